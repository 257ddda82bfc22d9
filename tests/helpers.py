"""Exact comparison of states: type, dtype, shape, layout and bits, recursively."""

from __future__ import annotations

import struct
from typing import Any

import numpy as np


def assert_state_equal(expected: Any, actual: Any, path: str = "<root>") -> None:
    """Assert ``actual`` is ``expected`` as a checkpoint must give it back.

    Types must match exactly (a tuple is not a list, ``np.float32`` is not ``float``, ``True`` is not
    ``1``), dict keys must come in the same order, floats must have the same bits (NaN payloads,
    -0.0), arrays the same dtype (byte order included), shape and bytes, and a Fortran-ordered array
    must come back Fortran-ordered.
    """
    assert type(actual) is type(expected), (
        f"{path}: type {type(actual).__name__} != expected {type(expected).__name__}"
    )
    if isinstance(expected, dict):
        keys = [(type(k), k) for k in actual]
        assert keys == [(type(k), k) for k in expected], (
            f"{path}: keys {list(actual)} != {list(expected)} (order and types count)"
        )
        for key in expected:
            assert_state_equal(expected[key], actual[key], f"{path}.{key}")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), f"{path}: length {len(actual)} != {len(expected)}"
        for i, (e, a) in enumerate(zip(expected, actual, strict=True)):
            assert_state_equal(e, a, f"{path}.{i}")
    elif isinstance(expected, float):
        assert struct.pack("<d", actual) == struct.pack("<d", expected), (
            f"{path}: float bits {actual!r} != {expected!r}"
        )
    elif isinstance(expected, np.ndarray):
        _assert_array_equal(expected, actual, path)
    elif isinstance(expected, np.generic):
        assert actual.dtype == expected.dtype, f"{path}: dtype {actual.dtype} != {expected.dtype}"
        assert np.asarray(actual).tobytes() == np.asarray(expected).tobytes(), f"{path}: bits"
    else:
        assert actual == expected, f"{path}: {actual!r} != {expected!r}"


def _assert_array_equal(expected: np.ndarray[Any, Any], actual: np.ndarray[Any, Any], path: str) -> None:
    assert actual.dtype == expected.dtype and actual.dtype.str == expected.dtype.str, (
        f"{path}: dtype {actual.dtype.str} ({actual.dtype}) != {expected.dtype.str} ({expected.dtype})"
    )
    assert actual.shape == expected.shape, f"{path}: shape {actual.shape} != {expected.shape}"
    if expected.flags.f_contiguous and not expected.flags.c_contiguous:
        assert actual.flags.f_contiguous, f"{path}: Fortran order was lost"
    assert np.ascontiguousarray(actual).tobytes() == np.ascontiguousarray(expected).tobytes(), (
        f"{path}: array bytes differ"
    )
