"""Child of test_concurrency: a saver or a GC loop.

``_conc_child.py saver REPO K SAVES LOG``: SAVES saves, alternating between the shared ref
``shared`` (compare-and-swap, retried on RefConflict) and the saver's own ``own/K``; after each
success appends ``REF CID DIGEST`` to LOG. After each save to its own ref it loads that ref back
and checks it bit for bit, while GC runs. Prints the number of conflicts retried.

``_conc_child.py gc REPO STOPFILE``: ``repo.gc(reflog_expiry=0)`` in a loop until STOPFILE exists; prints the
number of collections and of blocks they freed.

``_conc_child.py upkeep REPO STOPFILE``: ``repo.upkeep(force=True)`` (merging small packs, writing
an index snapshot) in a loop until STOPFILE exists; prints the number of runs and of packs merged.

An ``s3://`` REPO is opened with ``min_grace=0`` (GC may sweep what was just written), and the
loops pause longer between runs there: savers waiting out GC poll its lease every half second,
and a GC run back to back with the next would starve them.
"""

from __future__ import annotations

import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import _support
import numpy as np

import cas_ckpt

COMMON = np.random.default_rng(5).standard_normal(60_000)  # same blocks in every process


def state(k: int, i: int) -> dict[str, Any]:
    return {"k": k, "i": i, "common": COMMON, **_support.small_state(f"p{k}", i)}


def save_retrying(repo: cas_ckpt.Repository, value: Any, ref: str) -> tuple[Any, int]:
    conflicts = 0
    while True:
        try:
            return repo.save(value, ref=ref), conflicts
        except cas_ckpt.errors.RefConflict:
            conflicts += 1


def open_repo(location: str) -> cas_ckpt.Repository:
    options = {"storage_options": {"min_grace": 0.0}} if location.startswith("s3://") else {}
    return cas_ckpt.open(location, **options)  # type: ignore[arg-type]


def pause(location: str) -> float:
    return 0.3 if location.startswith("s3://") else 0.005


def saver(repo_dir: str, k: int, saves: int, log: str) -> None:
    conflicts = 0
    rng = random.Random(k)
    with open_repo(repo_dir) as repo, open(log, "a") as out:
        for i in range(saves):
            ref = "shared" if i % 2 == 0 else f"own/{k}"
            value = state(k, i)
            cid, n = save_retrying(repo, value, ref)
            conflicts += n
            out.write(f"{ref} {cid} {_support.digest(value)}\n")
            out.flush()
            if ref != "shared":
                got = _support.digest(repo.load(ref))
                assert got == _support.digest(value), f"{ref} loaded wrong while GC ran"
            # A training step between checkpoints. Without it, eight savers back to back always
            # hold the shared lock and GC (waiting for it exclusive) barely runs: flock has no
            # writer preference (see docs/reliability.md).
            time.sleep(rng.uniform(0, 0.02))
    print(conflicts)


def gc_loop(repo_dir: str, stop: str) -> None:
    runs = freed = 0
    with open_repo(repo_dir) as repo:
        while not os.path.exists(stop):
            freed += repo.gc(reflog_expiry=0).blocks_freed
            runs += 1
            time.sleep(pause(repo_dir))
    print(runs, freed)


def upkeep_loop(repo_dir: str, stop: str) -> None:
    runs = merged = 0
    with open_repo(repo_dir) as repo:
        while not os.path.exists(stop):
            report = repo.upkeep(force=True)
            merged += report.packs_merged
            runs += not report.skipped
            time.sleep(pause(repo_dir))
    print(runs, merged)


if __name__ == "__main__":
    if sys.argv[1] == "saver":
        saver(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
    elif sys.argv[1] == "upkeep":
        upkeep_loop(sys.argv[2], sys.argv[3])
    else:
        sys.argv[2].startswith("s3://") or Path(sys.argv[2]).exists() or sys.exit(2)
        gc_loop(sys.argv[2], sys.argv[3])
