"""Replication to S3: push of a checkpoint and of a 10%-changed one, against plain boto3 uploads of
the same bytes; and the training loop's blocking time with a two-tier manager against local only.

One run, one server: a moto S3 server started on 127.0.0.1 (or the server AWS_ENDPOINT_URL names).
The checkpoint is ``--size-mb`` MiB of random float32 in ``--arrays`` arrays (nothing deduplicates
inside it), saved in a local repository under ``--workdir``. Measured:

- ``push``: ``Repository.push`` of it to a fresh ``s3://`` prefix (walk, ``has`` on the remote's
  index, parallel reads, packs uploaded while the next is written);
- ``push 10%``: the same after every 10th 1 MiB chunk of every array changed;
- ``boto3 upload_fileobj``: each array uploaded by boto3's transfer manager (parallel multipart):
  what a plain uploader sends for every checkpoint, changed or not;
- ``two-tier``: ``--steps`` saves of a ``--loop-mb`` MiB state, 10% changed per step, by a
  ``CheckpointManager`` on the local repository alone and by one with ``replicate_to=s3://...``:
  the seconds each ``save`` blocked the loop, and for the two-tier one the wait at ``close`` for
  the replication still in flight.

    .venv/bin/python benchmarks/replicate_bench.py --size-mb 1024 --json replicate.json
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import boto3
import numpy as np

import cas_ckpt

sys.path.insert(0, str(Path(__file__).resolve().parent))
from s3_bench import s3_server  # the same server setup as the S3 benchmark

MiB = 1024 * 1024


def make_state(size_mb: int, arrays: int, seed: int = 0) -> dict[str, np.ndarray[Any, Any]]:
    rng = np.random.default_rng(seed)
    n = size_mb * MiB // 4 // arrays
    return {f"layer{i}": rng.random(n, dtype=np.float32) for i in range(arrays)}


CHUNK = MiB // 4  # float32 elements per 1 MiB chunk (the default chunk size)


def change_10_percent(state: dict[str, np.ndarray[Any, Any]], step: int) -> None:
    """Rewrite every 10th 1 MiB chunk of every array (a different tenth each step)."""
    for array in state.values():
        for start in range((step % 10) * CHUNK, array.size, 10 * CHUNK):
            array[start : start + CHUNK] += 1.0


def bench_push(local: cas_ckpt.Repository, url: str, state: dict[str, Any]) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    started = time.perf_counter()
    local.save(state, ref="main", step=1)
    figures["local save"] = {"seconds": time.perf_counter() - started}
    for label, step in (("push", 1), ("push 10%", 2)):
        if step == 2:
            change_10_percent(state, 0)
            local.save(state, ref="main", step=2)
        report = local.push(url, "main")
        figures[label] = {"seconds": report.seconds, "bytes_sent": report.bytes_sent,
                          "blocks_sent": report.blocks_sent, "bytes_skipped": report.bytes_skipped,
                          "blocks_skipped": report.blocks_skipped}
    with cas_ckpt.open(url, create=False) as remote:  # what arrived is what was saved
        loaded = remote.load("main")
        assert all(np.array_equal(loaded[k], v) for k, v in state.items())
    return figures


def bench_boto3(bucket: str, state: dict[str, Any]) -> dict[str, Any]:
    client = boto3.client("s3")
    blobs = {name: array.tobytes() for name, array in state.items()}
    started = time.perf_counter()
    for name, data in blobs.items():
        client.upload_fileobj(io.BytesIO(data), bucket, f"plain/{name}")
    seconds = time.perf_counter() - started
    return {"boto3 upload_fileobj": {"seconds": seconds, "bytes_sent": sum(map(len, blobs.values()))}}


def bench_two_tier(workdir: Path, url: str, size_mb: int, arrays: int, steps: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for label, remote in (("local only", None), ("two-tier", url)):
        state = make_state(size_mb, arrays, seed=1)
        with cas_ckpt.open(workdir / f"loop-{label.replace(' ', '-')}") as repo:
            mgr = cas_ckpt.CheckpointManager(repo, "run", keep_last=2, replicate_to=remote)
            blocked = []
            for step in range(1, steps + 1):
                change_10_percent(state, step)
                started = time.perf_counter()
                mgr.save(step, state)
                blocked.append(time.perf_counter() - started)
            started = time.perf_counter()
            mgr.close()  # the two-tier manager waits here for the pushes still in flight
            tail = time.perf_counter() - started
        out[label] = {"save_seconds": blocked, "median_save_seconds": statistics.median(blocked),
                      "close_seconds": tail}
    return out


def run_info() -> dict[str, Any]:
    """When, on what load, and on which cas_ckpt sources (the hash bench.py records too)."""
    source = hashlib.sha256()
    root = Path(cas_ckpt.__file__).parent
    for path in sorted(root.rglob("*.py")):
        source.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "load_average": os.getloadavg(),
            "cas_ckpt": cas_ckpt.__version__, "cas_ckpt_source_sha256": source.hexdigest()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mb", type=int, default=1024, help="checkpoint size (default 1024)")
    parser.add_argument("--arrays", type=int, default=16, help="number of arrays (default 16)")
    parser.add_argument("--loop-mb", type=int, default=256, help="two-tier loop state (default 256)")
    parser.add_argument("--steps", type=int, default=5, help="two-tier loop saves (default 5)")
    parser.add_argument("--workdir", help="local repositories here (default: a temp directory)")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    with s3_server() as endpoint, tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        bucket = f"bench-{uuid.uuid4().hex[:12]}"
        boto3.client("s3").create_bucket(Bucket=bucket)
        state = make_state(args.size_mb, args.arrays)
        nbytes = sum(a.nbytes for a in state.values())
        with cas_ckpt.open(Path(tmp) / "local") as local:
            figures = bench_push(local, f"s3://{bucket}/cas", state)
        figures.update(bench_boto3(bucket, state))
        loop = bench_two_tier(Path(tmp), f"s3://{bucket}/loop", args.loop_mb, args.arrays, args.steps)
    print(f"{nbytes / MiB:.0f} MiB in {args.arrays} arrays, endpoint {endpoint}, "
          f"{os.cpu_count()} CPUs, Python {platform.python_version()}")
    print(f"{'operation':<22} {'seconds':>8} {'MiB sent':>9} {'MiB/s':>8}")
    for label, row in figures.items():
        sent = row.get("bytes_sent", nbytes)
        print(f"{label:<22} {row['seconds']:8.2f} {sent / MiB:9.1f} {sent / MiB / row['seconds']:8.1f}")
    print(f"training loop, {args.steps} saves of {args.loop_mb} MiB, 10% changed per step:")
    for label, row in loop.items():
        print(f"  {label:<12} median save {row['median_save_seconds']:.3f} s, close "
              f"{row['close_seconds']:.3f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**run_info(), "bytes": nbytes, "arrays": args.arrays, "endpoint": endpoint,
                       "cpus": os.cpu_count(), "python": platform.python_version(),
                       "figures": figures, "loop_mb": args.loop_mb, "steps": args.steps,
                       "two_tier": loop}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
