"""Durable file primitives: every write path in the local backend goes through these."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import socket
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


def read_bytes(path: Path) -> bytes:
    """A whole file's bytes, refusing a symbolic link (:class:`CorruptStore`)."""
    with os.fdopen(open_nofollow(path, os.O_RDONLY), "rb") as f:
        return f.read()


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


def lock_holder_text() -> bytes:
    return f"{os.getpid()} {socket.gethostname()} {time.time():.3f} {uuid.uuid4().hex}\n".encode()


def _boot_time() -> float | None:
    try:
        with open("/proc/stat", "rb") as f:
            for line in f:
                if line.startswith(b"btime "):
                    return float(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def holder_is_dead(text: str) -> bool:
    """True only when the lock's holder was a process on this host that no longer exists.

    That includes a holder that started before the last boot (its pid may have been reused since).
    A holder on another host, or text that names no holder, is never judged dead here.
    """
    parts = text.split()
    if len(parts) < 2 or parts[1] != socket.gethostname() or not parts[0].isdigit():
        return False
    boot = _boot_time()
    try:
        if boot is not None and len(parts) > 2 and float(parts[2]) < boot:
            return True
    except ValueError:
        pass
    try:
        os.kill(int(parts[0]), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError):
        return False
    return False


EMPTY_LOCK_AGE = 2.0


def lock_is_stale(path: Path, text: str) -> bool:
    """True when the lock file ``path`` (holding ``text``) cannot belong to a live writer.

    Locks are created whole (:func:`create_exclusive`), so a live holder's lock is never empty: an
    empty one (or one of zero bytes) is what a power cut leaves of a lock whose bytes never reached
    the disk. The age check only spares a writer of an older cas_ckpt, which created the lock first
    and wrote its holder line after.
    """
    if text.strip("\x00 \t\r\n"):
        return holder_is_dead(text)
    try:
        age = time.time() - os.stat(path).st_mtime
    except OSError:
        return False
    return age > EMPTY_LOCK_AGE


@contextlib.contextmanager
def flocked(path: Path, *, exclusive: bool, blocking: bool = True) -> Iterator[bool]:
    """Hold an advisory ``flock`` on ``path``; the kernel drops it if the process dies.

    Yields False (holding nothing) when ``blocking`` is False and the lock is taken.
    """
    fd = open_nofollow(path, os.O_RDWR | os.O_CREAT)
    try:
        mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
        try:
            fcntl.flock(fd, mode if blocking else mode | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        except OSError as exc:
            raise RepositoryError(f"cannot lock {path}: {exc}") from exc
        yield True
    finally:
        os.close(fd)
