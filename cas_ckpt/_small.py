"""Many small arrays: one raw block each, hashed and read in batches.

An array of at most ``INLINE_LIMIT`` bytes is normally stored inline in its parent's node. In a
container whose inline arrays hold more than ``SMALL_SPLIT`` bytes (10,000 small tensors, 100 to a
dict), that made every node ~850 KiB, so a change to one tensor in ten rewrote all of them. There
the arrays above ``TINY_LIMIT`` are stored as ordinary one-chunk arrays instead: their own raw
block each, found again by a re-save that leaves them alone. Hashing one block per pool task, and
reading one per task, cost more in Python than the hashing itself, so both go in batches; a batch
is hashed on the saving thread as it is written (see :func:`give_blocks`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import Executor, Future
from typing import Any

import msgpack

from cas_ckpt import cid as cidlib
from cas_ckpt import codec
from cas_ckpt.blocks.base import BlockStore, BlockWriter, Stored
from cas_ckpt.errors import CorruptBlock

TINY_LIMIT = 1024  # arrays up to this size stay inline even among many small ones
SMALL_SPLIT = 64 * 1024  # inline array bytes in one container above which they get blocks
BATCH_BYTES = 512 * 1024  # bytes of small arrays hashed (or read) by one pool task


Digest = tuple[bytes, "Stored | None"]  # a block's CID, and its encoding for a compressing writer

class SmallArray:
    """An array small enough to be inline: stays so, or (``batch`` set) becomes one block."""

    __slots__ = ("batch", "data", "header", "index")

    def __init__(self, header: dict[str, Any], data: memoryview) -> None:
        self.header = header
        self.data = data  # a view of the array: keeps it alive, no copy
        self.batch: _Batch | None = None  # the batch hashing this array's block
        self.index = 0  # this array's place in that batch

    def cid(self) -> bytes:
        """The CID of this array's block (waits for its batch to be hashed)."""
        return self._digest()[0]

    def put_batch(self, writer: BlockWriter) -> None:
        """Put the blocks of this array's whole batch, once, in one call (they are written
        together, in order: one container's arrays)."""
        batch = self.batch
        assert batch is not None, "not given a block"
        if not batch.written:
            blocks = [(cid, data, stored) for (cid, stored), data in zip(batch.results(), batch.data,
                                                                        strict=True)]
            writer.put_many(blocks, keep=True)
            batch.written = True

    def _digest(self) -> Digest:
        assert self.batch is not None, "not given a block"
        return self.batch.results()[self.index]

    def inline(self) -> dict[str, Any]:
        """The ndarray map with the bytes inline (the layout of cas_ckpt 0.1 and 0.2)."""
        return {**self.header, "data": self.data}


def give_blocks(
    items: Iterable[Any], digest: Callable[[memoryview, dict[str, Any]], Digest], chunk_size: int,
    pool: Executor | None = None,
) -> bool:
    """If the small arrays among ``items`` hold more than ``SMALL_SPLIT`` bytes, give each of
    them a block of its own and return True: their container then gets a node of its own,
    however small (a sub-tree load reads it alone, not its parent's other children with it).

    The blocks are hashed (``digest(data, header)``: the CID, and the encoding for a compressing
    writer) in batches of about ``BATCH_BYTES``: on ``pool`` from now on if one is given, else
    each on the saving thread when it is written. Hashing a small block takes about 5 us, less
    than handing the GIL to a pool thread and back, and a pool thread hashing beside a busy
    saving thread gets the GIL once per switch interval (5 ms): only a compressing writer, whose
    encoding takes ten times longer outside the GIL, gains from the pool.

    An array larger than ``chunk_size`` (a repository cutting chunks below 16 KiB) stays inline:
    one chunk must not be larger than the chunk size its array records.
    """
    small = [x for x in items if type(x) is SmallArray]
    if not small or sum(x.data.nbytes for x in small) <= SMALL_SPLIT:
        return False
    batch: list[SmallArray] = []
    size = 0
    for item in small:
        if item.data.nbytes > chunk_size:
            continue
        batch.append(item)
        size += item.data.nbytes
        if size >= BATCH_BYTES:
            _Batch(batch, digest, pool)
            batch, size = [], 0
    if batch:
        _Batch(batch, digest, pool)
    return True


class _Batch:
    """The CIDs (and encodings) of a batch of small arrays, hashed on a pool or when needed."""

    __slots__ = ("_digest", "_future", "_results", "data", "headers", "written")

    def __init__(self, arrays: list[SmallArray], digest: Callable[[memoryview, dict[str, Any]], Digest],
                 pool: Executor | None) -> None:
        self.data = [x.data for x in arrays]  # each array's bytes, in order
        self.headers = [x.header for x in arrays]
        self.written = False  # all its blocks put (by the first of its arrays to be written)
        self._digest = digest
        self._results: list[Digest] | None = None
        self._future = None if pool is None else pool.submit(self._digest_all)
        for i, array in enumerate(arrays):
            array.batch, array.index = self, i

    def results(self) -> list[Digest]:
        if self._results is None:  # one wait (or one hashing run) per batch, not one per array
            self._results = self._digest_all() if self._future is None else self._future.result()
        return self._results

    def cancel(self) -> None:
        if self._future is not None:
            self._future.cancel()

    def _digest_all(self) -> list[Digest]:
        digest = self._digest
        return [digest(data, header) for data, header in zip(self.data, self.headers, strict=True)]


