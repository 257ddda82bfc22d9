"""fsck beside writers and GC reports no damage that is not there.

One process saves and collects in a loop (a manager with ``keep_last=1``, whose retention deletes
step refs and runs GC, plus plain saves and ``gc(reflog_expiry=0)``), so what fsck read a moment ago
is collected under it; another runs ``fsck()`` over and over, each time on a freshly opened
repository (as ``cas-ckpt fsck`` from cron would). The repository is never damaged, so
every problem fsck reports is false. Afterwards a fresh fsck is clean and the heads load.
"""

from __future__ import annotations

import json
import subprocess
from collections import Counter
from pathlib import Path

import pytest

import cas_ckpt
from cas_ckpt import cid as cidlib

from ._support import HERE, LONG, PYTHON, Timer, child_env, fsck_problems, record

ROUNDS = 2000 if LONG else 300
SECONDS = 120.0 if LONG else 8.0


def test_fsck_beside_saves_and_gc_reports_nothing_false(tmp_path: Path) -> None:
    timer = Timer()
    repo_dir, done = tmp_path / "repo", tmp_path / "done"
    cas_ckpt.open(repo_dir).close()
    child, env = str(HERE / "_fsck_child.py"), child_env()
    writer = subprocess.Popen(
        [PYTHON, child, "writer", str(repo_dir), str(ROUNDS), str(SECONDS), str(done)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    checker = subprocess.Popen(
        [PYTHON, child, "fsck", str(repo_dir), str(done)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    try:
        out, err = writer.communicate(timeout=SECONDS + 120)
        assert writer.returncode == 0, err[-4000:]
    finally:
        done.touch()
        fsck_out, fsck_err = checker.communicate(timeout=120)
    assert checker.returncode == 0, fsck_err[-4000:]
    rounds, collections = map(int, out.split())
    result = json.loads(fsck_out)
    assert rounds >= 10 and result["runs"] >= 10, "fsck did not really run beside the writer"
    kinds = Counter(report.split()[0] for report in result["reports"])
    assert not kinds, f"false reports {dict(kinds)}, e.g. {result['reports'][:3]}"
    with cas_ckpt.open(repo_dir, create=False) as repo:
        assert not fsck_problems(repo)
        assert repo.load("run")["i"] == repo.load("plain")["i"] == rounds - 1
    record(
        "fsck_races", rounds=rounds, collections=collections, fsck_runs=result["runs"],
        seconds=timer.seconds,
    )


@pytest.mark.parametrize("read_only", [False, True])
def test_a_block_really_missing_is_still_reported(tmp_path: Path, read_only: bool) -> None:
    """The re-check only drops what a race explains: real damage survives it (read-only
    repositories re-check without the lock, which would be a write)."""
    with cas_ckpt.open(tmp_path / "repo") as repo:
        repo.save({"x": 1, "y": "two"})
        tree = cidlib.to_bytes(repo.commit("main").tree)
        repo.blocks.delete({tree})
    with cas_ckpt.open(tmp_path / "repo", create=False, read_only=read_only) as repo:
        report = repo.fsck()
    assert [(p.kind, p.cid, [str(w) for w in p.needed_by]) for p in report.problems] == [
        ("missing", cidlib.to_str(tree), ["main:<root>"])
    ]
