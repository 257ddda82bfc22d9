"""Hypothesis strategies for training states: nested containers, scalars and numpy arrays.

Values are built from random bit patterns wherever a type allows it, so NaN payloads, signed zeros,
subnormals and odd float8/bfloat16 encodings all turn up. Most arrays and byte strings are small
(inline in their node); about one in ten is over 16 KiB so it is cut into chunk blocks (use a
repository with ``chunk_size=4096`` to make those multi-chunk cheaply).
"""

from __future__ import annotations

import math
import struct
from typing import Any

import ml_dtypes
import numpy as np
from hypothesis import strategies as st
from hypothesis.extra.numpy import array_shapes

INLINE_LIMIT = 16 * 1024

NUMPY_DTYPES = [
    np.dtype(name)
    for name in (
        "bool",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "float32",
        "float64",
        "complex64",
        "complex128",
    )
]
ML_DTYPES = [
    np.dtype(ml_dtypes.bfloat16),
    np.dtype(ml_dtypes.float8_e4m3fn),
    np.dtype(ml_dtypes.float8_e5m2),
]
DTYPES = NUMPY_DTYPES + ML_DTYPES

_QUIET_NAN_WITH_PAYLOAD = struct.unpack("<d", struct.pack("<Q", 0x7FF8_0000_DEAD_BEEF))[0]
_SIGNALLING_NAN = struct.unpack("<d", struct.pack("<Q", 0xFFF0_0000_0000_0001))[0]
SPECIAL_FLOATS = [
    0.0,
    -0.0,
    math.inf,
    -math.inf,
    math.nan,
    _QUIET_NAN_WITH_PAYLOAD,
    _SIGNALLING_NAN,
    5e-324,
]
INT_EDGES = [
    0,
    -1,
    2**63 - 1,
    -(2**63),
    -(2**63) - 1,
    2**64 - 1,
    2**64,
    -(2**64),
    2**200,
    -(2**521) + 7,
]


