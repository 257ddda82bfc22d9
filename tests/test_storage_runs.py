"""Storage by run as the browser view gives it: ``repo.stats()``'s runs (one definition of a run,
``refs.base.run_of``), checked against ``gc(dry_run=True)`` and what deleting a run really frees;
the view's link cache, which reads each node once."""

from __future__ import annotations

from pathlib import Path

import numpy as np

import cas_ckpt
from cas_ckpt.refs.base import run_of
from cas_ckpt.web.data import Browser, LinkCache


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


def test_storage_by_run_is_the_repositorys_usage(tmp_path: Path) -> None:
    with make_runs(tmp_path / "repo") as repo:
        report = Browser(repo).storage()
        usage = repo.stats()
        runs = {r["run"]: r for r in report["runs"]}
        assert sorted(runs) == ["alone", "runs/a", "runs/b"]
        assert runs["runs/a"]["refs"] == 3 and runs["runs/a"]["head"] == str(repo.resolve("runs/a"))
        assert report["stored_bytes"] == usage.stored_bytes and report["total_bytes"] == usage.total_bytes
        assert report["unreachable_bytes"] == repo.gc(dry_run=True).unreachable_bytes
        for r in usage.runs:
            assert runs[r.run]["stored_bytes"] == r.stored_bytes
            assert runs[r.run]["exclusive_bytes"] == r.exclusive_bytes
            assert runs[r.run]["shared_bytes"] == r.shared_bytes
        a, b = runs["runs/a"], runs["runs/b"]
        assert a["shared_bytes"] > 1_000_000 and b["shared_bytes"] > 1_000_000  # the fork point's weights
        assert runs["alone"]["shared_bytes"] == 0


def test_a_runs_exclusive_bytes_are_what_deleting_it_frees(tmp_path: Path) -> None:
    with make_runs(tmp_path / "repo") as repo:
        view = Browser(repo)
        before = view.storage()
        exclusive = next(r["exclusive_bytes"] for r in before["runs"] if r["run"] == "runs/b")
        assert exclusive > 0
        for name in [n for n in repo.refs() if run_of(n) == "runs/b"]:
            repo.delete_ref(name)
        repo.gc(expire_reflogs=["runs/b", "runs/b.steps/"])
        after = view.storage()  # the refs moved: worked out again
        assert before["total_bytes"] - after["total_bytes"] == exclusive
        assert "runs/b" not in {r["run"] for r in after["runs"]}


def test_the_link_cache_reads_each_node_once(tmp_path: Path) -> None:
    with make_runs(tmp_path / "repo") as repo:
        cache = LinkCache(repo.blocks)
        heads = [bytes(cid) for cid in repo.refs().values()]
        first = cache.reach(heads)
        reads = 0
        get = repo.blocks.get

        def counted(*args: object, **kwargs: object) -> bytes:
            nonlocal reads
            reads += 1
            return get(*args, **kwargs)  # type: ignore[arg-type]

        repo.blocks.get = counted  # type: ignore[method-assign]
        again = cache.reach(heads)
        assert reads == 0 and again == first
        assert first == set().union(*(cache.reach([h]) for h in heads))
