#!/usr/bin/env python
"""Sharded saves through torch.distributed.checkpoint: ``cas_ckpt.dcp`` against DCP's own
storage, side by side, on local disk and on S3 (issue #49, item 5).

N gloo ranks (``--save-ranks``, default 8; ``OMP_NUM_THREADS=1``) each build their dim-0 DTensor
shards of a deterministic FSDP-style state of ``--size`` bytes (default 4 GiB): a Llama-like
model's ``model.layers.{i}.{self_attn,mlp}.*.weight`` and norms (fp32), Adam's ``exp_avg`` and
``exp_avg_sq`` of each under ``optim.state.<fqn>``, ``optim.param_groups`` and ``step``: about 400
tensors at the default 14 layers. Every value is generated from (tensor, version, row block), so any
rank of any world size can build or check its own shard without the others.

Each rank job saves, one side after the other at each point (their order rotating):

* the state fresh (a new repository; a new DCP directory), then unchanged again (bytes after these
  two saves), then ``--steps`` - 1 saves where 10% of the weights, with their two moments, get new
  values in place (bytes after ``--steps`` saves: the unchanged one's DCP copy is deleted first,
  so both sides hold the series of ``--steps`` saves; cas_ckpt's holds one more commit node);
* then each of ``--load-ranks`` (default 8,4,2,1; the saving world size by the saving ranks, the
  others by new jobs) loads the last save into freshly made DTensors sharded its way (resharded
  unless the world size is the saving one), checks every
  loaded byte against the generated state (a wrong byte fails the run), and ``step`` and
  ``param_groups``.

Sides: DCP (``FileSystemWriter``/``FileSystemReader`` on local disk, ``FsspecWriter``/
``FsspecReader`` over ``s3fs`` on S3), cas_ckpt with sha2-256 and with blake3
(``cas_ckpt.dcp.Writer`` / ``Reader``). S3 is the tests' moto server (``tests/s3_server.py``,
started here unless ``AWS_ENDPOINT_URL`` names one), on 127.0.0.1; requests are counted in each
rank at the client's HTTP send (botocore's ``Endpoint._send`` for cas_ckpt, aiobotocore's
``AioEndpoint._send`` for s3fs), retries included. Without s3fs, the S3 DCP side is skipped with a
message (``--s3fs-path DIR``: a folder ``pip install --target DIR 's3fs==2026.9.0'`` filled,
prepended to that side's ranks' path only: aiobotocore pins an older botocore than boto3's).

Per operation and rank: wall seconds from a common barrier (the figure is the slowest rank's),
CPU seconds, and peak resident memory (``VmHWM``, reset through ``/proc/self/clear_refs`` just
before) above the rank's resident size before it built the state (libraries imported, repositories
open; for a load, before it made its target tensors), against its shard + 128 MiB.
Saves run on a repository the rank holds open (as a training job does); a cas_ckpt load's time
includes ``cas_ckpt.open`` (a restarted job opens it). Before each operation rank 0 syncs the
disk (untimed); before each local load it reads that side's files once (untimed): loads are warm.

    .venv/bin/python benchmarks/dcp_bench.py --quick                   # seconds
    .venv/bin/python benchmarks/dcp_bench.py --s3fs-path /tmp/dcp-bench-s3fs   # 4 GiB, 8 ranks
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import datetime
import gc
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from _context import cpu_of, machine, tree_state

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MiB = 1024 * 1024
GiB = 1024 * MiB
SEED = 49
MEMORY_SLACK = 128 * MiB  # the target: peak per rank <= its shard + 128 MiB
TARGETS = {  # cas_ckpt / DCP, at most (issue #49 item 5)
    "fresh": 1.1, "unchanged": 0.5, "load_sha2-256": 1.5, "load_blake3": 1.2, "bytes_series": 0.4,
}
SIDES = ("dcp", "sha2-256", "blake3")  # DCP's storage; cas_ckpt with each hash


# ============================================================================================
# The state: shapes, versions, values
# ============================================================================================
def parse_size(text: str) -> int:
    found = re.fullmatch(r"\s*([\d.]+)\s*([KMG]?)(i?B)?\s*", text, re.IGNORECASE)
    if not found:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 4GiB, 512MiB)")
    return int(float(found[1]) * {"": 1, "K": 1024, "M": MiB, "G": GiB}[found[2].upper()])


def dims(h: int) -> tuple[int, int, int]:
    """Hidden, intermediate and vocabulary sizes of a Llama-like model of hidden size ``h``."""
    return h, max(16, round(8 * h / 3 / 16) * 16), 25 * h


def weights(h: int, layers: int) -> list[tuple[str, tuple[int, ...]]]:
    """The model's weights (fqn, shape), as FSDP would name them inside ``model``."""
    h, inter, vocab = dims(h)
    out: list[tuple[str, tuple[int, ...]]] = [("embed_tokens.weight", (vocab, h))]
    for i in range(layers):
        p = f"layers.{i}."
        out += [(p + f"self_attn.{n}_proj.weight", (h, h)) for n in "qkvo"]
        out += [(p + "mlp.gate_proj.weight", (inter, h)), (p + "mlp.up_proj.weight", (inter, h)),
                (p + "mlp.down_proj.weight", (h, inter)),
                (p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,))]
    return [*out, ("norm.weight", (h,)), ("lm_head.weight", (vocab, h))]


