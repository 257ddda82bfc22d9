"""The compiled hashing pool (cas_ckpt/_hashpool.c) against hashlib, the blake3 package and
multiformats.

``Hasher.raw_many`` must give exactly the CIDs ``Hasher.raw`` gives, with the pool and without
it, for both hashes, and a save or a verified load must not depend on which one ran. The pool's
own contract: it holds each buffer from submit until the result is taken or the job dropped,
refuses a buffer it cannot read whole, and works in a forked child (which has none of the
parent's threads).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import threading
import warnings
from collections.abc import Callable
from pathlib import Path

import blake3
import ml_dtypes
import numpy as np
import pytest
from helpers import flip_byte
from hypothesis import given, settings
from hypothesis import strategies as st
from multiformats import CID, multihash

import cas_ckpt
from cas_ckpt import cid as cidlib
from cas_ckpt.errors import CorruptBlock

if os.environ.get("CAS_CKPT_REQUIRE_NATIVE") == "1":
    assert cidlib._hashpool is not None, "cas_ckpt._hashpool was not built (setup.py)"
    assert cidlib._hashpool.BLAKE3_VERSION, "cas_ckpt._hashpool was built without BLAKE3"
hashpool = pytest.importorskip("cas_ckpt._hashpool", reason="the compiled pool was not built")

SHA = cidlib.Hasher("sha2-256")
BLAKE = cidlib.Hasher("blake3")
PREFIX = cidlib.prefix(cidlib.RAW, cidlib.SHA2_256)
B3_PREFIX = cidlib.prefix(cidlib.RAW, cidlib.BLAKE3)


def reference(data: bytes) -> bytes:
    return bytes(CID("base32", 1, "raw", multihash.digest(data, "sha2-256", size=32)))


@pytest.fixture(params=["pool", "hashlib"])
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each test with the compiled pool, then with the hashlib fallback."""
    if request.param == "hashlib":
        monkeypatch.setattr(cidlib, "_hashpool", None)
    return str(request.param)


@settings(max_examples=60, deadline=None)
@given(blobs=st.lists(st.binary(max_size=70_000), max_size=40), threads=st.integers(0, 3))
def test_the_pool_gives_the_cids_multiformats_gives(blobs: list[bytes], threads: int) -> None:
    got = hashpool.submit(blobs, PREFIX, threads).result()
    assert got == [reference(b) for b in blobs] == [SHA.raw(b) for b in blobs]


@given(blobs=st.lists(st.binary(max_size=5000), max_size=30))
def test_raw_many_equals_raw_with_either_backend(blobs: list[bytes]) -> None:
    want = [SHA.raw(b) for b in blobs]
    assert SHA.raw_many(blobs).result() == want
    saved, cidlib._hashpool = cidlib._hashpool, None
    try:
        assert SHA.raw_many(blobs).result() == want
    finally:
        cidlib._hashpool = saved


def test_blake3_is_hashed_on_the_pool_with_either_backend(backend: str) -> None:
    """A blake3 hasher's raw_many runs on the pool where it is built, and falls back to the
    blake3 package where it is not: the same CIDs, whatever the buffer's format (the package
    itself refuses a float32 array's)."""
    blobs: list[object] = [os.urandom(3000) for _ in range(20)]
    blobs += [np.arange(n, dtype=np.float32) for n in (1, 700, 4096)] + [np.zeros((3, 5), np.int16)]
    want = [B3_PREFIX + blake3.blake3(memoryview(b).cast("B")).digest() for b in blobs]  # type: ignore[arg-type]
    before = hashpool.blake3_hashed()
    assert BLAKE.raw_many(blobs).result() == want
    assert BLAKE.pooled == (backend == "pool")
    assert hashpool.blake3_hashed() - before == (len(blobs) if backend == "pool" else 0)


# Every length class of BLAKE3: empty, one byte, around one 64-byte block, around one 1 KiB chunk,
# powers of two of chunks and one past (the tree's shapes), odd lengths, 1 MiB and past it.
B3_LENGTHS = sorted({0, 1, 2, 31, 63, 64, 65, 127, 128, 129, 1023, 1024, 1025, 2047, 2048, 2049,
                     3072, 3073, 4095, 4096, 4097, 8191, 8192, 8193, 16383, 16384, 16385, 31744,
                     65535, 65536, 65537, 100_003, 262_143, 262_144, 262_145, 1 << 20,
                     (1 << 20) - 1, (1 << 20) + 1, 3 * (1 << 20) + 777})


