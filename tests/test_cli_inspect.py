"""``cas-ckpt stats`` (and ``--find-nonfinite``) and ``cas-ckpt diff --by-tensor``: what they print,
their JSON and their exit codes, against the Python API's figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import cas_ckpt
from cas_ckpt import cli

BIN = Path(sys.executable).parent


def cas(repo: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / "cas-ckpt"), "--repo", str(repo), *args], capture_output=True,
                          text=True, timeout=120)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    rng = np.random.default_rng(0)
    weights = {"model": {"a": rng.standard_normal((100, 100)).astype(np.float32),
                         "b": rng.standard_normal(10_000).astype(np.float32),
                         "c": np.arange(6, dtype=np.int64)}, "step": 0}
    with cas_ckpt.open(tmp_path / "repo") as r, cas_ckpt.CheckpointManager(r, "run") as manager:
        for step in range(1, 5):
            weights = {"model": dict(weights["model"]), "step": step}  # type: ignore[call-overload]
            weights["model"]["a"] = weights["model"]["a"] * np.float32(1.1)
            if step >= 2:
                weights["model"]["b"] = weights["model"]["b"] + np.float32(0.01)
            if step == 3:
                weights["model"]["b"] = weights["model"]["b"].copy()
                weights["model"]["b"][5] = -np.inf
            manager.save(step, weights)
    return tmp_path / "repo"


def test_stats_prints_every_tensor(repo: Path) -> None:
    done = cas(repo, "stats", "run")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split() == ["PATH", "DTYPE", "SHAPE", "MIN", "MAX", "MEAN", "STD", "L2", "NAN", "INF"]
    assert [line.split()[0] for line in lines[1:]] == ["model.a", "model.b", "model.c"]
    assert lines[3].split()[1:] == ["int64", "6", "0", "5", "2.5", "1.708", "7.416", "0", "0"]
    rows = json.loads(cas(repo, "stats", "run", "model.b", "--json").stdout)
    with cas_ckpt.open(repo, read_only=True) as r:
        [expected] = r.stats("run", "model.b")
    assert rows == [{**expected.__dict__, "min": expected.min, "max": expected.max}]
    assert rows[0]["inf"] == 1  # step 3 planted -inf, and step 4 kept it
    missing = cas(repo, "stats", "run", "model.nope")
    assert missing.returncode == cli.EXIT_NOT_FOUND and "model.nope" in missing.stderr


def test_find_nonfinite_exits_1_at_the_first_step(repo: Path) -> None:
    found = cas(repo, "stats", "run", "--find-nonfinite")
    assert found.returncode == cli.EXIT_CHECK, found.stderr
    assert found.stdout.startswith("step 3 (") and "first checkpoint of run with NaN or Inf" in found.stdout
    assert found.stdout.splitlines()[-1].split()[0] == "model.b"
    report = json.loads(cas(repo, "stats", "run", "--find-nonfinite", "--json").stdout)
    assert report["found"] and report["step"] == 3 and report["checked"] == 3
    clean = cas(repo, "stats", "run", "model.a", "--find-nonfinite")
    assert clean.returncode == 0 and clean.stdout == "no NaN or Inf in 4 checkpoints of run\n"


def test_diff_by_tensor_sorts_by_relative_change(repo: Path) -> None:
    done = cas(repo, "diff", "run~2", "run", "--by-tensor")
    assert done.returncode == cli.EXIT_CHECK, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split() == ["RELATIVE", "PATH", "||A-B||", "||A||", "MAX", "|A-B|"]
    # model.b: -inf at step 3 makes its change infinite; model.a moved by 1.1^2 - 1 = 21%
    assert lines[1] == "model weights:"
    assert [line.split()[:2] for line in lines[2:4]] == [["inf", "model.b"], ["0.21", "model.a"]]
    assert lines[-1] == "2 tensors changed, 1 other values changed, 0 added, 0 removed, 1 unchanged"
    report = json.loads(cas(repo, "diff", "run~3", "run~2", "--by-tensor", "--json").stdout)
    assert [t["path"] for t in report["tensors"]] == ["model.a", "model.b"]
    with cas_ckpt.open(repo, read_only=True) as r:
        relative = {c.path: c.relative for c in r.diff("run~3", "run~2").changed}
    assert {t["path"]: t["relative"] for t in report["tensors"]} == pytest.approx(
        {k: v for k, v in relative.items() if v is not None}, rel=1e-15)
    same = cas(repo, "diff", "run", "run", "--by-tensor")
    assert same.returncode == 0


def test_diff_by_tensor_groups_weights_before_optimizer_state_and_the_rest(tmp_path: Path) -> None:
    """Adam's moments, a step counter and RNG bytes change entirely (relative 1.0) while the
    weights move a little: the weights still come first, and --model-only keeps only them."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal(5000).astype(np.float32)

    def state(bump: float, seed: int) -> dict[str, object]:
        moments = np.random.default_rng(seed).standard_normal(5000).astype(np.float32)
        step = np.array([seed], np.float32)
        rng_state = np.random.default_rng(seed).integers(0, 255, 4096, dtype=np.uint8).astype(np.float32)
        return {"model": {"layer.weight": w * bump},
                "optim": {"state": {"layer.weight": {"exp_avg": moments, "step": step}}}, "rng": rng_state}

    with cas_ckpt.open(tmp_path / "r") as repo:
        repo.save(state(1.0, 1), ref="run")
        repo.save(state(1.01, 2), ref="run")
    report = json.loads(cas(tmp_path / "r", "diff", "run~1", "run", "--by-tensor", "--json").stdout)
    assert [(t["group"], t["path"]) for t in report["tensors"]] == [
        ("model", "model.layer.weight"), ("optimizer", "optim.state.layer.weight.exp_avg"),
        ("optimizer", "optim.state.layer.weight.step"), ("other", "rng")]
    text = cas(tmp_path / "r", "diff", "run~1", "run", "--by-tensor").stdout.splitlines()
    assert [line for line in text if line.endswith(":")] == [
        "model weights:", "optimizer state:", "other values:"]
    only = json.loads(cas(tmp_path / "r", "diff", "run~1", "run", "--by-tensor", "--model-only",
                          "--json").stdout)
    assert [t["path"] for t in only["tensors"]] == ["model.layer.weight"] and only["other_changes"] == 0
