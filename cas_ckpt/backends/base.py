"""The backend interface: named, immutable objects (packs) on one medium, and nothing more.

A backend stores bytes under names. It knows no CIDs, blocks or indexes: the packed block store
(:mod:`cas_ckpt.blocks.packed`) builds those on top, once for every medium. What each method MUST
do is written on it, as restic's ``internal/backend/backend.go`` does; the conformance suite
:class:`cas_ckpt.testing.BackendTests` checks it. A new medium is one subclass and that suite.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from types import TracebackType
from typing import NamedTuple

from cas_ckpt.errors import CorruptStore


@dataclass(frozen=True)
class ObjectInfo:
    """A published object: its name, size in bytes and age in seconds on the medium's own clock."""

    name: str
    size: int
    age: float


class Read(NamedTuple):
    """One ranged read: ``out.nbytes`` bytes from ``offset`` of ``name``, holding the blocks
    that start at ``starts`` (a cache may keep them)."""

    name: str
    offset: int
    out: memoryview
    starts: list[int]


class Sink(ABC):
    """A new object being written: bytes append in order, then it is published, or aborted.

    Nothing written to a sink is visible under any name until :meth:`publish` returns True.
    """

    @abstractmethod
    def write(self, data: bytes | memoryview, *, keep: bool = False) -> None:
        """Append ``data``. The caller may reuse its buffer as soon as this returns, unless
        ``keep``: then it leaves the bytes unchanged until the sink is published or aborted (or
        settled), and the sink may hold them by reference and write them later."""

    def settle(self) -> None:  # noqa: B027 - only sinks that hold kept writes act here
        """Write out every kept write held by reference: the callers' buffers are free again."""

    @abstractmethod
    def publish(self, name: str) -> bool:
        """Make the object durable, then visible as ``name`` only if no object has that name.

        MUST be atomic: readers see no object or the whole one. Returns False, replacing nothing,
        when ``name`` exists; the sink then stays open for :meth:`replace` or :meth:`abort`.
        """

    @abstractmethod
    def replace(self, name: str) -> None:
        """Durably put this object in place of the existing ``name`` (a repair of a damaged copy).

        MUST be atomic: readers see the old object or the new one, never a mix.
        """

    @abstractmethod
    def abort(self) -> None:
        """Discard what was written. Idempotent; a no-op after publish or replace."""

    def __enter__(self) -> Sink:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.abort()