@pytest.mark.parametrize("filling", [False, True])
@pytest.mark.parametrize("threads", [0, 2])
def test_blake3_on_the_pool_is_the_blake3_package_for_every_length_class(
    filling: bool, threads: int
) -> None:
    """Each length alone in a job and all of them in one (claimed in ranges by several threads),
    hashed or filled from one source and hashed 64 KiB at a time: the blake3 package's digests,
    which are multiformats' blake3 multihashes."""
    rng = np.random.default_rng(21)
    blobs = [rng.bytes(n) for n in B3_LENGTHS]
    want = [B3_PREFIX + blake3.blake3(b).digest() for b in blobs]
    assert want[:3] == [bytes(CID("base32", 1, "raw", multihash.digest(b, "blake3", size=32)))
                        for b in blobs[:3]]

    def run(part: list[bytes]) -> list[bytes]:
        if not filling:
            return hashpool.submit(part, B3_PREFIX, threads, hash=hashpool.BLAKE3).result()
        outs = [np.zeros(len(b), np.uint8) for b in part]
        got = hashpool.submit(outs, B3_PREFIX, threads, b"".join(part), hash=hashpool.BLAKE3).result()
        assert [o.tobytes() for o in outs] == part
        return got

    assert [run([b])[0] for b in blobs] == want
    assert run(blobs) == want


@settings(max_examples=60, deadline=None)
@given(blobs=st.lists(st.binary(max_size=70_000), max_size=40), threads=st.integers(0, 3),
       filling=st.booleans())
def test_blake3_on_the_pool_gives_the_blake3_packages_cids(
    blobs: list[bytes], threads: int, filling: bool
) -> None:
    want = [B3_PREFIX + blake3.blake3(b).digest() for b in blobs]
    if filling:
        outs = [bytearray(len(b)) for b in blobs]
        got = hashpool.submit(outs, B3_PREFIX, threads, b"".join(blobs), hash=hashpool.BLAKE3).result()
        assert outs == blobs
    else:
        got = hashpool.submit(blobs, B3_PREFIX, threads, hash=hashpool.BLAKE3).result()
    assert got == want == [BLAKE.raw(b) for b in blobs]


@settings(max_examples=30, deadline=None)
@given(plan=st.lists(st.tuples(st.booleans(), st.sampled_from([100, 5000, 64 * 1024, 1 << 20]),
                               st.integers(1, 17)), max_size=10),
       threads=st.integers(0, 3), seed=st.integers(0, 2**32 - 1))
def test_jobs_of_both_hashes_queued_together_each_get_their_own_hash(
    plan: list[tuple[bool, int, int]], threads: int, seed: int
) -> None:
    """SHA-256 jobs of buffers of one length (groups, taken across the queue's jobs) or of short
    ones (lanes), queued between BLAKE3 jobs of the same lengths: no group or lane takes a
    BLAKE3 job's buffers, and each job gets its own hash's CIDs."""
    rng = np.random.default_rng(seed)
    jobs, wants = [], []
    for is_blake3, length, count in plan:
        blobs = [rng.bytes(length) for _ in range(count)]
        if is_blake3:
            jobs.append(hashpool.submit(blobs, B3_PREFIX, threads, hash=hashpool.BLAKE3))
            wants.append([B3_PREFIX + blake3.blake3(b).digest() for b in blobs])
        else:
            jobs.append(hashpool.submit(blobs, PREFIX, threads))
            wants.append([PREFIX + hashlib.sha256(b).digest() for b in blobs])
    assert [job.result() for job in jobs] == wants


def test_a_hash_the_pool_does_not_know_is_refused() -> None:
    with pytest.raises(ValueError, match="hash must be"):
        hashpool.submit([b"x"], PREFIX, 1, hash=0x13)
    assert hashpool.submit([b"x"], PREFIX, 1, hash=hashpool.SHA2_256).result() == [SHA.raw(b"x")]


