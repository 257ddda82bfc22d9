"""One grid of chunks per tensor, whoever writes it: the geometry of sharded saves and reads.

A tensor's raw chunks are cut at fixed offsets of the whole tensor's bytes (row-major,
``chunk_size`` each, the last the remainder): the grid :meth:`TreeWriter.write` uses for an
array saved from one process. When several ranks each hold a box of the tensor (a DCP shard),
each grid chunk lying inside one rank's bytes is hashed and stored by that rank where it is;
a chunk across two or more ranks' boxes is assembled by the rank holding most of its bytes
(the lowest such rank on a tie) from the others' pieces (:class:`Exchange` plans which bytes
go where). So the same tensor is the same chunks, whatever the sharding, and a checkpoint
written by many ranks loads as one tensor.

:func:`read_region` reads a box of a chunked array, fetching only the chunks it overlaps.
:func:`state_root` sees through the root node of a sharded save (``docs/format.md``, "Sharded
checkpoints") to the state it holds. No torch here: ``cas_ckpt.dcp`` builds on this.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from cas_ckpt import cid as cidlib
from cas_ckpt.codec import Link
from cas_ckpt.errors import BlockNotFound, DecodeError, RepositoryError
from cas_ckpt.tree import TreeReader, parse_dtype

__all__ = ["SHARDED_FORMAT", "SHARDED_LAYOUT", "Exchange", "Piece", "Round", "box_runs", "read_region",
           "state_root"]

SHARDED_FORMAT = "cas_ckpt.dcp"  # the "format" of a sharded save's root node
SHARDED_LAYOUT = 2  # its "version": 1 kept each rank's shard as an array of its own (0.2)
# The encoded start of a layout-2 root node, a map of 4 whose first key is "format": a root that
# starts otherwise is the state itself and is never decoded twice.
_ROOT_PREFIX = b"\x84\xa6format"
WINDOW = 16 * 1024 * 1024  # bytes one exchange round moves to or from a rank, and a region read holds


# --------------------------------------------------------------------------------------------
# Boxes as byte runs
# --------------------------------------------------------------------------------------------
def byte_strides(shape: Sequence[int], itemsize: int) -> list[int]:
    """Row-major byte strides of an array of ``shape``."""
    strides, step = [], itemsize
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return strides[::-1]


def box_runs(shape: Sequence[int], itemsize: int, offsets: Sequence[int], sizes: Sequence[int]
             ) -> tuple[np.ndarray, int]:
    """The contiguous byte runs of a box of a row-major array: their starts (ascending, in the
    box's own row-major order, so run ``i`` is bytes ``i * length`` of the box copied out) and
    their common length. A box over whole trailing dimensions is few long runs; a dim-0 box one."""
    if any(s == 0 for s in sizes):
        return np.zeros(0, np.int64), 0
    strides = byte_strides(shape, itemsize)
    d = len(shape) - 1
    while d >= 0 and offsets[d] == 0 and sizes[d] == shape[d]:
        d -= 1
    if d < 0:  # the whole array (a scalar too)
        return np.zeros(1, np.int64), math.prod(shape) * itemsize
    starts = np.array([sum(offsets[j] * strides[j] for j in range(d + 1))], np.int64)
    for j in range(d):
        starts = (starts[:, None] + np.arange(sizes[j], dtype=np.int64) * strides[j]).ravel()
    return starts, sizes[d] * strides[d]


# --------------------------------------------------------------------------------------------
# Planning an exchange
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Piece:
    """The box of a tensor one rank holds."""

    rank: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


@dataclass
class _Tensor:
    """One tensor's grid: who stores each chunk, and the pieces of those it must assemble."""

    name: str
    nbytes: int
    chunk_size: int
    owners: np.ndarray  # rank storing each chunk (of an assembled one: the rank holding most of it)
    assembled: np.ndarray  # bool per chunk: made of pieces (else inside one run of its owner)
    local_offsets: np.ndarray  # per chunk not assembled: where it starts in its owner's box
    # one row per piece of an assembled chunk, sorted by (chunk, start): chunk, src rank,
    # global start, length, offset in the src rank's box (its bytes in row-major order)
    segments: np.ndarray

    @property
    def chunks(self) -> int:
        return len(self.owners)

    def span(self, k: int) -> tuple[int, int]:
        start = k * self.chunk_size
        return start, min(self.nbytes, start + self.chunk_size)


def _plan_tensor(name: str, shape: Sequence[int], itemsize: int, pieces: Sequence[Piece],
                 chunk_size: int) -> _Tensor:
    nbytes = math.prod(shape) * itemsize
    rows = []
    for piece in pieces:
        starts, length = box_runs(shape, itemsize, piece.offsets, piece.sizes)
        if length:
            rows.append(np.stack([starts, np.full_like(starts, length), np.full_like(starts, piece.rank),
                                  np.arange(len(starts), dtype=np.int64) * length], axis=1))
    runs = np.concatenate(rows) if rows else np.zeros((0, 4), np.int64)
    runs = runs[np.argsort(runs[:, 0], kind="stable")]
    _check_cover(name, runs, nbytes)
    starts, ends = runs[:, 0], runs[:, 0] + runs[:, 1]
    count = -(-nbytes // chunk_size)
    chunk_starts = np.arange(count, dtype=np.int64) * chunk_size
    holder = np.searchsorted(starts, chunk_starts, side="right") - 1  # the run with each chunk's start
    owners = runs[holder, 2]
    local_offsets = runs[holder, 3] + chunk_starts - starts[holder]
    chunk_ends = np.minimum(chunk_starts + chunk_size, nbytes)
    first, last = starts // chunk_size, (ends - 1) // chunk_size
    # a run is partial in its first chunk if it starts after it, in its last if it ends before
    # it (a run within one chunk: either); a chunk between the two lies inside the run
    segs = []
    for which, chunk in (("first", first), ("last", last)):
        seg_start = np.maximum(starts, chunk * chunk_size)
        seg_end = np.minimum(ends, chunk_ends[chunk])
        partial = (seg_start > chunk * chunk_size) | (seg_end < chunk_ends[chunk])
        if which == "last":
            partial &= last != first
        pick = np.nonzero(partial)[0]
        segs.append(np.stack([chunk[pick], runs[pick, 2], seg_start[pick], seg_end[pick] - seg_start[pick],
                              runs[pick, 3] + seg_start[pick] - starts[pick]], axis=1))
    segments = np.concatenate(segs)
    segments = segments[np.lexsort((segments[:, 2], segments[:, 0]))]
    assembled = np.zeros(count, bool)
    assembled[segments[:, 0]] = True
    if len(segments):  # a chunk across boxes goes to the rank holding most of it: least moves
        width = int(runs[:, 2].max()) + 1
        key = segments[:, 0] * width + segments[:, 1]
        order = np.argsort(key, kind="stable")
        pairs, starts_at = np.unique(key[order], return_index=True)
        held = np.add.reduceat(segments[order, 3], starts_at)
        chunk_of, rank_of = pairs // width, pairs % width
        best = np.lexsort((rank_of, -held, chunk_of))  # by chunk, most bytes first, lowest rank on ties
        lead = best[np.r_[True, chunk_of[best][1:] != chunk_of[best][:-1]]]
        owners[chunk_of[lead]] = rank_of[lead]
    return _Tensor(name, nbytes, chunk_size, owners, assembled, local_offsets, segments)


def _check_cover(name: str, runs: np.ndarray, nbytes: int) -> None:
    """Refuse pieces that leave bytes of the tensor unwritten, or write some twice."""
    if not len(runs):
        raise RepositoryError(f"no rank wrote any bytes of {name!r}")
    starts, ends = runs[:, 0], runs[:, 0] + runs[:, 1]
    gaps = np.nonzero(starts[1:] != ends[:-1])[0]
    if starts[0] != 0 or len(gaps) or ends[-1] != nbytes:
        if starts[0] != 0:
            a, b = 0, int(starts[0])
        elif len(gaps):
            a, b = int(ends[gaps[0]]), int(starts[gaps[0] + 1])
        else:
            a, b = int(ends[-1]), nbytes
        if b < a:
            raise RepositoryError(f"two ranks wrote bytes {b}-{a} of {name!r} (overlapping shards)")
        raise RepositoryError(f"no rank wrote bytes {a}-{b} of {name!r} ({nbytes} bytes)")


_Stores = tuple[int, list[int], list[memoryview], list[bool]]  # tensor, chunks, bytes, views


@dataclass(frozen=True)
class Round:
    """One exchange: the chunks ``(tensor, chunk)`` from ``start`` up to ``stop`` (exclusive),
    in tensor then chunk order, with what each rank sends to and receives from each other."""

    start: tuple[int, int]
    stop: tuple[int, int]
    send: np.ndarray  # [src, dst] bytes
    segments: list[np.ndarray]  # per tensor: the rows of its segments in this round


class Exchange:
    """Who stores which grid chunk of each tensor, and the rounds of bytes that move between
    ranks so that every chunk is stored whole (at most :data:`WINDOW` bytes to or from a rank a
    round). Every rank builds the same plan from the same pieces, so they agree on it without
    talking: rounds, their order and their sizes.
    """

    def __init__(self, tensors: Sequence[tuple[str, Sequence[int], int, Sequence[Piece]]],
                 chunk_size: int, world: int, *, window: int = WINDOW) -> None:
        self.world = world
        self.tensors = [_plan_tensor(name, shape, itemsize, pieces, chunk_size)
                        for name, shape, itemsize, pieces in tensors]
        self.rounds = self._rounds(window)

    def _rounds(self, window: int) -> list[Round]:
        """Cut the transfers, in (tensor, chunk) order, into rounds: a round ends before the
        chunk that would take some rank past ``window`` bytes sent or received (a round holds
        at least one chunk)."""
        rounds: list[Round] = []
        start = (0, 0)
        sent, got = [0] * self.world, [0] * self.world
        send = np.zeros((self.world, self.world), np.int64)
        picked: list[list[np.ndarray]] = [[] for _ in self.tensors]

        def close(stop: tuple[int, int]) -> None:
            segments = [np.concatenate(p) if p else np.zeros((0, 5), np.int64) for p in picked]
            rounds.append(Round(start, stop, send.copy(), segments))

        for t, tensor in enumerate(self.tensors):
            segs = tensor.segments
            if not len(segs):
                continue
            moving = segs[tensor.owners[segs[:, 0]] != segs[:, 1]]
            if not len(moving):
                picked[t].append(segs)
                continue
            chunk_of = moving[:, 0].tolist()
            src_of, size_of = moving[:, 1].tolist(), moving[:, 3].tolist()
            dst_of = tensor.owners[moving[:, 0]].tolist()
            bounds = [0, *(np.flatnonzero(np.diff(moving[:, 0])) + 1).tolist(), len(moving)]
            first_row = 0  # rows of segs (moving or not) not yet in a round
            for a, b in itertools.pairwise(bounds):
                extra_sent: dict[int, int] = {}
                extra_got: dict[int, int] = {}
                for i in range(a, b):
                    extra_sent[src_of[i]] = extra_sent.get(src_of[i], 0) + size_of[i]
                    extra_got[dst_of[i]] = extra_got.get(dst_of[i], 0) + size_of[i]
                over = any(sent[r] + n > window for r, n in extra_sent.items()) or \
                    any(got[r] + n > window for r, n in extra_got.items())
                if over and send.any():
                    stop = (t, chunk_of[a])
                    cut = int(np.searchsorted(segs[:, 0], chunk_of[a]))
                    picked[t].append(segs[first_row:cut])
                    first_row = cut
                    close(stop)
                    start, sent, got = stop, [0] * self.world, [0] * self.world
                    send[:] = 0
                    picked = [[] for _ in self.tensors]
                for i in range(a, b):
                    send[src_of[i], dst_of[i]] += size_of[i]
                for r, n in extra_sent.items():
                    sent[r] += n
                for r, n in extra_got.items():
                    got[r] += n
            picked[t].append(segs[first_row:])
        close((len(self.tensors), 0))
        return rounds

    def chunks_in(self, t: int, round_: Round) -> range:
        """The chunks of tensor ``t`` that ``round_`` covers."""
        (t0, k0), (t1, k1) = round_.start, round_.stop
        if t < t0 or t > t1 or (t == t1 and k1 == 0):
            return range(0)
        return range(k0 if t == t0 else 0, k1 if t == t1 else self.tensors[t].chunks)

    def outgoing(self, rank: int, round_: Round, data: dict[str, np.ndarray]) -> list[np.ndarray]:
        """What ``rank`` sends each rank in ``round_``: the pieces of their chunks it holds,
        concatenated in (tensor, chunk, start) order. ``data``: the rank's box of each tensor,
        its bytes in row-major order (a tensor missing there, on a rank that failed, is sent as
        zeros of the same size, so that the exchange still completes)."""
        parts: list[list[np.ndarray]] = [[] for _ in range(self.world)]
        for t, segs in enumerate(round_.segments):
            tensor = self.tensors[t]
            raw = data.get(tensor.name)
            for chunk, _src, _start, length, offset in segs[segs[:, 1] == rank]:
                dst = int(tensor.owners[chunk])
                if dst != rank:
                    parts[dst].append(raw[offset : offset + length] if raw is not None
                                      else np.zeros(length, np.uint8))
        return [np.concatenate(p) if p else np.zeros(0, np.uint8) for p in parts]

    def incoming(self, rank: int, round_: Round, got: list[np.ndarray]) -> dict[tuple[int, int], np.ndarray]:
        """The pieces ``rank`` received in ``round_`` (``got``: what each rank sent it), by
        (tensor, global start)."""
        found: dict[tuple[int, int], np.ndarray] = {}
        cursor = [0] * self.world
        for t, segs in enumerate(round_.segments):
            tensor = self.tensors[t]
            mine = segs[(tensor.owners[segs[:, 0]] == rank) & (segs[:, 1] != rank)]
            for _chunk, src, start, length, _offset in mine:
                found[(t, int(start))] = got[src][cursor[src] : cursor[src] + length]
                cursor[src] += length
        return found

    def stored(self, rank: int, round_: Round, data: dict[str, np.ndarray],
               received: dict[tuple[int, int], np.ndarray]) -> Iterator[_Stores]:
        """The chunks ``rank`` stores in ``round_``, tensor by tensor: (tensor, chunk numbers, their
        bytes, which are views of ``data`` that stay valid while it does). A chunk inside the
        rank's box is a view of it; one across boxes is assembled from its pieces."""
        for t, tensor in enumerate(self.tensors):
            ks = [k for k in self.chunks_in(t, round_) if tensor.owners[k] == rank]
            if not ks:
                continue
            raw = data[tensor.name]
            segs = round_.segments[t]
            chunks, views = [], []
            for k in ks:
                a, b = tensor.span(k)
                if not tensor.assembled[k]:
                    at = int(tensor.local_offsets[k])
                    chunks.append(memoryview(raw[at : at + b - a]))
                    views.append(True)
                    continue
                buffer = np.empty(b - a, np.uint8)
                for _chunk, src, start, length, offset in segs[segs[:, 0] == k]:
                    piece = raw[offset : offset + length] if src == rank else received[(t, int(start))]
                    buffer[start - a : start - a + length] = piece
                chunks.append(memoryview(buffer))
                views.append(False)
            yield t, ks, chunks, views


# --------------------------------------------------------------------------------------------
# Reading a box of a stored array
# --------------------------------------------------------------------------------------------
def read_region(reader: TreeReader, header: dict[str, Any], offsets: Sequence[int],
                sizes: Sequence[int]) -> np.ndarray:
    """The box ``offsets``/``sizes`` of the stored array ``header`` (an ndarray node's map),
    reading only the chunks it overlaps, at most :data:`WINDOW` bytes of them at a time (a box
    of whole trailing dimensions, a dim-0 shard, is read straight into the result)."""
    dtype = parse_dtype(header.get("dtype"))
    shape = header.get("shape")
    if not isinstance(shape, list) or len(shape) != len(offsets) or len(sizes) != len(offsets) or any(
            o < 0 or s < 0 or o + s > n for o, s, n in zip(offsets, sizes, shape, strict=True)):
        raise DecodeError(f"box {list(offsets)}+{list(sizes)} is not inside an array of shape {shape}")
    box = tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))
    nbytes = math.prod(shape) * dtype.itemsize
    if "chunk_size" not in header:  # inline bytes
        data = header.get("data")
        if not isinstance(data, bytes) or len(data) != nbytes:
            raise DecodeError(f"inline array holds {len(data) if isinstance(data, bytes) else 0} bytes, "
                              f"expected {nbytes}")
        return _shaped(np.frombuffer(data, dtype), shape, header)[box].copy()
    chunks = _Chunks(reader, header, nbytes)
    if header.get("order") == "F":  # no writer cuts Fortran-ordered arrays by boxes: read it whole
        whole = np.empty(nbytes, np.uint8)
        chunks.read_into(0, whole)
        return _shaped(whole.view(dtype), shape, header)[box].copy()
    out = np.empty(sizes, dtype)
    if out.nbytes:
        starts, length = box_runs(shape, dtype.itemsize, offsets, sizes)
        flat = out.reshape(-1).view(np.uint8)
        if len(starts) == 1:
            chunks.read_into(int(starts[0]), flat)
        else:
            _read_runs(chunks, starts, length, flat)
    return out


