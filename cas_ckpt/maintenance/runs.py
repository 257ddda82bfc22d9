"""Storage by run: what each run's checkpoints occupy, what runs share, and what GC would free.

A run is a ref and the ``<ref>.steps/<step>`` refs a :class:`~cas_ckpt.CheckpointManager` keeps
beside it. The links of every node are decoded once into a :class:`LinkCache`, which stays valid
for ever (a CID names one content), so working the figures out again after a save reads only the
new nodes. Nothing is locked and nothing is written: the figures are those of the moment they
were read, and a save in flight counts as unreachable until its ref moves.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from multiformats import CID

from cas_ckpt import cid as cidlib
from cas_ckpt import codec
from cas_ckpt.blocks.base import BlockStore
from cas_ckpt.codec import HistoryLink
from cas_ckpt.errors import BlockNotFound, CasCkptError
from cas_ckpt.maintenance.gc import DEFAULT_REFLOG_EXPIRY, roots
from cas_ckpt.maintenance.walk import child_links
from cas_ckpt.refs import RefStore

STEPS = ".steps/"
MAX_PAIRS_RUNS = 64  # runs up to which every pair's shared bytes are worked out


def run_of(ref: str) -> str:
    """The run a ref belongs to: ``<run>.steps/<step>`` (a manager's retained step) is ``<run>``'s."""
    run, steps, step = ref.rpartition(STEPS)
    return run if steps and run and step.isdigit() else ref


@dataclass
class RunStorage:
    """One run: its refs, its head, and its bytes on the medium.

    ``stored_bytes``: every block its refs reach, once. ``exclusive_bytes``: those no other run
    reaches, which deleting the run (and a GC) would free unless a pin or a recent reflog entry
    keeps them. ``logical_bytes``: the head checkpoint's size if nothing were shared (as
    ``repo.stats()`` counts it).
    """

    run: str
    refs: list[str]
    head: CID | None
    logical_bytes: int
    stored_bytes: int
    exclusive_bytes: int
    blocks: int

    @property
    def shared_bytes(self) -> int:
        return self.stored_bytes - self.exclusive_bytes


@dataclass
class StorageReport:
    """Every run's storage, the bytes each pair of runs shares (when at most 64 runs), and the
    repository's totals: ``stored_bytes`` (what any ref reaches), ``total_bytes`` (every stored
    block) and ``gc_would_free_bytes`` (what no ref, pin, reflog entry newer than the expiry or
    history link keeps now: what ``repo.gc()`` would remove)."""

    runs: list[RunStorage] = field(default_factory=list)
    shared: list[tuple[str, str, int]] = field(default_factory=list)
    stored_bytes: int = 0
    total_bytes: int = 0
    total_blocks: int = 0
    gc_would_free_bytes: int = 0
    gc_would_free_blocks: int = 0


class LinkCache:
    """Each node's data links and history links, decoded once (bounded: emptied past ``limit``)."""

    def __init__(self, store: BlockStore, *, limit: int = 2_000_000) -> None:
        self.store = store
        self.limit = limit
        self._links: dict[bytes, tuple[tuple[bytes, ...], tuple[bytes, ...]]] = {}
        self._lock = threading.Lock()

    def links(self, cid: bytes) -> tuple[tuple[bytes, ...], tuple[bytes, ...]] | None:
        """(data links, history links) of node ``cid``; None where it is not stored."""
        found = self._links.get(cid)
        if found is not None:
            return found
        try:
            node = codec.decode(self.store.get(cid), cid=cid)
        except BlockNotFound:
            return None
        data, history = [], []
        for link, _ in child_links(node):
            (history if isinstance(link, HistoryLink) else data).append(link.cid)
        found = (tuple(data), tuple(history))
        with self._lock:
            if len(self._links) >= self.limit:
                self._links.clear()
            self._links[cid] = found
        return found

    def reach(self, start: Iterable[bytes]) -> set[bytes]:
        """Every stored block ``start`` reaches through data links (missing blocks left out)."""
        seen: set[bytes] = set()
        stack = list(start)
        while stack:
            cid = stack.pop()
            if cid in seen:
                continue
            if not cidlib.is_node(cid):
                if self.store.has(cid):
                    seen.add(cid)
                continue
            links = self.links(cid)
            if links is None:
                continue
            seen.add(cid)
            stack.extend(c for c in links[0] if c not in seen)
        return seen

    def lineage(self, reached: Iterable[bytes]) -> set[bytes]:
        """The commit nodes history links lead to from ``reached`` (GC keeps them, not their data)."""
        seen: set[bytes] = set()
        stack = [parent for cid in reached if cidlib.is_node(cid)
                 for parent in (self.links(cid) or ((), ()))[1]]
        while stack:
            cid = stack.pop()
            if cid in seen:
                continue
            links = self.links(cid)
            if links is None:
                continue
            seen.add(cid)
            stack.extend(links[1])
        return seen

    def logical_size(self, root: bytes, memo: dict[bytes, int]) -> int:
        """Bytes of every block below ``root``, once per reference (as if nothing were shared)."""
        total = memo.get(root)
        if total is not None:
            return total
        try:
            total = self.store.size(root)
        except BlockNotFound:
            total = 0
        links = self.links(root) if cidlib.is_node(root) else None
        for child in links[0] if links else ():
            total += self.logical_size(child, memo)
        memo[root] = total
        return total


