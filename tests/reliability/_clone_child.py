"""Child of test_push_kill: a clone that stops in its ref phase, for the parent to SIGKILL.

Usage: ``_clone_child.py SRC DST REFS_DONE``. Clones SRC into DST (a directory or
``s3://bucket/prefix``); once REFS_DONE refs have moved in DST (every pin is set before the first
one), prints ``refs REFS_DONE`` and waits on stdin, in the middle of the clone's ref phase, where
the parent kills it. Without the kill it would go on and print ``done``.
"""

from __future__ import annotations

import sys
from typing import Any

import cas_ckpt


def main() -> None:
    src, dst, stop_after = sys.argv[1], sys.argv[2], int(sys.argv[3])
    with cas_ckpt.open(src) as source:
        config = source.config
    target = cas_ckpt.open(dst, hash=config.hash, chunk_size=config.chunk_size)
    store = target.refs_store
    swap = store._swap
    moved = 0

    def pausing_swap(*args: Any) -> bool:  # every ref move of the clone goes through here
        nonlocal moved
        if moved == stop_after:
            print(f"refs {moved}", flush=True)
            sys.stdin.readline()
        done = swap(*args)
        moved += done
        return done

    store._swap = pausing_swap  # type: ignore[method-assign]
    with cas_ckpt.clone(src, target):
        print("done", flush=True)


if __name__ == "__main__":
    main()
