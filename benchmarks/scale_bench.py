#!/usr/bin/env python
"""How cas_ckpt's costs grow with history, ranks and blocks, on a directory and on S3 (moto), as
curves in one run, before (an earlier revision) and after (this tree): issue #37's targets.

Every figure comes from a fresh child process that imports one side's ``cas_ckpt``
(``PYTHONPATH``; the base revision is checked out and built as ``ab.py`` does). S3 requests are
counted inside the child, at botocore's HTTP send (retries included). Measured:

* **history**: one repository saved to again and again (a 20 KiB array that changes, a 256 KiB
  one that does not): at each point of ``--saves``, a fresh process's ``open`` (seconds, S3
  requests, resident memory it added), the time and requests of the ten saves before that
  point against saves 6-15 (means, and medians: a mean takes in the upkeep some saves run), the
  mean of the last 100, and (directory) the peak memory of a process that opens and runs
  ``gc()``;
* **ranks**: a DCP job of R gloo ranks (``--ranks``) restarted on S3, on a repository with
  ``--rank-history`` saves of history: each rank opens the repository and saves a sharded state
  already stored (unchanged); the slowest rank's seconds, open alone and open plus save, the
  CPU seconds of all ranks together and of the S3 server meanwhile (the cores they share bound
  the wall time), and each
  rank's requests;
* **blocks**: a repository of N blocks (``--blocks``, 256-byte raw blocks linked from list
  nodes, in packs of 10,000): ``open`` seconds and the memory it added per block, 10,000 new
  blocks put (each a dedup check against the index), and the peak memory of ``gc()`` with every
  block live;
* **big saves**: 1, 4, 16 (``--big-saves``) saves of ``--big-save-blocks`` (50,000) 256-byte
  blocks each, every save one pack (a rank's share of a big model's save): ``open`` seconds and
  the memory it added per block with the index snapshot of the first save only (the packs after
  it read by their own indexes: what upkeep by pack count left below 16 packs), with the upkeep
  each save runs (what is due), and after ``upkeep(force=True)``;
* **mmap**: ``load(mmap=True)`` of one array of each ``--mmap`` size: the RssAnon it added.

On the after side a repository written block by block gets ``upkeep(force=True)`` before it is
measured, as its saves would have run it; the history repositories get what their saves did.

    .venv/bin/python benchmarks/scale_bench.py --quick --json scale-quick.json
    .venv/bin/python benchmarks/scale_bench.py --base 3327dd7 --json scale.json      # full size
    .venv/bin/python benchmarks/scale_bench.py --only big-saves --json scale-big-saves.json
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import resource
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

from _context import cpu_of  # noqa: F401 - the child scripts import it from here

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MiB = 1024 * 1024
FULL = {"saves": [100, 1000, 10000], "ranks": [1, 2, 4, 8], "blocks": [10**4, 10**5, 10**6],
        "mmap": [256, 1024, 4096], "rank_history": [200], "big_saves": [1, 4, 16],
        "big_save_blocks": [50_000]}
QUICK = {"saves": [20, 100], "ranks": [1, 2], "blocks": [10**4, 10**5], "mmap": [256], "rank_history": [40],
         "big_saves": [1, 4], "big_save_blocks": [50_000]}


# ============================================================================================
# Children: one measurement each, with the cas_ckpt PYTHONPATH names
# ============================================================================================
def count_requests() -> collections.Counter[str]:
    """Count every HTTP request botocore sends from now on, by method."""
    import botocore.endpoint

    counter: collections.Counter[str] = collections.Counter()
    original = botocore.endpoint.Endpoint._send

    def send(self: Any, request: Any) -> Any:
        counter[request.method] += 1
        return original(self, request)

    botocore.endpoint.Endpoint._send = send
    return counter




def _status_bytes(field: str) -> int:
    """A memory figure of this process from /proc/self/status (0 where it has none)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    return 0


def rss() -> int:
    return _status_bytes("VmRSS")


