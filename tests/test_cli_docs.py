"""Every shell example (``$ `` lines in console/sh blocks) of docs/cli.md and docs/guide.md runs.

Each runs through bash with the installed console script first on PATH, in one temp directory that
holds the prepared repository ``ckpts`` (``CAS_CKPT_REPO=ckpts``), in the order the docs give. A
documented error must fail with that message; any other command must succeed, and print something
when the docs show output.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import cas_ckpt

DOCS = Path(__file__).parent.parent / "docs"
BIN = Path(sys.executable).parent
BLOCK = re.compile(r"^```(?:console|sh)\n(.*?)^```", re.S | re.M)


def prepared_state(step: int) -> dict[str, object]:
    """The state the examples show (its tree CID is fixed: docs/cli.md names it by a prefix)."""
    return {"model": {"w": np.full((300, 1000), step, dtype=np.float32),
                      "b": np.arange(3, dtype=np.float16)}, "step": step}


def prepare(root: Path) -> None:
    with cas_ckpt.open(root / "ckpts") as repo:
        repo.save(prepared_state(1), ref="main", step=1, message="first")
        repo.save({"scratch": 1}, ref="main", step=1)  # an overwrite: gc --dry-run has work
        repo.save(prepared_state(1), ref="main", step=1, message="first")
        repo.save(prepared_state(2), ref="main", step=2)
        repo.save({"x": 1}, ref="other")


def examples(doc: Path) -> list[tuple[str, list[str]]]:
    """(command, documented output lines) for every ``$ `` line of the doc's shell blocks."""
    found: list[tuple[str, list[str]]] = []
    for block in BLOCK.findall(doc.read_text()):
        for line in block.splitlines():
            if line.startswith("$ "):
                found.append((line[2:], []))
            elif found:
                found[-1][1].append(line)
    return found


@pytest.mark.skipif(not (BIN / "cas-ckpt").exists(), reason="cas-ckpt console script not installed")
@pytest.mark.parametrize("doc", ["cli.md", "guide.md"])
def test_shell_examples_run(doc: str, tmp_path: Path) -> None:
    prepare(tmp_path)
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "CAS_CKPT_REPO": "ckpts"}
    for command, output in examples(DOCS / doc):
        done = subprocess.run(["bash", "-o", "pipefail", "-c", command], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=120)
        assert "Traceback" not in done.stderr, command
        error = next((line for line in output if line.startswith("cas-ckpt: error:")), None)
        if error is not None:
            assert done.returncode != 0, command
            assert done.stderr.startswith(error.split("...")[0]), (command, done.stderr)
        else:
            assert done.returncode == 0, (command, done.stderr)
            assert bool(done.stdout) == bool(output) or not output, (command, done.stdout)