def state_bytes(h: int, layers: int) -> int:
    return 3 * 4 * sum(_numel(shape) for _, shape in weights(h, layers))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def hidden_for(size: int, layers: int) -> int:
    """The hidden size (a multiple of 16) whose state comes closest to ``size`` bytes."""
    return min(range(16, 16385, 16), key=lambda h: abs(state_bytes(h, layers) - size))


def changed_at(step: int, count: int, share: float) -> list[int]:
    """The weights (indices) that get new values at ``step`` (2, 3, ...), with their moments."""
    import numpy as np

    pick = max(1, round(share * count))
    order = np.random.Generator(np.random.SFC64([SEED, 7, step])).permutation(count)
    return sorted(int(i) for i in order[:pick])


def versions_at(step: int, count: int, share: float) -> list[int]:
    """Each weight's version after the save of ``step`` (saves 2.. change ``share`` of them)."""
    version = [0] * count
    for s in range(2, step + 1):
        for i in changed_at(s, count, share):
            version[i] += 1
    return version


def fill(out: Any, tensor: int, version: int, rows: int, row0: int) -> None:
    """Rows ``row0 ..`` of tensor ``tensor`` at ``version`` into ``out`` (float32, rows x width):
    the same bytes whichever rank, of whichever world size, asks."""
    import numpy as np

    width = out.shape[1]
    block = max(1, MiB // (4 * width))  # rows generated from one seed
    r, end = row0, row0 + out.shape[0]
    while r < end:
        b = r // block
        start, stop = b * block, min((b + 1) * block, rows)
        gen = np.random.Generator(np.random.SFC64([SEED, tensor, version, b]))
        values = gen.random((stop - start) * width, dtype=np.float32).reshape(stop - start, width)
        upto = min(end, stop)
        out[r - row0 : upto - row0] = values[r - start : upto - start]
        r = upto


# ============================================================================================
# A rank
# ============================================================================================
def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def reset_peak() -> None:
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS


def count_requests() -> collections.Counter[str]:
    """Every HTTP request botocore (cas_ckpt) and aiobotocore (s3fs) send from now on, by method."""
    counter: collections.Counter[str] = collections.Counter()
    with contextlib.suppress(ImportError):
        import botocore.endpoint

        sync_send = botocore.endpoint.Endpoint._send

        def send(self: Any, request: Any) -> Any:
            counter[request.method] += 1
            return sync_send(self, request)

        botocore.endpoint.Endpoint._send = send
    with contextlib.suppress(ImportError):
        import aiobotocore.endpoint

        async_send = aiobotocore.endpoint.AioEndpoint._send

        async def asend(self: Any, request: Any) -> Any:
            counter[request.method] += 1
            return await async_send(self, request)

        aiobotocore.endpoint.AioEndpoint._send = asend
    return counter




class Sampler:
    """The largest anonymous and file-backed resident sizes seen, sampled every 20 ms in a
    thread, above those at the start: which kind of memory a peak is."""

    FIELDS = ("RssAnon", "RssFile", "RssShmem")

    def __init__(self) -> None:
        import threading

        self.start = {f: _status(f) for f in self.FIELDS}
        self.peaks = dict.fromkeys(self.FIELDS, 0)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        while True:
            for f in self.FIELDS:
                self.peaks[f] = max(self.peaks[f], _status(f) - self.start[f])
            if self.stop.wait(0.02):
                return

    def __enter__(self) -> Sampler:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()


class Rank:
    """One rank of a job: its process group, its shards, its sides' storage."""

    def __init__(self, spec: dict[str, Any], rank: int) -> None:
        self.counter = count_requests()
        import numpy as np
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        self.np, self.torch, self.dist = np, torch, dist
        self.spec, self.rank, self.world = spec, rank, spec["world"]
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{spec['port']}", rank=rank,
                                world_size=self.world, timeout=datetime.timedelta(seconds=3600))
        self.mesh = init_device_mesh("cpu", (self.world,))
        self.weights = weights(spec["hidden"], spec["layers"])
        self.records: list[dict[str, Any]] = []
        self.extra: dict[str, Any] = {}
        self.server = os.environ.get("S3_BENCH_SERVER_PID", "")
        # Every library a side uses, imported before any baseline is taken.
        import torch.distributed.checkpoint
        from torch.distributed.tensor import DTensor  # noqa: F401

        if "dcp" in spec["sides"] and spec["locations"]["dcp"].startswith("s3://"):
            import s3fs  # noqa: F401
            import torch.distributed.checkpoint._fsspec_filesystem
        if any(side != "dcp" for side in spec["sides"]):
            import cas_ckpt.dcp  # noqa: F401
        self.baseline = 0

    def take_baseline(self) -> None:
        """The resident size before the state is built: what every peak is measured above."""
        reset_peak()
        self.baseline = _status("VmRSS")

    # -- the state -------------------------------------------------------------------------------
    def local_box(self, shape: tuple[int, ...]) -> tuple[int, int]:
        """This rank's rows of a dim-0 shard of ``shape``: (first row, row count)."""
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        local, offset = compute_local_shape_and_global_offset(shape, self.mesh, [Shard(0)])
        return offset[0], local[0]

    def dtensor(self, local: Any, shape: tuple[int, ...]) -> Any:
        from torch.distributed.tensor import DTensor, Shard

        stride = tuple(_numel(shape[i + 1 :]) for i in range(len(shape)))
        return DTensor.from_local(local, self.mesh, [Shard(0)], run_check=False,
                                  shape=self.torch.Size(shape), stride=stride)

    def fill_local(self, local: Any, index: int, kind: int, version: int, shape: tuple[int, ...]) -> None:
        row0, _ = self.local_box(shape)
        width = _numel(shape[1:])
        view = local.numpy().reshape(-1, width)
        fill(view, 3 * index + kind, version, shape[0], row0)

    def build(self, step: int) -> dict[str, Any]:
        """This rank's shards of the state after the save of ``step``, made from scratch."""
        versions = versions_at(step, len(self.weights), self.spec["changed"])
        model: dict[str, Any] = {}
        moments: dict[str, Any] = {}
        for i, (fqn, shape) in enumerate(self.weights):
            made = []
            for kind in range(3):
                _, rows = self.local_box(shape)
                local = self.torch.empty((rows, *shape[1:]), dtype=self.torch.float32)
                self.fill_local(local, i, kind, versions[i], shape)
                made.append(self.dtensor(local, shape))
            model[fqn] = made[0]
            moments[fqn] = {"exp_avg": made[1], "exp_avg_sq": made[2]}
        return {"model": model, "optim": {"state": moments, "param_groups": self.param_groups()},
                "step": step}

    def param_groups(self) -> list[dict[str, Any]]:
        return [{"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1,
                 "params": [fqn for fqn, _ in self.weights]}]

    def change(self, state: dict[str, Any], step: int) -> None:
        """The optimizer's step, in place: the weights ``changed_at(step)`` and their moments."""
        versions = versions_at(step, len(self.weights), self.spec["changed"])
        for i in changed_at(step, len(self.weights), self.spec["changed"]):
            fqn, shape = self.weights[i]
            tensors = (state["model"][fqn], state["optim"]["state"][fqn]["exp_avg"],
                       state["optim"]["state"][fqn]["exp_avg_sq"])
            for kind, t in enumerate(tensors):
                self.fill_local(t.to_local(), i, kind, versions[i], shape)
        state["step"] = step

    def empty(self) -> dict[str, Any]:
        """Targets for a load: zeros sharded this job's way, values unset."""
        from torch.distributed.tensor import Shard, zeros

        def z(shape: tuple[int, ...]) -> Any:
            return zeros(shape, dtype=self.torch.float32, device_mesh=self.mesh, placements=[Shard(0)])

        return {"model": {fqn: z(shape) for fqn, shape in self.weights},
                "optim": {"state": {fqn: {"exp_avg": z(shape), "exp_avg_sq": z(shape)}
                                    for fqn, shape in self.weights},
                          "param_groups": [{"lr": None, "betas": None, "eps": None, "weight_decay": None,
                                            "params": None}]},
                "step": 0}

    def check(self, state: dict[str, Any], step: int, side: str) -> int:
        """Every loaded byte against the generated state of ``step``; raises on a difference.
        Returns the bytes checked."""
        np = self.np
        versions = versions_at(step, len(self.weights), self.spec["changed"])
        checked = 0
        for i, (fqn, shape) in enumerate(self.weights):
            got = (state["model"][fqn], state["optim"]["state"][fqn]["exp_avg"],
                   state["optim"]["state"][fqn]["exp_avg_sq"])
            for kind, t in enumerate(got):
                local = t.to_local()
                _, rows = self.local_box(shape)
                if tuple(local.shape) != (rows, *shape[1:]):
                    raise AssertionError(f"{side}: {fqn}[{kind}] has shape {tuple(local.shape)}")
                want = np.empty((rows, _numel(shape[1:])), np.float32)
                fill(want, 3 * i + kind, versions[i], shape[0], self.local_box(shape)[0])
                loaded = local.numpy().reshape(want.shape)
                if not np.array_equal(loaded.view(np.uint32), want.view(np.uint32)):
                    raise AssertionError(f"{side}: loaded wrong bytes for {fqn} (kind {kind}) on rank "
                                         f"{self.rank} of {self.world}")
                checked += want.nbytes
        groups = state["optim"]["param_groups"]
        if state["step"] != step or [dict(g, betas=tuple(g["betas"])) for g in groups] != self.param_groups():
            raise AssertionError(f"{side}: loaded step {state['step']!r} / param_groups {groups!r}")
        return checked

    def shard_bytes(self, state: dict[str, Any]) -> int:
        total = sum(t.to_local().nbytes for t in state["model"].values())
        return total + sum(t.to_local().nbytes for m in state["optim"]["state"].values() for t in m.values())

    # -- storage ---------------------------------------------------------------------------------
    def location(self, side: str) -> str:
        return self.spec["locations"][side]

    def dcp_path(self, n: str) -> str:
        return f"{self.location('dcp').rstrip('/')}/ckpt-{n}"

    def s3(self) -> dict[str, Any]:
        return {"endpoint_url": os.environ["AWS_ENDPOINT_URL"], "key": os.environ["AWS_ACCESS_KEY_ID"],
                "secret": os.environ["AWS_SECRET_ACCESS_KEY"]}

    def dcp_writer(self, path: str) -> Any:
        if path.startswith("s3://"):
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

            return FsspecWriter(path, **self.s3())
        from torch.distributed.checkpoint import FileSystemWriter

        return FileSystemWriter(path)

    def dcp_reader(self, path: str) -> Any:
        if path.startswith("s3://"):
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

            return FsspecReader(path, **self.s3())
        from torch.distributed.checkpoint import FileSystemReader

        return FileSystemReader(path)

    def stored(self, location: str) -> int:
        """Bytes stored under ``location`` (a folder, or an s3:// prefix)."""
        if not location.startswith("s3://"):
            return sum(p.stat().st_size for p in Path(location).rglob("*") if p.is_file())
        bucket, _, prefix = location.removeprefix("s3://").partition("/")
        prefix = prefix.rstrip("/") + "/"
        with contextlib.suppress(ImportError):
            import s3fs

            fs = s3fs.S3FileSystem(**self.s3())
            fs.invalidate_cache()
            return sum(info["size"] for info in fs.find(f"{bucket}/{prefix}", detail=True).values())
        import boto3

        client = boto3.client("s3")
        total = 0
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            total += sum(obj["Size"] for obj in page.get("Contents", ()))
        return total

    def remove(self, location: str) -> None:
        if location.startswith("s3://"):
            import s3fs

            s3fs.S3FileSystem(**self.s3()).rm(location.removeprefix("s3://"), recursive=True)
        else:
            shutil.rmtree(location)

    # -- measuring -------------------------------------------------------------------------------
    def settle(self) -> None:
        if self.rank == 0:
            os.sync()
        self.dist.barrier()

    def measure(self, op: str, side: str, run: Any, **info: Any) -> Any:
        """``run()`` from a common barrier: seconds, CPU, peak memory above the baseline, requests."""
        self.settle()
        reset_peak()
        sampler = Sampler()
        before = collections.Counter(self.counter)
        served = cpu_of(self.server) if self.rank == 0 and self.server else float("nan")
        cpu = time.process_time()
        self.dist.barrier()
        began = time.perf_counter()
        with sampler:
            result = run()
        seconds = time.perf_counter() - began
        cpu = time.process_time() - cpu
        peak = _status("VmHWM")
        requests = dict(self.counter - before)
        self.dist.barrier()
        served = cpu_of(self.server) - served if self.rank == 0 and self.server else float("nan")
        self.records.append({"op": op, "side": side, "seconds": seconds, "cpu_seconds": cpu,
                             "peak_above_baseline": peak - self.baseline, "baseline": self.baseline,
                             "sampled": sampler.peaks, "requests": requests, "server_cpu_seconds": served,
                             **info})
        return result

    # -- jobs ------------------------------------------------------------------------------------
    def save_job(self) -> None:
        import torch.distributed.checkpoint as dcp

        import cas_ckpt
        from cas_ckpt.dcp import Writer

        sides = self.spec["sides"]
        repos = {}
        for side in sides:
            if side != "dcp":
                if self.rank == 0:  # one creates the repository, then the others open it
                    repos[side] = cas_ckpt.open(self.location(side), hash=side)
                self.dist.barrier()
                if self.rank != 0:
                    repos[side] = cas_ckpt.open(self.location(side))
        self.take_baseline()  # the repositories open, as a training job holds them
        state = self.build(1)
        shard = self.shard_bytes(state)
        self.extra["shard_bytes"] = shard
        steps = self.spec["steps"]
        plan = [("fresh", 1, "1"), ("unchanged", 1, "1u")]
        plan += [("changed", s, str(s)) for s in range(2, steps + 1)]
        for n, (op, step, name) in enumerate(plan):
            if op == "changed":
                self.change(state, step)
            for k in range(len(sides)):
                side = sides[(n + k) % len(sides)]  # the order rotates from one save to the next
                if side == "dcp":
                    writer = self.dcp_writer(self.dcp_path(name))
                else:
                    writer = Writer(repos[side], "run", step=step)
                self.measure(op, side, lambda w=writer, sd=state: dcp.save(sd, storage_writer=w),
                             step=step, shard_bytes=shard)
            if op == "unchanged" and self.rank == 0:
                self.extra["bytes_two_saves"] = self.stored_all(sides, ["1", "1u"])
                if "dcp" in sides:  # the series is fresh + changed saves: drop the unchanged copy
                    self.remove(self.dcp_path("1u"))
        self.dist.barrier()
        if self.rank == 0:
            names = ["1"] + [str(s) for s in range(2, steps + 1)]
            self.extra["bytes_series"] = self.stored_all(sides, names)
            self.extra["series_changed"] = {
                str(s): {"tensors": 3 * len(changed_at(s, len(self.weights), self.spec["changed"])),
                         "bytes": 3 * 4 * sum(_numel(self.weights[i][1])
                                             for i in changed_at(s, len(self.weights), self.spec["changed"]))}
                for s in range(2, steps + 1)}
            if "dcp" in sides:  # loads read the last save only
                for name in names[:-1]:
                    self.remove(self.dcp_path(name))
        for repo in repos.values():
            repo.close()
        del state
        if self.spec["load_after"]:  # the load at the saving world size, by the same ranks
            self.load_job()

    def stored_all(self, sides: list[str], names: list[str]) -> dict[str, int]:
        return {side: (sum(self.stored(self.dcp_path(n)) for n in names) if side == "dcp"
                       else self.stored(self.location(side))) for side in sides}

    def load_job(self) -> None:
        import torch.distributed.checkpoint as dcp

        import cas_ckpt
        from cas_ckpt.dcp import Reader

        steps, sides = self.spec["steps"], self.spec["sides"]
        for k in range(len(sides)):
            side = sides[(self.world + k) % len(sides)]
            where = self.dcp_path(str(steps)) if side == "dcp" else self.location(side)
            if self.rank == 0 and not where.startswith("s3://"):
                warm(where)  # untimed: loads are measured with the files in the page cache
            self.take_baseline()
            state = self.empty()
            shard = self.shard_bytes(state)

            def load(side: str = side, state: dict[str, Any] = state, where: str = where) -> None:
                if side == "dcp":
                    dcp.load(state, storage_reader=self.dcp_reader(where))
                else:
                    with cas_ckpt.open(where, create=False) as repo:
                        dcp.load(state, storage_reader=Reader(repo, "run"))

            self.measure("load", side, load, shard_bytes=shard)
            self.records[-1]["checked_bytes"] = self.check(state, steps, side)
            del state, load
        self.dist.barrier()

    def finish(self, out: Path) -> None:
        (out / f"rank-{self.rank}.json").write_text(json.dumps({"records": self.records, **self.extra}))
        self.dist.destroy_process_group()


