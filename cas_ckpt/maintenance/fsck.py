"""Integrity check: every block re-hashed, every link from every ref resolved."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from cas_ckpt import cid as cidlib
from cas_ckpt.blocks.base import BlockStore
from cas_ckpt.errors import CasCkptError
from cas_ckpt.maintenance.walk import Problem, Where, walk
from cas_ckpt.refs import RefStore


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
    """Check links reachable from refs and pins, and re-hash every block (or a ``sample`` share)."""
    report = FsckReport()
    blocks.refresh()
    report.store_problems.extend(f"damaged pack {name}: {why}" for name, why in blocks.damaged().items())
    roots: dict[bytes, str] = {}
    for name in _names(refs, report):
        try:
            value = refs.get(name)
        except CasCkptError as exc:
            report.store_problems.append(str(exc))
            continue
        report.refs_checked += 1
        if value is not None:
            roots.setdefault(value, name)
        try:
            refs.reflog(name)
        except CasCkptError as exc:
            report.store_problems.append(str(exc))
    report.store_problems.extend(_lost_refs(refs))
    try:
        for pin in refs.pins():
            roots.setdefault(pin, "pin")
    except CasCkptError as exc:
        report.store_problems.append(str(exc))
    reach = walk(blocks, roots, check_raw=True)
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
            entries = refs.reflog(name)
            if not entries:
                continue
            current = refs.get(name)
        except CasCkptError:
            continue  # reported with the ref's other problems
        last = entries[-1]
        if current not in (last.new, last.old):
            held = cidlib.to_str(current) if current else "nothing"
            wanted = cidlib.to_str(last.new) if last.new else "nothing"
            lost.append(f"ref {name!r} holds {held} but its reflog says {wanted}")
    return lost


def _names(refs: RefStore, report: FsckReport) -> list[str]:
    try:
        return refs.names()
    except CasCkptError as exc:
        report.store_problems.append(str(exc))
        return []