def storage(
    blocks: BlockStore, refs: RefStore, *, cache: LinkCache | None = None,
    reflog_expiry: float = DEFAULT_REFLOG_EXPIRY,
) -> StorageReport:
    """Bytes per run, shared between runs, and what GC would free now (see :class:`StorageReport`)."""
    cache = cache or LinkCache(blocks)
    blocks.refresh()
    heads: dict[str, bytes] = {}
    for name in refs.names():
        value = refs.get(name)
        if value is not None:
            heads[name] = value
    members: dict[str, list[str]] = {}
    for name in sorted(heads):
        members.setdefault(run_of(name), []).append(name)
    runs = sorted(members)
    owners: dict[bytes, int] = {}
    for i, run in enumerate(runs):
        for cid in cache.reach(heads[name] for name in members[run]):
            owners[cid] = owners.get(cid, 0) | (1 << i)
    size = _sizes(blocks)
    by_owners: Counter[int] = Counter()
    count_by_owners: Counter[int] = Counter()
    for cid, mask in owners.items():
        by_owners[mask] += size(cid)
        count_by_owners[mask] += 1
    report = StorageReport(stored_bytes=sum(by_owners.values()))
    logical: dict[bytes, int] = {}
    for i, run in enumerate(runs):
        bit = 1 << i
        head = heads.get(run)
        report.runs.append(RunStorage(
            run=run, refs=members[run], head=cidlib.to_cid(head) if head else None,
            logical_bytes=cache.logical_size(head, logical) if head else 0,
            stored_bytes=sum(b for m, b in by_owners.items() if m & bit),
            exclusive_bytes=by_owners.get(bit, 0),
            blocks=sum(n for m, n in count_by_owners.items() if m & bit),
        ))
    if len(runs) <= MAX_PAIRS_RUNS:
        report.shared = _pairs(runs, by_owners)
    found = roots(refs, reflog_expiry=reflog_expiry)
    live = cache.reach([*found.strong, *found.weak])
    live |= cache.lineage(live)
    stored = list(blocks.keys())
    report.total_blocks = len(stored)
    report.total_bytes = sum(map(size, stored))
    dead = [cid for cid in stored if cid not in live]
    report.gc_would_free_blocks = len(dead)
    report.gc_would_free_bytes = sum(map(size, dead))
    return report


def _sizes(blocks: BlockStore) -> Callable[[bytes], int]:
    def size(cid: bytes) -> int:
        try:
            return blocks.stored_size(cid)
        except CasCkptError:  # gone meanwhile (a GC): it occupies nothing now
            return 0

    return size


def _pairs(runs: list[str], by_owners: Counter[int]) -> list[tuple[str, str, int]]:
    shared: Counter[tuple[int, int]] = Counter()
    for mask, nbytes in by_owners.items():
        members = [i for i in range(len(runs)) if mask >> i & 1]
        for x, i in enumerate(members):
            for j in members[x + 1:]:
                shared[i, j] += nbytes
    return [(runs[i], runs[j], n) for (i, j), n in sorted(shared.items(), key=lambda kv: -kv[1]) if n]
