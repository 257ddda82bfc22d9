"""Kill a training process with SIGKILL right after a checkpoint, resume it, and get the same bits.

Each training script runs 20 steps straight through in one process; a second copy is killed right
after step 10's checkpoint and resumed in a third process. Per-step losses, final parameters and
optimizer state must be bit-identical to the uninterrupted run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import assert_bit_identical

import cas_ckpt

SCRIPTS = Path(__file__).parent / "scripts"
STEPS, KILL_AFTER = 20, 10


def start(script: str, repo: Path, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(SCRIPTS / script), str(repo), str(STEPS), *extra],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def losses(lines: list[str]) -> dict[int, str]:
    return {int(p[1]): p[2] for p in (line.split() for line in lines) if p and p[0] == "loss"}


def finish(proc: subprocess.Popen[str]) -> list[str]:
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    return out.splitlines()


def run_killed(script: str, repo: Path) -> list[str]:
    """Run until step KILL_AFTER's checkpoint is saved, then SIGKILL the process."""
    proc = start(script, repo, "--pause-after", str(KILL_AFTER))
    assert proc.stdout is not None
    lines: list[str] = []
    try:
        for line in proc.stdout:
            lines.append(line.strip())
            if line.strip() == f"SAVED {KILL_AFTER}":
                os.kill(proc.pid, signal.SIGKILL)
                break
    finally:
        proc.kill()
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL, err
    assert lines[-1] == f"SAVED {KILL_AFTER}", err
    return lines


def run_both(script: str, tmp_path: Path) -> tuple[cas_ckpt.Repository, cas_ckpt.Repository]:
    straight_repo, resumed_repo = tmp_path / "straight", tmp_path / "resumed"
    straight = start(script, straight_repo)  # runs alongside the interrupted one
    killed_lines = run_killed(script, resumed_repo)
    straight_lines = finish(straight)
    with cas_ckpt.open(resumed_repo) as repo:
        assert retained_steps(repo) == [5, 10]  # nothing after step 10 was saved
    resumed_lines = finish(start(script, resumed_repo))
    first, second = losses(killed_lines), losses(resumed_lines)
    assert sorted(first) == list(range(1, KILL_AFTER + 1))
    assert sorted(second) == list(range(KILL_AFTER + 1, STEPS + 1))  # resumed after step 10
    assert {**first, **second} == losses(straight_lines)  # every loss, bit for bit
    return cas_ckpt.open(straight_repo), cas_ckpt.open(resumed_repo)


def retained_steps(repo: cas_ckpt.Repository) -> list[int]:
    with cas_ckpt.CheckpointManager(repo, "run") as manager:  # one manager per run at a time
        return manager.steps()


def compare_runs(straight: cas_ckpt.Repository, resumed: cas_ckpt.Repository) -> None:
    for step in (15, 20):  # both retained checkpoints, the async ones included
        with cas_ckpt.CheckpointManager(straight, "run") as one, \
                cas_ckpt.CheckpointManager(resumed, "run") as other:
            a, b = one.restore(step), other.restore(step)
        assert_bit_identical(a, b, f"step{step}")
    assert straight.commit("run").tree == resumed.commit("run").tree  # the same state, hashed
    assert [c.step for c in resumed.log("run")] == [20, 15, 10, 5]
    assert straight.fsck().ok and resumed.fsck().ok


def test_torch_training_resumes_bit_for_bit_after_sigkill(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    straight, resumed = run_both("train_torch.py", tmp_path)
    with straight, resumed:
        compare_runs(straight, resumed)
        final = resumed.load("run")
        assert set(final) == {"model", "optimizer", "scheduler", "rng", "extra"}
        assert set(final["optimizer"]["state"]) == {0, 1, 2, 3}  # int keys, as torch has them
        assert final["optimizer"]["state"][0]["step"].item() == 20.0
        assert isinstance(final["optimizer"]["param_groups"][0]["betas"], tuple)
        assert type(final["model"]["0.weight"]) is torch.Tensor


def test_numpy_training_resumes_bit_for_bit_after_sigkill(tmp_path: Path) -> None:
    straight, resumed = run_both("train_numpy.py", tmp_path)
    with straight, resumed:
        compare_runs(straight, resumed)
        final = resumed.load("run")
        assert final["adam"]["t"] == 20 and type(final["params"]["w1"]) is np.ndarray
