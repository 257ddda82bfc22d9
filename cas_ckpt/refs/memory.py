"""Refs in memory, for throwaway repositories and tests."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

from cas_ckpt.errors import LeaseHeld
from cas_ckpt.refs.base import (
    Lease,
    ReflogEntry,
    RefStore,
    check_clash,
    check_ref_name,
    describe_holder,
    holder_info,
)


class MemoryRefStore(RefStore):
    """Refs in dicts, guarded by one lock."""

    def __init__(self) -> None:
        self._refs: dict[str, bytes] = {}
        self._logs: dict[str, list[ReflogEntry]] = {}
        self._pins: set[bytes] = set()
        self._config: dict[str, Any] | None = None
        self._mutex = threading.Lock()
        self._rw = _SharedExclusive()
        self._leases: dict[str, _MemoryLease] = {}

    def get(self, name: str) -> bytes | None:
        return self._refs.get(check_ref_name(name))

    def _swap(self, name: str, check: Any, new: bytes | None, message: str) -> bool:
        with self._mutex:
            current = self._refs.get(name)
            if not check(current):
                return False
            if current is None and new is not None:
                check_clash(name, self._refs)
            self._logs.setdefault(name, []).append(ReflogEntry(current, new, time.time(), message))
            if new is None:
                del self._refs[name]
            else:
                self._refs[name] = new
            return True

    def names(self, prefix: str = "") -> list[str]:
        return sorted(name for name in self._refs if name.startswith(prefix))

    def values(self, prefix: str = "") -> dict[str, bytes]:
        return {name: self._refs[name] for name in self.names(prefix) if name in self._refs}

    def reflog(self, name: str) -> list[ReflogEntry]:
        return list(self._logs.get(check_ref_name(name), []))

    def reflog_names(self) -> list[str]:
        return sorted(self._logs)

    def drop_reflog(self, name: str, *, older_than: float | None = None) -> bool:
        with self._mutex:
            entries = self._logs.get(check_ref_name(name))
            if name in self._refs or not entries:
                return False
            if older_than is not None and max(e.time for e in entries) >= older_than:
                return False
            del self._logs[name]
            return True

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

    def update_config(self, old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
        with self._mutex:
            if self._config == old:
                self._config = dict(new)
            return dict(self._config or {})

    def lock(self, *, exclusive: bool) -> contextlib.AbstractContextManager[None]:
        return self._rw.hold(exclusive)

    def lease(self, name: str, *, takeover: bool = False) -> Lease:
        check_ref_name(name)
        with self._mutex:
            current = self._leases.get(name)
            if current is not None and current.held() and not takeover:
                raise LeaseHeld(name, describe_holder(current.info))
            lease = self._leases[name] = _MemoryLease(self, name)
            return lease


class _MemoryLease(Lease):
    """Held while it is the store's lease of its ref."""

    def __init__(self, store: MemoryRefStore, name: str) -> None:
        self.store, self.name, self.info = store, name, holder_info()

    def held(self) -> bool:
        return self.store._leases.get(self.name) is self

    def release(self) -> None:
        with self.store._mutex:
            if self.held():
                del self.store._leases[self.name]


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