def _shaped(flat: np.ndarray, shape: Sequence[int], header: dict[str, Any]) -> np.ndarray:
    return flat.reshape(shape, order="F" if header.get("order") == "F" else "C")


def _read_runs(chunks: _Chunks, starts: np.ndarray, length: int, out: np.ndarray) -> None:
    """Copy runs of ``length`` bytes at ``starts`` into consecutive slices of ``out``, reading a
    window of the array at a time."""
    i = 0
    while i < len(starts):
        first = int(starts[i])
        j = max(i + 1, int(np.searchsorted(starts, first + WINDOW - length, side="right")))
        span = np.empty(int(starts[j - 1]) + length - first, np.uint8)
        chunks.read_into(first, span)
        offsets = starts[i:j] - first
        if length >= 4096:
            for n, at in enumerate(offsets):
                out[(i + n) * length : (i + n + 1) * length] = span[at : at + length]
        else:  # short runs: gathered a batch at a time (an index of 8 bytes a byte gathered)
            step = max(1, (1 << 20) // length)
            for n in range(0, len(offsets), step):
                picks = offsets[n : n + step, None] + np.arange(length, dtype=np.int64)
                out[(i + n) * length : (i + n + len(picks)) * length] = span[picks].reshape(-1)
        i = j


class _Chunks:
    """The chunks of one stored array, read by byte range."""

    def __init__(self, reader: TreeReader, header: dict[str, Any], nbytes: int) -> None:
        size = header.get("chunk_size")
        self.cids = reader.chunk_links(header)
        if type(size) is not int or size <= 0 or -(-nbytes // size) != len(self.cids):
            raise DecodeError(f"{len(self.cids)} chunks of {size!r} bytes cannot hold {nbytes} bytes")
        self.reader, self.size, self.nbytes = reader, size, nbytes

    def read_into(self, start: int, out: np.ndarray) -> None:
        """Bytes ``start`` to ``start + len(out)`` of the array into ``out``: whole chunks
        straight in, the partial ones at either end through a chunk buffer."""
        end = start + out.nbytes
        first, last = start // self.size, (end - 1) // self.size
        direct = [k for k in range(first, last + 1)
                  if k * self.size >= start and min((k + 1) * self.size, self.nbytes) <= end]
        view = memoryview(out).cast("B")
        if direct:
            lo = direct[0] * self.size - start
            sizes = [min(self.size, self.nbytes - k * self.size) for k in direct]
            hi = lo + sum(sizes)
            self.reader.store.get_many_into([self.cids[k] for k in direct], sizes, view[lo:hi],
                                            self.reader.pool, verify=self.reader.verify)
        for k in sorted({first, last} - set(direct)):
            data = self.reader.store.get(self.cids[k], verify=self.reader.verify)
            base = k * self.size
            if len(data) != min(self.size, self.nbytes - base):
                raise DecodeError(f"chunk {k} holds {len(data)} bytes", cid=cidlib.to_str(self.cids[k]))
            a, b = max(start, base), min(end, base + len(data))
            view[a - start : b - start] = data[a - base : b - base]


# --------------------------------------------------------------------------------------------
# The root of a sharded save
# --------------------------------------------------------------------------------------------
def state_root(reader: TreeReader, tree: bytes) -> bytes:
    """The root node of the state a checkpoint's tree holds: ``tree`` itself, or the ``state``
    a sharded save's root (layout 2) links to. A missing ``tree`` is left to the caller."""
    try:
        data = reader.peek(tree)
    except BlockNotFound:
        return tree
    if not data.startswith(_ROOT_PREFIX):
        return tree
    root = reader.node(tree)
    if root.get("format") != SHARDED_FORMAT or root.get("version") != SHARDED_LAYOUT:
        return tree
    state = root.get("state")
    if type(state) is not Link or not cidlib.is_node(state.cid):
        raise DecodeError("malformed sharded checkpoint: 'state' is not a link to a node",
                          cid=cidlib.to_str(tree))
    return state.cid
