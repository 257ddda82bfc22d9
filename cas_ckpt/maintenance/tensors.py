"""Per-tensor statistics, change norms and non-finite scans, streamed from an array's chunks.

An array is read a chunk at a time (a few chunks read ahead on the repository's pool) and its
elements converted to float64 a window at a time: memory stays at a few chunks whatever the
tensor's size, and a state is never loaded whole. Moments combine window by window (Chan's
parallel form of Welford's update) and norms are accumulated scaled by the largest magnitude seen
(as LAPACK's ``dnrm2``), so neither loses precision nor overflows on long tensors. bfloat16 and
float8 arrays convert through ``ml_dtypes``; integer and bool arrays keep exact minima and maxima.
"""

from __future__ import annotations

import collections
import functools
import math
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
from multiformats import CID

from cas_ckpt.codec import Link, Tagged
from cas_ckpt.errors import DecodeError
from cas_ckpt.tree import NDARRAY, PAGES, SCALAR, TUPLE, TreeReader, join_path, parse_dtype

WINDOW = 1 << 18  # elements converted to float64 at a time (2 MiB of float64)
READ_AHEAD = 4  # chunks read ahead of the one being reduced

T = TypeVar("T")


@dataclass
class TensorStats:
    """One tensor's statistics. ``min``, ``max``, ``mean``, ``std`` (population, ddof 0) and ``l2``
    (the Euclidean norm) are of the finite elements; ``nan`` and ``inf`` count the others. An
    integer or bool tensor's ``min`` and ``max`` are exact ints; a complex tensor has only ``l2``
    (of the moduli) and the counts. None where there is no finite element."""

    path: str
    dtype: str
    shape: list[int]
    count: int
    nan: int
    inf: int
    min: float | int | None
    max: float | int | None
    mean: float | None
    std: float | None
    l2: float | None

    @property
    def finite(self) -> bool:
        """True if every element is finite (no NaN, no infinity)."""
        return not (self.nan or self.inf)


@dataclass
class ChangeNorms:
    """How far array ``b`` moved from array ``a``: the largest ``|a-b|``, ``‖a-b‖`` and ``‖a‖``."""

    max_abs: float
    l2: float
    a_norm: float

    @property
    def relative(self) -> float:
        """``‖a-b‖ / ‖a‖`` (infinite when ``a`` is zero and ``b`` is not; NaN where either holds NaN)."""
        return relative_change(self.l2, self.a_norm)


def _quiet(work: Callable[..., T]) -> Callable[..., T]:
    """NaN and infinity are what these functions look for: numpy's warnings about them (inf - inf,
    an overflow in a cast) would only be noise."""

    @functools.wraps(work)
    def run(*args: Any, **kwargs: Any) -> T:
        with np.errstate(all="ignore"):
            return work(*args, **kwargs)

    return run


def relative_change(l2: float, a_norm: float) -> float:
    """``l2 / a_norm``, with 0/0 = 0 (nothing moved) and x/0 = inf."""
    if math.isnan(l2) or math.isnan(a_norm):
        return math.nan
    if a_norm == 0:
        return 0.0 if l2 == 0 else math.inf
    return l2 / a_norm


def is_array(value: Any) -> bool:
    """True for a leaf that holds an array (an ndarray descriptor or a numpy scalar)."""
    return isinstance(value, Tagged) and value.code in (NDARRAY, SCALAR) and isinstance(value.value, dict)


