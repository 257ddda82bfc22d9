"""``_memory.prefault``: fresh memory populated in one call before a load copies into it.

It must never change what the memory holds (hypothesis, any alignment), and, where the kernel has
``MADV_POPULATE_WRITE``, writing the populated range must then take no page faults.
"""

from __future__ import annotations

import mmap
import resource

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from cas_ckpt import _memory

PAGE = mmap.PAGESIZE


@given(st.binary(min_size=0, max_size=5 * PAGE), st.integers(0, 5 * PAGE), st.integers(0, 5 * PAGE))
def test_prefault_never_changes_the_contents(data: bytes, start: int, stop: int) -> None:
    buffer = np.frombuffer(bytearray(data + bytes(3 * PAGE)), np.uint8)
    before = buffer.copy()
    _memory.prefault(memoryview(buffer)[min(start, stop) : max(start, stop)])
    assert np.array_equal(buffer, before)


def test_read_only_memory_is_left_alone() -> None:
    _memory.prefault(memoryview(bytes(4 * PAGE)))  # no error, nothing to populate


def _faults_writing(view: np.ndarray) -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    view.fill(1)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_writing_prefaulted_memory_takes_no_page_faults() -> None:
    size = 16 << 20
    plain = _faults_writing(np.frombuffer(mmap.mmap(-1, size), np.uint8))
    if plain < size // PAGE // 4:
        pytest.skip(f"{plain} faults writing {size >> 20} MiB of fresh memory (huge pages?)")
    view = np.frombuffer(mmap.mmap(-1, size), np.uint8)
    _memory.prefault(memoryview(view))
    if _memory._madvise is None:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux 5.14 and later)")
    faults = _faults_writing(view)
    assert faults < plain // 100, f"{faults} page faults writing prefaulted memory ({plain} without)"
