"""A repository written by cas_ckpt 0.1.0 (before the storage redesign) still opens, loads bit-exact,
keeps its history and accepts new saves: the on-disk format did not change by a byte."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fixtures.make_v1_repo import state

import cas_ckpt

FIXTURE = Path(__file__).parent / "fixtures" / "v1-repo"
MANIFEST = json.loads((FIXTURE.parent / "v1-repo.json").read_text())


def assert_same(loaded: Any, expected: Any, path: str = "") -> None:
    if isinstance(expected, np.ndarray):
        assert isinstance(loaded, np.ndarray), path
        assert loaded.dtype == expected.dtype and loaded.shape == expected.shape, path
        assert loaded.tobytes() == expected.tobytes(), path
    elif isinstance(expected, dict):
        assert list(loaded) == list(expected), path
        for key in expected:
            assert_same(loaded[key], expected[key], f"{path}.{key}")
    elif isinstance(expected, (list, tuple)):
        assert type(loaded) is type(expected) and len(loaded) == len(expected), path
        for i, (a, b) in enumerate(zip(loaded, expected, strict=True)):
            assert_same(a, b, f"{path}.{i}")
    elif isinstance(expected, np.generic):
        assert type(loaded) is type(expected) and loaded.tobytes() == expected.tobytes(), path
    else:
        assert type(loaded) is type(expected) and loaded == expected, path


@pytest.fixture
def old_repo(tmp_path: Path) -> Path:
    copy = tmp_path / "v1-repo"
    shutil.copytree(FIXTURE, copy)
    return copy


def test_opens_read_only_in_place_and_loads_every_commit_bit_exact() -> None:
    with cas_ckpt.open(FIXTURE, read_only=True) as repo:
        assert {k: str(v) for k, v in repo.refs().items()} == MANIFEST["refs"]
        commits = list(repo.log("main"))
        assert [str(c.cid) for c in commits] == [c["cid"] for c in MANIFEST["commits"]]
        assert [str(c.tree) for c in commits] == [c["tree"] for c in MANIFEST["commits"]]
        for commit in commits:
            assert commit.message == f"step {commit.step}"
            assert commit.metadata == {"loss": 1.0 / commit.step}
            assert_same(repo.load(commit.cid), state(commit.step))
        assert [str(p) for p in repo.pins()] == MANIFEST["pins"]
        assert [str(c.cid) for c in repo.log("runs/fork")] == [c["cid"] for c in MANIFEST["fork"]]


def test_fsck_is_clean_and_every_block_is_found() -> None:
    with cas_ckpt.open(FIXTURE, read_only=True) as repo:
        report = repo.fsck()
        assert report.ok, report
        assert len(list(repo.blocks.keys())) == MANIFEST["blocks"]


def test_same_state_gives_the_same_tree_cids_as_the_old_code(tmp_path: Path) -> None:
    """The node encoding and chunking are unchanged: today's save names each tree as 0.1.0 did.

    Since issue #16, arrays of 1-16 KiB in a container holding over 64 KiB of them get blocks of
    their own (docs/format.md, "Many small arrays"), which changes those states' CIDs; the
    fixture's containers hold at most ~6 KiB of small arrays, so its CIDs must not change.
    """
    with cas_ckpt.open(tmp_path / "fresh") as repo:
        for expected in reversed(MANIFEST["commits"]):
            repo.save(state(expected["step"]), step=expected["step"])
            assert str(repo.commit("main").tree) == expected["tree"]


def test_accepts_new_saves_history_and_gc(old_repo: Path) -> None:
    with cas_ckpt.open(old_repo) as repo:
        head = repo.resolve("main")
        new = repo.save(state(3), ref="main", step=5, message="after upgrade")
        assert repo.last_save is not None and repo.last_save.bytes_written < 4096  # all deduplicated
        assert repo.commit(new).parents == (head,)
        assert [c.step for c in repo.log("main")] == [5, 3, 2, 1]
        repo.gc()
        assert repo.fsck().ok
        assert_same(repo.load("main"), state(3))
        assert_same(repo.load("runs/fork"), state(1))
    with cas_ckpt.open(old_repo) as reopened:  # what the new code wrote, it reads back
        assert [c.step for c in reopened.log("main")] == [5, 3, 2, 1]