@_quiet
def tensor_stats(reader: TreeReader, path: str, leaf: Tagged) -> TensorStats:
    """The statistics of the array ``leaf`` (at ``path``), streamed from its chunks."""
    elements = Elements(reader, leaf)
    kind = _kind(elements.name, elements.dtype)
    moments, norm = _Moments(), _Norm()
    nan = inf = finite = 0
    low: Any = None
    high: Any = None
    for window in elements.windows():
        if kind in ("float", "complex"):
            values = window.astype(np.complex128 if kind == "complex" else np.float64)
            is_nan, is_inf = _nonfinite(values)
            found_nan, found_inf = int(is_nan.sum()), int(is_inf.sum())
            if found_nan or found_inf:
                nan, inf = nan + found_nan, inf + found_inf
                values = values[~(is_nan | is_inf)]
            if not values.size:
                continue
            if kind == "float":
                low = _fold(low, float(values.min()), min)
                high = _fold(high, float(values.max()), max)
        else:  # ints and bools: exact extremes from the stored values
            values = window.astype(np.float64)
            low = _fold(low, int(window.min()), min)
            high = _fold(high, int(window.max()), max)
        finite += values.size
        norm.add(np.abs(values))
        if kind != "complex":
            moments.add(values)
    real = kind != "complex" and finite > 0
    return TensorStats(
        path=path, dtype=str(elements.dtype), shape=elements.shape, count=elements.count, nan=nan, inf=inf,
        min=low if real else None, max=high if real else None,
        mean=moments.mean if real else None,
        std=moments.std if real else None,
        l2=norm.value if finite else (0.0 if elements.count == 0 else None),
    )


def _nonfinite(values: np.ndarray[Any, Any]) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """Masks of the NaN elements and of the infinite ones (a complex number: either part)."""
    if values.dtype.kind == "c":
        is_nan = np.isnan(values.real) | np.isnan(values.imag)
        return is_nan, ~is_nan & (np.isinf(values.real) | np.isinf(values.imag))
    return np.isnan(values), np.isinf(values)


@_quiet
def change_norms(reader: TreeReader, a: Tagged, b: Tagged) -> ChangeNorms:
    """``b`` against ``a`` (arrays of one shape), both streamed a window at a time.

    Chunks the two share are read once. Two layouts (C and Fortran order) cannot be paired
    element by element as they stream: such a pair is loaded whole, one tensor at a time.
    """
    chunks = _SharedReads(reader, keep=2 * READ_AHEAD)
    left, right = Elements(reader, a, chunks), Elements(reader, b, chunks)
    if left.shape != right.shape:
        raise ValueError(f"shapes differ: {left.shape} and {right.shape}")
    if left.order != right.order and left.count > 1 and len(left.shape) > 1:
        return _norms(np.asarray(reader.load(a)).ravel(), np.asarray(reader.load(b)).ravel())
    complex_ = "complex" in (_kind(left.name, left.dtype), _kind(right.name, right.dtype))
    widest = np.complex128 if complex_ else np.float64
    diff, base = _Norm(), _Norm()
    largest = 0.0
    for x in left.windows():
        y = right.take(x.size)
        if y.size != x.size:
            raise DecodeError(f"arrays of one shape hold {left.count} and fewer elements")
        xs, ys = x.astype(widest), y.astype(widest)
        delta = np.abs(xs - ys)
        base.add(np.abs(xs))
        diff.add(delta)
        if delta.size:
            largest = _larger(largest, float(delta.max()))
    return ChangeNorms(largest, diff.value, base.value)


def _larger(current: float, new: float) -> float:
    """The larger of two maxima; a NaN stays (Python's max would drop it)."""
    return new if math.isnan(new) or new > current else current


@_quiet
def _norms(x: np.ndarray[Any, Any], y: np.ndarray[Any, Any]) -> ChangeNorms:
    widest = np.complex128 if "c" in (x.dtype.kind, y.dtype.kind) else np.float64
    xs, ys = x.astype(widest), y.astype(widest)
    delta, base = _Norm(), _Norm()
    delta.add(np.abs(xs - ys))
    base.add(np.abs(xs))
    return ChangeNorms(float(np.abs(xs - ys).max()) if xs.size else 0.0, delta.value, base.value)


@_quiet
def nonfinite_counts(
    reader: TreeReader, leaf: Tagged, known_finite: set[tuple[bytes, str]]
) -> tuple[int, int]:
    """(NaN, infinity) counts of a float or complex array; integer and bool arrays have none.

    Chunks named in ``known_finite`` (CID, dtype) are skipped, and chunks found finite are added
    to it: scanning a run's history reads each chunk once, however many checkpoints share it.
    """
    elements = Elements(reader, leaf, skip=known_finite)
    if _kind(elements.name, elements.dtype) not in ("float", "complex"):
        return 0, 0
    nan = inf = 0
    for window, cid in elements.chunk_windows():
        is_nan, is_inf = _nonfinite(window.astype(np.complex128 if window.dtype.kind == "c" else np.float64))
        found_nan, found_inf = int(is_nan.sum()), int(is_inf.sum())
        nan, inf = nan + found_nan, inf + found_inf
        if cid is not None and not (found_nan or found_inf):
            known_finite.add((cid, elements.name))
    return nan, inf


