"""Training state <-> a tree of blocks.

Saving walks the state twice. The first walk checks every value (errors name the path inside the
state before anything is written), cuts large arrays and byte strings into chunks and queues their
hashes (on the compiled hashing pool for sha2-256, else on the thread pool). The second walk
encodes nodes bottom-up, writing each chunk as its hash arrives, so hashing, encoding and writing
overlap and no tensor byte is copied on the way.

Typed values are msgpack extension values (see ``docs/format.md``):

====  ==========  ==========================================================================
code  name        payload
====  ==========  ==========================================================================
1     tuple       array of values
2     bigint      bin: signed big-endian two's complement (ints outside int64/uint64)
3     ndarray     map: dtype, shape, order, and data (inline) or chunk_size + chunks
4     blob        map: size, chunks (content-defined chunks of a large bytes or str value)
5     scalar      map: dtype, data (a numpy scalar)
6     pages       map: kind ("map"/"list"/"tuple"), pages (links to nodes holding the parts)
7     cid         a link (ext 42) to any stored block: a ``multiformats.CID`` value in the state;
                  GC keeps its target, loading gives the CID back (not the target's content)
42    link        a sub-tree stored as its own node
====  ==========  ==========================================================================
"""

from __future__ import annotations

import bisect
import collections
import functools
import itertools
import math
import os
import re
import sys
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Protocol

import numpy as np
from fastcdc.fastcdc_cy import fastcdc_cy
from multiformats import CID

from cas_ckpt import _small, codec
from cas_ckpt import cid as cidlib
from cas_ckpt._memory import cyclic_gc_paused, memory_limit
from cas_ckpt._small import SmallArray
from cas_ckpt.blocks.base import MAX_CHUNK, BlockStore, BlockWriter, Stored
from cas_ckpt.codec import Link, Tagged
from cas_ckpt.errors import (
    CorruptBlock,
    DecodeError,
    ExpansionLimit,
    InvalidCID,
    MapLocationError,
    OutOfMemory,
    StateTypeError,
)

TUPLE, BIGINT, NDARRAY, BLOB, SCALAR, PAGES, CID_VALUE = 1, 2, 3, 4, 5, 6, 7

INLINE_LIMIT = 16 * 1024  # arrays and bytes up to this size live inside their node (but see _small)
SPLIT_LIMIT = 64 * 1024  # containers whose encoding is larger get a node of their own
PAGE_LIMIT = MAX_CHUNK - 64  # nodes are cut into pages below this size
MAX_LINKS = 16384  # chunk links kept in one descriptor before they move into link pages
MAX_DEPTH = 256
MAX_DIMS = 64  # numpy's (and so a loaded array's) most dimensions
FILLS_IN_FLIGHT = 4  # arrays being read at once during a load
HASH_AHEAD = 8 * 1024 * 1024  # chunk bytes hashed ahead of the one being written (see _HashAhead)
# Where the pool hashes 16 chunks of one length at once, each hashing thread (the pool's and the
# saving thread) needs 16 queued to take a group: a lead of 8 MiB never let one form (a's fresh
# save 155 ms with it, 131 with 34 MiB on two cores).
GROUP_LEAD = 16 * 1024 * 1024  # per hashing thread
HASH_AHEAD_GROUPED = (cidlib.POOL_THREADS + 1) * GROUP_LEAD + 2 * 1024 * 1024
# Node reads allowed for one load. A tree cas_ckpt writes reads each node about once (a node holds
# at least 64 KiB of structure, or a page of ~1 MiB); a hostile DAG whose nodes each link twice to
# the one below would otherwise expand to 2**depth reads (a "billion laughs").
MAX_NODE_READS = 1 << 18
# The bytes of nodes and pages a read expands (each counted as often as it is linked) may exceed
# the distinct bytes it read only by this factor, beyond a floor (docs/format.md, "Reading a
# tree"). A writer links one node or page twice only where the state repeats a value whose
# encoding is over 64 KiB (pages: ~1 MiB): a 4 MB node linking one 1,000-item page 100,000 times
# expanded to 100 million items (203 s, 1.6 GB). Items take a byte at least, so this bounds them.
EXPANSION_FACTOR = 4
EXPANSION_FLOOR = 16 * 1024 * 1024  # 16 million items at most; ~5 s to load as Nones
EXPANSION_ENV = "CAS_CKPT_MAX_EXPANSION"  # another floor, in bytes (a state that needs more)
MAX_KEY = 64 * 1024
MAX_BIGINT_BYTES = 64 * 1024
CDC_MIN, CDC_AVG, CDC_MAX = 64 * 1024, 256 * 1024, MAX_CHUNK
BLOB_WINDOW = 16 * 1024 * 1024  # bytes of a streamed byte string held at once (write_blob)

_INT64_MIN, _UINT64_MAX = -(2**63), 2**64 - 1
_NUMPY_DTYPE = re.compile(r"^[<>|](b1|[iu][1248]|f[248]|c(8|16))$")
# ml_dtypes' dtypes, stored by these names. ml_dtypes is imported on first need, not with cas_ckpt:
# its import takes 0.5-1.4 s, and an array of one of its dtypes exists only once it is imported.
ML_DTYPE_NAMES = (
    "bfloat16",
    "float8_e4m3fn",
    "float8_e4m3fnuz",
    "float8_e5m2",
    "float8_e5m2fnuz",
    "float8_e4m3b11fnuz",
    "float8_e3m4",
    "float8_e4m3",
    "float8_e8m0fnu",
    "float4_e2m1fn",
    "float6_e2m3fn",
    "float6_e3m2fn",
    "int4",
    "uint4",
    "int2",
    "uint2",
)
_USER_DTYPES = 256  # numpy numbers the dtypes other libraries register from NPY_USERDEF on


@functools.cache
def _ml_dtypes() -> dict[str, np.dtype[Any]]:
    """The dtypes of ML_DTYPE_NAMES that this ml_dtypes has, by name."""
    import ml_dtypes

    return {name: np.dtype(getattr(ml_dtypes, name)) for name in ML_DTYPE_NAMES if hasattr(ml_dtypes, name)}


@functools.cache
def _ml_names() -> dict[np.dtype[Any], str]:
    return {dtype: name for name, dtype in _ml_dtypes().items()}


# The common names, looked up without the regular expression (once per small tensor adds up).
_NAMES = {n: n for n in (f"{o}{t}" for o in "<>|" for t in ("b1", "i1", "u1", "i2", "u2", "i4", "u4",
          "i8", "u8", "f2", "f4", "f8", "c8", "c16")) if _NUMPY_DTYPE.match(n)}
_PARSED = {n: np.dtype(n) for n in _NAMES}
# The dtypes parse_dtype returns whose arrays export a buffer (ml_dtypes' do not), by identity.
_BUFFER_DTYPES = frozenset(id(_PARSED[n]) for n in _NAMES)

try:
    from cas_ckpt import _headers
except ImportError:  # not built (setup.py): TreeReader._load_small takes each array
    _pick_small = None
else:
    # A container's usual small arrays, made in one compiled loop: what _load_small makes of
    # each (tests/test_small_tensors.py checks that on generated containers), as views into
    # buffers of up to 16 MiB that the small arrays of one load share (``arena``: see
    # TreeReader.load).
    _SMALL_DTYPES = {name: (dtype, dtype.itemsize) for name, dtype in _PARSED.items()
                     if id(dtype) in _BUFFER_DTYPES}

    def _pick_small(
        items: dict[Any, Any], arena: list[Any], kind: str | None = None, make: Any = None
    ) -> tuple[dict[Any, Any], list[bytes], list[Any], list[Any]]:
        """... and, given a tensor kind and its ``make`` (``TensorAdapter.tensor_maker``), the
        small arrays saved from that library's tensors too, as ``make(array)`` in the map."""
        return _headers.pick_small(  # type: ignore[no-any-return]
            items, Tagged, NDARRAY, _SMALL_DTYPES, INLINE_LIMIT, arena, kind, make)


def dtype_name(dtype: np.dtype[Any]) -> str | None:
    """The stored name of a dtype, or None if it cannot be saved."""
    seen = _NAME_OF.get(id(dtype))
    if seen is not None and seen[0] is dtype:  # numpy reuses one dtype object per type
        return seen[1]
    name = _dtype_name(dtype)
    if len(_NAME_OF) < 256:  # the object is kept alive with its entry, so its id stays its own
        _NAME_OF[id(dtype)] = (dtype, name)
    return name


