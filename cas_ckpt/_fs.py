"""Durable file primitives: every write path in the local backend goes through these."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import stat
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from cas_ckpt.errors import CorruptStore, RepositoryError

O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_LINK = "is a symbolic link; cas_ckpt never follows links inside a repository"


def refuse_links(root: Path, path: Path) -> Path:
    """Return ``path`` once sure that neither it nor a directory between ``root`` and it is a link.

    Raises :class:`CorruptStore` naming the link. Nothing inside a repository is a link, so one
    found there was planted, and following it would read or write outside the repository.
    Components that do not exist yet are fine.
    """
    current = root
    for part in path.relative_to(root).parts:
        current = current / part
        if current.is_symlink():
            raise CorruptStore(current, _LINK)
    return path


def open_nofollow(path: Path, flags: int, mode: int = 0o644) -> int:
    """``os.open`` that refuses a symbolic link in the last component (:class:`CorruptStore`)."""
    try:
        return os.open(path, flags | O_NOFOLLOW, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise CorruptStore(path, _LINK) from None
        raise


_KINDS = {
    stat.S_IFIFO: "a FIFO",
    stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFLNK: "a symbolic link",
    stat.S_IFDIR: "a directory",
}


def kind(mode: int) -> str:
    """What a non-regular file is, in words."""
    return _KINDS.get(stat.S_IFMT(mode), "not a regular file")


def open_regular(path: Path, flags: int, mode: int = 0o644) -> int:
    """Open ``path`` only if it is a regular file, without following a link.

    A directory raises :class:`IsADirectoryError` (to some callers it means "no such ref": a name
    that is a prefix of others); anything else that is not a regular file :class:`CorruptStore`.
    """
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer (forever, if none comes).
        fd = open_nofollow(path, flags | os.O_NONBLOCK, mode)
    except OSError as exc:
        if exc.errno == errno.ENXIO:  # a socket, or a FIFO opened for writing without a reader
            raise CorruptStore(path, "is not a regular file") from None
        raise
    try:
        st_mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(st_mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
        if not stat.S_ISREG(st_mode):
            raise CorruptStore(path, f"is {kind(st_mode)}, not a regular file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_small(path: Path, limit: int) -> bytes:
    """The bytes of the regular file ``path``; :class:`CorruptStore` if it has over ``limit``."""
    fd = open_regular(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise CorruptStore(path, f"is {size} bytes; the format allows at most {limit}")
        data = b""
        while len(data) <= limit:
            piece = os.read(fd, limit + 1 - len(data))
            if not piece:
                return data
            data += piece
        raise CorruptStore(path, f"grew past {limit} bytes while being read")
    finally:
        os.close(fd)



@contextlib.contextmanager
def naming(path: str | os.PathLike[str] | None) -> Iterator[None]:
    """Name ``path`` in an OSError raised without a file name (write/fsync on a descriptor).

    Disk-full and I/O errors reach the caller as the OSError they are (errno intact), naming the
    file that was being written.
    """
    try:
        yield
    except OSError as exc:
        if exc.filename is None and path is not None:
            exc.filename = os.fspath(path)
        raise


def fsync_dir(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with naming(path):
            os.fsync(fd)
    finally:
        os.close(fd)


def makedirs(path: Path) -> None:
    """``mkdir -p`` that makes each directory it creates durable (fsyncs the parent of each).

    Without it a power cut can drop a new directory, and every file saved in it, after the save
    that made them returned.
    """
    missing = []
    while not path.exists():
        missing.append(path)
        path = path.parent
    for directory in reversed(missing):
        with contextlib.suppress(FileExistsError):  # made concurrently: fsync the parent anyway
            os.mkdir(directory)
        fsync_dir(directory.parent)


_SYNC_FILE_RANGE_WRITE = 2
_libc: Any = None


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start writing this range to disk now, without waiting (Linux only).

    Keeps the final fsync short: the disk works while later blocks are hashed and written,
    instead of all at the end. A no-op where ``sync_file_range`` is unavailable.
    """
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL("libc.so.6", use_errno=True)  # glibc; elsewhere: disabled
            _libc.sync_file_range.argtypes = [
                ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint
            ]
        except (OSError, AttributeError):
            _libc = False
    if _libc:
        _libc.sync_file_range(fd, offset, length, _SYNC_FILE_RANGE_WRITE)  # a hint: errors ignored


def write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data).cast("B")
    while view.nbytes:
        written = os.write(fd, view)
        view = view[written:]