def rss_anon() -> int:
    return _status_bytes("RssAnon")


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def history_state(i: int) -> dict[str, Any]:
    import numpy as np

    frozen = np.random.default_rng(7).random(32768)  # 256 KiB, the same in every save
    return {"w": np.full(5120, i, np.float32), "frozen": frozen, "step": i}


def child_history(location: str, start: int, stop: int) -> dict[str, Any]:
    """Saves ``start`` to ``stop - 1``: the seconds and requests of each."""
    counter = count_requests()
    import cas_ckpt

    seconds, requests = [], []
    with cas_ckpt.open(location) as repo:
        for i in range(start, stop):
            state = history_state(i)
            before = sum(counter.values())
            began = time.perf_counter()
            repo.save(state, step=i)
            seconds.append(time.perf_counter() - began)
            requests.append(sum(counter.values()) - before)
    return {"seconds": seconds, "requests": requests}


def child_open(location: str) -> dict[str, Any]:
    """A fresh process's open, and a load of the latest checkpoint."""
    import numpy as np  # noqa: F401 - imported before the baseline

    import cas_ckpt

    counter = count_requests()
    base = rss()
    began = time.perf_counter()
    repo = cas_ckpt.open(location, create=False)
    seconds = time.perf_counter() - began
    opened = sum(counter.values())
    added = rss() - base
    with repo:
        step = repo.load()["step"]
    return {"seconds": seconds, "requests": opened, "rss_added": added, "step": int(step),
            "by_method": dict(counter)}


def child_gc(location: str) -> dict[str, Any]:
    """Open and a default ``gc()``: the peak memory above the process after its imports."""
    import numpy as np  # noqa: F401

    import cas_ckpt

    base = rss()
    began = time.perf_counter()
    with cas_ckpt.open(location, create=False) as repo:
        report = repo.gc()
    return {"seconds": time.perf_counter() - began, "peak_above_imports": peak_rss() - base,
            "peak_rss": peak_rss(), "live_blocks": report.live_blocks + report.lineage_blocks}


def child_blocks_build(location: str, count: int) -> dict[str, Any]:
    """``count`` raw blocks of 256 bytes in packs of 10,000, linked from list nodes to ref main."""
    import cas_ckpt
    from cas_ckpt import codec
    from cas_ckpt.codec import Link

    began = time.perf_counter()
    with cas_ckpt.open(location) as repo:
        hasher, nodes = repo.hasher, []
        for start in range(0, count, 10_000):
            links = []
            with repo.blocks.writer() as writer:
                for i in range(start, min(count, start + 10_000)):
                    data = i.to_bytes(8, "little") * 32
                    cid = hasher.raw(data)
                    writer.put(cid, data)
                    links.append(Link(cid))
                for at in range(0, len(links), 5_000):
                    node = codec.encode(links[at : at + 5_000])
                    nodes.append(hasher.node(node))
                    writer.put(nodes[-1], node)
        with repo.blocks.writer() as writer:
            root = codec.encode([Link(n) for n in nodes])
            writer.put(hasher.node(root), root)
        repo.refs_store.add_if_new("main", hasher.node(root))
        if hasattr(repo, "upkeep"):
            repo.upkeep(force=True)  # what its saves would have done
    return {"seconds": time.perf_counter() - began}


def child_blocks_open(location: str, count: int) -> dict[str, Any]:
    """Open a repository of ``count`` blocks; the memory the index added; 10,000 new blocks put."""
    import numpy as np  # noqa: F401

    import cas_ckpt

    base = rss()
    began = time.perf_counter()
    repo = cas_ckpt.open(location, create=False)
    seconds = time.perf_counter() - began
    added = rss() - base
    with repo:
        began = time.perf_counter()
        with repo.blocks.writer() as writer:
            for i in range(count, count + 10_000):
                data = i.to_bytes(8, "little") * 32
                writer.put(repo.hasher.raw(data), data)
        put = time.perf_counter() - began
    return {"seconds": seconds, "rss_added": added, "bytes_per_block": added / count, "put_10k": put}


