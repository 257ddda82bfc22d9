"""``du``: per-run totals, shared and exclusive bytes (what deleting a run frees, checked against
GC itself), one meaning of "unreachable" with ``gc --dry-run``, and what S3's ``min_grace`` keeps."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cas_ckpt
from cas_ckpt import cli
from cas_ckpt.records import put_array

CHUNK = 4096
RUNS = ("runs/a", "runs/b", "plain")
POOL = [np.full(6 * CHUNK // 8, i, dtype=np.float64) + np.arange(6 * CHUNK // 8) for i in range(5)]

# One step of a scenario: (what, run, contents) with contents two indices into POOL.
OPS = st.lists(
    st.tuples(st.sampled_from(["save", "save", "save", "fork", "pin", "delete"]),
              st.sampled_from(RUNS), st.tuples(st.integers(0, 4), st.integers(0, 4))),
    min_size=1, max_size=10,
)


def build(ops: list[tuple[str, str, tuple[int, int]]], keep_last: int | None) -> cas_ckpt.Repository:
    """The repository a scenario makes: runs/a and runs/b by managers (keep_last, their own GC),
    plain by plain saves; forks between runs, pins of heads, deleted plain refs; then a plain gc."""
    repo = cas_ckpt.open("memory://", chunk_size=CHUNK)
    step = 0  # one count for all runs: a fork continues its source's steps
    for what, run, (x, y) in ops:
        state = {"x": POOL[x], "y": POOL[y], "n": x * 10 + y}
        heads = repo.refs()
        if what == "save" and run == "plain":
            repo.save(state, ref=run)
        elif what == "save":
            step += 1
            with cas_ckpt.CheckpointManager(repo, run, keep_last=keep_last) as manager:
                manager.save(step, state)
        elif what == "fork" and run not in heads and heads:
            repo.fork(heads[sorted(heads)[x % len(heads)]], run)
        elif what == "pin" and run in heads:
            repo.pin(run)
        elif what == "delete" and run == "plain" and run in heads:
            repo.delete_ref(run)
    repo.gc()  # only what nothing keeps goes: du's figures then hold for the next gc as well
    return repo


def run_refs(repo: cas_ckpt.Repository, run: str) -> list[str]:
    return [name for name in repo.refs() if name == run or name.startswith(run + ".steps/")]


@settings(deadline=None)
@given(ops=OPS, keep_last=st.sampled_from([None, 1, 2]))
def test_exclusive_bytes_are_what_gc_frees_once_the_run_is_deleted(
    ops: list[tuple[str, str, tuple[int, int]]], keep_last: int | None
) -> None:
    with build(ops, keep_last) as repo:
        usage = repo.stats()
        runs = {r.run: r for r in usage.runs}
        assert set(runs) <= set(RUNS)
        for run in runs.values():
            assert 0 <= run.shared_bytes <= run.stored_bytes
            assert run.exclusive_bytes >= run.stored_bytes - run.shared_bytes
            assert run.refs == len(run_refs(repo, run.run))
    for name, figures in runs.items():
        with build(ops, keep_last) as repo:
            before = repo.stats().total_bytes
            for ref in run_refs(repo, name):
                repo.delete_ref(ref)
            repo.gc(expire_reflogs=[name, name + ".steps/"])
            assert before - repo.stats().total_bytes == figures.exclusive_bytes, name


@settings(deadline=None)
@given(ops=OPS, expiry=st.sampled_from([0.0, 30 * 86400.0]))
def test_du_and_gc_dry_run_mean_the_same_unreachable(
    ops: list[tuple[str, str, tuple[int, int]]], expiry: float
) -> None:
    with build(ops, None) as repo:
        for ref in run_refs(repo, "runs/b"):  # garbage: runs/b's data, held by its reflog only
            repo.delete_ref(ref)
        usage = repo.stats(reflog_expiry=expiry)
        report = repo.gc(dry_run=True, reflog_expiry=expiry)
        assert usage.unreachable_blocks == report.unreachable_blocks
        assert usage.unreachable_bytes == report.unreachable_bytes
        assert usage.live_blocks == report.live_blocks + report.lineage_blocks
        assert usage.freeable_bytes == usage.unreachable_bytes  # no minimum grace in memory
        freed = repo.gc(reflog_expiry=expiry)
        assert repo.stats().total_bytes == usage.total_bytes - usage.unreachable_bytes
        assert freed.blocks_freed == usage.unreachable_blocks


def test_a_run_with_history_a_fork_and_a_pin(tmp_path: Path) -> None:
    with cas_ckpt.open(tmp_path / "repo", chunk_size=CHUNK) as repo:
        with cas_ckpt.CheckpointManager(repo, "runs/a") as manager:
            for step in range(3):  # POOL[0] in every step, POOL[step + 1] in one
                manager.save(step, {"base": POOL[0], "w": POOL[step + 1]})
        repo.fork("runs/a", "runs/b")
        with cas_ckpt.CheckpointManager(repo, "runs/b") as manager:
            manager.save(10, {"base": POOL[0], "w": POOL[4]})
        repo.save({"w": POOL[1]}, ref="main")
        repo.pin("main")
        usage = repo.stats()
        a, b, main = (next(r for r in usage.runs if r.run == name) for name in ("runs/a", "runs/b", "main"))
        chunk = 6 * CHUNK  # an array of POOL: six chunks
        assert (a.refs, a.checkpoints) == (4, 3)  # the head and three steps, the head one of them
        # runs/a alone holds POOL[2] (step 1); POOL[3] (step 2) is runs/b's start too; POOL[1] is pinned.
        assert chunk <= a.exclusive_bytes < chunk + 4096
        assert 3 * chunk <= a.shared_bytes < a.stored_bytes
        assert chunk <= b.exclusive_bytes < chunk + 4096
        assert main.exclusive_bytes == 0 and main.shared_bytes == main.stored_bytes  # the pin holds it
        assert usage.unreachable_bytes == 0
        repo.delete_ref("main")  # the pin still holds its data
        assert repo.stats().unreachable_bytes == repo.gc(dry_run=True).unreachable_bytes == 0


def test_du_prints_runs_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with cas_ckpt.open(tmp_path / "repo", chunk_size=CHUNK) as repo:
        with cas_ckpt.CheckpointManager(repo, "runs/a") as manager:
            for step in range(2):
                manager.save(step, {"w": POOL[step]})
        put_array(repo, POOL[3])  # blocks nothing keeps: no ref, pin or reflog entry
        usage = repo.stats()
    assert cli.main(["--repo", str(tmp_path / "repo"), "du"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["RUN", "REFS", "CHECKPOINTS", "LOGICAL", "STORED", "SHARED", "EXCLUSIVE"]
    assert lines[1].split()[:3] == ["runs/a", "3", "2"]
    assert lines[-2].endswith(f"unreachable {cli.human(usage.unreachable_bytes)} "
                              f"(gc would free {cli.human(usage.unreachable_bytes)})")
    assert usage.upkeep is not None and lines[-1].startswith(f"storage: {usage.upkeep.packs} packs")
    assert usage.unreachable_bytes >= 6 * CHUNK
    assert cli.main(["--repo", str(tmp_path / "repo"), "du", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["runs"] == [{"run": "runs/a", "refs": 3, "checkpoints": 2, "logical_bytes": a.logical_bytes,
                             "stored_bytes": a.stored_bytes, "shared_bytes": 0,
                             "exclusive_bytes": a.exclusive_bytes} for a in usage.runs]
    assert data["unreachable_bytes"] == data["gc_would_free_bytes"] == usage.unreachable_bytes
    assert data["live_bytes"] == usage.live_bytes and data["held_bytes"] == 0
    assert cli.main(["--repo", str(tmp_path / "repo"), "du", "--by-ref"]) == 0
    assert capsys.readouterr().out.splitlines()[0].split() == ["REF", "LOGICAL", "STORED", "BLOCKS"]


def test_memory_grows_with_blocks_not_runs_times_blocks() -> None:
    big = np.arange(600 * CHUNK // 8, dtype=np.float64)  # 600 chunks every run shares

    def peak(runs: int) -> int:
        with cas_ckpt.open("memory://", chunk_size=CHUNK) as repo:
            for i in range(runs):
                repo.save({"big": big, "own": np.full(8, i)}, ref=f"runs/{i}")
            tracemalloc.start()
            try:
                repo.stats()
                return tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()

    one, many = peak(1), peak(30)
    assert many < 2.5 * one, (one, many)  # one owner set per run would be ~30 times as much


def test_gc_and_du_on_s3_say_what_min_grace_keeps(s3_url: str, capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    with cas_ckpt.open(s3_url, chunk_size=CHUNK) as repo:  # min_grace: an hour by default
        repo.save({"w": POOL[0]}, ref="keep")
        put_array(repo, POOL[1])  # unreachable at once
        dry = repo.gc(dry_run=True)
        assert dry.unreachable_bytes >= 6 * CHUNK and dry.min_grace == 3600
        assert dry.held_packs >= 1 and dry.held_blocks == dry.unreachable_blocks
        assert dry.held_bytes == dry.unreachable_bytes
        usage = repo.stats()
        assert usage.unreachable_bytes == dry.unreachable_bytes == usage.held_bytes
        assert usage.freeable_bytes == 0
        done = repo.gc()
        assert done.blocks_freed == 0 and done.held_bytes == dry.held_bytes
    monkeypatch.setenv(cli.ENV_REPO, s3_url)
    assert cli.main(["gc"]) == 0
    out = capsys.readouterr().out
    assert "younger than the medium's minimum grace (3600 s)" in out, out
    assert cli.main(["du"]) == 0
    assert f"(gc would free 0 B; {cli.human(usage.held_bytes)} more once young packs age)" in (
        capsys.readouterr().out)
    with cas_ckpt.open(s3_url, storage_options={"min_grace": 0.0}) as repo:
        assert repo.gc(dry_run=True).held_packs == 0
        freed = repo.gc()
        assert freed.blocks_freed == dry.unreachable_blocks and freed.held_bytes == 0
