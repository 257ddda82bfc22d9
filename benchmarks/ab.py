#!/usr/bin/env python
"""Before and after: one state's cas_ckpt operations under an earlier revision and under this
working tree, in turns, in separate processes.

On a shared 2-core VM the same load can take 118 ms in one minute and 158 ms in the next, which
is more than most changes are worth; two runs of ``bench.py`` one after the other compare the
minutes as much as the code. Here each round runs both sides back to back (which side goes first
alternates), each in a fresh process importing its own ``cas_ckpt``, with ``bench.py``'s own
measurements (forked children, a settled disk, prewarmed memory, loads checked byte for byte).
The verdict is the median of the rounds' ratios, after over before::

    .venv/bin/python benchmarks/ab.py --base HEAD~1 --state c --ops save_fresh,load_verify
    .venv/bin/python benchmarks/ab.py --base 0ee8b1f --state e --rounds 6 --json ab-e.json

The base revision is checked out into a temporary git worktree and its compiled modules are
built there (``setup.py build_ext --inplace`` with this interpreter); ``--no-build`` leaves them
out, so that side hashes with hashlib and decodes with msgpack. The working tree is used as it is
installed (``pip install -e .`` builds its compiled modules in place).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
# The sibling runner, with the cas_ckpt this process imports: in a side's child, that side's
# (PYTHONPATH names its tree first); in the parent, only its states and sizes are used.
import bench  # noqa: E402

import cas_ckpt  # noqa: E402

OPS = ("save_fresh", "save_unchanged", "load_verify", "load_noverify", "load_mmap", "load_mmap_verify",
       "load_verify_cold")


# -- the child: one side's measurements ------------------------------------------------------
def measure(state_name: str, size: str, ops: list[str], reps: int, workdir: Path, hash_name: str
            ) -> dict[str, Any]:
    """``reps`` samples of each op on ``state_name``, with the cas_ckpt this process imports."""
    state = bench.build_state(state_name, bench.SIZES[size], bench.state_seed(5, state_name))
    saved = workdir / "saved"
    bench.forked(lambda: bench.cas_save(state, saved, 1, hash_name))  # what the re-saves and loads use
    runs: dict[str, Callable[[int], dict[str, Any]]] = {
        "save_fresh": lambda i: bench.cas_save(state, workdir / f"fresh-{i}", 1, hash_name),
        "save_unchanged": lambda i: bench.cas_save(state, saved, 2 + i, hash_name),
        "load_verify": lambda i: bench.cas_load(state, saved, verify=True, sub=False),
        "load_noverify": lambda i: bench.cas_load(state, saved, verify=False, sub=False),
        "load_mmap": lambda i: bench.cas_load(state, saved, verify=False, sub=False, mmap=True),
        "load_mmap_verify": lambda i: bench.cas_load(state, saved, verify=True, sub=False, mmap=True),
        "load_verify_cold": lambda i: bench.cas_load(state, saved, verify=True, sub=False, cold=True),
    }
    samples: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}
    for op in ops:
        samples[op], cpu[op] = [], []
        for i in range(reps):
            figures = bench.forked(lambda op=op, i=i: runs[op](i))
            samples[op].append(figures["seconds"])
            cpu[op].append(figures["cpu_seconds"])
            shutil.rmtree(workdir / f"fresh-{i}", ignore_errors=True)
    return {"cas_ckpt": str(Path(cas_ckpt.__file__).resolve().parent), "samples": samples, "cpu": cpu}


# -- the parent: trees, rounds, verdicts -----------------------------------------------------
@contextlib.contextmanager
def base_tree(revision: str, build: bool) -> Iterator[Path]:
    """A worktree of ``revision`` in a temp folder, its compiled modules built unless not
    ``build``; removed afterwards."""
    where = Path(tempfile.mkdtemp(prefix="cas-ab-")) / "base"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "--quiet", str(where),
                    revision], check=True)
    try:
        if build:
            subprocess.run([sys.executable, "setup.py", "--quiet", "build_ext", "--inplace"],
                           cwd=where, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        yield where
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(where)],
                       check=False)
        shutil.rmtree(where.parent, ignore_errors=True)


def run_side(tree: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One side's samples, measured by a child process that imports ``tree``'s cas_ckpt."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    with tempfile.TemporaryDirectory(prefix="cas-ab-work-") as work:
        done = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), "--child", "--state", args.state,
             "--size", args.size, "--ops", ",".join(args.ops), "--reps", str(args.reps),
             "--hash", args.hash, "--workdir", work],
            env=env, capture_output=True, text=True, check=False,
        )
    if done.returncode != 0:
        raise SystemExit(f"the side at {tree} failed:\n{done.stdout}{done.stderr}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    if not Path(result["cas_ckpt"]).is_relative_to(tree.resolve()):
        raise SystemExit(f"the side at {tree} imported cas_ckpt from {result['cas_ckpt']}")
    return result


def compare(rounds: list[dict[str, dict[str, list[float]]]], ops: list[str],
            cpu_rounds: list[dict[str, dict[str, list[float]]]] | None = None) -> dict[str, Any]:
    """Per op: each side's median, and after/before round by round with their median; the
    same of CPU time where ``cpu_rounds`` has it."""
    verdict: dict[str, Any] = {}
    for op in ops:
        before = [statistics.median(r["base"][op]) for r in rounds]
        after = [statistics.median(r["head"][op]) for r in rounds]
        ratios = [a / b for a, b in zip(after, before, strict=True)]
        verdict[op] = {
            "before_seconds": statistics.median(s for r in rounds for s in r["base"][op]),
            "after_seconds": statistics.median(s for r in rounds for s in r["head"][op]),
            "ratios": ratios, "ratio": statistics.median(ratios),
        }
        if cpu_rounds:
            cpu = compare(cpu_rounds, [op])[op]
            verdict[op].update({"before_cpu_seconds": cpu["before_seconds"],
                                "after_cpu_seconds": cpu["after_seconds"], "cpu_ratio": cpu["ratio"]})
    return verdict


def render(verdict: dict[str, Any], args: argparse.Namespace) -> str:
    lines = [f"state {args.state} ({args.size}, {args.hash}), {args.rounds} rounds of {args.reps}: before = "
             f"{args.base}, after = the working tree; ratio = after / before, the median of the "
             "rounds' (below 1: faster); CPU: the process's CPU time, all threads",
             f"  {'operation':<18}{'before ms':>11}{'after ms':>10}{'ratio':>8}{'CPU before':>12}"
             f"{'CPU after':>11}{'CPU ratio':>11}  rounds"]
    for op, v in verdict.items():
        rounds = " ".join(f"{r:.2f}" for r in v["ratios"])
        cpu = (f"{v['before_cpu_seconds'] * 1e3:>12.1f}{v['after_cpu_seconds'] * 1e3:>11.1f}"
               f"{v['cpu_ratio']:>11.2f}" if "cpu_ratio" in v else f"{'':>34}")
        lines.append(f"  {op:<18}{v['before_seconds'] * 1e3:>11.1f}{v['after_seconds'] * 1e3:>10.1f}"
                     f"{v['ratio']:>8.2f}{cpu}  {rounds}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="HEAD", help="the revision before (default HEAD)")
    parser.add_argument("--state", default="a", choices=list(bench.STATES))
    parser.add_argument("--size", default="medium", choices=list(bench.SIZES))
    parser.add_argument("--ops", default="save_fresh,load_verify",
                        help=f"comma-separated, from {','.join(OPS)} (default save_fresh,load_verify)")
    parser.add_argument("--hash", default="sha2-256", choices=["sha2-256", "blake3"],
                        help="the repositories' hash (default sha2-256)")
    parser.add_argument("--rounds", type=int, default=4, help="rounds of both sides (default 4)")
    parser.add_argument("--reps", type=int, default=3, help="samples per side and round (default 3)")
    parser.add_argument("--no-build", action="store_true", help="do not build the base's compiled modules")
    parser.add_argument("--json", type=Path, help="write every sample and the verdicts here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.ops = [op.strip() for op in args.ops.split(",") if op.strip()]
    for op in args.ops:
        if op not in OPS:
            parser.error(f"unknown operation {op!r}; choose from {','.join(OPS)}")
    if args.rounds < 1 or args.reps < 1:
        parser.error("--rounds and --reps must be at least 1")
    if args.child:
        print(json.dumps(measure(args.state, args.size, args.ops, args.reps, args.workdir, args.hash)))
        return 0

    rounds: list[dict[str, dict[str, list[float]]]] = []
    cpu_rounds: list[dict[str, dict[str, list[float]]]] = []
    with base_tree(args.base, build=not args.no_build) as base:
        sides = {"base": base, "head": ROOT}
        for i in range(args.rounds):
            order = ["base", "head"] if i % 2 == 0 else ["head", "base"]
            results = {side: run_side(sides[side], args) for side in order}
            rounds.append({side: result["samples"] for side, result in results.items()})
            cpu_rounds.append({side: result["cpu"] for side, result in results.items()})
            print(f"round {i + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    verdict = compare(rounds, args.ops, cpu_rounds)
    print(render(verdict, args))
    if args.json:
        args.json.write_text(json.dumps({"base": args.base, "state": args.state, "size": args.size,
                                         "hash": args.hash,
                                         "rounds": rounds, "cpu_rounds": cpu_rounds, "verdict": verdict},
                                        indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
