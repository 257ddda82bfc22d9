"""Looking at checkpoints: streamed statistics, diffs and NaN scans against loading and numpy,
and the browser view's answers on a large repository.

    python benchmarks/inspect_bench.py [--scale 1.0] [--quick] [--json out.json]

What a user would otherwise write is ``repo.load(...)`` and numpy on the whole state. Each row
gives both sides' time and peak traced memory (tracemalloc: numpy's buffers and Python's) and
their ratio:

  stats      per-tensor min/max/mean/std/L2/NaN/Inf of a GPT-2-like model (~120 MiB x scale)
  diff       a fine-tune that moved 10% of the tensors: relative change of each changed tensor
  nonfinite  the first NaN over a run of 8 checkpoints, each moving 10% of the tensors
  browser    the view's API (cas_ckpt.web.data.Browser, no HTTP) on 2,000 commits of 10,000
             tensors (200 of 1,000 with --quick): each page's first answer and a later one
             (time only)
  draw       with --draw: the same pages served by ``cas-ckpt serve`` in headless Chromium
             (Debian's chromium and chromium-driver, as tests/test_browser.py drives them): the
             milliseconds from a navigation's start to the page drawn, each page's second visit
             (the issue asks for under a second; the tests assert no speed, this measures it)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import cas_ckpt

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from dedup import model  # the GPT-2-small-like tensors the dedup benchmark saves

MiB = 1024 * 1024


def measure(work: Callable[[], Any]) -> dict[str, float]:
    tracemalloc.start()
    started = time.perf_counter()
    try:
        work()
        seconds = time.perf_counter() - started
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return {"seconds": seconds, "peak_bytes": peak}


def timed(work: Callable[[], Any]) -> dict[str, float]:
    """Time only: tracemalloc slows code that makes many small objects several times over."""
    started = time.perf_counter()
    work()
    return {"seconds": time.perf_counter() - started}


def numpy_stats(state: dict[str, np.ndarray]) -> list[tuple[float, ...]]:
    out = []
    for array in state.values():
        values = array.astype(np.float64).ravel()
        finite = values[np.isfinite(values)]
        out.append((finite.min(), finite.max(), finite.mean(), finite.std(), np.linalg.norm(finite),
                    np.isnan(values).sum(), np.isinf(values).sum()))
    return out


def numpy_norms(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> dict[str, float]:
    out = {}
    for name, x in a.items():
        y = b[name]
        if not np.array_equal(x, y):
            x64 = x.astype(np.float64)
            out[name] = float(np.linalg.norm(x64 - y.astype(np.float64)) / np.linalg.norm(x64))
    return out


def first_nan_by_loading(repo: cas_ckpt.Repository, ref: str) -> int | None:
    for commit in reversed(list(repo.log(ref))):
        state = repo.load(commit.cid)
        if any(not np.isfinite(a).all() for a in state.values()):
            return commit.step
    return None


def tensors(repo: cas_ckpt.Repository, scale: float) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    base = model(rng, scale)
    repo.save(base, ref="base", step=0)
    names = sorted(base)
    moved = dict(base)
    for name in names[:: 10]:
        moved[name] = base[name] + np.float32(1e-3)
    repo.save(moved, ref="tuned", step=1)
    state = dict(base)
    for step in range(1, 9):
        for name in names[step % 10:: 10]:
            state[name] = state[name] * np.float32(1.001)
        if step == 6:
            state[names[-1]] = state[names[-1]].copy()
            state[names[-1]][0] = np.nan
        repo.save(state, ref="run", step=step)
    size = sum(a.nbytes for a in base.values())
    del base, moved, state
    rows = {}
    rows["stats"] = {"cas_ckpt": measure(lambda: repo.stats("base")),
                     "load+numpy": measure(lambda: numpy_stats(repo.load("base")))}
    rows["diff"] = {"cas_ckpt": measure(lambda: repo.diff("base", "tuned").by_tensor()),
                    "load+numpy": measure(lambda: numpy_norms(repo.load("base"), repo.load("tuned")))}
    found = {}
    rows["nonfinite"] = {
        "cas_ckpt": measure(lambda: found.update(ours=repo.find_nonfinite("run").step)),
        "load+numpy": measure(lambda: found.update(theirs=first_nan_by_loading(repo, "run"))),
    }
    assert found["ours"] == found["theirs"] == 6, found
    return {"state_bytes": size, "rows": rows}


def draw(path: Path, commits: int) -> dict[str, int]:
    """Milliseconds to draw each page in headless Chromium, the second visit (caches warm)."""
    from browsing import chromium, served, visit

    middle = f"runs/big.steps/{commits // 2:012d}"
    pages = [("/ui/", "runs"), ("/ui/run?ref=runs/big", "run"),
             ("/ui/checkpoint?target=runs/big&ref=runs/big", "checkpoint"),
             (f"/ui/diff?a={middle}&b=runs/big-ft", "diff"), ("/ui/storage", "storage")]
    timings = {}
    with served(path) as base, chromium() as driver:
        for address, page in pages:
            visit(driver, base + address, page)  # first: the server reads and caches the history
            timings[page] = visit(driver, base + address, page)
    return timings


def browser(path: Path, quick: bool, *, drawn: bool = False) -> dict[str, Any]:
    from browsing import large_repository

    from cas_ckpt.web.data import Browser

    commits, count = (200, 1000) if quick else (2000, 10_000)
    started = time.perf_counter()
    large_repository(path, commits=commits, tensors=count, fork_commits=commits // 7)
    made = time.perf_counter() - started
    with cas_ckpt.open(path, read_only=True) as repo:
        view = Browser(repo)
        middle = f"runs/big.steps/{commits // 2:012d}"
        pages = {
            "runs": lambda: view.runs(),
            "run (graph + metrics)": lambda: (view.graph(view.heads(None, "runs/big"), limit=200),
                                              view.metrics(view.heads(None, "runs/big"))),
            "checkpoint (tree page)": lambda: (view.checkpoint("runs/big"),
                                               view.tree("runs/big", ref="runs/big")),
            "diff (+ norms)": lambda: (view.diff(middle, "runs/big-ft"),
                                       view.diff_norms(middle, "runs/big-ft")),
            "storage": lambda: view.storage(),
        }
        timings = {}
        for name, page in pages.items():
            first = timed(page)
            again = timed(page)
            timings[name] = {"first": first, "again": again}
    result = {"commits": commits, "tensors": count, "generate_seconds": made, "pages": timings}
    if drawn:
        result["draw_ms"] = draw(path, commits)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--quick", action="store_true", help="scale 0.1 and a smaller repository")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--draw", action="store_true",
                        help="also time each page drawn in headless Chromium (chromium, chromium-driver)")
    args = parser.parse_args()
    scale = 0.1 if args.quick else args.scale
    with tempfile.TemporaryDirectory() as work:
        with cas_ckpt.open(Path(work) / "tensors") as repo:
            result = {"scale": scale, "tensors": tensors(repo, scale)}
        result["browser"] = browser(Path(work) / "big", args.quick, drawn=args.draw)
    print(f"state: {result['tensors']['state_bytes'] / MiB:.0f} MiB of float32 tensors")
    print(f"{'operation':<12} {'cas_ckpt s':>11} {'load+numpy s':>13} {'speed x':>8} "
          f"{'cas peak MiB':>13} {'numpy peak MiB':>15}")
    for name, row in result["tensors"]["rows"].items():
        ours, theirs = row["cas_ckpt"], row["load+numpy"]
        print(f"{name:<12} {ours['seconds']:>11.2f} {theirs['seconds']:>13.2f} "
              f"{theirs['seconds'] / ours['seconds']:>8.2f} {ours['peak_bytes'] / MiB:>13.1f} "
              f"{theirs['peak_bytes'] / MiB:>15.1f}")
    big = result["browser"]
    print(f"\nbrowser view, {big['commits']} commits of {big['tensors']} tensors "
          f"(made in {big['generate_seconds']:.1f} s)")
    for name, page in big["pages"].items():
        print(f"  {name:<24} first {page['first']['seconds'] * 1000:7.0f} ms   "
              f"again {page['again']['seconds'] * 1000:6.0f} ms")
    for page, ms in big.get("draw_ms", {}).items():
        print(f"  drawn in Chromium: {page:<12} {ms:6d} ms")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
