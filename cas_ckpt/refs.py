"""Refs: named, mutable pointers to root CIDs, moved only by compare-and-swap.

A ref store also keeps each ref's reflog, the pin set, the repository config and the save/GC lock:
the small mutable state of a repository, as opposed to the immutable blocks.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cas_ckpt import _fs
from cas_ckpt import cid as cidlib
from cas_ckpt.errors import CorruptStore, InvalidRefName, RefLocked

_FORBIDDEN = set(' \\*?[]:~^"<>|')
MAX_REF_LENGTH = 1024
MAX_SEGMENT_BYTES = 250  # on disk: a file name is at most 255 bytes, and locks add ".lock"


def check_ref_name(name: object) -> str:
    """Return ``name`` if it is a valid ref name, else raise :class:`InvalidRefName`.

    Names are ``/``-separated segments; no empty, ``.`` or ``..`` segment, none starting with ``.``
    or ending in ``.lock`` or ``.tmp``, no control characters, whitespace or ``\\*?[]:~^"<>|``.
    On disk (:class:`LocalRefStore`) a segment is also at most 250 bytes of UTF-8.
    """
    if not isinstance(name, str):
        raise InvalidRefName(name, "must be a string")
    if not name or len(name) > MAX_REF_LENGTH:
        raise InvalidRefName(name, f"must be 1 to {MAX_REF_LENGTH} characters")
    if not name.isascii():
        try:
            name.encode("utf-8")  # ref names become file names and reflog JSON
        except UnicodeEncodeError:
            raise InvalidRefName(name, "is not valid Unicode text (lone surrogate)") from None
    for ch in name:
        if ord(ch) < 32 or ord(ch) == 127 or ch.isspace():
            raise InvalidRefName(name, "contains a control or whitespace character")
        if ch in _FORBIDDEN:
            raise InvalidRefName(name, f"contains {ch!r}")
    for segment in name.split("/"):
        if not segment:
            raise InvalidRefName(name, "has an empty segment (leading, trailing or double '/')")
        if segment.startswith("."):
            raise InvalidRefName(name, "has a segment starting with '.' (including '..')")
        if segment.endswith((".lock", ".tmp")):
            # Lock and temp files: listings skip them, so GC would not see such a ref.
            raise InvalidRefName(name, "has a segment ending in '.lock' or '.tmp'")
    return name


@dataclass(frozen=True)
class ReflogEntry:
    """One ref update: old and new binary CIDs (None = absent), unix time, message."""

    old: bytes | None
    new: bytes | None
    time: float
    message: str

    def to_json(self) -> str:
        return json.dumps(
            {
                "old": cidlib.to_str(self.old) if self.old else None,
                "new": cidlib.to_str(self.new) if self.new else None,
                "time": self.time,
                "message": self.message,
            },
            ensure_ascii=True,
        )

    @classmethod
    def from_json(cls, line: str) -> ReflogEntry:
        obj = json.loads(line)
        return cls(
            old=cidlib.to_bytes(obj["old"]) if obj["old"] else None,
            new=cidlib.to_bytes(obj["new"]) if obj["new"] else None,
            time=float(obj["time"]),
            message=str(obj["message"]),
        )


class RefStore(ABC):
    """Refs, reflogs, pins, config and the save/GC lock of one repository."""

    @abstractmethod
    def get(self, name: str) -> bytes | None:
        """The ref's binary CID, or None if it does not exist."""

    @abstractmethod
    def _swap(self, name: str, check: Any, new: bytes | None, message: str) -> bool:
        """Atomically: if ``check(current)`` set the ref to ``new`` (None deletes) and log it."""

    def set_if_equals(
        self, name: str, old: bytes | None, new: bytes, *, message: str = ""
    ) -> bool:
        """Move ``name`` to ``new`` if it holds ``old``; ``old=None`` sets unconditionally.

        Returns False when another writer got there first.
        """
        check_ref_name(name)
        # Not ``old.__eq__``: bytes.__eq__(None) is NotImplemented, which is truthy, so an absent
        # ref would have passed the check.
        return self._swap(name, lambda cur: old is None or cur == old, new, message)

    def add_if_new(self, name: str, new: bytes, *, message: str = "") -> bool:
        """Create ``name`` pointing at ``new``; False if it already exists."""
        check_ref_name(name)
        return self._swap(name, lambda cur: cur is None, new, message)

    def remove_if_equals(self, name: str, old: bytes | None, *, message: str = "") -> bool:
        """Delete ``name`` if it holds ``old`` (``None``: whatever it holds); False otherwise."""
        check_ref_name(name)

        def check(cur: bytes | None) -> bool:
            return cur is not None and (old is None or cur == old)

        return self._swap(name, check, None, message)

    @abstractmethod
    def names(self) -> list[str]:
        """Every ref name, sorted."""

    @abstractmethod
    def reflog(self, name: str) -> list[ReflogEntry]:
        """Every recorded update of ``name``, oldest first (also after the ref was deleted)."""

    @abstractmethod
    def reflog_names(self) -> list[str]:
        """Names that have a reflog (including deleted refs)."""

    @abstractmethod
    def pins(self) -> set[bytes]: ...

    @abstractmethod
    def pin(self, cid: bytes) -> None: ...

    @abstractmethod
    def unpin(self, cid: bytes) -> bool: ...

    @abstractmethod
    def read_config(self) -> dict[str, Any] | None: ...

    @abstractmethod
    def init_config(self, config: dict[str, Any]) -> dict[str, Any]:
        """Store ``config`` unless one exists; return the one in force."""

    @abstractmethod
    def lock(self, *, exclusive: bool) -> contextlib.AbstractContextManager[None]:
        """Saves hold this shared, GC exclusive, so GC never sweeps under a save in progress."""