@dataclass
class NonFiniteReport:
    """The first checkpoint of a run's history (oldest first) that holds a NaN or an infinity:
    its commit and step, and the statistics of each tensor that holds one (none found: ``commit``
    is None). ``checked`` checkpoints were scanned; ``expired`` ones were passed over, their data
    collected by GC."""

    ref: str
    commit: CID | None = None
    step: int | None = None
    tensors: list[TensorStats] = field(default_factory=list)
    checked: int = 0
    expired: int = 0
    first_expired_step: int | None = None  # the oldest expired checkpoint's step (the gap's start)
    metric: str | None = None  # a metric already NaN or infinite at an expired checkpoint...
    metric_step: int | None = None  # ...and that checkpoint's step (the earliest such)

    @property
    def found(self) -> bool:
        return self.commit is not None

    def message(self) -> str:
        """The finding in a sentence, saying what expired checkpoints hid (they were not checked)."""
        gap = (f"{self.expired} expired checkpoint{'s' * (self.expired != 1)} before it"
               f"{_from_step(self.first_expired_step)} were not checked" if self.expired else "")
        if self.found:
            tensors = f"{len(self.tensors)} tensor{'s' * (len(self.tensors) != 1)}"
            text = (f"step {self.step if self.step is not None else '-'} ({self.commit}) is the first "
                    f"{'kept ' if self.expired else ''}checkpoint of {self.ref} with NaN or Inf, in "
                    f"{tensors}" + (f"; {gap}" if gap else ""))
        else:
            text = (f"no NaN or Inf in {self.checked} checkpoint{'s' * (self.checked != 1)} of {self.ref}"
                    + (f" ({self.expired} expired, not checked)" if self.expired else ""))
        if self.metric is not None:
            text += f"; metric {self.metric!r} was already NaN or Inf at step {self.metric_step} (expired)"
        return text


def _from_step(step: int | None) -> str:
    return f" (from step {step})" if step is not None else ""


def nonfinite_metric(metadata: dict[str, Any]) -> str | None:
    """The first metric of a commit's metadata (its ``metrics``, else its top level) that is a
    NaN or an infinity, or None."""
    metrics = metadata.get("metrics")
    values = metrics if isinstance(metrics, dict) else metadata
    return next((str(name) for name, value in values.items()
                 if isinstance(value, float) and not math.isfinite(value)), None)


class NonFiniteScan:
    """Scans checkpoints one after another for NaN and infinity, each chunk (and each node of
    a checkpoint found clean) once, however many checkpoints share it."""

    def __init__(self, reader: TreeReader) -> None:
        self.reader = reader
        self.known_finite: set[tuple[bytes, str]] = set()
        self.clean_nodes: set[bytes] = set()

    def scan(self, start: Any, path: str = "") -> list[tuple[str, Tagged]]:
        """The arrays below ``start`` that hold a NaN or an infinity, with their paths."""
        visited: set[bytes] = set()
        found = []
        for where, leaf in array_leaves(self.reader, start, path, skip_nodes=self.clean_nodes,
                                        visited=visited):
            if any(nonfinite_counts(self.reader, leaf, self.known_finite)):
                found.append((where, leaf))
        if not found:
            self.clean_nodes |= visited
        return found