class Backend(ABC):
    """Objects on a medium (a directory, memory, an S3 prefix), with their capabilities.

    Capabilities the packed store adapts to:

    * ``can_mmap``: :meth:`map` can return a read-only view of an object (loads skip a copy);
    * ``read_coalesce``: bytes one ranged read of neighbouring blocks may span (0: read each block
      on its own; a remote medium wants few large requests);
    * ``publish_in_background``: publishing costs a transfer, so a full pack publishes on a
      thread while the next ones are written, up to ``publish_workers`` at once;
    * ``min_grace``: GC never deletes an object younger than this many seconds (a medium whose
      listing lags, or whose writers cannot be locked out, needs one);
    * ``pack_size``: the size past which a writer starts a new pack;
    * ``cheap_listing``: :meth:`list_changes` costs little however many objects there are (a
      directory: names only), so a store may list every pack at each save; where it is False
      (object storage: a request per thousand objects), a store learns of new packs from index
      files listed in a folder of their own (:meth:`sibling`, :meth:`list_after`).
    """

    can_mmap = False
    pack_size = 256 * 1024 * 1024
    publish_workers = 2
    read_coalesce = 0
    publish_in_background = False
    min_grace = 0.0
    cheap_listing = True

    def __init__(self, *, read_only: bool = False) -> None:
        self.read_only = read_only

    @abstractmethod
    def list(self) -> list[ObjectInfo]:
        """Every published object. MAY lag a publish by another process (the caller re-lists on
        a miss) but MUST include every object this instance published."""

    def list_after(self, start: str) -> list[ObjectInfo]:
        """The published objects whose names sort after ``start`` (byte order), in that order;
        the same contract as :meth:`list`. Object storage asks the server for only those."""
        return sorted((info for info in self.list() if info.name > start), key=lambda info: info.name)

    def list_changes(self, known: AbstractSet[str]) -> tuple[set[str], list[ObjectInfo]]:
        """Every published object's name, and the ``list`` entries of those not in ``known``:
        what a caller that has seen ``known`` needs to catch up (the same contract as ``list``).

        The default lists everything once; a medium that names its objects for less than it
        describes them (a directory: no ``stat`` per file) overrides it. A name not in ``known``
        that has no entry was gone by the time it was described: the listing is stale.
        """
        listing = self.list()
        return {info.name for info in listing}, [info for info in listing if info.name not in known]

    @abstractmethod
    def read_into(self, name: str, offset: int, out: memoryview) -> bool:
        """Fill ``out`` from ``offset`` of ``name``; False if the object does not exist (any more).

        A short read (the object ends before ``out`` is full) MUST raise
        :class:`~cas_ckpt.errors.CorruptStore` naming the object: it is damage, never retried.
        An object that is not a regular object of this medium (say, a FIFO or a directory where
        a file should be) MUST raise CorruptStore too, and never block.
        """

    def read(self, name: str, offset: int, length: int) -> bytes | None:
        """``length`` bytes from ``offset`` of ``name``; None if the object does not exist."""
        out = bytearray(length)
        return bytes(out) if self.read_into(name, offset, memoryview(out)) else None

    def read_many(self, reads: list[Read]) -> list[bool | CorruptStore]:
        """Several ranged reads, in parallel where the medium gains from it.

        Each result is what :meth:`read_into` returned, or the CorruptStore it raised.
        """
        results: list[bool | CorruptStore] = []
        for read in reads:
            try:
                results.append(self.read_into(read.name, read.offset, read.out))
            except CorruptStore as exc:
                results.append(exc)
        return results

    def map(self, name: str) -> memoryview | None:
        """A read-only view of the whole object, if ``can_mmap``; None where it cannot be mapped."""
        return None

    def copied(self, name: str, start: int, end: int) -> None:  # noqa: B027 - optional hook
        """Bytes ``start`` to ``end`` of :meth:`map`'s view of ``name`` were copied out: their
        pages need not stay resident (a load's resident size stays that of what it loads)."""

    def map_private(self, name: str, offset: int, length: int) -> memoryview | None:
        """A writable copy-on-write view of ``length`` bytes at ``offset``, if ``can_mmap``.

        Pages are read on first touch and shared with the page cache until written; writes stay
        in this process, never reach the object. None where it cannot be mapped.
        """
        return None

    def free_space(self) -> int | None:
        """Bytes a new object may take before the medium is full; None if unknown or unbounded."""
        return None

    def sibling(self, directory: str, suffix: str) -> Backend | None:
        """A backend for objects of another kind on this medium, apart from these: the same
        root, bucket or memory, ``directory`` instead of ``packs/``; their names end in
        ``suffix`` (a store keeps its index files and its commit graph there). None where the
        medium keeps nothing but packs (the store then reads every pack's own index).

        Each call with the same ``directory`` MUST see the same objects (a memory backend keeps
        one per directory). Closing a sibling leaves this backend open.
        """
        return None

    def forget(self, name: str) -> None:  # noqa: B027 - optional hook
        """Release what this instance holds for ``name`` (descriptors, caches): it left the store."""

    def discard_cached(self, name: str, offset: int) -> bool:
        """Drop a locally cached copy of the bytes at ``offset`` of ``name`` (they failed their
        hash); True if there was one, so a read again goes to the medium itself."""
        return False

    @abstractmethod
    def create(self) -> Sink:
        """A new, private object to write (a temp file, a spool): see :class:`Sink`."""

    @abstractmethod
    def delete(self, name: str) -> None:
        """Remove ``name`` durably; no error if it is already gone."""

    def set_aside(self, name: str) -> str | None:
        """Move what the medium holds as ``name`` out of the way if it is not a readable object
        (a directory, a FIFO, a link, or a file this process may not read, where an object of
        that name belongs): whole, under a name no listing returns, kept for a person to look
        at; return where it went. None, touching nothing, if ``name`` is a readable object (damage
        in its bytes is for the caller to repair) or absent. Afterwards ``name`` is free.

        A medium that holds nothing but objects under its names (memory, S3: an object's bytes
        can be damaged, never its kind) has nothing to set aside: this default.
        """
        return None

    def clean_temp(self, min_age: float) -> int:
        """Remove leftovers of sinks whose writer died, older than ``min_age`` s; return how many.

        MUST NOT remove a live sink's data.
        """
        return 0

    def where(self, name: str) -> str:
        """How to name the object in a message: a path or a URL."""
        return name

    def describe(self) -> str:
        """The medium, for messages and reprs."""
        return type(self).__name__

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release open descriptors and connections."""

    def __iter__(self) -> Iterator[ObjectInfo]:
        return iter(self.list())