def one_chunk_array(
    code: int, header: dict[str, Any], chunk_size: int, cid: bytes, packer: msgpack.Packer
) -> bytes:
    """The encoding of ext ``code`` holding ``header`` plus ``chunk_size`` and one chunk link.

    Byte for byte ``codec.encode(Tagged(code, {**header, "chunk_size": chunk_size,
    "chunks": [Link(cid)]}))``, without a Python callback or an ``ExtType`` per array: the usual
    header (dtype, then shape) from encodings kept per dtype and chunk size, any other packed by
    the writer's ``packer`` and given one entry more.
    """
    name = header.get("dtype")
    if len(header) == 2 and type(name) is str and "shape" in header and next(iter(header)) == "dtype":
        around = _AROUND_SHAPE.get((name, chunk_size))
        if around is None:
            around = _around_shape(name, chunk_size, packer)
        body = b"".join((around[0], packer.pack(header["shape"]), around[1], codec.link(cid)))
        return codec.ext(code, body)
    head = packer.pack({**header, "chunk_size": chunk_size})
    if not 0x80 <= head[0] < 0x8F:  # not a fixmap with room for one more entry: never for ours
        raise ValueError(f"ndarray header of {len(header)} entries")
    return codec.ext(code, b"".join((bytes((head[0] + 1,)), head[1:], _CHUNKS_ONE, codec.link(cid))))


def _around_shape(name: str, chunk_size: int, packer: msgpack.Packer) -> tuple[bytes, bytes]:
    """The encoding of a one-chunk ndarray map before its shape, and after it up to the link."""
    before = b"\x84" + packer.pack("dtype") + packer.pack(name) + packer.pack("shape")
    after = packer.pack("chunk_size") + packer.pack(chunk_size) + _CHUNKS_ONE
    if len(_AROUND_SHAPE) < 1024:  # a few dtypes, one chunk size per repository
        _AROUND_SHAPE[(name, chunk_size)] = (before, after)
    return before, after


_AROUND_SHAPE: dict[tuple[str, int], tuple[bytes, bytes]] = {}
_CHUNKS_ONE = msgpack.packb("chunks") + b"\x91"  # the key, then an array of one item


class SmallReads:
    """Reads of one-block arrays, gathered in batches during one load.

    The reader flushes a batch at the end of each container, so a batch holds blocks one save
    wrote back to back. On a store that maps its packs (a local directory) the batch is copied
    out of the mapping and each block hashed, on the loading thread: no read call, no task and
    no GIL hand-over per array (reading them one by one cost 0.13 s for state c against 0.08 s;
    on the pool threads, with the GIL changing hands for every 8 KiB hash, more still). A batch
    a later save split (the blocks it rewrote lie elsewhere) is copied block by block, each
    mapped on its own. On a store that cannot map, a batch goes to ``executor`` through
    ``get_many_into``, which a remote store turns into a few ranged requests, several batches in
    flight at once.
    """

    def __init__(self, store: BlockStore, pool: Executor, verify: bool, executor: Executor) -> None:
        self._store = store
        self._pool = pool
        self._verify = verify
        self._executor = executor
        self._batch: list[tuple[bytes, memoryview]] = []
        self._size = 0
        self.futures: list[Future[None]] = []

    def add(self, cid: bytes, out: memoryview) -> None:
        """Fill ``out`` with block ``cid`` before the load ends (fails if the sizes differ)."""
        self._batch.append((cid, out))
        self._size += out.nbytes
        if self._size >= BATCH_BYTES:
            self.flush()

    def flush(self) -> None:
        batch = self._batch
        if not batch:
            return
        self._batch, self._size = [], 0
        mapped = self._store.map_blocks([cid for cid, _ in batch])
        if mapped is not None and mapped.nbytes == sum(out.nbytes for _, out in batch):
            # One pack, back to back, the sizes adding up: a block whose size differs from its
            # array's would shift the pieces after it, and each fails its hash (when verifying;
            # unverified, the store's index is trusted like its bytes).
            self._copy_out(batch, mapped)
        elif not self._read_runs(batch):
            self.futures.append(self._executor.submit(self._read_many, batch))

    def _read_runs(self, batch: list[tuple[bytes, memoryview]]) -> bool:
        """Copy each block of ``batch`` out of its mapped pack (a batch a later save split: the
        blocks it rewrote lie elsewhere); False (nothing read) on a store that cannot map."""
        store = self._store
        for i, (cid, out) in enumerate(batch):
            mapped = store.map_blocks([cid])
            if mapped is None:
                if i:  # cannot happen with one store, but never leave a block unread
                    self.futures.append(self._executor.submit(self._read_many, batch[i:]))
                    return True
                return False
            if mapped.nbytes != out.nbytes:
                raise CorruptBlock(cidlib.to_str(cid),
                                   f"stored size {mapped.nbytes} != expected {out.nbytes}")
            self._copy_out([(cid, out)], mapped)
        return True

    def _copy_out(self, part: list[tuple[bytes, memoryview]], mapped: memoryview) -> None:
        offset = 0
        for cid, out in part:
            piece = mapped[offset : offset + out.nbytes]
            offset += out.nbytes
            if self._verify and not cidlib.matches(cid, piece):
                self._store.get_into(cid, out, verify=True)  # a good copy elsewhere, or why not
            else:
                out[:] = piece

    def _read_many(self, batch: list[tuple[bytes, memoryview]]) -> None:
        sizes = [out.nbytes for _, out in batch]
        scratch = memoryview(bytearray(sum(sizes)))
        self._store.get_many_into([cid for cid, _ in batch], sizes, scratch, self._pool,
                                  verify=self._verify)
        offset = 0
        for _, out in batch:
            out[:] = scratch[offset : offset + out.nbytes]
            offset += out.nbytes

