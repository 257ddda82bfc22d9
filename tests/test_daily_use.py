"""Daily use (issue #51): ``REF@STEP`` in every API and command that takes a target (item 5), and
transfer summaries that count many refs (item 4), through the installed ``cas-ckpt``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import cas_ckpt
from cas_ckpt.errors import RefNotFound, StepTargetNotFound

SCRIPT = Path(sys.executable).parent / "cas-ckpt"


@pytest.fixture
def run(tmp_path: Path) -> Path:
    """runs/lr: steps 0-5 saved by a manager keeping the last 2 step refs; main: plain saves."""
    path = tmp_path / "repo"
    with cas_ckpt.open(path) as repo, cas_ckpt.CheckpointManager(repo, "runs/lr", keep_last=2,
                                                                 gc_after_retention=False) as manager:
        for step in range(6):
            manager.save(step, {"w": np.full(4, step), "step": step})
        repo.save({"w": np.zeros(2)}, ref="main", step=7)
    return path


def test_a_step_resolves_to_its_step_ref_or_its_commit_in_history(run: Path) -> None:
    with cas_ckpt.open(run) as repo:
        assert repo.resolve("runs/lr@5") == repo.resolve("runs/lr.steps/000000000005")
        expired = repo.resolve("runs/lr@1")  # its step ref expired; the history still has it
        assert [c.step for c in repo.log(expired, limit=1)] == [1]
        assert repo.load("runs/lr@3")["step"] == 3
        assert repo.resolve("main@7") == repo.resolve("main")
        assert repo.resolve("runs/lr@4~1") == repo.resolve("runs/lr@3")
        assert repo.resolve("runs/lr@{0}") == repo.resolve("runs/lr")  # braces: the reflog's
        with pytest.raises(StepTargetNotFound, match=r"'runs/lr@99' not found"):
            repo.resolve("runs/lr@99")
        with pytest.raises(RefNotFound, match="'runs/nope' not found"):
            repo.resolve("runs/nope@1")
        repo.set_ref("runs/lr@2", repo.resolve("main"))  # a ref named so wins
        assert repo.resolve("runs/lr@2") == repo.resolve("main")


@pytest.mark.skipif(not SCRIPT.exists(), reason="cas-ckpt console script not installed")
def test_commands_take_a_step(run: Path) -> None:
    def cas(*argv: str) -> subprocess.CompletedProcess[str]:
        done = subprocess.run([str(SCRIPT), "--repo", str(run), *argv], capture_output=True, text=True,
                              timeout=60)
        assert "Traceback" not in done.stderr
        return done

    shown = cas("show", "runs/lr@2")
    assert shown.returncode == 0 and json.loads(shown.stdout)["step"] == 2, shown
    assert cas("diff", "runs/lr@1", "runs/lr@2").returncode == 1  # they differ
    missing = cas("log", "runs/lr@99")
    assert missing.returncode == 3 and "runs/lr@99" in missing.stderr


@pytest.mark.skipif(not SCRIPT.exists(), reason="cas-ckpt console script not installed")
def test_clone_counts_many_refs_and_lists_them_with_verbose(run: Path, tmp_path: Path) -> None:
    """A clone of a run with its step refs names no more than 3 refs (it printed a 1.5 KB line);
    -v lists every ref that moved, one a line (issue #51, item 4)."""
    def clone(dst: str, *flags: str) -> str:
        done = subprocess.run([str(SCRIPT), "clone", str(run), str(tmp_path / dst), *flags],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and "Traceback" not in done.stderr, done
        return done.stdout

    with cas_ckpt.open(run) as repo:
        names = sorted(repo.refs())
    assert len(names) > 3
    brief = clone("brief")
    assert brief.count("\n") == 1 and f"{len(names)} refs moved ({len(names)} new)" in brief
    assert "--verbose lists them" in brief and not any(f" {name} " in brief for name in names)
    listed = clone("listed", "-v").splitlines()
    assert sorted(line.split()[0] for line in listed[1:]) == names


def test_a_run_is_pushed_and_pulled_with_its_step_refs(run: Path, tmp_path: Path) -> None:
    """push and pull of a manager's run ref move its .steps/N refs too (the pulled log showed
    every earlier step as expired); --head-only moves the head alone (item 6)."""
    with cas_ckpt.open(run) as repo:
        steps = {n: c for n, c in repo.refs().items() if n.startswith("runs/lr.steps/")}
        assert len(steps) == 2
        repo.push(tmp_path / "backup", "runs/lr")
        repo.push(tmp_path / "heads", "runs/lr", head_only=True)
        repo.push(tmp_path / "renamed", "runs/lr", remote_ref="runs/copy")
    with cas_ckpt.open(tmp_path / "backup") as backup:
        assert {n: c for n, c in backup.refs().items() if ".steps/" in n} == steps
        assert backup.resolve("runs/lr@5") == backup.resolve("runs/lr")
    with cas_ckpt.open(tmp_path / "heads") as heads:
        assert sorted(heads.refs()) == ["runs/lr"]
    with cas_ckpt.open(tmp_path / "renamed") as renamed:
        assert sorted(renamed.refs()) == ["runs/copy", *(n.replace("runs/lr", "runs/copy") for n in steps)]
    with cas_ckpt.open(tmp_path / "puller") as puller:
        report = puller.pull(tmp_path / "backup", "runs/lr")
        assert sorted(report.refs) == ["runs/lr", *steps]
        assert sorted(puller.refs()) == sorted(["runs/lr", *steps])
    if SCRIPT.exists():
        cas_ckpt.open(tmp_path / "cli").close()
        done = subprocess.run([str(SCRIPT), "--repo", str(tmp_path / "cli"), "pull", str(tmp_path / "backup"),
                               "runs/lr", "--head-only"], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done
        with cas_ckpt.open(tmp_path / "cli") as cli_repo:
            assert sorted(cli_repo.refs()) == ["runs/lr"]


def test_the_nan_finder_says_what_expired_checkpoints_hid(tmp_path: Path) -> None:
    """The NaN went in at step 2, whose checkpoint retention expired: the finder names step 4 as
    the first *kept* one, says how many expired ones before it went unchecked from which step,
    and names the expired step whose metric was already NaN (item 1), in the CLI's text and in
    the browser API's message."""
    with cas_ckpt.open(tmp_path / "repo") as repo:
        with cas_ckpt.CheckpointManager(repo, "run", keep_last=2, keep_every=4) as manager:
            for step in range(6):
                bad = step >= 2
                manager.save(step, {"w": np.full(3, np.nan if bad else 1.0), "s": np.arange(5000) + step},
                             metrics={"loss": float("nan") if bad else 1.0 / (step + 1)})
        report = repo.find_nonfinite("run")
    # kept: 0 and 4 (every 4th), 4 and 5 (the last 2); expired: 1, 2, 3
    assert (report.step, report.expired, report.first_expired_step) == (4, 3, 1)
    assert (report.metric, report.metric_step) == ("loss", 2)
    text = report.message()
    assert "first kept checkpoint of run" in text and "3 expired checkpoints before it (from step 1)" in text
    assert text.endswith("metric 'loss' was already NaN or Inf at step 2 (expired)")
    if SCRIPT.exists():
        argv = [str(SCRIPT), "--repo", str(tmp_path / "repo"), "stats", "run", "--find-nonfinite"]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        assert done.returncode == 1 and done.stdout.splitlines()[0] == text + ":"
    from cas_ckpt.web.data import Browser

    with cas_ckpt.open(tmp_path / "repo", read_only=True) as repo:
        assert Browser(repo).nonfinite("run")["message"] == text
