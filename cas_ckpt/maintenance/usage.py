"""Space accounting: logical bytes (as if nothing were shared) against bytes really stored, per
ref, per run (what deleting it would free) and for the whole repository.

Every figure is taken over the roots GC keeps (:func:`~cas_ckpt.maintenance.gc.root_entries`), so
``unreachable`` means here what it means to ``gc --dry-run``. One walk per owner of roots (a run,
or the pins) marks what it reaches; a block's owners are folded into one small int as the walks go
(the first owner, and whether another owner or a ref's data reached it too), so memory grows with
the number of live blocks (one dict entry each) plus one owner's walk, never with owners times
blocks.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from multiformats import CID

from cas_ckpt import cid as cidlib
from cas_ckpt import codec
from cas_ckpt.blocks.base import BlockStore
from cas_ckpt.codec import HistoryLink
from cas_ckpt.maintenance.gc import DEFAULT_REFLOG_EXPIRY, Root, root_entries
from cas_ckpt.maintenance.upkeep import UpkeepStatus
from cas_ckpt.maintenance.walk import Reach, child_links, walk
from cas_ckpt.refs import RefStore
from cas_ckpt.refs.base import run_of


@dataclass
class RefUsage:
    """One ref's checkpoint: its size if stored alone, and what it really occupies."""

    ref: str
    cid: CID
    logical_bytes: int
    stored_bytes: int
    blocks: int

    __repr__ = cidlib.readable_repr


@dataclass
class RunUsage:
    """A run (a ref and the ``<ref>.steps/N`` refs a CheckpointManager keeps beside it): what its
    refs hold, and what deleting it would free.

    ``stored_bytes``: the blocks its refs reach, each once; ``shared_bytes``: those of them that
    another root reaches too (another run's refs or reflog entries, a pin, a fork's history).
    ``exclusive_bytes``: what GC frees once the run's refs are deleted and its own reflog entries
    no longer count (``repo.gc(expire_reflogs=[run, run + ".steps/"])``, as its manager's GC
    does): the blocks its refs, its reflog entries younger than the expiry and their history reach
    and no other root does. It can exceed ``stored_bytes - shared_bytes`` by what only its reflog
    keeps (steps its retention expired in the last 30 days). A run that has no refs left but a
    reflog still holding checkpoints shows with ``refs == 0``.
    """

    run: str
    refs: int
    checkpoints: int
    logical_bytes: int
    stored_bytes: int
    shared_bytes: int
    exclusive_bytes: int


@dataclass
class Usage:
    """The whole repository. Blocks shared between refs count once in ``stored_bytes``, and each
    distinct checkpoint once in ``logical_bytes``. ``live_*``: what GC keeps (every ref, pin,
    reflog entry younger than ``reflog_expiry`` and the commit nodes of their history);
    ``unreachable_*`` is the rest, exactly what ``gc(dry_run=True)`` reports with that expiry;
    ``freeable_bytes`` the part of it a GC run now frees (the medium may keep young packs:
    ``held_bytes``, S3's ``min_grace``). All sizes are bytes on the medium (after compression)."""

    refs: list[RefUsage] = field(default_factory=list)
    runs: list[RunUsage] = field(default_factory=list)
    logical_bytes: int = 0
    stored_bytes: int = 0
    total_blocks: int = 0
    total_bytes: int = 0
    live_blocks: int = 0
    live_bytes: int = 0
    held_bytes: int = 0
    reflog_expiry: float = DEFAULT_REFLOG_EXPIRY
    upkeep: UpkeepStatus | None = None  # packs, index files, and what upkeep would do next

    @property
    def unreachable_blocks(self) -> int:
        return self.total_blocks - self.live_blocks

    @property
    def unreachable_bytes(self) -> int:
        return self.total_bytes - self.live_bytes

    @property
    def freeable_bytes(self) -> int:
        return self.unreachable_bytes - self.held_bytes

    @property
    def dedup_ratio(self) -> float:
        return self.logical_bytes / self.stored_bytes if self.stored_bytes else 1.0


def logical_size(store: BlockStore, root: bytes, memo: dict[bytes, int] | None = None) -> int:
    """Bytes of every block below ``root``, counted once per reference (no dedup)."""
    memo = {} if memo is None else memo
    if root in memo:
        return memo[root]
    total = store.size(root)
    if cidlib.is_node(root):
        node = codec.decode(store.get(root), cid=root)
        for link, _ in child_links(node):
            if not isinstance(link, HistoryLink):
                total += logical_size(store, link.cid, memo)
    memo[root] = total
    return total


