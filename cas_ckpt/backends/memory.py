"""Objects in a dict: for throwaway repositories and tests. Nothing survives the process."""

from __future__ import annotations

import threading
import time

from cas_ckpt.backends.base import Backend, ObjectInfo, Sink
from cas_ckpt.errors import CorruptStore


class MemorySink(Sink):
    def __init__(self, backend: MemoryBackend) -> None:
        self._backend = backend
        self._data: bytearray | None = bytearray()

    def write(self, data: bytes | memoryview, *, keep: bool = False) -> None:
        assert self._data is not None, "sink is closed"
        self._data += data  # a copy: the caller may reuse its buffer

    def publish(self, name: str) -> bool:
        assert self._data is not None, "sink is closed"
        with self._backend._lock:
            if name in self._backend.objects:
                return False
            self._backend.objects[name] = (bytes(self._data), time.time())
        self._data = None
        return True

    def replace(self, name: str) -> None:
        assert self._data is not None, "sink is closed"
        with self._backend._lock:
            self._backend.objects[name] = (bytes(self._data), time.time())
        self._data = None

    def abort(self) -> None:
        self._data = None


class MemoryBackend(Backend):
    """Objects as bytes in a dict (name -> (bytes, creation time)), guarded by one lock."""

    def __init__(self, folder: str = "") -> None:
        super().__init__()
        self.objects: dict[str, tuple[bytes, float]] = {}
        self._lock = threading.Lock()
        self.folder = folder
        self._siblings: dict[str, MemoryBackend] = {}

    def describe(self) -> str:
        return "memory://"

    def where(self, name: str) -> str:
        return f"memory://{self.folder}{name}"

    def list(self) -> list[ObjectInfo]:
        now = time.time()
        with self._lock:
            return [ObjectInfo(name, len(data), now - t) for name, (data, t) in self.objects.items()]

    def read_into(self, name: str, offset: int, out: memoryview) -> bool:
        found = self.objects.get(name)
        if found is None:
            return False
        data = found[0]
        if offset + out.nbytes > len(data):
            raise CorruptStore(self.where(name), f"truncated: {out.nbytes} bytes at {offset} asked, "
                                                 f"the object has {len(data)}")
        out.cast("B")[:] = memoryview(data)[offset : offset + out.nbytes]
        return True

    def sibling(self, directory: str, suffix: str) -> MemoryBackend:
        with self._lock:
            return self._siblings.setdefault(directory, MemoryBackend(f"{directory}/"))

    def create(self) -> MemorySink:
        return MemorySink(self)

    def delete(self, name: str) -> None:
        with self._lock:
            self.objects.pop(name, None)
