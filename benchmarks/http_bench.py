"""A checkpoint over loopback HTTP: cas_ckpt's verified load from ``cas-ckpt serve`` against the same
bytes as one safetensors file from ``python -m http.server``, and 8 clients at once against one.

One run, side by side, on this machine's loopback interface. The state is ``--arrays`` random
float32 arrays of ``--size-mb`` MiB in all (nothing deduplicates), saved in a cas_ckpt repository
and written as one ``model.safetensors``. Compared:

- **cas_ckpt**: ``cas_ckpt.open(url).load("main")`` against a ``cas-ckpt serve`` process: the
  refs API, every block fetched in parallel (16 connections) and hashed against its CID on both
  sides (the server never sends a block it has not verified);
- **safetensors, file**: a plain client (``urllib.request``) downloads ``model.safetensors`` from
  ``python -m http.server`` to a file, then ``safetensors.numpy.load_file`` reads it;
- **safetensors, memory**: the same download into memory, then ``safetensors.numpy.load`` of the
  bytes (no disk: the fastest a plain client gets);
- **8 clients**: ``--clients`` processes load at once (each one whole checkpoint), from each
  server; the server's throughput is their bytes over the wall time until the last ends.

Each single-client operation runs ``--reps`` times, the tools taking turns to go first, each after
touching fresh memory (``bench.prewarm``). Every load is compared with the source, outside the
timing. Seconds are medians; ratios are the medians of the repetitions' paired ratios (above 1:
cas_ckpt is faster).

    .venv/bin/python benchmarks/http_bench.py --size-mb 1024 --json http-bench.json
    .venv/bin/python benchmarks/http_bench.py --size-mb 1024 --hash blake3 --json http-bench-b3.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import load as st_load
from safetensors.numpy import load_file, save_file

import cas_ckpt

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import Meter, prewarm  # the sibling runner's peak-memory meter and memory prewarm

MiB = 1024 * 1024

# One client of the multi-client run: waits for "go" on stdin, loads, prints its seconds.
CLIENT = """
import sys, time, urllib.request, cas_ckpt
from safetensors.numpy import load
kind, url = sys.argv[1], sys.argv[2]
sys.stdin.readline()
t = time.perf_counter()
if kind == "cas":
    with cas_ckpt.open(url) as repo:
        state = repo.load("main")
else:
    with urllib.request.urlopen(url) as r:
        state = load(r.read())
print(time.perf_counter() - t, sum(a.nbytes for a in state.values()))
"""


def make_state(size_mb: int, arrays: int) -> dict[str, np.ndarray[Any, Any]]:
    rng = np.random.default_rng(0)
    per = size_mb * MiB // arrays // 4
    return {f"layer{i}.weight": rng.random(per, dtype=np.float32) for i in range(arrays)}


def _same(state: dict[str, Any], loaded: dict[str, Any]) -> bool:
    return set(state) == set(loaded) and all(np.array_equal(state[k], loaded[k]) for k in state)


def start_cas_server(repo: Path) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([sys.executable, "-m", "cas_ckpt", "serve", str(repo), "--port", "0"],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    return proc, line.split(" at ")[1].split()[0]


def start_static_server(folder: Path) -> tuple[subprocess.Popen[str], str]:
    """``python -m http.server`` on a free port; its URL once it accepts connections."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1",
                             "--directory", str(folder)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(600):
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc, f"http://127.0.0.1:{port}"
        time.sleep(0.05)
    raise RuntimeError("http.server did not start")


