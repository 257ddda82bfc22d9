"""Child of test_fsck_races: a writer that saves and collects, or an fsck loop beside it.

``_fsck_child.py writer REPO ROUNDS SECONDS DONE``: up to ROUNDS rounds (or SECONDS, but never
before both sides did MIN_RUNS: on a loaded machine the time alone proves nothing), each a
manager save (``keep_last=1``: retention deletes a step ref and runs GC), a plain save to
``plain`` and ``repo.gc(reflog_expiry=0)``, so every round frees what the round before wrote.
Creates DONE when it stops; prints ``rounds collections``.

``_fsck_child.py fsck REPO DONE``: ``repo.fsck()`` in a loop until DONE exists, each run on a
freshly opened repository as ``cas-ckpt fsck`` does (its pack index read while GC repacks),
counting its runs in DONE.runs; prints one JSON line with the number of runs and every problem
reported (the repository is never damaged, so each one is a false report).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import _support

import cas_ckpt

MIN_RUNS = 10  # rounds of the writer and runs of fsck that overlap, whatever the time takes


def _runs_done(done: str) -> int:
    try:
        return int(Path(done + ".runs").read_text() or 0)
    except FileNotFoundError:
        return 0


def writer(repo_dir: str, rounds: int, seconds: float, done: str) -> None:
    deadline = time.monotonic() + seconds
    done_rounds = collections = 0
    try:
        with cas_ckpt.open(repo_dir) as repo:
            manager = cas_ckpt.CheckpointManager(repo, "run", keep_last=1)
            while done_rounds < rounds and (
                time.monotonic() < deadline or done_rounds < MIN_RUNS or _runs_done(done) < MIN_RUNS
            ):
                manager.save(done_rounds, _support.small_state("run", done_rounds))
                repo.save(_support.small_state("plain", done_rounds), ref="plain")
                repo.gc(reflog_expiry=0)
                done_rounds += 1
                collections += 2 if done_rounds > 1 else 1  # the manager's GC and this one
    finally:
        Path(done).touch()
    print(done_rounds, collections)


def fsck_loop(repo_dir: str, done: str) -> None:
    runs, reports = 0, []
    while not Path(done).exists():
        with cas_ckpt.open(repo_dir, create=False) as repo:
            reports.extend(_support.fsck_problems(repo))
        runs += 1
        Path(done + ".runs.tmp").write_text(str(runs))
        Path(done + ".runs.tmp").replace(done + ".runs")  # whole: the writer never reads it half
    print(json.dumps({"runs": runs, "reports": reports}))


if __name__ == "__main__":
    if sys.argv[1] == "writer":
        writer(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), sys.argv[5])
    else:
        fsck_loop(sys.argv[2], sys.argv[3])
