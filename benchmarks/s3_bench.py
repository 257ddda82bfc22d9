"""Save and load throughput of an s3:// repository against plain boto3 moving the same bytes.

One run, one server: a moto S3 server started on 127.0.0.1 (or the server AWS_ENDPOINT_URL names,
with the credentials of the environment). The state is ``--arrays`` float32 arrays of ``--size-mb``
MiB in all, random (nothing deduplicates). Compared, on the same bytes:

- cas_ckpt ``save`` (hash, spool into a pack, multipart upload) and ``load`` (index read, ranged
  GETs of chunk runs in parallel, hash check), then a ``load`` served by a warm local block cache;
- boto3 ``put_object`` / ``get_object`` of each array, one after another;
- boto3 ``upload_fileobj`` / ``download_fileobj`` of each array (its transfer manager: parallel
  multipart parts and ranged GETs);
- boto3 ranged GETs of 16 MiB, 16 at a time, of one object holding all the arrays: the access
  pattern of a cas_ckpt load (moto reads a whole object for every ranged GET, so on moto this
  costs far more than on S3).

Each operation runs ``--reps`` times (default 3), cas_ckpt and boto3 taking turns to go first,
each after touching twice the state's bytes of fresh memory (``bench.prewarm``: in a VM that hands
freed memory back to its host, the first touch of fresh pages costs 1-3 s per GiB, which fell on
whichever load ran first: before 2026-12-04 that was always cas_ckpt's, one run each). The table
shows medians, and the ratios against the transfer manager are the medians of the repetitions'
paired ratios.

    .venv/bin/python benchmarks/s3_bench.py --size-mb 256 --json s3-bench.json
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import boto3
import numpy as np

import cas_ckpt

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import Meter, prewarm  # the sibling runner's peak-memory meter and memory prewarm

MiB = 1024 * 1024


@contextlib.contextmanager
def s3_server() -> Iterator[str]:
    """AWS_ENDPOINT_URL if set, else a moto server on a free loopback port for this run."""
    if os.environ.get("AWS_ENDPOINT_URL"):
        yield os.environ["AWS_ENDPOINT_URL"]
        return
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    # the tests' moto: conditional PUTs atomic, as S3's are (racing ranks and writers rely on it)
    server = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests",
                          "s3_server.py")
    proc = subprocess.Popen([sys.executable, server, "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.05)
        os.environ.update(AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}", AWS_ACCESS_KEY_ID="bench",
                          AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
                          S3_BENCH_SERVER_PID=str(proc.pid))  # its CPU time can be read
        yield os.environ["AWS_ENDPOINT_URL"]
    finally:
        proc.terminate()
        proc.wait()


def make_state(size_mb: int, arrays: int) -> dict[str, np.ndarray[Any, Any]]:
    rng = np.random.default_rng(0)
    n = size_mb * MiB // 4 // arrays
    return {f"layer{i}": rng.random(n, dtype=np.float32) for i in range(arrays)}


def timed(run: Callable[[], Any], nbytes: int) -> tuple[float, Any]:
    prewarm(2 * nbytes)
    started = time.perf_counter()
    result = run()
    return time.perf_counter() - started, result


def bench_cas(url: str, state: dict[str, Any], cache: str) -> tuple[dict[str, float], Meter]:
    """Seconds per operation into a new repository at ``url``, and the save's meter (its peak
    memory above the state). Loads run on an open repository, as a training job holds one;
    opening it (listing packs, reading their indexes) is its own row."""
    nbytes = sum(a.nbytes for a in state.values())
    prewarm(2 * nbytes)
    with cas_ckpt.open(url) as repo, Meter() as meter:
        repo.save(state)
    seconds: dict[str, float] = {"cas_ckpt save": meter.seconds}
    seconds["cas_ckpt open"], repo = timed(lambda: cas_ckpt.open(url, create=False), 0)
    with repo:
        seconds["cas_ckpt load"], loaded = timed(repo.load, nbytes)
        assert all(np.array_equal(loaded[k], v) for k, v in state.items())
    del loaded
    for label in ("cas_ckpt load, filling cache", "cas_ckpt load, cache warm"):
        with cas_ckpt.open(url, create=False, storage_options={"cache_dir": cache}) as repo:
            seconds[label], loaded = timed(repo.load, nbytes)
            assert all(np.array_equal(loaded[k], v) for k, v in state.items())
        del loaded
    return seconds, meter


def bench_boto3(bucket: str, prefix: str, state: dict[str, Any]) -> dict[str, float]:
    client = boto3.client("s3")
    blobs = {name: array.tobytes() for name, array in state.items()}
    nbytes = sum(len(b) for b in blobs.values())

    def put() -> None:
        for name, data in blobs.items():
            client.put_object(Bucket=bucket, Key=f"{prefix}/plain/{name}", Body=data)

    def get() -> None:
        for name, data in blobs.items():
            assert client.get_object(Bucket=bucket, Key=f"{prefix}/plain/{name}")["Body"].read() == data

    def upload() -> None:
        for name, data in blobs.items():
            client.upload_fileobj(io.BytesIO(data), bucket, f"{prefix}/managed/{name}")

    whole = b"".join(blobs.values())
    client.put_object(Bucket=bucket, Key=f"{prefix}/ranged/all", Body=whole)
    ranges = [(start, min(start + 16 * MiB, len(whole))) for start in range(0, len(whole), 16 * MiB)]

    def ranged() -> None:
        def one(span: tuple[int, int]) -> bytes:
            r = client.get_object(Bucket=bucket, Key=f"{prefix}/ranged/all",
                                  Range=f"bytes={span[0]}-{span[1] - 1}")
            return r["Body"].read()

        with ThreadPoolExecutor(16) as pool:
            assert b"".join(pool.map(one, ranges)) == whole

    def download() -> None:
        for name, data in blobs.items():
            out = io.BytesIO()
            client.download_fileobj(bucket, f"{prefix}/managed/{name}", out)
            assert out.getvalue() == data

    return {label: timed(run, nbytes)[0] for label, run in [
        ("boto3 put_object", put), ("boto3 get_object", get),
        ("boto3 upload_fileobj", upload), ("boto3 download_fileobj", download),
        ("boto3 16 MiB ranged GETs", ranged),
    ]}


BASELINE = {"save": "boto3 upload_fileobj", "load": "boto3 download_fileobj"}


def _kind(label: str) -> str:
    return "save" if any(w in label for w in ("save", "put", "upload")) else "load"


def report(runs: list[dict[str, float]], nbytes: int) -> str:
    """Medians over the repetitions; each row's speed against the transfer manager is the median
    of the repetitions' paired ratios (the open row has no baseline)."""
    lines = [f"{'operation':<30} {'seconds':>8} {'MiB/s':>8} {'vs boto3 transfer manager':>26}"]
    for label in runs[0]:
        value = statistics.median(run[label] for run in runs)
        if label == "cas_ckpt open":
            lines.append(f"{label:<30} {value:8.2f}")
            continue
        base = BASELINE[_kind(label)]
        speed = statistics.median(run[base] / run[label] for run in runs)
        lines.append(f"{label:<30} {value:8.2f} {nbytes / MiB / value:8.1f} {speed:25.2f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mb", type=int, default=256, help="total state size (default 256)")
    parser.add_argument("--arrays", type=int, default=8, help="number of arrays (default 8)")
    parser.add_argument("--reps", type=int, default=3, help="repetitions; medians are reported")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.error("--reps must be at least 1")
    state = make_state(args.size_mb, args.arrays)
    nbytes = sum(a.nbytes for a in state.values())
    runs: list[dict[str, float]] = []
    peaks: list[int] = []
    with s3_server() as endpoint:
        bucket = f"bench-{uuid.uuid4().hex[:12]}"
        boto3.client("s3").create_bucket(Bucket=bucket)
        for rep in range(args.reps):
            with tempfile.TemporaryDirectory() as cache:
                if rep % 2:  # the first to run meets a server that has not just worked
                    seconds = bench_boto3(bucket, f"r{rep}", state)
                    cas, save = bench_cas(f"s3://{bucket}/cas-r{rep}", state, cache)
                else:
                    cas, save = bench_cas(f"s3://{bucket}/cas-r{rep}", state, cache)
                    seconds = bench_boto3(bucket, f"r{rep}", state)
            runs.append({**cas, **seconds})
            peaks.append(save.peak)
    print(f"{nbytes / MiB:.0f} MiB in {len(state)} arrays, endpoint {endpoint}, "
          f"{os.cpu_count()} CPUs, Python {platform.python_version()}, {args.reps} repetitions")
    print(report(runs, nbytes))
    print(f"cas_ckpt save: peak memory {max(peaks) / MiB:.0f} MiB above the state ({save.method})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bytes": nbytes, "arrays": len(state), "endpoint": endpoint,
                       "cpus": os.cpu_count(), "reps": args.reps, "runs": runs,
                       "seconds": {label: statistics.median(run[label] for run in runs)
                                   for label in runs[0]},
                       "save_peak_bytes": max(peaks)},
                      f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
