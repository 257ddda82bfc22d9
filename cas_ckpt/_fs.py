"""Durable file primitives: every write path in the local backend goes through these."""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from cas_ckpt.errors import RepositoryError


def fsync_dir(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
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
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
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
