"""Exercise cas_ckpt._hashpool from several threads, with jobs (hashing with SHA-256 or BLAKE3,
and filling from a source) taken, dropped and refused, and a forked child: run under valgrind by
tests/test_hashpool.py (long mode), and natively, where the SHA-256 buffers of one length are
hashed in groups across the threads' jobs (BLAKE3 jobs queued between them) and short ones 16
lanes at a time (valgrind's CPU has no AVX-512: neither runs there, and BLAKE3 takes its AVX2 or
SSE4.1 code)."""

from __future__ import annotations

import hashlib
import os
import threading
from typing import Any

import blake3

from cas_ckpt import _hashpool

PREFIX = b"\x01\x55\x12\x20"
B3_PREFIX = b"\x01\x55\x1e\x20"
BLOBS = [os.urandom(n) for n in range(1, 300_000, 7001)]
WANT = [PREFIX + hashlib.sha256(b).digest() for b in BLOBS]


SOURCE = b"".join(BLOBS)
SAME = [os.urandom(70_000) for _ in range(40)]  # one length: hashed 16 at once where it can be
SAME_WANT = [PREFIX + hashlib.sha256(b).digest() for b in SAME]
SHORT = [os.urandom(n) for n in range(0, 20_000, 97)]  # below 64 KiB: lanes of mixed lengths
SHORT_WANT = [PREFIX + hashlib.sha256(b).digest() for b in SHORT]
B3_WANT = [B3_PREFIX + blake3.blake3(b).digest() for b in BLOBS]
B3_SAME_WANT = [B3_PREFIX + blake3.blake3(b).digest() for b in SAME]


def blake3_job(buffers: list, threads: int, source: bytes | None = None) -> Any:
    return _hashpool.submit(buffers, B3_PREFIX, threads, source, hash=_hashpool.BLAKE3)


def run() -> None:
    for threads in (0, 1, 2, 2, 2):
        assert _hashpool.submit(BLOBS, PREFIX, threads).result() == WANT
        dropped = _hashpool.submit(BLOBS, PREFIX, threads)
        del dropped
        outs = [bytearray(len(b)) for b in BLOBS]  # filled from one source, then hashed
        assert _hashpool.submit(outs, PREFIX, threads, SOURCE).result() == WANT
        assert outs == BLOBS
        assert _hashpool.submit(outs, None, threads, SOURCE).result() is None
        dropped = _hashpool.submit([bytearray(len(b)) for b in BLOBS], PREFIX, threads, SOURCE)
        del dropped
        singles = [_hashpool.submit([b], PREFIX, threads) for b in SAME]  # groups span jobs
        between = [blake3_job([b], threads) for b in SAME]  # which no group may take
        del singles[::3]  # dropped while others' groups may hold their buffers
        del between[1::3]
        assert [job.result()[0] for job in singles] == [w for i, w in enumerate(SAME_WANT) if i % 3]
        assert [job.result()[0] for job in between] == [w for i, w in enumerate(B3_SAME_WANT) if i % 3 != 1]
        assert blake3_job(BLOBS, threads).result() == B3_WANT
        dropped = blake3_job(BLOBS, threads)
        del dropped
        outs = [bytearray(len(b)) for b in BLOBS]
        assert blake3_job(outs, threads, SOURCE).result() == B3_WANT
        assert outs == BLOBS
        outs = [bytearray(len(b)) for b in SAME]
        assert _hashpool.submit(outs, PREFIX, threads, b"".join(SAME)).result() == SAME_WANT
        assert outs == SAME
        assert _hashpool.submit(SHORT, PREFIX, threads).result() == SHORT_WANT
        dropped = _hashpool.submit(SHORT, PREFIX, threads)
        del dropped
        outs = [bytearray(len(b)) for b in SHORT]
        assert _hashpool.submit(outs, PREFIX, threads, b"".join(SHORT)).result() == SHORT_WANT
        assert outs == SHORT


workers = [threading.Thread(target=run) for _ in range(3)]
for worker in workers:
    worker.start()
for worker in workers:
    worker.join()
try:
    _hashpool.submit([b"taken", 42], PREFIX, 1)
except TypeError:
    pass  # refused: the buffer already taken must be given back (memcheck would see a leak)
else:
    raise AssertionError("an int was taken for a buffer")
try:
    _hashpool.submit([bytearray(3)], PREFIX, 1, b"12")
except ValueError:
    pass  # refused: the buffers and the source taken must be given back
else:
    raise AssertionError("a source of the wrong size was taken")
pid = os.fork()
if pid == 0:
    ok = _hashpool.submit(BLOBS, PREFIX, 2).result() == WANT and blake3_job(BLOBS, 2).result() == B3_WANT
    os._exit(0 if ok and _hashpool.submit(SAME, PREFIX, 2).result() == SAME_WANT else 1)
assert os.waitpid(pid, 0)[1] == 0
assert _hashpool.grouped() > 0 or not _hashpool.GROUPING, "no group was hashed"
assert _hashpool.mixed() > 0 or not _hashpool.GROUPING, "no short buffers were hashed in lanes"
assert _hashpool.blake3_hashed() > 0, "nothing was hashed with BLAKE3"
print("ok")
