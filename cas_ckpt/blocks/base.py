"""The block store interface.

A block store maps binary CIDs to immutable bytes. It knows nothing of nodes, trees or refs. Writes go
through a :class:`BlockWriter` (a batch): blocks added to a writer become visible together, and only
once they are durable, when the writer commits. Reads verify each block against its CID unless the
store was opened with ``verify=False``.
"""

from __future__ import annotations

import itertools
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, MutableSet, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, NamedTuple

from multiformats import CID

from cas_ckpt import cid as cidlib
from cas_ckpt.codec import MAX_NODE_SIZE
from cas_ckpt.errors import BlockNotFound, BlockTooLarge, CorruptBlock, RepositoryError

# The raw length of a block (``docs/format.md``, "Block sizes"): no writer makes a larger one, so
# a reader refuses a larger claim before allocating for it. A chunk (codec raw) is at most 1 MiB:
# a repository's chunk_size, FastCDC's maximum and a small array's block all are; a node at most
# the node limit the decoder enforces.
MAX_CHUNK = 1024 * 1024
MAX_BLOCK = max(MAX_CHUNK, MAX_NODE_SIZE)


def size_limit(cid: bytes) -> int:
    """The largest raw length a block of this CID may have."""
    return MAX_NODE_SIZE if cidlib.is_node(cid) else MAX_CHUNK


def check_size(cid: bytes, size: int) -> None:
    """:class:`BlockTooLarge` for a block no reader would accept: it is never stored."""
    limit = size_limit(cid)
    if size > limit:
        raise BlockTooLarge(cidlib.to_str(cid), "node" if cidlib.is_node(cid) else "raw chunk", size, limit)

if TYPE_CHECKING:
    from cas_ckpt.backends.base import Backend


@dataclass
class WriteStats:
    """What one writer did: the figures every save reports."""

    blocks_written: int = 0
    bytes_written: int = 0  # raw bytes of the new blocks
    blocks_reused: int = 0
    bytes_reused: int = 0
    bytes_stored: int = 0  # what the new blocks take on the medium (after compression)

    def add(self, other: WriteStats) -> None:
        self.blocks_written += other.blocks_written
        self.bytes_written += other.bytes_written
        self.blocks_reused += other.blocks_reused
        self.bytes_reused += other.bytes_reused
        self.bytes_stored += other.bytes_stored


class HeldBack(NamedTuple):
    """What a sweep leaves for later because the medium keeps young storage (``min_grace``)."""

    packs: int = 0  # storage units (packs) a sweep would otherwise have deleted, rewritten or merged
    blocks: int = 0  # the blocks being removed that lie in them
    bytes: int = 0  # their stored bytes
    grace: float = 0.0  # the medium's minimum age in seconds (S3: an hour)


@dataclass
class Layout:
    """How a store's blocks lie on its medium: what upkeep decides from and ``stats`` shows."""

    packs: int  # pack files (objects)
    bytes: int  # what they take
    small_packs: int  # packs under the size upkeep and GC merge
    blocks: int  # block copies indexed
    indexed: bool  # the medium keeps index files
    snapshot: str | None  # the newest snapshot this process read or wrote
    uncovered: int  # what an open reads besides the snapshot: packs' own indexes, or journals
    damaged_indexes: int  # index files found damaged (rebuilt from the packs)
    unreadable_indexes: int = 0  # of those, the ones the medium could not read: maybe no file at all
    uncovered_rows: int = 0  # block copies of the packs ``uncovered`` names (what the open reads there)


class Stored(NamedTuple):
    """A block as it goes onto the medium: its codec (``blocks.compression``) and bytes."""

    codec: int
    data: bytes | memoryview