def child_big_saves(location: str, start: int, stop: int, blocks: int, every: int) -> dict[str, Any]:
    """Saves ``start`` to ``stop - 1``, each of ``blocks`` raw blocks of 256 bytes in one pack,
    then the upkeep a save runs (what is due): after each save if ``every``, else after the
    first only (its index snapshot)."""
    import cas_ckpt

    began = time.perf_counter()
    with cas_ckpt.open(location) as repo:  # blocks put through a writer run no upkeep by themselves
        for save in range(start, stop):
            with repo.blocks.writer() as writer:
                for i in range(save * blocks, (save + 1) * blocks):
                    data = i.to_bytes(8, "little") * 32
                    writer.put(repo.hasher.raw(data), data)
            if hasattr(repo, "upkeep") and (every or save == 0):
                repo.upkeep()
    return {"seconds": time.perf_counter() - began}


def child_upkeep(location: str) -> dict[str, Any]:
    """``upkeep(force=True)``: packs merged, one index snapshot of everything."""
    import cas_ckpt

    began = time.perf_counter()
    with cas_ckpt.open(location) as repo:
        repo.upkeep(force=True)
    return {"seconds": time.perf_counter() - began}


def child_open_blocks(location: str, count: int) -> dict[str, Any]:
    """A fresh process's ``open`` of a repository of ``count`` blocks: seconds (and CPU seconds,
    which other jobs on the machine inflate less), the memory it added per block (resident; and
    anonymous only, without the pages of code and files it touched first), and how many packs'
    own indexes it read besides the snapshot."""
    import numpy as np  # noqa: F401

    import cas_ckpt

    base, anon = rss(), rss_anon()
    began, cpu = time.perf_counter(), time.process_time()
    repo = cas_ckpt.open(location, create=False)
    seconds, cpu = time.perf_counter() - began, time.process_time() - cpu
    added, anon = rss() - base, rss_anon() - anon
    with repo:
        status = repo.upkeep_status() if hasattr(repo, "upkeep_status") else None
    return {"seconds": seconds, "cpu_seconds": cpu, "rss_added": added, "bytes_per_block": added / count,
            "anon_bytes_per_block": anon / count,
            "packs": status.packs if status is not None else None,
            "uncovered": status.uncovered if status is not None else None}


MMAP_LOADER = """
import json, sys
import numpy as np
import cas_ckpt
sys.path.insert(0, sys.argv[2])
from scale_bench import rss_anon
repo = cas_ckpt.open(sys.argv[1], create=False, read_only=True)
before = rss_anon()
loaded = repo.load(mmap=True)["big"]
assert int(loaded[0]) == 1 and int(loaded[-1]) == 0
print(json.dumps({"rss_anon_added": rss_anon() - before, "mapped": not loaded.flags.owndata}))
"""


