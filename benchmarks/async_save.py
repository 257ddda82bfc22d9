"""How long a save blocks the training loop: synchronous versus async (snapshot first, write later).

    python benchmarks/async_save.py [--size-mib 256] [--saves 5] [--numpy] [--dir PATH]

Each save is of a state whose every byte changed since the last one (an in-place update, as an
optimizer step does), so nothing dedups. "blocked" is the time ``save()`` holds the loop; "durable"
is the time until the checkpoint is on disk and its ref moved (retention and GC included).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

import cas_ckpt


def make_state(size_mib: int, use_numpy: bool, parts: int = 16) -> dict[str, Any]:
    count = max(1, size_mib * 1024 * 1024 // 4 // parts)
    if use_numpy:
        return {f"layer{i}": np.random.default_rng(i).random(count, dtype=np.float32)
                for i in range(parts)}
    import torch

    gen = torch.Generator().manual_seed(0)
    return {f"layer{i}": torch.rand(count, generator=gen) for i in range(parts)}


def update(state: dict[str, Any]) -> None:
    """Change every byte in place, as an optimizer step would."""
    for value in state.values():
        value += 1.0


def run(mode: str, state: dict[str, Any], saves: int, root: Path) -> tuple[list[float], list[float]]:
    """Blocked and durable seconds per save."""
    blocked, durable = [], []
    with cas_ckpt.open(root / mode) as repo:
        mgr = cas_ckpt.CheckpointManager(repo, "bench", keep_last=2, async_save=mode == "async")
        for step in range(1, saves + 1):
            update(state)
            start = time.perf_counter()
            mgr.save(step, state)
            blocked.append(time.perf_counter() - start)
            update(state)  # the loop goes on while the write proceeds
            mgr.wait()
            durable.append(time.perf_counter() - start)
        mgr.close()
    return blocked, durable


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=256, help="state size (default 256 MiB)")
    parser.add_argument("--saves", type=int, default=5, help="saves per mode (default 5)")
    parser.add_argument("--numpy", action="store_true", help="numpy arrays instead of torch tensors")
    parser.add_argument("--dir", type=Path, default=None, help="where to put the repositories")
    args = parser.parse_args(argv)
    state = make_state(args.size_mib, args.numpy)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        results = {mode: run(mode, state, args.saves, Path(tmp)) for mode in ("sync", "async")}
    kind = "numpy" if args.numpy else "torch"
    print(f"state: {args.size_mib} MiB of {kind} float32, {args.saves} saves per mode (median)")
    print(f"{'mode':<6} {'blocked ms':>11} {'durable ms':>11} {'blocked MiB/s':>14}")
    for mode, (blocked, durable) in results.items():
        b, d = statistics.median(blocked), statistics.median(durable)
        print(f"{mode:<6} {b * 1e3:>11.1f} {d * 1e3:>11.1f} {args.size_mib / b:>14.0f}")
    ratio = statistics.median(results["sync"][0]) / statistics.median(results["async"][0])
    print(f"async blocks the loop {ratio:.1f}x less than sync")


if __name__ == "__main__":
    main()
