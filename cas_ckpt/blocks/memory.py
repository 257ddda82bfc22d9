"""An in-memory block store, for tests and throwaway repositories."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

from cas_ckpt import cid as cidlib
from cas_ckpt.blocks.base import BlockStore, BlockWriter
from cas_ckpt.errors import BlockNotFound


class _MemoryWriter(BlockWriter):
    def __init__(self, store: MemoryStore) -> None:
        super().__init__(store)
        self._memory = store
        self._blocks: dict[bytes, bytes] = {}

    def _append(self, cid: bytes, data: bytes | memoryview) -> None:
        self._blocks[cid] = bytes(data)  # copy: the caller may reuse its buffer

    def commit(self) -> None:
        now = time.time()
        with self._memory._lock:
            for cid, data in self._blocks.items():
                if cid not in self._memory._blocks:
                    self._memory._blocks[cid] = data
                    self._memory._times[cid] = now
        self._blocks = {}
        self.closed = True

    def abort(self) -> None:
        self._blocks = {}
        self.closed = True


class MemoryStore(BlockStore):
    """Blocks in a dict. Thread-safe; nothing survives the process."""

    def __init__(self, *, verify: bool = True) -> None:
        super().__init__(verify=verify)
        self._blocks: dict[bytes, bytes] = {}
        self._times: dict[bytes, float] = {}
        self._lock = threading.Lock()

    def _read(self, cid: bytes) -> bytes | None:
        return self._blocks.get(cid)

    def _has(self, cid: bytes) -> bool:
        return cid in self._blocks

    def _size(self, cid: bytes) -> int:
        try:
            return len(self._blocks[cid])
        except KeyError:
            raise BlockNotFound(cidlib.to_str(cid)) from None

    def keys(self) -> Iterator[bytes]:
        with self._lock:
            return iter(list(self._blocks))

    def writer(self) -> BlockWriter:
        return _MemoryWriter(self)

    def delete(self, cids: set[bytes], *, min_age: float = 0.0) -> tuple[int, int]:
        removed = freed = 0
        cutoff = time.time() - min_age
        with self._lock:
            for cid in cids:
                if cid in self._blocks and self._times[cid] <= cutoff:
                    freed += len(self._blocks.pop(cid))
                    del self._times[cid]
                    removed += 1
        return removed, freed
