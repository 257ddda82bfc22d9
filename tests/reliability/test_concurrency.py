"""Concurrent saves and GC: no lost update, no live block deleted.

Several processes (3 in CI, 8 with ``CAS_CKPT_LONG=1``) each save (15 / 100 times), alternating
between one ref they all share (compare-and-swap, retried on RefConflict) and a ref of their own,
while another process runs ``repo.gc(reflog_expiry=0)`` in a loop (so every older checkpoint is
garbage). Then every successful save must be in its ref's reflog and first-parent history (the
shared history is exactly the successful saves: none lost, none invented), each ref's checkpoint
loads bit for bit, and fsck is clean. The same with threads sharing one Repository (a GC thread
and loads included).
"""

from __future__ import annotations

import contextlib
import subprocess
import threading
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import cas_ckpt
from cas_ckpt import cid as cidlib

from ._support import HERE, LONG, PYTHON, Timer, child_env, digest, fsck_problems, record, small_state

PROCESSES = 8 if LONG else 3
SAVES = 100 if LONG else 15
THREADS = 4
THREAD_SAVES = 60 if LONG else 12
# Each medium: a directory, and S3 on each of the tests' servers (moto and LocalStack, conftest.py).
S3_MEDIA = ("medium", "s3_server"), [
    pytest.param("local", None, id="local"),
    *(pytest.param("s3", kind, id=f"s3-{kind}") for kind in ("moto", "localstack")),
]


def _check(repo: cas_ckpt.Repository, saves: list[tuple[str, str, str]]) -> None:
    """``saves``: (ref, cid, digest) of every save that returned, in any order."""
    by_ref: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for ref, cid, dig in saves:
        by_ref[ref].append((cid, dig))
    for ref, done in by_ref.items():
        logged = {cidlib.to_str(e.new) for e in repo.reflog(ref) if e.new}
        missing = [cid for cid, _ in done if cid not in logged]
        assert not missing, f"{ref}: saves missing from the reflog: {missing}"
        history = [str(c.cid) for c in repo.log(ref)]
        assert sorted(history) == sorted(cid for cid, _ in done), (
            f"{ref}: first-parent history ({len(history)} commits) is not exactly the "
            f"{len(done)} successful saves: an update was lost or invented"
        )
        head = str(repo.resolve(ref))
        assert head == history[0]
        expected = dict(done)[head]
        assert digest(repo.load(ref)) == expected, f"{ref}: the head does not load bit-exact"
    problems = fsck_problems(repo)
    assert not problems, f"fsck: {problems}"


