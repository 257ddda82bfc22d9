"""One writer per run: a manager's lease on its ref, across real processes, and its release."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import cas_ckpt
from cas_ckpt import CheckpointManager, _fs
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


FORKING_TRAINER = """
import multiprocessing, os, sys, threading
import cas_ckpt

repo = cas_ckpt.open(sys.argv[1])
manager = cas_ckpt.CheckpointManager(repo, "runs/a", async_save=True)  # the run's lease
manager.save(1, {"v": 1})
manager.wait()
saving = repo.refs_store.lock(exclusive=False)  # locks/gc.lock shared, as a save holds it
saving.__enter__()
updating = repo.refs_store._ref_lock("runs/a")  # locks/refs.lock, as a ref update holds it
updating.__enter__()


started, say_started = os.pipe()


def worker() -> None:  # a DataLoader worker: lives on, whatever happens to its parent
    os.write(say_started, b"!")  # running its own code: the after-fork hooks are done
    threading.Event().wait()


if sys.argv[2] == "multiprocessing":
    child = multiprocessing.get_context("fork").Process(target=worker)
    child.start()
    pid = child.pid
else:
    pid = os.fork()
    if pid == 0:
        worker()
os.read(started, 1)
print(pid, flush=True)
sys.stdin.readline()  # hold everything until killed
"""


def _lock_is_free(path: Path) -> bool:
    with _fs.flocked(path, exclusive=True, blocking=False) as held:
        return held


@pytest.mark.parametrize("fork", ["multiprocessing", "os.fork"])
def test_locks_are_not_held_by_forked_children_that_outlive_a_killed_trainer(
    tmp_path: Path, fork: str
) -> None:
    """A trainer with forked workers is SIGKILLed; the workers live on. Its lease, the GC lock
    and the ref lock must be free at once: the workers' copies of the descriptors were closed."""
    location = tmp_path / "repo"
    trainer = subprocess.Popen([sys.executable, "-c", FORKING_TRAINER, str(location), fork],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    worker = None
    try:
        assert trainer.stdout is not None
        worker = int(trainer.stdout.readline())
        with cas_ckpt.open(location) as repo:
            assert not _lock_is_free(location / "locks" / "gc.lock")  # the trainer holds them
            assert not _lock_is_free(location / "locks" / "refs.lock")
            with pytest.raises(LeaseHeld, match=f"pid {trainer.pid} "):
                CheckpointManager(repo, "runs/a")
            trainer.send_signal(signal.SIGKILL)
            trainer.wait(timeout=30)
            os.kill(worker, 0)  # the worker outlived it
            assert _lock_is_free(location / "locks" / "gc.lock")
            assert _lock_is_free(location / "locks" / "refs.lock")
            with CheckpointManager(repo, "runs/a") as resumed:  # no LeaseHeld naming a dead pid
                assert resumed.restore() == {"v": 1}
                resumed.save(2, {"v": 2})
            assert repo.gc().dry_run is False
    finally:
        if worker is not None:  # first: it holds the trainer's stdout open too
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker, signal.SIGKILL)
        trainer.kill()
        trainer.communicate(timeout=30)