_NAME_OF: dict[int, tuple[np.dtype[Any], str | None]] = {}


def _dtype_name(dtype: np.dtype[Any]) -> str | None:
    name = _NAMES.get(dtype.str)  # no ml_dtypes dtype's .str is one of these ("<V2" for bfloat16)
    if name is not None:
        return name
    if dtype.num >= _USER_DTYPES:
        # Only ml_dtypes' own dtypes have names here, and none exists before it is imported.
        return _ml_names().get(dtype) if "ml_dtypes" in sys.modules else None
    name = dtype.str
    return name if _NUMPY_DTYPE.match(name) else None


def float_size(name: str) -> int:
    """The element size by which a little-endian float dtype's bytes group for compression
    (a complex number's parts), or 0 for every other dtype."""
    if name in ("bfloat16", "<f2", "<f4", "<f8"):
        return 2 if name == "bfloat16" else int(name[2:])
    return {"<c8": 4, "<c16": 8}.get(name, 0)


def parse_dtype(name: object) -> np.dtype[Any]:
    """The dtype for a stored name; never evaluates anything but the allow-listed names."""
    found = _PARSED.get(name) if type(name) is str else None
    if found is not None:
        return found
    if isinstance(name, str):
        ml_dtype = _ml_dtypes().get(name) if name in ML_DTYPE_NAMES else None
        if ml_dtype is not None:
            return ml_dtype
        if _NUMPY_DTYPE.match(name):
            return np.dtype(name)
    raise DecodeError(f"unknown dtype {name!r}")


def join_path(path: str, key: object) -> str:
    return f"{path}.{key}" if path else str(key)