def hwm(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def load_cas(url: str, state: dict[str, Any]) -> dict[str, Any]:
    prewarm(2 * sum(a.nbytes for a in state.values()))
    with Meter() as meter, cas_ckpt.open(url) as repo:
        loaded = repo.load("main")
    return {**meter.figures(), "verified": _same(state, loaded)}


def load_file_download(url: str, state: dict[str, Any], spool: Path) -> dict[str, Any]:
    prewarm(2 * sum(a.nbytes for a in state.values()))
    with Meter() as meter:
        with urllib.request.urlopen(f"{url}/model.safetensors") as r, open(spool, "wb") as f:
            shutil.copyfileobj(r, f, 1 << 20)
        loaded = load_file(spool)
    spool.unlink()
    return {**meter.figures(), "verified": _same(state, loaded)}


def load_memory_download(url: str, state: dict[str, Any]) -> dict[str, Any]:
    prewarm(2 * sum(a.nbytes for a in state.values()))
    with Meter() as meter, urllib.request.urlopen(f"{url}/model.safetensors") as r:
        loaded = st_load(r.read())
    return {**meter.figures(), "verified": _same(state, loaded)}


def many_clients(kind: str, url: str, clients: int, nbytes: int) -> dict[str, Any]:
    procs = [subprocess.Popen([sys.executable, "-c", CLIENT, kind, url], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) for _ in range(clients)]
    started = time.perf_counter()
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()
    outs = [proc.communicate(timeout=3600)[0].split() for proc in procs]
    wall = time.perf_counter() - started
    assert all(int(out[1]) == nbytes for out in outs), outs
    return {"clients": clients, "wall_seconds": wall, "client_seconds": [float(o[0]) for o in outs],
            "throughput_mib_s": clients * nbytes / MiB / wall}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=int, default=1024)
    parser.add_argument("--arrays", type=int, default=16)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--hash", default="sha2-256", choices=["sha2-256", "blake3"],
                        help="the repository's hash (both sides verify every block with it)")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    state = make_state(args.size_mb, args.arrays)
    nbytes = sum(a.nbytes for a in state.values())
    work = Path(tempfile.mkdtemp(prefix="http-bench-"))
    results: dict[str, Any] = {"size_bytes": nbytes, "arrays": args.arrays, "reps": args.reps,
                               "hash": args.hash,
                               "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                                           "platform": platform.platform()},
                               "date": time.strftime("%Y-%m-%d")}
    try:
        with cas_ckpt.open(work / "repo", hash=args.hash) as repo:
            repo.save(state, ref="main")
        (work / "static").mkdir()
        save_file(state, str(work / "static" / "model.safetensors"))
        cas_proc, cas_url = start_cas_server(work / "repo")
        static_proc, static_url = start_static_server(work / "static")
        try:
            runs: dict[str, list[dict[str, Any]]] = {"cas_ckpt": [], "safetensors_file": [],
                                                      "safetensors_memory": []}
            ops = {"cas_ckpt": lambda: load_cas(cas_url, state),
                   "safetensors_file": lambda: load_file_download(static_url, state, work / "spool"),
                   "safetensors_memory": lambda: load_memory_download(static_url, state)}
            names = list(ops)
            for rep in range(args.reps):
                for name in names[rep % len(names):] + names[: rep % len(names)]:
                    run = ops[name]()
                    assert run["verified"], f"{name} loaded something else"
                    runs[name].append(run)
                    print(f"rep {rep} {name}: {run['seconds']:.2f} s", flush=True)
            results["single"] = runs
            results["server_peak_rss_bytes"] = hwm(cas_proc.pid)
            if args.clients > 1:
                file_url = f"{static_url}/model.safetensors"
                results["many"] = {
                    "cas_ckpt": many_clients("cas", cas_url, args.clients, nbytes),
                    "cas_ckpt_one": many_clients("cas", cas_url, 1, nbytes),
                    "http.server": many_clients("static", file_url, args.clients, nbytes),
                    "http.server_one": many_clients("static", file_url, 1, nbytes),
                }
                results["server_peak_rss_bytes"] = hwm(cas_proc.pid)
        finally:
            for proc in (cas_proc, static_proc):
                proc.terminate()
                proc.wait()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(report(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


def report(results: dict[str, Any]) -> str:
    nbytes = results["size_bytes"]
    runs = results["single"]
    lines = [f"{nbytes / MiB:.0f} MiB, {results['arrays']} float32 arrays, {results['reps']} reps, "
             f"{results['machine']['cpus']} CPUs, a {results.get('hash', 'sha2-256')} repository",
             "| operation | seconds | MiB/s | cas_ckpt's speed vs it | peak client memory |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for name, label in (("cas_ckpt", "cas_ckpt verified load over HTTP"),
                        ("safetensors_file", "urllib download to a file + safetensors load_file"),
                        ("safetensors_memory", "urllib download to memory + safetensors load")):
        seconds = statistics.median(r["seconds"] for r in runs[name])
        ratio = statistics.median(b["seconds"] / a["seconds"] for a, b in zip(runs["cas_ckpt"], runs[name],
                                                                               strict=True))
        peak = max(r["peak_bytes"] for r in runs[name]) / MiB
        vs = "" if name == "cas_ckpt" else f"{ratio:.2f}x"
        lines.append(f"| {label} | {seconds:.2f} | {nbytes / MiB / seconds:.0f} | {vs} | {peak:.0f} MiB |")
    many = results.get("many")
    if many:
        for name, label in (("cas_ckpt", "cas-ckpt serve"), ("http.server", "python -m http.server")):
            one, all_ = many[f"{name}_one"]["throughput_mib_s"], many[name]["throughput_mib_s"]
            lines.append(f"{label}: {many[name]['clients']} clients {all_:.0f} MiB/s, one client "
                         f"{one:.0f} MiB/s ({all_ / one:.2f}x)")
    lines.append(f"cas-ckpt serve peak RSS: {results['server_peak_rss_bytes'] / MiB:.0f} MiB")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
