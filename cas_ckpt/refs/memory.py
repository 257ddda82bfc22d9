"""Refs in memory, for throwaway repositories and tests."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

from cas_ckpt.refs.base import ReflogEntry, RefStore, check_clash, check_ref_name


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
                check_clash(name, self._refs)
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


