"""What a benchmark's results record of where they were measured: the machine, the commit and
the files changed from it, and the CPU a process used (shared by the benchmarks that spawn
ranks, servers and trainers)."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
GiB = 1024**3


def cpu_of(pid: int | str) -> float:
    """CPU seconds (user and system) process ``pid`` has used; NaN when it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return float("nan")


def tree_state() -> dict[str, Any]:
    """The commit measured, and the files of cas_ckpt/ changed from it (others edit the tree too)."""
    def git(*args: str) -> str:
        done = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)
        return done.stdout.strip()

    return {"head": git("rev-parse", "HEAD"), "modified": git("status", "--short", "cas_ckpt").splitlines()}


def machine() -> dict[str, Any]:
    """The CPU, its cores, memory, the versions that matter, and the load when the run began."""
    import numpy as np
    import torch

    cpuinfo, meminfo = Path("/proc/cpuinfo").read_text(), Path("/proc/meminfo").read_text()
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines()
                  if line.startswith("model name")), platform.processor())
    mem = next(int(line.split()[1]) * 1024 for line in meminfo.splitlines() if line.startswith("MemTotal"))
    return {"cpu_model": model, "cpus": os.cpu_count(), "mem_total_gib": round(mem / GiB, 1),
            "python": platform.python_version(), "numpy": np.__version__, "torch": torch.__version__,
            "loadavg_at_start": os.getloadavg()}