# --------------------------------------------------------------------------------------------
# Saving
# --------------------------------------------------------------------------------------------
class Encoded:
    """A value already written and encoded (:meth:`TreeWriter.write_blob`): a state holding it
    is stored with these bytes in its place, exactly as the value they encode would be."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data


@dataclass
class _Chunked:
    """A value cut into chunks being hashed (and, for a compressing writer, encoded)."""

    header: dict[str, Any]
    chunks: list[memoryview]
    float_size: int = 0
    owner: Any = None  # keeps the array (or a contiguous copy) alive until written
    hashes: list[_Digesting] = field(default_factory=list)  # in order


class _Digesting(Protocol):
    """A chunk's CID and encoding being made: a pool task's future, or a :class:`_Pooled`."""

    def result(self) -> tuple[bytes, Stored | None]: ...

    def cancel(self) -> bool: ...


class _Pooled:
    """A chunk's CID from the compiled hashing pool (:meth:`cid.Hasher.raw_many`).

    Its threads never take the GIL, and the saving thread, waiting for a chunk another thread
    is hashing, hashes the next ones meanwhile. A hashlib task per 1 MiB chunk on the Python
    pool made the saving thread and two pool threads pass the GIL around every chunk: an
    unchanged re-save of 256 MiB took 1.15-1.3x what two threads need to hash it.
    """

    __slots__ = ("_job",)

    def __init__(self, job: cidlib.Pending) -> None:
        self._job: cidlib.Pending | None = job

    def result(self) -> tuple[bytes, Stored | None]:
        assert self._job is not None
        cid = self._job.result()[0]
        self._job = None
        return cid, None

    def cancel(self) -> bool:
        self._job = None  # a dropped job stops, and lets the chunk go
        return True


class _HashAhead:
    """Queues chunk hashes at most ``window`` bytes ahead of the chunk being written.

    On two cores, hashing far ahead takes the CPU from the thread writing; the writes then lag
    behind and end in a backlog with a core idle. A bounded lead keeps both busy to the end, and
    at 8 MiB each chunk is still in the CPU cache when written. Where the pool hashes 16 chunks
    of one length at once the lead is 16 MiB per hashing thread, so that each can take a group
    (the write then reads the chunk from memory again: hashing it cost more).
    Chunks are consumed in the order they were queued (both walks visit the state in one
    order); one consumed early is submitted then.
    ``start`` begins one chunk's digest: on the compiled pool where it serves (sha2-256, no
    compression), else as a task of the Python pool.
    """

    def __init__(self, start: Callable[[memoryview, int], _Digesting], window: int) -> None:
        self.start, self.window = start, window
        self.queued: collections.deque[tuple[_Chunked, int]] = collections.deque()
        self.ahead = 0  # bytes submitted and not yet consumed

    def add(self, plan: _Chunked) -> None:
        self.queued.extend((plan, i) for i in range(len(plan.chunks)))
        self.fill()  # hashing starts while the first walk goes on

    def next(self, plan: _Chunked, i: int) -> Future[tuple[bytes, Stored | None]]:
        """The hash of chunk ``i`` of ``plan``, which is being consumed now."""
        while len(plan.hashes) <= i:
            self._submit_one()
        self.ahead -= plan.chunks[i].nbytes
        self.fill()
        return plan.hashes[i]

    def fill(self) -> None:
        while self.queued and self.ahead < self.window:
            self._submit_one()

    def _submit_one(self) -> None:
        plan, i = self.queued.popleft()
        chunk = plan.chunks[i]
        plan.hashes.append(self.start(chunk, plan.float_size))
        self.ahead += chunk.nbytes

    def clear(self) -> None:
        self.queued.clear()
        self.ahead = 0


class TreeWriter:
    """Encodes one state into blocks written through a :class:`BlockWriter`."""

    def __init__(
        self,
        writer: BlockWriter,
        hasher: cidlib.Hasher,
        pool: Executor,
        *,
        chunk_size: int = MAX_CHUNK,
    ) -> None:
        if not 4096 <= chunk_size <= MAX_CHUNK:
            raise ValueError(f"chunk_size must be between 4 KiB and {MAX_CHUNK} bytes")
        self.writer = writer
        self.hasher = hasher
        self.pool = pool
        self.chunk_size = chunk_size
        self.logical_bytes = 0
        self._packer = codec.packer()
        # ids of prepared containers of many small arrays, each with its batches where they
        # hold every item (see SmallBlocks.give_blocks)
        self._own_node: dict[int, list[_small.Batch] | None] = {}
        # ids of prepared dicts whose bare small arrays are the host arrays of one tensor
        # library's tensors, with its kind (their headers record it)
        self._kind_of: dict[int, str] = {}
        self._pooled = hasher.pooled and not writer.compresses  # chunk hashes on the compiled pool
        grouped = self._pooled and hasher.grouped
        self._hashing = _HashAhead(self._start_digest, HASH_AHEAD_GROUPED if grouped else HASH_AHEAD)
        self._small = _small.SmallBlocks(
            hasher, self._encode_small if writer.compresses else None, pool, self._describe_small
        )

    def write(self, state: Any) -> bytes:
        """Store the whole state; return the binary CID of its root node."""
        # The plan's containers and headers (and a tensor's host array each) live until written,
        # and writing makes a tuple or two per block: every 700 of them set off a collection,
        # though none is in a cycle (4-5% of a save of 10,000 small arrays' instructions).
        with cyclic_gc_paused():
            return self._write(state)

    def _write(self, state: Any) -> bytes:
        self._own_node.clear()
        try:
            plan = self._prepare(state, "", 0)
        except BaseException:
            self._hashing.clear()
            self._small.clear()
            raise
        try:
            root = self._put_node(self._body(plan, ""))
            self.writer.settle()  # the state's memory is the caller's again when this returns
            return root
        except BaseException:
            self._hashing.clear()
            _release(plan)
            raise
        finally:
            self._own_node.clear()  # ids of freed objects get reused: never carry them over
            self._kind_of.clear()
            self._small.clear()

    # -- first walk: check types, start hashing ------------------------------------------------
    def _prepare(self, value: Any, path: str, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise StateTypeError(path, f"nesting deeper than {MAX_DEPTH} levels")
        kind = type(value)
        if kind is np.ndarray:  # the most frequent value, checked first
            return self._prepare_array(value, path, "numpy")
        if value is None or kind in (bool, float):
            return value
        if kind is int:
            if not _INT64_MIN <= value <= _UINT64_MAX:
                size = (value.bit_length() + 8) // 8
                if size > MAX_BIGINT_BYTES:
                    raise StateTypeError(path, f"int of {value.bit_length()} bits is too large")
            return value
        if kind is str:
            if len(value) > INLINE_LIMIT:
                return self._chunk_blob(_utf8(value, path), {"str": True})
            _utf8(value, path)
            return value
        if kind is bytes:
            return self._chunk_blob(value, {}) if len(value) > INLINE_LIMIT else value
        if isinstance(value, dict):
            out = {}
            plain_bytes = 0
            plain_kind = None  # where its plain small arrays come from: numpy, or one tensor library
            hosts, host_kind = _host_arrays(value) if depth < MAX_DEPTH else (_NO_HOSTS, "numpy")
            for (key, item), host in zip(value.items(), hosts, strict=False):  # _NO_HOSTS is endless
                key_type = type(key)
                if key_type is str:
                    if len(key) > MAX_KEY:
                        raise StateTypeError(join_path(path, key[:40]), "dict key is too long")
                elif key_type is not int:
                    raise StateTypeError(
                        join_path(path, key), f"dict keys must be str or int, not {key_type.__name__}"
                    )
                elif not _INT64_MIN <= key <= _UINT64_MAX:
                    raise StateTypeError(join_path(path, key), "int dict keys must fit 64 bits")
                kind = "numpy"
                if host is not None:
                    item, kind = host, host_kind
                if type(item) is np.ndarray and depth < MAX_DEPTH:  # no dispatch per tensor
                    if _small.TINY_LIMIT < item.nbytes <= INLINE_LIMIT and id(item.dtype) in _BUFFER_DTYPES \
                            and item.flags.c_contiguous and plain_kind in (None, kind):
                        plain_kind = kind
                        plain_bytes += item.nbytes  # a plain small array: as _prepare_array plans it
                        out[key] = item
                        continue
                    # bare only where the container's bare arrays are of its kind
                    out[key] = self._prepare_array(item, join_path(path, key), kind,
                                                   bare=plain_kind in (None, kind))
                else:
                    out[key] = self._prepare(item, join_path(path, key), depth + 1)
            self.logical_bytes += plain_bytes
            if plain_kind not in (None, "numpy"):
                self._kind_of[id(out)] = plain_kind
            return self._mark(out, out.values(), self._kind_of.get(id(out)))
        if kind in (list, tuple):
            items = [self._prepare(v, join_path(path, i), depth + 1) for i, v in enumerate(value)]
            return self._mark(items if kind is list else Tagged(TUPLE, items), items)
        if isinstance(value, np.ndarray):
            return self._prepare_array(value, path, "numpy")
        if isinstance(value, np.generic):
            return self._scalar(value, path)
        adapter = adapter_for(value)
        if adapter is not None:
            return self._prepare_array(adapter.to_numpy(value, path), path, adapter.kind)
        if isinstance(value, CID):
            return self._cid_value(value, path)
        if kind is Link:
            return self._linked(value, path)
        if kind is Encoded:
            return value
        raise StateTypeError(path, f"cannot save a value of type {kind.__module__}.{kind.__name__}"
                             + _state_dict_hint(value))

    def _mark(self, container: Any, items: Any, kind: str | None = None) -> Any:
        """``container``, noted to get a node of its own if its small arrays get blocks (``kind``:
        the tensor library its bare arrays come from, None for numpy's own)."""
        given = self._small.give_blocks(items, _small_dtype, self.chunk_size, kind)
        if given is not None:  # the plan holds the container until written: the id stays
            self._own_node[id(container)] = given[0] if given[1] else None
        return container

    def _linked(self, value: Link, path: str) -> Link:
        """A sub-tree already stored (e.g. by another process): linked as it is, not re-encoded."""
        if not cidlib.is_node(value.cid):
            raise StateTypeError(path, f"link to {cidlib.to_str(value.cid)}: not a node")
        if not self.writer.has(value.cid):
            raise StateTypeError(path, f"link to {cidlib.to_str(value.cid)}: block not stored")
        return value

    def _cid_value(self, value: CID, path: str) -> Tagged:
        """A CID in the state: a strong link to a block that must already be stored."""
        try:
            target = cidlib.to_bytes(value)
        except InvalidCID as exc:
            raise StateTypeError(path, f"cannot store this CID: {exc}") from None
        if not self.writer.has(target):
            raise StateTypeError(path, f"CID {value} names a block that is not in the store")
        return Tagged(CID_VALUE, Link(target))

    def _scalar(self, value: np.generic, path: str) -> Tagged:
        name = dtype_name(value.dtype)
        if name is None:
            raise StateTypeError(path, f"unsupported numpy scalar dtype {value.dtype}")
        return Tagged(SCALAR, {"dtype": name, "data": np.asarray(value).tobytes()})

    def _prepare_array(self, array: np.ndarray[Any, Any], path: str, kind: str, *, bare: bool = True) -> Any:
        """The plan of an array: bare if it is a plain small one of numpy's (and ``bare``),
        else its header and bytes (inline, a block of its own, or chunks)."""
        name = dtype_name(array.dtype)
        if name is None:
            raise StateTypeError(path, f"unsupported array dtype {array.dtype}")
        order = "C"
        if array.flags.c_contiguous:
            flat = array
        elif array.flags.f_contiguous:
            order, flat = "F", array.T
        else:
            flat = np.ascontiguousarray(array)  # strided views: the one unavoidable copy
        if bare and flat is array and order == "C" and type(array) is np.ndarray and kind == "numpy" \
                and name in _NAMES and _small.TINY_LIMIT < array.nbytes <= INLINE_LIMIT:
            self.logical_bytes += array.nbytes
            return array  # plain: described when written (see SmallArray)
        if not array.size:
            data = memoryview(b"")
        elif name in _NAMES:  # numpy's own dtypes export a buffer: a byte view in one call
            data = memoryview(flat).cast("B")
        else:  # ml_dtypes' (bfloat16...) have no buffer format
            data = memoryview(flat.reshape(-1).view(np.uint8))
        header: dict[str, Any] = {"dtype": name, "shape": list(array.shape)}
        if order == "F":
            header["order"] = "F"
        if kind != "numpy":
            header["kind"] = kind
        self.logical_bytes += data.nbytes
        if data.nbytes <= _small.TINY_LIMIT:
            return Tagged(NDARRAY, {**header, "data": data})  # msgpack packs the view: no copy
        if data.nbytes <= INLINE_LIMIT:
            return SmallArray(header, data)  # inline, or a block of its own: see give_blocks
        size = self.chunk_size
        chunks = [data[i : i + size] for i in range(0, data.nbytes, size)]
        header["chunk_size"] = size
        return self._submit(header, chunks, flat, float_size=float_size(name))

    def _chunk_blob(self, data: bytes, header: dict[str, Any]) -> _Chunked:
        self.logical_bytes += len(data)
        view = memoryview(data)
        cuts = fastcdc_cy(view, CDC_MIN, CDC_AVG, CDC_MAX, False, None)
        chunks = [view[c.offset : c.offset + c.length] for c in cuts]
        return self._submit({**header, "size": len(data)}, chunks, data, blob=True)

    def _submit(
        self, header: dict[str, Any], chunks: list[memoryview], owner: Any, *, blob: bool = False,
        float_size: int = 0,
    ) -> _Chunked:
        header["_blob"] = blob
        plan = _Chunked(header, chunks, float_size, owner)
        self._hashing.add(plan)
        return plan

    # -- second walk: encode bottom-up, write ---------------------------------------------------
    def _encode(self, value: Any, path: str) -> bytes:
        """The encoding of ``value`` inside its parent: a link if it was given a node of its own."""
        body = self._body(value, path)
        if isinstance(value, (dict, list, Tagged)) \
                and (len(body) > SPLIT_LIMIT or id(value) in self._own_node):
            return codec.link(self._put_node(body))
        return body

    def _body(self, value: Any, path: str) -> bytes:
        # a container of plain small arrays only (a tuple's Tagged is marked too: see _mark)
        batches = self._own_node.get(id(value)) if type(value) in (dict, list, Tagged) else None
        if batches:
            keys = list(value) if type(value) is dict else None
            body = self._small.container_encoding(keys, batches, self.writer, NDARRAY, self.chunk_size,
                                                  self._packer, _small_dtype, PAGE_LIMIT - 16)
            if body is not None:
                return codec.ext(TUPLE, body) if type(value) is Tagged else body
        if isinstance(value, dict):
            pack, small, kind = self._pack, self._write_small, self._kind_of.get(id(value))
            items = [pack(k) + (small(v, kind) if type(v) in _SMALL else self._encode(v, join_path(path, k)))
                     for k, v in value.items()]
            return self._container(items, "map")
        if isinstance(value, list):
            return self._container(
                [self._write_small(v) if type(v) in _SMALL else self._encode(v, join_path(path, i))
                 for i, v in enumerate(value)], "list"
            )
        if isinstance(value, Tagged) and value.code == TUPLE:
            return self._container(
                [self._encode(v, join_path(path, i)) for i, v in enumerate(value.value)], "tuple"
            )
        if type(value) in _SMALL:
            return self._write_small(value)
        if isinstance(value, _Chunked):
            return self._write_chunked(value)
        if type(value) is Encoded:
            return value.data
        if type(value) is int and not _INT64_MIN <= value <= _UINT64_MAX:
            return codec.encode(Tagged(BIGINT, _bigint_bytes(value)))
        return self._pack(value)

    def _pack(self, value: Any) -> bytes:
        return self._packer.pack(value)  # type: ignore[no-any-return]

    def _container(self, items: list[bytes], kind: str) -> bytes:
        """Encode a map/list/tuple from its encoded items, cut into pages if too large: each page
        the longest run of items that fits (at least one)."""
        if sum(map(len, items)) + 16 <= PAGE_LIMIT:
            return self._frame(items, kind)
        pages = [items[start:end] for start, end in page_runs(list(map(len, items)), PAGE_LIMIT - 16)]
        links = [Link(self._put_node(self._frame(page, "list" if kind == "tuple" else kind)))
                 for page in pages]
        return codec.encode(Tagged(PAGES, {"kind": kind, "pages": links}))

    def _frame(self, items: list[bytes], kind: str) -> bytes:
        if kind == "map":
            return b"".join([self._packer.pack_map_header(len(items)), *items])
        body = b"".join([self._packer.pack_array_header(len(items)), *items])
        return codec.ext(TUPLE, body) if kind == "tuple" else body

    def _start_digest(self, chunk: memoryview, float_size: int) -> _Digesting:
        if self._pooled:
            return _Pooled(self.hasher.raw_many([chunk]))
        return self.pool.submit(self._digest, chunk, float_size)

    def _digest(self, chunk: memoryview, float_size: int) -> tuple[bytes, Stored | None]:
        """A chunk's CID and, for a compressing writer, its encoding (both on the pool)."""
        cid = self.hasher.raw(chunk)
        return cid, self.writer.encode(cid, chunk, float_size) if self.writer.compresses else None

    def _encode_small(self, cid: bytes, data: memoryview, dtype: str) -> Stored | None:
        return self.writer.encode(cid, data, float_size(dtype))

    def _write_chunked(self, plan: _Chunked) -> bytes:
        cids = []
        if len(plan.chunks) > 1:
            self.writer.expect_run(sum(chunk.nbytes for chunk in plan.chunks))  # one pack: mappable
        for i, chunk in enumerate(plan.chunks):
            cid, stored = self._hashing.next(plan, i).result()
            self.writer.put(cid, chunk, stored=stored, keep=True)  # the state is not changed meanwhile
            cids.append(cid)
        header = dict(plan.header)
        blob = header.pop("_blob")
        plan.chunks, plan.hashes, plan.owner = [], [], None
        return self._chunked_value(BLOB if blob else NDARRAY, header, cids)

    def write_chunks(self, chunks: list[memoryview], dtype: str, keep: Sequence[bool]) -> list[bytes]:
        """Store raw chunks of an array of ``dtype`` (hashed ahead on the pool as :meth:`write`
        hashes an array's); return their CIDs. ``keep[i]``: the caller leaves chunk ``i``
        unchanged until the writer commits (else it is copied as it is written)."""
        plan = _Chunked({}, chunks, float_size(dtype))
        self._hashing.add(plan)
        cids = []
        for i, chunk in enumerate(chunks):
            cid, stored = self._hashing.next(plan, i).result()
            self.writer.put(cid, chunk, stored=stored, keep=keep[i])
            cids.append(cid)
            self.logical_bytes += chunk.nbytes
        plan.chunks, plan.hashes = [], []
        return cids

    def array_value(self, dtype: str, shape: list[int], kind: str, cids: list[bytes]) -> Encoded:
        """The value of an array whose chunks (cut on this writer's ``chunk_size`` grid) are
        stored: in a state to :meth:`write`, encoded byte for byte as ``write`` encodes the
        array itself (``kind``: the tensor library it came from, "numpy" for none)."""
        header: dict[str, Any] = {"dtype": dtype, "shape": list(shape)}
        if kind != "numpy":
            header["kind"] = kind
        header["chunk_size"] = self.chunk_size
        return Encoded(self._chunked_value(NDARRAY, header, cids))

    def _chunked_value(self, code: int, header: dict[str, Any], cids: list[bytes]) -> bytes:
        """The encoding of an array or blob whose chunks are written: its links in ``chunks``,
        or in link pages past :data:`MAX_LINKS`."""
        links = [Link(c) for c in cids]
        if len(links) > MAX_LINKS:
            pages = [links[i : i + MAX_LINKS] for i in range(0, len(links), MAX_LINKS)]
            header["chunk_pages"] = [Link(self._put_node(codec.encode(p))) for p in pages]
        else:
            header["chunks"] = links
        return codec.encode(Tagged(code, header))

    def write_blob(self, source: BinaryIO, *, window: int = BLOB_WINDOW) -> bytes | Encoded:
        """The bytes ``source`` holds (read to its end) as a value of a state to :meth:`write`:
        byte for byte what ``write`` stores for those bytes (a blob of FastCDC chunks, or inline
        when short), reading ``window`` bytes at a time and holding at most a chunk more.

        Returns the bytes themselves when short, else an :class:`Encoded` blob whose chunks are
        written now.
        """
        first = source.read(INLINE_LIMIT + 1)
        if len(first) <= INLINE_LIMIT:
            return first
        window = max(window, CDC_MAX)  # a chunk at least: each read cuts what it completes
        pending, cids, size = bytearray(first), [], len(first)
        while True:
            more = source.read(window)
            pending += more
            size += len(more)
            view = memoryview(pending)
            cuts = list(fastcdc_cy(view, CDC_MIN, CDC_AVG, CDC_MAX, False, None))
            # A chunk's cut depends only on its own bytes; the last one may be cut short by the
            # end of what was read so far, so it waits for more (the next read starts with it).
            if more:
                cuts.pop()
            chunks = [view[c.offset : c.offset + c.length] for c in cuts]
            for chunk, (cid, stored) in zip(chunks, self.pool.map(self._digest, chunks, itertools.repeat(0)),
                                            strict=True):
                self.writer.put(cid, chunk, stored=stored)  # written or copied: the buffer is reused
                cids.append(cid)
            done = sum(c.nbytes for c in chunks)
            for chunk in chunks:
                chunk.release()
            view.release()
            del pending[:done]
            if not more:
                break
        self.logical_bytes += size
        return Encoded(self._chunked_value(BLOB, {"size": size}, cids))

    def _write_small(self, value: SmallArray | np.ndarray[Any, Any], kind: str | None = None) -> bytes:
        """A small array of the plan (``kind``: the tensor library a bare one comes from)."""
        encoded = self._small.encoding(value, self.writer)
        if encoded is not None:
            return encoded
        inline = value.inline() if type(value) is SmallArray else _plain_inline(value, kind)
        return self._pack(Tagged(NDARRAY, inline))

    def _describe_small(self, arrays: list[Any], cids: list[bytes], kind: str | None) -> list[bytes]:
        return _small.one_chunk_encodings(NDARRAY, arrays, cids, self.chunk_size, self._packer,
                                          _small_dtype, kind)

    def _put_node(self, data: bytes) -> bytes:
        cid = self.hasher.node(data)
        self.writer.put(cid, data)
        return cid


# torch's classes whose objects hold state but are not state (what each is, what to call it),
# recognised by name so that torch is never imported.
_STATEFUL = {
    ("torch.nn.modules.module", "Module"): ("a torch.nn.Module", "model"),
    ("torch.optim.optimizer", "Optimizer"): ("a torch optimizer", "optimizer"),
    ("torch.optim.lr_scheduler", "LRScheduler"): ("a learning-rate scheduler", "scheduler"),
    ("torch.optim.lr_scheduler", "_LRScheduler"): ("a learning-rate scheduler", "scheduler"),
    ("torch.amp.grad_scaler", "GradScaler"): ("a gradient scaler", "scaler"),
}


def page_runs(sizes: list[int], limit: int) -> list[tuple[int, int]]:
    """Cut items of these sizes into runs, in order: each run the longest that fits ``limit``
    bytes, and at least one item. A bisection per run, not a step per item (10,000 small
    tensors' map took 4 ms a save in that loop)."""
    ends = list(itertools.accumulate(sizes))
    runs = []
    start = 0
    while start < len(sizes):
        before = ends[start - 1] if start else 0
        end = max(bisect.bisect_right(ends, before + limit, start), start + 1)
        runs.append((start, end))
        start = end
    return runs


def _state_dict_hint(value: Any) -> str:
    """For an object that has a ``state_dict()`` (a model, an optimizer): save that instead."""
    found = next((_STATEFUL[key] for c in type(value).__mro__
                  if (key := (c.__module__, c.__name__)) in _STATEFUL), None)
    if found is None:
        try:
            has = callable(getattr(value, "state_dict", None))
        except Exception:  # an attribute lookup of an arbitrary object: only a hint is at stake
            has = False
        if not has:
            return ""
        found = ("an object with a state_dict() method", "obj")
    what, name = found
    return f": it is {what}; save its state_dict() instead (e.g. {{{name!r}: {name}.state_dict()}})"


def _release(plan: Any) -> None:
    """Cancel hashes still queued (after an error) so the pool does not keep working for nothing."""
    stack = [plan]
    while stack:
        item = stack.pop()
        if isinstance(item, _Chunked):
            for f in item.hashes:
                f.cancel()
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, Tagged):
            stack.append(item.value)


