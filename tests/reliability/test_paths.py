"""Path safety: a repository never makes cas_ckpt read or write outside it.

Hostile ref names (``..``, absolute, ...) are refused. Symbolic links planted inside a repository
(``refs/`` or another top directory pointing outside, a nested ref directory, a ref file, a reflog,
a lock, a pack, a temp pack, ``config.json``) are refused with a clear error or ignored, never
followed. Every path the library opens, lists, creates, renames or removes is watched through
Python's audit hooks (``open``, ``os.listdir``, ``os.scandir``, ``os.rename``, ``os.remove``, ...):
none may go through a link inside the repository. The outside directory also holds a valid ref
and a valid pack, so following a link would show (a ref or block appearing), and its files are
compared before and after.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

import cas_ckpt
from cas_ckpt import errors

from ._support import record

_WATCH: list[Any] = []  # [root, violations] while a test watches
_EVENTS = {
    "open": "open",
    "os.listdir": "list",
    "os.scandir": "list",
    "os.rename": "rename",
    "os.remove": "remove",
    "os.rmdir": "remove",
    "os.mkdir": "mkdir",
    "os.link": "link",
    "os.truncate": "open",
    "os.utime": "open",
    "os.chmod": "open",
}


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if not _WATCH or event not in _EVENTS:
        return
    root, outside, seen = _WATCH
    kind = _EVENTS[event]
    paths = list(args[:2]) if kind in ("rename", "link") else [args[0]]
    flags = args[2] if event == "open" and len(args) > 2 and isinstance(args[2], int) else 0
    for p in paths:
        if isinstance(p, int) or p is None:
            continue
        path = os.path.abspath(os.fsdecode(p))
        if path == outside or path.startswith(outside + os.sep):
            seen.append(f"{event} {path}: a path outside the repository")
            continue
        if not path.startswith(root + os.sep):
            continue
        parts = Path(path).relative_to(root).parts
        current = root
        for i, part in enumerate(parts):
            current = os.path.join(current, part)
            last = i == len(parts) - 1
            if not os.path.islink(current):
                continue
            if last and (
                kind in ("rename", "remove", "link", "mkdir")
                or flags & getattr(os, "O_NOFOLLOW", 0)
                or (flags & os.O_CREAT and flags & os.O_EXCL)
            ):
                continue  # acts on the link itself, or fails on it: nothing is followed
            seen.append(f"{event} {path}: goes through the link {current}")


sys.addaudithook(_audit)


@contextmanager
def watching(root: Path, outside: Path) -> Iterator[list[str]]:
    seen: list[str] = []
    _WATCH[:] = [os.path.realpath(root), os.path.realpath(outside), seen]
    try:
        yield seen
    finally:
        _WATCH.clear()


def _snapshot(directory: Path) -> dict[str, str]:
    out = {}
    for path in sorted(directory.rglob("*")):
        if path.is_file() and not path.is_symlink():
            out[path.relative_to(directory).as_posix()] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


class World:
    """A repository, and outside it a directory with a valid ref, reflog, pack and config."""

    def __init__(self, tmp_path: Path) -> None:
        self.root = tmp_path / "repo"
        self.outside = tmp_path / "outside"
        elsewhere = tmp_path / "elsewhere"
        with cas_ckpt.open(elsewhere) as other:
            self.foreign = other.save({"secret": "outside data"}, ref="main")
        with cas_ckpt.open(self.root) as repo:
            self.main = repo.save({"mine": 1}, ref="main")
        self.outside.mkdir()
        for sub in ("refs", "logs", "packs", "tmp", "pins", "locks"):
            shutil.copytree(elsewhere / sub, self.outside / sub)
        shutil.copy(elsewhere / "config.json", self.outside / "config.json")
        (self.outside / "passwd").write_text("root:x:0:0:root:/root:/bin/bash\n")
        self.before = _snapshot(self.outside)
        self.pack = next((self.outside / "packs").glob("*.pack"))

    def link(self, inside: str, target: Path) -> Path:
        path = self.root / inside
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.symlink_to(target)
        return path

    def untouched(self) -> None:
        assert _snapshot(self.outside) == self.before, "a file outside the repository changed"
        assert not any((self.outside / "tmp").iterdir())


def _exercise(world: World) -> list[str]:
    """Everything a user does with a repository; return the errors raised (each must be clear)."""
    errors = []
    steps: list[Callable[[cas_ckpt.Repository], Any]] = [
        lambda r: r.refs(),
        lambda r: r.load("main"),
        lambda r: r.load(world.foreign),
        lambda r: r.save({"new": 2}, ref="main"),
        lambda r: r.save({"new": 3}, ref="runs/x"),
        lambda r: r.reflog("main"),
        lambda r: r.pin("main"),
        lambda r: r.pins(),
        lambda r: r.gc(),
        lambda r: r.fsck(),
        lambda r: r.set_ref("tags/t", "main"),
        lambda r: r.delete_ref("tags/t"),
    ]
    try:
        repo = cas_ckpt.open(world.root)
    except cas_ckpt.CasCkptError as exc:
        return [f"open: {exc}"]
    with repo:
        for step in steps:
            try:
                result = step(repo)
            except cas_ckpt.CasCkptError as exc:
                errors.append(str(exc))
                continue
            if isinstance(result, dict) and "secret" in result:
                raise AssertionError("loaded a checkpoint from outside the repository")
            if isinstance(result, dict):
                assert str(world.foreign) not in {str(v) for v in result.values()}
    return errors


LINKS: dict[str, Callable[[World], None]] = {
    "refs-dir": lambda w: w.link("refs", w.outside / "refs"),
    "logs-dir": lambda w: w.link("logs", w.outside / "logs"),
    "packs-dir": lambda w: w.link("packs", w.outside / "packs"),
    "tmp-dir": lambda w: w.link("tmp", w.outside / "tmp"),
    "pins-dir": lambda w: w.link("pins", w.outside / "pins"),
    "locks-dir": lambda w: w.link("locks", w.outside / "locks"),
    "nested-ref-dir": lambda w: w.link("refs/runs", w.outside / "refs"),
    "ref-file": lambda w: w.link("refs/main", w.outside / "refs" / "main"),
    "reflog-file": lambda w: w.link("logs/main", w.outside / "passwd"),
    "ref-lock": lambda w: w.link("refs/main.lock", w.outside / "passwd"),
    "gc-lock": lambda w: w.link("locks/gc.lock", w.outside / "passwd"),
    "pack-file": lambda w: w.link(f"packs/{w.pack.name[:-5]}0.pack", w.pack),
    "pack-to-passwd": lambda w: w.link("packs/evil.pack", w.outside / "passwd"),
    "temp-pack": lambda w: w.link("tmp/0123456789abcdef.pack.tmp", w.outside / "passwd"),
    "config": lambda w: w.link("config.json", w.outside / "config.json"),
}


@pytest.mark.parametrize("planted", sorted(LINKS))
def test_planted_symlink_is_never_followed(tmp_path: Path, planted: str) -> None:
    world = World(tmp_path)
    LINKS[planted](world)
    with watching(world.root, world.outside) as seen:
        errors = _exercise(world)
    assert not seen, "followed a link out of the repository:\n" + "\n".join(seen[:10])
    world.untouched()
    for error in errors:  # refusals must say what is wrong and where
        assert "link" in error or "not found" in error or "locked" in error, error
    record("paths", symlinks_planted=1, refusals=len(errors))


def test_symlinked_repository_root_is_fine(tmp_path: Path) -> None:
    """The user's own path may go through links: only links inside the repository are refused."""
    with cas_ckpt.open(tmp_path / "real") as repo:
        repo.save({"a": 1})
    (tmp_path / "alias").symlink_to(tmp_path / "real")
    with cas_ckpt.open(tmp_path / "alias") as repo:
        assert repo.load("main") == {"a": 1}
        repo.save({"a": 2})
        assert repo.fsck().ok


