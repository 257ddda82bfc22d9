"""One rank of a torch.distributed.checkpoint job on a cas_ckpt repository (gloo on 127.0.0.1).

    python dcp_worker.py SCENARIO RANK WORLD PORT REPO OUT

Scenarios (run by tests/test_dcp.py):

* ``save``: 2 ranks save the state of :func:`state` three times to ``main`` (the second save
  unchanged, the third through ``dcp.async_save`` with ``w`` + 1), then try a save whose plain
  tensor differs across ranks;
* ``load``: 3 ranks load ``main`` into DTensors sharded 3 ways; first with the ref moved between
  the ranks' Readers (must fail on every rank, loading nothing), then pinned to one CID;
* ``kill``: 2 ranks save; the rank given in ``CAS_CKPT_KILL_RANK`` SIGKILLs itself while writing;
* ``manager``: 2 ranks save steps 1-3 through ``CheckpointManager.save_dcp`` (keep_last=2), restore
  the latest and a fork of step 2 with ``restore_dcp``.

Run by tests/test_hf_dcp.py:

* ``hf``: 2 ranks save the state of :func:`hf_state` to ``main``, then its float tensors through
  torch's own ``HuggingFaceStorageWriter`` (``save_distributed=True``, consolidated by torch) to
  ``OUT/torch-one`` (one file) and ``OUT/torch-shards`` (the split of :func:`hf_split`);
* ``hfbig``: 2 ranks save ``CAS_CKPT_HF_MIB`` MiB of fp32 (:func:`big_layout`) to ``main``.
* ``reshard``: WORLD ranks save the FSDP-style state of :func:`fsdp_full` (dim-0 shards, some
  smaller than a chunk, one below the inline limit; ``CAS_CKPT_BUMP`` adds 1 to one weight and
  its moment) to ``run`` at step WORLD, then load it back into their own shards;
* ``mesh``: 4 ranks save :func:`mesh_full` with dim-1 shards, a 2-D mesh (dim 0 and dim 1) and
  replicas over a mesh dimension (HSDP), reporting the edge bytes each rank sent; 3 ranks
  (``CAS_CKPT_LOAD_ONLY``) load it back sharded on dim 1.

Each rank writes what it saw to ``OUT/<scenario>-<rank>.json``.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import cas_ckpt
from cas_ckpt.dcp import Reader, Writer

MiB = 1024 * 1024
SHARDED = ("w", "z", "h")  # DTensors sharded on dim 0


def full_state() -> dict[str, torch.Tensor]:
    """The unsharded tensors, the same on every rank (a fixed seed)."""
    g = torch.Generator().manual_seed(7)
    half = torch.randn(512, 512, generator=g)  # 1 MiB
    return {
        "w": torch.randn(2048, 512, generator=g),  # 4 MiB: 2 MiB (two chunks) per rank of 2
        "z": torch.cat([half, half]),  # both halves equal: the 2 ranks' shards are one block set
        "h": torch.randn(7, 5, generator=g).to(torch.bfloat16),  # uneven: 4+3 rows, 3+3+1 rows
        "r": torch.randn(3 * MiB // 4, generator=g),  # 3 MiB, replicated (a plain tensor)
    }


def state(mesh: Any, rank: int, world: int, bump: float = 0.0) -> dict[str, Any]:
    full = full_state()
    full["w"] = full["w"] + bump
    model: dict[str, Any] = {"r": full["r"]}
    for name in SHARDED:
        local = torch.chunk(full[name], world)[rank].clone()
        model[name] = DTensor.from_local(
            local, mesh, [Shard(0)], run_check=False, shape=full[name].shape,
            stride=full[name].stride(),
        )
    return {"model": model, "step": 3, "opt": {"lr": 0.1, "betas": (0.9, 0.999), "name": "adam"}}


def pack_bytes(repo: str) -> int:
    return sum(p.stat().st_size for p in (Path(repo) / "packs").glob("*.pack"))


def failure(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def scenario_save(repo: cas_ckpt.Repository, mesh: Any, rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    writer = Writer(repo, "main", step=1)
    meta = dcp.save(state(mesh, rank, world), storage_writer=writer)
    out["cid1"] = meta.storage_meta.checkpoint_id
    out["written1"] = writer.stats.bytes_written
    dist.barrier()
    out["packs1"] = pack_bytes(repo.location)
    dist.barrier()
    writer = Writer(repo, "main", step=2)
    out["cid2"] = dcp.save(state(mesh, rank, world), storage_writer=writer).storage_meta.checkpoint_id
    out["written2"] = writer.stats.bytes_written
    dist.barrier()
    out["packs2"] = pack_bytes(repo.location)
    future = dcp.async_save(state(mesh, rank, world, bump=1.0), storage_writer=Writer(repo, "main", step=3))
    out["cid3"] = future.result().storage_meta.checkpoint_id
    bad = state(mesh, rank, world)
    bad["seed"] = torch.full((4,), rank)  # a plain tensor that differs: DCP would keep one
    try:
        dcp.save(bad, storage_writer=Writer(repo, "main", step=4))
        out["mismatch"] = None
    except CheckpointException as exc:  # a BaseException
        out["mismatch"] = failure(exc)
    return out


def scenario_load(repo: cas_ckpt.Repository, mesh: Any, rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.tensor import zeros

    out: dict[str, Any] = {}
    full = full_state()
    full["w"] = full["w"] + 1.0  # the third save
    head = repo.resolve("main")

    def target() -> dict[str, Any]:
        model: dict[str, Any] = {"r": torch.zeros_like(full["r"])}
        for name in SHARDED:
            model[name] = zeros(full[name].shape, dtype=full[name].dtype, device_mesh=mesh,
                                placements=[Shard(0)])
        return {"model": model, "step": 0, "opt": {"lr": None, "betas": None, "name": None}}

    # The ref moves between the ranks' Readers: the load must fail everywhere, loading nothing.
    reader = Reader(repo, "main") if rank < 2 else None
    dist.barrier()
    if rank == 0:
        repo.set_ref("main", repo.commit(head).parents[0], expected=head)
    dist.barrier()
    reader = reader or Reader(repo, "main")
    sd = target()
    try:
        dcp.load(sd, storage_reader=reader)
        out["mixed"] = None
    except CheckpointException as exc:
        out["mixed"] = failure(exc)
    out["untouched"] = not sd["model"]["w"].to_local().any().item() and sd["step"] == 0
    dist.barrier()
    if rank == 0:
        repo.set_ref("main", head)
    dist.barrier()

    sd = target()
    dcp.load(sd, storage_reader=Reader(repo, head))
    exact = {}
    for name in SHARDED:
        want = torch.chunk(full[name], world)[rank]
        got = sd["model"][name].to_local()
        exact[name] = got.shape == want.shape and torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    exact["r"] = torch.equal(sd["model"]["r"].view(torch.uint8), full["r"].view(torch.uint8))
    out["exact"] = exact
    out["values"] = [sd["step"], sd["opt"]["lr"], list(sd["opt"]["betas"]), sd["opt"]["name"]]
    return out


class KillingPlanner(DefaultSavePlanner):
    """Kills its own process on the second item it resolves (mid ``write_data``)."""

    resolved = 0

    def resolve_data(self, write_item: Any) -> Any:
        KillingPlanner.resolved += 1
        if KillingPlanner.resolved == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().resolve_data(write_item)


def scenario_kill(repo: cas_ckpt.Repository, mesh: Any, rank: int, world: int) -> dict[str, Any]:
    victim = int(os.environ["CAS_CKPT_KILL_RANK"])
    planner = KillingPlanner() if rank == victim else DefaultSavePlanner()
    try:
        dcp.save(state(mesh, rank, world, bump=2.0), storage_writer=Writer(repo, "main"),
                 planner=planner)
        return {"raised": None}
    except BaseException as exc:  # CheckpointException, or gloo's error when the peer vanished
        return {"raised": failure(exc)}


def scenario_manager(repo: cas_ckpt.Repository, mesh: Any, rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.tensor import zeros

    def target() -> dict[str, Any]:
        full = full_state()
        model: dict[str, Any] = {"r": torch.zeros_like(full["r"])}
        for name in SHARDED:
            model[name] = zeros(full[name].shape, dtype=full[name].dtype, device_mesh=mesh,
                                placements=[Shard(0)])
        return {"model": model, "step": 0, "opt": {"lr": None, "betas": None, "name": None}}

    def w_of(loaded: dict[str, Any]) -> list[float]:
        local = loaded["model"]["w"].to_local()
        return [float(local.sum()), float(local[0, 0])]

    out: dict[str, Any] = {}
    manager = cas_ckpt.CheckpointManager(repo, "run", keep_last=2)
    out["cids"] = [str(manager.save_dcp(step, state(mesh, rank, world, bump=float(step)),
                                        metrics={"loss": 1.0 / step})) for step in (1, 2, 3)]
    out["steps"] = manager.steps()
    out["latest"] = w_of(manager.restore_dcp(target()))
    out["expected_latest"] = w_of(state(mesh, rank, world, bump=3.0))
    out["metrics"] = manager.metrics(3)
    fork = cas_ckpt.CheckpointManager(repo, "fork", fork_from=manager.step_ref(2))
    out["fork"] = w_of(fork.restore_dcp(target()))
    out["expected_fork"] = w_of(state(mesh, rank, world, bump=2.0))
    out["fork_steps"] = fork.steps()
    fork.close()
    manager.close()
    return out


def scenario_requests(repo: cas_ckpt.Repository, mesh: Any, rank: int, world: int) -> dict[str, Any]:
    """On S3: the requests this rank sends in each of three saves (fresh, unchanged, unchanged),
    counted by the S3 client itself, with those that read or list index files or list packs."""
    sent: list[str] = []

    def count(request: Any, **_: Any) -> None:
        sent.append(f"{request.method} {request.url}")

    repo.blocks.backend.bucket.client.meta.events.register("before-send", count)  # type: ignore[attr-defined]
    saves = []
    for step in range(3):
        sent.clear()
        dist.barrier()
        dcp.save(state(mesh, rank, world), storage_writer=Writer(repo, "main", step=step))
        dist.barrier()
        saves.append({
            "requests": len(sent),
            "index_reads": sum(1 for r in sent if r.startswith("GET") and "/index/" in r),
            "pack_lists": sum(1 for r in sent if "list-type=2" in r and "prefix=repo%2Fpacks" in r),
        })
    return {"saves": saves}


def fsdp_full() -> dict[str, Any]:
    """An FSDP-style state (deterministic): weights and their Adam moments, a step."""
    g = torch.Generator().manual_seed(11)
    shapes = {"a": (1000, 1000), "b": (3000, 300), "c": (37, 1000), "d": (5000,)}
    model = {f"layers.{n}.weight": torch.randn(*shape, generator=g) for n, shape in shapes.items()}
    model["layers.d.weight"] = model["layers.d.weight"].to(torch.bfloat16)  # 10 KB: inline
    moments = {k: {"exp_avg": torch.randn(v.shape, generator=g).to(v.dtype), "step": 7}
               for k, v in model.items() if k != "layers.b.weight"}
    return {"model": model, "optim": {"state": moments, "param_groups": [{"lr": 0.01, "betas": (0.9, 0.95)}]}}


def _sharded(value: Any, mesh: Any, placements: list[Any]) -> Any:
    from torch.distributed.tensor import distribute_tensor

    if isinstance(value, dict):
        return {k: _sharded(v, mesh, placements) for k, v in value.items()}
    if isinstance(value, list):
        return [_sharded(v, mesh, placements) for v in value]
    if isinstance(value, torch.Tensor):
        return distribute_tensor(value, mesh, placements)
    return value


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def _blank(value: Any) -> Any:
    from torch.distributed.tensor import DTensor

    if isinstance(value, dict):
        return {k: _blank(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_blank(v) for v in value]
    if isinstance(value, DTensor):
        return DTensor.from_local(torch.zeros_like(value.to_local()), value.device_mesh, value.placements,
                                  run_check=False, shape=value.shape, stride=value.stride())
    return value


def _locals_equal(loaded: Any, expected: Any) -> bool:
    from torch.distributed.tensor import DTensor

    if isinstance(expected, dict):
        return loaded.keys() == expected.keys() and all(
            _locals_equal(loaded[k], v) for k, v in expected.items())
    if isinstance(expected, list):
        return len(loaded) == len(expected) and all(map(_locals_equal, loaded, expected))
    if isinstance(expected, DTensor):
        return _same_bits(loaded.to_local(), expected.to_local())
    return bool(loaded == expected)


def scenario_reshard(repo: cas_ckpt.Repository, mesh: Any, rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.tensor import Shard

    full = fsdp_full()
    if os.environ.get("CAS_CKPT_BUMP"):  # one weight and its moment change
        full["model"]["layers.a.weight"] += 1
        full["optim"]["state"]["layers.a.weight"]["exp_avg"] += 1
    state = _sharded(full, mesh, [Shard(0)])
    writer = Writer(repo, "run", step=world)
    cid = dcp.save(state, storage_writer=writer).storage_meta.checkpoint_id
    target = _blank(state)
    dcp.load(target, storage_reader=Reader(repo, cid))
    return {"cid": cid, "written": writer.stats.bytes_written, "moved": writer.moved_bytes,
            "loaded": _locals_equal(target, state)}


def mesh_full() -> dict[str, Any]:
    g = torch.Generator().manual_seed(5)
    return {"cols": torch.randn(300, 1000, generator=g), "grid": torch.randn(500, 600, generator=g),
            "hsdp": torch.randn(700, 800, generator=g)}


def scenario_mesh(repo: cas_ckpt.Repository, mesh: Any, rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    full = mesh_full()
    if os.environ.get("CAS_CKPT_LOAD_ONLY"):  # a resharded load: dim-1 shards over this world
        state = {k: _sharded(v, mesh, [Shard(1)]) for k, v in full.items()}
        target = _blank(state)
        dcp.load(target, storage_reader=Reader(repo, "mesh"))
        return {"loaded": _locals_equal(target, state)}
    square = init_device_mesh("cpu", (2, 2))
    state = {"cols": _sharded(full["cols"], mesh, [Shard(1)]),
             "grid": _sharded(full["grid"], square, [Shard(0), Shard(1)]),
             "hsdp": _sharded(full["hsdp"], square, [Replicate(), Shard(0)])}
    writer = Writer(repo, "mesh")
    dcp.save(state, storage_writer=writer)
    return {"moved": writer.moved_bytes, "written": writer.stats.bytes_written}


def hf_full() -> dict[str, torch.Tensor]:
    """A model's unsharded tensors for the ``hf`` scenario (a fixed seed), by state_dict name."""
    g = torch.Generator().manual_seed(11)
    return {
        "embed.weight": torch.randn(1024, 640, generator=g),  # fp32 2.5 MiB: 1.25 MiB a rank
        "layers.0.attn.weight": torch.randn(1301, 257, generator=g),  # 651+650 rows, each < 1 MiB
        "layers.0.mlp.weight": torch.randn(256, 1030, generator=g).to(torch.bfloat16),  # Shard(1)
        "layers.0.norm.weight": torch.randn(7, 5, generator=g).to(torch.bfloat16),  # 4+3 rows
        "lm_head.bias": torch.randn(1000, generator=g).to(torch.float16),  # replicated
        "pos_ids": torch.arange(4096, dtype=torch.int64),  # replicated; torch's tool refuses ints
    }


