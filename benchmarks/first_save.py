"""The first save of a process: what a training script pays once, before its loop gets going.

Each measurement is a fresh Python process that imports torch (not timed: every tool needs it),
builds a model, then times importing the tool, opening its target, and its first and second save
of the model's state dict (float32, or bfloat16 where ml_dtypes is needed). cas_ckpt is set
against ``torch.save`` and ``safetensors.torch.save_file`` side by side; ratios are cas_ckpt's
time over the other tool's (below 1: cas_ckpt is faster). #40 found the first cas_ckpt save of a
float32 model spending 2.9 of 5.3 s importing ml_dtypes, which it never needed.

    .venv/bin/python benchmarks/first_save.py --reps 5 --json first-save.json
    .venv/bin/python benchmarks/first_save.py --reps 1 --dtypes float32 --tools cas_ckpt,torch  # quick
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

TOOLS = ("cas_ckpt", "torch", "safetensors")
DTYPES = ("float32", "bfloat16")


def child(tool: str, dtype: str, workdir: str, layers: int, width: int) -> dict[str, Any]:
    """One process's figures: import, open, first and second save (seconds), and what it imported."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    model = model.to(getattr(torch, dtype))
    state = model.state_dict()
    out: dict[str, Any] = {}
    started = time.perf_counter()
    if tool == "cas_ckpt":
        import cas_ckpt

        out["import_s"] = time.perf_counter() - started
        started = time.perf_counter()
        repo = cas_ckpt.open(os.path.join(workdir, "repo"))
        out["open_s"] = time.perf_counter() - started

        def save(i: int) -> None:
            repo.save({"model": state}, ref="run", step=i)
    elif tool == "torch":
        out["import_s"] = out["open_s"] = 0.0

        def save(i: int) -> None:
            torch.save({"model": state}, os.path.join(workdir, f"ckpt-{i}.pt"))
    else:
        from safetensors.torch import save_file

        out["import_s"] = time.perf_counter() - started
        out["open_s"] = 0.0

        def save(i: int) -> None:
            save_file(state, os.path.join(workdir, f"ckpt-{i}.safetensors"))
    for i, key in enumerate(("first_save_s", "second_save_s")):
        started = time.perf_counter()
        save(i)
        out[key] = time.perf_counter() - started
    out["total_s"] = out["import_s"] + out["open_s"] + out["first_save_s"]
    out["ml_dtypes_imported"] = "ml_dtypes" in sys.modules
    out["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out["state_bytes"] = sum(t.numel() * t.element_size() for t in state.values())
    return out


def measure(tool: str, dtype: str, layers: int, width: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="first-save-") as workdir:
        done = subprocess.run(
            [sys.executable, __file__, "--child", tool, dtype, workdir, "--layers", str(layers),
             "--width", str(width)], capture_output=True, text=True, check=False, timeout=600,
        )
    if done.returncode:
        raise SystemExit(f"{tool} {dtype} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", nargs=3, metavar=("TOOL", "DTYPE", "DIR"), help=argparse.SUPPRESS)
    parser.add_argument("--reps", type=int, default=5, help="fresh processes per tool and dtype (medians)")
    parser.add_argument("--tools", default=",".join(TOOLS))
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--json", metavar="FILE", help="write every figure here")
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(*args.child, args.layers, args.width)))
        return 0
    tools, dtypes = args.tools.split(","), args.dtypes.split(",")
    runs: dict[str, list[dict[str, Any]]] = {}
    for _ in range(args.reps):  # tools take turns, so a slow moment of the machine hits all alike
        for dtype in dtypes:
            for tool in tools:
                runs.setdefault(f"{tool} {dtype}", []).append(measure(tool, dtype, args.layers, args.width))
    rows = {key: {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "ml_dtypes_imported"}
            | {"ml_dtypes_imported": any(r["ml_dtypes_imported"] for r in rs)} for key, rs in runs.items()}
    print(f"{'tool dtype':<22}{'import':>9}{'open':>9}{'1st save':>10}{'2nd save':>10}{'total':>9}"
          f"{'peak RSS':>11}  ml_dtypes")
    for key, row in rows.items():
        print(f"{key:<22}{row['import_s']:>9.3f}{row['open_s']:>9.3f}{row['first_save_s']:>10.3f}"
              f"{row['second_save_s']:>10.3f}{row['total_s']:>9.3f}{row['peak_rss'] / 2**20:>9.0f} MiB"
              f"  {'imported' if row['ml_dtypes_imported'] else '-'}")
    for dtype in dtypes:
        ours = rows.get(f"cas_ckpt {dtype}")
        for tool in tools:
            other = rows.get(f"{tool} {dtype}")
            if ours and other and tool != "cas_ckpt":
                print(f"cas_ckpt / {tool} ({dtype}): import+open+first save "
                      f"{ours['total_s'] / other['total_s']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "runs": runs, "medians": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