# A block's owners in one int: bit 0, a ref's data (not only a reflog entry's or history);
# bit 1, more than one owner; the bits above, the first owner's number.
_REF_DATA, _SHARED, _OWNER_SHIFT = 1, 2, 2


def usage(blocks: BlockStore, refs: RefStore, *, reflog_expiry: float = DEFAULT_REFLOG_EXPIRY) -> Usage:
    """Logical and stored bytes per ref, per run and for the whole repository (see :class:`Usage`)."""
    blocks.refresh()
    result = Usage(reflog_expiry=reflog_expiry)
    by_owner: dict[str, list[Root]] = defaultdict(list)  # "" owns the pins: no run
    for root in root_entries(refs, reflog_expiry=reflog_expiry):
        by_owner["" if root.kind == "pin" else run_of(root.name)].append(root)
    names = sorted(by_owner)
    owners: dict[bytes, int] = {}
    memo: dict[bytes, int] = {}
    for number, name in enumerate(names):
        roots = by_owner[name]
        reach, ref_data = _walk_owner(blocks, roots, result, memo)
        for cid in reach.data | reach.lineage:
            flag = _REF_DATA if cid in ref_data else 0
            old = owners.get(cid)
            if old is None:
                owners[cid] = number << _OWNER_SHIFT | flag
            else:
                owners[cid] = old | flag | (_SHARED if old >> _OWNER_SHIFT != number else 0)
        if name:
            heads = {r.cid for r in roots if r.kind == "ref"}
            logical = sum(logical_size(blocks, h, memo) for h in heads if blocks.has(h))
            result.runs.append(RunUsage(name, sum(r.kind == "ref" for r in roots), len(heads), logical,
                                        _stored(blocks, ref_data), 0, 0))
    _settle(blocks, result, owners, names)
    keys = list(blocks.keys())
    result.total_blocks = len(keys)
    result.total_bytes = _stored(blocks, keys)
    live = blocks.marks()
    for cid in owners:
        live.add(cid)
    result.held_bytes = blocks.held_back(live).bytes
    result.refs.sort(key=lambda r: r.ref)
    # A checkpoint two refs hold (a manager's head and its .steps/N ref) is one checkpoint.
    result.logical_bytes = sum({bytes(r.cid): r.logical_bytes for r in result.refs}.values())
    return result


def _walk_owner(
    blocks: BlockStore, roots: list[Root], result: Usage, memo: dict[bytes, int]
) -> tuple[Reach, set[bytes]]:
    """What one owner's roots reach, and the data of its refs alone; each ref's own figures go
    into ``result.refs``."""
    reach = Reach()
    ref_data: set[bytes] = set()
    for root in roots:
        if root.kind != "ref":
            continue
        mine = walk(blocks, {root.cid: root.name})
        logical = logical_size(blocks, root.cid, memo) if blocks.has(root.cid) else 0
        result.refs.append(RefUsage(root.name, cidlib.to_cid(root.cid), logical,
                                    _stored(blocks, mine.data), len(mine.data)))
        ref_data |= mine.data
        reach.data |= mine.data
        reach.lineage |= mine.lineage
    walk(blocks, {r.cid: r.name for r in roots if r.kind == "pin"},
         weak={r.cid: r.name for r in roots if r.kind == "reflog"}, reach=reach)
    return reach, ref_data


def _settle(blocks: BlockStore, result: Usage, owners: dict[bytes, int], names: list[str]) -> None:
    """Shared, exclusive and repository totals from the owners of every live block."""
    runs = {run.run: run for run in result.runs}
    exclusive = [0] * len(names)
    exclusive_data = [0] * len(names)
    for cid, bits in owners.items():
        if not blocks.has(cid):
            continue  # needed but gone (an expired reflog entry's data, collected history)
        size = blocks.stored_size(cid)
        result.live_blocks += 1
        result.live_bytes += size
        if bits & _REF_DATA:
            result.stored_bytes += size
        if not bits & _SHARED:
            exclusive[bits >> _OWNER_SHIFT] += size
            if bits & _REF_DATA:
                exclusive_data[bits >> _OWNER_SHIFT] += size
    for number, name in enumerate(names):
        if name in runs:
            run = runs[name]
            run.exclusive_bytes = exclusive[number]
            run.shared_bytes = run.stored_bytes - exclusive_data[number]


def _stored(blocks: BlockStore, cids: Iterable[bytes]) -> int:
    """Bytes on the medium of the blocks among ``cids`` that are stored."""
    return sum(blocks.stored_size(c) for c in cids if blocks.has(c))
