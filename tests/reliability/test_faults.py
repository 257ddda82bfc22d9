"""Disk full and I/O errors at every write step: a clear error, nothing half done, then recovery.

The ``os`` calls that write (``write``, ``pwrite``, ``fsync``, ``link``, ``replace``, ``rename``) are
wrapped in-process so that the Nth call of a category raises ``OSError(ENOSPC)`` or
``OSError(EIO)`` (for writes also: a short write, then the error, as a filling disk does).
Categories: the pack data (written on the pool's threads too), the pack's fsync, the pack publish
(link into packs/, directory fsync), the ref update (lock, temp file, rename, directory fsync), the
reflog append, GC's repacking, and creating a repository.
For every N until the operation gets through, the failed operation must:

* raise ``OSError`` with that errno, naming the file it concerns (``filename``);
* leave the ref where it was (except after the rename itself succeeded: then the ref is at the new,
  complete checkpoint, and only the directory fsync that followed failed);
* leave no temp pack, temp file or ref lock, and only complete packs (a fresh store reads every
  block of every pack, each matching its CID);
* and the same operation must succeed once the fault is gone, with fsck clean after.
"""

from __future__ import annotations

import errno
import functools
import os
import shutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import cas_ckpt

from ._support import (
    Timer,
    digest,
    fsck_problems,
    leftovers,
    make_state,
    packs_sound,
    record,
    scratch_dir,
)

ERRNOS = [errno.ENOSPC, errno.EIO]


@pytest.fixture
def where(tmp_path: Path) -> Iterator[Path]:
    """Where the repositories go: tmpfs if there is one (the faults are injected, not real)."""
    with scratch_dir(tmp_path) as directory:
        yield directory


def _fd_path(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}").removesuffix(" (deleted)")
    except OSError:
        return ""


