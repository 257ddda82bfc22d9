"""Compression inside packs, measured on real trained weights (issue #16).

For each state - the real all-MiniLM-L6-v2 weights (fp32), a bf16 copy of them, and the fp32
AdamW state after a few real training steps - it saves to a fresh local repository with
``compression="none"`` and ``"zstd"`` (durable: every save fsyncs), loads every byte back
verified, and reports the stored size against the raw bytes, the save and load times (medians,
the two settings alternating in one process run) and their ratios, and the CPU seconds, against
the issue's targets. Reference figures: zstd level 1 over the raw bytes, in one piece.

    .venv/bin/python benchmarks/compression_bench.py --reps 5 --json results/compression.json
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import zstandard

sys.path.insert(0, str(Path(__file__).resolve().parent))
import real_model

import cas_ckpt

TARGETS = {  # state -> largest stored/raw ratio the issue accepts
    "fp32 weights": 0.85, "bf16 weights": 0.70, "fp32 Adam state": 0.90,
}
TIME_TARGET = 1.3  # compressed save (and load) at most this many times the uncompressed one


def states(steps: int) -> dict[str, Any]:
    trained = real_model.trained_state(steps)
    weights = real_model.model_weights()
    bf16 = {k: v.astype(ml_dtypes.bfloat16) if v.dtype == np.float32 else v for k, v in weights.items()}
    return {
        "fp32 weights": weights,
        "bf16 weights": bf16,
        "fp32 Adam state": {"exp_avg": trained["exp_avg"], "exp_avg_sq": trained["exp_avg_sq"]},
    }


def raw_bytes(state: Any) -> int:
    if isinstance(state, dict):
        return sum(raw_bytes(v) for v in state.values())
    return state.nbytes


def zstd_whole(state: Any) -> float:
    """zstd level 1 over all the raw bytes, one frame: the reference ratio."""
    def flat(s: Any) -> list[np.ndarray[Any, Any]]:
        return [a for v in s.values() for a in flat(v)] if isinstance(s, dict) else [s]

    data = b"".join(a.tobytes() for a in flat(state))
    return len(zstandard.ZstdCompressor(level=1).compress(data)) / len(data)


def measure(state: Any, compression: str, work: Path) -> dict[str, float]:
    path = work / f"repo-{compression}"
    shutil.rmtree(path, ignore_errors=True)
    with cas_ckpt.open(path, compression=compression) as repo:
        cpu, wall = time.process_time(), time.perf_counter()
        cid = repo.save(state)
        save, save_cpu = time.perf_counter() - wall, time.process_time() - cpu
        report = repo.last_save
        assert report is not None
    with cas_ckpt.open(path) as repo:
        cpu, wall = time.process_time(), time.perf_counter()
        repo.load(cid)  # verified: every block re-hashed
        load, load_cpu = time.perf_counter() - wall, time.process_time() - cpu
    shutil.rmtree(path)
    return {"save": save, "save_cpu": save_cpu, "load": load, "load_cpu": load_cpu,
            "stored": report.bytes_stored, "written": report.bytes_written}


def run(reps: int, steps: int, work: Path) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name, state in states(steps).items():
        runs: dict[str, list[dict[str, float]]] = {"none": [], "zstd": []}
        for rep in range(reps):
            order = ("none", "zstd") if rep % 2 == 0 else ("zstd", "none")
            for compression in order:
                runs[compression].append(measure(state, compression, work))
        med = {c: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for c, rs in runs.items()}
        raw = raw_bytes(state)
        results[name] = {
            "raw_bytes": raw, "runs": runs, "median": med,
            "stored_ratio": med["zstd"]["stored"] / raw,
            "zstd_whole_ratio": zstd_whole(state),
            "save_ratio": med["zstd"]["save"] / med["none"]["save"],
            "load_ratio": med["zstd"]["load"] / med["none"]["load"],
        }
    return results


def render(results: dict[str, Any]) -> str:
    lines = ["| state | raw MiB | stored (target) | zstd-1 whole | save none / zstd (ratio) |"
             " load none / zstd (ratio) | save CPU s none / zstd |", "|---" * 7 + "|"]
    for name, r in results.items():
        m = r["median"]
        ok = "PASS" if r["stored_ratio"] <= TARGETS[name] else "MISS"
        save_ok = "PASS" if r["save_ratio"] <= TIME_TARGET else "MISS"
        load_ok = "PASS" if r["load_ratio"] <= TIME_TARGET else "MISS"
        lines.append(
            f"| {name} | {r['raw_bytes'] / 2**20:.1f} | {r['stored_ratio']:.1%} (<= {TARGETS[name]:.0%}) {ok}"
            f" | {r['zstd_whole_ratio']:.1%} | {m['none']['save']:.3f} / {m['zstd']['save']:.3f} s"
            f" ({r['save_ratio']:.2f}x) {save_ok} | {m['none']['load']:.3f} / {m['zstd']['load']:.3f} s"
            f" ({r['load_ratio']:.2f}x) {load_ok}"
            f" | {m['none']['save_cpu']:.3f} / {m['zstd']['save_cpu']:.3f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="AdamW steps before the state is taken")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--render", type=Path, help="print the table of an earlier --json and exit")
    args = parser.parse_args()
    if args.render:
        print(render(json.loads(args.render.read_text())["states"]))
        return
    work = args.workdir or Path(tempfile.mkdtemp(prefix="cas-compression-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        results = run(args.reps, args.steps, work)
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    print(render(results))
    if args.json:
        machine = {"cpu": platform.processor() or platform.machine(), "python": platform.python_version(),
                   "zstandard": zstandard.__version__, "numpy": np.__version__}
        args.json.write_text(json.dumps({"machine": machine, "reps": args.reps, "states": results}, indent=1))


if __name__ == "__main__":
    main()
