#!/usr/bin/env python
"""Profile helpers for cas_ckpt save and load, and the machine's raw bounds.

Run one cas_ckpt operation on a benchmark state, for a profiler to record::

    .venv/bin/py-spy record --idle --threads --format raw -o save.txt -- \\
        .venv/bin/python benchmarks/profile_cas.py --size medium --state a --op save
    .venv/bin/python benchmarks/profile_cas.py --size medium --state a --op load_verify \\
        --pyinstrument

``--op bounds`` instead measures what bounds the figures here: sha2-256 on one and on two
threads, and writing a file with and without fsync. ``--summarise FILE`` folds a py-spy ``raw``
(collapsed stacks) profile into the share of samples per cas_ckpt function and per leaf.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench  # the sibling runner, for its state builders

import cas_ckpt

MiB = 1024 * 1024


def run_op(size: str, state_name: str, op: str, repeat: int, use_pyinstrument: bool) -> None:
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
        for i in range(repeat):
            target = repo_dir if op != "save" else work / f"fresh{i}"
            t0 = time.perf_counter()
            if op in ("save", "save_unchanged"):
                with cas_ckpt.open(target) as repo:
                    repo.save(state.nested, ref="main")
            else:
                with cas_ckpt.open(target, verify=op == "load_verify") as repo:
                    loaded = repo.load("main")
                    arrays, _ = bench.flatten(loaded)
                    bench.touch_all(arrays)
                    del loaded, arrays
            seconds = time.perf_counter() - t0
            print(f"{op} {i}: {seconds:.3f} s, {state.nbytes / seconds / 1e9:.2f} GB/s", flush=True)
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
                                 "bounds"])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--pyinstrument", action="store_true", help="print a pyinstrument profile")
    parser.add_argument("--bounds-mib", type=int, default=512)
    parser.add_argument("--summarise", type=Path, help="summarise a py-spy raw profile and exit")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--within", default="Repository.save",
                        help="main-thread frame that delimits the operation (--summarise)")
    args = parser.parse_args()
    if args.summarise:
        summarise(args.summarise, args.top, args.within)
    elif args.op == "bounds":
        bounds(args.bounds_mib * MiB)
    else:
        run_op(args.size, args.state, args.op, args.repeat, args.pyinstrument)
    return 0


if __name__ == "__main__":
    sys.exit(main())
