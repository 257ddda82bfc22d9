"""A small deterministic numpy MLP (dropout, Adam) that checkpoints with async saves.

    python train_numpy.py REPO STEPS [--pause-after STEP]

Same protocol as train_torch.py. Minibatches and dropout masks come from a numpy ``Generator``,
label noise from numpy's global generator and Python's ``random``: all three must be restored.
"""

from __future__ import annotations

import argparse
import random
import sys

import numpy as np

import cas_ckpt
from cas_ckpt.integrations.training import capture_rng, restore_rng

LR, BETAS, EPS = 1e-2, (0.9, 0.999), 1e-8


def init() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {
        "w1": rng.normal(0, 0.3, (8, 32)), "b1": np.zeros(32),
        "w2": rng.normal(0, 0.3, (32, 1)), "b2": np.zeros(1),
    }


def forward_backward(
    p: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray, gen: np.random.Generator
) -> tuple[float, dict[str, np.ndarray]]:
    h = x @ p["w1"] + p["b1"]
    a = np.maximum(h, 0)
    mask = (gen.random(a.shape) >= 0.2) / 0.8  # dropout
    d = a * mask
    out = d @ p["w2"] + p["b2"]
    err = out - y
    loss = float(np.mean(err**2))
    g_out = 2 * err / len(x)
    g_d = g_out @ p["w2"].T
    g_h = g_d * mask * (h > 0)
    grads = {"w2": d.T @ g_out, "b2": g_out.sum(0), "w1": x.T @ g_h, "b1": g_h.sum(0)}
    return loss, grads


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("repo")
    parser.add_argument("steps", type=int)
    parser.add_argument("--pause-after", type=int, default=None)
    args = parser.parse_args()

    random.seed(1)
    np.random.seed(1)
    gen = np.random.default_rng(2)
    data = np.random.default_rng(3)
    inputs = data.normal(size=(256, 8))
    targets = inputs @ data.normal(size=(8, 1))
    params = init()
    adam = {"m": {k: np.zeros_like(v) for k, v in params.items()},
            "v": {k: np.zeros_like(v) for k, v in params.items()}, "t": 0}

    repo = cas_ckpt.open(args.repo)
    manager = cas_ckpt.CheckpointManager(repo, "run", save_every=5, keep_last=2, async_save=True)
    start = 0
    if manager.latest_step() is not None:
        state = manager.restore()
        params, adam, start = state["params"], state["adam"], state["step"]
        restore_rng(state["rng"], gen)

    for step in range(start + 1, args.steps + 1):
        index = gen.integers(0, 256, 32)
        noise = np.random.normal(scale=1e-2, size=(32, 1)) * (1 + random.random())
        loss, grads = forward_backward(params, inputs[index], targets[index] + noise, gen)
        adam["t"] += 1
        for k, g in grads.items():  # updates in place, right after an async save returned
            adam["m"][k] *= BETAS[0]
            adam["m"][k] += (1 - BETAS[0]) * g
            adam["v"][k] *= BETAS[1]
            adam["v"][k] += (1 - BETAS[1]) * g * g
            m_hat = adam["m"][k] / (1 - BETAS[0] ** adam["t"])
            v_hat = adam["v"][k] / (1 - BETAS[1] ** adam["t"])
            params[k] -= LR * m_hat / (np.sqrt(v_hat) + EPS)
        print(f"loss {step} {loss.hex()}", flush=True)
        state = {"params": params, "adam": adam, "step": step, "rng": capture_rng(gen)}
        manager.save(step, state, metrics={"loss": loss})
        if step == args.pause_after:
            manager.wait()  # durable before we report it
            print(f"SAVED {step}", flush=True)
            sys.stdin.readline()  # wait here to be killed
    manager.close()
    repo.close()


if __name__ == "__main__":
    main()