def warm(location: str) -> None:
    """Read every file under ``location`` once (into the page cache)."""
    for path in Path(location).rglob("*"):
        if path.is_file():
            with open(path, "rb", buffering=0) as f:
                while f.read(16 * MiB):
                    pass


def rank_main(spec_path: str, rank: int) -> None:
    spec = json.loads(Path(spec_path).read_text())
    me = Rank(spec, rank)
    getattr(me, f"{spec['job']}_job")()
    me.finish(Path(spec["out"]))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip torch's teardown, which now and then aborts after passing (see dcp_worker.py)


# ============================================================================================
# The driver
# ============================================================================================
def run_job(job: str, world: int, sides: list[str], locations: dict[str, str], config: dict[str, Any],
            folder: Path, env: dict[str, str], log: Any) -> dict[str, Any]:
    """``world`` ranks of ``job`` over ``sides``; every rank's records."""
    out = folder / f"{job}-{world}-{'-'.join(sides)}-{uuid.uuid4().hex[:6]}"
    out.mkdir(parents=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spec = {**config, "job": job, "world": world, "port": port, "sides": sides, "locations": locations,
            "out": str(out)}
    (out / "spec.json").write_text(json.dumps(spec))
    child_env = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    began = time.perf_counter()
    command = [sys.executable, str(Path(__file__).resolve()), "--rank", str(out / "spec.json")]
    procs = [subprocess.Popen([*command, str(r)], env=child_env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT) for r in range(world)]
    failed = []
    for r, proc in enumerate(procs):
        output, _ = proc.communicate(timeout=7200)
        if proc.returncode:
            failed.append(f"rank {r} exited {proc.returncode}:\n{output.decode(errors='replace')[-6000:]}")
    if failed:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        raise RuntimeError(f"{job} job of {world} ranks ({', '.join(sides)}) failed:\n" + "\n".join(failed))
    ranks = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(world)]
    log(f"  {job} x{world} ({', '.join(sides)}): {time.perf_counter() - began:.0f} s")
    return {"world": world, "sides": sides, "ranks": ranks}


