"""A bounded number of pack descriptors: repositories with more packs than ``ulimit -n`` work.

Before, a backend kept one descriptor per pack it had read, and a mapped pack held another: a
repository with more packs than the process may open could not even be opened (its index is read
from every pack). The real-process tests run a child under a low ``RLIMIT_NOFILE``.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import cas_ckpt
from cas_ckpt.backends.descriptors import OpenFiles

LIMIT = 128  # the child's RLIMIT_NOFILE: far fewer descriptors than the repository has packs


def open_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_descriptor_in_use_outlives_its_eviction(tmp_path: Path) -> None:
    """Evicted, forgotten or closed while in use, it still names its own file until released,
    so no other file gets its number under a read."""
    paths = [tmp_path / f"f{i}" for i in range(6)]
    for i, path in enumerate(paths):
        path.write_bytes(bytes([i]) * 10)
    files = OpenFiles(limit=2)

    def opener(i: int) -> Callable[[], int]:
        return lambda: os.open(paths[i], os.O_RDONLY)

    with files.use("f0", opener(0)) as fd0:
        for i in range(1, 6):  # f0 is the least recently used: evicted at the third
            with files.use(f"f{i}", opener(i)):
                pass
        files.forget("f0")
        files.close()
        replacement = os.open(paths[5], os.O_RDONLY)  # would take fd0's number were it closed
        try:
            assert replacement != fd0
            assert os.pread(fd0, 1, 0) == b"\x00"
        finally:
            os.close(replacement)
    assert len(files) == 0


def test_at_most_limit_descriptors_stay_open(tmp_path: Path) -> None:
    for i in range(50):
        (tmp_path / f"f{i}").write_bytes(b"x")
    before = open_count()
    files = OpenFiles(limit=8)
    for i in range(50):
        with files.use(f"f{i}", lambda i=i: os.open(tmp_path / f"f{i}", os.O_RDONLY)) as fd:
            assert os.pread(fd, 1, 0) == b"x"
    assert len(files) == 8 and open_count() - before == 8
    with files.use("f49", lambda: 1 / 0):  # kept: not opened again
        pass
    files.close()
    assert open_count() == before


def test_an_opener_error_comes_out_and_keeps_nothing(tmp_path: Path) -> None:
    files = OpenFiles(limit=4)
    with contextlib.suppress(FileNotFoundError), files.use("gone", lambda: os.open(tmp_path / "no", 0)):
        raise AssertionError("the block must not run")
    assert len(files) == 0


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["enter", "exit", "forget", "close"]),
                              st.integers(0, 5)), max_size=60),
       limit=st.integers(1, 4))
def test_any_interleaving_keeps_each_descriptor_on_its_file(
    ops: list[tuple[str, int]], limit: int, tmp_path_factory: object
) -> None:
    """Uses held open across evictions, forgets and closes, in any order: every descriptor in use
    reads its own file, and once all are released at most ``limit`` remain open."""
    tmp = Path(str(tmp_path_factory.mktemp("files")))  # type: ignore[attr-defined]
    for i in range(6):
        (tmp / f"f{i}").write_bytes(bytes([i]))
    before = open_count()
    files = OpenFiles(limit=limit)
    active: list[tuple[contextlib.ExitStack, int, int]] = []
    try:
        for op, i in ops:
            if op == "enter":
                stack = contextlib.ExitStack()
                fd = stack.enter_context(files.use(f"f{i}", lambda i=i: os.open(tmp / f"f{i}", 0)))
                active.append((stack, fd, i))
            elif op == "exit" and active:
                active.pop(i % len(active))[0].close()
            elif op == "forget":
                files.forget(f"f{i}")
            elif op == "close":
                files.close()
            spare = [os.open(tmp / "f0", 0) for _ in range(3)]  # would reuse a closed number
            for _, fd, j in active:
                assert os.pread(fd, 1, 0) == bytes([j])
            for fd in spare:
                os.close(fd)
    finally:
        for stack, _, _ in active:
            stack.close()
    assert len(files) <= limit and open_count() - before == len(files)
    files.close()
    assert open_count() == before


def run_limited(script: str, *args: str) -> str:
    """Run ``script`` in a child allowed ``LIMIT`` descriptors; its output (it must succeed)."""
    code = f"import resource\nresource.setrlimit(resource.RLIMIT_NOFILE, ({LIMIT}, {LIMIT}))\n"
    done = subprocess.run([sys.executable, "-c", code + textwrap.dedent(script), *args],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_a_repository_with_more_packs_than_descriptors_works(tmp_path: Path) -> None:
    """Three times more packs than the child may open: open, old and new loads (verified, mapped,
    small arrays batched), a save, GC merging them and fsck all work, and few descriptors stay open."""
    repo_dir = tmp_path / "repo"
    saves = 3 * LIMIT
    with cas_ckpt.open(repo_dir, upkeep=False) as repo:  # one pack per save, none merged
        for i in range(saves):
            repo.save({"w": np.full(64, i, np.float32), "big": np.full(5000, i, np.int32), "step": i},
                      step=i)
        assert len(list((repo_dir / "packs").iterdir())) >= saves
    out = run_limited("""
        import os, sys
        import numpy as np
        import cas_ckpt
        from cas_ckpt.backends.descriptors import open_limit
        assert open_limit() == 16  # an eighth of the limit, and as many mappings
        with cas_ckpt.open(sys.argv[1]) as repo:
            n = int(sys.argv[2])
            for back in range(0, n, 7):
                assert repo.load(f"main~{back}")["step"] == n - 1 - back
                mapped = repo.load(f"main~{back}", mmap=True)["big"]  # a view of its own pack
                assert not mapped.flags.writeable and (mapped == n - 1 - back).all()
            small = {f"t{i}": np.full(2048, i, np.float32) for i in range(64)}  # batched blocks
            repo.save(small, ref="small")
            assert all((repo.load("small")[k] == v).all() for k, v in small.items())
            repo.delete_ref("small")
            repo.gc(reflog_expiry=0)  # merges the hundreds of small packs
            assert repo.fsck().ok
            assert repo.load("main")["step"] == n - 1
            print(len(os.listdir("/proc/self/fd")))
        """, str(repo_dir), str(saves))
    assert int(out.split()[-1]) < LIMIT


def test_the_s3_block_cache_keeps_few_descriptors(tmp_path: Path) -> None:
    """The local cache of an S3 repository holds one sparse copy per pack fetched: hundreds of
    packs cached and read back under the low limit, and dropped ones leave no file behind."""
    out = run_limited("""
        import os, sys
        from pathlib import Path
        from cas_ckpt.backends.s3 import PackCache
        cache = PackCache(sys.argv[1])
        for i in range(400):
            cache.write(f"p{i}.pack", 4096 * i, memoryview(bytes([i % 256]) * 100), [4096 * i])
        for i in range(400):
            out = bytearray(100)
            assert cache.read_into(f"p{i}.pack", 4096 * i, memoryview(out), [4096 * i])
            assert out == bytes([i % 256]) * 100
        for i in range(0, 400, 2):
            cache.drop(f"p{i}.pack")
            assert not cache.read_into(f"p{i}.pack", 4096 * i, memoryview(bytearray(100)), [4096 * i])
        assert not (Path(sys.argv[1]) / "p0.pack").exists()
        cache.close()
        print(len(os.listdir("/proc/self/fd")))
        """, str(tmp_path / "cache"))
    assert int(out.split()[-1]) < 16


def test_a_mapped_load_of_many_small_tensors_holds_no_descriptor_each(tmp_path: Path) -> None:
    """``mmap=True`` copies small tensors: a copy-on-write mapping each held a descriptor (Python's
    mmap keeps a duplicate), so a state of more small tensors than the process may open failed
    the second time it was loaded, the first load's tensors still alive. A large tensor is still
    mapped, copy-on-write."""
    out = run_limited("""
        import os, sys
        import torch
        import cas_ckpt
        state = {f"t{i}": torch.full((1024,), float(i)) for i in range(3 * 128)}
        state["big"] = torch.arange(1 << 16, dtype=torch.float32)
        with cas_ckpt.open(sys.argv[1]) as repo:
            repo.save(state, ref="main")
            kept = [repo.load("main", mmap=True) for _ in range(2)]
            kept.append(repo.load("main", mmap=True, map_location="cpu"))  # copied at once there
            for loaded in kept:
                assert all(torch.equal(loaded[k], v) for k, v in state.items())
                loaded["t0"] += 1.0  # writable, and private to this load
                loaded["big"] += 1.0
            assert torch.equal(repo.load("main")["big"], state["big"])
            maps = open("/proc/self/maps").read()
            print(maps.count(os.path.realpath(sys.argv[1])), len(os.listdir("/proc/self/fd")))
        """, str(tmp_path / "repo"))
    mapped, descriptors = (int(x) for x in out.split()[-2:])
    assert 3 <= mapped < 16 and descriptors < 64  # the big tensor's mapping in each load
