"""Async saves at the edges of a process: interpreter exit, an uncaught exception, Ctrl-C.

Each test runs a real Python process. To make "a save is in flight" certain rather than likely,
the child holds the repository's exclusive (GC) lock while it saves, so the background write
cannot start until the lock is released: by a timer thread at exit, or by the child itself.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import cas_ckpt

SIZE = 1 << 20  # float64 values: 8 MiB, chunked, so hashing goes through the repository's pool

PRELUDE = f"""
import faulthandler, signal, sys, threading
faulthandler.register(signal.SIGUSR1, all_threads=True)  # a hung child shows where it waits
# Ctrl-C raises KeyboardInterrupt, as in a terminal, also where the tests run as a background job:
# there SIGINT is inherited ignored, and Python then installs no handler for it.
signal.signal(signal.SIGINT, signal.default_int_handler)
import numpy as np
import cas_ckpt

repo = cas_ckpt.open(sys.argv[1])
manager = cas_ckpt.CheckpointManager(repo, "run", async_save=True)
state = {{"w": np.random.default_rng(7).random({SIZE}), "step": 1}}
hold = repo.refs_store.lock(exclusive=True)  # the background write waits for this lock
hold.__enter__()
manager.save(1, state)
"""


def expected_state() -> dict[str, object]:
    return {"w": np.random.default_rng(7).random(SIZE), "step": 1}


def run_child(tmp_path: Path, body: str) -> subprocess.CompletedProcess[str]:
    code = PRELUDE + textwrap.dedent(body)
    return subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "repo")],
        cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False,
    )


def assert_saved(tmp_path: Path) -> None:
    with cas_ckpt.open(tmp_path / "repo") as repo:
        out = repo.load("run")
        assert repo.commit("run").step == 1 and "run.steps/000000000001" in repo.refs()
        assert repo.fsck().ok
    expected = expected_state()
    assert out["step"] == 1 and out["w"].dtype == np.float64
    assert out["w"].tobytes() == expected["w"].tobytes()  # type: ignore[union-attr]


RELEASE_LATER = "threading.Timer(0.3, hold.__exit__, (None, None, None)).start()\n"


def test_a_save_in_flight_when_the_script_ends_is_finished(tmp_path: Path) -> None:
    result = run_child(tmp_path, RELEASE_LATER + "print('main done')\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "main done\n" and result.stderr == ""
    assert_saved(tmp_path)


def test_a_save_in_flight_when_an_exception_ends_the_script_is_finished(tmp_path: Path) -> None:
    result = run_child(tmp_path, RELEASE_LATER + "raise RuntimeError('the training loop broke')\n")
    assert result.returncode == 1
    assert "RuntimeError: the training loop broke" in result.stderr
    assert "cas_ckpt" not in result.stderr.split("RuntimeError: the training loop broke")[-1]
    assert_saved(tmp_path)


def test_a_save_that_fails_at_exit_is_reported_and_the_exit_status_is_not_zero(
    tmp_path: Path,
) -> None:
    body = """
        other = cas_ckpt.open("memory://")
        foreign = other.save({"x": 1}, ref="x")  # a CID whose block ``repo`` does not hold
        hold.__exit__(None, None, None)
        manager.wait()
        manager.save(2, {"link": foreign})  # fails in the background; nobody waits for it
        print("main done")
    """
    result = run_child(tmp_path, body)
    assert result.returncode == 120  # Python's status for an error during cleanup
    assert result.stdout == "main done\n"
    assert "async save of step 2 to 'run' failed" in result.stderr, result.stderr
    assert "not saved" in result.stderr
    assert "Traceback" not in result.stderr  # one clear message, not an unraisable-error dump
    assert_saved(tmp_path)  # step 1 is intact; the ref did not move to a partial step 2


def test_ctrl_c_during_wait_stays_a_keyboard_interrupt_and_the_save_completes(
    tmp_path: Path,
) -> None:
    body = """
        try:
            print("waiting", flush=True)
            manager.wait()
        except BaseException as exc:
            print(type(exc).__name__, isinstance(exc, cas_ckpt.errors.CasCkptError), flush=True)
        hold.__exit__(None, None, None)
        print(manager.wait() == repo.resolve("run"), manager.steps(), flush=True)
        manager.close()
    """
    proc = subprocess.Popen(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(body), str(tmp_path / "repo")],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == "waiting\n"
        time.sleep(0.3)  # the child is blocked in wait(): the save cannot take the lock
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGUSR1)  # every thread's stack, to stderr
        time.sleep(1)
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"the child hung after Ctrl-C; its threads:\n{err[-8000:]}\nits output: {out!r}")
    finally:
        proc.kill()
        proc.communicate()  # reaped, its pipes closed, whatever happened
    assert proc.returncode == 0, err
    assert out.splitlines() == ["KeyboardInterrupt False", "True [1]"], err
    assert_saved(tmp_path)


def test_a_save_that_fails_at_exit_keeps_the_status_of_an_uncaught_exception(tmp_path: Path) -> None:
    body = """
        other = cas_ckpt.open("memory://")
        foreign = other.save({"x": 1}, ref="x")
        hold.__exit__(None, None, None)
        manager.wait()
        manager.save(2, {"link": foreign})  # fails in the background
        raise RuntimeError("the training loop broke")
    """
    result = run_child(tmp_path, body)
    assert result.returncode == 1, result.stderr  # the program's own failure, not 120
    assert "RuntimeError: the training loop broke" in result.stderr
    assert "async save of step 2 to 'run' failed" in result.stderr
    assert_saved(tmp_path)


def test_replication_behind_at_exit_is_reported_and_leaves_the_exit_status_alone(
    tmp_path: Path,
) -> None:
    """A manager left open with its remote unreachable: nothing is lost (the checkpoints are
    local), so the status is the script's own (0 here; pytest's 1 stayed 120 before)."""
    (tmp_path / "remote").write_text("not a repository")  # every push fails
    code = textwrap.dedent("""
        import sys
        import cas_ckpt
        repo = cas_ckpt.open(sys.argv[1])
        repo.save({"v": 0}, ref="run", step=0)
        manager = cas_ckpt.CheckpointManager(repo, "run", replicate_to=sys.argv[2])
        manager.save(1, {"v": 1})
        print("main done")
    """)
    result = subprocess.run([sys.executable, "-c", code, str(tmp_path / "repo"), str(tmp_path / "remote")],
                            cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "main done\n"
    assert "cas_ckpt: replication of 'run'" in result.stderr and "steps [0, 1]" in result.stderr
    assert "Traceback" not in result.stderr
    with cas_ckpt.open(tmp_path / "repo") as repo:
        assert repo.load("run") == {"v": 1}
