"""Upkeep (``maintenance/upkeep.py``): small packs merged and index snapshots written, by saves
themselves once thresholds pass, safely beside other writers, readers and GC."""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import plant

import cas_ckpt
from cas_ckpt.maintenance import upkeep as upkeep_module
from cas_ckpt.maintenance.upkeep import Context, Policy, UpkeepReport

FIXTURE = Path(__file__).parent / "fixtures" / "v1-repo"


def state(step: int) -> dict[str, Any]:
    return {"w": np.full(2048, step, np.float32), "shared": np.arange(4096, dtype=np.float64), "step": step}


def saves(repo: cas_ckpt.Repository, count: int, first: int = 0) -> list[cas_ckpt.CID]:
    return [repo.save(state(i), step=i) for i in range(first, first + count)]


def pack_files(repo: cas_ckpt.Repository) -> list[str]:
    return sorted(p.name for p in (Path(repo.location) / "packs").iterdir())


def index_files(repo: cas_ckpt.Repository) -> list[str]:
    folder = Path(repo.location) / "index"
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def test_saves_keep_packs_and_index_flat_by_themselves(tmp_path: Path) -> None:
    with cas_ckpt.open(tmp_path / "repo", upkeep={"small_packs": 8, "uncovered": 4}) as repo:
        cids = saves(repo, 40)
        assert len(pack_files(repo)) <= 8  # 40 saves, one pack each, merged every 8
        status = repo.stats().upkeep
        assert status is not None and status.snapshot is not None and status.uncovered < 4
        assert len(index_files(repo)) == 1 and status.due == []
    with cas_ckpt.open(tmp_path / "repo") as again:
        for i, cid in enumerate(cids):
            assert again.load(cid)["step"] == i
        assert again.fsck().ok


def test_without_automatic_upkeep_nothing_is_tidied_until_asked(tmp_path: Path) -> None:
    with cas_ckpt.open(tmp_path / "repo", upkeep=False) as repo:
        cids = saves(repo, 12)
        assert len(pack_files(repo)) == 12 and index_files(repo) == []
        status = repo.upkeep_status()
        assert status is not None and not status.auto and "consolidate-index" in status.due
        report = repo.upkeep()
        assert report.ran == ["consolidate-index"] and report.snapshot in index_files(repo)
        report = repo.upkeep(force=True)
        assert report.ran == ["set-aside-damaged", "merge-small-packs", "consolidate-index",
                              "update-commit-graph"]
        assert report.packs_merged == 12 and report.packs_written == 1
        assert len(pack_files(repo)) == 1 and len(index_files(repo)) == 1
        assert [repo.load(cid)["step"] for cid in cids] == list(range(12))