HF_PLACEMENTS = {"embed.weight": 0, "layers.0.attn.weight": 0, "layers.0.mlp.weight": 1,
                 "layers.0.norm.weight": 0}  # name -> the dim it is sharded on; the rest replicated
HF_SHARD_LIMIT = 3 * MiB  # --max-shard-size of the sharded comparison


def _hf_sharded(full: torch.Tensor, dim: int, mesh: Any, rank: int, world: int) -> Any:
    local = torch.chunk(full, world, dim=dim)[rank].clone()
    return DTensor.from_local(local, mesh, [Shard(dim)], run_check=False, shape=full.shape,
                              stride=full.stride())


def hf_state(mesh: Any, rank: int, world: int) -> dict[str, Any]:
    """The ``hf`` scenario's training state: a model, an optimizer subtree and plain values."""
    full = hf_full()
    model = {name: _hf_sharded(t, HF_PLACEMENTS[name], mesh, rank, world) if name in HF_PLACEMENTS
             else t for name, t in full.items()}
    exp_avg = _hf_sharded(full["embed.weight"] * 0.5 + 3.0, 0, mesh, rank, world)
    return {"model": model,
            "optim": {"state": {"embed.weight": {"exp_avg": exp_avg, "step": torch.tensor(7.0)}},
                      "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "params": ["embed.weight"]}]},
            "step": 7, "run": "hf-test"}


def hf_split(tensors: dict[str, torch.Tensor], limit: int) -> dict[str, int]:
    """name -> file index (from 1): huggingface_hub's greedy split in state order."""
    index, size, mapping = 1, 0, {}
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if size and size + nbytes > limit:
            index, size = index + 1, 0
        mapping[name] = index
        size += nbytes
    return mapping


def scenario_hf(repo: cas_ckpt.Repository, mesh: Any, rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    out = Path(sys.argv[6])
    state = hf_state(mesh, rank, world)
    cid = dcp.save(state, storage_writer=Writer(repo, "main", step=7)).storage_meta.checkpoint_id
    floats = {k: v for k, v in state["model"].items() if v.dtype.is_floating_point}
    dcp.save(floats, storage_writer=HuggingFaceStorageWriter(
        str(out / "torch-one"), save_distributed=True, enable_consolidation=True))
    mapping = hf_split({k: v for k, v in hf_full().items() if k in floats}, HF_SHARD_LIMIT)
    dcp.save(floats, storage_writer=HuggingFaceStorageWriter(
        str(out / "torch-shards"), save_distributed=True, enable_consolidation=True,
        fqn_to_index_mapping=mapping))
    return {"cid": cid}


def big_layout(total_mib: int) -> dict[str, tuple[int, int]]:
    """name -> (rows, cols) of fp32 for ``total_mib`` MiB: one tensor of a quarter of it (the
    largest), the rest in tensors of a sixteenth."""
    cols = 1024  # 4 KiB rows
    rows = total_mib * MiB // 4 // 4096
    layout = {"big": (rows, cols)}
    rest, i = total_mib * MiB - rows * 4096, 0
    while rest > 0:
        n = min(rows // 4, rest // 4096)
        layout[f"t{i}"] = (n, cols)
        rest -= n * 4096
        i += 1
    return layout


def big_shard(name: str, shape: tuple[int, int], rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s rows of tensor ``name`` (Shard(0)), made from a seed of its own."""
    step = -(-shape[0] // world)  # torch.chunk's rows per rank
    rows = max(0, min(shape[0], (rank + 1) * step) - rank * step)
    seed = sum(ord(c) * 31**i for i, c in enumerate(name)) % 1_000_003 * 16 + rank
    return torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(seed))


def scenario_hfbig(repo: cas_ckpt.Repository, mesh: Any, rank: int, world: int) -> dict[str, Any]:
    layout = big_layout(int(os.environ["CAS_CKPT_HF_MIB"]))
    model = {}
    for name, shape in layout.items():
        model[name] = DTensor.from_local(big_shard(name, shape, rank, world), mesh, [Shard(0)],
                                         run_check=False, shape=torch.Size(shape),
                                         stride=(shape[1], 1))
    cid = dcp.save({"model": model, "step": 1}, storage_writer=Writer(repo, "main")).storage_meta
    return {"cid": cid.checkpoint_id}


def main() -> None:
    scenario, rank, world, port, location, out = sys.argv[1:]
    rank, world = int(rank), int(world)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        # 8 ranks on 2 busy cores start (import torch) and hash slowly: a collective may wait
        # minutes for the last rank; a killed peer is noticed at once (its sockets close)
        timeout=datetime.timedelta(seconds=30 if scenario == "kill" else 300),
    )
    mesh = init_device_mesh("cpu", (world,))
    repo = cas_ckpt.open(location)
    result = globals()[f"scenario_{scenario}"](repo, mesh, rank, world)
    Path(out, f"{scenario}-{rank}.json").write_text(json.dumps(result))
    if scenario == "kill":
        os._exit(0)  # the group lost a rank: skip a teardown that would wait for it
    dist.barrier()
    dist.destroy_process_group()
    repo.close()
    sys.stdout.flush()
    # Every result is written and the group torn down: skip the interpreter's teardown, where
    # torch's C++ statics now and then destroyed a still-joinable std::thread ("terminate called
    # without an active exception", SIGABRT) after the scenario had passed (seen in loaded runs).
    os._exit(0)


if __name__ == "__main__":
    main()
