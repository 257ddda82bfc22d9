"""Storage by run: each run's bytes, what runs share, and what GC would free, checked against
``repo.stats()``, ``repo.gc(dry_run=True)`` and what deleting a run really frees."""

from __future__ import annotations

from pathlib import Path

import numpy as np

import cas_ckpt
from cas_ckpt.maintenance.runs import LinkCache, run_of, storage


def test_run_of() -> None:
    assert run_of("runs/a.steps/000000000012") == "runs/a"
    assert run_of("runs/a") == "runs/a"
    assert run_of("runs/a.steps/latest") == "runs/a.steps/latest"  # not a manager's step ref
    assert run_of(".steps/000000000001") == ".steps/000000000001"


def make_runs(path: Path) -> cas_ckpt.Repository:
    repo = cas_ckpt.open(path)
    rng = np.random.default_rng(0)
    base = {"w": rng.standard_normal(400_000).astype(np.float32), "b": np.zeros(8000, np.float32)}
    with cas_ckpt.CheckpointManager(repo, "runs/a") as a:  # keeps every step: no expired commit
        for step in (1, 2):
            base["b"] = base["b"] + 1
            a.save(step, base)
    with cas_ckpt.CheckpointManager(repo, "runs/b", fork_from="runs/a") as b:
        b.save(3, {**base, "extra": rng.standard_normal(100_000)})
    repo.save({"alone": rng.standard_normal(50_000)}, ref="alone")
    return repo


def test_storage_by_run_agrees_with_the_repository(tmp_path: Path) -> None:
    with make_runs(tmp_path / "repo") as repo:
        report = storage(repo.blocks, repo.refs_store)
        usage = repo.stats()
        runs = {r.run: r for r in report.runs}
        assert sorted(runs) == ["alone", "runs/a", "runs/b"]
        assert runs["runs/a"].refs == ["runs/a", "runs/a.steps/000000000001", "runs/a.steps/000000000002"]
        assert report.stored_bytes == usage.stored_bytes and report.total_bytes == usage.total_bytes
        assert report.gc_would_free_bytes == repo.gc(dry_run=True).unreachable_bytes
        heads = {r.ref: r.logical_bytes for r in usage.refs}
        assert {name: r.logical_bytes for name, r in runs.items()} == {n: heads[n] for n in runs}
        shared = {(x, y): n for x, y, n in report.shared}
        a, b = runs["runs/a"], runs["runs/b"]
        assert shared == {("runs/a", "runs/b"): a.shared_bytes}  # alone shares nothing
        assert a.shared_bytes == b.shared_bytes > 1_000_000  # the fork point's weights
        assert runs["alone"].exclusive_bytes == runs["alone"].stored_bytes
        union = a.stored_bytes + b.stored_bytes - shared["runs/a", "runs/b"] + runs["alone"].stored_bytes
        assert union == report.stored_bytes


def test_a_runs_exclusive_bytes_are_what_deleting_it_frees(tmp_path: Path) -> None:
    with make_runs(tmp_path / "repo") as repo:
        before = storage(repo.blocks, repo.refs_store)
        exclusive = next(r.exclusive_bytes for r in before.runs if r.run == "runs/b")
        for name in [n for n in repo.refs() if run_of(n) == "runs/b"]:
            repo.delete_ref(name)
        assert storage(repo.blocks, repo.refs_store, reflog_expiry=0).gc_would_free_bytes == exclusive
        repo.gc(reflog_expiry=0)
        after = storage(repo.blocks, repo.refs_store)
        assert before.total_bytes - after.total_bytes == exclusive


def test_the_link_cache_reads_each_node_once(tmp_path: Path) -> None:
    with make_runs(tmp_path / "repo") as repo:
        cache = LinkCache(repo.blocks)
        first = storage(repo.blocks, repo.refs_store, cache=cache)
        reads = 0
        get = repo.blocks.get

        def counted(*args: object, **kwargs: object) -> bytes:
            nonlocal reads
            reads += 1
            return get(*args, **kwargs)  # type: ignore[arg-type]

        repo.blocks.get = counted  # type: ignore[method-assign]
        again = storage(repo.blocks, repo.refs_store, cache=cache)
        assert reads == 0 and again == first


def test_gc_estimate_keeps_what_history_links_keep(tmp_path: Path) -> None:
    with cas_ckpt.open(tmp_path / "repo") as repo:
        with cas_ckpt.CheckpointManager(repo, "run", keep_last=1) as manager:  # steps 1, 2 expire
            for step in (1, 2, 3):
                manager.save(step, {"w": np.full(50_000, step, np.float32)})
        repo.save({"junk": np.ones(30_000)}, ref="tmp")
        repo.delete_ref("tmp")
        assert sum(repo.expired(c) for c in repo.log("run")) == 2  # their commit nodes stay
        for expiry in (0.0, 30 * 86400.0):
            estimate = storage(repo.blocks, repo.refs_store, reflog_expiry=expiry)
            dry = repo.gc(dry_run=True, reflog_expiry=expiry)
            assert estimate.gc_would_free_bytes == dry.unreachable_bytes
            # tmp's junk: its deleted ref's reflog keeps it until the entry expires
            assert (dry.unreachable_bytes > 240_000) == (expiry == 0.0)
