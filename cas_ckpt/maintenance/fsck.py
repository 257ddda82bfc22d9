"""Integrity check: every block re-hashed, every link from every ref resolved."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from cas_ckpt import cid as cidlib
from cas_ckpt.blocks.base import BlockStore
from cas_ckpt.errors import CasCkptError
from cas_ckpt.maintenance.walk import Problem, Reach, Where, walk
from cas_ckpt.refs import ReflogEntry, RefStore


@dataclass
class FsckReport:
    """Problems found; ``ok`` is True only when there are none."""

    blocks_checked: int = 0
    blocks_total: int = 0
    reachable_blocks: int = 0
    refs_checked: int = 0
    problems: list[Problem] = field(default_factory=list)
    store_problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems and not self.store_problems


def check(
    blocks: BlockStore,
    refs: RefStore,
    *,
    sample: float | None = None,
    seed: int | None = None,
    progress: Callable[[str, int, int], None] | None = None,
) -> FsckReport:
    """Check links reachable from refs and pins, and re-hash every block (or a ``sample`` share).

    Runs beside saves and GC without blocking them; only when the walk finds a problem does it
    walk again under the shared save lock, and it reports what that second walk still finds.
    """
    report = FsckReport()
    names = _names(refs, report)
    roots = _roots(refs, names, report)
    report.store_problems.extend(_reflog_problems(refs, names))
    blocks.refresh(full=True)  # after reading the refs: every block they reach was published before
    report.store_problems.extend(
        f"damaged {'index file' if name.endswith('.idx') else 'pack'} {name}: {why}"
        for name, why in blocks.check_storage().items()
    )
    reach = walk(blocks, roots, check_raw=True)
    if reach.problems:
        reach = _recheck(blocks, refs)
    report.reachable_blocks = len(reach.live)
    problems: dict[bytes, Problem] = dict(reach.problems)

    keys = list(blocks.keys())
    report.blocks_total = len(keys)
    if sample is not None and sample < 1.0:
        keys = random.Random(seed).sample(keys, max(1, int(len(keys) * sample)) if keys else 0)
    rehash = (lambda i, n: progress("rehash", i, n)) if progress is not None else None
    for cid, why in blocks.check_copies(keys, progress=rehash).items():  # every copy of each
        where = reach.where.get(cid)
        problem = problems.setdefault(cid, Problem(cidlib.to_str(cid), "corrupt", why))
        if where is not None and where not in problem.needed_by:
            problem.needed_by.append(where)
        if where is None:
            problem.needed_by.append(Where("unreferenced", ""))
    report.blocks_checked = len(keys)
    report.problems = sorted(problems.values(), key=lambda p: p.cid)
    return report


def _roots(refs: RefStore, names: list[str], report: FsckReport) -> dict[bytes, str]:
    """Refs and pins to walk from; what cannot be read goes to ``report.store_problems``."""
    roots: dict[bytes, str] = {}
    for name in names:
        try:
            value = refs.get(name)
        except CasCkptError as exc:
            report.store_problems.append(str(exc))
            continue
        report.refs_checked += 1
        if value is not None:
            roots.setdefault(value, name)
    try:
        for pin in refs.pins():
            roots.setdefault(pin, "pin")
    except CasCkptError as exc:
        report.store_problems.append(str(exc))
    return roots


def _recheck(blocks: BlockStore, refs: RefStore) -> Reach:
    """Walk again from the refs and pins of now, with GC kept out.

    A block the first walk missed may have been collected after a ref moved on, or sat in a pack
    GC rewrote while the index was read. Under the shared lock nothing is swept, and every block
    the refs read now reach was published before the refresh that follows: what is missing now is
    really missing. A read-only repository cannot take the lock (on S3 it is a write), so there
    the second walk only narrows the race.
    """
    lock = contextlib.nullcontext() if blocks.read_only else refs.lock(exclusive=False)
    with lock:
        unread = FsckReport()  # what cannot be read was reported by the first pass
        roots = _roots(refs, _names(refs, unread), unread)
        blocks.refresh()
        return walk(blocks, roots, check_raw=True)


def _reflog_problems(refs: RefStore, names: list[str]) -> list[str]:
    """Reflogs that cannot be read, and refs their reflog says are lost."""
    problems = []
    for name in names:
        try:
            refs.reflog(name)
        except CasCkptError as exc:
            problems.append(str(exc))
    return problems + _lost_refs(refs)


def _lost_refs(refs: RefStore) -> list[str]:
    """Refs whose reflog says they hold a checkpoint but that are gone (removed behind our back).

    A ref may lag its last entry by one update (a crash between the reflog append and the ref
    write), so only a ref matching neither the last entry's new nor its old value is reported.
    """
    lost = []
    try:
        names = refs.reflog_names()
    except CasCkptError:
        return []
    for name in names:
        try:
            found = _settled(refs, name)
        except CasCkptError:
            continue  # reported with the ref's other problems
        if found is None:
            continue
        current, last = found
        if current not in (last.new, last.old):
            held = cidlib.to_str(current) if current else "nothing"
            wanted = cidlib.to_str(last.new) if last.new else "nothing"
            lost.append(f"ref {name!r} holds {held} but its reflog says {wanted}")
    return lost


def _settled(refs: RefStore, name: str, tries: int = 5) -> tuple[bytes | None, ReflogEntry] | None:
    """The ref and its last reflog entry, read while the ref did not move; None if it has no
    entry, or kept moving (a ref being written is not lost).

    A writer appends to the reflog, then moves the ref; a delete removes the reflog, then the ref.
    Read apart, a moving ref would look lost; read between two equal reads of the ref, its last
    entry is one the ref's value agrees with (unless the ref moved away and back in between).
    """
    for _ in range(tries):
        before = refs.get(name)
        entries = refs.reflog(name)
        if refs.get(name) == before:
            return (before, entries[-1]) if entries else None
    return None


def _names(refs: RefStore, report: FsckReport) -> list[str]:
    try:
        return refs.names()
    except CasCkptError as exc:
        report.store_problems.append(str(exc))
        return []