def test_an_open_after_upkeep_reads_the_snapshot_not_each_pack(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from cas_ckpt.blocks import PackedBlockStore

    with cas_ckpt.open(tmp_path / "repo", upkeep={"small_packs": 0, "uncovered": 10}) as repo:
        saves(repo, 25)
        uncovered = repo.upkeep_status().uncovered  # type: ignore[union-attr]
    assert 0 < uncovered < 10
    described: list[str] = []
    original = PackedBlockStore._read_indexes
    monkeypatch.setattr(PackedBlockStore, "_read_indexes",
                        lambda self, infos: described.extend(i.name for i in infos) or original(self, infos))
    with cas_ckpt.open(tmp_path / "repo") as again:
        assert len(described) == uncovered  # 25 packs, all but these in the snapshot
        assert again.load()["step"] == 24


def test_a_repository_written_by_0_2_gets_its_index_on_its_first_upkeep(tmp_path: Path) -> None:
    copy = tmp_path / "v1-repo"
    shutil.copytree(FIXTURE, copy)
    config = json.loads((copy / "config.json").read_text())
    with cas_ckpt.open(copy) as repo:
        status = repo.upkeep_status()
        assert status is not None and status.snapshot is None and status.due == ["consolidate-index"]
        before = {name: repo.load(name) for name in repo.refs()}
        repo.save({"new": 1}, ref="after-upgrade")  # its upkeep writes the first snapshot
        assert len(index_files(repo)) == 1
    assert json.loads((copy / "config.json").read_text()) == config  # still readable by 0.2
    with cas_ckpt.open(copy) as again:
        assert again.upkeep_status().snapshot == index_files(again)[0]  # type: ignore[union-attr]
        for name, value in before.items():
            assert repr(again.load(name)) == repr(value)
        assert again.fsck().ok


def test_one_upkeep_at_a_time(tmp_path: Path) -> None:
    with cas_ckpt.open(tmp_path / "repo", upkeep=False) as repo:
        saves(repo, 3)
        with repo.refs_store.try_exclusive("upkeep") as mine:
            assert mine
            report = repo.upkeep(force=True)
        assert report.ran == [] and report.skipped is not None
        assert len(pack_files(repo)) == 3
        assert repo.upkeep(force=True).ran == ["set-aside-damaged", "merge-small-packs",
                                               "consolidate-index", "update-commit-graph"]


def test_a_failed_upkeep_never_fails_the_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              caplog: pytest.LogCaptureFixture) -> None:
    def broken(self: object) -> str:
        raise OSError(28, "No space left on device")

    from cas_ckpt.blocks import PackedBlockStore

    monkeypatch.setattr(PackedBlockStore, "consolidate", broken)
    with cas_ckpt.open(tmp_path / "repo") as repo:
        cid = repo.save(state(1))
        assert repo.resolve("main") == cid
    assert "upkeep of" in caplog.text and "No space left" in caplog.text


def test_history_older_than_the_commit_graph_is_taken_in_by_upkeep(tmp_path: Path) -> None:
    """History no layer holds (a writer without the graph: cas_ckpt 0.2) is taken in whole by
    the upkeep of the first save that sees it, not a bounded walk per save."""
    with cas_ckpt.open(tmp_path / "repo", upkeep=False) as plain:
        plain.history.graph = None
        saves(plain, 100)
    with cas_ckpt.open(tmp_path / "repo", upkeep=False) as repo:
        repo.save(state(100), step=100)
        assert repo.history.behind()
        assert "update-commit-graph" in repo.upkeep_status().due  # type: ignore[union-attr]
    with cas_ckpt.open(tmp_path / "repo") as repo:
        repo.save(state(101), step=101)  # its upkeep catches up
        graph = repo.history.graph
        assert graph is not None and not repo.history.behind()
        assert len(graph) + len(repo.history._pending) == 102
        assert [c.step for c in repo.log()] == list(range(101, -1, -1))
        reads = []
        repo.blocks.get = lambda cid, _get=repo.blocks.get: reads.append(cid) or _get(cid)  # type: ignore[method-assign]
        assert len(list(repo.log())) == 102 and reads == []  # every commit from the graph


class CountSaves:
    """A task of a test's own: it runs after every save."""

    name = "count-saves"

    def __init__(self) -> None:
        self.runs = 0

    def due(self, context: Context) -> bool:
        return True

    def run(self, context: Context) -> None:
        self.runs += 1


@pytest.fixture
def extra_task() -> Iterator[CountSaves]:
    task = CountSaves()
    upkeep_module.register(task, before="consolidate-index")
    yield task
    upkeep_module.TASKS.remove(task)


def test_another_task_is_one_registration(extra_task: CountSaves) -> None:
    names = [t.name for t in upkeep_module.TASKS]
    assert names[-3:] == ["count-saves", "consolidate-index", "update-commit-graph"]
    with pytest.raises(ValueError, match="exists"):
        upkeep_module.register(CountSaves())
    with cas_ckpt.open("memory://") as repo:
        saves(repo, 3)
        assert extra_task.runs == 3
        assert "count-saves" in repo.stats().upkeep.due  # type: ignore[union-attr]


