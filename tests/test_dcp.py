"""torch.distributed.checkpoint through cas_ckpt.dcp: real gloo process groups on 127.0.0.1.

The many-rank tests run ``tests/scripts/dcp_worker.py`` as 2 or 3 processes; the rest run DCP in
this process without a process group.
"""

from __future__ import annotations

import gc
import importlib.util
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner  # noqa: E402
from torch.distributed.checkpoint.planner import SavePlanner  # noqa: E402

import cas_ckpt  # noqa: E402
from cas_ckpt.cid import to_bytes as cid_bytes  # noqa: E402
from cas_ckpt.codec import Link  # noqa: E402
from cas_ckpt.dcp import MixedCheckpoints, Reader, Writer, load_full  # noqa: E402
from cas_ckpt.tree import TreeReader  # noqa: E402

pytestmark = [
    pytest.mark.torch,
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
]

SCRIPTS = Path(__file__).parent / "scripts"
WORKER = SCRIPTS / "dcp_worker.py"
MiB = 1024 * 1024


def _worker_module() -> Any:
    spec = importlib.util.spec_from_file_location("dcp_worker", WORKER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


worker = _worker_module()


def run_ranks(
    scenario: str, world: int, repo: Path, out: Path, env: dict[str, str] | None = None
) -> list[int]:
    """Run one scenario as ``world`` processes; return their exit codes."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    child_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), scenario, str(rank), str(world), str(port), str(repo),
             str(out)],
            env=child_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )
        for rank in range(world)
    ]
    codes = []
    for proc in procs:
        try:
            output, _ = proc.communicate(timeout=600)  # 8 ranks on 2 busy cores
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        if proc.returncode not in (0, -signal.SIGKILL):
            print(output.decode(errors="replace"))
        codes.append(proc.returncode)
    return codes


def results(out: Path, scenario: str, world: int) -> list[dict[str, Any]]:
    return [json.loads((out / f"{scenario}-{rank}.json").read_text()) for rank in range(world)]


def expected_full(bump: float = 1.0) -> dict[str, Any]:
    """The state the third (async) save holds, unsharded."""
    full = worker.full_state()
    full["w"] = full["w"] + bump
    return full


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
    )


# --------------------------------------------------------------------------------------------
# Many ranks
# --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """A repository that 2 ranks saved into (see the ``save`` scenario)."""
    base = tmp_path_factory.mktemp("dcp")
    repo, out = base / "repo", base / "out"
    out.mkdir()
    assert run_ranks("save", 2, repo, out) == [0, 0]
    return repo, results(out, "save", 2)


def test_two_ranks_write_one_commit_per_save(saved: tuple[Path, list[dict[str, Any]]]) -> None:
    path, ranks = saved
    repo = cas_ckpt.open(path)
    for key in ("cid1", "cid2", "cid3"):  # every rank learns the commit from dcp.save's result
        assert ranks[0][key] == ranks[1][key]
    assert str(repo.resolve("main")) == ranks[0]["cid3"]
    assert [c.step for c in repo.log("main")] == [3, 2, 1]
    assert [str(c.cid) for c in repo.log("main")] == [ranks[0][k] for k in ("cid3", "cid2", "cid1")]
    report = repo.fsck()
    assert not report.problems and not report.store_problems


def test_replicas_differing_across_ranks_fail_the_save(saved: tuple[Path, list[dict[str, Any]]]) -> None:
    path, ranks = saved
    for rank in ranks:
        assert "ReplicaMismatch" in rank["mismatch"] and "'seed'" in rank["mismatch"]
    assert str(cas_ckpt.open(path).resolve("main")) == ranks[0]["cid3"]  # the ref did not move


def test_identical_bytes_are_stored_once(saved: tuple[Path, list[dict[str, Any]]]) -> None:
    path, ranks = saved
    # the 3 MiB replicated tensor is written by one rank only (DCP's dedup + the replica check)
    written = sum(r["written1"] for r in ranks)
    assert 8 * MiB <= written < 10 * MiB  # w 4 + z 1..2 (both ranks may race) + r 3
    # the two halves of z hold the same bytes: its two grid chunks are one block
    repo = cas_ckpt.open(path)
    tree = TreeReader(repo.blocks, repo.pool)
    z = tree.resolve(tree.resolve(tree.resolve(Link(cid_bytes(repo.tree("main"))))["model"])["z"]).value
    assert len(z["chunks"]) == 2 and z["chunks"][0] == z["chunks"][1]
    # an unchanged second save writes no chunk again
    assert [r["written2"] for r in ranks] == [0, 0]
    assert ranks[0]["packs2"] - ranks[0]["packs1"] < 4096
    assert repo.stats().total_bytes < 4 * MiB + 1 * MiB + 3 * MiB + 4 * MiB + 64 * 1024


def test_load_into_one_process_without_process_group(
    saved: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    path, _ = saved
    repo = cas_ckpt.open(path)
    full = expected_full()
    target = {
        "model": {name: torch.zeros_like(t) for name, t in full.items()},
        "step": 0,
        "opt": {"lr": None, "betas": None, "name": None},
    }
    dcp.load(target, storage_reader=Reader(repo, "main"))
    for name, tensor in full.items():
        assert same_bits(target["model"][name], tensor), name
    assert target["step"] == 3 and target["opt"] == {"lr": 0.1, "betas": (0.9, 0.999), "name": "adam"}
    whole = load_full(repo, "main")
    assert all(same_bits(whole["model"][n], t) for n, t in full.items())
    assert whole["opt"]["betas"] == (0.9, 0.999)


def test_load_into_three_ranks(saved: tuple[Path, list[dict[str, Any]]], tmp_path: Path) -> None:
    path, _ = saved
    repo = tmp_path / "repo"
    shutil.copytree(path, repo)
    assert run_ranks("load", 3, repo, tmp_path) == [0, 0, 0]
    for rank in results(tmp_path, "load", 3):
        # the ref moved between the Readers: refused on every rank before anything was copied
        assert "MixedCheckpoints" in rank["mixed"] and rank["untouched"]
        assert rank["exact"] == {"w": True, "z": True, "h": True, "r": True}
        assert rank["values"] == [3, 0.1, [0.9, 0.999], "adam"]


@pytest.mark.parametrize("victim", [0, 1])
def test_rank_killed_during_save_leaves_ref_and_repo_intact(
    saved: tuple[Path, list[dict[str, Any]]], tmp_path: Path, victim: int
) -> None:
    path, ranks = saved
    repo_path = tmp_path / "repo"
    shutil.copytree(path, repo_path)
    codes = run_ranks("kill", 2, repo_path, tmp_path, env={"CAS_CKPT_KILL_RANK": str(victim)})
    survivor = 1 - victim
    assert codes[victim] == -signal.SIGKILL and codes[survivor] == 0
    assert json.loads((tmp_path / f"kill-{survivor}.json").read_text())["raised"]
    repo = cas_ckpt.open(repo_path)
    assert str(repo.resolve("main")) == ranks[0]["cid3"]
    assert not repo.fsck().problems
    repo.gc()  # sweeps what the failed save stored, and the dead rank's temp pack
    assert not list((repo_path / "tmp").iterdir())
    report = repo.fsck()
    assert not report.problems and not report.store_problems
    whole = load_full(repo)
    assert all(same_bits(whole["model"][n], t) for n, t in expected_full().items())


def test_a_dcp_checkpoint_is_a_normal_checkpoint(
    saved: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    path, ranks = saved
    repo = cas_ckpt.open(path)
    state = repo.load("main")  # the state as the ranks saved it: whole tensors, nested
    full = expected_full()
    assert list(state) == ["model", "step", "opt"] and list(state["model"]) == ["r", "w", "z", "h"]
    assert all(same_bits(state["model"][n], t) for n, t in full.items())
    assert state["step"] == 3 and state["opt"] == {"lr": 0.1, "betas": (0.9, 0.999), "name": "adam"}
    assert same_bits(repo.load("main", path="model.w"), full["w"])  # reads only w's chunks
    changed = repo.diff(ranks[0]["cid1"], "main")  # tensors by their state names
    assert {c.path for c in changed.changed} == {"model.w"}
    assert {s.path for s in repo.stats("main", "model")} == {"model.r", "model.w", "model.z", "model.h"}
    with open(tmp_path / "c.car", "wb") as f:
        repo.export_car("main", f)
    other = cas_ckpt.open(tmp_path / "other")
    with open(tmp_path / "c.car", "rb") as f:
        other.import_car(f, ref="main")
    assert same_bits(load_full(other)["model"]["z"], full["z"])
    assert same_bits(other.load("main", path="model.h"), full["h"])


def test_the_ranks_state_is_the_tree_one_process_saves(
    saved: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    """The state node of a 2-rank DCP save is byte for byte what ``repo.save`` writes for the
    same state from one process: same chunks, same tensor nodes, same tree."""
    path, _ = saved
    repo_path = tmp_path / "repo"
    shutil.copytree(path, repo_path)
    repo = cas_ckpt.open(repo_path)
    full = expected_full()
    single = repo.save({"model": {n: full[n] for n in ("r", "w", "z", "h")}, "step": 3,
                        "opt": {"lr": 0.1, "betas": (0.9, 0.999), "name": "adam"}}, ref="single")
    assert repo.tree(single) == repo.tree("main")
    assert repo.last_save is not None and repo.last_save.bytes_written < 4096  # one commit node
    assert repo.commit("main").tree != repo.tree("main")  # the root links the state and DCP's metadata


def test_saving_from_one_process_shares_the_ranks_chunks(
    saved: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    path, _ = saved
    repo_path = tmp_path / "repo"
    shutil.copytree(path, repo_path)
    repo = cas_ckpt.open(repo_path)
    before = repo.stats().total_bytes
    full = expected_full()  # unsharded now: chunks are cut at the same 1 MiB boundaries
    writer = Writer(repo, "single")
    dcp.save({"model": full, "step": 3, "opt": {"lr": 0.1}}, storage_writer=writer)
    assert writer.stats.bytes_written < 64 * 1024
    assert repo.stats().total_bytes - before < 64 * 1024


def test_a_restart_at_another_world_size_stores_nothing_new(tmp_path: Path) -> None:
    """8 -> 4 -> 2 ranks, and 8 -> 6 (uneven shards), on one unchanged state with shards smaller
    than a chunk: every save is the same state tree, the re-saves store only their commit and
    DCP's metadata (far below 5% of the state), and each world size loads back its own shards."""
    repo_path, out = tmp_path / "repo", tmp_path / "out"
    out.mkdir()
    state_bytes = sum(t.nbytes for t in _tensors(worker.fsdp_full()))
    grown, trees = [], []
    for world in (8, 4, 2, 6):
        before = cas_ckpt.open(repo_path).stats().total_bytes if repo_path.exists() else 0
        assert run_ranks("reshard", world, repo_path, out) == [0] * world
        ranks = results(out, "reshard", world)
        assert all(r["loaded"] for r in ranks), world
        assert len({r["cid"] for r in ranks}) == 1
        repo = cas_ckpt.open(repo_path)
        grown.append(repo.stats().total_bytes - before)
        trees.append(repo.tree(ranks[0]["cid"]))
        if world == 8:  # dim-0 shards: at most half a chunk per shard edge and tensor moves
            assert sum(r["moved"] for r in ranks) <= 7 * 5 * MiB // 2
    assert grown[0] >= state_bytes
    assert all(g < 0.05 * state_bytes for g in grown[1:]), grown
    assert len(set(trees)) == 1
    repo = cas_ckpt.open(repo_path)  # and one process saving the same state shares all of it
    single = repo.save(worker.fsdp_full(), ref="single")
    assert repo.tree(single) == trees[0]
    assert repo.last_save is not None and repo.last_save.bytes_written < 0.05 * state_bytes


def test_dim1_shards_and_2d_meshes_store_the_same_chunks(tmp_path: Path) -> None:
    """Shards that are not one run of a tensor's bytes (dim-1 over 4 ranks, a 2x2 mesh, HSDP's
    replicas) still make the single-process tree; dim-1 shards move most of their bytes to the
    ranks that own the chunks. 3 ranks then load it back sharded on dim 1."""
    repo_path, out = tmp_path / "repo", tmp_path / "out"
    out.mkdir()
    assert run_ranks("mesh", 4, repo_path, out) == [0] * 4
    ranks = results(out, "mesh", 4)
    full = worker.mesh_full()
    moved = sum(r["moved"] for r in ranks)
    # each chunk is stored by the rank holding most of it: 3/4 of "cols" (dim 1 over 4) moves,
    # at most 3/4 of "grid" (2x2), at most half a chunk at the one edge of "hsdp"
    cols, grid = full["cols"].nbytes, full["grid"].nbytes
    assert 0.7 * cols <= moved <= 0.75 * cols + 0.75 * grid + MiB // 2
    repo = cas_ckpt.open(repo_path)
    assert repo.tree(repo.save(full, ref="single")) == repo.tree("mesh")
    assert run_ranks("mesh", 3, repo_path, out, env={"CAS_CKPT_LOAD_ONLY": "1"}) == [0] * 3
    assert all(r["loaded"] for r in results(out, "mesh", 3))


def test_every_tool_sees_tensors_across_world_sizes(tmp_path: Path) -> None:
    """4 ranks save, 2 ranks save again with one weight and its moment changed: ls, diff,
    diff --by-tensor, stats and --find-nonfinite (the installed command) and the browser's
    checkpoint and diff pages name tensors by their state paths, weights apart from moments."""
    from cas_ckpt.web.data import Browser

    repo_path, out = tmp_path / "repo", tmp_path / "out"
    out.mkdir()
    assert run_ranks("reshard", 4, repo_path, out) == [0] * 4
    assert run_ranks("reshard", 2, repo_path, out, env={"CAS_CKPT_BUMP": "1"}) == [0] * 2
    weight, moment = "model.layers.a.weight", "optim.state.layers.a.weight.exp_avg"

    def cas(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(Path(sys.executable).parent / "cas-ckpt"), "--repo", str(repo_path),
                               *args], capture_output=True, text=True, timeout=120)

    listed = json.loads(cas("ls", "run", "--json").stdout)
    paths = {row["path"] for row in listed}
    assert {weight, moment, "model.layers.c.weight", "optim.param_groups.0.lr"} <= paths
    assert [row["shape"] for row in listed if row["path"] == "model.layers.b.weight"] == [[3000, 300]]
    diff = cas("diff", "run~1", "run", "--json")
    assert diff.returncode == 1
    assert {c["path"] for c in json.loads(diff.stdout)["changed"]} == {weight, moment}
    by_tensor = json.loads(cas("diff", "run~1", "run", "--by-tensor", "--json").stdout)
    assert [t["path"] for t in sorted(by_tensor["tensors"], key=lambda t: t["path"])] == [weight, moment]
    stats = json.loads(cas("stats", "run", "model", "--json").stdout)
    assert {s["path"] for s in stats} == {f"model.layers.{n}.weight" for n in "abcd"}
    nonfinite = cas("stats", "run", "--find-nonfinite")
    assert nonfinite.returncode == 0, nonfinite.stdout + nonfinite.stderr
    browser = Browser(cas_ckpt.open(repo_path))
    rows = browser.tree("run")["rows"]
    assert {weight, moment} <= {r["path"] for r in rows}
    assert {r["path"] for r in rows if r["changed"]} == {weight, moment}
    page = browser.diff("run~1", "run")
    assert {r["path"] for r in page["changed"]} == {weight, moment} and not page["added"]


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, list):
        return [t for v in value for t in _tensors(v)]
    return [value] if isinstance(value, torch.Tensor) else []


