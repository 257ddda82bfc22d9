"""Smoke test of ``benchmarks/inspect_bench.py --quick``: it runs, both sides of every row are
measured, and the NaN scan agrees with loading every checkpoint. No speed thresholds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_inspect_bench_quick(tmp_path: Path) -> None:
    out = tmp_path / "inspect.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "inspect_bench.py"), "--quick",
                           "--json", str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    rows = result["tensors"]["rows"]
    assert set(rows) == {"stats", "diff", "nonfinite"}
    for row in rows.values():
        for side in ("cas_ckpt", "load+numpy"):
            assert row[side]["seconds"] > 0 and row[side]["peak_bytes"] > 0
    # streamed: a few chunks in memory, not the state
    assert rows["stats"]["cas_ckpt"]["peak_bytes"] < result["tensors"]["state_bytes"] / 2
    pages = result["browser"]["pages"]
    assert len(pages) == 5 and all(p["again"]["seconds"] > 0 for p in pages.values())
