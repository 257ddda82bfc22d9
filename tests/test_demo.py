"""The demo (``bash scripts/demo.sh``, ``python -m cas_ckpt.demo``): it runs, runs again in the
folder it made, and never deletes a folder it did not make."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import cas_ckpt
from cas_ckpt.demo import MARK, create, prepare

SMALL = ["--steps", "6", "--every", "2", "--crash-after", "2"]


def demo(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cas_ckpt.demo", *argv], capture_output=True,
                          text=True, timeout=300, check=False)


def test_the_demo_runs_and_runs_again_in_the_folder_it_made(tmp_path: Path) -> None:
    folder = tmp_path / "demo-repo"
    first = demo("--repo", str(folder), *SMALL)
    assert first.returncode == 0, first.stderr
    assert "bit-identical to an uninterrupted run: True" in first.stdout and "fsck: ok" in first.stdout
    again = demo("--repo", str(folder), *SMALL)  # the folder is the demo's: emptied, used again
    assert again.returncode == 0, again.stderr
    with cas_ckpt.open(folder) as repo:
        assert [c.step for c in repo.log("demo/mlp")] == [6, 4, 2]  # one run's history, not two


def test_the_demo_refuses_a_folder_it_did_not_make_and_leaves_it_alone(tmp_path: Path) -> None:
    """``--repo DIR`` ran shutil.rmtree(DIR) first: an existing repository was gone."""
    precious = tmp_path / "checkpoints"
    with cas_ckpt.open(precious) as repo:
        cid = repo.save({"weights": 1}, ref="main")
    refused = demo("--repo", str(precious), *SMALL)
    assert refused.returncode == 2 and "is not empty" in refused.stderr and "Training" not in refused.stdout
    with cas_ckpt.open(precious) as repo:
        assert repo.resolve("main") == cid and repo.load("main") == {"weights": 1}
    other = tmp_path / "notes"
    other.mkdir()
    (other / "todo.txt").write_text("keep me")
    assert demo("--repo", str(other), *SMALL).returncode == 2
    assert (other / "todo.txt").read_text() == "keep me"
    a_file = tmp_path / "file"
    a_file.write_text("x")
    assert "is not a folder" in str(prepare(a_file)) and a_file.read_text() == "x"
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "made-by-demo")
    (tmp_path / "made-by-demo").mkdir()
    (tmp_path / "made-by-demo" / MARK).write_text("")
    assert "is not a folder" in str(prepare(link))  # never followed
    empty = tmp_path / "empty"
    empty.mkdir()
    assert prepare(empty) is None and prepare(tmp_path / "new") is None
    create(empty)
    with cas_ckpt.open(empty, create=False) as repo:  # an ordinary repository, marked as the demo's
        assert repo.refs() == {} and (empty / MARK).is_file()