# --------------------------------------------------------------------------------------------
# One process, no process group
# --------------------------------------------------------------------------------------------
def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    return {
        "model": {
            "w": torch.randn(300, 200, generator=g),
            "bf": torch.randn(17, 3, generator=g).to(torch.bfloat16),
            "i8": torch.randint(-128, 127, (5000,), dtype=torch.int8, generator=g),
            "mask": torch.rand(9, generator=g) > 0.5,
            "scalar": torch.tensor(2.5, dtype=torch.float64),
            "view": torch.arange(40.0).reshape(5, 8)[:, 1::2],  # not contiguous
        },
        "optim": {"state": {0: {"step": torch.tensor(4.0)}}, "param_groups": [{"lr": 0.01, "params": [0]}]},
        "epoch": 2,
        "meta": {"name": "run", "betas": (0.9, 0.95), "none": None, "blob": b"x" * 40000,
                 "array": np.arange(6, dtype=np.int16)},
    }


def _blank(state: Any) -> Any:
    """A load target shaped like ``state``: zero tensors, None for the values DCP pickles."""
    if isinstance(state, dict):
        return {k: _blank(v) for k, v in state.items()}
    if isinstance(state, list) and any(isinstance(v, (dict, torch.Tensor)) for v in state):
        return [_blank(v) for v in state]
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    return None


