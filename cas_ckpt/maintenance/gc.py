"""Garbage collection: keep what refs, pins and live reflog entries reach; remove the rest.

Refs and pins are strong roots: a block missing below one is damage, and GC refuses to sweep.
Reflog entries younger than the expiry (default 30 days, as git keeps unreachable entries) are weak
roots, both what an entry set and what it replaced (a deletion entry names what the deleted ref
held): GC keeps what they still reach, and a part an earlier GC removed is an expired record. A
``CheckpointManager`` collecting after its retention expires its own refs' reflogs only
(``expire_reflogs``): its policy decides what its run keeps, never what another ref's history names.
The reflog of a deleted ref is dropped once it roots nothing: every entry past the expiry, or its
ref governed by ``expire_reflogs``.

Safety with concurrent saves rests on two things (``docs/gc.md``):

1. the repository lock: every save holds it shared from its first dedup check until its ref has
   moved, and GC holds it exclusive from marking to sweeping, so a block a save is about to
   reference is never swept (on a local filesystem the kernel drops the lock of a killed process);
2. a grace period: blocks stored less than ``grace`` seconds ago survive even if unreachable, for
   media whose locks cannot be trusted (network filesystems).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from cas_ckpt import cid as cidlib
from cas_ckpt.blocks.base import BlockStore
from cas_ckpt.errors import RepositoryError
from cas_ckpt.maintenance.walk import Reach, walk
from cas_ckpt.refs import RefStore, check_ref_name


@dataclass
class GCReport:
    """What a collection found and did.

    Unreachable blocks are the stored ones no root reaches (refs, pins, reflog entries younger
    than the expiry, and the commit nodes of their history): what ``du`` calls unreachable too.
    Bytes are stored bytes, as the medium holds them (after compression). ``held_*``: what GC
    would have removed but left for a later run because the medium keeps young storage
    (``min_grace``, S3: an hour): the packs spared, and the unreachable blocks and bytes in them.
    """

    live_blocks: int
    lineage_blocks: int
    unreachable_blocks: int
    unreachable_bytes: int
    blocks_freed: int
    bytes_freed: int
    temp_files_removed: int
    dry_run: bool
    unreachable: list[str] = field(default_factory=list)
    held_packs: int = 0
    held_blocks: int = 0
    held_bytes: int = 0
    min_grace: float = 0.0
    reflogs_dropped: int = 0  # of deleted refs, rooting nothing any more


DEFAULT_REFLOG_EXPIRY = 30 * 86400.0
"""Reflog entries younger than this keep their checkpoints (git keeps unreachable entries 30 days)."""


@dataclass
class Roots:
    """What GC keeps: ``strong`` (refs, pins: a block missing below is damage) and ``weak``
    (reflog entries: kept as far as they are still there)."""

    strong: dict[bytes, str]
    weak: dict[bytes, str]


@dataclass(frozen=True)
class Root:
    """One thing GC keeps: a ref's CID, a pin, or the CID a reflog entry of ``name`` moved to."""

    cid: bytes
    name: str  # the ref (whose reflog it is, for a reflog entry); "pin" for a pin
    kind: str  # "ref", "pin" or "reflog"


def root_entries(
    refs: RefStore,
    *,
    reflog_expiry: float = DEFAULT_REFLOG_EXPIRY,
    expire_reflogs: Collection[str] = (),
) -> Iterator[Root]:
    """Every root, one per ref, pin and live reflog entry (the same CID may come several times):
    reflog entries newer than ``reflog_expiry`` s, except those of the refs ``expire_reflogs``
    names (see :func:`governs`). The one definition of what GC keeps, for GC and ``du``."""
    for name, value in refs.values().items():  # read at once (S3: in parallel)
        yield Root(value, name, "ref")
    for pin in refs.pins():
        yield Root(pin, "pin", "pin")
    if reflog_expiry > 0:
        cutoff = time.time() - reflog_expiry
        for name in refs.reflog_names():
            if governs(expire_reflogs, name):
                continue
            for entry in refs.reflog(name):
                if entry.time >= cutoff:  # the ref held both sides of it within the expiry
                    for cid in (entry.old, entry.new):
                        if cid is not None:
                            yield Root(cid, name, "reflog")


def roots(
    refs: RefStore,
    *,
    reflog_expiry: float = DEFAULT_REFLOG_EXPIRY,
    expire_reflogs: Collection[str] = (),
) -> Roots:
    """:func:`root_entries` as GC walks them: refs and pins strong, reflog entries weak."""
    found = list(root_entries(refs, reflog_expiry=reflog_expiry, expire_reflogs=expire_reflogs))
    strong: dict[bytes, str] = {}
    for root in found:
        if root.kind != "reflog":
            strong.setdefault(root.cid, root.name)
    weak: dict[bytes, str] = {}
    for root in found:
        if root.kind == "reflog" and root.cid not in strong:
            weak.setdefault(root.cid, f"reflog:{root.name}")
    return Roots(strong, weak)


