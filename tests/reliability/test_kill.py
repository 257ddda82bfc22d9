"""Crash consistency under SIGKILL: a process saving multi-megabyte checkpoints is killed at random.

After every kill the repository must open, every ref must hold either the last checkpoint the child
logged as committed or the one it was saving (complete, whose parent is that last one), each loading
bit for bit as recorded; fsck must find nothing wrong, and leftovers (temp packs, stale ref locks)
must not get in the way: the next round saves again, and a final GC clears the temp packs.

CI: 30 kills. ``CAS_CKPT_LONG=1``: 1000.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest

import cas_ckpt
from cas_ckpt import cid as cidlib

from ._support import (
    HERE,
    LONG,
    PYTHON,
    Timer,
    child_env,
    digest,
    fsck_problems,
    leftovers,
    lines,
    record,
    small_state,
)

REFS = ("main", "runs/a", "runs/b/c")
KILLS = 1000 if LONG else 30
SCALE = 1.0
MAX_DELAY = 0.25
# Half the kills come within this of a save's start: a save takes 10-30 ms here, and with delays
# spread over MAX_DELAY alone only 20-50% of kills landed inside one (the test needs a quarter).
EARLY = 0.01


def _append(log: Path, line: str) -> None:
    with open(log, "a") as f:
        f.write(line + "\n")


def _expected(log: Path) -> tuple[dict[str, tuple[str, str]], tuple[str, int, str] | None, int]:
    """What the log says: ref -> (cid, digest) committed, the save in flight, the next index."""
    committed: dict[str, tuple[str, str]] = {}
    inflight: tuple[str, int, str] | None = None
    next_i = 0
    for parts in lines(log):
        kind = parts[0]
        if kind == "begin":
            inflight = (parts[1], int(parts[2]), parts[3])
            next_i = max(next_i, int(parts[2]) + 1)
        elif kind in ("done", "recovered"):
            committed[parts[1]] = (parts[3], parts[4])
            inflight = None
            next_i = max(next_i, int(parts[2]) + 1)
        elif kind == "gc-begin":
            inflight = None
    return committed, inflight, next_i


def _wait_for_a_save(log: Path, offset: int, timeout: float = 30.0) -> None:
    """Wait until the saver logged (past ``offset``) the start of a save: it opened the repo."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(log, "rb") as f:
            f.seek(offset)
            if b"begin " in f.read():
                return
        time.sleep(0.002)
    raise AssertionError("the saver did not start saving")


def _verify(repo_dir: Path, log: Path, figures: dict[str, int]) -> None:
    committed, inflight, _ = _expected(log)
    with cas_ckpt.open(repo_dir, create=False) as repo:
        refs = {name: str(cid) for name, cid in repo.refs().items()}
        assert set(refs) <= set(REFS), f"unexpected refs {set(refs) - set(REFS)}"
        for ref in REFS:
            value = refs.get(ref)
            last = committed.get(ref)
            if value is None:
                assert last is None, f"{ref}: committed {last[0]} but the ref is gone"
                continue
            if last is not None and value == last[0]:
                assert digest(repo.load(ref)) == last[1], f"{ref}: {value} does not load bit-exact"
                figures["refs_at_committed"] += 1
            else:
                assert inflight is not None and inflight[0] == ref, (
                    f"{ref} holds {value}: neither the committed {last} nor a save in flight"
                )
                parents = [str(p) for p in repo.commit(value).parents]
                assert parents == ([last[0]] if last else []), (
                    f"{ref}: in-flight checkpoint {value} has parents {parents}, expected {last}"
                )
                assert digest(repo.load(ref)) == inflight[2], (
                    f"{ref}: the in-flight checkpoint {value} does not load as what was saved"
                )
                _append(log, f"recovered {ref} {inflight[1]} {value} {inflight[2]}")
                figures["refs_at_inflight"] += 1
            news = [cidlib.to_str(e.new) for e in repo.reflog(ref) if e.new]
            assert value in news, f"{ref}: {value} is not in its reflog"
        problems = fsck_problems(repo)
        assert not problems, f"fsck after a kill: {problems}"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_sigkill_during_saves(tmp_path: Path) -> None:
    repo_dir, log, err = tmp_path / "repo", tmp_path / "log", tmp_path / "child.err"
    cas_ckpt.open(repo_dir).close()
    log.touch()
    rng = random.Random(20240601)
    timer = Timer()
    figures = {
        "kills": 0,
        "kills_mid_save": 0,
        "refs_at_committed": 0,
        "refs_at_inflight": 0,
        "temp_packs_seen": 0,
        "stale_locks_seen": 0,
        "saves_committed": 0,
    }
    with open(err, "w") as errf:
        zygote = subprocess.Popen(
            [PYTHON, str(HERE / "_kill_child.py"), str(repo_dir), str(log), "7", str(SCALE)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=errf,
            text=True,
            env=child_env(),
        )
    try:
        assert zygote.stdout is not None and zygote.stdin is not None
        assert zygote.stdout.readline().strip() == "ready"
        for _ in range(KILLS):
            next_i = _expected(log)[2]
            offset = log.stat().st_size
            zygote.stdin.write(f"run {next_i} {rng.randrange(2**32)}\n")
            zygote.stdin.flush()
            pid = int(zygote.stdout.readline())
            _wait_for_a_save(log, offset)  # however slow the machine, kill while saving
            time.sleep(rng.uniform(0.0, EARLY if rng.random() < 0.5 else MAX_DELAY))
            os.kill(pid, signal.SIGKILL)
            status = zygote.stdout.readline().split()
            assert status[0] == "exit"
            assert os.WIFSIGNALED(int(status[1])), f"the saver died by itself: {err.read_text()}"
            figures["kills"] += 1
            _, inflight, _ = _expected(log)
            figures["kills_mid_save"] += inflight is not None
            found = leftovers(repo_dir)
            figures["temp_packs_seen"] += len(found["temp_packs"])
            figures["stale_locks_seen"] += len(found["locks"])
            _verify(repo_dir, log, figures)
    finally:
        zygote.kill()
        zygote.communicate()
    committed, _, _ = _expected(log)
    figures["saves_committed"] = sum(1 for p in lines(log) if p[0] in ("done", "recovered"))
    # The kills must land in the middle of things for the test to mean anything.
    assert figures["saves_committed"] >= KILLS // 4, "too few saves committed"
    assert figures["kills_mid_save"] >= KILLS // 4, "too few kills landed inside a save"

    # Leftovers are recovered: a later save works on every ref (stale locks broken), GC removes
    # the dead writers' temp packs, and nothing is left behind.
    with cas_ckpt.open(repo_dir, create=False) as repo:
        for n, ref in enumerate(REFS):
            cid = repo.save(small_state(ref, n), ref=ref)
            assert str(repo.commit(cid).parents[0]) == committed[ref][0]
            assert digest(repo.load(ref)) == digest(small_state(ref, n))
        repo.gc()
        assert not fsck_problems(repo)
    found = leftovers(repo_dir)
    assert not found["temp_packs"] and not found["locks"], found
    figures["temp_files_ignored"] = len(found["temp_files"])
    record("kill", seconds=timer.seconds, **figures)
