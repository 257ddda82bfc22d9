"""Memory: fresh pages made resident in one call before a copy (:func:`prefault`), the
cyclic garbage collector paused while many acyclic objects are made (:func:`cyclic_gc_paused`),
the most memory this process could ever get (:func:`memory_limit`), and large buffers returned
to the system when freed (:func:`return_freed_buffers`)."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import gc
import mmap
import os
import sys
import threading
from collections.abc import Callable, Iterator

MADV_POPULATE_WRITE = 23  # Linux 5.14 and later
_PAGE = mmap.PAGESIZE


def _libc_madvise() -> Callable[[int, int, int], int] | None:
    """libc's ``madvise`` (ctypes calls it without the GIL), or None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        call = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    call.restype = ctypes.c_int
    return call


_madvise = _libc_madvise()


def prefault(out: memoryview) -> None:
    """Make the whole pages inside ``out`` resident now, in one ``madvise(MADV_POPULATE_WRITE)``.

    Copying into fresh memory takes a page fault per 4 KiB page; populating the range first does
    the same work without a fault each. Copying 255 MiB into fresh arrays: 120 ms, 90 ms
    populated first (one thread, 2-core VM). The contents do not change. It does nothing where
    the kernel lacks it (before 5.14; not Linux: then off for good), or for read-only memory.
    """
    global _madvise
    call = _madvise
    if call is None or out.readonly or out.nbytes < 2 * _PAGE:
        return
    address = ctypes.addressof(ctypes.c_char.from_buffer(out))
    start = -(-address // _PAGE) * _PAGE
    end = (address + out.nbytes) // _PAGE * _PAGE
    failed = end > start and call(start, end - start, MADV_POPULATE_WRITE) != 0
    if failed and ctypes.get_errno() in (errno.EINVAL, errno.ENOSYS):
        _madvise = None  # an older kernel: every later call would fail the same way


@functools.cache
def memory_limit() -> int:
    """Bytes this process could ever hold: physical memory plus swap, or less where its cgroup
    (v2: a container's ``memory.max`` and ``memory.swap.max``) allows less.

    Linux overcommits: allocations past this all succeed, and the process is killed once it
    touches them. A reader refuses more than this up front instead (``tree.TreeReader``).
    """
    fields = {}
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo") as f:
        for line in f:
            name, _, rest = line.partition(":")
            fields[name] = int(rest.split()[0]) * 1024  # kB
    total = fields.get("MemTotal", 0) + fields.get("SwapTotal", 0)
    if not total:
        try:
            total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, AttributeError):
            return sys.maxsize
    return min(total, _cgroup_limit())


def _cgroup_limit() -> int:
    """The memory and swap this process's cgroup allows (v2, or v1's memory controller; at its
    own path, or at the root where a container sees only its own), or sys.maxsize."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = [line.rstrip("\n").split(":", 2) for line in f]
    except OSError:
        return sys.maxsize
    found = sys.maxsize
    for _, controllers, path in (parts for parts in lines if len(parts) == 3):
        if controllers == "":  # v2: memory.max plus memory.swap.max
            names, base = ("memory.max", "memory.swap.max"), "/sys/fs/cgroup"
        elif "memory" in controllers.split(","):  # v1: memory.memsw.limit_in_bytes holds both
            names, base = ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes"), "/sys/fs/cgroup/memory"
        else:
            continue
        for where in (base + path, base):
            limits = [_read_limit(f"{where}/{name}") for name in names]
            if limits[0] is not None:
                v1 = names[0].endswith("in_bytes")
                both = limits[1] if v1 and limits[1] is not None else limits[0] + (limits[1] or 0)
                found = min(found, both)
                break
    return found


def _read_limit(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    if text == "max":
        return sys.maxsize
    try:
        return min(int(text), sys.maxsize)
    except ValueError:
        return None


_gc_pause_lock = threading.Lock()
_gc_pauses = 0  # callers running with the cyclic collector paused
_gc_was_enabled = False


@contextlib.contextmanager
def cyclic_gc_paused() -> Iterator[None]:
    """The cyclic garbage collector paused while this runs (restored as it was after the last
    of those running at once).

    For code that makes many objects, none in a cycle, in a short time: a load's walk of its
    tree (a few per array: header dicts, links, arrays; not its wait for the reads to finish,
    which on S3 can be long) and reading pack indexes (a few per block). Every 700 of them started a
    collection, some of which walked the whole heap: 14% of loading 10,000 small arrays (92 ->
    79 ms, median of 15), and 8-10 of the 13 ms that taking in an index of 10,000 entries took in
    a fresh process. Reference counting still frees everything.
    """
    global _gc_pauses, _gc_was_enabled
    with _gc_pause_lock:
        if _gc_pauses == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_pauses += 1
    try:
        yield
    finally:
        with _gc_pause_lock:
            _gc_pauses -= 1
            if _gc_pauses == 0 and _gc_was_enabled:
                gc.enable()


def _after_fork_in_child() -> None:
    """A child forked during a pause runs none of the paused callers: it gets the collector
    back as it was, and a lock no thread of the parent can hold."""
    global _gc_pause_lock, _gc_pauses
    _gc_pause_lock = threading.Lock()
    if _gc_pauses and _gc_was_enabled:
        gc.enable()
    _gc_pauses = 0


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


M_MMAP_THRESHOLD = -3  # mallopt's parameter (glibc's malloc.h)
FREED_BUFFER = 128 * 1024  # buffers this large and over get pages of their own, unmapped when freed


def return_freed_buffers() -> bool:
    """Give large buffers pages of their own from now on, returned to the system when freed.

    glibc raises its mmap threshold each time a mapped buffer is freed (up to 32 MiB), after which
    a long-lived server's block-sized buffers come from its heaps, and memory a burst of clients
    used stays the process's after they leave. Fixing the threshold keeps it at its default.
    True if set (glibc only)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, FREED_BUFFER))


OWN_PAGES = 1024 * 1024  # buffers this large and over, from pages(), are mappings of their own


def pages(nbytes: int) -> bytearray | mmap.mmap:
    """A zeroed, writable buffer of ``nbytes`` that gives its memory back to the system when it
    is freed: from ``OWN_PAGES`` up, an anonymous mapping of its own (unmapped with its last
    reference), whatever the allocator's thresholds; a ``bytearray`` below.

    For the large buffers a process builds once and frees soon after (an index's rows, read and
    sorted at an open): from glibc's heap, once its mmap threshold has grown past them, they
    stayed the process's after they were freed (an open after big saves kept 20 MiB more)."""
    if nbytes < OWN_PAGES:
        return bytearray(nbytes)
    try:
        if not hasattr(mmap, "MAP_PRIVATE"):  # Windows: its anonymous maps are private already
            return mmap.mmap(-1, nbytes)
        # Anonymous (no file given); its pages made now, in one call, not a fault each (all are
        # written at once): 11 MB, 2.9 ms against 5.1.
        return mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | getattr(mmap, "MAP_POPULATE", 0))
    except OSError as exc:
        if exc.errno == errno.ENOMEM:
            raise MemoryError(f"no memory for a buffer of {nbytes} bytes") from exc
        raise
