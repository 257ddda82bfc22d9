"""Descriptors kept open for reuse, a bounded number at once.

A backend reads each pack through one descriptor, opened once. Keeping one per pack for the life
of the process ran out of descriptors: a repository with more packs than ``ulimit -n`` (1024 on
many systems) could not even be opened, its index being read from every pack. :class:`OpenFiles`
keeps at most ``limit`` descriptors (by default :func:`open_limit`), closing the least recently
used first, and never closes one under a read or write that is using it: closing it could hand
its number to another file in the middle of that call (a pread would return, a pwrite would
change, another file's bytes).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator


def open_limit() -> int:
    """How many descriptors (and as many mappings) one backend keeps open for reuse: an eighth
    of the process's soft ``RLIMIT_NOFILE``, between 8 and 512, read when the backend is made."""
    try:
        import resource
    except ImportError:  # not a POSIX system
        return 64
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return 512
    return max(8, min(512, soft // 8))


class _Open:
    __slots__ = ("fd", "retired", "users")

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.users = 0  # calls using the descriptor right now
        self.retired = False  # no longer kept: closed when its last user is done


class OpenFiles:
    """Descriptors by name, opened by ``opener`` on first use, at most ``limit`` kept open.

    ``with files.use(name, opener) as fd`` holds the descriptor open for the ``with`` block, even
    if it is evicted, forgotten or the whole set is closed meanwhile: it closes when its last user
    is done. Thread-safe.
    """

    def __init__(self, limit: int | None = None) -> None:
        if limit is not None and limit < 1:
            raise ValueError("limit must be at least 1")
        self.limit = open_limit() if limit is None else limit
        self._lock = threading.Lock()
        self._kept: OrderedDict[str, _Open] = OrderedDict()  # least recently used first

    def __len__(self) -> int:
        with self._lock:
            return len(self._kept)

    @contextlib.contextmanager
    def use(self, name: str, opener: Callable[[], int]) -> Iterator[int]:
        """The descriptor of ``name``, held open while the block runs; ``opener``'s errors
        (e.g. FileNotFoundError) come out of the ``with``."""
        with self._lock:
            entry = self._kept.get(name)
            if entry is None:
                entry = self._kept[name] = _Open(opener())
                while len(self._kept) > self.limit:
                    self._retire(self._kept.popitem(last=False)[1])
            else:
                self._kept.move_to_end(name)
            entry.users += 1
        try:
            yield entry.fd
        finally:
            with self._lock:
                entry.users -= 1
                if entry.retired and not entry.users:
                    os.close(entry.fd)

    def forget(self, name: str) -> None:
        """Stop keeping the descriptor of ``name`` (its file went away or was replaced)."""
        with self._lock:
            entry = self._kept.pop(name, None)
            if entry is not None:
                self._retire(entry)

    def close(self) -> None:
        """Close every kept descriptor (those in use when their users are done)."""
        with self._lock:
            for entry in self._kept.values():
                self._retire(entry)
            self._kept.clear()

    @staticmethod
    def _retire(entry: _Open) -> None:
        entry.retired = True
        if not entry.users:
            os.close(entry.fd)
