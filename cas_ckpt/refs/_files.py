"""Reading a local ref store's files defensively: bounded by what the format allows.

A 4 GiB sparse file would exhaust memory, JSON nested 200,000 deep would exhaust the stack: each is
a :class:`CorruptStore` naming the file instead. Regular files only: ``_fs.open_regular``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from cas_ckpt.errors import CorruptStore

MAX_REF_BYTES = 256  # a ref file is one CID in base32 (about 60 characters) and a newline
MAX_CONFIG_BYTES = 1 << 20  # config.json is a few lines
MAX_REFLOG_LINE = 64 << 10  # two CIDs, a time and a message of at most MAX_MESSAGE characters
MAX_MESSAGE = 4096  # reflog messages are cut to this: escaped, at most 12 bytes a character
_PIECE = 64 << 10


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