def _str_keys(state: Any) -> Any:
    """``state`` as DCP's flattening gives it back whole: every dict key a str."""
    if isinstance(state, dict):
        return {str(k): _str_keys(v) for k, v in state.items()}
    if isinstance(state, list) and any(isinstance(v, (dict, torch.Tensor)) for v in state):
        return [_str_keys(v) for v in state]
    return state


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(_equal, a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and same_bits(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    return a == b and type(a) is type(b)


@pytest.mark.parametrize("location", ["local", "memory"])
def test_round_trip_in_one_process(tmp_path: Path, location: str) -> None:
    repo = cas_ckpt.open(tmp_path / "r" if location == "local" else "memory://")
    state = _state()
    meta = dcp.save(state, storage_writer=Writer(repo, "main", step=9, metadata={"run": "a"}))
    assert meta.storage_meta.checkpoint_id == str(repo.resolve("main"))
    commit = repo.commit("main")
    assert (commit.step, commit.metadata) == (9, {"run": "a"})
    target = _blank(state)
    dcp.load(target, storage_reader=Reader(repo, "main"))
    assert _equal(state, target)
    assert _equal(_str_keys(state), load_full(repo))


def test_mmap_maps_a_tensor_one_rank_wrote_and_path_reads_only_its_chunks(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from helpers import CountingStore

    repo = cas_ckpt.open(tmp_path / "r")
    g = torch.Generator().manual_seed(1)
    state = {"model": {"w": torch.randn(1000, 1000, generator=g), "b": torch.randn(300_000, generator=g)}}
    dcp.save(state, storage_writer=Writer(repo, "main"))
    caplog.clear()
    with caplog.at_level("WARNING", logger="cas_ckpt"):
        mapped = repo.load("main", mmap=True)
    assert not [r for r in caplog.records if r.name == "cas_ckpt"]  # nothing copied instead of mapped
    assert same_bits(mapped["model"]["w"], state["model"]["w"])
    store = CountingStore(cas_ckpt.blocks.LocalStore(tmp_path / "r"))
    repo = cas_ckpt.Repository(store, cas_ckpt.refs.LocalRefStore(tmp_path / "r"))
    assert same_bits(repo.load("main", path="model.b"), state["model"]["b"])
    assert len(store.reads) <= 2 + 3 + 2  # commit, root, state, model node; b's 2 chunks


def test_no_pickle_is_stored_and_objects_are_refused(tmp_path: Path) -> None:
    repo = cas_ckpt.open(tmp_path / "r")
    dcp.save(_state(), storage_writer=Writer(repo, "main"))
    for cid in repo.blocks:  # torch.save writes a zip archive around a pickle
        block = repo.blocks.get(cid)
        assert not block.startswith(b"PK\x03\x04") and b"\x80\x02" not in block[:2]

    class Opaque:
        pass

    with pytest.raises(CheckpointException) as info:
        dcp.save({"w": torch.ones(3), "obj": {"x": Opaque()}}, storage_writer=Writer(repo, "other"))
    assert "obj.x: cannot save a value of type" in str(info.value)
    assert "other" not in repo.refs()


def test_async_save(tmp_path: Path) -> None:
    repo = cas_ckpt.open(tmp_path / "r")
    state = _state()
    future = dcp.async_save(state, storage_writer=Writer(repo, "main", step=1))
    meta = future.result(timeout=60)
    assert meta.storage_meta.checkpoint_id == str(repo.resolve("main"))
    assert _equal(_str_keys(state), load_full(repo))


def test_plan_caching_never_uses_a_stale_plan(tmp_path: Path) -> None:
    repo = cas_ckpt.open(tmp_path / "r")

    class CachingPlannerForTest(DefaultSavePlanner):  # its own cache key
        def __init__(self) -> None:
            super().__init__(enable_plan_caching=True)

    try:
        writer = Writer(repo, "main")
        first, second = _state(), _state()
        second["model"]["w"] += 1
        second["epoch"] = 3
        dcp.save(first, storage_writer=writer, planner=CachingPlannerForTest())
        cid_first = repo.resolve("main")
        dcp.save(second, storage_writer=writer, planner=CachingPlannerForTest())  # a cache hit
        assert _equal(_str_keys(second), load_full(repo))
        assert _equal(_str_keys(first), load_full(repo, cid_first))
        # A new Writer on a cache hit: still right
        second["model"]["w"] += 1
        dcp.save(second, storage_writer=Writer(repo, "main"), planner=CachingPlannerForTest())
        assert _equal(_str_keys(second), load_full(repo))
    finally:
        for cache in (SavePlanner._cached_save_plan, SavePlanner._cached_all_plans,
                      SavePlanner._cached_global_plan, SavePlanner._cached_metadata,
                      SavePlanner._cached_final_save_plan):
            cache.pop("CachingPlannerForTest", None)


def test_checkpoint_id_names_the_ref_and_reset_is_optional(tmp_path: Path) -> None:
    repo = cas_ckpt.open(tmp_path / "r")
    state = _state()
    dcp.save(state, storage_writer=Writer(repo, "main"))  # reset() is not called at all here
    dcp.save(state, checkpoint_id="runs/b", storage_writer=Writer(repo, "main"))
    assert set(repo.refs()) == {"main", "runs/b"}
    pinned = repo.resolve("main")
    reader = Reader(repo, "main")
    state["epoch"] = 7
    dcp.save(state, storage_writer=Writer(repo, "main"))
    target = _blank(state)
    dcp.load(target, storage_reader=reader)  # the Reader keeps the commit it resolved
    assert target["epoch"] == 2 and reader.cid == pinned
    dcp.load(target, checkpoint_id="main", storage_reader=reader)  # an id re-targets it
    assert target["epoch"] == 7


def test_ref_moves_only_by_compare_and_swap(tmp_path: Path) -> None:
    repo = cas_ckpt.open(tmp_path / "r")
    state = _state()
    dcp.save(state, storage_writer=Writer(repo, "main"))
    stale = repo.resolve("main")
    dcp.save(state | {"epoch": 5}, storage_writer=Writer(repo, "main"))
    head = repo.resolve("main")
    with pytest.raises(CheckpointException, match="RefConflict"):
        dcp.save(state, storage_writer=Writer(repo, "main", expected=stale))
    assert repo.resolve("main") == head


def _gc_finishes(repo: cas_ckpt.Repository, seconds: float = 30) -> bool:
    done = threading.Event()
    threading.Thread(target=lambda: (repo.gc(), done.set()), daemon=True).start()
    return done.wait(seconds)


def test_a_failed_save_does_not_block_gc(tmp_path: Path) -> None:
    repo = cas_ckpt.open(tmp_path / "r")
    with pytest.raises(CheckpointException):
        dcp.save({"x": object()}, storage_writer=Writer(repo, "main"))
    gc.collect()  # the dropped Writer releases the save lock its coordinator held
    assert _gc_finishes(repo)
    writer = Writer(repo, "main")  # or close() it explicitly
    with pytest.raises(CheckpointException):
        dcp.save({"x": object()}, storage_writer=writer)
    writer.close()
    assert _gc_finishes(repo)


def test_gc_waits_for_a_save_from_planning_to_commit(tmp_path: Path) -> None:
    repo = cas_ckpt.open(tmp_path / "r")
    seen: dict[str, bool] = {}
    done = threading.Event()

    class GcDuringSave(DefaultSavePlanner):
        def create_global_plan(self, all_plans: Any) -> Any:
            threading.Thread(target=lambda: (repo.gc(), done.set()), daemon=True).start()
            done.wait(0.5)  # long enough for a GC nothing holds off to finish
            return super().create_global_plan(all_plans)

        def finish_plan(self, new_plan: Any) -> Any:  # right before write_data
            seen["gc ran before the writes"] = done.is_set()
            return super().finish_plan(new_plan)

    state = _state()
    dcp.save(state, storage_writer=Writer(repo, "main"), planner=GcDuringSave())
    assert seen == {"gc ran before the writes": False}
    assert done.wait(30) and repo.fsck().ok
    assert _equal(_str_keys(state), load_full(repo))


def test_use_collectives_false_is_refused(tmp_path: Path) -> None:
    repo = cas_ckpt.open(tmp_path / "r")
    with pytest.raises((ValueError, CheckpointException), match="use_collectives"):
        dcp.save(_state(), storage_writer=Writer(repo, "main"), use_collectives=False)


def test_reader_refuses_what_is_not_a_dcp_checkpoint(tmp_path: Path) -> None:
    repo = cas_ckpt.open(tmp_path / "r")
    repo.save({"w": np.zeros(3)}, ref="plain")
    with pytest.raises(cas_ckpt.errors.RepositoryError, match="not a checkpoint written through"):
        load_full(repo, "plain")
    with pytest.raises(CheckpointException, match="not a checkpoint written through"):
        dcp.load({"w": torch.zeros(3)}, storage_reader=Reader(repo, "plain"))


def test_values_are_handed_to_the_planner_from_msgpack(tmp_path: Path) -> None:
    """load_bytes gets a buffer pickled in memory from decoded values, never stored bytes."""
    repo = cas_ckpt.open(tmp_path / "r")
    dcp.save({"meta": {"k": [1, 2]}}, storage_writer=Writer(repo, "main"))
    seen: list[bytes] = []

    class Spy(dcp.DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            seen.append(value.getvalue())
            super().load_bytes(read_item, value)

    target: dict[str, Any] = {"meta": {"k": None}}
    dcp.load(target, storage_reader=Reader(repo, "main"), planner=Spy())
    assert target["meta"]["k"] == [1, 2] and len(seen) == 1
    stored = {repo.blocks.get(c) for c in repo.blocks}
    assert seen[0] not in stored


def test_mixed_checkpoints_error_is_exported() -> None:
    assert issubclass(MixedCheckpoints, cas_ckpt.errors.RepositoryError)


def test_a_state_may_link_subtrees_already_stored(tmp_path: Path) -> None:
    """The hook the coordinator's tree uses: a Link in a state is an already-stored sub-tree."""
    repo = cas_ckpt.open(tmp_path / "r")
    part = repo.commit(repo.save({"x": np.arange(5000)}, ref="part")).tree
    repo.save({"linked": Link(cid_bytes(part))}, ref="whole")
    assert np.array_equal(repo.load("whole")["linked"]["x"], np.arange(5000))
    assert repo.fsck().ok
    missing = cid_bytes(repo.hasher.node(b"\x90"))
    with pytest.raises(cas_ckpt.errors.StateTypeError, match="block not stored"):
        repo.save({"a": Link(missing)})
    raw = cid_bytes(repo.hasher.raw(b"chunk"))
    with pytest.raises(cas_ckpt.errors.StateTypeError, match="not a node"):
        repo.save({"a": Link(raw)})


def test_the_manager_saves_and_restores_through_dcp_on_two_ranks(tmp_path: Path) -> None:
    """``CheckpointManager.save_dcp`` / ``restore_dcp`` on 2 gloo ranks: one commit per step,
    retention (keep_last=2) and step refs by rank 0, the latest and a fork restored shard by shard.
    Rank 1's manager takes no lease (the job is one writer), so both construct without LeaseHeld."""
    repo = tmp_path / "repo"
    cas_ckpt.open(repo).close()
    assert run_ranks("manager", 2, repo, tmp_path) == [0, 0]
    ranks = results(tmp_path, "manager", 2)
    assert ranks[0]["cids"] == ranks[1]["cids"] and len(set(ranks[0]["cids"])) == 3
    for rank in ranks:
        assert rank["steps"] == [2, 3] and rank["fork_steps"] == [2]
        assert rank["latest"] == rank["expected_latest"] and rank["fork"] == rank["expected_fork"]
        assert rank["metrics"] == {"loss": 1.0 / 3}
    with cas_ckpt.open(repo) as r:
        commits = list(r.log("run"))
        assert [c.step for c in commits] == [3, 2, 1]
        r.load(commits[1].cid)  # step 2 is retained
        with pytest.raises(cas_ckpt.errors.CheckpointExpired):
            r.load(commits[2].cid)  # step 1 was expired by retention and its data collected


@pytest.mark.parametrize("s3_server", ["moto"], indirect=True)  # counts cas_ckpt's requests: one server
def test_ranks_of_an_s3_save_read_no_index_of_each_other(s3_url: str, tmp_path: Path) -> None:
    """The coordinator records every rank's packs in one journal; a rank learns only of packs
    removed before its batch. So an unchanged save costs each rank the same requests however
    many ranks there are, and no rank reads an index file another wrote."""
    out = tmp_path / "out"
    out.mkdir()
    assert run_ranks("requests", 2, s3_url, out) == [0, 0]  # type: ignore[arg-type]
    ranks = results(out, "requests", 2)
    for found in ranks:
        _, second, third = found["saves"]
        assert second == third  # unchanged saves: the same requests each time
        assert second["pack_lists"] == 0 and second["index_reads"] == 0
    assert ranks[1]["saves"][0]["index_reads"] == 0  # nor in the first save
    with cas_ckpt.open(s3_url, read_only=True) as repo:
        assert repo.fsck().ok and repo.commit("main").step == 2
