"""CheckpointManager: periodic saves, retention that frees space, async saves, resume and forks.

Layout in the repository (so a new process sees exactly what the old one left):

* ``<ref>`` points at the latest checkpoint; its commits chain through history links, so
  ``repo.log(ref)`` lists every checkpoint ever saved, expired ones included;
* ``<ref>.steps/<step, 12 digits>`` points at each retained checkpoint. Retention deletes these
  refs, then (``gc_after_retention``) runs ``repo.gc()``, which frees every block no retained
  checkpoint of any ref still needs;
* each commit records ``step`` and ``metadata={"step": step, "metrics": {...}}``; ``keep_best``
  ranks by those, so nothing lives only in memory.

The latest checkpoint is always kept (``<ref>`` itself holds it), whatever the policy says: a run
can always resume. ``keep_best`` alone therefore keeps the best N plus the latest.

"Latest" is the checkpoint saved last. Steps normally increase; :meth:`CheckpointManager.rewind`
moves ``<ref>`` back to a retained step and deletes the step refs after it (the reflog keeps
them). Without a rewind, a step at or before the latest needs ``overwrite=True``.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import operator
import os
import signal
import sys
import threading
import time
import weakref
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
from multiformats import CID

from cas_ckpt import cid as cidlib
from cas_ckpt.errors import (
    BlockNotFound,
    CasCkptError,
    CheckpointExists,
    CheckpointExpired,
    CorruptBlock,
    DecodeError,
    LeaseHeld,
    MediumError,
    RefConflict,
    ReplicationFailed,
    RepositoryError,
    SaveFailed,
    StateTypeError,
    StepNotFound,
    UnknownMetric,
)
from cas_ckpt.refs import check_ref_name
from cas_ckpt.refs.base import Lease, step_ref
from cas_ckpt.repository import Commit, RepoOrPath, Repository, SaveReport, Target, ensure_open
from cas_ckpt.tree import MAX_DEPTH, dtype_name, is_tensor, join_path
from cas_ckpt.two_tier import ReplicationLag, Replicator, RestoreReport, Retention, best_of, recover, steps_of

__all__ = ["CheckpointManager", "snapshot"]

_log = logging.getLogger("cas_ckpt")

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)  # SLURM sends SIGUSR1 with --signal


class CheckpointManager:
    """Saves one run's checkpoints under ``ref`` and applies a retention policy after each save.

    ``repo``: an open :class:`Repository` (it stays the caller's to close), or a location as
    :func:`cas_ckpt.open` takes it (a directory as str or path-like, ``"s3://bucket/prefix"``,
    ``"memory://"``), opened (created if missing) by the manager and closed by :meth:`close`.
    ``save_every``: save only steps divisible by it (``force=True`` saves any step).
    ``keep_last`` / ``keep_every`` / ``keep_best``: keep the last N steps, every step divisible by
    K, and the N best by ``metrics[best_metric]`` (``best_mode`` "min" or "max"); a step any rule
    keeps survives, the latest always does. No rule given: keep everything. Until a save of
    ``ref`` has reported ``best_metric``, a save without it raises :class:`UnknownMetric` (naming
    the metrics reported) before anything is written or expired: a misspelt metric would rank
    nothing and expire the best step. Once one has, saves may leave it out; they never rank.
    ``async_save``: ``save`` returns once the state is copied to host memory; writing continues in
    a background thread, one save at a time. ``reuse_buffers`` (async): keep that host copy between
    saves and refill it in place, which is faster than fresh memory but holds one copy of the state
    while the manager is open. ``fork_from``: a ref or CID that a new ``ref`` starts
    from (ignored once ``ref`` exists, so a restarted run simply resumes).
    One writer per run: the manager holds the ref store's lease on ``ref`` until :meth:`close`
    (or until it is garbage collected, or its process ends); a second manager on ``ref``, in any
    process, raises :class:`LeaseHeld` naming the holder, unless ``takeover=True`` (then the old
    one's next save raises it). A manager of a read-only repository takes no lease.
    ``preemption``: install handlers for ``preemption_signals`` that only set a flag, which
    :meth:`reached_preemption` reports; they are restored by :meth:`close`.
    ``replicate_to``: a second, durable repository (``s3://bucket/prefix``, a path, or an open
    Repository). Each save (every ``replicate_every``-th, one made after a preemption signal, and
    the last before :meth:`close`) lands locally first, then a background thread pushes it there:
    its step ref and the run's ref, only the blocks the remote lacks; local retention keeps a
    step until it is there. ``remote_retention`` (``{"keep_last": 10}``...,
    the keep_* rules above; None: the same as here, ``{}``: keep all) applies there after each
    push. :meth:`wait` and :meth:`close` wait for replication too; :attr:`replication_lag` says
    how far it is behind; a failure is logged and retried. A manager whose repository lacks ``ref``,
    or holds an older checkpoint of it than the remote, first pulls it from there (a new node
    resumes from object storage); :meth:`restore` fetches a step only the remote holds, or whose
    local copy fails verification. See ``docs/scale-out.md``.
    ``replicate_to`` may be a list of tiers (``["http://peer:9000", "/nvme/ckpts", "s3://..."]``:
    a peer's ``cas-ckpt serve --write-token``, disks, object storage), each pushed to by a thread
    of its own (a slow or dead tier delays no other); ``remote_retention`` and
    ``remote_storage_options`` are then one setting for all or a list with one per tier,
    :attr:`replication_lag` a list, and a new manager first restores the newest step any tier
    holds from the first tier (in list order) that holds it and passes verification, fetching
    only what its repository lacks (:attr:`last_restore` says from where). See
    ``docs/scale-out.md``, "Tiers".
    ``storage_options`` / ``remote_storage_options``: how ``repo`` / ``replicate_to``, when given
    as a location, are opened (as :func:`cas_ckpt.open` takes them: an S3 ``cache_dir``, an HTTP
    server's ``token``, ``timeout`` and ``min_rate``...).
    """

    def __init__(
        self,
        repo: RepoOrPath,
        ref: str = "main",
        *,
        save_every: int | None = None,
        keep_last: int | None = None,
        keep_every: int | None = None,
        keep_best: int | None = None,
        best_metric: str | None = None,
        best_mode: str = "min",
        async_save: bool = False,
        reuse_buffers: bool = True,
        gc_after_retention: bool = True,
        fork_from: Target | None = None,
        preemption: bool = False,
        preemption_signals: Sequence[int] = PREEMPTION_SIGNALS,
        takeover: bool = False,
        replicate_to: Repository | str | os.PathLike[str] | None = None,
        replicate_every: int | None = None,
        remote_retention: Mapping[str, Any] | None = None,
        storage_options: Mapping[str, Any] | None = None,
        remote_storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        for name, value in (("save_every", save_every), ("keep_last", keep_last),
                            ("keep_every", keep_every), ("keep_best", keep_best),
                            ("replicate_every", replicate_every)):
            if value is not None and (type(value) is not int or value < 1):
                raise ValueError(f"{name} must be a positive int or None, not {value!r}")
        if best_mode not in ("min", "max"):
            raise ValueError(f"best_mode must be 'min' or 'max', not {best_mode!r}")
        if keep_best is not None and not best_metric:
            raise ValueError("keep_best needs best_metric")
        self.ref = check_ref_name(ref)
        self.save_every = save_every
        self.keep_last, self.keep_every, self.keep_best = keep_last, keep_every, keep_best
        self.best_mode = best_mode
        self._metric = best_metric  # what "best" means: best_step(), best_metric(), keep_best
        self._retention = Retention(keep_last, keep_every, keep_best, best_metric, best_mode)
        self.async_save = async_save
        self._buffers: dict[Place, Any] | None = {} if reuse_buffers else None
        self.gc_after_retention = gc_after_retention
        self.last_report: SaveReport | None = None  # of the latest save this manager finished
        self._prefix = check_ref_name(f"{ref}.steps") + "/"
        self._commits: dict[bytes, Commit] = {}  # commits are immutable: safe to cache
        self._executor: ThreadPoolExecutor | None = None
        self._future: Future[CID] | None = None
        self._pending_step = -1
        self._last_cid: CID | None = None
        self._best_metric_stored = False  # a retained step reported best_metric
        self._closed = False
        self._lock = threading.Lock()
        self._retaining = threading.Lock()  # saves and the replicator's thread both apply retention
        self._preempted: int | None = None  # the signal that asked this run to stop
        self._handlers: dict[int, Any] = {}  # signal -> the handler installed before ours
        self.preempted_at: int | None = None  # the step at which reached_preemption said True
        self._lease: Lease | None = None
        self._replicators: list[Replicator] = []
        self._tiered = isinstance(replicate_to, (list, tuple))  # a list: replication_lag is a list
        self.last_restore: RestoreReport | None = None  # where the run's bytes last came from
        # A location is opened here and closed by close(); a Repository stays its caller's.
        self.repo, self._owns_repo = ensure_open(repo, storage_options)
        with contextlib.ExitStack() as undo:  # a manager that fails to start gives everything back
            if self._owns_repo:
                undo.callback(self.repo.close)
            # The ranks of one torch.distributed job are one writer: rank 0 holds the run's lease.
            if not self.repo.read_only and _rank() == 0:
                self._lease = self._take_lease(takeover)
                # An unclosed manager gives its run back when collected.
                self._release_lease = weakref.finalize(self, self._lease.release)
                undo.callback(self._release_lease)
            if replicate_to is not None and self._lease is not None:  # the run's writer replicates
                self._replicators = self._start_replication(_tiers(replicate_to), replicate_every,
                                                            remote_retention, remote_storage_options)
                for replicator in self._replicators:
                    undo.callback(replicator.stop)
            if fork_from is not None and self.repo.refs_store.get(self.ref) is None:
                self._fork(fork_from)
            self._reconcile()
            for replicator in self._replicators:  # before any retention: what a dead manager left
                replicator.queue_unsent()
            if preemption:
                self._install_handlers(tuple(preemption_signals))
            undo.pop_all()

    def __repr__(self) -> str:
        return f"<CheckpointManager {self.ref!r} in {self.repo!r}>"

    def _take_lease(self, takeover: bool) -> Lease:
        try:
            return self.repo.refs_store.lease(self.ref, takeover=takeover)
        except MediumError:
            raise
        except OSError as exc:  # a read-only medium (EROFS), a repository of another user
            where = self.repo.location or self.repo
            raise MediumError(f"a checkpoint manager of {self.ref!r} cannot write to {where} (it exists "
                              "to save; to restore from a repository it cannot write, open it with "
                              "read_only=True)", exc) from exc

    # -- queries -------------------------------------------------------------------------------
    def steps(self) -> list[int]:
        """Retained steps, oldest first (their refs' names: one listing, nothing read per step)."""
        self._drain()
        return sorted(self._steps(self.repo.refs_store.names(self._prefix)).values())

    def latest_step(self) -> int | None:
        """The step of the latest checkpoint (what ``restore()`` loads), or None if none."""
        self._drain()
        head = self.repo.refs_store.get(self.ref)
        return None if head is None else self._commit(head).step

    def commit(self, step: int | None = None) -> Commit:
        """The commit record of ``step`` (latest when None): CID, time, metadata with metrics."""
        self._drain()
        return self._commit(self._target(None if step is None else _as_step(step)))

    def metrics(self, step: int | None = None) -> dict[str, Any]:
        """The metrics saved with ``step`` (latest when None)."""
        metrics = self.commit(step).metadata.get("metrics")
        return dict(metrics) if isinstance(metrics, dict) else {}

    def best_step(self, metric: str | None = None, *, mode: str | None = None) -> int | None:
        """The retained step whose ``metric`` is best: lowest with ``mode`` "min", highest with
        "max" (defaults: the manager's ``best_metric`` and ``best_mode``, as Orbax's ``best_fn``
        and ``best_mode``, Lightning's ``monitor`` and ``mode``); the later step of a tie.

        Steps whose metrics lack it, or hold NaN, never rank; None if no retained step reported
        it. With ``replicate_to``, the steps the remote retains count too (:meth:`restore`
        fetches one held only there); a remote out of reach is logged and the local steps rank.
        ``ValueError`` if neither ``metric`` nor the manager's ``best_metric`` names one.
        """
        best = self._best(metric, mode)
        return None if best is None else best[0]

    def best_metric(self, metric: str | None = None, *, mode: str | None = None) -> int | float | None:
        """The value of ``metric`` at :meth:`best_step` (as Lightning's ``best_model_score``);
        None if no retained step reported it."""
        best = self._best(metric, mode)
        return None if best is None else best[1]

    def _best(self, metric: str | None, mode: str | None) -> tuple[int, int | float] | None:
        name = metric if metric is not None else self._metric
        if not name:
            raise ValueError(f"no metric to rank the steps of {self.ref!r} by: pass metric=, or "
                             "make the manager with best_metric=")
        mode = self.best_mode if mode is None else mode
        if mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max', not {mode!r}")
        self._drain()
        steps = {step: (self.repo, cid) for step, cid in self._step_refs().items()}
        for replicator in self._replicators:
            try:
                remote = replicator.remote()
                for step, cid in steps_of(remote.refs_store, self._prefix).items():
                    steps.setdefault(step, (remote, cid))
            except (CasCkptError, OSError) as exc:
                _log.warning("ranking the steps of %r without %s, out of reach (%s: %s)", self.ref,
                             replicator.where, type(exc).__name__, exc)

        def metrics(step: int) -> Any:
            repo, cid = steps[step]
            if cid not in self._commits:  # a commit is the same wherever it is stored
                self._commits[cid] = repo.commit(cid)
            return self._commits[cid].metadata.get("metrics")

        return best_of(steps, metrics, name, mode)

    # -- save ----------------------------------------------------------------------------------
    def save(
        self,
        step: int,
        state: Any,
        *,
        metrics: Mapping[str, Any] | None = None,
        force: bool = False,
        overwrite: bool = False,
    ) -> CID | None:
        """Save ``state`` as checkpoint ``step``; return its CID, or None if skipped.

        ``step``: an int, or a numpy or torch integer scalar. Skipped (None), at once, when
        ``save_every`` does not divide ``step`` and not ``force``. After a
        preemption signal the save is synchronous whatever ``async_save`` says: it waits for the
        save in flight, writes, and returns the CID once the checkpoint is durable. Raises
        :class:`CheckpointExists` if ``step`` is already saved (or older than the latest) unless
        ``overwrite``. With ``async_save`` it returns None once the state is copied to host
        memory; :meth:`wait` gives the CID, and a failure is raised (as :class:`SaveFailed`) by
        the next call.
        """
        if self._closed:
            raise RepositoryError(f"checkpoint manager for {self.ref!r} is closed")
        step = _as_step(step)
        if self.save_every and step % self.save_every and not force:
            return None  # at once: a skipped step never waits for the save in flight
        self._drain()
        self._check_lease()
        self._check_new(step, overwrite)
        metadata = {"step": step, "metrics": _metrics(metrics)}
        self._check_best_metric(metadata["metrics"])
        if not self.async_save or self._preempted is not None:
            return self._write(step, state, metadata)
        copy = snapshot(state, self._buffers)
        _finish_at_exit(self)
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="cas_ckpt-save")
            self._pending_step = step
            self._future = self._executor.submit(self._write, step, copy, metadata)
        return None

    def wait(self) -> CID | None:
        """Block until the save in flight is durable (and, with ``replicate_to``, replicated:
        :class:`ReplicationFailed` if that keeps failing); return the CID of this manager's last save."""
        self._drain()
        for replicator in self._replicators:
            replicator.wait()
        return self._last_cid

    def close(self) -> None:
        """Wait for the save in flight (raising its failure) and for replication (raising
        :class:`ReplicationFailed` if it cannot catch up), apply retention to what reached the
        remote, and stop the background threads."""
        try:
            self._drain()
        finally:
            try:
                if self._replicators:
                    try:
                        _close_all(self._replicators)
                    finally:
                        self._retain()  # steps retention kept while they were on their way
            finally:
                self._close()

    def delete(self, *, dry_run: bool = False) -> dict[str, CID]:
        """Delete this run from the repository and close the manager; return the refs dropped
        (the head, its step refs and other companions: :meth:`Repository.run_refs`) with what each
        held. ``dry_run``: only return them; the manager stays open.

        Waits for the save in flight, and stops replication without sending what is queued (the
        remote's copy of the run is left as it is: delete it there too if it must go). Every
        ref's reflog stays: GC keeps the run's checkpoints for the reflog expiry (other runs'
        retention included), and ``repo.restore_ref`` brings each ref back.
        """
        if self._closed:
            raise RepositoryError(f"checkpoint manager for {self.ref!r} is closed")
        self._drain()
        found = self.repo.run_refs(self.ref)
        if dry_run:
            return found
        self._check_lease()
        for replicator in self._replicators:
            replicator.stop()
        self._replicators = []
        try:
            if found:
                self.repo.delete_run(self.ref)
        finally:
            self._close()
        return found

    def _close(self) -> None:
        """Stop the threads, restore signal handlers, give the run's lease back, and close the
        repository if this manager opened it."""
        self._closed = True
        self._buffers = None
        self._restore_handlers()
        if self._lease is not None:
            self._release_lease()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        if self._owns_repo:
            self.repo.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.close()
            return
        # The exception already propagating matters more (a replication failure was logged).
        with contextlib.suppress(SaveFailed, ReplicationFailed):
            self.close()

    # -- preemption ----------------------------------------------------------------------------
    def reached_preemption(self, step: int) -> bool:
        """True once a preemption signal arrived (on any rank): save ``step`` now and exit.

        With ``torch.distributed`` initialized, the flag is all-reduced (MAX) over the default
        group, so every rank sees the same answer at the same step; every rank must call it at
        the same steps, as for any collective.
        """
        flag = self._preempted is not None
        if _distributed():
            flag = _any_rank(flag)
        if flag and self.preempted_at is None:
            self.preempted_at = _as_step(step)
        return flag

    def _install_handlers(self, signals: tuple[int, ...]) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise RepositoryError(
                "CheckpointManager(preemption=True) must be made in the main thread: Python runs "
                "signal handlers there only"
            )
        for signum in signals:
            self._handlers[signum] = signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._preempted = signum
        previous = self._handlers.get(signum)
        # SIG_DFL (not callable) would end the process before the save; SIG_IGN does nothing.
        if callable(previous):
            previous(signum, frame)

    def _restore_handlers(self) -> None:
        if not self._handlers or threading.current_thread() is not threading.main_thread():
            return
        for signum, previous in self._handlers.items():
            if signal.getsignal(signum) == self._on_signal:  # a later handler stays in place
                signal.signal(signum, signal.SIG_DFL if previous is None else previous)
        self._handlers = {}

    def _fork(self, source: Target) -> None:
        """Start the ref at ``source``; another process (a rank of the same job) forking it to the
        same checkpoint at the same moment is no conflict."""
        try:
            self.repo.fork(source, self.ref)
        except RefConflict:
            if self.repo.refs_store.get(self.ref) != bytes(self.repo.resolve(source)):
                raise

    # -- torch.distributed.checkpoint ------------------------------------------------------------
    def save_dcp(
        self, step: int, state_dict: dict[str, Any], *, metrics: Mapping[str, Any] | None = None,
        force: bool = False,
    ) -> CID | None:
        """Save checkpoint ``step`` of a multi-rank job through ``torch.distributed.checkpoint``.

        Every rank calls it with its own ``state_dict`` (DTensors, sharded tensors...), as it
        would call ``dcp.save``; each rank writes its shards, the coordinator commits, and rank 0
        records the step and applies retention. Returns the commit's CID on every rank (None if
        ``save_every`` skips the step). The checkpoint is an ordinary one: ``steps()``, retention,
        ``fork_from`` and :meth:`restore_dcp` (or ``restore`` of a rank's view) work on it.
        """
        import torch.distributed.checkpoint as dcp  # torch only for this call

        from cas_ckpt.integrations.dcp import Writer

        if self._closed:
            raise RepositoryError(f"checkpoint manager for {self.ref!r} is closed")
        step = _as_step(step)
        if self.save_every and step % self.save_every and not force:
            return None
        self._drain()
        self._check_lease()
        self._check_new(step, overwrite=False)
        metadata = {"step": step, "metrics": _metrics(metrics)}
        self._check_best_metric(metadata["metrics"])
        writer = Writer(self.repo, self.ref, step=step, metadata=metadata)
        cid = CID.decode(dcp.save(state_dict, storage_writer=writer).storage_meta.checkpoint_id)
        if _rank() == 0:
            self.repo.set_ref(self.step_ref(step), cid)
            self._last_cid = cid
            self._retain()
            self._replicate(step, cid, writer.stats.bytes_written)  # this rank's share
        if _distributed():
            _barrier()  # every rank sees the step ref, and retention done, once this returns
        return cid

    def restore_dcp(self, state_dict: dict[str, Any], step: int | None = None) -> dict[str, Any]:
        """Load checkpoint ``step`` (the latest when None) into ``state_dict`` in place, through
        ``torch.distributed.checkpoint`` (each rank reads only its shards); returns it."""
        import torch.distributed.checkpoint as dcp

        from cas_ckpt.integrations.dcp import Reader

        dcp.load(state_dict, storage_reader=Reader(self.repo, cidlib.to_cid(self._target(step))))
        return state_dict

    # -- restore -------------------------------------------------------------------------------
    def restore(
        self,
        step: int | None = None,
        *,
        path: str | None = None,
        mmap: bool = False,
        verify: bool | None = None,
        map_location: Any = None,
        dtype: Any = None,
    ) -> Any:
        """Load checkpoint ``step`` (the latest when None), or only its sub-tree at ``path``.

        ``mmap``, ``verify``, ``map_location`` and ``dtype`` are those of :meth:`Repository.load`. Raises
        :class:`StepNotFound` for a step never saved, or (``step`` None) when the ref holds no
        checkpoint yet, and :class:`CheckpointExpired` for a step retention removed.
        """
        self._drain()
        step = None if step is None else _as_step(step)
        try:
            target = self._target(step)
        except (StepNotFound, CheckpointExpired):
            fetched = self._fetch(step)
            if fetched is None:
                raise
            target = fetched

        def read() -> Any:
            return self.repo.load(target, path=path, mmap=mmap, verify=verify,
                                  map_location=map_location, dtype=dtype)

        try:
            return read()
        except (CorruptBlock, BlockNotFound) as exc:  # local damage: a tier has a good copy
            if not self._replicators:
                raise
            _log.warning("restoring %s of %r: the local copy failed (%s); fetching it from the first "
                         "tier that holds a good one", step, self.ref, exc)
            if self._fetch(self._commit(target).step, repair=True) is None:
                raise
            return read()

    def _fetch(self, step: int | None, *, repair: bool = False) -> bytes | None:
        """Copy ``step`` (the latest when None) from the first tier, in list order, that holds
        it and answers with verified blocks (recorded in :attr:`last_restore`); None if none."""
        for replicator in self._replicators:
            started = time.perf_counter()
            try:
                found = replicator.fetch(step, repair=repair)
            except (CasCkptError, OSError) as exc:
                _log.warning("cannot restore %s of %r from %s (%s: %s): trying the next tier", step,
                             self.ref, replicator.where, type(exc).__name__, exc)
                continue
            if found is not None:
                self.last_restore = RestoreReport.of(replicator, found, time.perf_counter() - started)
                return found
        return None

    def rewind(self, step: int) -> CID:
        """Make retained ``step`` the latest again: later steps leave :meth:`steps` (their commits
        stay in the ref's reflog), and the next save, of any step after ``step``, is its child.

        Raises :class:`CheckpointExpired` or :class:`StepNotFound` as :meth:`restore` does.
        """
        self._drain()
        self._check_lease()
        step = _as_step(step)
        target = self._target(step)
        head = self.repo.refs_store.get(self.ref)
        moved = head == target or self.repo.refs_store.set_if_equals(
            self.ref, head, target, message=f"rewind to step {step}"
        )
        if not moved:
            raise RefConflict(self.ref, head, self.repo.refs_store.get(self.ref))
        for later, cid in self._step_refs().items():
            if later > step:
                self.repo.delete_ref(self.step_ref(later), expected=cid)
        self._last_cid = cidlib.to_cid(target)
        return self._last_cid

    # -- internals -----------------------------------------------------------------------------
    def step_ref(self, step: int) -> str:
        """The ref that holds ``step`` while it is retained."""
        return step_ref(self.ref, _as_step(step))

    def _step_refs(self) -> dict[int, bytes]:
        """Each retained step and its commit (the refs read at once)."""
        return steps_of(self.repo.refs_store, self._prefix)

    def _steps(self, names: Iterable[str]) -> dict[str, int]:
        """The step refs among ``names`` (all below this run's prefix) and their steps."""
        digits = len(self._prefix)
        return {name: int(name[digits:]) for name in names if name[digits:].isdigit()}

    def _commit(self, cid: bytes) -> Commit:
        if cid not in self._commits:
            self._commits[cid] = self.repo.commit(cid)
        return self._commits[cid]

    def _read_commits(self, cids: Iterable[bytes]) -> None:
        """Read the commits of ``cids`` not known yet, at once (the commit graph's copies, the rest
        in parallel): retention ranks every retained step."""
        self._commits.update(self.repo.history.commits(c for c in cids if c not in self._commits))

    def _target(self, step: int | None) -> bytes:
        if step is None:
            head = self.repo.refs_store.get(self.ref)
            if head is None:
                refs = [n for n in self.repo.refs_store.names() if ".steps/" not in n]
                raise StepNotFound(self.ref, None, location=self.repo.location or self.repo, refs=refs)
            return head
        cid = self.repo.refs_store.get(self.step_ref(step))
        if cid is not None:
            return cid
        for commit in self.repo.log(self.ref):
            if commit.step == step:
                raise CheckpointExpired(commit.cid)
        raise StepNotFound(self.ref, step)

    def _check_new(self, step: int, overwrite: bool) -> None:
        if overwrite:
            return
        if self.repo.refs_store.get(self.step_ref(step)) is not None:
            raise CheckpointExists(self.ref, step)
        latest = self.latest_step()
        if latest is not None and step <= latest:
            raise CheckpointExists(self.ref, step, latest=latest)

    def _reconcile(self) -> None:
        """Give the latest checkpoint its step ref if a crash (or a fork) left it without one."""
        head = self.repo.refs_store.get(self.ref)
        if head is None or self.repo.read_only or _rank() != 0:  # only the run's writer writes
            return
        try:
            step = self._commit(head).step
        except DecodeError:
            raise RepositoryError(f"{self.ref!r} does not point at a checkpoint commit") from None
        if step is not None and self.repo.refs_store.get(self.step_ref(step)) is None:
            self.repo.refs_store.add_if_new(self.step_ref(step), head, message="step ref")

    def _check_lease(self) -> None:
        if self._lease is not None and not self._lease.held():
            raise LeaseHeld(self.ref, "another writer, which took this manager's lease over")

    def _write(self, step: int, state: Any, metadata: dict[str, Any]) -> CID:
        self._check_lease()
        cid = self.repo.save(state, ref=self.ref, step=step, metadata=metadata)
        self.last_report = self.repo.last_save
        self.repo.set_ref(self.step_ref(step), cid)
        self._last_cid = cid
        self._retain()
        self._replicate(step, cid, self.last_report.bytes_written if self.last_report else 0)
        return cid

    def _replicate(self, step: int, cid: CID, written: int) -> None:
        """Queue a finished save (``written`` new bytes here) for the remote; a save after a
        preemption signal always."""
        for replicator in self._replicators:
            replicator.saved(step, bytes(cid), written, now=self._preempted is not None)

    def _start_replication(
        self, tiers: list[Repository | str | os.PathLike[str]], every: int | None,
        rules: Mapping[str, Any] | Sequence[Mapping[str, Any] | None] | None,
        options: Mapping[str, Any] | Sequence[Mapping[str, Any] | None] | None,
    ) -> list[Replicator]:
        """A background replicator per tier; first the run is brought up to the newest step any
        tier holds, from the first tier (in list order) that holds it (:attr:`last_restore`)."""
        replicators: list[Replicator] = []
        try:
            settings = zip(tiers, _per_tier(rules, len(tiers), "remote_retention"),
                           _per_tier(options, len(tiers), "remote_storage_options"), strict=True)
            for tier, tier_rules, tier_options in settings:
                retention = self._retention if tier_rules is None else Retention.parse(
                    tier_rules, best_metric=self._metric, best_mode=self.best_mode)
                replicators.append(Replicator(self.repo, self.ref, tier, step_ref=self.step_ref, every=every,
                                              retention=retention, on_replicated=self._retain,
                                              storage_options=tier_options))
            if self._tiered:
                self.last_restore = recover(self.repo, self.ref, replicators, self.step_ref)
            for replicator in replicators:
                replicator.resume(tolerant=self._tiered)
        except BaseException:
            for replicator in replicators:
                replicator.stop()
            raise
        _finish_at_exit(self)  # a script that ends without close() still replicates its last save
        return replicators

    @property
    def replication_lag(self) -> ReplicationLag | list[ReplicationLag] | None:
        """How far each tier is behind: one :class:`ReplicationLag` for a ``replicate_to`` given
        alone, a list (in tier order) for a list; None without ``replicate_to``."""
        if not self._replicators:
            return None
        lags = [replicator.lag for replicator in self._replicators]
        return lags if self._tiered else lags[0]

    def _drain(self) -> None:
        """Wait for the save in flight; raise its failure as :class:`SaveFailed`, once.

        An exception raised while waiting (KeyboardInterrupt) propagates as it is and leaves the
        save pending: it is still running, and the next call, or interpreter exit, waits for it.
        """
        with self._lock:
            future, step = self._future, self._pending_step
        if future is None:
            return
        error = future.exception()
        with self._lock:
            if self._future is not future:
                return  # another thread took this result (and reports a failure)
            self._future = None
        if error is not None:
            raise SaveFailed(self.ref, step, error) from error

    # -- retention -----------------------------------------------------------------------------
    def _retain(self) -> None:
        """Expire the steps no rule keeps, then collect. After each save, and with replication
        after each push (on the replicator's thread: a step waiting for the remote is kept until
        it is there) and at close()."""
        if self._retention.keeps_all or self._lease is None:
            return
        with self._retaining:
            steps = self._step_refs()
            head = self.repo.refs_store.get(self.ref)
            if self.keep_best is not None:
                self._read_commits(steps.values())
            keep = self._retention.keep(steps, head, lambda cid: self._commit(cid).metadata.get("metrics"))
            for replicator in self._replicators:  # a step on its way to a tier stays until it is there
                keep |= replicator.pending()
            expired = sorted(set(steps) - keep)
            for step in expired:
                self.repo.delete_ref(self.step_ref(step), expected=steps[step])
            if expired and self.gc_after_retention:
                # This policy decides what this run keeps, nothing else: other refs' reflogs stay roots.
                self.repo.gc(expire_reflogs=(self.ref, self._prefix))

    def _check_best_metric(self, metrics: dict[str, Any]) -> None:
        """Refuse a save while ``keep_best`` ranks by a metric that no save has reported.

        A misspelt name ranks nothing, and retention would expire every step but the latest, the
        best one included. Once a retained step reported the metric, saves may leave it out (steps
        without an evaluation, say): they never rank.
        """
        if self.keep_best is None or self._metric in metrics or self._best_metric_stored:
            return
        reported = set(metrics)
        steps = self._step_refs()
        self._read_commits(steps.values())
        for cid in steps.values():
            stored = self._commit(cid).metadata.get("metrics")
            if isinstance(stored, dict):
                if self._metric in stored:
                    self._best_metric_stored = True
                    return
                reported.update(k for k in stored if isinstance(k, str))
        raise UnknownMetric(self.ref, str(self._metric), sorted(reported))


# -- interpreter exit ----------------------------------------------------------------------------
# The last checkpoint of a run is the one most needed, and a script that ends (or dies of an
# exception) right after an async save must not lose it. concurrent.futures makes every thread
# pool, Repository.pool included, refuse new work from a hook it registers with
# threading._register_atexit when it is imported; those hooks run, last registered first, as the
# main thread ends, before non-daemon threads are joined and long before atexit callbacks. This
# module imported concurrent.futures before it registers its own hook, so that hook runs first and
# the saves in flight can still use the pools.
_ASYNC_MANAGERS: weakref.WeakSet[CheckpointManager] = weakref.WeakSet()
_HOOK_LOCK = threading.Lock()
_hook_registered = False


def _finish_at_exit(manager: CheckpointManager) -> None:
    """Make the end of the main thread wait for ``manager``'s saves in flight."""
    global _hook_registered
    with _HOOK_LOCK:
        _ASYNC_MANAGERS.add(manager)
        if _hook_registered:
            return
        _hook_registered = True
    register = getattr(threading, "_register_atexit", atexit.register)  # private, in 3.9+
    with contextlib.suppress(RuntimeError):  # shutting down already: too late for any hook
        register(_finish_saves)


def _finish_saves() -> None:
    """Wait for every async save in flight, and replication; report each failure on stderr.

    A save that failed here lost a checkpoint: the process then exits non-zero (unless it already
    does, ended by an uncaught exception: that status stays). Replication that cannot catch up
    lost nothing (the checkpoints are local, and the run's next manager sends them): reported
    only, the exit status is the program's own.
    """
    failures = []
    lost = False
    managers = [m for m in list(_ASYNC_MANAGERS)
                if m._future is not None or (m._replicators and not m._closed)]
    for i, manager in enumerate(managers):
        try:
            manager._drain()
            if manager._replicators and not manager._closed:
                for replicator in manager._replicators:
                    replicator.finish()  # the run's last save reaches every tier too
                for replicator in manager._replicators:
                    replicator.wait()
        except SaveFailed as exc:
            failures.append(f"{exc}; the checkpoint was not saved")
            lost = True
        except ReplicationFailed as exc:
            failures.append(f"{exc}; the run's next manager on this repository sends them")
        except KeyboardInterrupt:
            interrupted = [m for m in managers[i:] if m._future is not None]
            failures.extend(
                f"interrupted at exit while the async save of step {m._pending_step} to {m.ref!r} "
                "was in flight; it may not be saved" for m in interrupted
            )
            lost = lost or bool(interrupted)
            break
    for message in failures:
        print(f"cas_ckpt: {message}", file=sys.stderr, flush=True)
    # An uncaught exception ending the main thread was printed (which sets sys.last_value) and
    # already makes the status 1; forcing 120 would only hide which failure came first.
    if lost and getattr(sys, "last_value", None) is None:
        _exit_status_120()


def _exit_status_120() -> None:
    """Make the interpreter exit with status 120 without cutting its shutdown short.

    Nothing an exit hook raises changes the exit status, and ``os._exit`` would skip the atexit
    callbacks and the output still buffered. Python itself exits 120 when flushing ``sys.stdout``
    fails at the very end of finalization (after every atexit callback ran); a stand-in stream
    whose flush fails only then gets that status. Its error is not printed again: the reason is.
    """
    name = "stdout" if sys.stdout is not None else "stderr"
    stream = _FailingFlush(getattr(sys, name))
    setattr(sys, name, stream)
    previous = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        if unraisable.object is not stream:
            previous(unraisable)

    sys.unraisablehook = hook


class _FailingFlush:
    """A stream that passes everything through, but whose flush fails once Python finalizes."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)

    def write(self, text: str) -> int:
        return len(text) if self._stream is None else int(self._stream.write(text))

    def flush(self) -> None:
        if self._stream is not None:
            self._stream.flush()
        if sys.is_finalizing():
            raise RepositoryError("an async save failed at exit (reported above)")


def _tiers(replicate_to: Any) -> list[Any]:
    tiers = list(replicate_to) if isinstance(replicate_to, (list, tuple)) else [replicate_to]
    if not tiers:
        raise ValueError("replicate_to is an empty list: give at least one tier, or None")
    return tiers


def _per_tier(value: Any, count: int, name: str) -> list[Any]:
    """One setting for every tier (a mapping or None), or a list with one per tier."""
    if value is None or isinstance(value, Mapping):
        return [value] * count
    values = list(value)
    if len(values) != count:
        raise ValueError(f"{name} lists {len(values)} settings for {count} tiers")
    return values


def _close_all(replicators: list[Replicator]) -> None:
    """Close every tier's replicator (each waits for its queue); the first failure is raised
    once all are closed: a dead tier does not stop the others' last pushes."""
    failure: BaseException | None = None
    for replicator in replicators:
        try:
            replicator.close()
        except BaseException as exc:  # raised below, once every tier was closed
            failure = failure or exc
    if failure is not None:
        raise failure


def _as_step(step: Any) -> int:
    """``step`` as a non-negative int: ints and numpy or torch integer scalars, not bools."""
    try:
        if isinstance(step, bool) or str(getattr(step, "dtype", "")).endswith("bool"):
            raise TypeError
        value = operator.index(step)
    except TypeError:
        raise ValueError(f"step must be a non-negative integer, not {step!r}") from None
    if value < 0:
        raise ValueError(f"step must be a non-negative integer, not {step!r}")
    return value


def _distributed() -> bool:
    """True when torch.distributed is imported, available and initialized (never imports it)."""
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


def _rank() -> int:
    """This process's rank in the default process group (0 without torch.distributed)."""
    return int(sys.modules["torch.distributed"].get_rank()) if _distributed() else 0


def _barrier() -> None:
    import torch.distributed as dist

    dist.barrier()


def _any_rank(flag: bool) -> bool:
    """``flag`` all-reduced with MAX over the default process group."""
    import torch
    import torch.distributed as dist

    device = torch.device("cpu")
    if dist.get_backend() == "nccl":  # NCCL reduces device tensors only
        device = torch.device("cuda", torch.cuda.current_device())
    value = torch.tensor([int(flag)], dtype=torch.int32, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def _metrics(metrics: Mapping[str, Any] | None) -> dict[str, Any]:
    """Metrics as plain numbers (numpy and torch scalars converted), checked now, not later."""
    out: dict[str, Any] = {}
    for key, value in (metrics or {}).items():
        if not isinstance(key, str):
            raise StateTypeError(f"metrics.{key}", "metric names must be str")
        out[key] = _metric(value, f"metrics.{key}")
    return out


def _metric(value: Any, path: str) -> Any:
    """One metric as a Python number; numpy scalars and one-element arrays or tensors unwrapped."""
    if type(value) in (int, float, bool):
        return value
    if hasattr(value, "item") and callable(value.item):
        count = _element_count(value)
        if count is not None and count != 1:
            shape = tuple(getattr(value, "shape", ()))
            raise StateTypeError(
                path, f"a metric must be one number, not a {type(value).__name__} of shape {shape}"
            )
        try:
            value = value.item()
        except (RuntimeError, ValueError, TypeError, NotImplementedError) as exc:  # a meta tensor
            raise StateTypeError(path, f"a metric must be one number; reading it failed: {exc}") from exc
    if type(value) not in (int, float, bool):
        raise StateTypeError(path, f"metrics must be numbers, not {type(value).__name__}")
    return value


def _element_count(value: Any) -> int | None:
    if isinstance(value, (np.ndarray, np.generic)):
        return int(value.size)
    numel = getattr(value, "numel", None)  # torch tensors, without importing torch
    return int(numel()) if callable(numel) else None


# Where a value sits in a state, one (container, key) pair per level: ("d", key) for a dict
# key (int and str kept apart), ("i", index) for a list or tuple item. Unlike the dotted path
# (which errors show), it never names two places alike: {"a.b": x} and {"a": {"b": y}}, or
# {0: x} and {"0": y}, once shared a host buffer and saved y twice.
Place = tuple[tuple[str, Any], ...]


def snapshot(state: Any, buffers: dict[Place, Any] | None = None) -> Any:
    """A copy of ``state`` that in-place updates of its arrays and tensors cannot reach.

    Tensors are copied to host memory (detached), numpy arrays copied; immutable values are shared.
    An object reached twice (tied weights) is copied once. ``buffers`` (place -> array or tensor,
    a place being a tuple of ``("d", key)`` and ``("i", index)`` steps): copies from an earlier
    snapshot no longer in use, refilled in place when shape and dtype still match (no new memory
    to fault in), each into at most one value; the dict is updated to this snapshot's copies.
    Raises :class:`StateTypeError` for values ``save`` would refuse.
    """
    return _Snapshot({} if buffers is None else buffers).copy(state, "", (), 0)


class _Snapshot:
    def __init__(self, buffers: dict[Place, Any]) -> None:
        self.old = dict(buffers)
        self.buffers = buffers
        buffers.clear()
        self.memo: dict[int, Any] = {}  # tied values are copied (and registered) once

    def copy(self, value: Any, path: str, place: Place, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise StateTypeError(path, f"nesting deeper than {MAX_DEPTH} levels")
        kind = type(value)
        if value is None or kind in (bool, int, float, str, bytes) or isinstance(
            value, (np.generic, CID)
        ):
            return value
        if isinstance(value, dict):
            out = {}
            for key, item in value.items():
                if type(key) not in (str, int):
                    raise StateTypeError(
                        join_path(path, key), f"dict keys must be str or int, not {type(key).__name__}"
                    )
                out[key] = self.copy(item, join_path(path, key), (*place, ("d", key)), depth + 1)
            return out
        if kind in (list, tuple):
            items = [
                self.copy(v, join_path(path, i), (*place, ("i", i)), depth + 1)
                for i, v in enumerate(value)
            ]
            return items if kind is list else tuple(items)
        if id(value) not in self.memo:
            self.memo[id(value)] = self.leaf(value, path, place)
        return self.memo[id(value)]

    def leaf(self, value: Any, path: str, place: Place) -> Any:
        old = self.old.pop(place, None)  # popped: an old buffer never backs two values
        if isinstance(value, np.ndarray):
            if dtype_name(value.dtype) is None:
                raise StateTypeError(path, f"unsupported array dtype {value.dtype}")
            if type(old) is np.ndarray and old.shape == value.shape and old.dtype == value.dtype:
                np.copyto(old, value)
                copy = old
            else:
                copy = np.array(value, copy=True, order="K")
        elif is_tensor(value):
            from cas_ckpt.integrations.torch import host_copy

            copy = host_copy(value, path, out=old)
        else:
            kind = type(value)
            raise StateTypeError(path, f"cannot save a value of type {kind.__module__}.{kind.__name__}")
        self.buffers[place] = copy
        return copy
