"""A repository on a read-only medium: everything that only reads works, everything else fails
with a cas_ckpt error (issue #40: ``cas-ckpt du`` failed with EROFS on ``locks/gc.lock``, and
``gc(dry_run=True)`` and a ``CheckpointManager`` raised a bare ``OSError``).

The medium is real: a tmpfs mounted, filled, then remounted read-only (root only; skipped
elsewhere, or where mounting is not allowed, as in an unprivileged container). Every command
``docs/cli.md`` lists as only reading is run as a separate process, and every method of
:class:`cas_ckpt.Repository` is classified here as reading or writing, so a new one cannot be
left out.
"""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import cas_ckpt
from cas_ckpt.errors import MediumError, RepositoryError

from ._support import child_env

ROOT = Path(__file__).resolve().parents[2]


def _mount(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["mount", *argv], capture_output=True, text=True, check=False)


@pytest.fixture(scope="module")
def medium(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A read-only tmpfs holding a repository: refs ``main`` (two steps) and ``other``, a pin,
    and the kept reflog of deleted ref ``gone``."""
    if os.geteuid() != 0:
        pytest.skip("mounting a read-only filesystem needs root")
    where = tmp_path_factory.mktemp("ro-medium")
    mounted = _mount("-t", "tmpfs", "-o", "size=64m", "tmpfs", str(where))
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        with cas_ckpt.open(where / "repo") as repo:
            with cas_ckpt.CheckpointManager(repo, "main") as manager:
                for step in (1, 2):
                    manager.save(step, {"model": {"w": np.arange(9.0 + step)},
                                        "blob": bytes([step]) * 20_000, "step": step})
            repo.save({"v": 1}, ref="other")
            repo.pin("other")
            repo.save({"v": 2}, ref="gone")
            repo.delete_ref("gone")
        remounted = _mount("-o", "remount,ro", str(where))
        assert remounted.returncode == 0, remounted.stderr
        with pytest.raises(OSError):
            (where / "repo" / "probe").write_text("x")  # it is read-only
        yield where / "repo"
    finally:
        _mount("-o", "remount,rw", str(where))
        subprocess.run(["umount", str(where)], check=False)


def _documented_read_only_commands() -> list[str]:
    """The commands docs/cli.md says only read ("Commands that only read (`log`, ...)")."""
    text = (ROOT / "docs" / "cli.md").read_text()
    found = re.search(r"Commands that only read \((.*?)\)\s+open the repository read-only", text, re.S)
    assert found, "docs/cli.md no longer lists the commands that only read"
    return re.findall(r"`([a-z]+)[^`]*`", found.group(1).replace("\n", " "))


def _cli_runs(out: Path, chunk: str) -> dict[str, list[list[str]]]:
    """How each reading command is run (each must exit 0, or 1 where it reports differences)."""
    return {
        "log": [["log"], ["log", "other"], ["log", "--graph"]],
        "show": [["show", "main"]],
        "ls": [["ls", "main"]],
        "cat": [["cat", chunk]],
        "refs": [["refs"], ["refs", "--json"]],
        "du": [["du"], ["du", "--json", "--by-ref"]],
        "diff": [["diff", "main~1", "main"], ["diff", "main~1", "main", "--by-tensor"]],
        "stats": [["stats", "main", "model"], ["stats", "main", "--find-nonfinite"]],
        "fsck": [["fsck"]],
        "export": [["export", "main", "-o", str(out / "main.car")],
                   ["export", "main", "-o", str(out / "m.safetensors"), "--path", "model"]],
        "pin": [["pin"]],
        "reflog": [["reflog", "main"]],
        "gc": [["gc", "--dry-run"]],
        "upkeep": [["upkeep", "--dry-run"], ["upkeep", "--dry-run", "--json"]],
        "push": [["push", str(out / "pushed")]],
        "clone": [],  # below: its source is the read-only repository
    }


def test_every_command_that_only_reads_works(medium: Path, tmp_path: Path) -> None:
    with cas_ckpt.open(medium, read_only=True) as repo:
        chunk = next(str(c) for c in repo.blocks if c.codec.name == "raw")
    runs = _cli_runs(tmp_path, chunk)
    documented = _documented_read_only_commands()
    assert set(documented) <= set(runs), f"docs/cli.md lists commands this test does not run: {documented}"
    failed = {}
    for command, argvs in runs.items():
        for argv in argvs:
            done = subprocess.run([sys.executable, "-m", "cas_ckpt", "--repo", str(medium), *argv],
                                  capture_output=True, text=True, env=child_env(), check=False)
            if done.returncode not in ((0, 1) if command == "diff" else (0,)):
                failed[" ".join(argv)] = (done.returncode, done.stderr.strip()[-300:])
    clone = subprocess.run([sys.executable, "-m", "cas_ckpt", "clone", str(medium), str(tmp_path / "c")],
                           capture_output=True, text=True, env=child_env(), check=False)
    if clone.returncode:
        failed["clone"] = (clone.returncode, clone.stderr.strip()[-300:])
    assert not failed, failed
    assert (tmp_path / "c").is_dir() and (tmp_path / "pushed").is_dir()


# Every public method of Repository, as reading (run on the medium, must work) or writing (must
# fail with a cas_ckpt error and change nothing). Each reader: (name, call).
Call = Callable[[cas_ckpt.Repository, Path], Any]
READS: dict[str, Call] = {
    "resolve": lambda r, _: r.resolve("main~1"),
    "load": lambda r, _: r.load("main", path="model.w"),
    "tree": lambda r, _: r.tree(),
    "commit": lambda r, _: r.commit(),
    "log": lambda r, _: list(r.log()),
    "expired": lambda r, _: r.expired(r.commit()),
    "forks": lambda r, _: r.forks(list(r.log())),
    "refs": lambda r, _: r.refs(),
    "reflog": lambda r, _: r.reflog("main"),
    "run_refs": lambda r, _: r.run_refs("main"),
    "pins": lambda r, _: r.pins(),
    "gc": lambda r, _: r.gc(dry_run=True),
    "fsck": lambda r, _: r.fsck(),
    "stats": lambda r, _: r.stats(),
    "upkeep_status": lambda r, _: r.upkeep_status(),
    "diff": lambda r, _: r.diff("main~1", "main"),
    "graph": lambda r, _: r.graph(),
    "find_nonfinite": lambda r, _: r.find_nonfinite("main"),
    "check_complete": lambda r, _: r.check_complete("main"),
    "push": lambda r, out: r.push(out / "pushed"),
    "export_car": lambda r, out: r.export_car("main", out / "x.car"),
    "export_safetensors": lambda r, out: r.export_safetensors("main", out / "m.safetensors", path="model"),
    "last_save": lambda r, _: r.last_save,
    "last_transfer": lambda r, _: r.last_transfer,
    "read_only": lambda r, _: r.read_only,
    "pool": lambda r, _: r.pool,
    "close": lambda r, _: None,  # closing is what the with block does
}
WRITES: dict[str, Call] = {
    "save": lambda r, _: r.save({"a": 1}),
    "transaction": lambda r, _: _transaction(r),
    "commit_tree": lambda r, _: r.commit_tree(lambda tree: tree.write({"a": 1})),
    "set_compression": lambda r, _: r.set_compression("zstd"),
    "set_ref": lambda r, _: r.set_ref("new", "main"),
    "delete_ref": lambda r, _: r.delete_ref("other"),
    "upkeep": lambda r, _: r.upkeep(force=True),
    "rename_ref": lambda r, _: r.rename_ref("other", "renamed"),
    "delete_run": lambda r, _: r.delete_run("main"),
    "restore_ref": lambda r, _: r.restore_ref("gone"),
    "drop_reflog": lambda r, _: r.drop_reflog("gone"),
    "fork": lambda r, _: r.fork("main", "forked"),
    "pin": lambda r, _: r.pin("main"),
    "unpin": lambda r, _: r.unpin("other"),
    "pull": lambda r, out: r.pull(out / "pushed", "pulled", remote_ref="main"),  # READS pushed it
    # nothing listens on port 9 (discard): only the refusal up front makes this a read-only error
    "update_commit_graph": lambda r, _: r.update_commit_graph(consolidate=True),
    "fetch": lambda r, _: r.fetch(r.resolve("main"), gateway="http://127.0.0.1:9", ref="fetched"),
    "import_car": lambda r, out: r.import_car(out / "x.car", ref="imported"),
    "import_safetensors": lambda r, out: r.import_safetensors(out / "m.safetensors", ref="st"),
}


def _transaction(repo: cas_ckpt.Repository) -> None:
    with repo.transaction() as txn:
        txn.move_ref("by-hand", None, txn.tree.write({"a": np.arange(3)}), "by hand")


def _public(cls: type) -> set[str]:
    return {name for name, _ in inspect.getmembers(cls) if not name.startswith("_")}


def test_every_repository_method_is_classified() -> None:
    assert _public(cas_ckpt.Repository) == set(READS) | set(WRITES)


@pytest.mark.parametrize("read_only", [True, False], ids=["opened read-only", "opened for writing"])
def test_every_read_works_and_every_write_is_a_cas_ckpt_error(
    medium: Path, tmp_path: Path, read_only: bool
) -> None:
    with cas_ckpt.open(medium, read_only=read_only) as repo:
        before = (repo.refs(), repo.pins(), sorted(map(str, repo.blocks)))
        failed = {}
        for name, call in READS.items():
            try:
                call(repo, tmp_path)
            except Exception as exc:
                failed[name] = f"{type(exc).__name__}: {exc}"
        assert not failed, failed
        refused = {}
        for name, call in WRITES.items():
            try:
                call(repo, tmp_path)
            except (RepositoryError, MediumError):
                refused[name] = True
            except Exception as exc:  # reported, by method
                refused[name] = f"{type(exc).__name__}: {exc}"
        assert refused == dict.fromkeys(WRITES, True), refused
        assert (repo.refs(), repo.pins(), sorted(map(str, repo.blocks))) == before


def test_a_manager_restores_read_only_and_refuses_to_start_for_writing(medium: Path) -> None:
    """A manager exists to save: on a medium it cannot write it fails as it starts, saying how
    to restore instead; one of a repository opened read-only restores (evaluation jobs)."""
    with cas_ckpt.open(medium) as repo, pytest.raises(MediumError, match=r"read_only=True") as info:
        cas_ckpt.CheckpointManager(repo, "main")
    assert info.value.errno == 30  # EROFS
    with cas_ckpt.open(medium, read_only=True) as repo:
        manager = cas_ckpt.CheckpointManager(repo, "main")
        assert manager.steps() == [1, 2] and manager.restore()["step"] == 2
        with pytest.raises(RepositoryError, match="read-only"):
            manager.save(3, {"step": 3})
        manager.close()
