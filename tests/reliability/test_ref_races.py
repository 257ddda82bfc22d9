"""Ref updates racing in real processes: savers in separate pid namespaces, create/delete in one
directory, S3 reflog reads against racing writers.

The pid-namespace test needs root and ``unshare`` (util-linux) and skips, saying why, without them.
The local ones use the filesystem under pytest's ``tmp_path``; the S3 one runs on each S3 server
(moto, LocalStack). Counts grow with ``CAS_CKPT_LONG=1``.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

import cas_ckpt
from cas_ckpt import cid as cidlib

from ._support import HERE, LONG, PYTHON, child_env, record

CHILD = str(HERE / "_ref_child.py")


def _pid_namespace() -> list[str]:
    """The command prefix that runs a command in a new pid namespace (else the test skips)."""
    if os.geteuid() != 0:
        pytest.skip("needs root: a new pid namespace (unshare --pid) is made for each saver")
    tool = shutil.which("unshare")
    if tool is None:
        pytest.skip("needs unshare (util-linux) to put each saver in its own pid namespace")
    prefix = [tool, "--pid", "--fork", "--mount-proc"]
    probe = subprocess.run([*prefix, "true"], capture_output=True, text=True, timeout=60)
    if probe.returncode != 0:
        pytest.skip(f"cannot create a pid namespace here: {probe.stderr.strip()}")
    return prefix


@contextlib.contextmanager
def _racing(commands: list[list[str]], go: Path) -> Iterator[list[subprocess.Popen[str]]]:
    """Start the children, touch ``go`` once all are ready; kill any left running at the end."""
    procs = [
        subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=child_env())
        for command in commands
    ]
    try:
        for proc in procs:
            assert proc.stdout is not None
            ready = proc.stdout.readline().strip()
            assert ready == "ready", proc.communicate()[1][-4000:]
        go.touch()
        yield procs
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.communicate()


def _outputs(procs: list[subprocess.Popen[str]], timeout: float = 120) -> list[str]:
    """What each child printed after ``ready``, once all exited cleanly."""
    outputs = []
    for proc in procs:
        out, err = proc.communicate(timeout=timeout)
        assert proc.returncode == 0, err[-4000:]
        outputs.append(out)
    return outputs


def test_savers_in_separate_pid_namespaces_lose_no_commit(tmp_path: Path) -> None:
    """Two containers (same host name, own pid namespaces) save to one ref on a shared volume.

    Neither can see the other's pids. The savers' pids differ (the second starts three processes
    first), so a lock judged by its holder's pid looks dead to the other saver.
    """
    prefix = _pid_namespace()
    repo_dir, go = tmp_path / "repo", tmp_path / "go"
    cas_ckpt.open(repo_dir).close()
    true = shutil.which("true") or "/bin/true"
    count = 200 if LONG else 40
    commands = [
        # sh stays pid 1 (the saver is not its last command, so it is not exec'd) and spends
        # pids on `true` first: the saver is pid 2 in one namespace and pid 5 in the other.
        [*prefix, "sh", "-c", f'{(true + "; ") * spent}"$@"; exit $?', "sh",
         PYTHON, CHILD, "saver", str(repo_dir), str(go), name, str(count)]
        for name, spent in (("alpha", 0), ("beta", 3))
    ]
    with _racing(commands, go) as procs:
        outputs = _outputs(procs)
    saved = [line.split()[1] for out in outputs for line in out.splitlines()]
    assert len(set(saved)) == 2 * count
    with cas_ckpt.open(repo_dir) as repo:
        history = [str(c.cid) for c in repo.log("main")]
        lost = sorted(set(saved) - set(history))
        assert not lost, f"{len(lost)} of {len(saved)} saves that returned are not in the history"
        assert sorted(history) == sorted(saved)
        log = repo.reflog("main")
        assert [cidlib.to_str(e.new) for e in log] == history[::-1]
        assert all(a.new == b.old for a, b in itertools.pairwise(log))
    record("ref_races", pid_namespace_saves=len(saved))


def test_create_and_delete_in_one_directory_race_cleanly(tmp_path: Path) -> None:
    """``runs/a``, ``runs/b`` and ``runs/deep/c`` created and deleted by three processes, each
    delete pruning ``runs/`` when it empties (and each drop of the deleted ref's reflog the same
    under ``logs/``): no error, no ref without its reflog, nothing left."""
    root, go = tmp_path / "repo", tmp_path / "go"
    store = cas_ckpt.refs.LocalRefStore(root)
    store.ensure_dirs()
    refs, count = ["runs/a", "runs/b", "runs/deep/c"], 300 if LONG else 60
    commands = [[PYTHON, CHILD, "churn", str(root), str(go), ref, str(count)] for ref in refs]
    with _racing(commands, go) as procs:
        rounds = [int(out) for out in _outputs(procs)]
    assert rounds == [count] * len(refs)
    assert store.names() == [] and store.reflog_names() == []
    assert sorted(p.name for p in store.refs_dir.iterdir()) == []
    assert sorted(p.name for p in store.logs_dir.iterdir()) == []
    record("ref_races", create_delete_rounds=sum(rounds))


def test_s3_reflog_reads_while_writers_race(s3_url: str, tmp_path: Path) -> None:
    """4 processes set one S3 ref while this one reads its reflog: losers delete their entries,
    maybe after the reader listed them. Every read must be one chain from a head the ref held.
    (Real S3-protocol servers, moto and LocalStack, on 127.0.0.1: tests/conftest.py.)"""
    from cas_ckpt.refs.s3 import S3RefStore

    go, writers, count = tmp_path / "go", 4, 60 if LONG else 15
    store = S3RefStore(s3_url)
    commands = [[PYTHON, CHILD, "s3writer", s3_url, str(go), str(k), str(count)] for k in range(writers)]
    with _racing(commands, go) as procs:
        reads = 0
        while reads < 10 or any(proc.poll() is None for proc in procs):
            log = store.reflog("main")  # CorruptStore here was the bug: nothing is damaged
            assert log == [] or log[0].old is None
            assert all(a.new == b.old for a, b in itertools.pairwise(log))
            reads += 1
        set_by = {cid for out in _outputs(procs) for cid in out.split()}
    log = store.reflog("main")
    assert sorted(cidlib.to_str(e.new) for e in log) == sorted(set_by)
    assert log[-1].new == store.get("main")
    record("ref_races", s3_reflog_reads=reads)
