"""Linear regression by SGD that saves on preemption (SIGTERM or SIGUSR1) and exits 0.

    python train_preempt.py REPO STEPS DELAY [RANK WORLD PORT]

Prints each step before it asks ``reached_preemption``, ``saved STEP`` after a preemption save,
and ``done <final weights as hex>`` at the end. With RANK WORLD PORT it joins a gloo group on
127.0.0.1 and saves under its own ref ``run-RANK``. Minibatches come from a numpy ``Generator``
whose state is checkpointed, so a resumed run draws exactly what an uninterrupted one would.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import numpy as np

import cas_ckpt

LR, BATCH = 0.01, 16


def data() -> tuple[np.ndarray, np.ndarray]:
    x = np.random.default_rng(0).normal(size=(256, 8))
    return x, x @ np.arange(8.0)


def start(manager: cas_ckpt.CheckpointManager) -> tuple[int, np.ndarray, np.random.Generator]:
    if manager.latest_step() is None:
        return 0, np.zeros(8), np.random.default_rng(1)
    state = manager.restore()
    rng = np.random.default_rng()
    rng.bit_generator.state = json.loads(state["rng"])  # 128-bit ints: msgpack holds 64
    return state["step"], state["w"], rng


def state_of(step: int, w: np.ndarray, rng: np.random.Generator) -> dict[str, Any]:
    return {"step": step, "w": w, "rng": json.dumps(rng.bit_generator.state)}


def main() -> None:
    repo_path, total, delay = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    ref = "run"
    if len(sys.argv) > 4:
        import torch.distributed as dist

        rank, world, port = (int(a) for a in sys.argv[4:7])
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
        )
        ref = f"run-{rank}"
    repo = cas_ckpt.open(repo_path)
    manager = cas_ckpt.CheckpointManager(
        repo, ref, save_every=25, async_save=True, preemption=True
    )
    x, y = data()
    first, w, rng = start(manager)
    for step in range(first + 1, total + 1):
        idx = rng.integers(0, len(x), BATCH)
        w = w - LR * 2 * x[idx].T @ (x[idx] @ w - y[idx]) / BATCH
        print(step, flush=True)
        if manager.reached_preemption(step):
            manager.save(step, state_of(step, w, rng), force=True)
            print("saved", step, flush=True)
            manager.close()
            sys.exit(0)
        manager.save(step, state_of(step, w, rng))
        time.sleep(delay)
    manager.close()
    print("done", w.tobytes().hex(), flush=True)


if __name__ == "__main__":
    try:
        main()
    finally:
        if "torch.distributed" in sys.modules and sys.modules["torch.distributed"].is_initialized():
            sys.modules["torch.distributed"].destroy_process_group()