class Fault:
    """Raise ``err`` on the ``nth`` call that ``match(op, path)`` selects (paths inside ``root``)."""

    def __init__(
        self, root: Path, match: Callable[[str, str], bool], err: int, nth: int, short: bool
    ) -> None:
        self.root = os.path.realpath(root)
        self.match = match
        self.err = err
        self.nth = nth
        self.short = short
        self.calls = 0
        self.fired: tuple[str, str] | None = None
        self.armed = True

    def _hit(self, op: str, path: str) -> bool:
        if not self.armed or self.fired or not path.startswith(self.root + os.sep):
            return False
        rel = os.path.relpath(path, self.root)
        if not self.match(op, rel):
            return False
        self.calls += 1
        return self.calls >= self.nth

    def _raise(self, op: str, path: str, src: Any = None) -> None:
        self.fired = (op, os.path.relpath(path, self.root))
        if src is None:  # write/fsync on a descriptor: the OS names no file
            raise OSError(self.err, os.strerror(self.err))
        raise OSError(self.err, os.strerror(self.err), os.fsdecode(src), None, path)

    def install(self, mp: pytest.MonkeyPatch) -> None:
        names = ("write", "pwrite", "pwritev", "fsync", "link", "replace", "rename")
        real = {name: getattr(os, name) for name in names}
        fault = self
        pending_short: list[str] = []
        lock = threading.Lock()  # pack data is also written on the pool's threads

        def written(fd: int, data: Any, do: Callable[[Any], int]) -> int:
            path = _fd_path(fd)
            with lock:
                if pending_short and pending_short[0] == path:
                    pending_short.clear()
                    fault._raise("write", path)
                if fault._hit("write", path):
                    size = memoryview(data).nbytes
                    if fault.short and size > 1:
                        pending_short.append(path)
                        fault.calls = -(10**9)  # the next write to this file fails instead
                        return do(memoryview(data).cast("B")[: size // 2])
                    fault._raise("write", path)
            return do(data)

        def write(fd: int, data: Any) -> int:
            return written(fd, data, lambda d: real["write"](fd, d))

        def pwrite(fd: int, data: Any, offset: int) -> int:
            return written(fd, data, lambda d: real["pwrite"](fd, d, offset))

        def pwritev(fd: int, buffers: list[Any], offset: int) -> int:  # one write of their bytes
            joined = b"".join(memoryview(b).cast("B") for b in buffers)
            return written(fd, joined, lambda d: real["pwrite"](fd, d, offset))

        def fsync(fd: int) -> None:
            path = _fd_path(fd)
            if fault._hit("fsync", path):
                fault._raise("fsync", path)
            real["fsync"](fd)

        def two(name: str) -> Callable[..., None]:
            def call(src: Any, dst: Any, **kw: Any) -> None:
                path = os.path.realpath(os.fsdecode(dst))
                if fault._hit(name, path):
                    fault._raise(name, path, src)
                real[name](src, dst, **kw)

            return call

        mp.setattr(os, "write", write)
        mp.setattr(os, "pwrite", pwrite)
        mp.setattr(os, "pwritev", pwritev)
        mp.setattr(os, "fsync", fsync)
        for name in ("link", "replace", "rename"):
            mp.setattr(os, name, two(name))


def _under(prefix: str) -> Callable[[str, str], bool]:
    return lambda op, rel: rel == prefix or rel.startswith(prefix + "/")


CATEGORIES: dict[str, Callable[[str, str], bool]] = {
    "pack-data": lambda op, rel: op == "write" and rel.endswith(".pack.tmp"),
    "pack-fsync": lambda op, rel: op == "fsync" and rel.endswith(".pack.tmp"),
    "pack-publish": lambda op, rel: (
        (op == "link" and rel.startswith("packs/")) or (op == "fsync" and rel == "packs")
    ),
    "ref-update": _under("refs"),
    "reflog-append": _under("logs"),
}


SHORT = ("pack-data", "reflog-append", "ref-update")  # also try a short write, then the error


def _check_clean(root: Path) -> None:
    found = leftovers(root)
    assert found == {"temp_packs": [], "locks": [], "temp_files": []}, f"left behind: {found}"
    problems = packs_sound(root)
    assert not problems, f"a fresh store sees damaged packs or blocks: {problems}"


@pytest.mark.parametrize("category", sorted(CATEGORIES))
def test_fault_during_save(where: Path, monkeypatch: pytest.MonkeyPatch, category: str) -> None:
    timer = Timer()
    root = where / "repo"
    counts = {"faults": 0, "moved_despite_error": 0}
    with cas_ckpt.open(root, upkeep=False) as repo:  # upkeep's own faults: test_fault_during_upkeep
        repo.save(make_state(3, 0, scale=0.3), ref="main")
        i = 1
        plans = [
            (new_ref, err, short)
            for new_ref in (False, True)
            for err in ERRNOS
            for short in ([False, True] if category in SHORT else [False])
        ]
        for new_ref, err, short in plans:
            for nth in range(1, 400):
                ref = f"runs/r{i}/x" if new_ref else "main"  # a new ref creates directories
                value = make_state(3, i, scale=0.3)
                i += 1
                before = repo.refs()
                with monkeypatch.context() as mp:
                    fault = Fault(root, CATEGORIES[category], err, nth, short)
                    fault.install(mp)
                    try:
                        repo.save(value, ref=ref)
                        error: BaseException | None = None
                    except BaseException as exc:
                        error = exc
                    fault.armed = False
                if fault.fired is None:
                    assert error is None, f"failed without a fault: {error!r}"
                    assert nth > 1, f"{category}: no call matched: the test is not biting"
                    break
                counts["faults"] += 1
                where = f"{category} {os.strerror(err)} on call {nth} ({fault.fired})"
                assert isinstance(error, OSError) and error.errno == err, f"{where}: {error!r}"
                assert error.filename and str(root) in str(error.filename), (
                    f"{where}: the error does not name the file: {error!r}"
                )
                after = repo.refs()
                if after != before:
                    # Only once the new ref file is in place may a failure leave it moved.
                    assert fault.fired[0] == "fsync" and fault.fired[1] == os.path.dirname(
                        os.path.join("refs", ref)
                    ), f"{where}: ref moved though the save failed"
                    assert digest(repo.load(ref)) == digest(value)
                    counts["moved_despite_error"] += 1
                _check_clean(root)
                # The fault is gone: the same save goes through.
                repo.save(value, ref=ref)
                assert digest(repo.load(ref)) == digest(value)
                repo.reflog(ref)
                _check_clean(root)
        assert not fsck_problems(repo)
    assert counts["faults"] > 0
    record(
        "faults",
        **{f"{category}": counts["faults"]},
        total=counts["faults"],
        moved_despite_error=counts["moved_despite_error"],
        seconds=timer.seconds,
    )


def _fault_nth(monkeypatch: pytest.MonkeyPatch, root: Path, prefixes: tuple[str, ...], err: int,
               nth: int, operation: Callable[[], object], *, full_disk_skips: bool = True) -> bool:
    """Run ``operation`` with the ``nth`` write under ``prefixes`` failing with ``err``.

    Returns whether the fault fired (False: the operation got through untouched, so the loop
    over ``nth`` is done). When it fired, the operation raised that error, except a full disk
    under a merge with ``full_disk_skips``, which only skips the merge (GC and upkeep must
    work on a full disk).
    """
    with monkeypatch.context() as mp:
        fault = Fault(root, lambda op, rel: rel.startswith(prefixes), err, nth, False)
        fault.install(mp)
        try:
            operation()
            error: BaseException | None = None
        except BaseException as exc:
            error = exc
        fault.armed = False
    if fault.fired is None:
        assert error is None and nth > 1
        return False
    if error is not None or err != errno.ENOSPC or not full_disk_skips:
        assert isinstance(error, OSError) and error.errno == err, repr(error)
    return True


def test_fault_during_gc(where: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """GC repacks live blocks out of packs with garbage; a fault there loses nothing.

    A full disk while merging packs is not an error (the merge waits for room: GC must work on a
    full disk); any other fault is raised as it is.
    """
    root = where / "repo"
    faults = 0
    refs = cas_ckpt.refs.LocalRefStore(root)
    for err in ERRNOS:
        for nth in range(1, 200):
            shutil.rmtree(root, ignore_errors=True)
            cas_ckpt.open(root).close()
            store = cas_ckpt.blocks.LocalStore(root, pack_size=100_000)
            with cas_ckpt.Repository(store, refs, create=False) as repo:
                for i in range(3):
                    repo.save(make_state(4, i, scale=0.1), ref="main")
                expected = digest(repo.load("main"))
                # main's older checkpoints are garbage
                if not _fault_nth(monkeypatch, root, ("tmp/", "packs"), err, nth,
                                  lambda: repo.gc(reflog_expiry=0)):
                    break
                faults += 1
                assert digest(repo.load("main")) == expected
                _check_clean(root)
                repo.gc()
                assert digest(repo.load("main")) == expected
                assert not fsck_problems(repo)
    record("faults", gc=faults, total=faults)


def test_fault_during_upkeep(where: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Upkeep merges small packs and writes an index snapshot; a fault anywhere in it (the new
    pack, the snapshot, deleting what they replace) loses nothing, leaves no temp file, and the
    next upkeep does the work. A full disk under the merge only skips it."""
    root = where / "repo"
    faults = 0
    for err in ERRNOS:
        for nth in range(1, 200):
            shutil.rmtree(root, ignore_errors=True)
            with cas_ckpt.open(root, upkeep=False) as repo:
                cids = [repo.save(make_state(4, i, scale=0.05), ref="main") for i in range(4)]
                expected = [digest(repo.load(cid)) for cid in cids]
                if not _fault_nth(monkeypatch, root, ("tmp/", "packs", "index"), err, nth,
                                  lambda: repo.upkeep(force=True)):
                    break
                faults += 1
                assert [digest(repo.load(cid)) for cid in cids] == expected
                _check_clean(root)
                report = repo.upkeep(force=True)
                assert report.snapshot is not None
            with cas_ckpt.open(root) as again:
                assert again.blocks.damaged() == {}
                assert again.upkeep_status().uncovered == 0  # type: ignore[union-attr]
                assert [digest(again.load(cid)) for cid in cids] == expected
                assert not fsck_problems(again)
    record("faults", upkeep=faults, total=faults)


def _create(root: Path) -> None:
    cas_ckpt.open(root).close()


@pytest.mark.parametrize("err", ERRNOS)
def test_fault_creating_a_repository(where: Path, monkeypatch: pytest.MonkeyPatch, err: int) -> None:
    faults = 0
    for nth in range(1, 50):
        root = where / f"repo{nth}"
        if not _fault_nth(monkeypatch, where, ("",), err, nth, functools.partial(_create, root),
                          full_disk_skips=False):
            break
        faults += 1
        # Whatever the failed creation left, opening again creates (or opens) the repository.
        with cas_ckpt.open(root) as repo:
            repo.save({"x": 1}, ref="main")
            assert repo.load("main") == {"x": 1}
    record("faults", create=faults, total=faults)
