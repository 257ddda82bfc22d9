"""Smoke test of ``benchmarks/history_bench.py``: both sides run on both media and every operation
is measured (with S3 requests counted). No speed thresholds: timings on shared machines say
nothing in a test; the request counts of the graph are pinned in test_commit_graph.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_history_bench_tiny(tmp_path: Path) -> None:
    out = tmp_path / "history.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "history_bench.py"), "--sizes", "20",
         "--reps", "1", "--base", "HEAD", "--json", str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    runs = json.loads(out.read_text())["runs"]
    assert [(r["medium"], r["commits"]) for r in runs] == [("local", 20), ("s3", 20)]
    for run in runs:
        for side in ("before", "after"):
            samples = run[side]["samples"]
            expected = {"log", "log_10", "cli_log", "diff_meta", "diff", "steps", "retention", "gc"}
            if run["medium"] == "s3":
                expected.add("remote_retention")
            assert set(samples) == expected, (run["medium"], side)
            for op, taken in samples.items():
                seconds, requests = taken[0]
                assert seconds > 0, op
                assert (requests > 0) == (run["medium"] == "s3"), op  # counted on S3 only
    assert "log" in proc.stdout and "after/before" in proc.stdout
