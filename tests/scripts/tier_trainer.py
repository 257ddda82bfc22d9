"""Trainers for ``tests/reliability/test_tier_kills.py``: a CheckpointManager on a RAM (tmpfs)
repository replicating every step to tiers (a peer's ``cas-ckpt serve --write-token``, a disk
folder), saving a deterministic state per step, for the test to SIGKILL.

Run as a zygote: ``tier_trainer.py`` imports everything once and prints ``ready``; for each line
``run JSON`` on stdin it forks a trainer (the JSON: :func:`train`'s keyword arguments), prints its
pid, waits for it and prints ``exit STATUS`` (``os.waitpid``'s). The trainer writes nothing to
stdout; its warnings (replication failures, conflicts) go to stderr, each line naming its ``tid``.

A trainer appends to ``log`` (each line fsynced, so a SIGKILL never tears one):

* ``start TID TIER STEP LATEST``: the manager is up; ``last_restore`` said where the run's latest
  step came from (``TIER``: ``local`` or a tier's location; ``STEP``, ``LATEST``: a step or ``-``);
* ``start-failed TID ERROR MESSAGE``: the manager refused to start (it then exits 0);
* ``begin STEP`` before each ``manager.save`` and ``saved STEP`` once it returned (without
  ``async_save``: durable in the RAM repository; with it: copied, written in the background);
* on SIGUSR1 the loop ends after the current step: ``stopping``, then ``closed`` once
  ``manager.close()`` returned (every save durable, every tier caught up) or ``close-failed ERROR
  MESSAGE``, then ``lag TIER REPLICATED_STEP QUEUED FAILURES`` for each tier.

:func:`state` is the state of a step: any step's bytes are recomputed from ``(tid, step)``.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import traceback
from typing import Any

import numpy as np

import cas_ckpt

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "reliability"))
from _support import append_line  # the reliability suite's fsynced log line

MiB = 1 << 20
FIXED = 2 * MiB  # bytes of the weights that never change (stored once per trainer)
MOVING = 2 * MiB  # bytes that change every step: what each push sends

_fixed: dict[int, np.ndarray[Any, Any]] = {}


def state(tid: int, step: int, moving: int = MOVING) -> dict[str, Any]:
    """The state trainer ``tid`` saves at ``step``: deterministic, distinct per trainer."""
    if tid not in _fixed:
        _fixed[tid] = np.random.default_rng([tid, 0]).standard_normal(FIXED // 8)
    rng = np.random.default_rng([tid, step, 1])
    return {
        "tid": tid,
        "step": step,
        "fixed": _fixed[tid],
        "moving": rng.standard_normal(moving // 8).astype(np.float64),
        "opt": {"m": rng.standard_normal((64, 33)).astype(np.float16), "count": np.int64(step)},
        "lr": 0.1 / (step + 1),
        "small": np.arange(step % 5 + 1, dtype=np.int16),
    }


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__} {' '.join(str(exc).split())}"


def train(*, repo: str, ref: str, tid: int, tiers: list[str], token: str, async_save: bool, log: str,
          pause: float = 0.02, keep_last: int = 2, remote_keep: list[int] | None = None,
          max_steps: int = 10_000) -> int:
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING,
                        format=f"%(asctime)s tid={tid} pid={os.getpid()} %(name)s %(levelname)s %(message)s")
    stop = threading.Event()
    signal.signal(signal.SIGUSR1, lambda *_: stop.set())
    keep = remote_keep or [3] * len(tiers)  # per tier: keep_last there (0: keep every step)
    options = [{"token": token} if t.startswith("http") else None for t in tiers]
    try:
        manager = cas_ckpt.CheckpointManager(
            repo, ref, keep_last=keep_last, async_save=async_save, replicate_to=list(tiers),
            remote_retention=[{"keep_last": k} if k else {} for k in keep], remote_storage_options=options)
    except cas_ckpt.CasCkptError as exc:  # a diverged run on a tier (another trainer's): refused
        append_line(log, f"start-failed {tid} {_one_line(exc)}")
        print(f"tid={tid} pid={os.getpid()} the manager refused to start: {_one_line(exc)}",
              file=sys.stderr, flush=True)
        return 0
    report = manager.last_restore
    latest = manager.latest_step()
    append_line(log, f"start {tid} {report.tier if report else 'local'} "
                 f"{'-' if report is None or report.step is None else report.step} "
                 f"{'-' if latest is None else latest}")
    step = 0 if latest is None else latest + 1
    for _ in range(max_steps):
        if stop.is_set():
            break
        append_line(log, f"begin {step}")
        manager.save(step, state(tid, step))
        append_line(log, f"saved {step}")
        step += 1
        stop.wait(pause)
    append_line(log, "stopping")
    try:
        manager.close()
        append_line(log, "closed")
    except cas_ckpt.CasCkptError as exc:
        append_line(log, f"close-failed {_one_line(exc)}")
        print(f"tid={tid} pid={os.getpid()} close failed: {_one_line(exc)}", file=sys.stderr, flush=True)
    for lag in manager.replication_lag or []:
        append_line(log, f"lag {lag.tier} {'-' if lag.replicated_step is None else lag.replicated_step} "
                     f"{lag.steps} {lag.failures}")
    return 0


def main() -> None:
    print("ready", flush=True)
    for command in sys.stdin:
        verb, _, payload = command.partition(" ")
        if verb != "run":
            continue
        args = json.loads(payload)
        pid = os.fork()
        if pid == 0:
            code = 4
            try:
                code = train(**args)
            except BaseException:
                traceback.print_exc()
                code = 3
            finally:
                sys.stderr.flush()
                os._exit(code)
        print(pid, flush=True)
        _, status = os.waitpid(pid, 0)
        print("exit", status, flush=True)


if __name__ == "__main__":
    main()