def summarise(job: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per operation of a job: the slowest rank's seconds, every rank's peak and requests."""
    rows = []
    per_rank = [r["records"] for r in job["ranks"]]
    for i, first in enumerate(per_rank[0]):
        recs = [records[i] for records in per_rank]
        assert all(r["op"] == first["op"] and r["side"] == first["side"] for r in recs)
        requests: collections.Counter[str] = collections.Counter()
        for r in recs:
            requests.update(r["requests"])
        rows.append({
            "op": first["op"], "side": first["side"], "step": first.get("step"), "world": job["world"],
            "seconds": max(r["seconds"] for r in recs), "rank_seconds": [r["seconds"] for r in recs],
            "cpu_seconds": sum(r["cpu_seconds"] for r in recs),
            "server_cpu_seconds": first["server_cpu_seconds"],
            "peak_above_baseline": [r["peak_above_baseline"] for r in recs],
            "sampled_peaks": [r["sampled"] for r in recs],
            "shard_bytes": [r["shard_bytes"] for r in recs],
            "memory_ok": all(r["peak_above_baseline"] <= r["shard_bytes"] + MEMORY_SLACK for r in recs),
            "requests": sum(requests.values()), "requests_by_method": dict(requests),
            "requests_per_rank": [sum(r["requests"].values()) for r in recs],
            "checked_bytes": sum(r.get("checked_bytes", 0) for r in recs) or None,
        })
    return rows


@contextlib.contextmanager
def s3_environment(log: Any) -> Iterator[dict[str, str] | None]:
    """The moto server's environment (started here unless AWS_ENDPOINT_URL is set), or None."""
    sys.path.insert(0, str(HERE))
    try:
        from s3_bench import s3_server
    except ImportError as exc:  # boto3, numpy: s3_bench's imports
        log(f"S3 skipped: {exc}")
        yield None
        return
    if not os.environ.get("AWS_ENDPOINT_URL"):
        try:
            import moto  # noqa: F401
        except ImportError:
            log("S3 skipped: moto is not installed and AWS_ENDPOINT_URL names no server")
            yield None
            return
    with s3_server() as url:
        yield {"AWS_ENDPOINT_URL": url}


def s3fs_env(path: str | None) -> tuple[dict[str, str] | None, str]:
    """The environment the S3 DCP side's ranks need for s3fs, or None and why not."""
    probe = "import s3fs, aiobotocore; print(s3fs.__version__)"
    env = {}
    if path:
        env["PYTHONPATH"] = os.pathsep.join([path, *filter(None, [os.environ.get("PYTHONPATH")])])
    done = subprocess.run([sys.executable, "-c", probe], env={**os.environ, **env}, capture_output=True,
                          text=True)
    if done.returncode:
        return None, ("s3fs is not importable (pip install 's3fs==2026.9.0', the bench extra, or "
                      "pip install --target DIR 's3fs==2026.9.0' and --s3fs-path DIR)")
    return env, f"s3fs {done.stdout.strip()}"


def new_bucket() -> str:
    import boto3

    bucket = f"dcp-bench-{uuid.uuid4().hex[:10]}"
    boto3.client("s3").create_bucket(Bucket=bucket)
    return bucket


def measure_medium(medium: str, args: argparse.Namespace, config: dict[str, Any], work: Path,
                   env: dict[str, str], groups: list[list[str]], group_env: dict[str, dict[str, str]],
                   log: Any) -> dict[str, Any]:
    """The save series and the loads on one medium; ``groups``: sides that share rank processes."""
    if medium == "local":
        base = work / "local"
        base.mkdir(parents=True)
        locations = {"dcp": str(base / "dcp"), **{h: str(base / f"cas-{h}") for h in args.hashes}}
    else:
        bucket = new_bucket()
        locations = {"dcp": f"s3://{bucket}/dcp", **{h: f"s3://{bucket}/cas-{h}" for h in args.hashes}}
    found: dict[str, Any] = {"locations": locations, "saves": [], "loads": [], "bytes_two_saves": {},
                             "bytes_series": {}}
    load_after = args.save_ranks in args.load_ranks  # run by the save job, saving a start of 8 ranks
    for sides in groups:
        genv = {**env, **group_env.get(sides[0], {})}
        job = run_job("save", args.save_ranks, sides, locations, {**config, "load_after": load_after},
                      work / "jobs", genv, log)
        rows = summarise(job)
        found["saves"] += [r for r in rows if r["op"] != "load"]
        found["loads"] += [r for r in rows if r["op"] == "load"]
        found["bytes_two_saves"].update(job["ranks"][0]["bytes_two_saves"])
        found["bytes_series"].update(job["ranks"][0]["bytes_series"])
        found["series_changed"] = job["ranks"][0]["series_changed"]
        found["shard_bytes"] = job["ranks"][0]["shard_bytes"]
    for world in [w for w in args.load_ranks if w != args.save_ranks]:
        for sides in groups:
            genv = {**env, **group_env.get(sides[0], {})}
            job = run_job("load", world, sides, locations, {**config, "load_after": False}, work / "jobs",
                          genv, log)
            found["loads"] += summarise(job)
    if medium == "local":
        shutil.rmtree(base, ignore_errors=True)
    return found


def ratios(found: dict[str, Any], hashes: list[str]) -> dict[str, Any]:
    """cas_ckpt / DCP for each figure of one medium (None where DCP was not measured)."""
    def seconds(rows: list[dict[str, Any]], side: str, op: str, world: int | None = None) -> list[float]:
        return [r["seconds"] for r in rows if r["side"] == side and r["op"] == op
                and (world is None or r["world"] == world)]

    out: dict[str, Any] = {}
    saves, loads = found["saves"], found["loads"]
    for h in hashes:
        mine: dict[str, Any] = {}
        for op in ("fresh", "unchanged", "changed"):
            ours, theirs = seconds(saves, h, op), seconds(saves, "dcp", op)
            mine[op] = (statistics.median(a / b for a, b in zip(ours, theirs, strict=True))
                        if ours and theirs else None)
        for world in sorted({r["world"] for r in loads}, reverse=True):
            ours, theirs = seconds(loads, h, "load", world), seconds(loads, "dcp", "load", world)
            mine[f"load_{world}"] = ours[0] / theirs[0] if ours and theirs else None
        for key in ("bytes_two_saves", "bytes_series"):
            got = found[key]
            mine[key] = got[h] / got["dcp"] if "dcp" in got and h in got else None
        out[h] = mine
    return out


def verdicts(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue #49's targets against this run's figures."""
    rows = []
    for medium, found in results["media"].items():
        for h, mine in found["ratios"].items():
            loads = {k: v for k, v in mine.items() if k.startswith("load_") and v is not None}
            checks = [("fresh save <= 1.1x DCP", mine["fresh"], TARGETS["fresh"]),
                      ("unchanged re-save <= 0.5x DCP", mine["unchanged"], TARGETS["unchanged"]),
                      (f"load <= {TARGETS['load_' + h]}x DCP (worst of {len(loads)} world sizes)",
                       max(loads.values()) if loads else None, TARGETS["load_" + h]),
                      (f"bytes after {results['config']['steps']} saves, 10% changing <= 0.4x DCP",
                       mine["bytes_series"], TARGETS["bytes_series"])]
            for target, value, limit in checks:
                if value is not None:
                    rows.append({"medium": medium, "hash": h, "target": target, "ratio": value,
                                 "pass": value <= limit})
        rows_mem = found["saves"] + found["loads"]
        cas = [r for r in rows_mem if r["side"] != "dcp"]
        worst = max(cas, key=lambda r: max(p - s for p, s in zip(r["peak_above_baseline"], r["shard_bytes"],
                                                                strict=True)), default=None)
        if worst is not None:
            over = max(p - s for p, s in zip(worst["peak_above_baseline"], worst["shard_bytes"], strict=True))
            rows.append({"medium": medium, "hash": "both",
                         "target": "peak memory per rank <= shard + 128 MiB", "ratio": None,
                         "worst_over_shard_mib": over / MiB,
                         "worst_op": f"{worst['side']} {worst['op']} x{worst['world']}",
                         "pass": all(r["memory_ok"] for r in cas)})
    return rows


def render(results: dict[str, Any]) -> str:
    """The figures and ratios as text tables."""
    lines = []
    cfg = results["config"]
    box = results["machine"]
    lines.append(f"DCP benchmark: saved by {cfg['save_ranks']} ranks, loaded at "
                 f"{','.join(map(str, cfg['load_ranks']))}; {cfg['layers']} layers; {box['cpus']} CPUs, "
                 f"load average {box['loadavg_at_start'][0]:.1f} at the start, "
                 f"{box.get('loadavg_at_end', [float('nan')])[0]:.1f} at the end")
    for medium, found in results["media"].items():
        state = found["state"]
        lines.append(f"\n== {medium}: {state['state_bytes'] / GiB:.2f} GiB state ({state['tensors']} "
                     f"tensors, hidden {state['hidden']}), {found['seconds'] / 60:.1f} min"
                     + (f"; {found['skipped']}" if found.get("skipped") else ""))
        hashes = [h for h in ("sha2-256", "blake3") if h in found["ratios"]]
        sides = ["dcp", *hashes] if any(r["side"] == "dcp" for r in found["saves"]) else hashes
        lines.append(f"{'figure':<26}" + "".join(f"{s:>12}" for s in sides)
                     + "".join(f"{h + ' /DCP':>16}" for h in hashes))
        line = _liner(lines, sides, hashes, found["ratios"])

        def med(rows: list[dict[str, Any]], side: str, op: str, world: int | None = None) -> float | None:
            got = [r["seconds"] for r in rows if r["side"] == side and r["op"] == op
                   and (world is None or r["world"] == world)]
            return statistics.median(got) if got else None

        for op, label in (("fresh", "fresh save s"), ("unchanged", "unchanged re-save s"),
                          ("changed", "10%-changed re-save s")):
            line(label, {s: med(found["saves"], s, op) for s in sides}, ".2f", op)
        for world in sorted({r["world"] for r in found["loads"]}, reverse=True):
            tag = "" if world == cfg["save_ranks"] else " (resharded)"
            line(f"load x{world}{tag} s", {s: med(found["loads"], s, "load", world) for s in sides}, ".2f",
                 f"load_{world}")
        line("GiB after 2 saves", {s: v / GiB for s, v in found["bytes_two_saves"].items()}, ".2f",
             "bytes_two_saves")
        line(f"GiB after {cfg['steps']} saves", {s: v / GiB for s, v in found["bytes_series"].items()}, ".2f",
             "bytes_series")
        if medium == "s3":
            for op in ("fresh", "unchanged", "changed"):
                vals = {s: statistics.median([r["requests"] for r in found["saves"]
                                              if r["side"] == s and r["op"] == op])
                        for s in sides if any(r["side"] == s for r in found["saves"])}
                line(f"requests, {op} save", vals, ".0f", None)
            for world in sorted({r["world"] for r in found["loads"]}, reverse=True):
                vals = {r["side"]: r["requests"] for r in found["loads"] if r["world"] == world}
                line(f"requests, load x{world}", vals, ".0f", None)
        for op in ("fresh", "unchanged", "changed", "load"):
            kind = found["saves" if op != "load" else "loads"]
            for world in sorted({r["world"] for r in kind}, reverse=True):
                rows = [r for r in kind if r["op"] == op and r["world"] == world]
                worst = {r["side"]: max(p - s for p, s in zip(r["peak_above_baseline"], r["shard_bytes"],
                                                              strict=True)) / MiB for r in rows}
                line(f"{op} x{world}: peak-shard MiB", worst, ".0f", None)
        lines.append(f"(shard per rank at x{cfg['save_ranks']}: {found['shard_bytes'] / MiB:.0f} MiB; "
                     "peak-shard: the worst rank's peak RSS above its baseline, less its shard; "
                     "target <= 128)")
    lines.append("\nTargets")
    for v in results["targets"]:
        value = f"{v['ratio']:.2f}" if v.get("ratio") is not None else f"+{v['worst_over_shard_mib']:.0f} MiB"
        extra = f" ({v['worst_op']})" if v.get("worst_op") else ""
        lines.append(f"  {v['medium']:<6}{v['hash']:<9}{v['target']:<58}{value:>10}  "
                     f"{'PASS' if v['pass'] else 'MISS'}{extra}")
    return "\n".join(lines)


def _liner(lines: list[str], sides: list[str], hashes: list[str], ratios: dict[str, Any]) -> Any:
    """A function adding one row of figures (one per side) and ratios (``key`` of ``ratios``)."""

    def line(label: str, values: dict[str, float | None], fmt: str, key: str | None) -> None:
        cells = "".join(f"{format(values[s], fmt) if values.get(s) is not None else '-':>12}" for s in sides)
        rats = "".join(f"{ratios[h][key]:>16.2f}" if key and ratios[h].get(key) is not None else f"{'-':>16}"
                       for h in hashes)
        lines.append(f"{label:<26}{cells}{rats}")

    return line






def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=parse_size, help="the state's bytes (default 4GiB; --quick 16MiB)")
    parser.add_argument("--s3-size", type=parse_size, help="the state's bytes on S3 (default --size)")
    parser.add_argument("--layers", type=int, help="transformer layers (default 14: ~400 tensors; --quick 2)")
    parser.add_argument("--save-ranks", type=int, help="ranks that save (default 8; --quick 2)")
    parser.add_argument("--load-ranks", help="world sizes that load (default 8,4,2,1; --quick 2,1)")
    parser.add_argument("--steps", type=int, default=5, help="saves in the changing series (default 5)")
    parser.add_argument("--changed", type=float, default=0.1, help="weights changed a step (default 0.1)")
    parser.add_argument("--hashes", default="sha2-256,blake3", help="cas_ckpt's hashes (default both)")
    parser.add_argument("--media", default="local,s3", help="local, s3 or both (default)")
    parser.add_argument("--s3fs-path", help="a folder holding s3fs (pip install --target), for S3's DCP")
    parser.add_argument("--quick", action="store_true", help="small sizes, 2 ranks: seconds")
    parser.add_argument("--workdir", type=Path, help="where files go (default a new folder in /var/tmp)")
    parser.add_argument("--json", type=Path, help="default results/dcp-DATE.json (none with --quick)")
    parser.add_argument("--render", type=Path, help="print the tables of an earlier run's JSON and exit")
    parser.add_argument("--rank", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank:
        rank_main(args.rank[0], int(args.rank[1]))
        return 0
    if args.render:
        print(render(json.loads(args.render.read_text())))
        return 0
    quick = args.quick
    args.size = args.size or (16 * MiB if quick else 4 * GiB)
    args.layers = args.layers or (2 if quick else 14)
    args.save_ranks = args.save_ranks or (2 if quick else 8)
    args.load_ranks = [int(v) for v in (args.load_ranks or ("2,1" if quick else "8,4,2,1")).split(",")]
    args.hashes = [h for h in args.hashes.split(",") if h]
    if args.steps < 2:
        parser.error("--steps must be at least 2")
    config = {"layers": args.layers, "changed": args.changed, "steps": args.steps,
              "save_ranks": args.save_ranks, "load_ranks": args.load_ranks, "hashes": args.hashes}

    def state_of(size: int) -> dict[str, Any]:
        hidden = hidden_for(size, args.layers)
        return {"hidden": hidden, "state_bytes": state_bytes(hidden, args.layers), "requested_bytes": size,
                "tensors": 3 * len(weights(hidden, args.layers)), "dims": dims(hidden)}

    def log(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    results: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "machine": machine(), "config": config,
                               "cas_ckpt_tree": tree_state(), "media": {}}
    began = time.perf_counter()
    with contextlib.ExitStack() as stack:
        work = args.workdir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="dcp-bench-",
                                                                                   dir="/var/tmp")))
        work.mkdir(parents=True, exist_ok=True)
        for medium in args.media.split(","):
            state = state_of(args.s3_size or args.size if medium == "s3" else args.size)
            log(f"== {medium}: {state['state_bytes'] / MiB:.0f} MiB, {state['tensors']} tensors "
                f"(hidden {state['hidden']}, {args.layers} layers)")
            started = time.perf_counter()
            if medium == "local":
                groups = [["dcp", *args.hashes]]
                found = measure_medium(medium, args, {**config, **state}, work, {}, groups, {}, log)
            elif medium == "s3":
                s3 = stack.enter_context(s3_environment(log))
                if s3 is None:
                    continue
                fs_env, why = s3fs_env(args.s3fs_path)
                groups = [list(args.hashes)]
                if fs_env is None:
                    log(f"S3: the DCP (fsspec) side skipped: {why}")
                else:
                    groups.insert(0, ["dcp"])  # its own ranks: s3fs's botocore may not be boto3's
                found = measure_medium(medium, args, {**config, **state}, work, {}, groups,
                                       {"dcp": fs_env or {}}, log)
                found["s3fs"] = why
                if fs_env is None:
                    found["skipped"] = f"DCP side skipped: {why}"
            else:
                parser.error(f"unknown medium {medium!r}")
            found["seconds"], found["state"] = time.perf_counter() - started, state
            found["ratios"] = ratios(found, args.hashes)
            results["media"][medium] = found
    results["seconds"] = time.perf_counter() - began
    results["machine"]["loadavg_at_end"] = os.getloadavg()
    results["targets"] = verdicts(results)
    print(render(results))
    out = args.json or (None if quick else HERE / "results" / f"dcp-{results['date']}.json")
    if out:
        out.write_text(json.dumps(results, indent=1) + "\n")
        log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