def pwritev_all(fd: int, pieces: list[bytes | memoryview], offset: int) -> int:
    """Write ``pieces`` back to back from ``offset`` (one ``pwritev`` when the kernel takes
    them all, as it does for a regular file); return the bytes written."""
    views = [view for view in (memoryview(p).cast("B") for p in pieces) if view.nbytes]
    total = sum(v.nbytes for v in views)
    done = 0
    while views:
        written = os.pwritev(fd, views, offset + done)
        if not written:
            raise OSError(errno.EIO, "the write made no progress")
        done += written
        while views and written >= views[0].nbytes:
            written -= views.pop(0).nbytes
        if views:
            views[0] = views[0][written:]
    return total


def pread_into(fd: int, out: memoryview, offset: int) -> int:
    """Fill ``out`` from ``offset``; return the bytes read (short only at end of file)."""
    view = out.cast("B") if out.format != "B" or out.ndim != 1 else out
    done = 0
    while done < view.nbytes:
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            break
        done += n
    return done


def temp_name(directory: Path, suffix: str) -> Path:
    return directory / f"{uuid.uuid4().hex}{suffix}"


def atomic_write(path: Path, data: bytes, *, tmp_dir: Path | None = None) -> None:
    """Write ``data`` to ``path`` atomically and durably: temp file, fsync, rename, fsync dir."""
    tmp = temp_name(tmp_dir or path.parent, ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        with naming(tmp):
            write_all(fd, data)
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def create_exclusive(path: Path, data: bytes, *, tmp_dir: Path, durable: bool = True) -> bool:
    """Create ``path`` with ``data`` unless it exists (then return False). Never overwrites.

    The file appears whole (a complete temp file is linked into place), so a reader never sees it
    empty or half written. ``durable`` also fsyncs the data and the directory entry.
    """
    tmp = temp_name(tmp_dir, ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        try:
            with naming(tmp):
                write_all(fd, data)
                if durable:
                    os.fsync(fd)
        finally:
            os.close(fd)
        os.link(tmp, path)
        created = True
    except FileExistsError:
        created = False
    finally:
        tmp.unlink(missing_ok=True)
    if created and durable:
        fsync_dir(path.parent)
    return created


# -- descriptors that hold locks, never handed down to a forked child ---------------------------
# A flock belongs to the open file description, and a fork shares it: a child (a DataLoader
# worker, any multiprocessing "fork" child) that outlives its parent would hold the parent's
# lease, GC lock or ref lock for as long as it lives. Such descriptors are recorded here and closed
# in the child right after a fork. Closing the child's copy drops only the child's claim (the lock
# goes when no descriptor of the description is left); unlocking there would drop the parent's.
# The record is kept under a lock that a fork holds too, so none is opened or closed unrecorded.
_PRIVATE: set[int] = set()
_RECORDING = threading.Lock()


def open_private(path: Path, flags: int, mode: int = 0o644) -> int:
    """:func:`open_nofollow`, for a descriptor that will hold a lock: closed in forked children."""
    with _RECORDING:
        fd = open_nofollow(path, flags, mode)
        _PRIVATE.add(fd)
    return fd


def dup_private(fd: int) -> int:
    """``os.dup`` of a lock's descriptor, closed in forked children as well."""
    with _RECORDING:
        copy = os.dup(fd)
        _PRIVATE.add(copy)
    return copy


def close_private(fd: int) -> None:
    """Close a descriptor from :func:`open_private` or :func:`dup_private`."""
    with _RECORDING:
        _PRIVATE.discard(fd)
        os.close(fd)


def _close_private_in_child() -> None:
    for fd in _PRIVATE:
        with contextlib.suppress(OSError):
            os.close(fd)
    _PRIVATE.clear()
    _RECORDING.release()  # taken by the thread that forked, which is this one


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_RECORDING.acquire, after_in_parent=_RECORDING.release,
                        after_in_child=_close_private_in_child)


@contextlib.contextmanager
def flocked(
    path: Path, *, exclusive: bool, blocking: bool = True, timeout: float | None = None
) -> Iterator[bool]:
    """Hold an advisory ``flock`` on the regular file ``path`` (created if missing).

    The kernel drops the lock when its holder closes the file or dies (SIGKILL included), so no
    pid, host name or clock is ever judged. ``flock`` belongs to the open file description: two
    threads of one process exclude each other as two processes do, also across pid namespaces
    sharing a kernel. Yields False (holding nothing) when ``blocking`` is False and the lock is
    taken, or when it stayed taken for ``timeout`` seconds. :class:`CorruptStore` if ``path`` is
    not a regular file (a FIFO, a directory, a link).
    """
    fd = _lock(path, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH, blocking, timeout)
    if fd is None:
        yield False
        return
    if fd == _NO_LOCK_FILE:
        yield True  # a reader on a medium it cannot write, where no lock file exists to share
        return
    try:
        yield True
    finally:
        # Unlock before closing: a child forked meanwhile shares the file description, and its
        # copy of the descriptor would otherwise keep the lock held for as long as it lives.
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)
        close_private(fd)