@pytest.mark.parametrize(("setting", "expected"), [
    (True, Policy()), (False, Policy(auto=False)), ({"small_packs": 0}, Policy(small_packs=0)),
    ({"uncovered": 3, "auto": False}, Policy(auto=False, uncovered=3)),
])
def test_policies(setting: Any, expected: Policy) -> None:
    assert Policy.of(setting) == expected


@pytest.mark.parametrize("setting", [{"small": 3}, {"small_packs": -1}, {"uncovered": "4"}])
def test_bad_policies_are_refused_by_name(setting: Any) -> None:
    with pytest.raises(ValueError, match="upkeep setting"):
        cas_ckpt.open("memory://", upkeep=setting)


def test_the_report_defaults() -> None:
    assert UpkeepReport().ran == [] and UpkeepReport().skipped is None


# -- what stands where an index file or a commit-graph layer belongs -----------------------------
def damaged_repository(root: Path, folder: str, kind: str) -> tuple[Path, list[cas_ckpt.CID]]:
    """A repository with one index snapshot and one commit-graph layer; ``kind`` planted in
    place of the one in ``folder``."""
    with cas_ckpt.open(root) as repo:
        cids = saves(repo, 3)
        repo.upkeep(force=True)
    (entry,) = (root / folder).iterdir()
    entry.unlink()
    plant(entry, kind)
    return entry, cids


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize("kind", ["directory", "fifo", "link"])
@pytest.mark.parametrize("folder", ["index", "commit-graph"])
def test_upkeep_sets_aside_what_is_no_file_and_rebuilds(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str], folder: str,
    kind: str,
) -> None:
    from cas_ckpt import cli

    root = tmp_path / "repo"
    entry, cids = damaged_repository(root, folder, kind)
    with cas_ckpt.open(root, upkeep=False) as repo:
        cids += saves(repo, 1, first=3)
        assert "set-aside-damaged" in repo.upkeep_status().due  # type: ignore[union-attr]
    assert cli.main(["upkeep", "--repo", str(root)]) == 0
    out = capsys.readouterr().out
    (aside,) = [p for p in (root / folder).iterdir() if p.name.startswith(f"{entry.name}.damaged-")]
    assert f"set aside: {entry} (no readable file) moved to {aside}" in out
    assert os.path.lexists(aside)
    assert not os.path.lexists(entry) or (entry.is_file() and not entry.is_symlink())  # or rebuilt
    caplog.clear()
    with caplog.at_level(logging.WARNING), cas_ckpt.open(root) as repo:
        cids += saves(repo, 1, first=4)
        report = repo.fsck()
        assert report.ok and report.store_problems == [], report
        assert [c.step for c in repo.log("main")] == [4, 3, 2, 1, 0]
        assert [repo.load(cid)["step"] for cid in cids] == [0, 1, 2, 3, 4]
        assert repo.upkeep().set_aside == {}
    assert warnings_of(caplog) == []
    assert len(list((root / folder).glob("*.damaged-*"))) == 1


@pytest.mark.parametrize("folder", ["index", "commit-graph"])
def test_saves_warn_once_then_upkeep_has_set_it_aside(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, folder: str
) -> None:
    """A directory no delete removes: the first save's upkeep sets it aside (saying so, once),
    and no later save warns again."""
    root = tmp_path / "repo"
    entry, _ = damaged_repository(root, folder, "directory")
    with caplog.at_level(logging.WARNING), cas_ckpt.open(root) as repo:
        saves(repo, 1, first=3)
        assert any("set" in m and "aside" in m and str(entry) in m for m in warnings_of(caplog))
        caplog.clear()
        saves(repo, 2, first=4)
        assert warnings_of(caplog) == []
        report = repo.fsck()
        assert report.ok and report.store_problems == []


def test_upkeep_sets_aside_only_what_a_read_found_damaged(tmp_path: Path) -> None:
    """A memory repository has nothing to set aside (its names hold only objects)."""
    with cas_ckpt.open("memory://") as repo:
        saves(repo, 3)
        report = repo.upkeep(force=True)
        assert report.set_aside == {} and "set-aside-damaged" in report.ran