class MemoryRefStore(RefStore):
    """Refs in dicts, guarded by one lock."""

    def __init__(self) -> None:
        self._refs: dict[str, bytes] = {}
        self._logs: dict[str, list[ReflogEntry]] = {}
        self._pins: set[bytes] = set()
        self._config: dict[str, Any] | None = None
        self._mutex = threading.Lock()
        self._rw = _SharedExclusive()

    def get(self, name: str) -> bytes | None:
        return self._refs.get(check_ref_name(name))

    def _swap(self, name: str, check: Any, new: bytes | None, message: str) -> bool:
        with self._mutex:
            current = self._refs.get(name)
            if not check(current):
                return False
            if new is None:
                self._refs.pop(name, None)
                self._logs.pop(name, None)
                return True
            if current is None:
                for other in self._refs:
                    if other.startswith(name + "/") or name.startswith(other + "/"):
                        raise InvalidRefName(name, f"clashes with the existing ref {other!r}")
            self._logs.setdefault(name, []).append(ReflogEntry(current, new, time.time(), message))
            self._refs[name] = new
            return True

    def names(self) -> list[str]:
        return sorted(self._refs)

    def reflog(self, name: str) -> list[ReflogEntry]:
        return list(self._logs.get(check_ref_name(name), []))

    def reflog_names(self) -> list[str]:
        return sorted(self._logs)

    def pins(self) -> set[bytes]:
        return set(self._pins)

    def pin(self, cid: bytes) -> None:
        self._pins.add(cid)

    def unpin(self, cid: bytes) -> bool:
        present = cid in self._pins
        self._pins.discard(cid)
        return present

    def read_config(self) -> dict[str, Any] | None:
        return dict(self._config) if self._config else None

    def init_config(self, config: dict[str, Any]) -> dict[str, Any]:
        with self._mutex:
            if self._config is None:
                self._config = dict(config)
            return dict(self._config)

    def lock(self, *, exclusive: bool) -> contextlib.AbstractContextManager[None]:
        return self._rw.hold(exclusive)


