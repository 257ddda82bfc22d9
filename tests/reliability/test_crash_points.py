"""Every crash point of the commit protocol, with a process crash and with a power cut.

``_crash_child.py`` patches the ``os`` calls that change the disk in a forked child, lets the
protocol run up to the Nth of them and stops it there, for every N; at each point it images the
disk as a killed process leaves it and as three kinds of power cut leave it (unsynced data lost,
unsynced directory entries undone, or both), then checks each image: the repository opens, every
ref is at its old checkpoint or the new one (complete, bit for bit), fsck is clean, and a later save
and GC work and leave nothing behind. Once the protocol returned, the new state must be in every
image. Scenarios: creating a repository and its first save, a save to an existing ref, a save to a
new nested ref, moving and deleting refs, and GC repacking live blocks out of packs with garbage.

CI: one small pack size (several packs per save). ``CAS_CKPT_LONG=1``: three pack sizes.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path

import pytest

from ._support import HERE, LONG, PYTHON, Timer, child_env, record

SCENARIOS = ["init", "save", "new-ref", "refops", "gc"]
PACK_SIZES = [384 * 1024, 96 * 1024, 8 * 1024 * 1024] if LONG else [384 * 1024]
OPS = {"create", "write", "fsync", "link", "unlink", "replace", "mkdir"}


def _scratch(tmp_path: Path) -> tempfile.TemporaryDirectory[str] | None:
    """A tmpfs scratch directory when there is one: thousands of small files come and go."""
    shm = Path("/dev/shm")
    if shm.is_dir():
        try:
            return tempfile.TemporaryDirectory(dir=shm, prefix="cas-ckpt-crash-")
        except OSError:
            return None
    return None


@pytest.mark.parametrize("pack_size", PACK_SIZES)
def test_every_crash_point(tmp_path: Path, pack_size: int) -> None:
    timer = Timer()
    scratch = _scratch(tmp_path)
    work = Path(scratch.name) if scratch else tmp_path
    try:
        proc = subprocess.run(
            [PYTHON, str(HERE / "_crash_child.py"), str(work), str(pack_size), *SCENARIOS],
            capture_output=True,
            text=True,
            env=child_env(),
            timeout=900,
        )
    finally:
        if scratch:
            scratch.cleanup()
    assert proc.returncode == 0, proc.stderr[-5000:]
    outcome = json.loads(proc.stdout.strip().splitlines()[-1])
    failures = outcome["failures"]
    assert not failures, f"{len(failures)} bad images:\n" + "\n".join(failures[:40])

    # The harness really went through the protocol: every kind of step, both outcomes.
    assert set(outcome["kinds"]) >= OPS, outcome["kinds"]
    assert outcome["kinds"]["completed"] == len(SCENARIOS)
    states = outcome["states"]
    for key in (
        "save:main:old",
        "save:main:new",
        "new-ref:runs/x/y:absent",
        "new-ref:runs/x/y:new",
        "init:main:absent",
        "init:main:new",
        "init:recreated",
    ):
        assert states.get(key, 0) > 0, f"never saw {key}: {states}"
    assert outcome["points"] >= 100
    record(
        "crash_points",
        points=outcome["points"],
        images=outcome["images"],
        later_saves=outcome["later_saves"],
        seconds=timer.seconds,
        runs=1,
        **{f"points_{kind}": n for kind, n in outcome["kinds"].items()},
    )