def _bits_to_float(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<Q", bits))[0]  # type: ignore[no-any-return]


def _rarely(large: st.SearchStrategy[Any], small: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """``large`` about one time in ten, else ``small``."""
    return st.integers(0, 9).flatmap(lambda k: large if k == 0 else small)


floats = st.one_of(
    st.floats(),
    st.integers(0, 2**64 - 1).map(_bits_to_float),
    st.sampled_from(SPECIAL_FLOATS),
)
ints = st.one_of(
    st.integers(-(2**63), 2**64 - 1),
    st.integers(),
    st.integers(-(2**300), 2**300),
    st.sampled_from(INT_EDGES),
)

_TEXT_ALPHABET = list("abc xyz\n\t\x00é€ß中文😀🎉\U0010fffd")


@st.composite
def _large_text(draw: st.DrawFn) -> str:
    n = draw(st.integers(INLINE_LIMIT + 1, 150_000))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    return "".join(rng.choice(_TEXT_ALPHABET, size=n).tolist())


@st.composite
def _large_bytes(draw: st.DrawFn) -> bytes:
    # Above 128 KiB content-defined chunking cuts several chunks.
    n = draw(st.integers(INLINE_LIMIT + 1, 400_000))
    return np.random.default_rng(draw(st.integers(0, 2**32 - 1))).bytes(n)


texts = _rarely(_large_text(), st.text(max_size=30))
binaries = _rarely(_large_bytes(), st.binary(max_size=64))


@st.composite
def numpy_scalars(draw: st.DrawFn) -> np.generic:
    """A numpy (or ml_dtypes) scalar of any supported dtype with random bits."""
    dtype = draw(st.sampled_from(DTYPES))
    raw = draw(st.binary(min_size=dtype.itemsize, max_size=dtype.itemsize))
    return np.frombuffer(raw, dtype=dtype)[0]  # type: ignore[no-any-return]


@st.composite
def arrays(draw: st.DrawFn, *, large: bool | None = None) -> np.ndarray[Any, Any]:
    """An array of any supported dtype with random bits and any layout.

    Layouts: C order, Fortran order, strided (every k-th row), reversed (negative strides), and
    for multi-byte numpy dtypes big- or little-endian byte order. Shapes include 0-d and empty.
    ``large``: force (True) or forbid (False) a size over 16 KiB; by default one in ten.
    """
    dtype = draw(st.sampled_from(DTYPES))
    if large is None:
        large = draw(st.integers(0, 9)) == 0
    layout = draw(st.sampled_from(["C", "F", "strided", "reversed"]))
    if large:
        count = draw(st.integers(INLINE_LIMIT // dtype.itemsize + 1, 48 * 1024 // dtype.itemsize))
        width = draw(st.sampled_from([1, 2, 3, 8] if layout != "F" else [2, 3, 8]))
        shape: tuple[int, ...] = (count // width + 1, width) if width > 1 else (count,)
    elif layout == "F":  # at least two axes longer than 1, or F order is C order too
        shape = draw(array_shapes(min_dims=2, max_dims=3, min_side=2, max_side=5))
    else:
        shape = draw(array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5))
    if not shape:
        layout = "C"
    if dtype in NUMPY_DTYPES and dtype.itemsize > 1 and draw(st.booleans()):
        dtype = dtype.newbyteorder(">")
    step = draw(st.integers(2, 3)) if layout == "strided" else 1
    base_shape = (shape[0] * step, *shape[1:]) if shape else ()
    nbytes = math.prod(base_shape) * dtype.itemsize
    if large:
        raw = np.random.default_rng(draw(st.integers(0, 2**32 - 1))).bytes(nbytes)
    else:
        raw = draw(st.binary(min_size=nbytes, max_size=nbytes))
    base = np.frombuffer(raw, dtype=dtype).reshape(base_shape)
    if layout == "F":
        return np.asfortranarray(base)
    if layout == "strided":
        return base[::step]
    if layout == "reversed":
        return base[::-1]
    return base.copy() if draw(st.booleans()) else base  # writable or read-only


dict_keys = st.one_of(st.text(max_size=10), st.integers(-(2**63), 2**64 - 1))

leaves = st.one_of(
    st.none(),
    st.booleans(),
    ints,
    floats,
    texts,
    binaries,
    arrays(),
    numpy_scalars(),
)


def ordered_dicts(values: st.SearchStrategy[Any], max_size: int = 5) -> st.SearchStrategy[Any]:
    """Dicts with str and int keys in a random insertion order."""
    return st.lists(
        st.tuples(dict_keys, values), max_size=max_size, unique_by=lambda kv: kv[0]
    ).map(dict)


def states(max_leaves: int = 25) -> st.SearchStrategy[Any]:
    """Arbitrary nested training states."""
    return st.recursive(
        leaves,
        lambda children: st.one_of(
            st.lists(children, max_size=5),
            st.lists(children, max_size=5).map(tuple),
            ordered_dicts(children),
        ),
        max_leaves=max_leaves,
    )


# Keys whose dotted joins collide: "a.b" vs "a" > "b", 0 vs "0", "" vs "." and so on.
colliding_keys = st.sampled_from(["a", "b", "a.b", "b.a", "", ".", "a.", ".a", "0", "1", "0.1", 0, 1, 10])


@st.composite
def colliding_states(draw: st.DrawFn) -> Any:
    """Nested dicts and lists of arrays whose joined paths often collide.

    The arrays come from a pool of one or two templates, so colliding leaves usually have the
    same shape and dtype (the case where a buffer keyed by the joined path would be shared).
    """
    pool = draw(st.lists(arrays(large=False), min_size=1, max_size=2))
    leaf = st.sampled_from(pool)
    return draw(
        st.recursive(
            leaf,
            lambda children: st.one_of(
                st.lists(children, min_size=1, max_size=3),
                st.dictionaries(colliding_keys, children, min_size=1, max_size=4),
            ),
            max_leaves=10,
        )
    )