BAD_NAMES = [
    "..",
    "../escape",
    "a/../../escape",
    "/etc/passwd",
    "a//b",
    "./a",
    "a/.",
    ".hidden",
    "a/",
    "main.lock",
    "x.tmp",
    "a\x00b",
    "a\nb",
    "a b",
    "~user",
    "a:b",
    "C:\\x",
    "\\\\server\\share",
    "x" * 2000,
    "y" * 300,
    "seg/" + "z" * 260,
    "é" * 200,
    "",
]


@pytest.mark.parametrize("name", BAD_NAMES, ids=range(len(BAD_NAMES)))
def test_hostile_ref_names_are_refused(tmp_path: Path, name: str) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    with cas_ckpt.open(tmp_path / "repo") as repo, watching(tmp_path / "repo", outside) as seen:
        cid = repo.save({"a": 1})
        for call in (
            lambda: repo.save({"b": 2}, ref=name),
            lambda: repo.set_ref(name, cid),
            lambda: repo.delete_ref(name),
            lambda: repo.reflog(name),
            lambda: repo.refs_store.get(name),
        ):
            with pytest.raises(cas_ckpt.errors.InvalidRefName):
                call()
        with pytest.raises((errors.InvalidRefName, errors.InvalidCID, errors.RefNotFound)):
            repo.load(name)
        assert list(repo.refs()) == ["main"]
    assert not seen and not any(outside.iterdir())
    record("paths", hostile_ref_names=1)


def test_accepted_ref_names_stay_inside_and_are_listed(tmp_path: Path) -> None:
    names = ["a", "a-b_c.d", "runs/exp-1/step.10", "ünïcödé/名前", "x" * 250, "v1.0/rc.1", "A/B"]
    with cas_ckpt.open(tmp_path / "repo") as repo:
        for name in names:
            repo.save({"n": name}, ref=name)
        assert sorted(repo.refs()) == sorted(names)
        repo.gc()  # every ref is a GC root: nothing of theirs may go
        for name in names:
            assert repo.load(name) == {"n": name}
    for path in (tmp_path / "repo").rglob("*"):
        assert os.path.realpath(path).startswith(os.path.realpath(tmp_path / "repo"))
