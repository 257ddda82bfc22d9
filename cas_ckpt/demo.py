"""The demo: train, checkpoint, crash, resume, and show what the repository holds.

A small numpy MLP learns a synthetic regression task with Adam, fine-tuning style: its first layer is
a frozen "pretrained" backbone, so every checkpoint shares those blocks. A child process trains and saves a
checkpoint every few steps; the parent kills it with SIGKILL right after one of them, as a crash
would. The parent then resumes from the ref, trains to the end, checks the result against a run
that never crashed, and prints the history and the storage figures.

    python -m cas_ckpt.demo [--repo PATH] [--steps N] [--every K] [--crash-after STEP]

PATH must be a new or empty folder, or one an earlier run of the demo made (marked by a
``.cas-ckpt-demo`` file), which is emptied first: the demo deletes nothing it did not make.
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

import cas_ckpt
import cas_ckpt.cid
from cas_ckpt.maintenance.usage import logical_size
from cas_ckpt.maintenance.walk import walk

REF = "demo/mlp"
MARK = ".cas-ckpt-demo"  # in a folder the demo made: its next run may empty it, nothing else may
SIZES = (256, 1024, 256, 1)  # 2 MiB of float32 weights: several chunks per tensor
FROZEN = ("layer0.weight", "layer0.bias")  # the backbone: never updated, stored once


def init_state(seed: int = 0) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    params = {}
    for i, (fan_in, fan_out) in enumerate(itertools.pairwise(SIZES)):
        params[f"layer{i}.weight"] = (rng.standard_normal((fan_in, fan_out)) / np.sqrt(fan_in)).astype(
            np.float32
        )
        params[f"layer{i}.bias"] = np.zeros(fan_out, dtype=np.float32)
    zeros = {k: np.zeros_like(v) for k, v in params.items() if k not in FROZEN}
    return {
        "model": params,
        "optimizer": {"m": zeros, "v": {k: v.copy() for k, v in zeros.items()}, "t": 0},
        "rng": rng.bit_generator.state,  # PCG64 state holds 128-bit ints: saved exactly
        "step": 0,
        "losses": [],
    }


def train_step(state: dict[str, Any], lr: float = 1e-3) -> float:
    """One Adam step on a fresh minibatch drawn from the saved RNG (so resume is bit-exact)."""
    rng = np.random.default_rng()
    rng.bit_generator.state = state["rng"]
    x = rng.standard_normal((128, SIZES[0])).astype(np.float32)
    y = np.sin(x[:, :1] * 2.0) + 0.5 * x[:, 1:2]
    p = state["model"]
    acts = [x]
    for i in range(len(SIZES) - 1):
        z = acts[-1] @ p[f"layer{i}.weight"] + p[f"layer{i}.bias"]
        acts.append(np.maximum(z, 0) if i < len(SIZES) - 2 else z)
    err = acts[-1] - y
    loss = float(np.mean(err**2))
    grad = 2 * err / len(x)
    opt = state["optimizer"]
    opt["t"] += 1
    for i in reversed(range(len(SIZES) - 1)):
        gw, gb = acts[i].T @ grad, grad.sum(0)
        if i:
            grad = (grad @ p[f"layer{i}.weight"].T) * (acts[i] > 0)
        for name, g in ((f"layer{i}.weight", gw), (f"layer{i}.bias", gb)):
            if name in FROZEN:
                continue
            m, v = opt["m"][name], opt["v"][name]
            m[...] = 0.9 * m + 0.1 * g
            v[...] = 0.999 * v + 0.001 * g * g
            mhat = m / (1 - 0.9 ** opt["t"])
            vhat = v / (1 - 0.999 ** opt["t"])
            p[name] -= (lr * mhat / (np.sqrt(vhat) + 1e-8)).astype(np.float32)
    state["rng"] = rng.bit_generator.state
    state["step"] += 1
    state["losses"].append(loss)
    return loss


def run(repo_path: str, state: dict[str, Any], steps: int, every: int, *, announce: bool) -> None:
    with cas_ckpt.open(repo_path) as repo:
        while state["step"] < steps:
            loss = train_step(state)
            if state["step"] % every == 0 or state["step"] == steps:
                repo.save(state, ref=REF, step=state["step"], metadata={"loss": loss})
                if announce:
                    print(f"saved {state['step']}", flush=True)


def crash_run(repo_path: str, steps: int, every: int, crash_after: int) -> None:
    """Train in a child process and SIGKILL it right after step ``crash_after`` is saved."""
    cmd = [sys.executable, "-m", "cas_ckpt.demo", "--child", "--repo", repo_path,
           "--steps", str(steps), "--every", str(every)]
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    for line in child.stdout:
        if line.strip() == f"saved {crash_after}":
            os.kill(child.pid, signal.SIGKILL)
            break
    child.wait()
    print(f"  child trained to step {crash_after}, then was killed with SIGKILL "
          f"(exit status {child.returncode})")


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def report(repo: cas_ckpt.Repository) -> None:
    print("\nHistory (newest first):")
    commits = list(repo.log(REF))
    for commit in commits:
        print(f"  step {commit.step:>3}  loss {commit.metadata['loss']:.4f}  {commit.cid}")
    logical = references = 0
    unique: set[bytes] = set()
    for commit in commits:
        root = cas_ckpt.cid.to_bytes(commit.cid)
        blocks = walk(repo.blocks, {root: REF}).data
        logical += logical_size(repo.blocks, root)
        references += len(blocks)
        unique |= blocks
    usage = repo.stats()
    print("\nStorage:")
    print(f"  checkpoints      {len(commits)}")
    print(f"  logical bytes    {human(logical)}  (all checkpoints, each counted in full)")
    print(f"  bytes stored     {human(usage.total_bytes)}  in {usage.total_blocks} blocks, "
          f"{human(logical - usage.total_bytes)} saved by dedup")
    print(f"  blocks reused    {references - len(unique)} of {references} block references")


def prepare(folder: Path) -> str | None:
    """Make ``folder`` ready for a new demo repository; what is wrong with it, or None.

    Only a folder that is missing, empty, or marked by an earlier run of the demo is used (the
    marked one emptied first): the demo never deletes anything it did not make.
    """
    if folder.is_symlink() or (folder.exists() and not folder.is_dir()):
        return f"{folder} is not a folder"
    if folder.is_dir() and any(folder.iterdir()):
        if not (folder / MARK).is_file():
            return (f"{folder} is not empty, and not a folder an earlier run of the demo made: "
                    "the demo deletes only what it made; pass --repo with a new or empty folder")
        for entry in folder.iterdir():
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
    return None


def create(folder: Path) -> None:
    """Create the demo's repository in ``folder`` and mark the folder as the demo's."""
    cas_ckpt.open(folder).close()
    (folder / MARK).write_text("Made by python -m cas_ckpt.demo, which empties it on its next run.\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cas_ckpt.demo", description=__doc__.split("\n")[0])
    parser.add_argument("--repo", default="demo-repo",
                        help="repository folder: new, empty, or made by an earlier run of the demo, "
                             "which is emptied (default: ./demo-repo)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--crash-after", type=int, default=20)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        run(args.repo, init_state(), args.steps, args.every, announce=True)
        return 0
    if not 0 < args.crash_after < args.steps or args.crash_after % args.every:
        parser.error("--crash-after must be a multiple of --every below --steps")
    problem = prepare(Path(args.repo))
    if problem is not None:
        parser.error(problem)
    create(Path(args.repo))
    print(f"Training {args.steps} steps, checkpointing every {args.every} into {args.repo}/")
    crash_run(args.repo, args.steps, args.every, args.crash_after)

    with cas_ckpt.open(args.repo) as repo:
        state = repo.load(REF)
        print(f"  resumed from {repo.resolve(REF)} at step {state['step']}")
        while state["step"] < args.steps:
            loss = train_step(state)
            if state["step"] % args.every == 0 or state["step"] == args.steps:
                repo.save(state, ref=REF, step=state["step"], metadata={"loss": loss})

        straight = init_state()
        with tempfile.TemporaryDirectory() as tmp:
            run(str(Path(tmp) / "r"), straight, args.steps, args.every, announce=False)
        same = all(
            np.array_equal(state["model"][k].view(np.uint32), straight["model"][k].view(np.uint32))
            for k in straight["model"]
        ) and state["losses"] == straight["losses"]
        print(f"  trained to step {state['step']}: final loss {state['losses'][-1]:.4f}; "
              f"bit-identical to an uninterrupted run: {same}")
        report(repo)
        fsck = repo.fsck()
        print(f"\nfsck: {'ok' if fsck.ok else 'PROBLEMS'} ({fsck.blocks_checked} blocks re-hashed)")
        return 0 if same and fsck.ok else 1


if __name__ == "__main__":
    sys.exit(main())
