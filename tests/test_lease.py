"""One writer per run: a manager's lease on its ref, across real processes, and its release."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import cas_ckpt
from cas_ckpt import CheckpointManager
from cas_ckpt.errors import LeaseHeld

HOLDER = """
import sys, cas_ckpt
options = {"lease_timeout": 1.0} if sys.argv[1].startswith("s3") else None
repo = cas_ckpt.open(sys.argv[1], storage_options=options)
manager = cas_ckpt.CheckpointManager(repo, "runs/a")
manager.save(1, {"v": 1})
print("held", flush=True)
sys.stdin.readline()  # hold until told (or killed)
"""


def hold(location: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, location], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if line != "held\n":
        proc.kill()
        raise AssertionError(proc.communicate()[1])
    return proc


def test_a_second_process_fails_naming_the_holder_and_sigkill_frees_it_at_once(
    tmp_path: Path,
) -> None:
    location = str(tmp_path / "repo")
    proc = hold(location)
    try:
        with cas_ckpt.open(location) as repo:
            with pytest.raises(LeaseHeld, match=rf"'runs/a' is being written by pid {proc.pid} ") as info:
                CheckpointManager(repo, "runs/a")
            assert info.value.ref == "runs/a" and f"pid {proc.pid}" in info.value.holder
            CheckpointManager(repo, "runs/b").close()  # other runs are free
            repo.save({"v": 2}, ref="runs/a", step=2)  # plain saves ignore leases: still CAS
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
            with CheckpointManager(repo, "runs/a") as manager:  # no wait, no timeout
                assert manager.latest_step() == 2
    finally:
        proc.kill()
        proc.communicate(timeout=30)


def test_a_lease_held_here_stops_another_process(tmp_path: Path) -> None:
    location = str(tmp_path / "repo")
    with cas_ckpt.open(location) as repo, CheckpointManager(repo, "runs/a"):
        result = subprocess.run(
            [sys.executable, "-c", HOLDER, location], capture_output=True, text=True, timeout=60,
            check=False,
        )
    assert result.returncode == 1 and result.stdout == ""
    assert f"LeaseHeld: ref 'runs/a' is being written by pid {os.getpid()} " in result.stderr
    proc = hold(location)  # closed: free again
    proc.kill()
    proc.communicate(timeout=30)


def test_close_releases_and_takeover_fails_the_old_holder(repo: cas_ckpt.Repository) -> None:
    first = CheckpointManager(repo, "run")
    with pytest.raises(LeaseHeld, match=f"pid {os.getpid()} on host"):
        CheckpointManager(repo, "run")
    first.close()
    second = CheckpointManager(repo, "run")
    second.save(1, {"v": 1})
    third = CheckpointManager(repo, "run", takeover=True)
    with pytest.raises(LeaseHeld, match="took this manager's lease over"):
        second.save(2, {"v": 2})
    assert third.steps() == [1] and third.save(2, {"v": 2}) is not None
    second.close()  # releasing a lease taken over leaves the new holder's alone
    with pytest.raises(LeaseHeld):
        CheckpointManager(repo, "run")
    third.close()
    CheckpointManager(repo, "run").close()


def test_an_async_save_after_a_takeover_fails_at_once(repo: cas_ckpt.Repository) -> None:
    old = CheckpointManager(repo, "run", async_save=True)
    new = CheckpointManager(repo, "run", takeover=True)
    with pytest.raises(LeaseHeld):
        old.save(1, {"v": 1})
    new.close()
    old.close()
    assert not repo.refs()


def test_a_read_only_manager_takes_no_lease(tmp_path: Path) -> None:
    with cas_ckpt.open(tmp_path / "repo") as repo, CheckpointManager(repo, "run") as writer:
        writer.save(1, {"v": 1})
        with cas_ckpt.open(tmp_path / "repo", read_only=True) as ro:
            assert CheckpointManager(ro, "run").restore() == {"v": 1}


def test_nested_and_odd_ref_names_have_their_own_leases(tmp_path: Path) -> None:
    with cas_ckpt.open(tmp_path / "repo") as repo:
        names = ["a", "a.lease", "a%2Fb", "x/a/b", "y" * 240 + "/" + "z" * 240]
        managers = [CheckpointManager(repo, name) for name in names]
        for manager in managers:
            manager.close()


def test_s3_lease_names_the_holder_and_goes_stale_when_it_dies(s3_url: str) -> None:
    proc = hold(s3_url)
    try:
        with cas_ckpt.open(s3_url, storage_options={"lease_timeout": 1.0}) as repo:
            with pytest.raises(LeaseHeld, match=f"pid {proc.pid} "):
                CheckpointManager(repo, "runs/a")
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
            deadline = time.monotonic() + 20
            while True:  # no heartbeat for lease_timeout: the lease is stale and removed
                try:
                    manager = CheckpointManager(repo, "runs/a")
                    break
                except LeaseHeld:
                    assert time.monotonic() < deadline
                    time.sleep(0.2)
            other = CheckpointManager(repo, "runs/a", takeover=True)
            with pytest.raises(LeaseHeld, match="took this manager's lease over"):
                manager.save(2, {"v": 2})
            other.close()
            manager.close()
            CheckpointManager(repo, "runs/a").close()
    finally:
        proc.kill()
        proc.communicate(timeout=30)
