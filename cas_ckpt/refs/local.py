"""Refs on a local filesystem: one small file per ref, an append-only reflog file per ref."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

from cas_ckpt import _fs
from cas_ckpt import cid as cidlib
from cas_ckpt.errors import CorruptStore, InvalidRefName, LeaseHeld, RefLocked
from cas_ckpt.refs import _files
from cas_ckpt.refs.base import (
    MAX_SEGMENT_BYTES,
    Lease,
    ReflogEntry,
    RefStore,
    check_ref_name,
    check_task_name,
    describe_holder,
    holder_info,
    is_ref_name,
    listed_name,
)

# In refs/ and logs/, under the ref lock, no writer is using a file of these names: they are what
# a crash leaves (temp files; cas_ckpt 0.1's per-ref lock files), removed when pruning.
_DEBRIS = (".lock", ".tmp")
_MAX_DEPTH = 512  # directory levels a ref name can make (1024 characters, '/'-separated)


class LocalRefStore(RefStore):
    """Refs as files under ``refs/``, reflogs under ``logs/``, pins under ``pins/``.

    Every update holds the repository's ref lock, an exclusive ``flock`` on ``locks/refs.lock``
    that the kernel releases when its holder exits or dies; under it the update re-reads the ref,
    appends the reflog line (fsynced), writes the new value to a temp file, fsyncs it, renames it
    over the ref and fsyncs the directory (a delete also prunes emptied directories). Waiting for
    a live holder longer than ``lock_timeout`` raises :class:`RefLocked`.
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
            text = _fs.read_small(path, _files.MAX_REF_BYTES).decode("ascii").strip()
        except (FileNotFoundError, IsADirectoryError):
            return None  # a directory: a prefix of other refs' names
        except NotADirectoryError:
            _check_dir(self.refs_dir)
            return None  # a prefix of the name is a ref
        except UnicodeDecodeError:
            raise CorruptStore(path, "ref file is not ASCII") from None
        try:
            return cidlib.to_bytes(text)
        except ValueError as exc:
            raise CorruptStore(path, f"ref file does not hold a valid CID: {exc}") from None

    def _swap(self, name: str, check: Any, new: bytes | None, message: str) -> bool:
        path = self._path(self.refs_dir, name)
        log = self._path(self.logs_dir, name)
        # Everything below, directories created and pruned included, happens under the one ref
        # lock: updates of refs sharing a directory never interleave.
        with self._ref_lock(name):
            current = self._read(path)
            if not check(current):
                return False
            entry = ReflogEntry(current, new, time.time(), message)
            if new is None:
                self._delete(path, log, entry)
            else:
                self._make_parents(name, path, log)
                self._append_log(log, entry)
                _fs.atomic_write(path, (cidlib.to_str(new) + "\n").encode("ascii"))
        return True

    @contextlib.contextmanager
    def _ref_lock(self, name: str) -> Iterator[None]:
        lock = _fs.refuse_links(self.root, self.locks_dir) / "refs.lock"
        _fs.makedirs(self.locks_dir)
        with _fs.flocked(lock, exclusive=True, timeout=self.lock_timeout) as held:
            if not held:
                holder = f"another process or thread for over {self.lock_timeout:g} s"
                raise RefLocked(name, str(lock), holder)
            yield

    def _delete(self, path: Path, log: Path, entry: ReflogEntry) -> None:
        # Unlike git, the reflog stays, its deletion entry first and durable: it is the deleted
        # ref's safety net (a GC root for the expiry, what a restore reads). A crash in between
        # leaves the ref at the value the entry calls old, which fsck accepts.
        self._append_log(log, entry)
        path.unlink()
        _fs.fsync_dir(path.parent)
        self._prune(path.parent, self.refs_dir)

    def drop_reflog(self, name: str, *, older_than: float | None = None) -> bool:
        path = self._path(self.refs_dir, name)
        log = self._path(self.logs_dir, name)
        with self._ref_lock(name):
            if self._read(path) is not None:
                return False
            entries = self.reflog(name)
            if not entries or (older_than is not None and max(e.time for e in entries) >= older_than):
                return False
            log.unlink()
            _fs.fsync_dir(log.parent)
            self._prune(log.parent, self.logs_dir)
        return True

    def _make_parents(self, name: str, path: Path, log: Path) -> None:
        """Create the ref's and its reflog's directories; a ref cannot sit above or below another,
        nor above or below a deleted ref whose reflog is kept (a file where a directory must go)."""
        _check_dir(self.refs_dir)
        _check_dir(self.logs_dir)
        if path.is_dir():
            if self._walk(path):
                raise InvalidRefName(name, "refs exist below this name")
            self._vacate(path, "the ref file")
        for parent in path.relative_to(self.refs_dir).parents:
            if parent != Path(".") and (self.refs_dir / parent).is_file():
                raise InvalidRefName(name, f"clashes with the existing ref {parent.as_posix()!r}")
        if log.is_dir():
            kept = self._walk(log)
            if kept:
                raise InvalidRefName(name, _kept_reflog(f"{name}/{kept[0]}"))
            self._vacate(log, "the reflog")
        for parent in log.relative_to(self.logs_dir).parents:
            if parent != Path(".") and (self.logs_dir / parent).is_file():
                raise InvalidRefName(name, _kept_reflog(parent.as_posix()))
        try:
            _fs.makedirs(path.parent)
            _fs.makedirs(log.parent)
        except (FileExistsError, NotADirectoryError):
            raise InvalidRefName(name, "clashes with an existing ref or reflog") from None

    @staticmethod
    def _vacate(directory: Path, what: str) -> None:
        """Remove an empty directory tree (a crash leftover) where ``what`` must go."""
        if not _clear(directory):
            raise CorruptStore(directory, f"is a directory, not cas_ckpt's, where {what} belongs")

    @staticmethod
    def _prune(directory: Path, top: Path) -> None:
        while directory != top and top in directory.parents and _clear(directory):
            directory = directory.parent

    def _append_log(self, path: Path, entry: ReflogEntry) -> None:
        line = entry.to_json()
        if len(line) >= _files.MAX_REFLOG_LINE:  # readers refuse longer lines
            line = dataclasses.replace(entry, message=entry.message[: _files.MAX_MESSAGE]).to_json()
        try:
            fd = _fs.open_regular(path, os.O_RDWR | os.O_CREAT | os.O_APPEND)
        except IsADirectoryError:
            self._vacate(path, "the reflog")
            fd = _fs.open_regular(path, os.O_RDWR | os.O_CREAT | os.O_APPEND)
        try:
            with _fs.naming(path):
                # A torn line (an append cut short by a crash or a full disk) is dropped, never
                # left for the next line to be glued to; a failed append leaves no part behind.
                start = _files.whole_lines_length(fd, path)
                if start != os.fstat(fd).st_size:
                    os.ftruncate(fd, start)
                try:
                    _fs.write_all(fd, (line + "\n").encode("ascii"))
                    os.fsync(fd)
                except BaseException:
                    with contextlib.suppress(OSError):
                        os.ftruncate(fd, start)
                    raise
        finally:
            os.close(fd)

    def _walk(self, base: Path, suffix_skip: tuple[str, ...] = (".lock", ".tmp")) -> list[str]:
        """The valid names of the files below ``base``.

        A listing that fails raises: one that quietly came back short would let GC delete the
        checkpoints of the refs it missed. Only a directory pruned meanwhile is skipped.
        """
        names = []
        _check_dir(_fs.refuse_links(self.root, base))  # os.walk follows its top (not links below)

        def fail(exc: OSError) -> None:
            if not isinstance(exc, (FileNotFoundError, NotADirectoryError)):
                raise CorruptStore(exc.filename or base, f"cannot be listed: {exc.strerror}")

        try:
            for dirpath, _dirs, files in os.walk(base, onerror=fail):
                for f in files:
                    if f.endswith(suffix_skip) or f.startswith("."):
                        continue
                    rel = Path(dirpath, f).relative_to(base).as_posix()
                    if (name := listed_name(rel)) is not None:
                        names.append(name)
        except RecursionError:
            raise CorruptStore(base, "holds directories nested deeper than any ref name") from None
        return sorted(names)

    def names(self, prefix: str = "") -> list[str]:
        return [n for n in self._candidates(prefix) if self.get(n) is not None]

    def values(self, prefix: str = "") -> dict[str, bytes]:
        return {n: value for n in self._candidates(prefix) if (value := self.get(n)) is not None}

    def _candidates(self, prefix: str) -> list[str]:
        """Names of the ref files that start with ``prefix``: only the directory they lie in is
        walked (a run's ``<ref>.steps/`` among many runs' refs)."""
        top = prefix.rpartition("/")[0]
        if not top or not is_ref_name(top):
            return [n for n in self._walk(self.refs_dir) if n.startswith(prefix)]
        base = self.refs_dir.joinpath(*top.split("/"))
        try:
            if not stat.S_ISDIR(os.lstat(base).st_mode):
                return []  # a ref of that name, a link, or something else: nothing lies below
        except (FileNotFoundError, NotADirectoryError):
            return []
        # listed_name again: a ListedName below keeps its exemption in the joined name.
        names = (listed_name(f"{top}/{n}") for n in self._walk(base))
        return [name for name in names if name is not None and name.startswith(prefix)]

    def reflog(self, name: str) -> list[ReflogEntry]:
        path = self._path(self.logs_dir, name)
        try:
            fd = _fs.open_regular(path, os.O_RDONLY)
        except FileNotFoundError:
            return []
        except NotADirectoryError:
            _check_dir(self.logs_dir)
            return []  # a prefix of the name has a reflog
        except IsADirectoryError:
            if self.get(name) is None:
                return []  # a prefix of other refs' names
            raise CorruptStore(path, "is a directory, not the reflog of the ref") from None
        try:
            return _parse_reflog(fd, path)
        finally:
            os.close(fd)

    def reflog_names(self) -> list[str]:
        return self._walk(self.logs_dir)

    def pins(self) -> set[bytes]:
        try:
            entries = list(os.scandir(_fs.refuse_links(self.root, self.pins_dir)))
        except FileNotFoundError:
            return set()
        except NotADirectoryError:
            raise CorruptStore(self.pins_dir, "is not a directory") from None
        found = set()
        for entry in entries:
            if entry.name.endswith(".tmp") or entry.name.startswith("."):
                continue  # a pin() a crash cut short
            path = self.pins_dir / entry.name
            if not entry.is_file(follow_symlinks=False):
                self._check_pin(path)
            try:
                found.add(cidlib.to_bytes(entry.name))
            except ValueError:
                raise CorruptStore(path, "pin file name is not a CID") from None
        return found

    @staticmethod
    def _check_pin(path: Path) -> bool:
        """True if the pin file ``path`` exists; :class:`CorruptStore` if it is not a regular file."""
        try:
            mode = os.stat(path, follow_symlinks=False).st_mode
        except FileNotFoundError:
            return False
        except NotADirectoryError:
            _check_dir(path.parent)
            raise
        if not stat.S_ISREG(mode):
            raise CorruptStore(path, f"is {_fs.kind(mode)}; a pin is an empty regular file")
        return True

    def pin(self, cid: bytes) -> None:
        path = _fs.refuse_links(self.root, self.pins_dir) / cidlib.to_str(cid)
        self._check_pin(path)
        _fs.atomic_write(path, b"")

    def unpin(self, cid: bytes) -> bool:
        path = _fs.refuse_links(self.root, self.pins_dir) / cidlib.to_str(cid)
        if not self._check_pin(path):
            return False
        try:
            path.unlink()
        except FileNotFoundError:
            return False
        _fs.fsync_dir(self.pins_dir)
        return True

    def read_config(self) -> dict[str, Any] | None:
        path = self.config_path
        try:
            data = _fs.read_small(path, _files.MAX_CONFIG_BYTES)
        except (FileNotFoundError, NotADirectoryError):  # NotADirectory: the root is a file
            return None
        except IsADirectoryError:
            raise CorruptStore(path, "is a directory, not the repository's configuration") from None
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            raise CorruptStore(path, "not UTF-8 text") from None
        config = _files.parse_json(text, path)
        if not isinstance(config, dict):
            raise CorruptStore(path, "not a JSON object")
        return config

    def init_config(self, config: dict[str, Any]) -> dict[str, Any]:
        _fs.makedirs(self.root)
        self.ensure_dirs()
        data = (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()
        _fs.create_exclusive(self.config_path, data, tmp_dir=self.root)
        return self.read_config() or config

    def update_config(self, old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
        with self._ref_lock("config.json"):  # every writer of config.json holds the ref lock
            current = self.read_config()
            if current == old:
                data = (json.dumps(new, indent=2, sort_keys=True) + "\n").encode()
                _fs.atomic_write(self.config_path, data, tmp_dir=self.root)
                current = new
            return dict(current or {})

    def lock(self, *, exclusive: bool) -> contextlib.AbstractContextManager[None]:
        return _flock_none(_fs.refuse_links(self.root, self.locks_dir) / "gc.lock", exclusive)

    def try_exclusive(self, name: str) -> contextlib.AbstractContextManager[bool]:
        """A non-blocking exclusive ``flock`` on ``locks/<name>.lock`` (never removed)."""
        return _fs.flocked(_fs.refuse_links(self.root, self.locks_dir) / f"{check_task_name(name)}.lock",
                           exclusive=True, blocking=False)

    def lease(self, name: str, *, takeover: bool = False) -> Lease:
        """An exclusive ``flock`` on ``locks/runs/<name, %-quoted>.lease``, which holds the
        holder's host, pid and time; a takeover renames a new locked file over it."""
        path = self._lease_path(name)
        _fs.makedirs(path.parent)
        fd = _fs.try_lock(path)
        if fd is None:
            if not takeover:
                raise LeaseHeld(name, describe_holder(_read_holder(path)))
            fd = _replace_lease(path)
        else:
            _write_holder(fd)
        return _FileLease(path, fd)

    def _lease_path(self, name: str) -> Path:
        # One flat file per ref: "a" and "a/b" can both have a lease, and "%" is quoted too.
        file = quote(check_ref_name(name), safe="")
        if len(file) > MAX_SEGMENT_BYTES - len(".lease"):
            file = hashlib.sha256(name.encode()).hexdigest()
        return _fs.refuse_links(self.root, self.locks_dir / "runs") / f"{file}.lease"


class _FileLease(Lease):
    """Held while its descriptor locks the file the lease path names."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path, self._fd = path, fd

    def held(self) -> bool:
        return self._fd is not None and _fs.still_names(self.path, self._fd)

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            _fs.unlock(fd)


def _write_holder(fd: int) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, holder_info(), 0)


def _read_holder(path: Path) -> bytes | None:
    try:
        return _fs.read_small(path, 4096)
    except (OSError, CorruptStore):
        return None


def _replace_lease(path: Path) -> int:
    """Lock a new file and rename it over ``path``: the old holder's lock names nothing now."""
    temp = _fs.temp_name(path.parent, ".tmp")
    fd = _fs.try_lock(temp)
    if fd is None:  # a fresh random name: nobody else can hold it
        raise CorruptStore(temp, "a new lease file was locked by someone else")
    try:
        _write_holder(fd)
        os.rename(temp, path)
        _fs.fsync_dir(path.parent)
    except BaseException:
        _fs.unlock(fd)
        with contextlib.suppress(OSError):
            temp.unlink()
        raise
    return fd


def _kept_reflog(deleted: str) -> str:
    return (f"clashes with the kept reflog of the deleted ref {deleted!r} (a file where this name "
            f"needs a directory): restore that ref (cas-ckpt ref restore {deleted}) or drop its "
            f"reflog (cas-ckpt reflog --drop {deleted}); GC drops it once it is past the expiry")


def _parse_reflog(fd: int, path: Path) -> list[ReflogEntry]:
    entries = []
    for number, line in enumerate(_files.lines(fd, path), 1):
        if not line.strip():
            continue
        try:
            entries.append(ReflogEntry.from_json(line.decode("ascii")))
        except (ValueError, KeyError, TypeError, UnicodeDecodeError, RecursionError) as exc:
            if not line.endswith(b"\n"):
                continue  # a torn last line: the update it began never happened
            why = "nested too deeply" if isinstance(exc, RecursionError) else exc
            raise CorruptStore(path, f"line {number}: {why}") from None
    return entries


def _check_dir(path: Path) -> None:
    """:class:`CorruptStore` if ``path`` exists but is not a directory."""
    try:
        mode = os.stat(path, follow_symlinks=False).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(mode):
        raise CorruptStore(path, f"is {_fs.kind(mode)}, not a directory")


def _clear(directory: Path, depth: int = 0) -> bool:
    """Remove ``directory`` if it holds only directories like it and crash leftovers (_DEBRIS).

    Only under the ref lock, where no writer is using such a file or is about to use the directory.
    """
    debris = []
    try:
        with os.scandir(directory) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    if depth >= _MAX_DEPTH or not _clear(Path(entry.path), depth + 1):
                        return False
                elif entry.name.endswith(_DEBRIS) and entry.is_file(follow_symlinks=False):
                    debris.append(entry.path)
                else:
                    return False
    except FileNotFoundError:
        return True
    except NotADirectoryError:
        return False
    for leftover in debris:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(leftover)
    try:
        os.rmdir(directory)
    except FileNotFoundError:
        pass
    except OSError:
        return False
    return True


@contextlib.contextmanager
def _flock_none(path: Path, exclusive: bool) -> Iterator[None]:
    with _fs.flocked(path, exclusive=exclusive):
        yield