def drop_dead_reflogs(
    refs: RefStore, *, reflog_expiry: float, expire_reflogs: Collection[str] = ()
) -> int:
    """Drop the reflogs of deleted refs that root nothing: every entry older than the expiry, or
    the ref governed by ``expire_reflogs``. Returns how many were dropped."""
    live = set(refs.names())
    cutoff = time.time() - reflog_expiry if reflog_expiry > 0 else math.inf
    dropped = 0
    for name in refs.reflog_names():
        if name not in live:
            dropped += refs.drop_reflog(name, older_than=None if governs(expire_reflogs, name) else cutoff)
    return dropped


def governs(names: Collection[str], ref: str) -> bool:
    """True if ``ref`` is one of ``names``, or below one of them that ends in ``/``."""
    return ref in names or any(n.endswith("/") and ref.startswith(n) for n in names)


def check_expire_reflogs(names: Iterable[str]) -> tuple[str, ...]:
    """``names`` checked as ref names (a trailing ``/`` allowed, for every ref below it)."""
    names = (names,) if isinstance(names, str) else tuple(names)
    for name in names:
        check_ref_name(name[:-1] if name.endswith("/") else name)
    return names


def collect(
    blocks: BlockStore,
    refs: RefStore,
    *,
    grace: float = 0.0,
    reflog_expiry: float = DEFAULT_REFLOG_EXPIRY,
    expire_reflogs: Iterable[str] = (),
    dry_run: bool = False,
    progress: Callable[[str, int], None] | None = None,
    commits: Callable[[bytes], Any] | None = None,
) -> GCReport:
    """Mark from every root, then sweep unreachable blocks older than ``grace`` seconds.

    ``expire_reflogs``: refs whose reflog entries are not roots, because a retention policy decides
    what they keep (a name ending in ``/`` covers every ref below it). ``commits``: stored commit
    nodes, decoded (their links at least), known without reading their blocks (from the commit
    graph's copies, checked against their CIDs), so marking lineage reads no block per commit.
    """
    expire = check_expire_reflogs(expire_reflogs)
    # A dry run removes nothing: a shared lock keeps another GC out and lets saves (and readers
    # on a read-only medium) go on; blocks a save adds meanwhile are young, as the grace spares.
    with refs.lock(exclusive=not dry_run):
        blocks.refresh()
        found = roots(refs, reflog_expiry=reflog_expiry, expire_reflogs=expire)
        keep = blocks.marks()  # the store's compact marks: no object per block
        reach: Reach = walk(
            blocks,
            found.strong,
            weak=found.weak,
            progress=(lambda n: progress("mark", n)) if progress else None,
            nodes=commits,
            marks=keep,
            where=False,
        )
        if reach.problems:
            first = next(iter(reach.problems.values()))
            raise RepositoryError(
                f"gc refused: {len(reach.problems)} reachable block(s) are missing or damaged "
                f"(e.g. {first.kind} {first.cid}, needed by {first.needed_by[0]}); sweeping now "
                "could delete data a repair would need. Run fsck."
            )
        live = blocks.count_kept(keep)
        history_only = [cid for cid in reach.lineage if cid not in keep]
        lineage = sum(1 for cid in history_only if blocks.has(cid))
        for cid in history_only:
            keep.add(cid)  # a commit only history reaches is kept, its data not
        dead, dead_bytes = blocks.unkept(keep)
        held = blocks.held_back(keep, min_age=grace)
        report = GCReport(
            live_blocks=live,
            lineage_blocks=lineage,
            unreachable_blocks=dead,
            unreachable_bytes=dead_bytes,
            blocks_freed=0,
            bytes_freed=0,
            temp_files_removed=0,
            dry_run=dry_run,
            held_packs=held.packs,
            held_blocks=held.blocks,
            held_bytes=held.bytes,
            min_grace=held.grace,
        )
        if dry_run:
            report.unreachable = sorted(cidlib.to_str(c) for c in blocks.unkept_cids(keep))
            return report
        if progress:
            progress("sweep", dead)
        report.blocks_freed, report.bytes_freed = blocks.sweep(
            keep, min_age=grace, before_unlink=refs.check_lease
        )
        report.temp_files_removed = blocks.clean_temp()
        report.reflogs_dropped = drop_dead_reflogs(refs, reflog_expiry=reflog_expiry,
                                                   expire_reflogs=expire)
        refs.prune_deleted()  # S3's tombstones of refs whose reflog is gone
        blocks.consolidate()  # one index file of what is left: the next open reads it, not each pack
        return report
