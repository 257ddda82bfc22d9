"""A small deterministic torch training loop that checkpoints through CheckpointManager.

    python train_torch.py REPO STEPS [--pause-after STEP]

Resumes from the repository's latest checkpoint when there is one. Prints ``loss <step> <hex>`` per
step. With ``--pause-after``, once that step's checkpoint is saved it prints ``SAVED <step>`` and
blocks on stdin, for the parent to kill it. Dropout, minibatch sampling and input noise draw from
torch's, numpy's and Python's global generators, so resuming bit for bit needs all three restored.
"""

from __future__ import annotations

import argparse
import random
import sys

import numpy as np
import torch

import cas_ckpt
from cas_ckpt.integrations.training import restore_training_state, training_state

torch.use_deterministic_algorithms(True)
torch.set_num_threads(1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("repo")
    parser.add_argument("steps", type=int)
    parser.add_argument("--pause-after", type=int, default=None)
    args = parser.parse_args()

    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    data = torch.Generator().manual_seed(123)
    inputs = torch.randn(256, 8, generator=data)
    targets = inputs @ torch.randn(8, 1, generator=data) + 0.1 * torch.randn(256, 1, generator=data)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 1)
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.7)

    repo = cas_ckpt.open(args.repo)
    manager = cas_ckpt.CheckpointManager(repo, "run", save_every=5, keep_last=2)
    start = 0
    if manager.latest_step() is not None:
        state = manager.restore()
        start = restore_training_state(
            state, model=model, optimizer=optimizer, scheduler=scheduler
        )["step"]

    for step in range(start + 1, args.steps + 1):
        model.train()
        index = torch.randint(0, 256, (32,))
        scale = 1.0 + random.random() * 1e-2
        shift = float(np.random.normal(scale=1e-2))
        loss = torch.nn.functional.mse_loss(model(inputs[index] * scale + shift), targets[index])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
        print(f"loss {step} {loss.item().hex()}", flush=True)
        state = training_state(
            model=model, optimizer=optimizer, scheduler=scheduler, extra={"step": step}
        )
        saved = manager.save(step, state, metrics={"loss": loss.item()})
        if saved is not None and step == args.pause_after:
            print(f"SAVED {step}", flush=True)
            sys.stdin.readline()  # wait here to be killed
    manager.close()
    repo.close()


if __name__ == "__main__":
    main()
