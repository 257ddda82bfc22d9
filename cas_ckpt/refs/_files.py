"""Reading a local ref store's small files defensively: regular files only, bounded by the format.

A FIFO would hang an open, a 4 GiB sparse file would exhaust memory, JSON nested 200,000 deep
would exhaust the stack: each is a :class:`CorruptStore` naming the file instead.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from cas_ckpt import _fs
from cas_ckpt.errors import CorruptStore

MAX_REF_BYTES = 256  # a ref file is one CID in base32 (about 60 characters) and a newline
MAX_CONFIG_BYTES = 1 << 20  # config.json is a few lines
MAX_REFLOG_LINE = 64 << 10  # two CIDs, a time and a message of at most MAX_MESSAGE characters
MAX_MESSAGE = 4096  # reflog messages are cut to this: escaped, at most 12 bytes a character
_PIECE = 64 << 10

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
        fd = _fs.open_nofollow(path, flags | os.O_NONBLOCK, mode)
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


def lines(fd: int, path: Path, limit: int = MAX_REFLOG_LINE) -> Iterator[bytes]:
    """The lines of an open file, each with its newline (the last may lack one), read in pieces.

    :class:`CorruptStore` on a line longer than ``limit``: no line the format allows is.
    """
    pending = b""
    number = 1
    while piece := os.read(fd, _PIECE):
        pending += piece
        start = 0
        while (end := pending.find(b"\n", start)) >= 0:
            yield pending[start : end + 1]
            start, number = end + 1, number + 1
        pending = pending[start:]
        if len(pending) > limit:
            raise CorruptStore(path, f"line {number} is over {limit} bytes long")
    if pending:
        yield pending


def whole_lines_length(fd: int, path: Path, limit: int = MAX_REFLOG_LINE) -> int:
    """The length of the file up to and including its last newline.

    Only an append cut short leaves bytes after it, and never more than one line's worth:
    :class:`CorruptStore` rather than truncating what a torn append cannot have left.
    """
    size = os.fstat(fd).st_size
    if size == 0 or os.pread(fd, 1, size - 1) == b"\n":
        return size
    start = max(0, size - limit - 1)
    newline = os.pread(fd, size - start, start).rfind(b"\n")
    if newline >= 0:
        return start + newline + 1
    if start == 0:
        return 0  # a first line, torn
    raise CorruptStore(path, f"ends in over {limit} bytes without a newline: not a torn line")


def parse_json(text: str, path: Path) -> Any:
    """``json.loads``, with :class:`CorruptStore` naming ``path`` for text that is not JSON."""
    try:
        return json.loads(text)
    except ValueError as exc:
        raise CorruptStore(path, f"not valid JSON: {exc}") from None
    except RecursionError:
        raise CorruptStore(path, "not valid JSON: nested too deeply") from None