class BlockWriter(ABC):
    """A batch of new blocks, made visible together by :meth:`commit`.

    ``put`` skips blocks the store already has or this batch already holds, and counts them as
    reused. Thread-safe: several threads may ``put`` into one writer. A writer that compresses
    encodes each new block in ``put``, or ahead of it on any thread with ``encode``.
    ``verify_incoming``: the blocks come from elsewhere (another repository), named by CIDs this
    process did not compute: each is hashed before it is written, and one whose bytes do not match
    its CID raises :class:`CorruptBlock` (nothing of that ``put`` or ``put_many`` is written).
    """

    def __init__(self, store: BlockStore, *, verify_incoming: bool = False) -> None:
        self._store = store
        self._lock = threading.Lock()
        self._pending: set[bytes] = set()
        self.stats = WriteStats()
        self.closed = False
        self.verify_incoming = verify_incoming

    compresses = False

    def encode(self, cid: bytes, data: bytes | memoryview, float_size: int = 0) -> Stored | None:
        """The block as it would be stored, or None if it is already stored or nothing would be
        gained (then ``put`` writes it raw). ``float_size``: the element size of a float array's
        bytes. Runs on the caller's thread, outside the writer's lock."""
        return None

    def put(
        self, cid: bytes, data: bytes | memoryview, *, stored: Stored | None = None, keep: bool = False
    ) -> bool:
        """Add a block; return False (and write nothing) if it is already stored.

        ``stored``: its encoding from :meth:`encode`; without one a compressing writer encodes
        it here. ``keep``: the caller leaves ``data`` unchanged until the writer commits,
        aborts or settles, so it may be written by reference later, with its neighbours in one
        call (``bytes`` are always kept: they cannot change).
        """
        size = memoryview(data).nbytes
        if size > MAX_CHUNK:
            check_size(cid, size)
        if self.verify_incoming:
            _check_received([cid], [data])
        if stored is None and self.compresses:
            stored = self.encode(cid, data)
        with self._lock:
            if self.closed:
                raise RepositoryError("block writer is already closed")
            if cid in self._pending or self._stored(cid):
                self.stats.blocks_reused += 1
                self.stats.bytes_reused += size
                return False
            self._pending.add(cid)
            self._append(cid, stored or Stored(0, data), size, keep)
            self.stats.blocks_written += 1
            self.stats.bytes_written += size
            return True

    def put_many(
        self, blocks: list[tuple[bytes, Any, Stored | None]], *, keep: bool = False,
        view: Callable[[Any], bytes | memoryview] = memoryview,
    ) -> int:
        """:meth:`put` for many (cid, data, stored) blocks under one lock; how many were new.

        ``view`` makes a block's bytes of its ``data`` (which has ``nbytes``), for blocks not
        already stored only: an unchanged re-save of 10,000 small arrays made a view of each.
        """
        if self.verify_incoming:  # all at once, on the hashing threads
            _check_received([cid for cid, _, _ in blocks], [view(data) for _, data, _ in blocks])
        if self.compresses:
            blocks = [(c, d, s if s is not None else self.encode(c, view(d))) for c, d, s in blocks]
        new = 0
        with self._lock:
            if self.closed:
                raise RepositoryError("block writer is already closed")
            stats, pending = self.stats, self._pending
            cids = [cid for cid, _, _ in blocks]
            if self._all_stored(cids):  # an unchanged re-save
                stats.blocks_reused += len(blocks)
                stats.bytes_reused += sum(data.nbytes for _, data, _ in blocks)
                return 0
            for (cid, data, stored), known in zip(blocks, self._stored_many(cids), strict=True):
                if cid in pending or known:
                    stats.blocks_reused += 1
                    stats.bytes_reused += data.nbytes
                    continue
                data = view(data)
                size = memoryview(data).nbytes
                if size > MAX_CHUNK:
                    check_size(cid, size)
                pending.add(cid)
                self._append(cid, stored or Stored(0, data), size, keep)
                stats.blocks_written += 1
                stats.bytes_written += size
                new += 1
        return new

    def settle(self) -> None:  # noqa: B027 - a writer that holds no kept blocks has nothing to write
        """Write out the blocks put with ``keep=True`` still held: their buffers are free again."""

    def expect_run(self, nbytes: int) -> None:  # noqa: B027 - a hint stores without files may ignore
        """The next blocks, ``nbytes`` in all, belong together (an array's chunks): a store that
        can map its files keeps them in one, so a load can map the whole array."""

    journal = True  # record the batch in the store's index files at commit (where it keeps them)

    def receipt(self) -> Any:
        """After commit: what :meth:`BlockStore.adopt` in another process needs to take this
        batch's blocks in (picklable). A batch that leaves recording to that process sets
        ``journal = False`` first (the ranks of a DCP save)."""
        return None

    def has(self, cid: bytes) -> bool:
        """True if the block is stored or already in this batch."""
        with self._lock:
            return cid in self._pending or self._stored(cid)

    def has_many(self, cids: list[bytes]) -> list[bool]:
        """:meth:`has` of each of ``cids``, all at once (a remote store asks in batches)."""
        with self._lock:
            return [cid in self._pending or known for cid, known in zip(cids, self._stored_many(cids),
                                                                        strict=True)]

    def _stored(self, cid: bytes) -> bool:
        """Whether ``put`` may reuse the stored copy instead of writing the block."""
        return self._store._has(cid)

    def _all_stored(self, cids: list[bytes]) -> bool:
        """Whether :meth:`_stored` holds for every one of ``cids`` (False may be a guess: the
        caller then asks block by block)."""
        return all(map(self._stored, cids))

    def _stored_many(self, cids: list[bytes]) -> list[bool]:
        """:meth:`_stored` of each of ``cids``."""
        return [self._stored(cid) for cid in cids]

    @abstractmethod
    def _append(self, cid: bytes, stored: Stored, size: int, keep: bool = False) -> None:
        """Write one new block of raw ``size`` bytes into the batch (with the writer's lock held);
        ``keep`` as for :meth:`put`."""

    @abstractmethod
    def commit(self) -> None:
        """Make every block of the batch durable, then visible."""

    @abstractmethod
    def abort(self) -> None:
        """Discard the batch; nothing of it becomes visible."""

    def __enter__(self) -> BlockWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.closed:
            return
        if exc_type is None:
            self.commit()
        else:
            self.abort()


