"""Listings a person reads: long lists of scalars folded in ``ls`` and ``diff``, a forked run
named once in ``log``."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import cas_ckpt
from cas_ckpt import cli
from cas_ckpt.integrations.training import training_state

torch = pytest.importorskip("torch")


@pytest.fixture
def run(capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    monkeypatch.setenv(cli.ENV_REPO, str(tmp_path / "repo"))

    def call(*argv: str) -> tuple[int, str]:
        code = cli.main(list(argv))
        out, err = capsys.readouterr()
        assert "Traceback" not in err
        return code, out

    yield call


def mlp_state(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    random.seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16),
                                torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(4, 8)).sum().backward()
    optimizer.step()
    return training_state(model=model, optimizer=optimizer)


def test_a_training_state_of_a_3_layer_mlp_lists_in_a_few_dozen_lines(run: Any, tmp_path: Path) -> None:
    with cas_ckpt.open(tmp_path / "repo") as repo:
        repo.save(mlp_state(0), ref="a", step=1)
        repo.save(mlp_state(1), ref="b", step=1)
    code, out = run("ls", "a")
    lines = out.splitlines()
    assert code == 0 and len(lines) < 60, len(lines)  # 690 when the RNG state was 625 ints
    assert "rng.python.1\tarray\tuint32 625 2.4 KiB" in lines
    code, out = run("diff", "a", "b", "--stat")
    words = out.split()
    assert code == 1 and int(words[0]) > 0 and int(words[-2]) < 40, out  # 669 unchanged before


def test_long_lists_of_scalars_fold_and_short_ones_do_not(run: Any, tmp_path: Path) -> None:
    old = {"python": random.Random(1).getstate(), "losses": [0.5] * 40, "flags": (True,) * 17,
           "mixed": [1, 2.0, None] * 6, "short": list(range(16)), "tags": ["a"] * 30}
    new = {**old, "losses": [0.5] * 38 + [0.25, float("nan")], "flags": (1,) * 17}
    with cas_ckpt.open(tmp_path / "repo") as repo:
        repo.save(old, ref="old")
        repo.save(new, ref="new")
        repo.save(old, ref="same")
    code, out = run("ls", "old")
    rows = dict(line.split("\t", 1) for line in out.splitlines())
    assert rows["python.1"] == "tuple\t… 625 ints"
    assert rows["losses"] == "list\t… 40 floats" and rows["flags"] == "tuple\t… 17 bools"
    assert rows["mixed"] == "list\t… 18 scalars"
    assert "short.15" in rows and "short" not in rows  # 16 items or fewer: one line each
    assert "tags.29" in rows  # strings are not folded
    code, out = run("ls", "old", "--json")
    folded = {r["path"]: r for r in json.loads(out)}["python.1"]
    assert folded == {"path": "python.1", "type": "tuple", "items": 625, "of": "int"}
    code, out = run("ls", "old", "losses")
    assert out == "losses\tlist\t… 40 floats\n"
    code, out = run("diff", "old", "new")
    assert code == 1
    assert "~ losses: 2 of 40 floats differ (first at 38: 0.5 -> 0.25)" in out
    assert "~ flags: 17 of 17 bools differ (first at 0: True -> 1)" in out
    assert out.splitlines()[-1].startswith("50 unchanged;")  # python 3, mixed 1, short 16, tags 30
    code, out = run("diff", "old", "same")
    assert code == 0 and out.startswith("52 unchanged;"), out


def test_log_names_a_forked_run_once(run: Any, tmp_path: Path) -> None:
    with cas_ckpt.open(tmp_path / "repo") as repo:
        with cas_ckpt.CheckpointManager(repo, "runs/a") as manager:
            for step in range(3):
                manager.save(step, {"w": np.full(8, step)})
        repo.fork("runs/a~1", "runs/b")
        with cas_ckpt.CheckpointManager(repo, "runs/b") as manager:
            for step in range(10, 16):
                manager.save(step, {"w": np.full(8, step)})
        repo.fork("runs/a~1", "plain")
        repo.save({"w": 1}, ref="plain")
        assert len(repo.refs("runs/b")) >= 7
    code, out = run("log", "runs/a")
    lines = out.splitlines()
    assert code == 0 and "[fork: plain, runs/b]" in lines[1], out
    assert sum("[fork" in line for line in lines) == 1
    code, out = run("log", "runs/a", "--json")
    assert [row["forks"] for row in json.loads(out)] == [[], ["plain", "runs/b"], []]
    code, out = run("log", "runs/b")
    assert "[fork: plain, runs/a]" in out
