"""Many small arrays: one raw block each, hashed and read in batches.

An array of at most ``INLINE_LIMIT`` bytes is normally stored inline in its parent's node. In a
container whose inline arrays hold more than ``SMALL_SPLIT`` bytes (10,000 small tensors, 100 to a
dict), that made every node ~850 KiB, so a change to one tensor in ten rewrote all of them. There
the arrays above ``TINY_LIMIT`` are stored as ordinary one-chunk arrays instead: their own raw
block each, found again by a re-save that leaves them alone. Hashing one block per pool task, and
reading one per task, cost more in Python than the hashing itself, so both go in batches: a batch
is hashed, and checked when loaded, by :meth:`cid.Hasher.raw_many` (see :class:`SmallBlocks`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Collection
from concurrent.futures import Executor, Future
from typing import Any

import msgpack
import numpy as np

from cas_ckpt import cid as cidlib
from cas_ckpt import codec
from cas_ckpt.blocks.base import BlockStore, BlockWriter, Stored

try:
    from cas_ckpt import _headers
except ImportError:  # not built (setup.py): containers are encoded item by item
    _headers = None  # type: ignore[assignment]

TINY_LIMIT = 1024  # arrays up to this size stay inline even among many small ones
SMALL_SPLIT = 64 * 1024  # inline array bytes in one container above which they get blocks
BATCH_BYTES = 512 * 1024  # bytes of small arrays hashed (or read) by one pool task


Encode = Callable[[bytes, memoryview, str], "Stored | None"]  # (CID, bytes, dtype name) -> encoding
# (arrays, CIDs, their kind: None for numpy's, or a tensor library's) -> their encodings
Describe = Callable[[list[Any], list[bytes], "str | None"], list[bytes]]


class SmallArray:
    """An array small enough to be inline, with the header its descriptor needs.

    A plain one (a numpy dtype, C order: nearly all of them) stays a bare ``np.ndarray`` in the
    plan instead: no object per array survives the first walk, so the walk over 10,000 of them no
    longer sets off the cyclic GC (which took half of its time). So does a plain tensor's host
    array in a dict whose bare arrays all come from tensors of that library (the container's
    ``kind``, which their headers record: see :meth:`SmallBlocks.give_blocks`).
    """

    __slots__ = ("data", "header", "nbytes")

    def __init__(self, header: dict[str, Any], data: memoryview) -> None:
        self.header = header
        self.data = data  # a view of the array: keeps it alive, no copy
        self.nbytes = data.nbytes

    def inline(self) -> dict[str, Any]:
        """The ndarray map with the bytes inline (the layout of cas_ckpt 0.1 and 0.2)."""
        return {**self.header, "data": self.data}


class SmallBlocks:
    """The small arrays of one save that get blocks of their own, hashed in batches.

    A batch starts hashing (:meth:`cid.Hasher.raw_many`) as soon as the first walk has made it:
    on the compiled pool's threads, which need no GIL, beside the walk over the rest of the
    state. (A pool thread of Python's hashing 8 KiB blocks beside the busy saving thread got the
    GIL once per switch interval, 5 ms; without the compiled pool a batch is hashed on the saving
    thread when written.) For a compressing writer (``encode``: a block's encoding, ten times
    longer than hashing, outside the GIL) batches go to ``pool`` as they are made. Arrays are
    found by ``id``: the plan holds each one until it is written. Byte views of the arrays are
    made only while a batch is put: a view kept per array from the first walk on set off the
    cyclic GC, as the array's own object did.
    """

    def __init__(self, hasher: cidlib.Hasher, encode: Encode | None, pool: Executor | None,
                 describe: Describe) -> None:
        self._hasher = hasher
        self._encode = encode
        self._describe = describe  # each array's one-chunk ndarray encoding, a batch at a time
        self._pool = pool if encode is not None else None
        self._batch_of: dict[int, Batch] = {}
        self._index_of: dict[int, int] = {}  # ints only: the dict is not tracked by the GC
        self._batches: list[Batch] = []
        # The encodings around the shape by kind and id(dtype), for container_encoding: kept
        # for one save only, while its arrays (and so their dtypes) are alive.
        self._parts: dict[str | None, dict[int, tuple[bytes, bytes]]] = {}

    def give_blocks(
        self, items: Collection[Any], name_of: Callable[[Any], str], chunk_size: int,
        kind: str | None = None,
    ) -> tuple[list[Batch], bool] | None:
        """If the small arrays among ``items`` hold more than ``SMALL_SPLIT`` bytes, give each of
        them a block of its own and return the batches made (in order) and whether they hold
        every item as a plain array (the container is then encoded in one loop: see
        :meth:`container_encoding`). Their container gets a node of its own, however small (a
        sub-tree load reads it alone, not its parent's other children with it). None: they stay
        inline. ``kind``: the tensor library the plain arrays among ``items`` come from (their
        headers record it), None for numpy's own.

        An array larger than ``chunk_size`` (a repository cutting chunks below 16 KiB) stays
        inline: one chunk must not be larger than the chunk size its array records.
        """
        small = [x for x in items if type(x) is np.ndarray or type(x) is SmallArray]
        if not small or sum(x.nbytes for x in small) <= SMALL_SPLIT:
            return None
        # Arrays of a whole container are found by their batches, not one by one (see _find).
        whole = len(small) == len(items) and all(type(x) is np.ndarray and x.nbytes <= chunk_size
                                                 for x in small)
        batches: list[Batch] = []
        batch: list[Any] = []
        size = 0
        for item in small:
            if item.nbytes > chunk_size:
                continue
            batch.append(item)
            size += item.nbytes
            if size >= BATCH_BYTES:
                batches.append(self._add(batch, name_of, kind, find=not whole))
                batch, size = [], 0
        if batch:
            batches.append(self._add(batch, name_of, kind, find=not whole))
        return batches, whole

    def _add(self, arrays: list[Any], name_of: Callable[[Any], str], kind: str | None, *,
             find: bool) -> Batch:
        names = [name_of(x) for x in arrays] if self._encode is not None else None
        batch = Batch(arrays, names, self._hasher, self._encode, self._pool, kind)
        self._batches.append(batch)
        if find:
            self._find(batch)
        return batch

    def _find(self, batch: Batch) -> None:
        """Let :meth:`encoding` find the batch's arrays."""
        ids = list(map(id, batch.arrays))
        self._batch_of.update(zip(ids, itertools.repeat(batch)))
        self._index_of.update(zip(ids, range(len(ids)), strict=True))

    def encoding(self, item: Any, writer: BlockWriter) -> bytes | None:
        """The encoding of ``item`` as a one-chunk array linking to its block (None if it has no
        block, being inline), once its whole batch is put (in one call: one container's arrays,
        written together in order) and described. The state is not changed meanwhile: the
        blocks are kept, not copied."""
        key = id(item)
        batch = self._batch_of.get(key)
        if batch is None:
            return None
        if batch.encodings is None:
            batch.encodings = self._describe(batch.arrays, batch.put(writer), batch.kind)
        return batch.encodings[self._index_of[key]]

    def container_encoding(
        self, keys: list[Any] | None, batches: list[Batch], writer: BlockWriter, code: int,
        chunk_size: int, packer: msgpack.Packer, name_of: Callable[[Any], str], limit: int,
    ) -> bytes | None:
        """The encoding of a map (``keys``) or list (None) whose items are the plain arrays of
        ``batches`` (:meth:`give_blocks`), once their blocks are put: byte for byte the frame of
        their :meth:`encoding` one by one, made in one compiled loop. None where that loop is not
        built, or a key is of another kind or the whole longer than ``limit``: the caller then
        encodes item by item (the blocks stay put, and :meth:`encoding` finds the arrays)."""
        cids: list[bytes] = []
        for batch in batches:
            cids += batch.put(writer)
        body: bytes | int | None = None
        if _headers is not None:
            arrays = [x for batch in batches for x in batch.arrays]
            kind = batches[0].kind  # one per container (give_blocks)
            parts = self._parts.setdefault(kind, {})
            # An int: the index of an array whose dtype has no parts yet.
            while type(body := _headers.small_container(keys, arrays, cids, code, parts, limit)) is int:
                name = name_of(arrays[body])
                around = _around_shape(name, chunk_size, packer, kind)
                parts[id(arrays[body].dtype)] = (around[0], around[1] + _LINK_36)
        if body is None:
            for batch in batches:
                self._find(batch)
        return body  # type: ignore[return-value]  # bytes or None once the loop has ended

    def clear(self) -> None:
        """Cancel the batches still queued (a failed save) and forget them all: ids of freed
        objects get reused."""
        for batch in self._batches:
            batch.cancel()
        self._batches.clear()
        self._batch_of.clear()
        self._index_of.clear()
        self._parts.clear()


def bytes_of(item: Any) -> memoryview:
    """The bytes of a small array of the plan (a :class:`SmallArray` or a plain ``np.ndarray``)."""
    return item.data if type(item) is SmallArray else memoryview(item).cast("B")


Results = tuple[list[bytes], "list[Stored | None] | None"]  # the CIDs, and encodings if compressing


class Batch:
    """The CIDs (and encodings) of a batch of small arrays, hashed from the start."""

    __slots__ = ("_encode", "_future", "_hasher", "_names", "_pending", "_results", "arrays", "cids",
                 "encodings", "kind")

    def __init__(self, arrays: list[Any], names: list[str] | None, hasher: cidlib.Hasher,
                 encode: Encode | None, pool: Executor | None, kind: str | None = None) -> None:
        self.arrays = arrays  # in order
        self.kind = kind  # the tensor library its plain arrays come from (None: numpy's own)
        self._names = names  # each array's dtype name, for the encoder
        self.cids: list[bytes] | None = None  # set once all its blocks are put
        self.encodings: list[bytes] | None = None  # each array's, made when first asked for
        self._hasher = hasher
        self._encode = encode
        self._results: Results | None = None
        self._future = None if pool is None else pool.submit(self._encode_all)
        self._pending = None if pool is not None else hasher.raw_many(_buffers(arrays))

    def results(self) -> Results:
        """The CIDs (and encodings), waited for once per batch, not once per array."""
        if self._results is None:
            if self._future is not None:
                self._results = self._future.result()
            else:
                assert self._pending is not None
                self._results = self._pending.result(), None
                self._pending = None
        return self._results

    def put(self, writer: BlockWriter) -> list[bytes]:
        """Put the batch's blocks (once: a second call returns the CIDs again); their CIDs."""
        if self.cids is None:
            cids, stored = self.results()
            writer.put_many(list(zip(cids, self.arrays, stored or [None] * len(cids), strict=True)),
                            keep=True, view=bytes_of)
            self.cids = cids
        return self.cids

    def cancel(self) -> None:
        if self._future is not None:
            self._future.cancel()
        self._pending = None  # a job of the compiled pool stops, and lets the arrays go

    def _encode_all(self) -> Results:
        assert self._encode is not None and self._names is not None
        views = [bytes_of(x) for x in self.arrays]
        cids = self._hasher.raw_many(views).result()
        encode, names = self._encode, self._names
        return cids, [encode(cid, view, name) for cid, view, name in zip(cids, views, names, strict=True)]


def _buffers(arrays: list[Any]) -> list[Any]:
    """What hashes each array's bytes: the array itself (C-contiguous, a numpy dtype), or the
    byte view of a :class:`SmallArray`. No view is made per plain array."""
    return [x.data if type(x) is SmallArray else x for x in arrays]


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
        return one_chunk_plain(code, name, header["shape"], chunk_size, cid, packer)
    head = packer.pack({**header, "chunk_size": chunk_size})
    if not 0x80 <= head[0] < 0x8F:  # not a fixmap with room for one more entry: never for ours
        raise ValueError(f"ndarray header of {len(header)} entries")
    return codec.ext(code, b"".join((bytes((head[0] + 1,)), head[1:], _CHUNKS_ONE, codec.link(cid))))


def one_chunk_plain(
    code: int, name: str, shape: Any, chunk_size: int, cid: bytes, packer: msgpack.Packer
) -> bytes:
    """:func:`one_chunk_array` of the header ``{"dtype": name, "shape": list(shape)}``."""
    around = _AROUND_SHAPE.get((name, chunk_size, None))
    if around is None:
        around = _around_shape(name, chunk_size, packer)
    link = _LINK_36 + cid if len(cid) == 36 else codec.link(cid)  # 36: the CIDs of both hashes
    shaped = packer.pack(shape)  # a tuple packs as a list
    return codec.ext(code, b"".join((around[0], shaped, around[1], link)))


def one_chunk_encodings(
    code: int, items: list[Any], cids: list[bytes], chunk_size: int, packer: msgpack.Packer,
    name_of: Callable[[Any], str], kind: str | None = None,
) -> list[bytes]:
    """:func:`one_chunk_array` of each item (a :class:`SmallArray`, or a plain ``np.ndarray``
    whose header is its dtype and shape, and ``kind`` where not None) and its CID, in one loop:
    the parts around the shape are looked up once per run of one dtype, and no call is made per
    plain array but msgpack's for its shape (10,000 arrays spent 7.5 us each in the calls of the
    one-array path)."""
    out = []
    pack = packer.pack
    heads = _EXT8.get(code) or _EXT8.setdefault(code, [bytes((0xC7, n, code)) for n in range(0x100)])
    dtype, before, after = None, b"", b""
    for item, cid in zip(items, cids, strict=True):
        if type(item) is SmallArray:
            out.append(one_chunk_array(code, item.header, chunk_size, cid, packer))
            continue
        if item.dtype is not dtype:
            dtype = item.dtype
            name = name_of(item)
            before, after = _AROUND_SHAPE.get((name, chunk_size, kind)) \
                or _around_shape(name, chunk_size, packer, kind)
            after += _LINK_36
        if len(cid) == 36:
            body = b"".join((before, pack(item.shape), after, cid))
        else:
            body = b"".join((before, pack(item.shape), after[: -len(_LINK_36)], codec.link(cid)))
        out.append(heads[len(body)] + body if len(body) < 0x100 else codec.ext(code, body))
    return out


def _around_shape(name: str, chunk_size: int, packer: msgpack.Packer, kind: str | None = None
                  ) -> tuple[bytes, bytes]:
    """The encoding of a one-chunk ndarray map (dtype, shape, then kind where not None) before
    its shape, and after it up to the link (kept in ``_AROUND_SHAPE``, which the loops over many
    arrays read first, without a call)."""
    kept = _AROUND_SHAPE.get((name, chunk_size, kind))
    if kept is not None:
        return kept
    entries = b"\x84" if kind is None else b"\x85"
    before = entries + packer.pack("dtype") + packer.pack(name) + packer.pack("shape")
    after = b"" if kind is None else packer.pack("kind") + packer.pack(kind)
    after += packer.pack("chunk_size") + packer.pack(chunk_size) + _CHUNKS_ONE
    if len(_AROUND_SHAPE) < 1024:  # a few dtypes and kinds, one chunk size per repository
        _AROUND_SHAPE[(name, chunk_size, kind)] = (before, after)
    return before, after


_AROUND_SHAPE: dict[tuple[str, int, str | None], tuple[bytes, bytes]] = {}
_CHUNKS_ONE = msgpack.packb("chunks") + b"\x91"  # the key, then an array of one item
_LINK_36 = codec.link(bytes(36))[:-36]  # the head of a link to a 36-byte CID
# The heads of ext values of 17-255 bytes by code (msgpack ext 8; 16 bytes or fewer never hold a
# CID), made for a code when first used.
_EXT8: dict[int, list[bytes]] = {}


class SmallReads:
    """Reads of one-block arrays, gathered in batches during one load.

    The reader flushes a batch at the end of each container, so a batch holds blocks one save
    wrote back to back. A store with reads of its own (:meth:`BlockStore.start_reads`: a local
    directory, whose packs are mapped) starts each batch at once: copied out of the mapping and
    checked on the compiled pool's threads while the walk goes on, with no read call, task or
    GIL hand-over per array (reading them one by one cost 0.13 s for state c against 0.08 s).
    On any other store a batch goes to the fill threads (``executor()``) through
    ``get_many_into``, which a remote store turns into a few ranged requests, several batches
    in flight at once.
    """

    def __init__(self, store: BlockStore, pool: Executor, verify: bool,
                 executor: Callable[[], Executor]) -> None:
        self._store = store
        self._pool = pool
        self._verify = verify
        self._executor = executor
        # A batch is two lists, not a tuple per array: until the reads end, a tuple (or a byte
        # view) per array would be tracked by the cyclic GC, whose count then starts a
        # collection as soon as the load's pause of it ends.
        self._cids: list[bytes] = []
        self._outs: list[np.ndarray[Any, Any]] = []
        self._size = 0
        self.waits: list[Callable[[], Any]] = []  # batches the store reads on its own
        self.futures: list[Future[None]] = []  # and those on the fill threads: the load waits

    def add(self, cid: bytes, out: np.ndarray[Any, Any]) -> None:
        """Fill ``out`` (a contiguous array) with block ``cid`` before the load ends (fails if
        the sizes differ)."""
        self._cids.append(cid)
        self._outs.append(out)
        self._size += out.nbytes
        if self._size >= BATCH_BYTES:
            self.flush()

    def add_many(self, cids: list[bytes], outs: list[np.ndarray[Any, Any]]) -> None:
        """:meth:`add` for each of them."""
        self._cids += cids
        self._outs += outs
        self._size += sum(out.nbytes for out in outs)
        if self._size >= BATCH_BYTES:
            self.flush()

    def flush(self) -> None:
        cids, outs = self._cids, self._outs
        if not cids:
            return
        self._cids, self._outs, self._size = [], [], 0
        wait = self._store.start_reads(cids, outs, verify=self._verify)
        if wait is None:  # a store that cannot map, a compressed block, or a wrong size
            self.futures.append(self._executor().submit(self._read_many, cids, outs))
        else:
            self.waits.append(wait)

    def _read_many(self, cids: list[bytes], outs: list[np.ndarray[Any, Any]]) -> None:
        sizes = [out.nbytes for out in outs]
        scratch = np.empty(sum(sizes), np.uint8)
        self._store.get_many_into(cids, sizes, memoryview(scratch), self._pool, verify=self._verify)
        offset = 0
        for out in outs:
            out.reshape(-1).view(np.uint8)[:] = scratch[offset : offset + out.nbytes]
            offset += out.nbytes