@pytest.mark.parametrize("hash_name", ["sha2-256", "blake3"])
def test_many_small_arrays_round_trip_with_either_hash(
        tmp_path: Path, backend: str, hash_name: str) -> None:
    state = _small_state(6)
    with cas_ckpt.open(tmp_path / "r", hash=hash_name) as repo:
        repo.save(state, ref="main")
        loaded = repo.load("main")
    for got, want in zip(loaded["blocks"], state["blocks"], strict=True):  # type: ignore[call-overload]
        assert list(got) == list(want) and all(got[k].tobytes() == want[k].tobytes() for k in want)


def test_every_kind_of_buffer_hashes_its_bytes() -> None:
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(1000).astype(np.float32), np.arange(700, dtype=np.int64),
              rng.standard_normal(900).astype(ml_dtypes.bfloat16), np.zeros((0,), np.float32),
              np.asfortranarray(rng.standard_normal((30, 40)))[:, :].T.copy()]
    buffers: list[object] = [*arrays, b"bytes", bytearray(b"bytearray"), memoryview(b"0123456789")[2:7]]
    want = [SHA.raw(a.tobytes() if isinstance(a, np.ndarray) else bytes(a)) for a in buffers]
    assert hashpool.submit(buffers, PREFIX, 2).result() == want


def test_a_buffer_it_cannot_read_whole_is_refused_at_submit() -> None:
    strided = np.arange(100, dtype=np.float64)[::2]
    held = bytearray(100)
    with pytest.raises((BufferError, ValueError), match="contiguous"):
        hashpool.submit([held, strided], PREFIX, 1)
    held.extend(b"x")  # the buffer taken before the refusal was given back
    with pytest.raises(TypeError):
        hashpool.submit([b"ok", 42], PREFIX, 1)
    with pytest.raises(ValueError, match="threads"):
        hashpool.submit([b"ok"], PREFIX, -1)


def test_a_job_holds_its_buffers_until_its_result_is_taken_or_it_is_dropped() -> None:
    data = bytearray(os.urandom(50_000))
    job = hashpool.submit([data], PREFIX, 1)
    with pytest.raises(BufferError):
        data.extend(b"x")  # held: the pool may be reading it
    assert job.result() == [SHA.raw(bytes(data))]
    data.extend(b"x")
    with pytest.raises(RuntimeError, match="already taken"):
        job.result()
    dropped = hashpool.submit([data] * 200, PREFIX, 2)
    del dropped  # waits for what a pool thread is hashing, cancels the rest
    data.extend(b"y")


