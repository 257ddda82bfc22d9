"""SIGKILL during GC, CAR import, ref deletion, retention and upkeep (merging small packs, writing
index snapshots): nothing committed is lost or torn.

A real child process runs one operation in a loop (``_maint_child.py``) and is killed with SIGKILL
at a random moment inside it, several times. After every kill a fresh process's view must hold:
every checkpoint a ref names loads bit-exact, fsck finds nothing, and the next run of the same
operation works (leftover temp packs are cleaned, no lock is left held). CI kills each operation
``KILLS`` times; ``CAS_CKPT_LONG=1`` many more.
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

from ._support import HERE, LONG, PYTHON, child_env, digest, fsck_problems, make_state, record

KILLS = 40 if LONG else 4
KEEP = 3


def _setup(root: Path, car: Path) -> dict[str, str]:
    """A repository with ``keep/0..`` refs (what no operation may touch) and a CAR to import."""
    expected = {}
    with cas_ckpt.open(root) as repo:
        for i in range(KEEP):
            state = make_state(1, i, scale=0.05)
            repo.save(state, ref=f"keep/{i}")
            expected[f"keep/{i}"] = digest(state)
        with cas_ckpt.open(root.parent / "source") as source:
            state = make_state(2, 0, scale=0.05)
            source.save(state)
            source.export_car("main", car)
            expected["imported"] = digest(state)
    return expected


def _run_and_kill(op: str, root: Path, log: Path, car: Path, rng: random.Random) -> bool:
    """Start the child, kill it inside a round; True if the kill landed mid-round."""
    offset = log.stat().st_size if log.exists() else 0
    child = subprocess.Popen([PYTHON, str(HERE / "_maint_child.py"), op, str(root), str(log), str(car)],
                             env=child_env(), stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and child.poll() is None:
        if log.exists() and b"begin" in log.read_bytes()[offset:]:
            break
        time.sleep(0.005)
    assert child.poll() is None, f"{op} child ended by itself: {child.communicate()[1]}"
    time.sleep(rng.uniform(0.0, 0.4))
    child.send_signal(signal.SIGKILL)
    child.communicate()
    lines = log.read_text().splitlines()
    return bool(lines) and lines[-1].startswith("begin")


def _check(op: str, root: Path, log: Path, expected: dict[str, str]) -> None:
    with cas_ckpt.open(root, create=False) as repo:
        refs = repo.refs()
        for ref in (f"keep/{i}" for i in range(KEEP)):
            assert digest(repo.load(ref)) == expected[ref], f"{op}: {ref} changed"
        if "imported" in refs:
            assert digest(repo.load("imported")) == expected["imported"]
        assert not [r for r in refs if r.startswith("tmp/")] or op == "delete"
        for name in refs:
            repo.load(name)  # every ref names a complete checkpoint
        if op == "retention":
            lines = [p for p in map(str.split, log.read_text().splitlines())]
            begun = {int(p[1]) for p in lines if p[0] == "begin"}
            done = [int(p[1]) for p in lines if p[0] == "done"]
            # Closed before the next child starts: one manager per run at a time.
            with cas_ckpt.CheckpointManager(repo, "run", keep_last=2) as manager:
                latest = manager.latest_step()
                # The last step logged done, or a later one whose save returned before the kill.
                assert latest in begun and latest >= max(done, default=0), (latest, done[-1:])
                assert digest(manager.restore(latest)) == digest(make_state(5, latest, scale=0.05))
                steps = manager.steps()
                last_done = max(done, default=-1)
                assert steps[-1] == latest
                # keep_last held when the last save that returned had run its retention...
                assert len([s for s in steps if s <= last_done]) <= 2, (steps, last_done)
                # ...and the steps after it are saves a kill cut short before theirs (one each).
                assert all(s in begun for s in steps if s > last_done), (steps, last_done)
        problems = fsck_problems(repo)
        assert not problems, f"{op}: fsck after a kill: {problems}"
        assert repo.blocks.damaged() == {}, f"{op}: a torn pack or index file after a kill"


@pytest.mark.parametrize("op", ["gc", "import", "delete", "retention", "upkeep"])
def test_sigkill_during_maintenance(tmp_path: Path, op: str) -> None:
    root, log, car = tmp_path / "repo", tmp_path / "log", tmp_path / "x.car"
    expected = _setup(root, car)
    rng = random.Random(op)
    inside = 0
    for _ in range(KILLS):
        inside += _run_and_kill(op, root, log, car, rng)
        _check(op, root, log, expected)
    assert inside >= KILLS // 2, f"only {inside} of {KILLS} kills landed inside a {op}"
    # What the dead processes left (temp packs, locks) never blocks the next one.
    with cas_ckpt.open(root, create=False) as repo:
        repo.gc(reflog_expiry=0)
        assert not fsck_problems(repo)
        assert list((root / "tmp").glob("*.pack.tmp")) == []
    record("kill_maintenance", **{op: KILLS, f"{op}_inside": inside})


def test_the_child_is_real(tmp_path: Path) -> None:
    """The loop really runs operations (the kill test would pass vacuously on a child that idles)."""
    root, log, car = tmp_path / "repo", tmp_path / "log", tmp_path / "x.car"
    _setup(root, car)
    child = subprocess.Popen([PYTHON, str(HERE / "_maint_child.py"), "delete", str(root), str(log)],
                             env=child_env())
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (not log.exists() or log.read_text().count("done") < 3):
        time.sleep(0.01)
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    assert log.read_text().count("done") >= 3