def _check_received(cids: list[bytes], buffers: list[Any]) -> None:
    """:class:`CorruptBlock` naming the first of ``cids`` whose buffer does not hash to it."""
    wrong = cidlib.start_checks(cids, buffers)()
    if wrong:
        raise CorruptBlock(cidlib.to_str(cids[wrong[0]]),
                           "the bytes received for it do not match its hash; they were not stored")


class BlockStore(ABC):
    """Content-addressed block storage.

    Subclasses implement ``_read``, ``_read_into``, ``has``, ``keys``, ``size``, ``delete`` and
    ``writer``; verification and the CID-typed public helpers are written once here.
    """

    # False where asking a block's size costs a request (a remote server): readers that know the
    # sizes from the parent node (an array's chunks) pass those to reads instead, and the reads
    # refuse a block of another size (CorruptBlock), as every store's do.
    sizes_known = True

    def __init__(self, *, verify: bool = True, read_only: bool = False) -> None:
        self.verify = verify
        self.read_only = read_only

    # -- reads ---------------------------------------------------------------------------------
    @abstractmethod
    def _read(self, cid: bytes) -> bytes | None:
        """The stored bytes, or None when absent."""

    def _read_into(self, cid: bytes, out: memoryview) -> bool:
        """Fill ``out`` (exactly the block's size) with the block; False when absent."""
        data = self._read(cid)
        if data is None:
            return False
        if len(data) != out.nbytes:
            raise CorruptBlock(cidlib.to_str(cid), f"size {len(data)} != expected {out.nbytes}")
        out[:] = data
        return True

    def get(self, cid: cidlib.CIDLike, *, verify: bool | None = None) -> bytes:
        """The block's bytes; :class:`BlockNotFound` if absent, :class:`CorruptBlock` if damaged."""
        key = cidlib.to_bytes(cid)
        data = self._read(key)
        if data is None:
            raise BlockNotFound(cidlib.to_str(key), self._missing_hint())
        if (self.verify if verify is None else verify) and not cidlib.matches(key, data):
            raise CorruptBlock(cidlib.to_str(key))
        return data

    def get_into(self, cid: bytes, out: memoryview, *, verify: bool | None = None) -> None:
        """Read a block straight into a caller's buffer (no intermediate copy where possible)."""
        if not self._read_into(cid, out):
            raise BlockNotFound(cidlib.to_str(cid), self._missing_hint())
        if (self.verify if verify is None else verify) and not cidlib.matches(cid, out):
            raise CorruptBlock(cidlib.to_str(cid))

    def get_many_into(
        self, cids: list[bytes], sizes: list[int], out: memoryview, pool: Executor, *,
        verify: bool | None = None,
    ) -> None:
        """Read blocks of these ``sizes`` into consecutive slices of ``out``, in parallel on ``pool``.

        Remote stores override this to fetch blocks that lie back to back in one request.
        """
        offsets = [0, *itertools.accumulate(sizes)]

        def read(i: int) -> None:
            self.get_into(cids[i], out[offsets[i] : offsets[i + 1]], verify=verify)

        if len(cids) == 1:
            read(0)
            return
        for future in [pool.submit(read, i) for i in range(len(cids))]:
            future.result()

    def map_blocks(self, cids: list[bytes], *, private: bool = False) -> memoryview | None:
        """A read-only view of these blocks if they lie back to back in one file, else None.

        ``private``: a writable copy-on-write view instead, whose writes no one else sees.
        Stores that can memory-map (the local pack store) override this; loads then skip the copy.
        """
        return None

    def start_reads(
        self, cids: list[bytes], outs: Sequence[Any], *, verify: bool | None = None
    ) -> Callable[[], None] | None:
        """Start reading blocks into these contiguous buffers (byte views or arrays, each
        exactly its block's size); the function returned waits for them, and raises as
        :meth:`get_into` would. None where this store has no reads that run on their own (then
        :meth:`get_many_into` on a pool): the local pack store copies out of its mappings on
        the compiled pool's threads.
        """
        return None

    def _missing_hint(self) -> str:
        """Extra words for a BlockNotFound message (e.g. damaged files that may have held it)."""
        return ""

    def has(self, cid: cidlib.CIDLike) -> bool:
        """True if the block is stored."""
        return self._has(cidlib.to_bytes(cid))

    def size(self, cid: cidlib.CIDLike) -> int:
        """Stored size of the block; :class:`BlockNotFound` if absent."""
        return self._size(cidlib.to_bytes(cid))

    def sizes(self, cids: list[bytes]) -> list[int]:
        """:meth:`size` of each binary CID; a remote store asks for the unknown ones at once."""
        return [self._size(cid) for cid in cids]

    def stored_size(self, cid: cidlib.CIDLike) -> int:
        """Bytes the block takes on the medium (less than :meth:`size` when compressed)."""
        return self.size(cid)

    @abstractmethod
    def _has(self, cid: bytes) -> bool:
        """``has`` for a binary CID (the per-block hot path skips parsing)."""

    @abstractmethod
    def _size(self, cid: bytes) -> int:
        """``size`` for a binary CID."""

    @abstractmethod
    def keys(self) -> Iterator[bytes]:
        """Binary CIDs of every stored block."""

    def __iter__(self) -> Iterator[CID]:
        return (cidlib.to_cid(key) for key in self.keys())

    def __contains__(self, cid: object) -> bool:
        return self.has(cid)  # type: ignore[arg-type]

    def __len__(self) -> int:
        return sum(1 for _ in self.keys())

    # -- writes --------------------------------------------------------------------------------
    @abstractmethod
    def writer(
        self, *, verify_existing: bool = False, verify_incoming: bool = False, compression: str = "none"
    ) -> BlockWriter:
        """Start a batch of writes.

        ``verify_existing``: before reusing a stored copy of a block, read it back and check its
        hash; a damaged copy is then replaced by the one being written (an import that repairs).
        ``verify_incoming``: hash every block put before writing it (see :class:`BlockWriter`).
        ``compression``: ``"none"`` or ``"zstd"`` (``blocks.compression``); what a block is
        named by never depends on it.
        """

    def put(self, cid: cidlib.CIDLike, data: bytes) -> bool:
        """Store one block durably (a batch of one); False if it was already there."""
        key = cidlib.to_bytes(cid)
        if not cidlib.matches(key, data):
            raise CorruptBlock(cidlib.to_str(key), "refusing to store bytes that do not match")
        with self.writer(verify_existing=True) as w:
            return w.put(key, data)

    @abstractmethod
    def delete(
        self, cids: set[bytes], *, min_age: float = 0.0, before_unlink: Callable[[], None] | None = None
    ) -> tuple[int, int]:
        """Remove these blocks, sparing any stored less than ``min_age`` seconds ago.

        Returns (blocks removed, bytes of storage freed). Only GC calls this, under the
        exclusive repository lock. ``before_unlink`` runs before anything is removed and may
        raise to stop (a GC whose lease on a remote lock was lost).
        """

    def held_back(self, keep: MutableSet[bytes], *, min_age: float = 0.0) -> HeldBack:
        """What :meth:`sweep` of ``keep`` with ``min_age`` would leave because the medium's own
        minimum age keeps the storage holding them (GC reports it; nothing here by default)."""
        return HeldBack()

    def marks(self) -> MutableSet[bytes]:
        """An empty set for GC to mark the blocks it keeps in (a store may keep it compactly)."""
        return set()

    def count_kept(self, keep: MutableSet[bytes]) -> int:
        """How many stored blocks ``keep`` holds."""
        return sum(1 for cid in self.keys() if cid in keep)

    def unkept(self, keep: MutableSet[bytes]) -> tuple[int, int]:
        """(stored blocks not in ``keep``, the bytes they take)."""
        dead = list(self.unkept_cids(keep))
        return len(dead), sum(self.stored_size(cid) for cid in dead)

    def unkept_cids(self, keep: MutableSet[bytes]) -> Iterator[bytes]:
        return (cid for cid in self.keys() if cid not in keep)

    def sweep(
        self, keep: MutableSet[bytes], *, min_age: float = 0.0,
        before_unlink: Callable[[], None] | None = None,
    ) -> tuple[int, int]:
        """Remove every stored block not in ``keep`` (as :meth:`delete`)."""
        return self.delete(set(self.unkept_cids(keep)), min_age=min_age, before_unlink=before_unlink)

    def check_storage(self) -> dict[str, str]:
        """Read every storage unit's own description again (packs' indexes, where an index file
        described them instead): those damaged or disagreeing, and why (fsck)."""
        return self.damaged()

    def damaged(self) -> dict[str, str]:
        """Storage units (packs) found unreadable, and why: reported by fsck, never read from."""
        return {}

    def check_copies(
        self, cids: list[bytes], *, progress: Callable[[int, int], None] | None = None
    ) -> dict[bytes, str]:
        """Re-hash every stored copy of these blocks; return the damaged ones (CID -> why).

        Blocks gone meanwhile (a concurrent GC) are skipped.
        """
        damaged = {}
        for i, cid in enumerate(cids):
            if progress is not None and i % 256 == 0:
                progress(i, len(cids))
            try:
                self.get(cid, verify=True)
            except CorruptBlock as exc:
                damaged[cid] = str(exc)
            except BlockNotFound:
                continue
        return damaged

    def clean_temp(self) -> int:
        """Remove leftovers of writers that died; return how many."""
        return 0

    def sibling(self, directory: str, suffix: str) -> Backend | None:
        """Objects of another kind kept on this store's medium beside its blocks (the commit
        graph's layers), through a backend of their own; None where there is no such place."""
        return None

    def refresh(self, *, full: bool = False, learn: bool = True) -> None:  # noqa: B027 - optional hook
        """Pick up blocks other processes have committed since this store was opened (most
        stores see writes at once). ``full``: look at everything the medium holds, not only
        what an index says changed (GC and fsck ask for it). ``learn=False``: take in only what
        was removed (a batch must never count on it), not what was added."""

    def adopt(self, receipts: Sequence[Any]) -> None:  # noqa: B027 - stores that see writes at once
        """Take in what other processes' writers stored (their :meth:`BlockWriter.receipt`)."""

    format_version = 1  # the repository format version this store's writes need

    def layout(self) -> Layout | None:
        """How the blocks lie on the medium (packs, index files); None for stores without packs."""
        return None

    def merge_small(self) -> tuple[int, int, int]:
        """Merge small storage units (packs), every block kept: (merged, written, bytes copied)."""
        return 0, 0, 0

    def consolidate(self) -> str | None:
        """Write one index of everything the store holds where the medium keeps index files
        (upkeep, and GC after a sweep); the file's name, or None."""
        return None

    def set_aside_damaged(self) -> dict[str, str]:
        """Move index files found damaged that are no readable object at all (a directory, a
        FIFO, a link...) out of the way (:meth:`Backend.set_aside`), so that a consolidation
        can replace them: where each was -> where it went."""
        return {}

    def _check_writable(self) -> None:
        if self.read_only:
            raise RepositoryError("store is read-only")

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release open files."""
