"""Child of test_kill: a zygote that forks saver processes for the parent to SIGKILL.

Usage: ``_kill_child.py REPO LOG SEED SCALE``. Imports everything once, prints ``ready``, then for
each ``run START_I CHILD_SEED`` line on stdin forks a saver, prints its pid, waits for it (the parent
kills it) and prints ``exit STATUS``.

A saver saves states in a loop to a few refs, with a GC now and then. Around each save it appends to
LOG (fsynced): ``begin REF I DIGEST`` before and ``done REF I CID DIGEST`` once ``save`` returned.
"""

from __future__ import annotations

import os
import random
import sys

import _support

import cas_ckpt

REFS = ("main", "runs/a", "runs/b/c")


def saver(repo_dir: str, log: str, seed: int, scale: float, start: int, child_seed: int) -> None:
    rng = random.Random(child_seed)
    repo = cas_ckpt.open(repo_dir)
    i = start
    while True:
        if i > start and rng.random() < 0.15:
            _support.append_line(log, f"gc-begin {i}")
            repo.gc(reflog_expiry=0)  # sweep old checkpoints under the kills too
            _support.append_line(log, f"gc-done {i}")
        ref = rng.choice(REFS)
        state = _support.make_state(seed, i, scale=scale)
        d = _support.digest(state)
        _support.append_line(log, f"begin {ref} {i} {d}")
        cid = repo.save(state, ref=ref, step=i)
        _support.append_line(log, f"done {ref} {i} {cid} {d}")
        i += 1


def main() -> None:
    repo_dir, log, seed, scale = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
    print("ready", flush=True)
    for command in sys.stdin:
        _, start, child_seed = command.split()
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                saver(repo_dir, log, seed, scale, int(start), int(child_seed))
            except BaseException as exc:
                import traceback

                traceback.print_exc()
                code = 3 if isinstance(exc, Exception) else 4
            finally:
                sys.stderr.flush()
                os._exit(code)
        print(pid, flush=True)
        _, status = os.waitpid(pid, 0)
        print("exit", status, flush=True)


if __name__ == "__main__":
    main()