def test_many_threads_submitting_at_once_each_get_their_own_cids() -> None:
    blobs = [os.urandom(int(n)) for n in np.random.default_rng(1).integers(1, 20_000, 400)]
    want = [SHA.raw(b) for b in blobs]
    failures: list[str] = []

    def run(offset: int) -> None:
        for _ in range(20):
            mine = blobs[offset:] + blobs[:offset]
            if hashpool.submit(mine, PREFIX, 2).result() != want[offset:] + want[:offset]:
                failures.append(f"offset {offset}")

    threads = [threading.Thread(target=run, args=(i * 37,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []


def test_a_waiting_thread_that_hashes_other_jobs_gives_each_its_own_cids() -> None:
    """While its own job's last claim is hashed elsewhere, a waiting thread hashes claims of
    the jobs queued after it. Behind one job of 64 MiB (about 40 ms to hash), more jobs than
    the pool has threads: the thread waiting for the first hashes some of them, and each job,
    waited for in another order than submitted, gets its own CIDs."""
    rng = np.random.default_rng(3)
    first = [rng.bytes(64 << 20)]
    behind = [[rng.bytes(2 << 20), rng.bytes(int(n))] for n in rng.integers(1, 9000, 12)]
    want = [[SHA.raw(b) for b in job] for job in behind]
    for _ in range(3):
        head = hashpool.submit(first, PREFIX, 1)
        jobs = [hashpool.submit(b, PREFIX, 1) for b in behind]
        assert head.result() == [SHA.raw(first[0])]
        assert [job.result() for job in reversed(jobs)] == want[::-1]


def _in_a_forked_child(check: Callable[[], bool]) -> bool:
    """What ``check()`` returns in a forked child (which reports it through a pipe)."""
    read, write = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # 3.12+: fork() with threads
        pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe
        os.write(write, b"1" if check() else b"0")
        os._exit(0)
    os.close(write)
    answer = os.read(read, 1)
    os.close(read)
    return os.waitpid(pid, 0)[1] == 0 and answer == b"1"


def test_a_forked_child_hashes_without_the_parents_threads() -> None:
    """A job queued before fork() is finished by the child itself; new jobs start new threads."""
    blobs = [os.urandom(4000) for _ in range(3000)]
    want = [SHA.raw(b) for b in blobs]
    hashpool.submit(blobs, PREFIX, 2).result()  # the parent's threads are running
    queued = hashpool.submit(blobs, PREFIX, 2)
    assert _in_a_forked_child(
        lambda: queued.result() == want and hashpool.submit(blobs, PREFIX, 2).result() == want
    )
    assert queued.result() == want


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(0, 300_000), max_size=12), threads=st.integers(0, 3),
       hashing=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_a_filling_job_copies_its_source_into_its_buffers_and_hashes_them(
    sizes: list[int], threads: int, hashing: bool, seed: int
) -> None:
    """Buffers filled from one source holding their bytes back to back (pages populated,
    copied and hashed a piece at a time): each gets its part, and the CIDs are multiformats'.
    A job without a prefix only copies, and its result is None."""
    source = np.random.default_rng(seed).bytes(sum(sizes))
    outs = [np.full(n, 0xAA, np.uint8) for n in sizes]
    job = hashpool.submit(outs, PREFIX if hashing else None, threads, source)
    parts = [source[sum(sizes[:i]) : sum(sizes[: i + 1])] for i in range(len(sizes))]
    assert job.result() == ([reference(p) for p in parts] if hashing else None)
    assert [out.tobytes() for out in outs] == parts


def test_a_filling_job_refuses_what_it_cannot_fill() -> None:
    """Read-only buffers, a source of another size than the buffers' sum, a job with neither
    prefix nor source: refused at submit, and every buffer taken before is given back."""
    held = bytearray(10)
    with pytest.raises(BufferError):
        hashpool.submit([held, b"read-only"], PREFIX, 1, b"x" * 19)
    held.extend(b"x")
    with pytest.raises(ValueError, match="source holds 5 bytes"):
        hashpool.submit([held], PREFIX, 1, b"12345")
    held.extend(b"x")
    with pytest.raises(ValueError, match="only copies"):
        hashpool.submit([held], None, 1)
    with pytest.raises(TypeError, match="prefix"):
        hashpool.submit([held], "not bytes", 1, bytes(12))
    source = bytearray(12)
    job = hashpool.submit([held], None, 1, source)
    with pytest.raises(BufferError):
        source.extend(b"x")  # held with the buffers until the result is taken
    assert job.result() is None
    source.extend(b"x")


@pytest.mark.parametrize("hash_name", ["sha2-256", "blake3"])
def test_start_copies_is_the_same_with_and_without_the_pool(
    hash_name: str, backend: str
) -> None:
    """Arrays and byte views filled from one source, checked against their CIDs: the same
    copies, and the same positions reported for the CIDs that do not match, whichever ran."""
    hasher = cidlib.Hasher(hash_name)
    rng = np.random.default_rng(8)
    parts = [rng.bytes(int(n)) for n in rng.integers(1, 200_000, 9)]
    cids = [hasher.raw(p) for p in parts]
    cids[2] = cids[6] = hasher.raw(b"something else")
    outs = [np.empty(len(p) // 4, np.float32) if len(p) % 4 == 0 else memoryview(bytearray(len(p)))
            for p in parts]
    wrong = cidlib.start_copies(cids, outs, memoryview(b"".join(parts)))
    assert wrong() == [2, 6]
    assert [bytes(memoryview(out).cast("B")) for out in outs] == parts
    unchecked = [memoryview(bytearray(len(p))) for p in parts]
    assert cidlib.start_copies(None, unchecked, memoryview(b"".join(parts)))() == []
    assert [bytes(out) for out in unchecked] == parts
    with pytest.raises(ValueError, match="source holds"):
        cidlib.start_copies(cids, outs, memoryview(b"short"))


def test_a_forked_child_finishes_a_filling_job_queued_before_the_fork() -> None:
    """The child's copy of a queued filling job (its buffers copied too) is filled and hashed
    by the child itself: all of it, whatever the parent's threads had done before the fork."""
    rng = np.random.default_rng(9)
    source = rng.bytes(64 << 20)
    size = 1 << 20
    want = [SHA.raw(source[i : i + size]) for i in range(0, len(source), size)]
    outs = [np.empty(size, np.uint8) for _ in want]
    queued = hashpool.submit(outs, PREFIX, 1, source)
    assert _in_a_forked_child(
        lambda: queued.result() == want and b"".join(o.tobytes() for o in outs) == source
    )
    assert queued.result() == want
    assert b"".join(o.tobytes() for o in outs) == source


def _small_state(seed: int) -> dict[str, object]:
    rng = np.random.default_rng(seed)
    return {"blocks": [{f"p{j}": rng.standard_normal(int(rng.integers(300, 4000))).astype(np.float32)
                        for j in range(80)} for _ in range(4)]}


def test_a_save_and_a_verified_load_do_not_depend_on_the_backend(
        tmp_path: Path, backend: str) -> None:
    """The same tree, to the byte, whichever hashed it; a corrupt small block is found."""
    state = _small_state(2)
    with cas_ckpt.open(tmp_path / "r") as repo:
        repo.save(state, ref="main")
        tree = next(iter(repo.log("main"))).tree
    saved, cidlib._hashpool = cidlib._hashpool, None  # the reference: hashlib, block by block
    try:
        with cas_ckpt.open("memory://") as reference_repo:
            reference_repo.save(state, ref="main")
            assert next(iter(reference_repo.log("main"))).tree == tree
    finally:
        cidlib._hashpool = saved
    with cas_ckpt.open(tmp_path / "r") as repo:
        loaded = repo.load("main")
        for got, want in zip(loaded["blocks"], state["blocks"], strict=True):  # type: ignore[call-overload]
            assert all(got[k].tobytes() == want[k].tobytes() for k in want)
        victim = repo.hasher.raw(state["blocks"][2]["p40"].tobytes())  # type: ignore[index]
        path, offset, _ = repo.blocks.locate(victim)
    flip_byte(path, offset + 7)
    with cas_ckpt.open(tmp_path / "r") as repo, pytest.raises(CorruptBlock) as info:
        repo.load("main")
    assert cidlib.to_str(victim) in str(info.value)


def test_chunks_of_large_arrays_hashed_on_the_pool_make_the_same_tree(
        tmp_path: Path, backend: str) -> None:
    """A save hashes the 1 MiB chunks of large arrays on the pool (sha2-256, uncompressed):
    the tree is the one hashlib tasks make; a compressing save, which encodes on the Python
    pool, makes it too; a damaged chunk is found on a verified load."""
    rng = np.random.default_rng(4)
    state = {"big": rng.standard_normal(900_000).astype(np.float32),
             "layers": [rng.standard_normal((512, 700)).astype(np.float32) for _ in range(3)]}
    trees = []
    for compression in ("none", "zstd"):
        with cas_ckpt.open(tmp_path / compression, compression=compression) as repo:
            repo.save(state, ref="main")
            trees.append(next(iter(repo.log("main"))).tree)
    saved, cidlib._hashpool = cidlib._hashpool, None
    try:
        with cas_ckpt.open("memory://") as reference_repo:
            reference_repo.save(state, ref="main")
            trees.append(next(iter(reference_repo.log("main"))).tree)
    finally:
        cidlib._hashpool = saved
    assert trees[0] == trees[1] == trees[2]
    with cas_ckpt.open(tmp_path / "none") as repo:
        assert repo.load("main")["big"].tobytes() == state["big"].tobytes()
        victim = repo.hasher.raw(state["big"].tobytes()[1 << 20 : 2 << 20])
        path, offset, _ = repo.blocks.locate(victim)
    flip_byte(path, offset + 12345)
    with cas_ckpt.open(tmp_path / "none") as repo, pytest.raises(CorruptBlock) as info:
        repo.load("main")
    assert cidlib.to_str(victim) in str(info.value)


@pytest.mark.parametrize("hash_name", ["sha2-256", "blake3"])
@pytest.mark.parametrize("mmap", [False, True])
def test_a_repository_of_either_hash_saves_and_checks_its_loads_on_the_pool(
        tmp_path: Path, backend: str, hash_name: str, mmap: bool) -> None:
    """Large arrays (chunks of 1 MiB and a tail) and small ones: a save hashes them on the pool
    (blake3's count says so), to the CIDs hashlib and the blake3 package give; a verified load,
    copied or mapped, checks every chunk there and names a damaged one."""
    rng = np.random.default_rng(5)
    state = {"big": rng.standard_normal(700_000).astype(np.float32),
             "small": {f"p{i}": rng.standard_normal(int(n)).astype(np.float32)
                       for i, n in enumerate(rng.integers(300, 4000, 40))}}
    pooled = backend == "pool"
    before = hashpool.blake3_hashed()
    with cas_ckpt.open(tmp_path / "r", hash=hash_name) as repo:
        repo.save(state, ref="main")
        data = memoryview(state["big"]).cast("B")  # type: ignore[arg-type]
        chunks = [repo.hasher.raw(bytes(data[i : i + (1 << 20)])) for i in range(0, data.nbytes, 1 << 20)]
        assert all(repo.blocks.has(c) for c in chunks)
    saved_on_pool = hashpool.blake3_hashed() - before
    assert saved_on_pool >= (len(chunks) + 40 if pooled and hash_name == "blake3" else 0)
    assert saved_on_pool <= (0 if not pooled or hash_name != "blake3" else 10_000)
    with cas_ckpt.open(tmp_path / "r", verify=True) as repo:
        before = hashpool.blake3_hashed()
        loaded = repo.load("main", mmap=mmap)
        checked = hashpool.blake3_hashed() - before
        assert loaded["big"].tobytes() == state["big"].tobytes()
        assert all(loaded["small"][k].tobytes() == v.tobytes() for k, v in state["small"].items())  # type: ignore[attr-defined]
        assert (checked >= len(chunks) + 40) == (pooled and hash_name == "blake3")
        path, offset, _ = repo.blocks.locate(chunks[1])
    del loaded  # a mapped array holds its pack open
    flip_byte(path, offset + 4321)
    with cas_ckpt.open(tmp_path / "r", verify=True) as repo, pytest.raises(CorruptBlock) as info:
        repo.load("main", mmap=mmap)
    assert cidlib.to_str(chunks[1]) in str(info.value)


def test_a_damaged_small_block_with_a_good_copy_elsewhere_loads_right(
        tmp_path: Path, backend: str) -> None:
    """The batch's check finds the damaged copy; the block is read again from the good one."""
    state = _small_state(4)
    want = state["blocks"][1]["p9"]  # type: ignore[index]
    with cas_ckpt.open(tmp_path / "r") as repo:
        repo.save(state, ref="main")
        victim = repo.hasher.raw(want.tobytes())
        path, offset, _ = repo.blocks.locate(victim)
        flip_byte(path, offset + 3, 0x40)
        assert repo.blocks.put(victim, want.tobytes())  # the damaged copy is found: a new one
    flip_byte(path, offset + 3, 0x40)  # two good copies now
    with cas_ckpt.open(tmp_path / "r") as repo:
        first, offset, _ = repo.blocks.locate(victim)  # the copy a load maps (index order)
    flip_byte(first, offset + 3, 0x40)
    with cas_ckpt.open(tmp_path / "r") as repo:
        assert repo.blocks.locate(victim)[0] == first
        loaded = repo.load("main")
        assert loaded["blocks"][1]["p9"].tobytes() == want.tobytes()
        assert all(loaded["blocks"][2][k].tobytes() == v.tobytes()
                   for k, v in state["blocks"][2].items())  # type: ignore[index]


@pytest.mark.slow
@pytest.mark.parametrize("tool", ["memcheck", "helgrind"])
def test_valgrind_finds_nothing_in_the_pool(tool: str, tmp_path: Path) -> None:
    """memcheck (memory errors) and helgrind (data races) over threads, dropped jobs, a refused
    buffer and fork: no report may be about the module's code. ``--fair-sched``: without it valgrind
    ran the threads too rarely interleaved to see a race put in on purpose."""
    if shutil.which("valgrind") is None:
        pytest.skip("valgrind is not installed")
    log = tmp_path / "valgrind.log"
    script = Path(__file__).parent / "scripts" / "hashpool_stress.py"
    done = subprocess.run(
        ["valgrind", f"--tool={tool}", "--fair-sched=yes", f"--log-file={log}", sys.executable,
         str(script)],
        capture_output=True, text=True, timeout=900, env={**os.environ, "PYTHONMALLOC": "malloc"},
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
    # memcheck: any frame of ours (an error inside OpenSSL has ours below it). helgrind: the
    # racing access itself, as CPython's benign GIL-flag races run below Job.result too.
    frames = "at|by" if tool == "memcheck" else "at"
    ours = re.compile(rf"^==\d+== +({frames}) 0x[0-9A-F]+: \w+ \(_hashpool\.c:\d+\)", re.M)
    reports = [r for r in log.read_text().split("-" * 64) if ours.search(r)]
    assert reports == [], "\n".join(reports[:2])


# -- 16 buffers of one length at once (_sha256_x16.c) -------------------------------------------
GROUP_LEN = 64 * 1024  # GROUP_MIN_LEN in _hashpool.c
grouping = pytest.mark.skipif(not getattr(hashpool, "GROUPING", 0), reason="no AVX-512 here")


@grouping
def test_the_stress_script_passes_natively_with_groups_across_threads() -> None:
    """The valgrind script's threads, dropped jobs and fork, with the groups valgrind never runs."""
    script = Path(__file__).parent / "scripts" / "hashpool_stress.py"
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


@grouping
def test_a_group_is_taken_where_16_buffers_of_one_length_wait_and_not_below_10() -> None:
    before = hashpool.grouped()
    hashpool.submit([bytes(GROUP_LEN)] * 16, PREFIX, 0).result()
    assert hashpool.grouped() - before == 16
    before = hashpool.grouped()
    hashpool.submit([bytes(GROUP_LEN)] * 9, PREFIX, 0).result()
    hashpool.submit([bytes(GROUP_LEN - 64)] * 16, PREFIX, 0).result()  # too short to group
    assert hashpool.grouped() == before


def hash_filling_or_not(blobs: list[bytes], threads: int, filling: bool) -> list[bytes]:
    """The pool's digests of ``blobs``; filling, it also copies them into fresh buffers, checked."""
    if not filling:
        return hashpool.submit(blobs, PREFIX, threads).result()
    outs = [np.zeros(len(b), np.uint8) for b in blobs]
    got = hashpool.submit(outs, PREFIX, threads, b"".join(blobs)).result()
    assert [o.tobytes() for o in outs] == blobs
    return got


@grouping
@pytest.mark.parametrize("filling", [False, True])
def test_grouped_digests_are_sha256_for_every_length_of_the_last_block(filling: bool) -> None:
    """Every remainder mod 64 (one padding block or two), 16 lanes each with bytes of its own,
    and a group of 11 (lanes past it repeat the first buffer): hashlib's digests, in order."""
    rng = np.random.default_rng(7)
    before = hashpool.grouped()
    for extra in range(129):
        count = 16 if extra % 2 else 11
        blobs = [rng.bytes(GROUP_LEN + extra) for _ in range(count)]
        got = hash_filling_or_not(blobs, 1, filling)
        assert got == [PREFIX + hashlib.sha256(b).digest() for b in blobs], extra
    assert hashpool.grouped() - before > 16 * 64  # the groups, not the one-by-one path, did it


@grouping
@settings(max_examples=40, deadline=None)
@given(plan=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 6)), max_size=14),
       threads=st.integers(0, 3), filling=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_groups_across_jobs_give_each_job_its_own_cids(
    plan: list[tuple[int, int]], threads: int, filling: bool, seed: int
) -> None:
    """Jobs of one to six buffers of a few lengths (a group takes the next buffers of several
    queued jobs); one job is dropped unread. Each other job gets hashlib's CIDs, in its order."""
    rng = np.random.default_rng(seed)
    lengths = [GROUP_LEN, GROUP_LEN + 1, 2 * GROUP_LEN + 55, 1 << 20]
    jobs, wants = [], []
    for kind, count in plan:
        blobs = [rng.bytes(lengths[kind]) for _ in range(count)]
        if filling:
            outs = [np.zeros(len(b), np.uint8) for b in blobs]
            jobs.append((hashpool.submit(outs, PREFIX, threads, b"".join(blobs)), outs))
        else:
            jobs.append((hashpool.submit(blobs, PREFIX, threads), None))
        wants.append(blobs)
    if jobs:
        del jobs[len(jobs) // 2]  # its dealloc waits for any group holding its buffers
        del wants[len(wants) // 2]
    for (job, outs), blobs in zip(jobs, wants, strict=True):
        assert job.result() == [PREFIX + hashlib.sha256(b).digest() for b in blobs]
        if outs is not None:
            assert [o.tobytes() for o in outs] == blobs


# -- short buffers of any lengths, 16 lanes at a time (x16_many) -----------------------------
MIXED_MIN = 8  # MIXED_MIN in _hashpool.c: a claim of fewer short buffers goes one by one


@grouping
def test_short_buffers_go_to_the_lanes_from_eight_in_a_claim_and_long_ones_do_not() -> None:
    before = hashpool.mixed()
    hashpool.submit([bytes(1000)] * (MIXED_MIN - 1), PREFIX, 0).result()
    hashpool.submit([bytes(GROUP_LEN)] * 9, PREFIX, 0).result()  # long, too few for a group
    assert hashpool.mixed() == before
    hashpool.submit([bytes(1000)] * MIXED_MIN, PREFIX, 0).result()
    assert hashpool.mixed() - before == MIXED_MIN


@grouping
@pytest.mark.parametrize("filling", [False, True])
def test_lanes_of_mixed_lengths_give_sha256_for_every_length_up_to_three_blocks(filling: bool) -> None:
    """Lengths 0-200 in one job: each lane pads its own last block (one padding block or two)
    and takes the next buffer while the others go on."""
    rng = np.random.default_rng(11)
    blobs = [rng.bytes(n) for n in range(201)]
    before = hashpool.mixed()
    got = hash_filling_or_not(blobs, 0, filling)
    assert got == [PREFIX + hashlib.sha256(b).digest() for b in blobs]
    assert hashpool.mixed() - before == len(blobs)


@grouping
@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.one_of(st.integers(0, 300), st.integers(0, GROUP_LEN - 1),
                                  st.sampled_from([GROUP_LEN, GROUP_LEN + 1, 1 << 20])),
                        max_size=120),
       threads=st.integers(0, 2), filling=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_jobs_of_short_and_long_buffers_give_hashlibs_cids_in_order(
    lengths: list[int], threads: int, filling: bool, seed: int
) -> None:
    """Runs of short buffers (to the lanes) broken by long ones (one by one or in groups), in
    one job: the CIDs come back in the job's order whichever thread took which run."""
    rng = np.random.default_rng(seed)
    blobs = [rng.bytes(n) for n in lengths]
    got = hash_filling_or_not(blobs, threads, filling)
    assert got == [PREFIX + hashlib.sha256(b).digest() for b in blobs]


def test_a_verified_load_of_small_arrays_hashes_them_in_lanes_where_it_can(tmp_path: Path) -> None:
    """A load's batches of small arrays are jobs of short buffers: the lanes check them."""
    rng = np.random.default_rng(3)
    state = {f"p{i}": rng.random(int(n)) for i, n in enumerate(rng.integers(100, 2000, 300))}
    with cas_ckpt.open(tmp_path / "repo") as repo:
        repo.save(state)
    before = hashpool.mixed()
    with cas_ckpt.open(tmp_path / "repo", verify=True) as repo:
        loaded = repo.load()
    assert all(np.array_equal(loaded[k], v) for k, v in state.items())
    # most: a claim's last few (fewer than MIXED_MIN) may go one by one
    assert (hashpool.mixed() - before >= len(state) // 2) == bool(hashpool.GROUPING)


def test_a_save_of_many_chunks_hashes_them_in_groups_where_it_can(tmp_path: Path) -> None:
    """The lead of a save's hashing holds enough chunks of one length for groups to form."""
    state = {f"w{i}": np.random.default_rng(i).random(1 << 19) for i in range(24)}  # 4 MiB each
    before = hashpool.grouped()
    with cas_ckpt.open(tmp_path / "repo") as repo:
        repo.save(state)
        loaded = repo.load()
    assert all(np.array_equal(loaded[k], v) for k, v in state.items())
    assert (hashpool.grouped() - before > 0) == bool(hashpool.GROUPING)
