"""Dedup figures: how much a save really writes in the situations training produces.

    python benchmarks/dedup.py [--scale 1.0] [--json out.json]

Scenarios (all data random, never zeros):
  unchanged    re-save the same state
  finetune     90% of parameters frozen: only 10% of weights and their Adam state change
  blob-insert  a large opaque blob with one byte inserted at the front (content-defined chunks)
  two-runs     two runs (two refs) from the same initialisation, then 5 steps each
It also measures the chunk-size choice (array chunk size vs. save speed and fine-tune dedup) and
the content-defined chunker (fastcdc's Cython core vs. a vectorised numpy gear hash).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from fastcdc.fastcdc_cy import fastcdc_cy

import cas_ckpt

MiB = 1024 * 1024


def model(rng: np.random.Generator, scale: float) -> dict[str, np.ndarray]:
    """A GPT-2-small-like set of float32 tensors, ~scale x 120 MiB."""
    layers = max(1, round(12 * scale))
    params = {"wte": rng.standard_normal((int(50257 * min(scale, 1.0)), 768), np.float32)}
    for i in range(layers):
        params[f"h.{i}.attn.c_attn.weight"] = rng.standard_normal((768, 2304), np.float32)
        params[f"h.{i}.attn.c_proj.weight"] = rng.standard_normal((768, 768), np.float32)
        params[f"h.{i}.mlp.c_fc.weight"] = rng.standard_normal((768, 3072), np.float32)
        params[f"h.{i}.mlp.c_proj.weight"] = rng.standard_normal((3072, 768), np.float32)
        params[f"h.{i}.ln_1.weight"] = rng.standard_normal(768, np.float32)
    return params


def with_adam(params: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, Any]:
    return {
        "model": params,
        "optimizer": {
            name: {"exp_avg": rng.standard_normal(p.shape, np.float32),
                   "exp_avg_sq": rng.random(p.shape, np.float32)}
            for name, p in params.items()
        },
        "step": 0,
    }


def figures(repo: cas_ckpt.Repository) -> dict[str, Any]:
    r = repo.last_save
    assert r is not None
    return {
        "logical_bytes": r.logical_bytes,
        "bytes_written": r.bytes_written,
        "blocks_written": r.blocks_written,
        "blocks_reused": r.blocks_reused,
        "written_share": r.bytes_written / max(1, r.logical_bytes),
        "seconds": r.seconds,
    }


def scenario_unchanged(root: Path, scale: float) -> dict[str, Any]:
    rng = np.random.default_rng(1)
    state = with_adam(model(rng, scale), rng)
    with cas_ckpt.open(root / "unchanged") as repo:
        repo.save(state, step=0)
        repo.save(state, step=0)
        return figures(repo)


def scenario_finetune(root: Path, scale: float, chunk_size: int = MiB) -> dict[str, Any]:
    rng = np.random.default_rng(2)
    state = with_adam(model(rng, scale), rng)
    trainable = top_layers(state["model"], 0.10)
    with cas_ckpt.open(root / f"finetune-{chunk_size}-{time.monotonic_ns()}",
                       chunk_size=chunk_size) as repo:
        repo.save(state, step=0)
        for name in trainable:
            for array in (state["model"][name], state["optimizer"][name]["exp_avg"],
                          state["optimizer"][name]["exp_avg_sq"]):
                array += np.float32(1e-3)
        state["step"] = 1
        repo.save(state, step=1)
        result = figures(repo)
    share = sum(state["model"][n].nbytes for n in trainable) / sum(
        a.nbytes for a in state["model"].values())
    result["changed_parameter_share"] = share
    return result


def top_layers(params: dict[str, np.ndarray], share: float) -> set[str]:
    """The last tensors (the top of the network) holding about ``share`` of the parameter bytes."""
    total = sum(a.nbytes for a in params.values())
    chosen: set[str] = set()
    size = 0
    for name in reversed(list(params)):
        if size >= share * total:
            break
        chosen.add(name)
        size += params[name].nbytes
    return chosen


def scenario_blob_insert(root: Path, scale: float) -> dict[str, Any]:
    blob = np.random.default_rng(3).bytes(int(64 * MiB * scale) or MiB)
    with cas_ckpt.open(root / "blob") as repo:
        repo.save({"optimizer_blob": blob})
        repo.save({"optimizer_blob": b"\x01" + blob})
        return figures(repo)


def scenario_two_runs(root: Path, scale: float) -> dict[str, Any]:
    rng = np.random.default_rng(4)
    init = with_adam(model(rng, scale), rng)
    out: dict[str, Any] = {}
    with cas_ckpt.open(root / "two-runs") as repo:
        repo.save(init, ref="runs/a", step=0)
        repo.save(init, ref="runs/b", step=0)
        out["second_run_initial_save"] = figures(repo)
        for run, seed in (("runs/a", 5), ("runs/b", 6)):
            step_rng = np.random.default_rng(seed)
            state = {"model": {k: v.copy() for k, v in init["model"].items()},
                     "optimizer": init["optimizer"], "step": 0}
            for step in range(1, 6):
                name = list(state["model"])[step_rng.integers(len(state["model"]))]
                state["model"][name] += np.float32(1e-3)
                state["step"] = step
                repo.save(state, ref=run, step=step)
        usage = repo.stats()
        out["repository"] = {
            "logical_bytes": usage.logical_bytes,
            "stored_bytes": usage.stored_bytes,
            "total_bytes": usage.total_bytes,
            "dedup_ratio": usage.dedup_ratio,
        }
    return out


def chunk_size_sweep(root: Path, scale: float) -> list[dict[str, Any]]:
    rows = []
    for size in (256 * 1024, 512 * 1024, MiB):
        rng = np.random.default_rng(7)
        state = with_adam(model(rng, scale), rng)
        with cas_ckpt.open(root / f"sweep-{size}", chunk_size=size) as repo:
            start = time.perf_counter()
            repo.save(state)
            seconds = time.perf_counter() - start
            blocks = repo.last_save.blocks_written  # type: ignore[union-attr]
            logical = repo.last_save.logical_bytes  # type: ignore[union-attr]
            rows.append({
                "chunk_size": size,
                "fresh_save_GBps": logical / seconds / 1e9,
                "blocks": blocks,
                "sparse_update_written_share": sparse_update_share(repo, state),
            })
    return rows


def sparse_update_share(repo: cas_ckpt.Repository, state: dict[str, Any]) -> float:
    """Re-save after changing 64 random rows of the embedding table (a sparse update)."""
    wte = state["model"]["wte"]
    rows = np.random.default_rng(9).choice(len(wte), 64, replace=False)
    wte[rows] += np.float32(1e-3)
    repo.save(state)
    report = repo.last_save
    assert report is not None
    return report.bytes_written / wte.nbytes


_GEAR = np.random.default_rng(0xCDC).integers(0, 2**63, 256, dtype=np.uint64)


def numpy_gear_cuts(data: bytes, avg: int = 256 * 1024) -> int:
    """Count FastCDC-style cut points with a vectorised 64-byte gear hash (the numpy baseline)."""
    b = np.frombuffer(data, np.uint8)
    g = _GEAR[b]
    h = np.zeros(len(b), np.uint64)
    for k in range(64):  # h[i] = sum_k G[b[i-k]] << k: the gear hash after 64 bytes of history
        h[k:] += g[: len(b) - k] << np.uint64(k)
    mask = np.uint64((1 << (avg.bit_length() - 1)) - 1) << np.uint64(64 - avg.bit_length() + 1)
    return int(np.count_nonzero((h & mask) == 0))


def chunker_comparison(scale: float) -> dict[str, Any]:
    data = np.random.default_rng(8).bytes(int(16 * MiB * max(scale, 0.25)))
    start = time.perf_counter()
    cuts = sum(1 for _ in fastcdc_cy(data, 64 * 1024, 256 * 1024, MiB, False, None))
    fast = time.perf_counter() - start
    start = time.perf_counter()
    numpy_gear_cuts(data)
    slow = time.perf_counter() - start
    return {"bytes": len(data), "fastcdc_GBps": len(data) / fast / 1e9,
            "numpy_gear_GBps": len(data) / slow / 1e9, "fastcdc_chunks": cuts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scale", type=float, default=1.0, help="1.0: ~120 MiB model + Adam")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="cas-dedup-") as tmp:
        root = Path(tmp)
        results = {
            "unchanged": scenario_unchanged(root, args.scale),
            "finetune": scenario_finetune(root, args.scale),
            "blob-insert": scenario_blob_insert(root, args.scale),
            "two-runs": scenario_two_runs(root, args.scale),
            "chunk-size": chunk_size_sweep(root, args.scale),
            "chunker": chunker_comparison(args.scale),
        }
    print(f"{'scenario':<28}{'logical':>12}{'written':>12}{'share':>8}{'reused blocks':>15}")
    for name in ("unchanged", "finetune", "blob-insert"):
        r = results[name]
        print(f"{name:<28}{r['logical_bytes'] / MiB:>10.1f}Mi{r['bytes_written'] / MiB:>10.2f}Mi"
              f"{r['written_share']:>8.1%}{r['blocks_reused']:>15}")
    r = results["two-runs"]["second_run_initial_save"]
    print(f"{'two-runs: 2nd run init':<28}{r['logical_bytes'] / MiB:>10.1f}Mi"
          f"{r['bytes_written'] / MiB:>10.2f}Mi{r['written_share']:>8.1%}{r['blocks_reused']:>15}")
    repo = results["two-runs"]["repository"]
    print(f"two-runs repository: logical {repo['logical_bytes'] / MiB:.1f} MiB, stored "
          f"{repo['stored_bytes'] / MiB:.1f} MiB, dedup ratio {repo['dedup_ratio']:.2f}x")
    print("\nchunk size   fresh save GB/s   blocks   64 embedding rows changed: written / table")
    for row in results["chunk-size"]:
        print(f"{row['chunk_size'] // 1024:>7} KiB {row['fresh_save_GBps']:>14.2f} {row['blocks']:>8}"
              f" {row['sparse_update_written_share']:>18.1%}")
    c = results["chunker"]
    print(f"\nCDC chunker: fastcdc {c['fastcdc_GBps']:.2f} GB/s, numpy gear hash "
          f"{c['numpy_gear_GBps']:.3f} GB/s ({c['fastcdc_chunks']} chunks of ~256 KiB)")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