class _SharedExclusive:
    """A readers-writer lock for threads (the memory backend's save/GC lock)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._writer = False

    @contextlib.contextmanager
    def hold(self, exclusive: bool) -> Iterator[None]:
        with self._cond:
            if exclusive:
                self._cond.wait_for(lambda: not self._writer and self._readers == 0)
                self._writer = True
            else:
                self._cond.wait_for(lambda: not self._writer)
                self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                if exclusive:
                    self._writer = False
                else:
                    self._readers -= 1
                self._cond.notify_all()


class LocalRefStore(RefStore):
    """Refs as files under ``refs/``, reflogs under ``logs/``, pins under ``pins/``.

    An update takes ``<ref>.lock`` with ``O_EXCL`` (holding pid, host, time), re-reads the ref under
    it, appends the reflog line (fsynced), writes the new value to a temp file, fsyncs it, renames it
    over the ref, fsyncs the directory and drops the lock. A lock whose holder process is gone (same
    host) is broken safely; any other lock that outlives ``lock_timeout`` raises :class:`RefLocked`.
    """

    def __init__(self, root: str | os.PathLike[str], *, lock_timeout: float = 10.0) -> None:
        self.root = Path(root)
        self.refs_dir = self.root / "refs"
        self.logs_dir = self.root / "logs"
        self.pins_dir = self.root / "pins"
        self.locks_dir = self.root / "locks"
        self.config_path = self.root / "config.json"
        self.lock_timeout = lock_timeout

    def ensure_dirs(self) -> None:
        for d in (self.refs_dir, self.logs_dir, self.pins_dir, self.locks_dir):
            _fs.makedirs(_fs.refuse_links(self.root, d))

    def _path(self, base: Path, name: str) -> Path:
        segments = check_ref_name(name).split("/")
        if any(len(s.encode("utf-8")) > MAX_SEGMENT_BYTES for s in segments):
            raise InvalidRefName(name, f"has a segment over {MAX_SEGMENT_BYTES} bytes (a file name)")
        path = base.joinpath(*segments)
        _fs.refuse_links(self.root, path.parent)  # the file itself is opened without following
        return path

    def get(self, name: str) -> bytes | None:
        return self._read(self._path(self.refs_dir, name))

    def _read(self, path: Path) -> bytes | None:
        try:
            text = _fs.read_bytes(path).decode("ascii").strip()
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return None
        except UnicodeDecodeError:
            raise CorruptStore(path, "ref file is not ASCII") from None
        try:
            return cidlib.to_bytes(text)
        except ValueError as exc:
            raise CorruptStore(path, f"ref file does not hold a valid CID: {exc}") from None

    def _swap(self, name: str, check: Any, new: bytes | None, message: str) -> bool:
        path = self._path(self.refs_dir, name)
        self._make_parents(name, path)
        with self._ref_lock(name, path):
            current = self._read(path)
            if not check(current):
                return False
            if new is None:
                # As git does: a deleted ref takes its reflog along (step refs come and go often).
                # The reflog goes first, durably: a ref left without a reflog is fine, a reflog
                # naming a checkpoint for a ref that is gone is what fsck reports as a lost ref.
                log = self._path(self.logs_dir, name)
                if log.exists():
                    log.unlink()
                    _fs.fsync_dir(log.parent)
                path.unlink()
                _fs.fsync_dir(path.parent)
            else:
                self._append_log(name, ReflogEntry(current, new, time.time(), message))
                _fs.atomic_write(path, (cidlib.to_str(new) + "\n").encode("ascii"))
        if new is None:
            self._prune_empty(path.parent, self.refs_dir)
            self._prune_empty(self._path(self.logs_dir, name).parent, self.logs_dir)
        return True

    def _make_parents(self, name: str, path: Path) -> None:
        """Create the ref's directories; a ref cannot sit above or below another ref."""
        if path.is_dir():
            raise InvalidRefName(name, "refs exist below this name")
        for parent in path.relative_to(self.refs_dir).parents:
            if parent != Path(".") and (self.refs_dir / parent).is_file():
                raise InvalidRefName(name, f"clashes with the existing ref {parent.as_posix()!r}")
        try:
            _fs.makedirs(path.parent)
        except (FileExistsError, NotADirectoryError):
            raise InvalidRefName(name, "clashes with an existing ref") from None

    @staticmethod
    def _prune_empty(directory: Path, top: Path) -> None:
        while directory != top and top in directory.parents:
            try:
                directory.rmdir()
            except OSError:
                return  # not empty (or gone): stop
            directory = directory.parent

    @contextlib.contextmanager
    def _ref_lock(self, name: str, path: Path) -> Iterator[None]:
        lock = path.with_name(path.name + ".lock")
        deadline = time.monotonic() + self.lock_timeout
        delay = 0.001
        while True:
            # Created whole (temp file linked into place): a live holder's lock is never empty, so
            # an empty or torn one is a crash leftover that holder_is_dead lets us break.
            try:
                if _fs.create_exclusive(
                    lock, _fs.lock_holder_text(), tmp_dir=path.parent, durable=False
                ):
                    break
            except FileNotFoundError:  # a concurrent delete pruned the emptied directory
                _fs.makedirs(path.parent)
                continue
            holder = self._lock_text(lock)
            if holder is not None and _fs.lock_is_stale(lock, holder):
                self._break_stale(lock, holder)
                continue
            if time.monotonic() > deadline:
                raise RefLocked(name, str(lock), holder or "an unknown process") from None
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
        try:
            yield
        finally:
            lock.unlink(missing_ok=True)

    @staticmethod
    def _lock_text(lock: Path) -> str | None:
        try:
            return _fs.read_bytes(lock).decode(errors="replace")
        except FileNotFoundError:
            return None

    def _break_stale(self, lock: Path, seen: str) -> None:
        # Re-check under a kernel lock: two breakers must not remove a lock a live writer just took.
        _fs.makedirs(_fs.refuse_links(self.root, self.locks_dir))
        with _fs.flocked(self.locks_dir / "refs.breaker", exclusive=True):
            if self._lock_text(lock) == seen:
                lock.unlink(missing_ok=True)

    def _append_log(self, name: str, entry: ReflogEntry) -> None:
        path = self._path(self.logs_dir, name)
        _fs.makedirs(path.parent)
        fd = _fs.open_nofollow(path, os.O_RDWR | os.O_CREAT | os.O_APPEND)
        try:
            with _fs.naming(path):
                # A torn line (an append cut short by a crash or a full disk) is dropped, never
                # left for the next line to be glued to; a failed append leaves no part behind.
                start = _whole_lines_length(fd)
                if start != os.fstat(fd).st_size:
                    os.ftruncate(fd, start)
                try:
                    _fs.write_all(fd, (entry.to_json() + "\n").encode("ascii"))
                    os.fsync(fd)
                except BaseException:
                    with contextlib.suppress(OSError):
                        os.ftruncate(fd, start)
                    raise
        finally:
            os.close(fd)

    def _walk(self, base: Path, suffix_skip: tuple[str, ...] = (".lock", ".tmp")) -> list[str]:
        names = []
        _fs.refuse_links(self.root, base)  # os.walk follows its top (not links below it)
        for dirpath, _dirs, files in os.walk(base):
            for f in files:
                if f.endswith(suffix_skip) or f.startswith("."):
                    continue
                rel = Path(dirpath, f).relative_to(base).as_posix()
                with contextlib.suppress(InvalidRefName):
                    names.append(check_ref_name(rel))
        return sorted(names)

    def names(self) -> list[str]:
        return [n for n in self._walk(self.refs_dir) if self.get(n) is not None]

    def reflog(self, name: str) -> list[ReflogEntry]:
        path = self._path(self.logs_dir, name)
        try:
            lines = _fs.read_bytes(path).split(b"\n")
        except FileNotFoundError:
            return []
        entries = []
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                entries.append(ReflogEntry.from_json(line.decode("ascii")))
            except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
                if number == len(lines):
                    continue  # a torn last line (no newline): the update it began never happened
                raise CorruptStore(path, f"line {number}: {exc}") from None
        return entries

    def reflog_names(self) -> list[str]:
        return self._walk(self.logs_dir)

    def pins(self) -> set[bytes]:
        try:
            names = os.listdir(_fs.refuse_links(self.root, self.pins_dir))
        except FileNotFoundError:
            return set()
        found = set()
        for name in names:
            if name.endswith(".tmp") or name.startswith("."):
                continue  # a pin() a crash cut short
            try:
                found.add(cidlib.to_bytes(name))
            except ValueError:
                raise CorruptStore(self.pins_dir / name, "pin file name is not a CID") from None
        return found

    def pin(self, cid: bytes) -> None:
        path = _fs.refuse_links(self.root, self.pins_dir) / cidlib.to_str(cid)
        _fs.atomic_write(path, b"")

    def unpin(self, cid: bytes) -> bool:
        path = _fs.refuse_links(self.root, self.pins_dir) / cidlib.to_str(cid)
        try:
            path.unlink()
        except FileNotFoundError:
            return False
        _fs.fsync_dir(self.pins_dir)
        return True

    def read_config(self) -> dict[str, Any] | None:
        try:
            text = _fs.read_bytes(self.config_path).decode("utf-8")
        except (FileNotFoundError, NotADirectoryError):  # NotADirectory: the root is a file
            return None
        except UnicodeDecodeError:
            raise CorruptStore(self.config_path, "not UTF-8 text") from None
        try:
            config = json.loads(text)
        except ValueError as exc:
            raise CorruptStore(self.config_path, f"not valid JSON: {exc}") from None
        if not isinstance(config, dict):
            raise CorruptStore(self.config_path, "not a JSON object")
        return config

    def init_config(self, config: dict[str, Any]) -> dict[str, Any]:
        _fs.makedirs(self.root)
        self.ensure_dirs()
        data = (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()
        _fs.create_exclusive(self.config_path, data, tmp_dir=self.root)
        return self.read_config() or config

    def lock(self, *, exclusive: bool) -> contextlib.AbstractContextManager[None]:
        return _flock_none(_fs.refuse_links(self.root, self.locks_dir) / "gc.lock", exclusive)


def _whole_lines_length(fd: int) -> int:
    """The length of the file up to and including its last newline."""
    pos = os.fstat(fd).st_size
    if pos == 0 or os.pread(fd, 1, pos - 1) == b"\n":
        return pos
    while pos > 0:
        start = max(0, pos - 4096)
        newline = os.pread(fd, pos - start, start).rfind(b"\n")
        if newline >= 0:
            return start + newline + 1
        pos = start
    return 0


@contextlib.contextmanager
def _flock_none(path: Path, exclusive: bool) -> Iterator[None]:
    with _fs.flocked(path, exclusive=exclusive):
        yield
