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


def main() -> None:
    scenario, rank, world, port, location, out = sys.argv[1:]
    rank, world = int(rank), int(world)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=30),
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
