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


def test_a_child_forked_during_a_pause_gets_the_collector_back() -> None:
    """A load in one thread while another forks (a data loader's workers): the child has no load
    running, so its collector runs again, and its next pause and release work."""
    import gc
    import os
    import threading
    import warnings

    inside, release = threading.Event(), threading.Event()

    def paused() -> None:
        with _memory.cyclic_gc_paused():
            inside.set()
            release.wait(30)

    thread = threading.Thread(target=paused)
    thread.start()
    try:
        assert inside.wait(30) and not gc.isenabled()
        with warnings.catch_warnings():  # Python 3.12+ warns of fork beside threads: the point here
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:  # the child: report through the exit status only
            ok = gc.isenabled()
            with _memory.cyclic_gc_paused():
                ok = ok and not gc.isenabled()
            os._exit(0 if ok and gc.isenabled() else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        release.set()
        thread.join()
    assert gc.isenabled()