_SMALL = (SmallArray, np.ndarray)  # plan values of small arrays (a bare ndarray is a plain one)


def _small_dtype(value: SmallArray | np.ndarray[Any, Any]) -> str:
    """The stored dtype name of a small array of the plan."""
    if type(value) is SmallArray:
        return value.header["dtype"]  # type: ignore[no-any-return]
    return dtype_name(value.dtype)  # type: ignore[return-value]  # checked by the first walk


def _plain_inline(array: np.ndarray[Any, Any], kind: str | None = None) -> dict[str, Any]:
    """The inline ndarray map of a bare small array of the plan: what a :class:`SmallArray`
    of the same array and ``kind`` gives (the key order of ``_prepare_array``'s header)."""
    if kind is None:
        return {"dtype": _small_dtype(array), "shape": list(array.shape), "data": memoryview(array).cast("B")}
    return {"dtype": _small_dtype(array), "shape": list(array.shape), "kind": kind,
            "data": memoryview(array).cast("B")}


def _utf8(text: str, path: str) -> bytes:
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise StateTypeError(path, f"string is not valid Unicode text: {exc.reason}") from None


def _bigint_bytes(value: int) -> bytes:
    return value.to_bytes((value.bit_length() + 8) // 8, "big", signed=True)


@dataclass(frozen=True)
class TensorAdapter:
    """How the data model meets one tensor library; its integration registers it.

    The tree never imports a tensor library: a value is offered to the adapter whose ``module``
    its type comes from, and arrays saved with ``kind`` come back through ``from_numpy``.
    """

    kind: str  # the "kind" an array header records, e.g. "torch"
    module: str  # the top-level module of the library's types, e.g. "torch"
    is_tensor: Callable[[object], bool]
    to_numpy: Callable[[Any, str], np.ndarray[Any, Any]]  # (tensor, path): a host array, no copy
    # (array, header, map_location): the library's tensor, on map_location when one is given
    from_numpy: Callable[[np.ndarray[Any, Any], dict[str, Any], Any], Any]
    # (tensor, dtype): the tensor cast to ``dtype`` if it holds floating-point numbers, else itself
    cast_floats: Callable[[Any, Any], Any] | None = None
    # the numpy dtype for one of the library's dtype objects (torch.bfloat16...), or None
    numpy_dtype: Callable[[Any], np.dtype[Any] | None] | None = None
    # The fast paths of many small tensors, where the library offers them:
    # (values of one container): for each, its host array where that is all it takes (a plain
    # CPU tensor of a numpy dtype), else None (``to_numpy`` then checks it and says what is
    # wrong), in one call for the container rather than one per tensor
    host_arrays: Callable[[list[Any]], list[np.ndarray[Any, Any] | None]] | None = None
    # the exact types ``host_arrays`` takes (torch.Tensor, nn.Parameter); asked only once a value
    # of the library was seen, so the library is imported by then
    plain_types: Callable[[], tuple[type, ...]] | None = None
    # the function making a CPU tensor over a writable C-ordered array of a numpy dtype, sharing
    # its memory (torch.from_numpy), or None while the library is not imported: a load's small
    # arrays of this kind are made with it, one call each
    tensor_maker: Callable[[], Callable[[np.ndarray[Any, Any]], Any] | None] | None = None


_ADAPTERS: dict[str, TensorAdapter] = {}
# Value types -> the adapter whose host_arrays takes them, or None (looked up once per type).
_PLAIN_ADAPTERS: dict[type, TensorAdapter | None] = {}
_UNSEEN = object()


def register_tensor_adapter(adapter: TensorAdapter) -> None:
    """Make ``adapter``'s tensors savable (and loadable as themselves)."""
    _ADAPTERS[adapter.kind] = adapter
    _PLAIN_ADAPTERS.clear()


def _plain_adapter(kind: type) -> TensorAdapter | None:
    """The adapter whose ``host_arrays`` takes values of exactly this type, or None, kept in
    ``_PLAIN_ADAPTERS``: one dict look-up per type of a state dict's values, where
    ``adapter_for`` made several calls per value."""
    if kind in _PLAIN_ADAPTERS:
        return _PLAIN_ADAPTERS[kind]
    module = kind.__module__.partition(".")[0]
    found = next((adapter for adapter in _ADAPTERS.values()
                  if adapter.module == module and adapter.host_arrays is not None
                  and adapter.plain_types is not None and kind in adapter.plain_types()), None)
    if len(_PLAIN_ADAPTERS) < 256:  # the types of one state's values: a few
        _PLAIN_ADAPTERS[kind] = found
    return found


def _host_arrays(values: dict[Any, Any]) -> tuple[Iterable[np.ndarray[Any, Any] | None], str]:
    """The host array of each plain tensor among a dict's values (None for other values) and
    the kind they are of, from the adapter of the first such type: one call per container.
    ``_NO_HOSTS`` where none is a plain tensor (numpy's arrays, other values)."""
    for kind in set(map(type, values.values())):
        if kind is not np.ndarray:
            adapter = _PLAIN_ADAPTERS.get(kind, _UNSEEN)
            if adapter is _UNSEEN:
                adapter = _plain_adapter(kind)
            if adapter is not None:
                return adapter.host_arrays(list(values.values())), adapter.kind  # type: ignore[union-attr,misc]
    return _NO_HOSTS, "numpy"


_NO_HOSTS = itertools.repeat(None)  # never exhausted: zip stops at the dict's end


def adapter_for(value: object) -> TensorAdapter | None:
    """The adapter whose library ``value`` is a tensor of, or None."""
    module = type(value).__module__.partition(".")[0]
    for adapter in _ADAPTERS.values():
        if adapter.module == module and adapter.is_tensor(value):
            return adapter
    return None


def cast_floats(value: Any, dtype: Any) -> Any:
    """``value`` with every floating-point array and tensor in it cast to ``dtype`` (a numpy or a
    registered library's dtype); integers, bools and everything else stay as they are."""
    return _cast(value, dtype, _numpy_dtype(dtype))  # an unknown dtype fails before any copy


def _cast(value: Any, dtype: Any, target: np.dtype[Any]) -> Any:
    if isinstance(value, dict):
        return {k: _cast(v, dtype, target) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [_cast(v, dtype, target) for v in value]
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, np.ndarray):
        return value.astype(target) if _is_float(value.dtype) else value
    adapter = adapter_for(value)
    if adapter is not None and adapter.cast_floats is not None:
        return adapter.cast_floats(value, dtype)
    return value


def _is_float(dtype: np.dtype[Any]) -> bool:
    if dtype.kind == "f":
        return True
    name = (dtype_name(dtype) or "") if dtype.num >= _USER_DTYPES else ""
    return name.startswith(("float", "bfloat"))


def _numpy_dtype(dtype: Any) -> np.dtype[Any]:
    for adapter in _ADAPTERS.values():
        found = adapter.numpy_dtype(dtype) if adapter.numpy_dtype is not None else None
        if found is not None:
            return found
    try:
        return np.dtype(dtype)
    except TypeError:
        raise StateTypeError("dtype", f"{dtype!r} is not a dtype numpy or a tensor library knows") from None


def is_tensor(value: object) -> bool:
    """True if ``value`` is a tensor of a registered library (torch, once cas_ckpt is imported)."""
    return adapter_for(value) is not None


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------
TensorFactory = Callable[[np.ndarray[Any, Any], dict[str, Any]], Any]


class TreeReader:
    """Reads a tree back, fetching only the blocks of the part that is asked for."""

    def __init__(
        self,
        store: BlockStore,
        pool: Executor,
        *,
        verify: bool | None = None,
        tensor_factory: TensorFactory | None = None,
        map_location: Any = None,
        mmap: bool = False,
    ) -> None:
        self.store = store
        self.pool = pool
        self.verify = store.verify if verify is None else verify
        self.tensor_factory = tensor_factory
        self.map_location = map_location
        self.mmap = mmap
        self._fills: ThreadPoolExecutor | None = None
        self._waits: list[Callable[[], Any]] = []  # the store's own reads started (start_reads)
        self._futures: list[Future[None]] = []  # reads on the fill threads; load() waits for both
        self._small: _small.SmallReads | None = None
        # The buffers a load's small arrays share (_pick_small): [buffer or None, bytes used,
        # size of the next]. Separate allocations of 1-16 KiB each took four times as long to
        # make and first write as the same bytes in buffers large enough for huge pages.
        self._arena: list[Any] = [None, 0, 0]
        self._maker: tuple[str, Any] | tuple[()] = ()  # see _tensor_maker
        self.node_reads = 0
        self.mapped = self.copied = 0  # arrays an mmap load mapped, and those it had to copy
        # What this reader expanded: node bytes read (each distinct node once), node and page
        # bytes used (each as often as linked), and bytes allocated for arrays and byte strings.
        self._distinct: set[bytes] = set()
        self.stored_bytes = self.expanded_bytes = self.allocated = 0
        self._peeked: tuple[bytes, bytes] | None = None  # the node :meth:`peek` read last

    def node(self, cid: bytes) -> Any:
        self.node_reads += 1
        if self.node_reads > MAX_NODE_READS:
            raise DecodeError(
                f"over {MAX_NODE_READS} node reads for one value: its sub-trees are shared so "
                "many times that loading multiplies them (cas_ckpt never writes such a tree)",
                cid=cidlib.to_str(cid),
            )
        peeked, self._peeked = self._peeked, None
        if peeked is not None and peeked[0] == cid:
            data = peeked[1]
        else:
            data = self.store.get(cid, verify=self.verify)
        if cid not in self._distinct:
            self._distinct.add(cid)
            self.stored_bytes += len(data)
        self.expand(len(data), cid)
        return codec.decode(data, cid=cid)

    def peek(self, cid: bytes) -> bytes:
        """The encoded bytes of node ``cid``: read (and checked) once, whether the next
        :meth:`node` asks for the same node or not."""
        data = self.store.get(cid, verify=self.verify)
        self._peeked = (cid, data)
        return data

    def expand(self, size: int, cid: bytes) -> None:
        """Count ``size`` bytes of node ``cid`` used once more: :class:`ExpansionLimit` (before
        it is decoded or joined) when the tree expands far beyond the bytes it is stored in."""
        self.expanded_bytes += size
        if self.expanded_bytes > EXPANSION_FACTOR * self.stored_bytes \
                and self.expanded_bytes > (floor := expansion_floor()):
            raise ExpansionLimit(self.expanded_bytes, self.stored_bytes, floor, cidlib.to_str(cid))

    def reserve(self, nbytes: int, what: str) -> None:
        """Count ``nbytes`` about to be allocated: :class:`OutOfMemory` once a read would hold
        more than the process could ever get (Linux overcommits: past that it would be killed)."""
        self.allocated += nbytes
        if self.allocated > memory_limit():
            raise OutOfMemory(f"cannot allocate {nbytes} bytes for {what}: this read would hold "
                              f"{self.allocated}, more than the {memory_limit()} bytes of memory "
                              "and swap this machine has")

    # -- navigation ----------------------------------------------------------------------------
    def resolve(self, value: Any, depth: int = 0) -> Any:
        """Follow links and pages until a value with content is at hand (metadata only)."""
        while True:
            if depth > MAX_DEPTH:
                raise DecodeError(f"links nested deeper than {MAX_DEPTH}")
            if isinstance(value, Link):
                value = self.node(value.cid)
                depth += 1
            elif isinstance(value, Tagged) and value.code == PAGES:
                return self._join_pages(value.value)
            else:
                return value

    def _join_pages(self, spec: Any) -> Any:
        if not isinstance(spec, dict) or spec.get("kind") not in ("map", "list", "tuple"):
            raise DecodeError("malformed page set")
        # Pages are read one at a time (a bad one fails before the rest are read), and a page
        # repeated is decoded once: a hostile page set cannot multiply the decoding work.
        pages = _Pages(self)
        try:
            if spec["kind"] == "map":
                joined: dict[Any, Any] = {}
                for link in _seq(spec.get("pages"), "pages"):
                    page = pages.get(_link(link).cid)
                    if not isinstance(page, dict):
                        raise DecodeError("map page is not a map")
                    for key in page:
                        if key in joined:
                            raise DecodeError(f"key {key!r} appears in two pages")
                    joined.update(page)
                return joined
            items: list[Any] = []
            for link in _seq(spec.get("pages"), "pages"):
                page = pages.get(_link(link).cid)
                if not isinstance(page, list):
                    raise DecodeError("list page is not a list")
                items.extend(page)
        except MemoryError:
            raise OutOfMemory("joining the pages of a container ran out of memory") from None
        return Tagged(TUPLE, items) if spec["kind"] == "tuple" else items

    # -- materialising -------------------------------------------------------------------------
    def load(self, value: Any) -> Any:
        """Turn a decoded value into Python objects, reading what it links to.

        Arrays are allocated as the tree is walked and filled in the background (by the store's
        own reads, :meth:`BlockStore.start_reads`, or else several at a time on fill threads),
        so small arrays keep the read threads as busy as large ones; all are complete before
        this returns.
        """
        self._waits, self._futures = [], []
        self.allocated = 0  # what this load holds (a reader used again has freed its last ones)
        self._maker = self._tensor_maker()
        small = self._small = _small.SmallReads(self.store, self.pool, self.verify, self._filler)
        failed = True
        try:
            # Paused while the walk makes objects and the store's own reads (copies in memory)
            # end; not while the fill threads' reads do, which on S3 can take long.
            with cyclic_gc_paused():
                result = self._load(value, 0)
                small.flush()
                for wait in [*self._waits, *small.waits]:
                    wait()
                self._waits = small.waits = []  # freed while paused: their objects count no more
            for future in [*self._futures, *small.futures]:
                future.result()
            failed = False
        finally:
            # The arena too: its last buffer lives on in the arrays made in it, not in the reader.
            self._small, self._waits, self._futures, self._arena = None, [], [], [None, 0, 0]
            if self._fills is not None:
                self._fills.shutdown(cancel_futures=failed)  # the reads running end first
                self._fills = None
        return result

    def _tensor_maker(self) -> tuple[str, Any] | tuple[()]:
        """The kind of tensor a load's small arrays saved from tensors are made as in one loop
        (see ``_pick_small``), and its maker: where tensors stay on the CPU as loaded (no
        ``map_location``, no ``tensor_factory``) and the library is imported; else nothing."""
        if self.tensor_factory is not None or self.map_location is not None:
            return ()
        for adapter in _ADAPTERS.values():
            make = adapter.tensor_maker() if adapter.tensor_maker is not None else None
            if make is not None:
                return adapter.kind, make
        return ()

    def _filler(self) -> Executor:
        """The threads that fill arrays a store cannot read on its own (started on first need)."""
        if self._fills is None:
            self._fills = ThreadPoolExecutor(FILLS_IN_FLIGHT, thread_name_prefix="cas_ckpt-fill")
        return self._fills

    def _later(self, read: Callable[..., None], *args: Any, **kwargs: Any) -> None:
        """Run ``read`` on the fill threads; :meth:`load` waits for it."""
        self._futures.append(self._filler().submit(read, *args, **kwargs))

    def _load(self, value: Any, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise DecodeError(f"state nested deeper than {MAX_DEPTH}")
        node = value.cid if type(value) is Link else None  # a malformed value inside names it
        try:
            value = self.resolve(value, depth)
            try:
                if isinstance(value, dict):
                    return self._flushed(self._load_map(value, depth))
                if isinstance(value, list):
                    return self._flushed(self._load_list(value, depth))
            except MemoryError as exc:
                if isinstance(exc, OutOfMemory):
                    raise
                raise OutOfMemory(f"no memory for a container of {len(value)} items") from None
            if isinstance(value, Tagged):
                return self._load_tagged(value, depth)
            if value is None or isinstance(value, (bool, int, float, str, bytes)):
                return value
            raise DecodeError(f"unexpected {type(value).__name__} in a state node")
        except DecodeError as exc:  # one frame per level, not two: deep states stay loadable
            if node is not None and exc.cid is None:
                exc.cid = cidlib.to_str(node)
            raise

    def _flushed(self, container: Any) -> Any:
        """``container``, its small arrays' reads started: one batch holds one container's."""
        if self._small is not None:
            self._small.flush()
        return container

    # A MapLocationError or DecodeError learns the path inside the state on its way out, one
    # level each.
    def _load_map(self, value: dict[Any, Any], depth: int) -> dict[Any, Any]:
        items: Any = value.items()
        if _pick_small is not None and self._small is not None and not self.mmap and depth < MAX_DEPTH:
            # The usual small arrays at once, in their places; the other keys, holding None
            # meanwhile, in order below.
            out, cids, arrays, rest = _pick_small(value, self._arena, *self._maker)
            self._small.add_many(cids, arrays)
            items = ((key, value[key]) for key in rest)
        else:
            out = {}
        key = None
        try:
            for key, item in items:
                if type(item) is Tagged and item.code == NDARRAY and type(item.value) is dict \
                        and depth < MAX_DEPTH:
                    out[key] = self._load_array(item.value)  # a state dict's usual value, direct
                else:
                    out[key] = self._load(item, depth + 1)
        except (MapLocationError, DecodeError) as exc:
            exc.inside(key)
            raise
        return out

    def _load_list(self, value: Sequence[Any], depth: int) -> list[Any]:
        out: list[Any] = []
        try:
            for item in value:
                if type(item) is Tagged and item.code == NDARRAY and type(item.value) is dict \
                        and depth < MAX_DEPTH:
                    out.append(self._load_array(item.value))
                else:
                    out.append(self._load(item, depth + 1))
        except (MapLocationError, DecodeError) as exc:
            exc.inside(len(out))  # the index of the item that failed
            raise
        return out

    def _load_tagged(self, value: Tagged, depth: int) -> Any:
        code, body = value.code, value.value
        if code == TUPLE:
            return tuple(self._load_list(_seq(body, "tuple"), depth))
        if code == BIGINT:
            if not isinstance(body, bytes) or not body:
                raise DecodeError("malformed bigint")
            return int.from_bytes(body, "big", signed=True)
        if code == NDARRAY:
            return self._load_array(_map(body, "ndarray"))
        if code == BLOB:
            return self._load_blob(_map(body, "blob"))
        if code == SCALAR:
            body = _map(body, "scalar")
            dtype = parse_dtype(body.get("dtype"))
            data = body.get("data")
            if not isinstance(data, bytes) or len(data) != dtype.itemsize:
                raise DecodeError("malformed numpy scalar")
            return np.frombuffer(data, dtype=dtype)[0]
        if code == CID_VALUE:
            if type(body) is not Link:
                raise DecodeError("malformed CID value: expected a link")
            return cidlib.to_cid(body.cid)
        raise DecodeError(f"unknown extension type {code}")

    def chunk_links(self, header: dict[str, Any]) -> list[bytes]:
        """The chunk CIDs of an array's or blob's descriptor, in order (link pages read here)."""
        return self._chunk_links(header)

    def _chunk_links(self, header: dict[str, Any]) -> list[bytes]:
        chunks = header.get("chunks")
        if type(chunks) is list and len(chunks) == 1 and type(chunks[0]) is Link \
                and "chunk_pages" not in header:
            return [chunks[0].cid]  # one chunk: every small array given a block of its own
        if "chunk_pages" in header:
            links: list[Any] = []
            pages = _Pages(self, expands=False)  # a page repeated is decoded once
            for page in _seq(header["chunk_pages"], "chunk_pages"):
                links.extend(_seq(pages.get(_link(page).cid), "chunk page"))
        else:
            links = list(_seq(header.get("chunks"), "chunks"))
        return [_link(x).cid for x in links]

    def _fill(
        self, cids: list[bytes], sizes: list[int], out: memoryview, *, later: bool = False
    ) -> None:
        """Read chunks into consecutive slices of ``out`` (in parallel: see the store).

        ``later``: start now, finish before :meth:`load` returns.
        """
        if sum(sizes) != out.nbytes:
            raise DecodeError(f"chunks hold {sum(sizes)} bytes, expected {out.nbytes}")
        if later and self._small is not None:
            offsets = [0, *itertools.accumulate(sizes)]
            wait = self.store.start_reads(
                cids, [out[offsets[i] : offsets[i + 1]] for i in range(len(cids))], verify=self.verify
            )
            if wait is None:
                self._later(self.store.get_many_into, cids, sizes, out, self.pool, verify=self.verify)
            else:
                self._waits.append(wait)
            return
        self.store.get_many_into(cids, sizes, out, self.pool, verify=self.verify)

    def _sizes(self, cids: list[bytes]) -> list[int]:
        return self.store.sizes(cids)

    def _array_sizes(self, header: dict[str, Any], cids: list[bytes], nbytes: int) -> list[int]:
        """The sizes of an array's chunks: the store's, or where asking costs a request each
        (``sizes_known`` False), what the format makes them (``chunk_size`` bytes each, the
        last the remainder); the reads then refuse a block of another size."""
        size = header.get("chunk_size")
        if self.store.sizes_known or type(size) is not int or not 0 < size <= MAX_CHUNK or not cids:
            return self._sizes(cids)
        last = nbytes - size * (len(cids) - 1)
        if not 0 < last <= size:
            raise DecodeError(f"{len(cids)} chunks of {size} bytes cannot hold the array's {nbytes}")
        return [size] * (len(cids) - 1) + [last]

    def _load_array(self, header: dict[str, Any]) -> Any:
        if len(header) == 4 and self._small is not None and not self.mmap:
            array = self._load_small(header)
            if array is not None:
                return array
        dtype = parse_dtype(header.get("dtype"))
        shape = header.get("shape")
        if not _valid_shape(shape):
            raise DecodeError(f"malformed array shape {shape!r}")
        if len(shape) > MAX_DIMS:
            raise DecodeError(f"array has more than {MAX_DIMS} dimensions")
        order = header.get("order", "C")
        if order not in ("C", "F"):
            raise DecodeError(f"unknown array order {order!r}")
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes > sys.maxsize:
            raise DecodeError(f"array of shape {shape} is larger than any buffer")
        if "data" in header:
            data = header["data"]
            if not isinstance(data, bytes) or len(data) != nbytes:
                raise DecodeError("inline array data does not match its shape")
            flat = np.frombuffer(data, dtype=np.uint8).copy()
        else:
            kind = header.get("kind", "numpy")
            # A small tensor is copied even by a mapped load: a copy-on-write mapping of its own
            # costs a syscall, a page and a file descriptor (Python's mmap keeps a duplicate):
            # 10,000 took 1.3 s and the next load ran out of descriptors.
            mapping = self.mmap and (kind == "numpy" or nbytes > INLINE_LIMIT)
            # Allocate first: a declared size the process cannot hold fails here, before any
            # chunk link page is read (one chunk repeated can declare terabytes in a small node).
            out = None if mapping or nbytes <= INLINE_LIMIT else self._allocate(nbytes, shape)
            cids = self._chunk_links(header)
            if not mapping and len(cids) == 1 and nbytes <= INLINE_LIMIT and self._small \
                    and (kind == "numpy" or (self.tensor_factory is None and self.map_location is None)):
                return self._read_small(cids[0], dtype, shape, nbytes, order, header)
            sizes = self._array_sizes(header, cids, nbytes)  # the size really stored, checked
            if sum(sizes) != nbytes:
                raise DecodeError(f"array chunks hold {sum(sizes)} bytes, shape needs {nbytes}")
            # numpy: a read-only view of the pack. Tensors have no read-only flag, and a write
            # through a read-only mapping kills the process: they get a copy-on-write one.
            mapped = self.store.map_blocks(cids, private=kind != "numpy") if mapping else None
            if mapped is not None:
                self._verify_mapped(cids, sizes, mapped)
                flat = np.frombuffer(mapped, dtype=np.uint8)  # backed by the pack
                self.mapped += 1
            else:
                self.copied += mapping
                flat = out if out is not None else self._allocate(nbytes, shape)
                # A tensor moved to map_location is copied at once: its bytes must be there.
                later = kind == "numpy" or (self.tensor_factory is None and self.map_location is None)
                self._fill(cids, sizes, memoryview(flat), later=later)
        return self._shaped(flat, dtype, shape, order, header)

    def _allocate(self, nbytes: int, shape: list[int]) -> np.ndarray[Any, Any]:
        if nbytes > INLINE_LIMIT:  # smaller ones: bounded by the nodes holding them (expand)
            self.reserve(nbytes, f"an array of shape {shape}")
        return _allocate(nbytes, shape)

    def _load_small(self, header: dict[str, Any]) -> np.ndarray[Any, Any] | None:
        """The usual small array at once: a header of exactly dtype, shape, chunk_size and one
        chunk, of a numpy dtype with a buffer, C order, 1 byte to INLINE_LIMIT. None for any
        other header: the general path reads it (or says what is wrong), to the same array.

        10,000 small arrays: about 2 us less each than the general path's calls. In a map, the
        compiled ``_pick_small`` makes the same arrays in one loop (about 4 us less each again).
        """
        name, shape, chunks = header.get("dtype"), header.get("shape"), header.get("chunks")
        dtype = _PARSED.get(name) if type(name) is str else None
        if dtype is None or id(dtype) not in _BUFFER_DTYPES or "chunk_size" not in header \
                or type(chunks) is not list or len(chunks) != 1 or type(chunks[0]) is not Link \
                or not _valid_shape(shape) or len(shape) > MAX_DIMS:
            return None
        nbytes = math.prod(shape) * dtype.itemsize
        if not 0 < nbytes <= INLINE_LIMIT:
            return None
        array = np.empty(shape, dtype)
        self._small.add(chunks[0].cid, array)  # type: ignore[union-attr]
        return array

    def _read_small(
        self, cid: bytes, dtype: np.dtype[Any], shape: list[int], nbytes: int, order: str,
        header: dict[str, Any],
    ) -> Any:
        """A one-block array, read with its container's others (see ``SmallReads``; the read
        checks the stored size)."""
        assert self._small is not None
        # A byte view of a zero-size array cannot be made (a hostile node's: saves inline them).
        if nbytes and order == "C" and id(dtype) in _BUFFER_DTYPES and "kind" not in header:
            array = np.empty(shape, dtype)  # at once: a third of the cost of view and reshape
            self._small.add(cid, array)
            return array
        flat = _allocate(nbytes, shape)
        self._small.add(cid, flat)
        return self._shaped(flat, dtype, shape, order, header)

    def _shaped(
        self, flat: np.ndarray[Any, Any], dtype: np.dtype[Any], shape: list[int], order: str,
        header: dict[str, Any],
    ) -> Any:
        """The array (or tensor) over the bytes of ``flat``."""
        array = flat.view(dtype)
        try:
            array = array.reshape(shape[::-1]).T if order == "F" else array.reshape(shape)
        except ValueError as exc:  # e.g. a zero-size shape whose other dimensions overflow
            raise DecodeError(f"array shape {shape} is impossible: {exc}") from None
        kind = header.get("kind", "numpy")
        if kind == "numpy":
            return array
        if self.tensor_factory is not None:
            return self.tensor_factory(array, header)
        adapter = _ADAPTERS.get(kind)
        return array if adapter is None else adapter.from_numpy(array, header, self.map_location)

    def _verify_mapped(self, cids: list[bytes], sizes: list[int], view: memoryview) -> None:
        """Start checking the mapped chunks of one array against their CIDs, in one job of the
        compiled pool where it is built (no task or GIL hand-over per chunk), while the walk
        maps the next arrays; :meth:`load` waits for it, and a damaged chunk fails the load."""
        if not self.verify:
            return
        offsets = [0, *itertools.accumulate(sizes)]
        wrong = cidlib.start_checks(cids, [view[offsets[i] : offsets[i + 1]] for i in range(len(cids))])

        def wait() -> None:
            bad = wrong()
            if bad:
                raise CorruptBlock(cidlib.to_str(cids[bad[0]]))

        self._waits.append(wait)

    def _load_blob(self, header: dict[str, Any]) -> bytes | str:
        size = header.get("size")
        if type(size) is not int or size < 0:
            raise DecodeError("malformed blob size")
        if size > sys.maxsize:
            raise DecodeError(f"blob of {size} bytes is larger than any buffer")
        self.reserve(size, f"a byte string of {size} bytes")
        try:
            buffer = bytearray(size)  # first: a size the process cannot hold fails here
        except MemoryError:
            raise OutOfMemory(f"cannot allocate {size} bytes for a byte string") from None
        cids = self._chunk_links(header)
        sizes = self._sizes(cids)
        if sum(sizes) != size:
            raise DecodeError(f"blob chunks hold {sum(sizes)} bytes, header says {size}")
        self._fill(cids, sizes, memoryview(buffer))
        if header.get("str"):
            try:
                return buffer.decode("utf-8")
            except UnicodeDecodeError:
                raise DecodeError("text blob is not UTF-8") from None
        return bytes(buffer)


class _Pages:
    """Decoded page nodes of one container or one chunk list, each decoded once.

    ``expands``: a page used again counts as expanding the tree (:meth:`TreeReader.expand`). A
    chunk list's pages do not: the array's declared size bounds them, allocated first.
    """

    def __init__(self, reader: TreeReader, *, expands: bool = True) -> None:
        self.reader = reader
        self.expands = expands
        self.seen: dict[bytes, tuple[Any, int]] = {}

    def get(self, cid: bytes) -> Any:
        found = self.seen.get(cid)
        if found is None:
            before = self.reader.expanded_bytes
            page = self.reader.node(cid)
            self.seen[cid] = (page, self.reader.expanded_bytes - before)
            return page
        page, size = found
        if self.expands:  # joined again as if read again: counted as a read, and its bytes
            self.reader.node_reads += 1
            self.reader.expand(size, cid)
        return page


def expansion_floor() -> int:
    """The expansion floor: ``$CAS_CKPT_MAX_EXPANSION`` bytes if set, else :data:`EXPANSION_FLOOR`."""
    given = os.environ.get(EXPANSION_ENV, "").strip()
    return int(given) if given.isdigit() else EXPANSION_FLOOR


def _allocate(nbytes: int, shape: list[int]) -> np.ndarray[Any, Any]:
    try:
        return np.empty(nbytes, dtype=np.uint8)
    except MemoryError:  # the message is made only here: once per array it cost a microsecond
        raise OutOfMemory(f"cannot allocate {nbytes} bytes for an array of shape {shape}") from None


def _valid_shape(shape: Any) -> bool:
    if type(shape) is list and len(shape) == 1:  # the common case, without a generator
        return type(shape[0]) is int and shape[0] >= 0
    return isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)


def _link(value: Any) -> Link:
    if not isinstance(value, Link):
        raise DecodeError("expected a link")
    return value


def _seq(value: Any, what: str) -> list[Any]:
    if not isinstance(value, list):
        raise DecodeError(f"malformed {what}: expected a list")
    return value


def _map(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise DecodeError(f"malformed {what}: expected a map")
    return value
