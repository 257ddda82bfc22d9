#!/usr/bin/env python
"""Profile helpers for cas_ckpt save and load, and the machine's raw bounds.

Run one cas_ckpt operation on a benchmark state, for a profiler to record::

    .venv/bin/py-spy record --idle --threads --format raw -o save.txt -- \\
        .venv/bin/python benchmarks/profile_cas.py --size medium --state a --op save
    .venv/bin/python benchmarks/profile_cas.py --size medium --state a --op load_verify \\
        --pyinstrument

``--phases`` times, by wrapping them, the calls that matter (writes, fsyncs, hashing, waits for
the thread pool) and prints where each run's time went, per thread kind.

``--op bounds`` instead measures what bounds the figures here: sha2-256 on one and on two
threads, and writing a file with and without fsync. ``--op writeback`` times a save-like
pipeline with the fsync only at the end against starting the writeback while writing.
``--summarise FILE`` folds a py-spy ``raw`` (collapsed stacks) profile into the share of samples
per cas_ckpt function and per leaf.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import os
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench  # the sibling runner, for its state builders

import cas_ckpt

MiB = 1024 * 1024


class Phases:
    """Cumulative seconds in wrapped calls: main thread (wall) and pool threads (thread-seconds)."""

    def __init__(self) -> None:
        self.main: collections.Counter[str] = collections.Counter()
        self.pool: collections.Counter[str] = collections.Counter()
        self._main_thread = threading.main_thread()
        self._depth = threading.local()

    def wrap(self, owner: Any, attr: str, label: str) -> None:
        original = getattr(owner, attr)
        phases = self

        def timed(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(phases._depth, "n", 0)
            if depth:  # count only the outermost wrapped call
                return original(*args, **kwargs)
            phases._depth.n = 1
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                phases._depth.n = 0
                main = threading.current_thread() is phases._main_thread
                (phases.main if main else phases.pool)[label] += time.perf_counter() - t0

        setattr(owner, attr, timed)

    def install(self) -> None:
        from concurrent.futures import Future

        from cas_ckpt import _fs, codec, tree
        from cas_ckpt import cid as cidlib

        self.wrap(_fs, "write_all", "write (os.write)")
        self.wrap(os, "fsync", "fsync")
        self.wrap(_fs, "fsync_dir", "fsync dir")
        self.wrap(_fs, "pread_into", "pread")
        self.wrap(cidlib, "matches", "verify hash")
        self.wrap(cidlib.Hasher, "raw", "hash chunk")
        self.wrap(cidlib.Hasher, "node", "hash node")
        self.wrap(codec, "encode", "msgpack encode")
        self.wrap(codec, "decode", "msgpack decode")
        self.wrap(tree.TreeReader, "node", "read+verify+decode node")
        self.wrap(Future, "result", "wait for pool")

    def report(self, seconds: float) -> str:
        main = ", ".join(f"{k} {v:.3f}" for k, v in self.main.most_common())
        other = seconds - sum(self.main.values())
        pool = ", ".join(f"{k} {v:.3f}" for k, v in self.pool.most_common())
        self.main.clear()
        self.pool.clear()
        return f"    main thread: {main}, other {other:.3f}\n    pool threads: {pool or '-'}"


def run_op(size: str, state_name: str, op: str, repeat: int, use_pyinstrument: bool,
           phases: Phases | None = None) -> None:
    state = bench.build_state(state_name, bench.SIZES[size], 5 + ord(state_name))
    work = Path(tempfile.mkdtemp(prefix="cas-prof-"))
    repo_dir = work / "repo"
    try:
        if op != "save":
            # Loads and re-saves need a saved checkpoint first; a forked child writes it, so a
            # profiler following this process alone records only the operation under study.
            def setup() -> dict[str, float]:
                with cas_ckpt.open(repo_dir) as repo:
                    repo.save(state.nested, ref="main")
                return {}

            bench.forked(setup)
        profiler = None
        if use_pyinstrument:
            from pyinstrument import Profiler

            profiler = Profiler(interval=0.001)
            profiler.start()
        if phases is not None:
            phases.install()
        for i in range(repeat):
            target = repo_dir if op != "save" else work / f"fresh{i}"
            if op in ("save", "save_unchanged"):
                with cas_ckpt.open(target) as repo:
                    if phases is not None:
                        phases.report(0.0)  # drop what opening the repository did
                    t0 = time.perf_counter()
                    repo.save(state.nested, ref="main")
                    seconds = time.perf_counter() - t0
            else:
                with cas_ckpt.open(target, verify=op == "load_verify") as repo:
                    if phases is not None:
                        phases.report(0.0)
                    t0 = time.perf_counter()
                    loaded = repo.load("main")
                    seconds = time.perf_counter() - t0
                    arrays, _ = bench.flatten(loaded)
                    bench.touch_all(arrays)
                    del loaded, arrays
            print(f"{op} {i}: {seconds:.3f} s, {state.nbytes / seconds / 1e9:.2f} GB/s", flush=True)
            if phases is not None:
                print(phases.report(seconds), flush=True)
            if op == "save":
                shutil.rmtree(target)
        if profiler is not None:
            profiler.stop()
            print(profiler.output_text(unicode=False, color=False, show_all=False))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def bounds(total: int) -> None:
    data = np.random.Generator(np.random.SFC64(1)).integers(0, 255, total, dtype=np.uint8)
    view = memoryview(data)
    chunks = [view[i : i + MiB] for i in range(0, total, MiB)]

    def best(fn, n: int = 3) -> float:  # type: ignore[no-untyped-def]
        return min(_timed(fn) for _ in range(n))

    def sha_one() -> None:
        for c in chunks:
            hashlib.sha256(c).digest()

    print(f"sha2-256, 1 thread : {total / best(sha_one) / 1e9:.2f} GB/s")

    def blake3_one() -> None:
        import blake3

        for c in chunks:
            blake3.blake3(c).digest()

    print(f"blake3, 1 thread   : {total / best(blake3_one) / 1e9:.2f} GB/s")
    for threads in (2, 4):
        with ThreadPoolExecutor(threads) as pool:
            def sha_pool(p: ThreadPoolExecutor = pool) -> None:
                list(p.map(lambda c: hashlib.sha256(c).digest(), chunks))

            print(f"sha2-256, {threads} threads: {total / best(sha_pool) / 1e9:.2f} GB/s")
    work = Path(tempfile.mkdtemp(prefix="cas-bounds-"))
    try:
        for fsync in (False, True):
            def write(do_fsync: bool = fsync) -> None:
                path = work / "f"
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                for c in chunks:
                    os.write(fd, c)
                if do_fsync:
                    os.fsync(fd)
                os.close(fd)
                path.unlink()

            label = "write + fsync" if fsync else "write (page cache)"
            print(f"{label:<19}: {total / best(write) / 1e9:.2f} GB/s")
        path = work / "f"
        path.write_bytes(data.tobytes())
        fd = os.open(path, os.O_RDONLY)
        out = np.empty(total, dtype=np.uint8)
        ov = memoryview(out)

        def pread_warm() -> None:
            for i in range(0, total, MiB):
                os.preadv(fd, [ov[i : i + MiB]], i)

        print(f"pread (warm cache) : {total / best(pread_warm) / 1e9:.2f} GB/s")

        def pread_fresh() -> None:  # into never-touched memory: page faults on every page
            fresh = memoryview(np.empty(total, dtype=np.uint8))
            for i in range(0, total, MiB):
                os.preadv(fd, [fresh[i : i + MiB]], i)

        print(f"pread, fresh memory: {total / best(pread_fresh) / 1e9:.2f} GB/s")

        def first_touch() -> None:
            np.empty(total, dtype=np.uint8).fill(1)

        print(f"first touch (fill) : {total / best(first_touch) / 1e9:.2f} GB/s")
        os.close(fd)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def writeback(total: int, reps: int = 3) -> None:
    """A save's pipeline without cas_ckpt: 2 threads hash 1 MiB chunks, the main thread writes
    them in order, then fsync. Compares fsync only at the end (what cas_ckpt's pack writer does)
    with starting the writeback every 32 MiB while writing: sync_file_range(SYNC_FILE_RANGE_WRITE)
    (Linux, through ctypes) or fdatasync on a helper thread.
    """
    import ctypes

    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    data = np.random.Generator(np.random.SFC64(0)).random(total // 4, dtype=np.float32)
    view = memoryview(data.view(np.uint8))
    chunks = [view[i : i + MiB] for i in range(0, total, MiB)]
    work = Path(tempfile.mkdtemp(prefix="cas-writeback-"))
    step = 32 * MiB

    def save(mode: str, pool: ThreadPoolExecutor) -> tuple[float, float]:
        path = work / "pack"
        t0 = time.perf_counter()
        hashes = [pool.submit(lambda c: hashlib.sha256(c).digest(), c) for c in chunks]
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        flusher: threading.Thread | None = None
        done = flushed = 0
        for chunk, digest in zip(chunks, hashes, strict=True):
            digest.result()
            os.write(fd, chunk)
            done += chunk.nbytes
            if done - flushed >= step:
                if mode == "sync_file_range":
                    libc.sync_file_range(fd, flushed, done - flushed, 2)  # SYNC_FILE_RANGE_WRITE
                elif mode == "fdatasync thread" and (flusher is None or not flusher.is_alive()):
                    flusher = threading.Thread(target=os.fdatasync, args=(fd,))
                    flusher.start()
                flushed = done
        written = time.perf_counter() - t0
        if flusher is not None:
            flusher.join()
        os.fsync(fd)
        os.close(fd)
        seconds = time.perf_counter() - t0
        path.unlink()
        return seconds, written

    try:
        with ThreadPoolExecutor(2) as pool:
            for _ in range(reps):
                for mode in ("fsync at end", "sync_file_range", "fdatasync thread"):
                    seconds, written = save(mode, pool)
                    print(f"{mode:<17}: {seconds:.3f} s (hash+write phase {written:.3f} s), "
                          f"{total / seconds / 1e9:.2f} GB/s", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _timed(fn) -> float:  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def summarise(path: Path, top: int, within: str) -> None:
    """Fold a py-spy ``raw`` profile (record with ``--idle --threads``) into shares of samples.

    The main thread counts only while inside a frame named ``within`` (so state building does
    not count) and, sampled with ``--idle``, shows where the wall time of the operation goes.
    cas_ckpt's pool threads are shown apart, split into busy and idle (waiting for work).
    """
    main: dict[str, collections.Counter[str]] = {
        "innermost cas_ckpt frame": collections.Counter(), "leaf frame": collections.Counter()}
    pool: dict[str, collections.Counter[str]] = {
        "innermost cas_ckpt frame": collections.Counter(), "leaf frame": collections.Counter()}
    main_total = pool_total = 0
    for line in path.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack:
            continue
        count = int(count_text)
        frames = stack.split(";")
        thread, frames = frames[0], frames[1:]
        if "cas_ckpt_" in thread:
            target, pool_total = pool, pool_total + count
        elif any(f.startswith(within + " ") for f in frames):
            target, main_total = main, main_total + count
        else:
            continue
        cas = [f for f in frames if "cas_ckpt/" in f]
        target["innermost cas_ckpt frame"][_short(cas[-1]) if cas else "(no cas_ckpt frame)"] += count
        target["leaf frame"][_short(frames[-1]) if frames else "(none)"] += count
    for title, counters, total in ((f"main thread inside {within}", main, main_total),
                                   ("cas_ckpt pool threads", pool, pool_total)):
        for kind, counter in counters.items():
            print(f"\n{title}: by {kind} ({total} samples)")
            for name, count in counter.most_common(top):
                print(f"  {100 * count / max(total, 1):5.1f}%  {name}")


def _short(frame: str) -> str:
    name, _, where = frame.partition(" (")
    where = where.rstrip(")")
    if "site-packages/" in where:
        where = where.split("site-packages/", 1)[1]
    elif "cas_ckpt/" in where:
        where = "cas_ckpt/" + where.split("cas_ckpt/", 1)[1]
    else:
        where = where.rsplit("/", 1)[-1]
    return f"{name} ({where})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=list(bench.SIZES), default="medium")
    parser.add_argument("--state", choices=list(bench.STATES), default="a")
    parser.add_argument("--op", default="save",
                        choices=["save", "save_unchanged", "load_verify", "load_noverify",
                                 "bounds", "writeback"])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--pyinstrument", action="store_true", help="print a pyinstrument profile")
    parser.add_argument("--phases", action="store_true",
                        help="time writes, fsyncs, hashing and waits inside each run")
    parser.add_argument("--bounds-mib", type=int, default=512,
                        help="data size for --op bounds and --op writeback")
    parser.add_argument("--summarise", type=Path, help="summarise a py-spy raw profile and exit")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--within", default="Repository.save",
                        help="main-thread frame that delimits the operation (--summarise)")
    args = parser.parse_args()
    if args.summarise:
        summarise(args.summarise, args.top, args.within)
    elif args.op == "bounds":
        bounds(args.bounds_mib * MiB)
    elif args.op == "writeback":
        writeback(args.bounds_mib * MiB)
    else:
        run_op(args.size, args.state, args.op, args.repeat, args.pyinstrument,
               Phases() if args.phases else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