def try_lock(path: Path) -> int | None:
    """An exclusive ``flock`` on ``path`` held by the returned descriptor, or None if it is taken.

    For a lock held longer than a ``with`` block (a lease); :func:`unlock` gives it back.
    """
    return _lock(path, fcntl.LOCK_EX, False, None)


def unlock(fd: int) -> None:
    """Release a lock from :func:`try_lock` (before closing: see :func:`flocked`)."""
    with contextlib.suppress(OSError):
        fcntl.flock(fd, fcntl.LOCK_UN)
    close_private(fd)


def still_names(path: Path, fd: int) -> bool:
    """True if ``path`` still names the file open as ``fd`` (False once replaced or removed)."""
    return _names(path, fd)


_NO_LOCK_FILE = -1  # _lock: a shared lock needs no file where none exists and none can be made


def _lock(path: Path, mode: int, blocking: bool, timeout: float | None) -> int | None:
    """A descriptor of ``path`` holding the lock, or None if it could not be had in time.

    A shared lock (a reader's) on a medium this process cannot write (a read-only mount, a
    repository another user owns) locks the file opened read-only: ``flock`` needs no write
    access. Where the file is missing there and cannot be made, it is :data:`_NO_LOCK_FILE`.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        fd = _open_lock_file(path, read_only_ok=mode == fcntl.LOCK_SH)
        if fd is None:
            return _NO_LOCK_FILE
        try:
            if blocking and deadline is None:
                got = _flock(fd, mode, path)
            else:
                got = _flock(fd, mode | fcntl.LOCK_NB, path)
                if not got and blocking and deadline is not None:
                    got = _flock_within(fd, mode, path, deadline - time.monotonic())
            if not got:
                close_private(fd)
                return None
            if _names(path, fd):
                return fd
        except BaseException:
            close_private(fd)
            raise
        # The file was removed or replaced while we waited: its lock excludes no one who opens
        # the path now. Lock the file the path names.
        close_private(fd)


def _flock(fd: int, mode: int, path: Path) -> bool:
    try:
        fcntl.flock(fd, mode)
    except BlockingIOError:
        return False
    except OSError as exc:  # ENOLCK: e.g. NFSv3 mounted without a lock manager
        raise RepositoryError(f"cannot lock {path}: {exc}") from exc
    return True


def _flock_within(fd: int, mode: int, path: Path, timeout: float) -> bool:
    """A blocking flock given up after ``timeout`` s; flock has no timeout, so a thread waits.

    Blocked in the kernel, the waiter is woken when the lock frees (polling would mostly miss a
    holder that locks again at once). It locks through a duplicate of ``fd`` (one open file
    description, so one lock); if it gets the lock after we gave up, it unlocks at once.
    """
    dup = dup_private(fd)
    done = threading.Event()
    mutex = threading.Lock()
    state: dict[str, Any] = {"abandoned": False, "error": None}

    def wait() -> None:
        try:
            _flock(dup, mode, path)
        except RepositoryError as exc:
            state["error"] = exc
        with mutex:
            if state["abandoned"] and state["error"] is None:
                fcntl.flock(dup, fcntl.LOCK_UN)
            done.set()
        close_private(dup)

    threading.Thread(target=wait, name=f"cas_ckpt-flock-{path.name}", daemon=True).start()
    done.wait(max(timeout, 0.0))
    with mutex:
        if not done.is_set():
            state["abandoned"] = True
            return False
    if state["error"] is not None:
        raise state["error"]
    return True


def _open_lock_file(path: Path, *, read_only_ok: bool = False) -> int | None:
    try:
        # O_NONBLOCK: opening a FIFO planted there must not wait for a writer.
        fd = open_private(path, os.O_RDWR | os.O_CREAT | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno in (errno.EISDIR, errno.ENXIO):  # a directory; a socket
            raise CorruptStore(path, "lock file is not a regular file") from None
        if exc.errno == errno.ENOTDIR:
            raise CorruptStore(path.parent, "is not a directory") from None
        if not (read_only_ok and exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM)):
            raise
        try:
            fd = open_nofollow(path, os.O_RDONLY | os.O_NONBLOCK)
        except FileNotFoundError:
            return None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        close_private(fd)
        raise CorruptStore(path, "lock file is not a regular file")
    return fd


def _names(path: Path, fd: int) -> bool:
    """True if ``path`` still names the file open as ``fd``."""
    try:
        named = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (named.st_dev, named.st_ino) == (mine.st_dev, mine.st_ino)
