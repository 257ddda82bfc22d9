"""Upkeep, as ``git gc --auto``: after a save, whatever has passed its threshold is tidied.

A repository written to for weeks piles up small packs (one per small save) and packs no index
file covers yet (each a read at every open, a request on S3). Upkeep merges the small packs and
writes a fresh snapshot of the index (:meth:`~cas_ckpt.blocks.PackedBlockStore.consolidate`), so
that an open, a save and a read cost the same after ten thousand saves as after ten. It also
brings the commit graph up to date where history no layer holds is stored (a repository 0.2 wrote,
or a damaged layer), so that ``log`` and retention read a few files, not a block per commit.
First, it sets aside what stands where an index file or a layer belongs and is no readable file at
all (a directory, a FIFO, a link: no delete removes it, so it would trip every save), and the
tasks after it rebuild what that held.

Each job is a :class:`Task`: a name, :meth:`Task.due` (judged from what the process already
knows, without a request) and :meth:`Task.run`. :data:`TASKS` holds them in the order they run;
:func:`register` adds one. A run takes the save
lock shared, as a save does (GC waits for it; it deletes nothing a save could count on: a merged
pack's blocks are all in the new pack first), and a lock of its own, ``"upkeep"``, taken only if
free: one upkeep at a time per repository, and a save whose upkeep finds another one running
simply goes on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Protocol

from cas_ckpt.blocks.base import BlockStore, Layout
from cas_ckpt.history import History
from cas_ckpt.refs import RefStore

_log = logging.getLogger("cas_ckpt")

SMALL_PACKS = 32  # merge once this many packs are small (git's gc.autoPackLimit is 50)
UNCOVERED = 16  # snapshot once an open reads this many packs' own indexes besides the snapshot
UNCOVERED_REMOTE = 8  # ...or this many journals, where each is a request (S3)
# ...or this many block copies outside the snapshot (an eighth of those in it, if more): one big
# save (a 70B model's is ~700,000 chunks) leaves the next open the snapshot to read, not rows to
# sort, and a repository of N blocks is rewritten about once per N/8 new ones.
UNCOVERED_ROWS = 100_000


@dataclass(frozen=True)
class Policy:
    """When upkeep runs by itself: ``auto`` after each save, and the thresholds (0: never)."""

    auto: bool = True
    small_packs: int = SMALL_PACKS
    uncovered: int | None = None  # None: UNCOVERED, or UNCOVERED_REMOTE where listing costs requests
    uncovered_rows: int | None = None  # None: UNCOVERED_ROWS

    @classmethod
    def of(cls, setting: bool | Mapping[str, object] | Policy | None) -> Policy:
        """A policy from ``open(upkeep=...)``: a bool (on or off), or a mapping of the fields."""
        if isinstance(setting, Policy):
            return setting
        if setting is None or isinstance(setting, bool):
            return cls(auto=setting is not False)
        known = {f.name for f in fields(cls)}
        unknown = set(setting) - known
        if unknown:
            raise ValueError(f"unknown upkeep setting(s) {sorted(unknown)}; known: {sorted(known)}")
        for name, value in setting.items():
            if name != "auto" and not (value is None or (type(value) is int and value >= 0)):
                raise ValueError(f"upkeep setting {name!r} must be a count (0: never), not {value!r}")
        return cls(**setting)  # type: ignore[arg-type]


@dataclass
class Context:
    """What a task works on, and what it reports."""

    blocks: BlockStore
    refs: RefStore
    policy: Policy
    layout: Layout
    report: UpkeepReport
    history: History | None = None  # the repository's commits; None: no commit-graph task


class Task(Protocol):
    """One upkeep job."""

    name: str

    def due(self, context: Context) -> bool:
        """Whether it should run now (from what this process knows: no request)."""

    def run(self, context: Context) -> None:
        """Do it, adding to ``context.report``."""


@dataclass
class UpkeepReport:
    """What one upkeep did."""

    ran: list[str] = field(default_factory=list)  # the tasks that ran, in order
    skipped: str | None = None  # why nothing ran, when another upkeep held the lock
    packs_merged: int = 0
    packs_written: int = 0
    bytes_copied: int = 0
    snapshot: str | None = None  # the index snapshot written
    commits_added: int = 0  # commits taken into the commit graph
    set_aside: dict[str, str] = field(default_factory=dict)  # damaged entry -> where it was moved
    seconds: float = 0.0


@dataclass
class UpkeepStatus:
    """Where a repository stands: what ``stats`` shows and upkeep decides from."""

    auto: bool
    packs: int
    small_packs: int
    pack_bytes: int
    snapshot: str | None  # the newest index snapshot this process knows
    uncovered: int  # packs' own indexes (or journals) an open reads besides the snapshot
    damaged_indexes: int
    due: list[str]  # the tasks the next upkeep would run
    uncovered_rows: int = 0  # the block copies those hold


class SetAsideDamaged:
    """Move index files and commit-graph layers found damaged that are no readable file at all
    (a directory, a FIFO, a link, an unreadable file) out of the way, each renamed to
    ``<name>.damaged-<time>`` beside it (:meth:`~cas_ckpt.backends.base.Backend.set_aside`); the
    tasks after it rebuild what they held."""

    name = "set-aside-damaged"

    def due(self, context: Context) -> bool:
        graph = context.history.graph if context.history is not None else None
        found = context.layout.unreadable_indexes > 0 or (graph is not None and graph.misplaced)
        return found and not context.blocks.read_only

    def run(self, context: Context) -> None:
        moved = context.blocks.set_aside_damaged()
        if context.history is not None:
            moved.update(context.history.set_aside_damaged())
        for where, aside in moved.items():
            # Once: the entry is gone from its place, and no later save reads it.
            _log.warning("upkeep set %s aside as %s: it is no readable file; what it held is rebuilt",
                         where, aside)
        context.report.set_aside.update(moved)


class MergeSmallPacks:
    """Merge the small packs once there are ``policy.small_packs`` of them."""

    name = "merge-small-packs"

    def due(self, context: Context) -> bool:
        limit = context.policy.small_packs
        return bool(limit) and context.layout.small_packs >= max(limit, 2)

    def run(self, context: Context) -> None:
        merged, written, copied = context.blocks.merge_small()  # type: ignore[attr-defined]
        context.report.packs_merged += merged
        context.report.packs_written += written
        context.report.bytes_copied += copied


class ConsolidateIndex:
    """Write an index snapshot once opens read ``policy.uncovered`` files besides the last one,
    or ``policy.uncovered_rows`` block copies (an eighth of the snapshot's, if more), when none
    exists yet (a new repository, or one 0.2 wrote), or when one was found damaged."""

    name = "consolidate-index"

    def due(self, context: Context) -> bool:
        layout = context.layout
        if not layout.indexed:
            return False
        if layout.snapshot is None:
            return layout.packs > 0
        rows = UNCOVERED_ROWS if context.policy.uncovered_rows is None else context.policy.uncovered_rows
        covered = layout.blocks - layout.uncovered_rows
        return layout.damaged_indexes > 0 or layout.uncovered >= max(uncovered_limit(context), 1) \
            or bool(rows and layout.uncovered_rows >= max(rows, covered // 8, 1))

    def run(self, context: Context) -> None:
        context.report.snapshot = context.blocks.consolidate()


def uncovered_limit(context: Context) -> int:
    if context.policy.uncovered is not None:
        return context.policy.uncovered or 2**62
    cheap = getattr(context.blocks, "backend", None)
    return UNCOVERED if getattr(cheap, "cheap_listing", True) else UNCOVERED_REMOTE


class UpdateCommitGraph:
    """Take the stored history no commit-graph layer holds into the graph, and rewrite what a
    damaged layer held (:meth:`~cas_ckpt.history.History.update`). Saves add their own commits;
    this catches up with history they do not walk to (a repository 0.2 wrote)."""

    name = "update-commit-graph"

    def due(self, context: Context) -> bool:
        return context.history is not None and context.history.behind()

    def run(self, context: Context) -> None:
        assert context.history is not None
        context.report.commits_added += context.history.update(context.refs).commits_added


TASKS: list[Task] = [SetAsideDamaged(), MergeSmallPacks(), ConsolidateIndex(), UpdateCommitGraph()]


def register(task: Task, *, before: str | None = None) -> None:
    """Add a task (before the one named ``before``, else last); its name must be new."""
    if any(t.name == task.name for t in TASKS):
        raise ValueError(f"an upkeep task named {task.name!r} exists")
    at = next((i for i, t in enumerate(TASKS) if t.name == before), len(TASKS))
    TASKS.insert(at, task)


def status(
    blocks: BlockStore, refs: RefStore, policy: Policy, history: History | None = None
) -> UpkeepStatus | None:
    """Where the repository stands (None for a store without packs)."""
    layout = blocks.layout()
    if layout is None:
        return None
    context = Context(blocks, refs, policy, layout, UpkeepReport(), history)
    return UpkeepStatus(
        auto=policy.auto, packs=layout.packs, small_packs=layout.small_packs, pack_bytes=layout.bytes,
        snapshot=layout.snapshot, uncovered=layout.uncovered, damaged_indexes=layout.damaged_indexes,
        due=[task.name for task in TASKS if task.due(context)], uncovered_rows=layout.uncovered_rows,
    )


def due(blocks: BlockStore, refs: RefStore, policy: Policy, history: History | None = None) -> bool:
    """Whether any task is due (cheap: what this process knows)."""
    found = status(blocks, refs, policy, history)
    return found is not None and bool(found.due)


def run(
    blocks: BlockStore, refs: RefStore, policy: Policy, history: History | None = None, *,
    force: bool = False,
) -> UpkeepReport:
    """Run every task that is due (every task, with ``force``), one upkeep at a time per
    repository; a run that finds another in progress does nothing and says so."""
    started = time.perf_counter()
    report = UpkeepReport()
    with refs.lock(exclusive=False), refs.try_exclusive("upkeep") as mine:
        if not mine:
            report.skipped = "another upkeep of this repository is running"
            return report
        blocks.refresh()
        if history is not None:
            history.refresh()  # a damaged layer is known once listed (set-aside, the graph's update)
        for task in list(TASKS):
            layout = blocks.layout()
            if layout is None:
                break
            context = Context(blocks, refs, policy, layout, report, history)
            if force or task.due(context):
                task.run(context)
                report.ran.append(task.name)
    report.seconds = time.perf_counter() - started
    return report