def test_processes_save_while_gc_runs(tmp_path: Path) -> None:
    timer = Timer()
    repo_dir, stop = tmp_path / "repo", tmp_path / "stop"
    cas_ckpt.open(repo_dir).close()
    env = child_env()
    child = str(HERE / "_conc_child.py")
    gc = subprocess.Popen(
        [PYTHON, child, "gc", str(repo_dir), str(stop)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    savers = [
        subprocess.Popen(
            [PYTHON, child, "saver", str(repo_dir), str(k), str(SAVES), str(tmp_path / f"log{k}")],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for k in range(PROCESSES)
    ]
    conflicts = 0
    try:
        for proc in savers:
            out, err = proc.communicate(timeout=600)
            assert proc.returncode == 0, err[-4000:]
            conflicts += int(out.split()[-1])
    finally:
        stop.touch()
        out, err = gc.communicate(timeout=120)
    assert gc.returncode == 0, err[-4000:]
    gc_runs, gc_freed = map(int, out.split())
    assert gc_runs >= 2 and gc_freed > 0, "GC did not really run alongside the saves"

    saves = [
        tuple(parts)
        for k in range(PROCESSES)
        for parts in (line.split() for line in (tmp_path / f"log{k}").read_text().splitlines())
    ]
    assert len(saves) == PROCESSES * SAVES
    with cas_ckpt.open(repo_dir, create=False) as repo:
        _check(repo, saves)  # type: ignore[arg-type]
        repo.gc(reflog_expiry=0)  # old checkpoints go; every head must survive whole
        heads = {cid: dig for ref, cid, dig in saves if str(repo.resolve(ref)) == cid}
        assert len(heads) == PROCESSES + 1
        for cid, dig in heads.items():
            assert digest(repo.load(cid)) == dig
        assert not fsck_problems(repo)
    record(
        "concurrency_processes",
        processes=PROCESSES,
        saves=len(saves),
        conflicts_retried=conflicts,
        gc_runs=gc_runs,
        seconds=timer.seconds,
    )


@pytest.mark.parametrize(*S3_MEDIA, indirect=["s3_server"])
def test_processes_save_while_upkeep_and_gc_run(
    tmp_path: Path, medium: str, s3_server: tuple[str, str] | None, request: pytest.FixtureRequest
) -> None:
    """Savers (each with its own automatic upkeep), a process running upkeep by force in a loop
    (merging small packs, writing index snapshots, deleting what they replace) and one running
    GC, all at once: every save is kept and loads, no index file is torn, fsck is clean; on a
    directory and on S3 (moto, LocalStack)."""
    timer = Timer()
    stop = tmp_path / "stop"
    location = request.getfixturevalue("s3_url") if medium == "s3" else str(tmp_path / "repo")
    options = {"storage_options": {"min_grace": 0.0}} if medium == "s3" else {}
    cas_ckpt.open(location, **options).close()  # type: ignore[arg-type]
    env, child = child_env(), str(HERE / "_conc_child.py")
    processes, saves_each = (PROCESSES, SAVES) if medium == "local" else (2, 10 if not LONG else SAVES)
    loops = {op: subprocess.Popen([PYTHON, child, op, location, str(stop)], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env=env) for op in ("gc", "upkeep")}
    savers = [subprocess.Popen([PYTHON, child, "saver", location, str(k), str(saves_each),
                                str(tmp_path / f"log{k}")],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
              for k in range(processes)]
    try:
        for proc in savers:
            _, err = proc.communicate(timeout=900)
            assert proc.returncode == 0, err[-4000:]
    finally:
        stop.touch()
        outputs = {op: proc.communicate(timeout=300) for op, proc in loops.items()}
    for op, proc in loops.items():
        assert proc.returncode == 0, outputs[op][1][-4000:]
    upkeeps, merged = map(int, outputs["upkeep"][0].split())
    assert upkeeps >= 2 and merged > 0, "upkeep did not really run alongside the saves"
    saves = [tuple(parts) for k in range(processes)
             for parts in (line.split() for line in (tmp_path / f"log{k}").read_text().splitlines())]
    assert len(saves) == processes * saves_each
    with cas_ckpt.open(location, create=False, **options) as repo:  # type: ignore[arg-type]
        assert repo.blocks.damaged() == {}
        _check(repo, saves)  # type: ignore[arg-type]
        repo.upkeep(force=True)
    with cas_ckpt.open(location, create=False, **options) as repo:  # type: ignore[arg-type]
        _check(repo, saves)  # type: ignore[arg-type]
        assert repo.upkeep_status().uncovered == 0  # type: ignore[union-attr]
    label = medium if s3_server is None or s3_server[0] == "moto" else f"{medium}_{s3_server[0]}"
    record("concurrency_upkeep", **{f"{label}_saves": len(saves), f"{label}_upkeeps": upkeeps,
                                    f"{label}_merged": merged}, seconds=timer.seconds)


def test_threads_share_a_repository(tmp_path: Path) -> None:
    timer = Timer()
    saves: list[tuple[str, str, str]] = []
    errors: list[BaseException] = []
    guard = threading.Lock()
    stop = threading.Event()
    counts = {"conflicts": 0, "gc_runs": 0, "loads": 0}
    common = np.random.default_rng(5).standard_normal(60_000)

    with cas_ckpt.open(tmp_path / "repo") as repo:

        def saver(k: int) -> None:
            try:
                for i in range(THREAD_SAVES):
                    ref = "shared" if i % 2 == 0 else f"own/{k}"
                    value: dict[str, Any] = {"k": k, "i": i, "common": common, **small_state(f"t{k}", i)}
                    while True:
                        try:
                            cid = repo.save(value, ref=ref)
                            break
                        except cas_ckpt.errors.RefConflict:
                            with guard:
                                counts["conflicts"] += 1
                    with guard:
                        saves.append((ref, str(cid), digest(value)))
                    if ref != "shared":
                        assert digest(repo.load(ref)) == digest(value)
                        with guard:
                            counts["loads"] += 1
            except BaseException as exc:
                errors.append(exc)

        def collector() -> None:
            try:
                while not stop.is_set():
                    repo.gc(reflog_expiry=0)
                    counts["gc_runs"] += 1
            except BaseException as exc:
                errors.append(exc)

        gc_thread = threading.Thread(target=collector)
        gc_thread.start()
        threads = [threading.Thread(target=saver, args=(k,)) for k in range(THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        stop.set()
        gc_thread.join()
        if errors:
            raise errors[0]
        assert counts["gc_runs"] >= 2
        _check(repo, saves)
    record(
        "concurrency_threads",
        threads=THREADS,
        saves=len(saves),
        conflicts_retried=counts["conflicts"],
        gc_runs=counts["gc_runs"],
        loads=counts["loads"],
        seconds=timer.seconds,
    )


def test_threads_load_while_gc_repacks(tmp_path: Path) -> None:
    """Loads in threads while GC in another thread keeps merging the packs they read from.

    Every GC here rewrites the small packs, the loaded checkpoint's among them, and drops the old
    ones: a reader must never see a closed (or reused) file descriptor, so never an error, and with
    ``verify=False`` (nothing re-hashed) never wrong bytes.
    """
    timer = Timer()
    errors: list[BaseException] = []
    stop = threading.Event()
    counts = {"loads": 0, "gc_runs": 0}
    with cas_ckpt.open(tmp_path / "repo") as repo:
        expected = {}
        for k in range(3):
            value = {"k": k, **small_state(f"load{k}", k), "big": np.full(300_000, k, dtype=np.int32)}
            repo.save(value, ref=f"keep/{k}")
            expected[f"keep/{k}"] = digest(value)

        def loader(verify: bool) -> None:
            try:
                while not stop.is_set():
                    for ref, want in expected.items():
                        assert digest(repo.load(ref, verify=verify)) == want, f"{ref} wrong bytes"
                        counts["loads"] += 1
            except BaseException as exc:
                errors.append(exc)

        def churn() -> None:
            try:
                i = 0
                while not stop.is_set():
                    repo.save(small_state("churn", i), ref="churn")
                    repo.gc(reflog_expiry=0)
                    counts["gc_runs"] += 1
                    i += 1
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=loader, args=(v,)) for v in (True, False, False)]
        threads.append(threading.Thread(target=churn))
        for t in threads:
            t.start()
        stop.wait(20.0 if LONG else 4.0)
        stop.set()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        assert counts["gc_runs"] >= 3 and counts["loads"] >= 10
        assert not fsck_problems(repo)
    record("loads_vs_repack", loads=counts["loads"], gc_runs=counts["gc_runs"], seconds=timer.seconds)


def test_refs_never_point_at_collected_checkpoints(tmp_path: Path) -> None:
    """set_ref / fork / pin to a checkpoint whose data GC removed (its commit stays in the history)
    are refused, and a thread moving refs back in history while another runs GC never leaves a ref
    at a partial checkpoint (which would also make every later GC refuse to run)."""
    with cas_ckpt.open(tmp_path / "repo") as repo:
        old = repo.save(small_state("old", 0), ref="main")
        repo.save(small_state("new", 1), ref="main")
        repo.gc(reflog_expiry=0)  # the old checkpoint's data goes; its commit node stays
        assert str(old) in [str(c.cid) for c in repo.log("main")]
        for call in (lambda: repo.set_ref("back", old), lambda: repo.fork(old, "f"), lambda: repo.pin(old)):
            try:
                call()
            except (cas_ckpt.errors.CheckpointExpired, cas_ckpt.errors.BlockNotFound):
                pass
            else:
                raise AssertionError("a ref or pin now names a checkpoint whose data is gone")
        assert repo.fsck().ok

        # Racing: one thread saves and moves "flip" between the two newest checkpoints, GC runs.
        errors: list[BaseException] = []
        stop = threading.Event()

        gone = (cas_ckpt.errors.CheckpointExpired, cas_ckpt.errors.BlockNotFound)

        def mover() -> None:
            try:
                i = 2
                while not stop.is_set():
                    head = repo.save(small_state("m", i), ref="main")
                    i += 1
                    for target in (head, *[c.cid for c in repo.log("main", limit=3)]):
                        with contextlib.suppress(*gone):  # ``errors`` is the failure list here
                            repo.set_ref("flip", target)
            except BaseException as exc:
                errors.append(exc)

        def collector() -> None:
            try:
                while not stop.is_set():
                    repo.gc(reflog_expiry=0)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=mover), threading.Thread(target=collector)]
        for t in threads:
            t.start()
        stop.wait(8.0 if LONG else 3.0)
        stop.set()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        assert not fsck_problems(repo)
        repo.load("flip")
