"""Objects in a local directory: ``packs/<name>`` published from ``tmp/`` by a hard link.

A sink is a temp file in ``tmp/``, held under an ``flock`` until it is published (so cleaning never
removes a live writer's file). Small writes are gathered into one syscall, and the kernel is asked
to start writeback after each write so the final ``fsync`` is short. Publishing fsyncs the
file, links it into ``packs/`` (a link never replaces an existing file) and fsyncs the directory:
only then is the object visible, and durable. Reads go through one descriptor per object, opened
without following links and only for regular files, a bounded number kept open (and as many
mappings: ``descriptors.open_limit``); a descriptor evicted, or of an object deleted, while a read
uses it stays open until that read is done, so its number is never reused under a read. A read of
a chunk's size copies out of the object's mapping instead (see ``LocalBackend._copy_mapped``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from pathlib import Path
from typing import TypeVar

import numpy as np

from cas_ckpt import _fs
from cas_ckpt._memory import prefault
from cas_ckpt.backends.base import Backend, ObjectInfo, Sink
from cas_ckpt.backends.descriptors import OpenFiles, open_limit
from cas_ckpt.errors import CorruptStore

SMALL_WRITE = 256 * 1024  # writes below this are gathered before the write syscall
MAPPED_READ = 256 * 1024  # reads of this many bytes or more (chunks, not index tails) copy
# out of the object's mapping
RELEASE_BATCH = 16 * 1024 * 1024  # pages copied out of mappings are unmapped this many at a time
RELEASE_GAP = 1024 * 1024  # copied ranges this close are unmapped in one call, with what lies between
GATHER_BYTES = 4 * 1024 * 1024  # gathered small writes go out in one call of up to this many
_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024  # pieces one pwritev takes
SUFFIX = ".pack"
TEMP_SUFFIX = ".pack.tmp"
STAGING_SUFFIX = ".new"  # a temp file before its writer holds its lock (clean_temp skips it)
STAGING_AGE = 3600.0  # seconds after which a staging file is a dead writer's: it lives microseconds
T = TypeVar("T")


def open_regular(path: Path) -> int:
    """A read-only descriptor of the regular file ``path``; anything else is :class:`CorruptStore`
    (a FIFO planted under the name never blocks the open, a link is never followed)."""
    try:
        return _fs.open_regular(path, os.O_RDONLY)
    except IsADirectoryError:
        raise CorruptStore(path, "is a directory, not a regular file") from None


class LocalSink(Sink):
    """A temp file under ``tmp/``, published by linking it into ``packs/``.

    Writes are made on the caller's thread, in file order. Small ones are gathered into one
    ``pwritev`` of up to ``GATHER_BYTES``: a kept one by reference (its bytes are copied once, by
    the kernel), any other copied first. Writes to one file never run in parallel anyway (the
    kernel holds the file's lock for each), and copies on other threads fell behind the hashing
    on two cores: their backlog took a fifth of a 255 MiB save (see docs/performance.md).
    """

    def __init__(self, backend: LocalBackend) -> None:
        self._backend = backend
        path = _fs.temp_name(backend.tmp_dir, TEMP_SUFFIX)
        # Made under a name clean_temp never looks at, locked, then renamed: between an open and
        # its flock a cleaner would find the file unlocked and delete it under its writer.
        staging = path.with_name(path.name + STAGING_SUFFIX)
        # Private: a forked child must not keep the temp file locked (and uncleanable) once we die.
        fd = _fs.open_private(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held until published: see clean_temp
            os.rename(staging, path)
        except BaseException:
            _fs.close_private(fd)
            staging.unlink(missing_ok=True)
            raise
        self.path: Path | None = path
        self._fd: int | None = fd
        self._run: list[bytes | memoryview] = []  # small writes gathered, in file order
        self._run_bytes = 0
        self._size = 0  # where the next write goes

    def write(self, data: bytes | memoryview, *, keep: bool = False) -> None:
        view = memoryview(data)
        size = view.nbytes
        if size >= SMALL_WRITE:
            self._flush()
            self._write_at(self._size, [data])
            self._size += size
            return
        if not keep:
            data = bytes(view)  # the caller may reuse its buffer
        self._run.append(data)
        self._run_bytes += size
        self._size += size
        if self._run_bytes >= GATHER_BYTES or len(self._run) >= _IOV_MAX:
            self._flush()

    def _flush(self) -> None:
        if self._run:
            run, offset = self._run, self._size - self._run_bytes
            self._run, self._run_bytes = [], 0
            self._write_at(offset, run)

    def _write_at(self, offset: int, pieces: list[bytes | memoryview]) -> None:
        """Write ``pieces`` from ``offset`` and start their writeback (the final fsync is short)."""
        assert self._fd is not None, "sink is closed"
        with _fs.naming(self.path):
            length = _fs.pwritev_all(self._fd, pieces, offset)
        _fs.start_writeback(self._fd, offset, length)

    def settle(self) -> None:
        self._flush()  # a gathered run refers to kept buffers

    def _seal(self) -> Path:
        """Write what is buffered and fsync: the temp file is complete and durable. Its flock
        stays held until the file is published or removed (:meth:`_close`): released earlier, a
        cleaner took the sealed file from under the link that publishes it."""
        self._flush()
        assert self._fd is not None and self.path is not None, "sink is closed"
        with _fs.naming(self.path):
            os.fsync(self._fd)
        return self.path

    def publish(self, name: str) -> bool:
        path = self._seal()
        target = self._backend.pack_dir / name
        try:
            os.link(path, target)
        except FileExistsError:
            return False  # open (and locked) still, for replace or abort
        self.abort()  # the temp name goes; the published one stays
        _fs.fsync_dir(self._backend.pack_dir)
        return True

    def replace(self, name: str) -> None:
        path = self._seal()
        os.replace(path, self._backend.pack_dir / name)
        self.path = None
        self._close()
        _fs.fsync_dir(self._backend.pack_dir)
        self._backend.forget(name)

    def _close(self) -> None:
        if self._fd is not None:
            _fs.close_private(self._fd)
            self._fd = None

    def abort(self) -> None:
        """Remove the temp file (if still there), then release its lock and descriptor."""
        if self.path is not None:
            self.path.unlink(missing_ok=True)
            self.path = None
        self._close()


class LocalBackend(Backend):
    """Objects as files in ``<root>/packs`` (a sibling's: ``<root>/<directory>``), named
    ``*<suffix>``; sinks in ``<root>/tmp``."""

    can_mmap = True

    def __init__(
        self, root: str | os.PathLike[str], *, read_only: bool = False, directory: str = "packs",
        suffix: str = SUFFIX,
    ) -> None:
        super().__init__(read_only=read_only)
        self.root = Path(root)
        self.pack_dir = self.root / directory  # where the objects are (packs, unless a sibling)
        self.suffix = suffix
        self.tmp_dir = self.root / "tmp"
        if not read_only:
            _fs.makedirs(_fs.refuse_links(self.root, self.pack_dir))
            _fs.makedirs(_fs.refuse_links(self.root, self.tmp_dir))
        self._lock = threading.RLock()
        self._files = OpenFiles()
        # Each mapping holds a descriptor of its own (mmap duplicates it): as many are kept.
        self._maps: OrderedDict[str, mmap.mmap] = OrderedDict()  # least recently used first
        self._map_limit = open_limit()
        self._copied: list[tuple[mmap.mmap, int, int]] = []  # mapped pages copied out, not yet released
        self._copied_bytes = 0
        self._listed: dict[str, tuple[int, int, float]] = {}  # name -> inode, size, mtime

    def describe(self) -> str:
        return str(self.root)

    def where(self, name: str) -> str:
        return str(self.pack_dir / name)

    # -- listing and reads ---------------------------------------------------------------------
    def list(self) -> list[ObjectInfo]:
        now = time.time()
        found = []
        try:
            with os.scandir(_fs.refuse_links(self.root, self.pack_dir)) as listing:
                entries = list(listing)
        except FileNotFoundError:
            return []
        known, self._listed = self._listed, {}
        for entry in entries:
            if not entry.name.endswith(self.suffix):
                continue
            # A published pack never changes, so its size and mtime are looked up once per
            # file (the inode comes with the directory entry): a save lists packs/ each time.
            seen = known.get(entry.name)
            if seen is None or seen[0] != entry.inode():
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                seen = (st.st_ino, st.st_size, st.st_mtime)
            self._listed[entry.name] = seen
            found.append(ObjectInfo(entry.name, seen[1], now - seen[2]))
        return found

    def list_changes(self, known: AbstractSet[str]) -> tuple[set[str], list[ObjectInfo]]:
        """The names alone from the directory, and a ``stat`` of each name not in ``known``
        (a save looks for new packs each time: with thousands, describing every one took
        milliseconds). A name deleted before its ``stat`` stays among the names, without an
        entry: it tells the caller the listing is already stale."""
        try:
            listing = os.listdir(_fs.refuse_links(self.root, self.pack_dir))
            names = {n for n in listing if n.endswith(self.suffix)}
        except FileNotFoundError:
            return set(), []
        now, new = time.time(), []
        for name in sorted(names - known):
            try:
                st = os.stat(self.pack_dir / name, follow_symlinks=False)
            except FileNotFoundError:  # deleted since the listing
                continue
            self._listed[name] = (st.st_ino, st.st_size, st.st_mtime)
            new.append(ObjectInfo(name, st.st_size, now - st.st_mtime))
        return names, new

    def _open(self, name: str) -> contextlib.AbstractContextManager[int]:
        """The object's descriptor, never closed while the ``with`` block uses it."""
        return self._files.use(name, lambda: open_regular(self.pack_dir / name))

    def read_into(self, name: str, offset: int, out: memoryview) -> bool:
        if out.nbytes >= MAPPED_READ:
            prefault(out)
            if self._copy_mapped(name, offset, out):
                return True
        done = self._pread(name, lambda fd: _fs.pread_into(fd, out, offset))
        if done is None:
            return False
        self._check_length(name, offset, out.nbytes, done)
        return True

    def _copy_mapped(self, name: str, offset: int, out: memoryview) -> bool:
        """Copy out of the object's shared mapping; False where it cannot be mapped or is
        shorter than asked (``pread`` then says why).

        numpy copies without the GIL, so the pool's threads copy at once. 256 MiB read as
        1 MiB chunks on two threads, in a fresh mapping: 71-81 ms, against 115-153 ms by
        ``pread``; checking each chunk's hash as well, 163-183 ms against 225-257 ms. The pages
        copied are unmapped again (they stay in the page cache): a load's resident size stays
        that of what it loads, not twice that.
        """
        mapped = self._mapping(name)
        size = out.nbytes
        if mapped is None or offset + size > len(mapped):
            return False
        np.copyto(np.frombuffer(out, np.uint8), np.frombuffer(mapped, np.uint8, size, offset))
        self._release_later(mapped, offset, offset + size)
        return True

    def copied(self, name: str, start: int, end: int) -> None:
        with self._lock:
            mapped = self._maps.get(name)
        if mapped is not None:
            self._release_later(mapped, start, end)

    def _release_later(self, mapped: mmap.mmap, start: int, end: int) -> None:
        """Unmap the whole pages of bytes ``start`` to ``end``, copied out (``MADV_DONTNEED``;
        they stay in the page cache), once RELEASE_BATCH bytes of them have gathered,
        neighbours in one call.

        A call per chunk cost 10-17 ms of a 255 MiB load on two threads here (each call
        interrupts the other thread's CPU to flush its TLB); one per 16 chunks, 0-6 ms. At most
        RELEASE_BATCH bytes stay mapped after a load, until the next or :meth:`close`.
        """
        start = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE  # whole pages inside the range only
        end = end // mmap.PAGESIZE * mmap.PAGESIZE
        if end <= start:
            return
        with self._lock:
            self._copied.append((mapped, start, end))
            self._copied_bytes += end - start
            if self._copied_bytes < RELEASE_BATCH:
                return
            batch, self._copied, self._copied_bytes = self._copied, [], 0
        _release(batch)

    def read(self, name: str, offset: int, length: int) -> bytes | None:
        data = self._pread(name, lambda fd: os.pread(fd, length, offset))
        if data is not None:
            self._check_length(name, offset, length, len(data))
        return data

    def _pread(self, name: str, read: Callable[[int], T]) -> T | None:
        """``read(fd)`` on the object's descriptor, held open meanwhile; None if it is gone."""
        try:
            with self._open(name) as fd:
                return read(fd)
        except FileNotFoundError:
            return None

    def _check_length(self, name: str, offset: int, asked: int, got: int) -> None:
        if got != asked:
            raise CorruptStore(self.pack_dir / name,
                               f"truncated: {asked} bytes at {offset} asked, the file ends after {got}")

    def map(self, name: str) -> memoryview | None:
        mapped = self._mapping(name)
        return None if mapped is None else memoryview(mapped)

    def _mapping(self, name: str) -> mmap.mmap | None:
        """The object's shared read-only mapping, made once and kept (a bounded number)."""
        with self._lock:
            mapped = self._maps.get(name)
            if mapped is not None:
                self._maps.move_to_end(name)
                return mapped
            try:
                with self._open(name) as fd:
                    mapped = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
            except (FileNotFoundError, ValueError):
                return None
            except OSError as exc:
                if exc.errno == errno.ENOMEM:  # no address space for it (RLIMIT_AS): read instead
                    return None
                raise
            self._maps[name] = mapped
            if len(self._maps) > self._map_limit:
                self._maps.popitem(last=False)  # arrays still viewing it keep it alive
            return mapped

    def map_private(self, name: str, offset: int, length: int) -> memoryview | None:
        start = offset - offset % mmap.ALLOCATIONGRANULARITY  # mmap offsets are page-aligned
        try:
            with self._open(name) as fd:
                mapped = mmap.mmap(fd, length + offset - start, access=mmap.ACCESS_COPY, offset=start)
        except (FileNotFoundError, ValueError):
            return None
        # A mapping of its own (not the shared read-only one): writes to it touch no other view.
        return memoryview(mapped)[offset - start : offset - start + length]

    def forget(self, name: str) -> None:
        with self._lock:
            self._maps.pop(name, None)  # arrays still viewing it keep the mapping alive
        self._files.forget(name)  # a read using the descriptor right now keeps it until done

    def sibling(self, directory: str, suffix: str) -> LocalBackend:
        return LocalBackend(self.root, read_only=self.read_only, directory=directory, suffix=suffix)

    def free_space(self) -> int | None:
        try:
            st = os.statvfs(self.pack_dir)
        except OSError:
            return None
        return st.f_bavail * st.f_frsize

    # -- writes --------------------------------------------------------------------------------
    def create(self) -> LocalSink:
        return LocalSink(self)

    def delete(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.pack_dir / name).unlink()
        self.forget(name)
        _fs.fsync_dir(self.pack_dir)

    def set_aside(self, name: str) -> str | None:
        """Rename a directory, FIFO, link or unreadable file named ``name`` to
        ``<name>.damaged-<UTC time>`` in the same folder (listings skip it: it lacks the suffix)."""
        path = self.pack_dir / name
        try:
            os.close(open_regular(path))
            return None
        except FileNotFoundError:
            return None
        except (CorruptStore, PermissionError):
            pass  # not a readable regular file: ours to move
        aside = _free_name(path, f".damaged-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}")
        os.rename(path, aside)  # one folder, one filesystem: atomic, whatever the entry is
        _fs.fsync_dir(self.pack_dir)
        self.forget(name)
        return str(aside)

    def clean_temp(self, min_age: float) -> int:
        """Remove temp files whose writer is gone (its flock is free), whatever their age, and
        staging files (see :class:`LocalSink`) over :data:`STAGING_AGE` old."""
        removed = 0
        for path in self.tmp_dir.glob(f"*{TEMP_SUFFIX}{STAGING_SUFFIX}"):
            with contextlib.suppress(FileNotFoundError):
                if time.time() - path.lstat().st_mtime > STAGING_AGE:
                    path.unlink()
                    removed += 1
        for path in self.tmp_dir.glob(f"*{TEMP_SUFFIX}"):
            try:
                fd = open_regular(path)
            except (FileNotFoundError, CorruptStore):  # gone, or a planted link or FIFO: not ours
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                    continue  # a live writer holds it
                raise
            finally:
                os.close(fd)
            path.unlink(missing_ok=True)
            removed += 1
        return removed

    def close(self) -> None:
        self._files.close()
        with self._lock:
            batch, self._copied, self._copied_bytes = self._copied, [], 0
            self._maps.clear()  # mappings close when the last array viewing them goes
        _release(batch)


def _free_name(path: Path, suffix: str) -> Path:
    """``path`` with ``suffix`` added, and a count after it if that name is taken."""
    count = 0
    while os.path.lexists(found := path.with_name(f"{path.name}{suffix}{f'-{count}' if count else ''}")):
        count += 1
    return found


def _release(ranges: list[tuple[mmap.mmap, int, int]]) -> None:
    """``MADV_DONTNEED`` these ranges, neighbours in one mapping in one call."""
    merged: list[tuple[mmap.mmap, int, int]] = []
    for mapped, start, end in sorted(ranges, key=lambda r: (id(r[0]), r[1])):
        # What lies between two ranges up to RELEASE_GAP apart is released too: the page that
        # chunks back to back share, the node blocks between runs of small arrays (a call per
        # run was 100 calls, 2 ms, per load of 10,000 small arrays). Dropping pages of a shared
        # read-only file mapping loses nothing: a read re-faults them from the page cache.
        if merged and merged[-1][0] is mapped and merged[-1][2] + RELEASE_GAP >= start:
            merged[-1] = (mapped, merged[-1][1], max(merged[-1][2], end))
        else:
            merged.append((mapped, start, end))
    for mapped, start, end in merged:
        with contextlib.suppress(ValueError):  # closed meanwhile: nothing left mapped to release
            mapped.madvise(mmap.MADV_DONTNEED, start, end - start)
