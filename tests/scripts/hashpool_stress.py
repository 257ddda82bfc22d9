"""Exercise cas_ckpt._hashpool from several threads, with jobs (hashing, and filling from a
source) taken, dropped and refused, and a forked child: run under valgrind by
tests/test_hashpool.py (long mode)."""

import hashlib
import os
import threading

from cas_ckpt import _hashpool

PREFIX = b"\x01\x55\x12\x20"
BLOBS = [os.urandom(n) for n in range(1, 300_000, 7001)]
WANT = [PREFIX + hashlib.sha256(b).digest() for b in BLOBS]


SOURCE = b"".join(BLOBS)


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
    os._exit(0 if _hashpool.submit(BLOBS, PREFIX, 2).result() == WANT else 1)
assert os.waitpid(pid, 0)[1] == 0
print("ok")
