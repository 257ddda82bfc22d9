"""Preemption: real signals to a real training process, which saves at once and exits 0."""

from __future__ import annotations

import importlib.util
import os
import random
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import cas_ckpt
from cas_ckpt import CheckpointManager
from cas_ckpt.errors import RepositoryError

SCRIPT = Path(__file__).parent / "scripts" / "train_preempt.py"
STEPS = 120
GRACE = 20.0  # seconds from the signal to exit; SLURM and Kubernetes give 30 or more


def train(repo: Path, delay: float = 0.0, *dist: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), str(repo), str(STEPS), str(delay), *map(str, dist)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def finish(proc: subprocess.Popen[str], timeout: float = 60) -> list[str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    return out.splitlines()


def wait_for_step(proc: subprocess.Popen[str], step: int) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.strip() == str(step):
            return
    raise AssertionError(f"the child ended before step {step}")


def saved_step(lines: list[str]) -> int:
    [line] = [line for line in lines if line.startswith("saved ")]
    return int(line.split()[1])


def test_sigterm_saves_exits_0_and_the_resumed_run_is_bit_identical(tmp_path: Path) -> None:
    [done] = [line for line in finish(train(tmp_path / "whole")) if line.startswith("done")]
    target = random.randrange(2, STEPS - 20)
    proc = train(tmp_path / "cut", 0.01)
    wait_for_step(proc, target)
    proc.send_signal(signal.SIGTERM)
    stopped = saved_step(finish(proc, GRACE))
    assert target <= stopped < STEPS, f"signalled at step {target}"
    with cas_ckpt.open(tmp_path / "cut") as repo:
        assert repo.commit("run").step == stopped  # durable before the process exited
        with CheckpointManager(repo, "run") as reader:
            assert reader.latest_step() == stopped
    resumed = finish(train(tmp_path / "cut"))
    assert resumed[0] == str(stopped + 1) and resumed[-1] == done, f"signalled at step {target}"


def test_sigusr1_of_slurm_preempts_too(tmp_path: Path) -> None:
    proc = train(tmp_path / "repo", 0.01)
    wait_for_step(proc, 3)
    proc.send_signal(signal.SIGUSR1)
    assert saved_step(finish(proc, GRACE)) >= 3


def test_handlers_chain_to_the_previous_one_and_are_restored(repo: cas_ckpt.Repository) -> None:
    calls: list[int] = []

    def previous(signum: int, frame: object) -> None:
        calls.append(signum)

    before = signal.signal(signal.SIGUSR2, previous)
    try:
        mgr = CheckpointManager(repo, "run", preemption=True, preemption_signals=(signal.SIGUSR2,))
        assert not mgr.reached_preemption(1)
        signal.raise_signal(signal.SIGUSR2)
        assert calls == [signal.SIGUSR2] and mgr.reached_preemption(2)
        assert mgr.preempted_at == 2 and mgr.reached_preemption(3) and mgr.preempted_at == 2
        mgr.close()
        assert signal.getsignal(signal.SIGUSR2) is previous
    finally:
        signal.signal(signal.SIGUSR2, before)


def test_the_default_action_is_not_taken_and_comes_back_on_close(
    repo: cas_ckpt.Repository,
) -> None:
    before = signal.signal(signal.SIGUSR2, signal.SIG_DFL)  # SIG_DFL of SIGUSR2 kills the process
    try:
        with CheckpointManager(
            repo, "run", async_save=True, preemption=True, preemption_signals=(signal.SIGUSR2,)
        ) as mgr:
            mgr.save(1, {"w": np.zeros(4)})
            signal.raise_signal(signal.SIGUSR2)  # the test process survives it
            assert mgr.reached_preemption(1)
            cid = mgr.save(2, {"w": np.ones(4)}, force=True)  # synchronous now: returns the CID
            assert cid == repo.resolve("run") and mgr.steps() == [1, 2]
        assert signal.getsignal(signal.SIGUSR2) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGUSR2, before)


def test_handlers_need_the_main_thread(repo: cas_ckpt.Repository) -> None:
    errors: list[BaseException] = []

    def make() -> None:
        try:
            CheckpointManager(repo, "run", preemption=True)
        except BaseException as exc:  # handed to the main thread
            errors.append(exc)

    thread = threading.Thread(target=make)
    thread.start()
    thread.join()
    assert len(errors) == 1 and isinstance(errors[0], RepositoryError)
    assert "main thread" in str(errors[0])


@pytest.mark.torch
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_two_gloo_ranks_stop_at_the_same_step(tmp_path: Path) -> None:
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ranks = [train(tmp_path / "repo", 0.01, rank, 2, port) for rank in range(2)]
    try:
        wait_for_step(ranks[0], 5)
        ranks[0].send_signal(signal.SIGTERM)  # rank 1 is never signalled
        stopped = [saved_step(finish(proc, GRACE)) for proc in ranks]
    finally:
        for proc in ranks:
            proc.kill()
    assert stopped[0] == stopped[1] >= 5
    with cas_ckpt.open(tmp_path / "repo") as repo:
        assert [repo.commit(f"run-{r}").step for r in range(2)] == stopped