def child_mmap(folder: str, size_mib: int) -> dict[str, Any]:
    """Save one array of ``size_mib`` (a sparse file, each 1 MiB chunk numbered) and load it
    mapped in a fresh process."""
    import numpy as np

    import cas_ckpt

    source, nbytes = Path(folder) / "source.bin", size_mib * MiB
    with open(source, "wb") as f:
        f.truncate(nbytes)
        for i in range(nbytes // MiB):
            f.seek(i * MiB)
            f.write(np.uint64(i + 1).tobytes())
    big = np.memmap(source, np.uint64, "r", shape=(nbytes // 8,))
    with cas_ckpt.open(Path(folder) / "repo") as repo:
        repo.save({"big": big})
    del big
    source.unlink()
    done = subprocess.run([sys.executable, "-c", MMAP_LOADER, str(Path(folder) / "repo"), str(HERE)],
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


DCP_RANK = """
import datetime, json, os, sys, time
import torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
sys.path.insert(0, sys.argv[6])
from scale_bench import count_requests, cpu_of
counter = count_requests()
server = os.environ.get("S3_BENCH_SERVER_PID", "")
import cas_ckpt
from cas_ckpt.dcp import Writer
rank, world, port, location, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                        timeout=datetime.timedelta(seconds=600))
mesh = init_device_mesh("cpu", (world,))
g = torch.Generator().manual_seed(3)
full = {name: torch.randn(1024, 256, generator=g) for name in ("a", "b", "c", "d")}  # 1 MiB each
state = {"model": {k: DTensor.from_local(torch.chunk(v, world)[rank].clone(), mesh, [Shard(0)],
                                         run_check=False, shape=v.shape, stride=v.stride())
                   for k, v in full.items()}, "step": 1}
repo = cas_ckpt.open(location)
dcp.save(state, storage_writer=Writer(repo, "dcp", step=1))  # the first save of this state
repo.close()
dist.barrier()
# A job (re)started: each rank opens the repository, then saves what is already stored.
before, cpu, served = sum(counter.values()), time.process_time(), cpu_of(server)
began = time.perf_counter()
repo = cas_ckpt.open(location)
opened, open_requests = time.perf_counter() - began, sum(counter.values()) - before
dcp.save(state, storage_writer=Writer(repo, "dcp", step=2))  # unchanged
seconds, cpu = time.perf_counter() - began, time.process_time() - cpu
requests = sum(counter.values()) - before
dist.barrier()
served = cpu_of(server) - served  # the S3 server's CPU over every rank's open and save
with open(os.path.join(out, f"rank-{rank}.json"), "w") as f:
    json.dump({"seconds": seconds, "requests": requests, "open_seconds": opened,
               "open_requests": open_requests, "cpu_seconds": cpu, "server_cpu_seconds": served}, f)
dist.destroy_process_group()
repo.close()
sys.stdout.flush()
os._exit(0)  # skip torch's teardown, which now and then aborts after passing (tests/scripts/dcp_worker.py)
"""


def child_ranks(location: str, world: int, folder: str, history: int) -> dict[str, Any]:
    """A DCP job of ``world`` ranks restarted on ``location`` (``history`` saves first): each
    rank opens the repository and saves what is already stored. The slowest rank's seconds
    (open included) and each rank's requests."""
    import cas_ckpt

    with cas_ckpt.open(location) as repo:
        for i in range(history):
            repo.save(history_state(i), ref="history", step=i)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, "-c", DCP_RANK, str(rank), str(world), str(port), location,
                               folder, str(HERE)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for rank in range(world)]
    for proc in procs:
        output, _ = proc.communicate(timeout=1800)
        if proc.returncode:
            raise RuntimeError(output.decode(errors="replace")[-3000:])
    ranks = [json.loads((Path(folder) / f"rank-{r}.json").read_text()) for r in range(world)]
    return {"seconds": ranks[0]["seconds"], "slowest_seconds": max(r["seconds"] for r in ranks),
            "open_seconds": max(r["open_seconds"] for r in ranks),
            "cpu_seconds": sum(r["cpu_seconds"] for r in ranks),
            "server_cpu_seconds": ranks[0]["server_cpu_seconds"],
            "requests_per_rank": [r["requests"] for r in ranks],
            "open_requests_per_rank": [r["open_requests"] for r in ranks]}


CHILDREN = {"history": child_history, "open": child_open, "gc": child_gc, "blocks_build": child_blocks_build,
            "blocks_open": child_blocks_open, "mmap": child_mmap, "ranks": child_ranks,
            "big_saves": child_big_saves, "upkeep": child_upkeep, "open_blocks": child_open_blocks}


# ============================================================================================
# The parent: sides, servers, curves
# ============================================================================================
def run_child(tree: Path, name: str, *args: Any, env: dict[str, str] | None = None) -> dict[str, Any]:
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", name,
                           *map(str, args)],
                          env={**os.environ, **(env or {}), "PYTHONPATH": str(tree)},
                          capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"{name} {args} under {tree} failed:\n{done.stdout[-2000:]}{done.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@contextlib.contextmanager
def moto() -> Iterator[dict[str, str]]:
    """A moto S3 server for the run (s3_bench's); the environment that points clients at it."""
    from s3_bench import s3_server

    with s3_server() as url:
        yield {"AWS_ENDPOINT_URL": url, "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
               "AWS_DEFAULT_REGION": "us-east-1",
               "S3_BENCH_SERVER_PID": os.environ.get("S3_BENCH_SERVER_PID", "")}


def new_bucket(env: dict[str, str]) -> str:
    import boto3

    bucket = f"scale-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], aws_access_key_id="bench",
                 aws_secret_access_key="bench", region_name="us-east-1").create_bucket(Bucket=bucket)
    return f"s3://{bucket}/repo"


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def history_curve(tree: Path, location: str, points: list[int], env: dict[str, str] | None,
                  gc: bool, log: Any) -> list[dict[str, Any]]:
    rows, done, per_save = [], 0, {"seconds": [], "requests": []}  # type: ignore[var-annotated]
    for point in points:
        built = run_child(tree, "history", location, done, point, env=env)
        for key in per_save:
            per_save[key].extend(built[key])
        done = point
        row = {"saves": point,
               "save_seconds_early": mean(per_save["seconds"][5:15]),
               "save_seconds_late": mean(per_save["seconds"][point - 10 : point]),
               "save_requests_early": mean(per_save["requests"][5:15]),
               "save_requests_late": mean(per_save["requests"][point - 10 : point]),
               "save_seconds_median_early": median(per_save["seconds"][5:15]),
               "save_seconds_median_late": median(per_save["seconds"][point - 10 : point]),
               "save_seconds_mean_last_100": mean(per_save["seconds"][max(0, point - 100) : point]),
               "save_requests_mean_last_100": mean(per_save["requests"][max(0, point - 100) : point]),
               "save_seconds_max_late": max(per_save["seconds"][max(0, point - 100) : point]),
               "open": run_child(tree, "open", location, env=env)}
        if gc:
            row["gc"] = run_child(tree, "gc", location, env=env)
        rows.append(row)
        log(f"  {point} saves: {json.dumps(row)}")
    return rows


def median_open(tree: Path, location: Path, blocks: int, times: int = 3) -> dict[str, Any]:
    """The open of median seconds of ``times`` fresh processes (each figure from that one)."""
    opens = sorted((run_child(tree, "open_blocks", location, blocks) for _ in range(times)),
                   key=lambda found: found["seconds"])
    return opens[len(opens) // 2]


def big_saves_curve(tree: Path, location: Path, points: list[int], blocks: int,
                    log: Any) -> list[dict[str, Any]]:
    """At each point, ``open`` after that many big saves: with the first save's snapshot only,
    with each save's upkeep, and after ``upkeep(force=True)`` (of a copy: the saves go on)."""
    rows, done = [], 0
    kept, forced = (location.with_name(location.name + suffix) for suffix in ("-kept", "-forced"))
    for point in points:
        run_child(tree, "big_saves", location, done, point, blocks, 0)
        run_child(tree, "big_saves", kept, done, point, blocks, 1)
        done = point
        shutil.copytree(location, forced)
        run_child(tree, "upkeep", forced)
        row = {"saves": point, "blocks": point * blocks,
               **{at: median_open(tree, where, point * blocks)
                  for at, where in (("open", location), ("saves_upkeep", kept), ("after_upkeep", forced))}}
        shutil.rmtree(forced, ignore_errors=True)
        rows.append(row)
        log(f"  big saves {point}: {json.dumps(row)}")
    for folder in (location, kept):
        shutil.rmtree(folder, ignore_errors=True)
    return rows


CURVES = ("history", "ranks", "blocks", "big-saves", "mmap")


def measure_side(tree: Path, sizes: dict[str, list[int]], work: Path, s3_env: dict[str, str],
                 base: bool, base_s3_max: int, log: Any, curves: tuple[str, ...] = CURVES) -> dict[str, Any]:
    found: dict[str, Any] = {key: [] for key in ("history_local", "history_s3", "ranks", "blocks",
                                                 "big_saves", "mmap")}
    if "history" in curves:
        log("history, directory")
        found["history_local"] = history_curve(tree, str(work / "history"), sizes["saves"], None, True, log)
        log("history, S3")
        s3_points = [p for p in sizes["saves"] if not base or p <= base_s3_max]
        found["history_s3"] = history_curve(tree, new_bucket(s3_env), s3_points, s3_env, False, log)
    for world in sizes["ranks"] if "ranks" in curves else []:
        folder = work / f"ranks-{world}"
        folder.mkdir()
        result = run_child(tree, "ranks", new_bucket(s3_env), world, folder, sizes["rank_history"][0],
                           env=s3_env)
        found["ranks"].append({"ranks": world, **result})
        log(f"  ranks {world}: {json.dumps(result)}")
    for count in sizes["blocks"] if "blocks" in curves else []:
        location = str(work / f"blocks-{count}")
        build = run_child(tree, "blocks_build", location, count)
        row = {"blocks": count, "build_seconds": build["seconds"],
               "open": run_child(tree, "blocks_open", location, count),
               "gc": run_child(tree, "gc", location)}
        found["blocks"].append(row)
        shutil.rmtree(location, ignore_errors=True)
        log(f"  blocks {count}: {json.dumps(row)}")
    if "big-saves" in curves:
        found["big_saves"] = big_saves_curve(tree, work / "big-saves", sizes["big_saves"],
                                             sizes["big_save_blocks"][0], log)
    for size in sizes["mmap"] if "mmap" in curves else []:
        folder = work / f"mmap-{size}"
        folder.mkdir()
        result = run_child(tree, "mmap", folder, size)
        found["mmap"].append({"mib": size, **result})
        shutil.rmtree(folder, ignore_errors=True)
        log(f"  mmap {size} MiB: {json.dumps(result)}")
    return found


def render(results: dict[str, dict[str, Any]]) -> str:
    """The curves side by side, as markdown tables."""
    sides = list(results)
    out = []

    def table(title: str, header: list[str], rows: list[list[str]]) -> None:
        if not rows:
            return  # a curve not measured (--only)
        out.append(f"\n{title}\n")
        out.append("| " + " | ".join(header) + " |")
        out.append("|" + "---|" * len(header))
        out.extend("| " + " | ".join(r) + " |" for r in rows)

    for medium in ("local", "s3"):
        rows = []
        for side in sides:
            for r in results[side][f"history_{medium}"]:
                o = r["open"]
                rows.append([side, str(r["saves"]), f"{o['seconds']:.3f}",
                             str(o["requests"]) if medium == "s3" else "-", f"{o['rss_added'] / MiB:.1f}",
                             " / ".join(f"{r[f'save_seconds_median_{at}'] * 1e3:.0f}"
                                        for at in ("early", "late")),
                             f"{r['save_seconds_mean_last_100'] * 1e3:.0f}",
                             (f"{r['save_requests_early']:.1f} / {r['save_requests_mean_last_100']:.1f}"
                              if medium == "s3" else "-"),
                             f"{r['gc']['peak_above_imports'] / MiB:.0f}" if "gc" in r else "-"])
        table(f"History, {'a directory' if medium == 'local' else 'S3 (moto)'}",
              ["side", "saves", "open s", "open requests", "open MiB", "save ms, median 6-15 / last 10",
               "save ms, mean last 100", "save requests, mean 6-15 / last 100", "gc peak MiB"], rows)
    rows = [[side, str(r["ranks"]), f"{r['open_seconds']:.2f}", f"{r['slowest_seconds']:.2f}",
             f"{r['cpu_seconds']:.2f} / {r.get('server_cpu_seconds', float('nan')):.2f}",
             " ".join(map(str, r["open_requests_per_rank"])), " ".join(map(str, r["requests_per_rank"]))]
            for side in sides for r in results[side]["ranks"]]
    table("DCP job restarted on S3: open, then an unchanged save",
          ["side", "ranks", "open s (slowest)", "open + save s (slowest)", "CPU s, all ranks / S3 server",
           "open requests per rank",
           "open + save requests per rank"], rows)
    rows = [[side, f"{r['blocks']:,}", f"{r['open']['seconds']:.2f}", f"{r['open']['bytes_per_block']:.0f}",
             f"{r['open']['put_10k']:.2f}", f"{r['gc']['peak_above_imports'] / MiB:.0f}",
             f"{r['gc']['live_blocks']:,}"]
            for side in sides for r in results[side]["blocks"]]
    table("Blocks", ["side", "blocks", "open s", "open bytes/block", "10k puts s", "gc peak MiB",
                     "live"], rows)
    rows = [[side, str(r["saves"]), f"{r['blocks']:,}",
             *(f"{r[at]['seconds']:.3f} s, {r[at]['bytes_per_block']:.0f} B "
               f"({r[at].get('anon_bytes_per_block', float('nan')):.0f} anon), {r[at]['uncovered']}"
               for at in ("open", "saves_upkeep", "after_upkeep"))]
            for side in sides for r in results[side]["big_saves"]]
    table("Big saves (one pack each): open seconds, resident bytes a block (anonymous), packs read "
          "by their own index",
          ["side", "saves", "blocks", "first save's snapshot only", "each save's upkeep",
           "after upkeep(force=True)"], rows)
    rows = [[side, str(r["mib"]), f"{r['rss_anon_added'] / MiB:.1f}", str(r["mapped"])]
            for side in sides for r in results[side]["mmap"]]
    table("load(mmap=True) of one array", ["side", "MiB", "RssAnon added MiB", "mapped"], rows)
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", help="also measure this revision (before), e.g. 3327dd7")
    parser.add_argument("--quick", action="store_true", help="small curves: a run of minutes")
    for key in FULL:
        default = ",".join(map(str, FULL[key]))
        parser.add_argument(f"--{key.replace('_', '-')}", help=f"comma-separated (default {default})")
    parser.add_argument("--base-s3-max", type=int, default=1000,
                        help="the most saves of the S3 history curve on the base side (default 1000: "
                             "before, each save listed every pack)")
    parser.add_argument("--only", help=f"comma-separated curves, of {','.join(CURVES)} (default all)")
    parser.add_argument("--workdir", type=Path, help="where repositories go (default a temp folder)")
    parser.add_argument("--json", type=Path, help="write every figure here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args(argv)
    if args.child:
        values = [int(v) if v.lstrip("-").isdigit() else v for v in rest]
        print(json.dumps(CHILDREN[args.child](*values)))
        return 0
    defaults = QUICK if args.quick else FULL
    sizes = {key: [int(v) for v in getattr(args, key).split(",")] if getattr(args, key) else defaults[key]
             for key in FULL}
    curves = tuple(args.only.split(",")) if args.only else CURVES
    if not set(curves) <= set(CURVES):
        parser.error(f"--only takes curves of {', '.join(CURVES)}")

    def log(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    sys.path.insert(0, str(HERE))
    import ab

    results: dict[str, dict[str, Any]] = {}
    with contextlib.ExitStack() as stack:
        work = args.workdir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="scale-")))
        s3_env = stack.enter_context(moto())
        sides = {"after": ROOT}
        if args.base:
            sides = {"before": stack.enter_context(ab.base_tree(args.base, build=True)), **sides}
        for side, tree in sides.items():
            log(f"== {side} ({tree})")
            folder = work / side
            folder.mkdir(parents=True, exist_ok=True)
            started = time.perf_counter()
            results[side] = measure_side(tree, sizes, folder, s3_env, side == "before", args.base_s3_max, log,
                                         curves)
            results[side]["seconds"] = time.perf_counter() - started
    print(render(results))
    if args.json:
        args.json.write_text(json.dumps({"base": args.base, "sizes": sizes, "date": time.strftime("%Y-%m-%d"),
                                         "cpus": os.cpu_count(), "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
