"""Replication: move checkpoints between two repositories, sending only the blocks the other lacks.

Content addressing makes this cheap: a block the destination's index already has is the same
block, so a transfer walks the checkpoint's DAG on the source, asks the destination ``has`` for
each block, and copies only the missing ones, read in parallel and written through the
destination's own writer (so they land in packs sized for that medium). The order is the
repository's write order, on the destination:

1. inside ``dst.transaction(verify_incoming=True)`` (its save lock held shared: its GC cannot
   sweep a block the transfer counted on), every missing block is copied; the destination's writer
   hashes each before writing it, whatever the source's ``verify`` setting, and a block whose bytes
   do not match is read again from the source, which tries each of its copies (a source with no
   intact copy fails the transfer with :class:`CorruptBlock`, nothing moved);
2. the batch commits: every block is durable there;
3. only then are the transfer's pins set (a clone's, a pinned fetch's), and then each
   destination ref moves, by compare-and-swap from the value it held when the transfer started.
   A ref that moved meanwhile is a :class:`RefConflict`; one that holds a commit the source's
   history does not contain is a :class:`RefDiverged`, raised before anything is sent, unless
   ``force``.

Packs the writer published before a crash stay on the destination, unreferenced: a re-run finds
their blocks in the index and sends only what is still missing. Nothing half-sent is referenced.

What travels with a ref: the data of the commit it names (its tree, everything strongly linked),
and the commit nodes of its history (lineage, followed through history links until a commit the
destination already has or the source no longer has). The data of older commits travels only with
a ref that names it (a ``<ref>.steps/N`` ref, as :func:`cas_ckpt.clone` and the two-tier
CheckpointManager send); expired commits' data never does.

This module works on any two repositories through their block and ref stores and
``transaction()``; it knows nothing of media.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

from multiformats import CID

from cas_ckpt import cid as cidlib
from cas_ckpt import codec
from cas_ckpt.blocks.base import BlockStore, BlockWriter, Stored
from cas_ckpt.codec import HistoryLink, Link
from cas_ckpt.commit import is_commit
from cas_ckpt.errors import BlockNotFound, CorruptBlock, RefDiverged
from cas_ckpt.history import History
from cas_ckpt.maintenance.walk import child_links, float_chunks
from cas_ckpt.refs import RefStore, check_ref_name

BATCH_BYTES = 32 * 1024 * 1024  # read this much from the source at once, in parallel
BATCH_BLOCKS = 512

Progress = Callable[[int, int, int, int], None]  # blocks sent, bytes sent, blocks to send, bytes to send


class Source(Protocol):
    """What a transfer reads from: blocks (a repository, or an IPFS gateway's, for ``fetch``)."""

    blocks: BlockStore
    location: str
    history: History | None  # commits through the source's commit graph (None: a gateway has none)

    @property
    def pool(self) -> Executor: ...


class Side(Source, Protocol):
    """What a transfer needs of a repository (:class:`cas_ckpt.Repository` is one)."""

    refs_store: RefStore

    def transaction(
        self, *, verify_existing: bool = False, verify_incoming: bool = False
    ) -> contextlib.AbstractContextManager[Any]: ...


@dataclass
class Gateway:
    """Blocks only, from an IPFS trustless gateway: the source of ``Repository.fetch``."""

    blocks: BlockStore
    location: str
    pool: Executor
    history: None = None


@dataclass(frozen=True)
class Update:
    """Move destination ref ``ref`` to source commit ``new``.

    Without ``force`` the destination's value must be absent, equal, or an ancestor of ``new`` in
    the source's history. ``force`` skips that check; ``expect`` (a 1-tuple) then gives the value
    the ref must still hold (None: must not exist), else it moves from whatever it holds.
    """

    ref: str
    new: bytes
    force: bool = False
    expect: tuple[bytes | None] | None = None


@dataclass
class TransferReport:
    """What a push, pull or clone did: refs moved and the blocks sent and skipped."""

    source: str
    destination: str
    refs: dict[str, CID] = field(default_factory=dict)  # destination ref -> the CID it holds now
    previous: dict[str, CID | None] = field(default_factory=dict)  # what it held before
    blocks_sent: int = 0
    bytes_sent: int = 0
    blocks_skipped: int = 0  # blocks the destination already had
    bytes_skipped: int = 0
    commits_sent: int = 0  # history (commit nodes of older checkpoints), counted in blocks_sent
    seconds: float = 0.0

    __repr__ = cidlib.readable_repr

    @property
    def up_to_date(self) -> bool:
        """True if nothing was sent and no ref moved."""
        return self.blocks_sent == 0 and all(
            self.previous.get(ref) == cid for ref, cid in self.refs.items()
        )


def transfer(
    src: Source,
    dst: Side,
    updates: list[Update],
    *,
    progress: Progress | None = None,
    verify_existing: bool = False,
    roots: list[bytes] | tuple[bytes, ...] = (),
    pin: bool = False,
) -> TransferReport:
    """Copy what ``updates`` need from ``src`` to ``dst`` and move the destination refs.

    ``verify_existing``: re-hash each block the destination already has; a damaged copy counts as
    missing and is replaced (a pull that repairs). ``roots``: further checkpoints whose data is
    sent without a ref; ``pin``: pin them at the destination once every block is durable, before
    any ref moves (a clone's pins, a pinned fetch).
    See the module docstring for the order.
    """
    started = time.perf_counter()
    report = TransferReport(src.location or repr(src), dst.location or repr(dst))
    for update in updates:
        check_ref_name(update.ref)
    src.blocks.refresh()
    with dst.transaction(verify_existing=verify_existing, verify_incoming=True) as txn:
        writer: BlockWriter = txn.blocks
        olds = {u.ref: dst.refs_store.get(u.ref) for u in updates}
        nodes = _NodeCache(src)
        for update in updates:  # before anything is sent: a rejected push sends nothing
            old = olds[update.ref]
            if not update.force and old is not None and old != update.new \
                    and not _descends(nodes, update.new, old):
                raise RefDiverged(update.ref, report.destination, cidlib.to_str(old),
                                  cidlib.to_str(update.new))
        # skipped blocks are sized where that is cheap: the same CID is the same bytes on both sides
        sizes = dst.blocks.sizes if dst.blocks.sizes_known else src.blocks.sizes
        plan = _plan(nodes, [u.new for u in updates] + list(roots), writer, sizes)
        report.blocks_skipped, report.bytes_skipped = plan.skipped_blocks, plan.skipped_bytes
        report.commits_sent = plan.commits
        floats: dict[bytes, int] = {}  # chunks of float arrays, for a compressing destination
        if writer.compresses:
            for node in nodes.decoded.values():
                floats.update(float_chunks(node))
        _send(src, plan.send, writer, report, progress, floats)
        if pin:
            for root in roots:
                txn.pin(root)
        for update in updates:
            if update.force:
                old = update.expect[0] if update.expect else dst.refs_store.get(update.ref)
            else:
                old = olds[update.ref]
            report.previous[update.ref] = cidlib.to_cid(old) if old else None
            report.refs[update.ref] = cidlib.to_cid(update.new)
            if old != update.new:
                txn.move_ref(update.ref, old, update.new, f"replicate from {report.source}")
    report.seconds = time.perf_counter() - started
    return report


def descends(repo: Side, new: bytes, old: bytes) -> bool:
    """True if commit ``old`` is ``new`` or one of its ancestors in ``repo``'s history."""
    return _descends(_NodeCache(repo), new, old)


class _NodeCache:
    """Decoded source nodes, each read once (the ancestry check and the plan share them); history
    commits from the source's commit graph where it holds them."""

    def __init__(self, side: Source) -> None:
        self.blocks = side.blocks
        self.lookup = side.history.lookup() if side.history is not None else None
        self.decoded: dict[bytes, Any] = {}

    def get(self, cid: bytes) -> Any:
        if cid not in self.decoded:  # verified whatever the source's setting: the plan follows it
            data = self.lookup(cid) if self.lookup is not None else None
            if data is None or not cidlib.matches(cid, data):
                data = self.blocks.get(cid, verify=True)
            self.decoded[cid] = codec.decode(data, cid=cid)
        return self.decoded[cid]

    def parents(self, cid: bytes) -> list[bytes]:
        """The parents of commit ``cid`` ([] for a node that is not a commit); BlockNotFound if
        the source no longer has it."""
        node = self.get(cid)
        if not is_commit(node):
            return []
        return [link.cid for link, _ in child_links(node) if isinstance(link, HistoryLink)]


def _descends(nodes: _NodeCache, new: bytes, old: bytes) -> bool:
    """True if ``old`` is ``new`` or one of its ancestors in the source's history."""
    seen: set[bytes] = set()
    stack = [new]
    while stack:
        cid = stack.pop()
        if cid == old:
            return True
        if cid in seen:
            continue
        seen.add(cid)
        with contextlib.suppress(BlockNotFound):  # history collected on the source: stop there
            stack.extend(nodes.parents(cid))
    return False


@dataclass
class _Plan:
    send: list[tuple[bytes, int]] = field(default_factory=list)  # (cid, size) in write order
    skipped_blocks: int = 0
    skipped_bytes: int = 0
    commits: int = 0


def _plan(
    nodes: _NodeCache, heads: list[bytes], writer: BlockWriter, sizes: Callable[[list[bytes]], list[int]]
) -> _Plan:
    """The blocks the destination lacks: the heads' data, children before parents (an array's
    chunks in order, back to back), then their history's commit nodes, oldest first.

    The destination is asked about the heads' data all at once (``writer.has_many``: a remote
    one in a few requests); ``sizes`` sizes the blocks it has, and the source sizes the others
    all at once (a remote source answers them in parallel)."""
    plan = _Plan()
    planned: set[bytes] = set()
    data = [cid for head in heads for cid in _post_order(nodes, head, planned)]
    present = writer.has_many(data)
    skipped = [cid for cid, here in zip(data, present, strict=True) if here]
    missing = [cid for cid, here in zip(data, present, strict=True) if not here]
    for head in heads:
        for cid in _history(nodes, head, planned, writer.has):
            planned.add(cid)
            plan.commits += 1
            if writer.has(cid):
                skipped.append(cid)
            else:
                missing.append(cid)
    plan.skipped_blocks, plan.skipped_bytes = len(skipped), sum(sizes(skipped))
    plan.send = list(zip(missing, nodes.blocks.sizes(missing), strict=True))
    return plan


def _post_order(nodes: _NodeCache, root: bytes, done: set[bytes]) -> Iterator[bytes]:
    """Blocks strongly reachable from ``root``, not in ``done``, each after its children (and
    added to ``done`` as it is given)."""
    seen: set[bytes] = set()
    stack: list[tuple[bytes, bool]] = [(root, False)]
    while stack:
        cid, expanded = stack.pop()
        if expanded:
            done.add(cid)
            yield cid
            continue
        if cid in seen or cid in done:
            continue
        seen.add(cid)
        stack.append((cid, True))
        if cidlib.is_node(cid):
            children = [link.cid for link, _ in child_links(nodes.get(cid)) if type(link) is Link]
            stack.extend((child, False) for child in reversed(children))


def _history(
    nodes: _NodeCache, head: bytes, done: set[bytes], has: Callable[[bytes], bool]
) -> list[bytes]:
    """Commit nodes of ``head``'s history to send, oldest first: followed until a commit the
    destination has (its history is there as far as it goes) or the source lacks (collected)."""
    found: list[bytes] = []
    seen: set[bytes] = set()
    stack = [head]
    while stack:
        cid = stack.pop()
        try:
            parents = nodes.parents(cid)
        except BlockNotFound:
            continue
        for parent in parents:
            if parent in seen or parent in done or has(parent) or not nodes.blocks.has(parent):
                continue
            seen.add(parent)
            found.append(parent)
            stack.append(parent)
    found.reverse()
    return found


def _batches(blocks: list[tuple[bytes, int]]) -> Iterator[list[tuple[bytes, int]]]:
    batch: list[tuple[bytes, int]] = []
    size = 0
    for item in blocks:
        if batch and (size + item[1] > BATCH_BYTES or len(batch) >= BATCH_BLOCKS):
            yield batch
            batch, size = [], 0
        batch.append(item)
        size += item[1]
    if batch:
        yield batch


def _send(
    src: Source, blocks: list[tuple[bytes, int]], writer: BlockWriter, report: TransferReport,
    progress: Progress | None, floats: dict[bytes, int],
) -> None:
    """Copy ``blocks`` into ``writer``: each batch read in parallel (and encoded for a compressing
    destination, ``floats`` giving float chunks' element sizes) while the previous one is written.

    The reads are not hashed: the writer (``verify_incoming``) hashes what it receives. A block it
    refuses is read again with the source's every copy tried (:class:`CorruptBlock` if none is
    intact)."""
    total_blocks, total_bytes = len(blocks), sum(size for _, size in blocks)
    if progress is not None:
        progress(0, 0, total_blocks, total_bytes)

    def read(batch: list[tuple[bytes, int]]) -> tuple[memoryview, list[Stored | None]]:
        # A fresh buffer per batch: a writer may keep a view of what it was given until it seals.
        out = memoryview(bytearray(sum(size for _, size in batch)))
        src.blocks.get_many_into([c for c, _ in batch], [s for _, s in batch], out, src.pool,
                                 verify=False)
        if not writer.compresses:
            return out, [None] * len(batch)
        starts = list(itertools.accumulate((size for _, size in batch), initial=0))

        def encode(i: int) -> Stored | None:
            cid = batch[i][0]
            return writer.encode(cid, out[starts[i] : starts[i + 1]], floats.get(cid, 0))

        return out, list(src.pool.map(encode, range(len(batch))))

    with ThreadPoolExecutor(1, thread_name_prefix="cas_ckpt-fetch") as fetcher:
        batches = iter(_batches(blocks))
        pending: Future[tuple[memoryview, list[Stored | None]]] | None = None
        current = next(batches, None)
        if current is not None:
            pending = fetcher.submit(read, current)
        while current is not None and pending is not None:
            data, encoded = pending.result()
            following = next(batches, None)
            pending = fetcher.submit(read, following) if following is not None else None
            _write_batch(src, writer, current, data, encoded)
            report.blocks_sent += len(current)
            report.bytes_sent += sum(size for _, size in current)
            if progress is not None:
                progress(report.blocks_sent, report.bytes_sent, total_blocks, total_bytes)
            current = following


def _write_batch(
    src: Source, writer: BlockWriter, batch: list[tuple[bytes, int]], data: memoryview,
    encoded: list[Stored | None],
) -> None:
    """Put one batch read from ``src`` (``data``: its blocks back to back); a block the writer
    refuses as damaged is replaced by a copy the source verifies, and the batch put again."""
    starts = list(itertools.accumulate((size for _, size in batch), initial=0))
    blocks: list[tuple[bytes, Any, Stored | None]] = [
        (cid, data[starts[i] : starts[i + 1]], encoded[i]) for i, (cid, _) in enumerate(batch)]
    position = {cid: i for i, (cid, _) in enumerate(batch)}
    refetched: set[int] = set()
    while True:
        try:
            writer.put_many(blocks)
            return
        except CorruptBlock as exc:
            i = position.get(cidlib.to_bytes(exc.cid))
            if i is None or i in refetched:  # not one of ours, or the source verified it: a bug
                raise
            refetched.add(i)
            cid = blocks[i][0]
            # Each copy tried, and hashed: CorruptBlock here when the source has none intact.
            blocks[i] = (cid, memoryview(src.blocks.get(cid, verify=True)), None)
