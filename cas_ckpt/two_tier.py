"""The tiered CheckpointManager's parts: retention rules, the background replicators, recovery.

A manager with ``replicate_to`` saves to its (fast, local: a disk, or RAM as a tmpfs folder)
repository first; the training loop waits only for that. A :class:`Replicator` thread per tier
(a peer's ``cas-ckpt serve``, a disk, object storage) then pushes each due checkpoint there: its
step ref and the run's ref, in one transfer that sends only the blocks the tier lacks
(:mod:`cas_ckpt.replication`), then applies the tier's own retention. Tiers never wait for each
other. A failed push is logged, counted in :attr:`Replicator.lag` and retried with backoff;
nothing is dropped: :meth:`Replicator.wait` raises :class:`ReplicationFailed` if it cannot catch
up. :func:`recover` brings a new manager's run up to the newest step any tier holds, from the
first tier in list order that holds it.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

from cas_ckpt import cid as cidlib
from cas_ckpt.errors import CasCkptError, RefConflict, ReplicationFailed
from cas_ckpt.refs import RefStore
from cas_ckpt.replication import TransferReport, Update, descends, transfer
from cas_ckpt.repository import Repository
from cas_ckpt.repository import open as open_repository

_log = logging.getLogger("cas_ckpt")

WAIT_ATTEMPTS = 3  # wait() and close() give up after this many failed attempts in a row
MAX_DELAY = 30.0  # seconds between retries, at most


@dataclass(frozen=True)
class Retention:
    """Which steps a side keeps: the last N, every K-th, the N best by a metric (none: all)."""

    keep_last: int | None = None
    keep_every: int | None = None
    keep_best: int | None = None
    best_metric: str | None = None
    best_mode: str = "min"

    RULES = ("keep_last", "keep_every", "keep_best")

    @classmethod
    def parse(cls, rules: Mapping[str, Any], *, best_metric: str | None, best_mode: str) -> Retention:
        """Rules given as ``{"keep_last": 3, ...}`` (the manager's own keyword names)."""
        unknown = set(rules) - set(cls.RULES)
        if unknown:
            raise ValueError(f"unknown retention rule(s) {sorted(unknown)}; use {list(cls.RULES)}")
        for name, value in rules.items():
            if value is not None and (type(value) is not int or value < 1):
                raise ValueError(f"{name} must be a positive int or None, not {value!r}")
        if rules.get("keep_best") is not None and not best_metric:
            raise ValueError("keep_best needs best_metric")
        return cls(**rules, best_metric=best_metric, best_mode=best_mode)

    @property
    def keeps_all(self) -> bool:
        return self.keep_last is None and self.keep_every is None and self.keep_best is None

    def keep(
        self, steps: dict[int, bytes], head: bytes | None, metrics: Callable[[bytes], Any]
    ) -> set[int]:
        """The steps to keep of ``steps`` (step -> commit); the head's step always stays."""
        if self.keeps_all:
            return set(steps)
        keep = {s for s, cid in steps.items() if cid == head}
        if self.keep_last:
            keep.update(sorted(steps)[-self.keep_last:])
        if self.keep_every:
            keep.update(s for s in steps if s % self.keep_every == 0)
        if self.keep_best:
            assert self.best_metric is not None  # parse() and the manager check it
            ranked = ranking(steps, lambda step: metrics(steps[step]), self.best_metric, self.best_mode)
            keep.update(step for step, _ in ranked[: self.keep_best])
        return keep


def ranking(
    steps: Collection[int], metrics: Callable[[int], Any], metric: str, mode: str
) -> list[tuple[int, int | float]]:
    """(step, value) of the ``steps`` whose metrics (a dict, from ``metrics(step)``) hold
    ``metric`` as a number other than NaN, best first by ``mode`` ("min": lowest), the later
    step first in a tie."""
    scored = []
    for step in steps:
        found = metrics(step)
        value = found.get(metric) if isinstance(found, dict) else None
        if type(value) in (int, float) and not math.isnan(value):
            scored.append((value if mode == "min" else -value, -step, step, value))
    return [(step, value) for *_, step, value in sorted(scored)]


def best_of(
    steps: Collection[int], metrics: Callable[[int], Any], metric: str, mode: str
) -> tuple[int, int | float] | None:
    """The first of :func:`ranking`, or None."""
    ranked = ranking(steps, metrics, metric, mode)
    return ranked[0] if ranked else None


def steps_of(refs: RefStore, prefix: str) -> dict[int, bytes]:
    """A run's step refs in ``refs`` (``prefix``: ``"<ref>.steps/"``): step -> commit, the refs
    read at once."""
    digits = len(prefix)
    return {int(name[digits:]): cid for name, cid in refs.values(prefix).items() if name[digits:].isdigit()}


@dataclass(frozen=True)
class ReplicationLag:
    """How far the remote is behind: checkpoints due for replication and not yet there, the bytes
    their saves wrote locally (what a push sends at most), the latest step replicated, and the
    failed attempts (with the last error) since the last success."""

    steps: int
    bytes: int
    replicated_step: int | None
    failures: int
    error: str | None
    tier: str = ""  # where the tier is (its location)


@dataclass(frozen=True)
class RestoreReport:
    """Where a run's latest checkpoint came from when a manager started (or a restore fetched
    one): the tier (``"local"``: its own repository had it), the step and commit, the blocks and
    bytes fetched (only those the local repository lacked), and the seconds it took."""

    tier: str
    step: int | None
    cid: bytes | None
    blocks: int
    bytes: int
    seconds: float

    __repr__ = cidlib.readable_repr

    @classmethod
    def of(cls, replicator: Replicator, cid: bytes, seconds: float) -> RestoreReport:
        report = replicator.last_report
        return cls(replicator.where, replicator.remote().commit(cid).step, cid,
                   report.blocks_sent if report else 0, report.bytes_sent if report else 0, seconds)


def recover(repo: Repository, ref: str, replicators: list[Replicator], step_ref: Callable[[int], str]
            ) -> RestoreReport:
    """Bring ``ref`` up to the newest step any tier holds, from the first tier in list order that
    holds it and answers with blocks that pass verification (only the blocks ``repo`` lacks
    travel). A tier out of reach, or whose blocks fail, is skipped with a warning, never trusted."""
    started = time.perf_counter()
    local = repo.refs_store.get(ref)
    local_step = repo.commit(local).step if local is not None else None
    heads: list[tuple[int, Replicator, bytes]] = []
    for replicator in replicators:
        try:
            remote = replicator.remote()
            head = remote.refs_store.get(ref)
            step = remote.commit(head).step if head is not None else None
        except (CasCkptError, OSError) as exc:
            _log.warning("tier %s is out of reach (%s: %s): skipped", replicator.where,
                         type(exc).__name__, exc)
            continue
        newer = local_step is None or (step is not None and step > local_step)
        if head is not None and step is not None and head != local and newer:
            heads.append((step, replicator, head))
    newest = max((step for step, _, _ in heads), default=None)
    for step, replicator, head in heads:
        if step != newest:
            continue
        try:
            replicator.pull(head, step)
        except (CasCkptError, OSError) as exc:
            _log.warning("restoring step %s of %r from %s failed (%s: %s): trying the next tier", step, ref,
                         replicator.where, type(exc).__name__, exc)
            continue
        return RestoreReport.of(replicator, head, time.perf_counter() - started)
    return RestoreReport("local", local_step, local, 0, 0, time.perf_counter() - started)

class Replicator:
    """Pushes a run's due checkpoints to ``remote`` in a background thread (see the module)."""

    def __init__(
        self, repo: Repository, ref: str, remote: Repository | str | os.PathLike[str], *,
        step_ref: Callable[[int], str], every: int | None, retention: Retention,
        on_replicated: Callable[[], None] | None = None, storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.repo, self.ref, self.step_ref = repo, ref, step_ref
        self._options = storage_options  # how a remote given as a location is opened
        self.every, self.retention = every, retention
        self._on_replicated = on_replicated  # after each push that succeeded, on this thread
        self._remote = remote if isinstance(remote, Repository) else None
        self._spec = remote
        self.where = remote.location if isinstance(remote, Repository) else os.fspath(remote)
        self._prefix = step_ref(0).rpartition("/")[0] + "/"
        self._cond = threading.Condition()
        self._opening = threading.Lock()
        self._pending: dict[int, tuple[bytes, int]] = {}  # step -> (commit, bytes its save wrote)
        self._unchecked: set[int] = set()  # queued at start without the remote's word: see _push
        self._saves = 0
        self._latest: tuple[int, bytes, int] | None = None
        self._remote_head: tuple[bytes | None] | None = None  # last known value (None: unknown)
        self._replicated: int | None = None
        self._failures = 0  # failed attempts since the last success
        self._base = 0  # failures when the current wait() began (its backoff starts afresh)
        self._error: BaseException | None = None
        self._next = 0.0
        self._busy = False
        self._stop = False
        self._gc_due = False
        self.last_report: TransferReport | None = None
        self._thread = threading.Thread(target=self._run, name="cas_ckpt-replicate", daemon=True)
        self._thread.start()

    # -- the remote ----------------------------------------------------------------------------
    def remote(self) -> Repository:
        """The remote repository, opened (created with the local one's settings) on first use."""
        with self._opening:  # the thread and restore() may both need it first
            if self._remote is None:
                self._remote = open_repository(
                    self._spec, hash=self.repo.config.hash, chunk_size=self.repo.config.chunk_size,
                    storage_options=self._options,
                )
            return self._remote

    def resume(self, *, tolerant: bool = False) -> None:
        """Bring the local run up to the remote's before the first save, when the remote is
        ahead: a new node with an empty disk, or a disk older than what was replicated. A remote
        that cannot be reached is an error only when the local repository lacks the run (and
        never ``tolerant``: one tier of several)."""
        local = self.repo.refs_store.get(self.ref)
        try:
            remote = self.remote()
            head = remote.refs_store.get(self.ref)
        except (CasCkptError, OSError) as exc:
            if local is None and not tolerant:
                raise
            _log.warning("cannot reach %s to compare %r (%s: %s); replicating when it can",
                         self.where, self.ref, type(exc).__name__, exc)
            return
        if head is None or head == local or (local is not None and descends(self.repo, local, head)):
            self._remote_head = (head,)  # nothing there, or this side is ahead: pushes catch up
            return
        self.pull(head, remote.commit(head).step)

    def pull(self, head: bytes, step: int | None) -> None:
        """Fast-forward the local run to ``head`` (step ``step``) of the remote, its step ref too
        (RefDiverged if the two hold different histories); only the missing blocks travel, each
        verified."""
        local = self.repo.refs_store.get(self.ref)
        updates = [Update(self.ref, head, force=local is None, expect=(None,) if local is None else None)]
        if step is not None:
            updates.append(Update(self.step_ref(step), head, force=True))
        self.last_report = transfer(self.remote(), self.repo, updates)
        self._remote_head = (head,)
        self._replicated = step

    def fetch(self, step: int | None, *, repair: bool = False) -> bytes | None:
        """Copy checkpoint ``step`` (the latest when None) from the remote into the local
        repository under its step ref; None if the remote does not hold it. ``repair``: local
        copies of its blocks that fail their hash are replaced."""
        remote = self.remote()
        cid = remote.refs_store.get(self.ref if step is None else self.step_ref(step))
        if cid is None:
            return None
        found = remote.commit(cid).step
        local = self.step_ref(found) if found is not None else self.ref
        self.last_report = transfer(remote, self.repo, [Update(local, cid, force=True)],
                                    verify_existing=repair)
        return cid

    def queue_unsent(self) -> None:
        """Queue the local steps the remote lacks, saved while it was away by a manager that is
        gone: the queue is rebuilt from the two repositories, never kept only in memory, so local
        retention keeps those steps until they are there. Call after :meth:`resume`, before any
        retention. A remote out of reach then gets every local step queued, and the first push
        that reaches it sends only those it lacks."""
        steps = steps_of(self.repo.refs_store, self._prefix)
        if self._remote_head is not None:
            try:
                self._queue(self._lacking(self.remote(), self._remote_head[0], steps))
                return
            except (CasCkptError, OSError) as exc:
                _log.warning("cannot reach %s to compare the steps of %r (%s: %s)", self.where,
                             self.ref, type(exc).__name__, exc)
        self._queue(steps, checked=False)

    def _lacking(self, remote: Repository, head: bytes | None, steps: dict[int, bytes]) -> dict[int, bytes]:
        """Of ``steps`` (step -> commit), those the remote still needs: its run's latest step and
        newer ones (older ones it lacks were never due, or its retention expired them; the
        latest lacks its step ref where a push was cut between the run's ref and the step refs),
        without an equal step ref there."""
        after = None if head is None else remote.commit(head).step
        return {step: cid for step, cid in steps.items()
                if (after is None or step >= after) and remote.refs_store.get(self.step_ref(step)) != cid}

    def _queue(self, steps: dict[int, bytes], *, checked: bool = True) -> None:
        """Queue checkpoints saved before this manager started (their bytes unknown: 0)."""
        if not steps:
            return
        _log.info("queueing steps %s of %r for %s, saved locally before this manager started",
                  sorted(steps), self.ref, self.where)
        with self._cond:
            if not checked:
                self._unchecked.update(steps)
            for step, cid in steps.items():
                self._pending.setdefault(step, (cid, 0))
            self._cond.notify_all()

    # -- the queue -----------------------------------------------------------------------------
    def saved(self, step: int, cid: bytes, nbytes: int, *, now: bool = False) -> None:
        """A save finished locally: queue it if it is due (every ``every``-th save, or ``now``)."""
        with self._cond:
            self._saves += 1
            self._latest = (step, cid, nbytes)
            if now or self.every is None or self._saves % self.every == 0:
                self._pending[step] = (cid, nbytes)
                self._cond.notify_all()

    def finish(self) -> None:
        """Queue the latest save even if it was not due: the remote ends where the run did."""
        with self._cond:
            if self._latest is not None:
                step, cid, nbytes = self._latest
                if step not in self._pending and (self._replicated is None or self._replicated < step):
                    self._pending[step] = (cid, nbytes)
                    self._cond.notify_all()

    def pending(self) -> set[int]:
        """Steps queued for the remote and not there yet (local retention keeps them)."""
        with self._cond:
            return set(self._pending)

    @property
    def lag(self) -> ReplicationLag:
        with self._cond:
            return ReplicationLag(
                steps=len(self._pending), bytes=sum(n for _, n in self._pending.values()),
                replicated_step=self._replicated, failures=self._failures,
                error=None if self._error is None else f"{type(self._error).__name__}: {self._error}",
                tier=self.where,
            )

    def wait(self) -> None:
        """Block until every queued checkpoint is replicated; :class:`ReplicationFailed` after
        :data:`WAIT_ATTEMPTS` failed attempts in a row (the queue stays, and retries go on)."""
        with self._cond:
            self._base = self._failures
            self._next = min(self._next, time.monotonic())  # a waiter need not sit out a backoff
            self._cond.notify_all()
            while self._pending or self._busy:
                if not self._busy and self._failures - self._base >= WAIT_ATTEMPTS:
                    assert self._error is not None
                    raise ReplicationFailed(self.ref, self.where, sorted(self._pending),
                                            self._error) from self._error
                self._cond.wait(0.5)

    def close(self) -> None:
        """:meth:`finish` and :meth:`wait`, then :meth:`stop` (also when waiting failed)."""
        try:
            self.finish()
            self.wait()
        finally:
            self.stop()

    def stop(self) -> None:
        """Stop the thread (a push in progress completes first) and close the remote if it was
        opened here; what is still queued stays unsent."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout=60)
        if self._remote is not None and not isinstance(self._spec, Repository):
            self._remote.close()
            self._remote = None

    # -- the thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stop and not (self._pending and time.monotonic() >= self._next):
                    delay = self._next - time.monotonic() if self._pending else None
                    self._cond.wait(None if delay is None else max(delay, 0.01))
                if self._stop:
                    return
                batch = dict(self._pending)
                self._busy = True
            try:
                self._push(batch)
            except Exception as exc:  # reported, counted and retried: never dropped
                self._failed(batch, exc)
                continue
            with self._cond:
                for step, item in batch.items():
                    if self._pending.get(step) == item:
                        del self._pending[step]
                self._failures, self._error = 0, None
            try:  # still busy: wait() returns once what follows a push (local retention) is done
                if self._on_replicated is not None:
                    self._on_replicated()
            except Exception as exc:  # the push succeeded: retention runs again later
                _log.warning("after replicating %r to %s: %s: %s", self.ref, self.where,
                             type(exc).__name__, exc)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _failed(self, batch: dict[int, tuple[bytes, int]], exc: Exception) -> None:
        with self._cond:
            attempt = self._failures + 1
            delay = min(0.25 * 2 ** (attempt - self._base - 1), MAX_DELAY)
            # Logged before the attempt is counted: wait() raises once it sees the count, and the
            # warning must already be there for whoever reads the log then.
            _log.warning("replicating steps %s of %r to %s failed (attempt %d, retrying in %.1f s): "
                         "%s: %s", sorted(batch), self.ref, self.where, attempt, delay,
                         type(exc).__name__, exc)
            self._failures = attempt
            self._error = exc
            self._next = time.monotonic() + delay
            self._busy = False
            self._cond.notify_all()

    def _push(self, batch: dict[int, tuple[bytes, int]]) -> None:
        """Send the batch's checkpoints still held locally (their step refs and the run's ref at
        the newest), then apply the remote's retention."""
        refs = self.repo.refs_store
        head = refs.get(self.ref)
        present = {s: cid for s, (cid, _) in batch.items()
                   if refs.get(self.step_ref(s)) == cid or head == cid}
        gone = sorted(set(batch) - set(present))
        if gone:
            _log.warning("steps %s of %r were expired locally before they reached %s", gone,
                         self.ref, self.where)
        if not present:
            return
        remote = self.remote()
        unchecked = self._unchecked & set(present)
        if unchecked:  # queued while the remote was out of reach: send only what it lacks
            lacking = self._lacking(remote, remote.refs_store.get(self.ref),
                                    {s: present[s] for s in unchecked})
            present = {s: cid for s, cid in present.items() if s not in unchecked or s in lacking}
        if not present:
            self._unchecked -= unchecked
            return
        newest = max(present)
        # The run's ref moves first: a push refused there (another writer's run) moves no step
        # ref, so it never replaces steps that writer's tier acknowledged.
        if self._remote_head is None:  # first push of this manager: only a fast-forward
            updates = [Update(self.ref, present[newest])]
        else:  # the run is this manager's: it may move back (a rewind), but only from what it set
            updates = [Update(self.ref, present[newest], force=True, expect=self._remote_head)]
        updates += [Update(self.step_ref(s), cid, force=True) for s, cid in sorted(present.items())]
        try:
            self.last_report = transfer(self.repo, remote, updates)
        except RefConflict:
            # A commit of this run's own history there: an earlier push of ours moved the ref and
            # its answer was lost (a peer killed before it answered). Expect it from now on.
            actual = remote.refs_store.get(self.ref)
            if actual is not None and self._remote_head is not None and actual != self._remote_head[0] \
                    and descends(self.repo, present[newest], actual):
                self._remote_head = (actual,)
            raise
        self._remote_head = (present[newest],)
        self._replicated = newest
        self._unchecked -= unchecked
        self._retain_remote(remote)

    def _retain_remote(self, remote: Repository) -> None:
        if self.retention.keeps_all and not self._gc_due:
            return
        steps = steps_of(remote.refs_store, self._prefix)
        head = remote.refs_store.get(self.ref)
        commits = remote.history.commits(steps.values()) if self.retention.keep_best else {}

        def metrics(cid: bytes) -> Any:
            return (commits.get(cid) or remote.commit(cid)).metadata.get("metrics")

        expired = sorted(set(steps) - self.retention.keep(steps, head, metrics))
        for step in expired:
            remote.delete_ref(self.step_ref(step), expected=cidlib.to_cid(steps[step]))
        if expired or self._gc_due:
            self._gc_due = True  # until a collection succeeds
            remote.gc(expire_reflogs=(self.ref, self._prefix))
            self._gc_due = False