def array_leaves(
    reader: TreeReader, value: Any, path: str = "", *, skip_nodes: set[bytes] | None = None,
    visited: set[bytes] | None = None,
) -> Iterator[tuple[str, Tagged]]:
    """Every array below ``value`` with its path, in the state's order, reading only nodes.

    Sub-trees whose node CID is in ``skip_nodes`` are passed over (a scan that already covered
    them), and the nodes read are added to ``visited``; the pages of a long map are followed one
    by one, so a page skipped is never read.
    """
    stack: list[tuple[Any, str]] = [(value, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, Link):
            if skip_nodes is not None and item.cid in skip_nodes:
                continue
            if visited is not None:
                visited.add(item.cid)
            item = reader.node(item.cid)
        if isinstance(item, Tagged) and item.code == PAGES and isinstance(item.value, dict):
            pages = item.value.get("pages")
            kind = item.value.get("kind")
            if not isinstance(pages, list):
                raise DecodeError("malformed page set")
            # A page of a list continues its indices: joined, the pages give the indices.
            if kind != "map":
                stack.append((reader.resolve(item), where))
            else:
                stack.extend((page, where) for page in reversed(pages))
            continue
        if isinstance(item, Tagged) and item.code == TUPLE and isinstance(item.value, list):
            item = item.value
        if isinstance(item, dict):
            stack.extend((v, join_path(where, k)) for k, v in reversed(list(item.items())))
        elif isinstance(item, list):
            stack.extend((v, join_path(where, i)) for i, v in reversed(list(enumerate(item))))
        elif is_array(item):
            yield where, item


class Elements:
    """An array's elements in order, from its chunks (or its inline bytes), a window at a time.

    ``chunk_windows`` yields each chunk's elements with its CID where chunks hold whole elements,
    skipping chunks in ``skip``; elements that straddle two chunks (a chunk size that is not a
    multiple of the element size) join across them.
    """

    def __init__(
        self, reader: TreeReader, leaf: Tagged, reads: _SharedReads | None = None,
        skip: set[tuple[bytes, str]] | None = None,
    ) -> None:
        header = leaf.value
        self.name = str(header.get("dtype"))
        self.dtype = parse_dtype(header.get("dtype"))
        if leaf.code == SCALAR:
            shape: Any = []
            self.order = "C"
            self._inline: bytes | None = header.get("data")
        else:
            shape = header.get("shape")
            self.order = header.get("order", "C")
            self._inline = header.get("data")
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise DecodeError(f"malformed array shape {shape!r}")
        self.shape: list[int] = shape
        self.count = math.prod(shape)
        self._reader = reader
        self._reads = reads or _SharedReads(reader)
        self._skip = skip
        self._cids: list[bytes] = [] if self._inline is not None else reader.chunk_links(header)
        self._source = self._chunks()
        self._held: list[np.ndarray[Any, Any]] = []
        self._held_count = 0
        self._partial = b""  # the bytes of an element cut by a chunk boundary
        self._seen = 0

    def _chunks(self) -> Iterator[tuple[bytes | memoryview, bytes | None]]:
        if self._inline is not None:
            if not isinstance(self._inline, bytes):
                raise DecodeError("malformed inline array data")
            yield self._inline, None
            return
        yield from self._reads.stream(self._cids)

    def _aligned(self) -> bool:
        return self._inline is None and all(
            self._reader.store.size(c) % self.dtype.itemsize == 0 for c in self._cids[:-1]
        )

    def take(self, n: int) -> np.ndarray[Any, Any]:
        """The next ``n`` elements (fewer at the end; none once all are read)."""
        while self._held_count < n:
            piece = self._next_piece()
            if piece is None:
                break
            self._held.append(piece)
            self._held_count += piece.size
        if not self._held:
            return np.empty(0, self.dtype)
        joined = self._held[0] if len(self._held) == 1 else np.concatenate(self._held)
        out, rest = joined[:n], joined[n:]
        self._held = [rest] if rest.size else []
        self._held_count = rest.size
        return out

    def windows(self, n: int = WINDOW) -> Iterator[np.ndarray[Any, Any]]:
        while (window := self.take(n)).size:
            yield window

    def chunk_windows(self) -> Iterator[tuple[np.ndarray[Any, Any], bytes | None]]:
        """Each chunk's elements with its CID (None when chunks cut elements, or inline)."""
        if not self._aligned():
            for window in self.windows():
                yield window, None
            return
        wanted = [c for c in self._cids if self._skip is None or (c, self.name) not in self._skip]
        for data, cid in self._reads.stream(wanted):
            yield np.frombuffer(data, self.dtype), cid

    def _next_piece(self) -> np.ndarray[Any, Any] | None:
        size = self.dtype.itemsize
        for data, _ in self._source:
            if self._partial:
                data = self._partial + bytes(data)
            whole = len(data) - len(data) % size
            self._partial = bytes(data[whole:])
            self._seen += whole // size
            if self._seen > self.count:
                raise DecodeError(f"array chunks hold more than its {self.count} elements")
            if whole:
                return np.frombuffer(data, self.dtype, count=whole // size)
        if self._partial or self._seen != self.count:
            raise DecodeError(f"array chunks hold {self._seen} whole elements, its shape {self.count}")
        return None


class _SharedReads:
    """Chunk reads a few ahead on the repository's pool. With ``keep``, the last ``keep`` chunks
    stay at hand, so a chunk that two streams both need (a changed tensor's unchanged chunks,
    read by both sides at about the same time) is read once."""

    def __init__(self, reader: TreeReader, keep: int = 0) -> None:
        self._reader = reader
        self._keep = keep
        self._flight: collections.OrderedDict[bytes, Future[bytes]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def _read(self, cid: bytes) -> Future[bytes]:
        with self._lock:
            future = self._flight.get(cid)
            if future is None:
                store, verify = self._reader.store, self._reader.verify
                future = self._reader.pool.submit(store.get, cid, verify=verify)
                if self._keep:
                    self._flight[cid] = future
                    while len(self._flight) > self._keep:
                        self._flight.popitem(last=False)
            return future

    def stream(self, cids: list[bytes]) -> Iterator[tuple[bytes, bytes]]:
        ahead: collections.deque[tuple[bytes, Future[bytes]]] = collections.deque()
        pending = iter(cids)
        for cid in pending:
            ahead.append((cid, self._read(cid)))
            if len(ahead) >= READ_AHEAD:
                break
        while ahead:
            cid, future = ahead.popleft()
            following = next(pending, None)
            if following is not None:
                ahead.append((following, self._read(following)))
            yield future.result(), cid


def _kind(name: str, dtype: np.dtype[Any]) -> str:
    if dtype.kind == "c":
        return "complex"
    if dtype.kind == "f" or name.startswith(("float", "bfloat")):
        return "float"
    if dtype.kind == "b":
        return "bool"
    return "int"  # numpy's ints and uints, ml_dtypes' int4, uint4, int2, uint2


def _fold(current: Any, new: Any, pick: Any) -> Any:
    return new if current is None else pick(current, new)


class _Moments:
    """Count, mean and spread (the square root of the sum of squared deviations), combined
    window by window (Chan et al.'s update of Welford's); the spread is kept scaled as a norm, so
    neither it nor the mean overflows on values near the float64 limit."""

    def __init__(self) -> None:
        self.n = 0
        self.mean = 0.0
        self.spread = _Norm()

    def add(self, values: np.ndarray[Any, Any]) -> None:
        n = values.size
        if not n:
            return
        largest = float(np.abs(values).max())
        mean = largest * float((values / largest).mean()) if largest > 1e150 else float(values.mean())
        total = self.n + n
        delta = mean - self.mean
        self.spread.add(np.abs(values - mean))
        if self.n:
            self.spread.add(np.array([abs(delta) * math.sqrt(self.n * n / total)]))
        self.mean += delta * n / total
        self.n = total

    @property
    def std(self) -> float:
        """The population standard deviation (ddof 0)."""
        return self.spread.value / math.sqrt(self.n)


class _Norm:
    """A Euclidean norm accumulated as scale * sqrt(sum of squares / scale^2): no overflow,
    no underflow. NaN and infinity make it NaN and infinity."""

    def __init__(self) -> None:
        self.scale = 0.0
        self.ssq = 0.0
        self.nan = self.inf = False

    def add(self, magnitudes: np.ndarray[Any, Any]) -> None:
        if not magnitudes.size:
            return
        largest = float(magnitudes.max())
        if not math.isfinite(largest):
            if np.isnan(magnitudes).any():
                self.nan = True
            else:
                self.inf = True
            return
        if largest == 0:
            return
        if largest > self.scale:
            self.ssq *= (self.scale / largest) ** 2
            self.scale = largest
        self.ssq += float(np.square(magnitudes / self.scale).sum())

    @property
    def value(self) -> float:
        if self.nan:
            return math.nan
        if self.inf:
            return math.inf
        return self.scale * math.sqrt(self.ssq)
