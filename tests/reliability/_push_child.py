"""Child of test_push_kill: pushes a ref to a remote, slowly enough for the parent to SIGKILL it.

Usage: ``_push_child.py SRC REMOTE PACK_SIZE``. The remote is opened with packs of PACK_SIZE bytes
and the push reads one pack's worth per batch, pausing after each (the progress hook), so packs are
published one by one while the parent watches. Prints ``batch BLOCKS BYTES`` after each batch and
``done BLOCKS_SENT BYTES_SENT BYTES_SKIPPED`` at the end.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import cas_ckpt
from cas_ckpt import replication
from cas_ckpt.blocks import LocalStore
from cas_ckpt.refs import LocalRefStore


def open_remote(where: str, pack_size: int) -> cas_ckpt.Repository:
    if where.startswith("s3://"):
        return cas_ckpt.open(where, storage_options={"pack_size": pack_size, "min_grace": 0.0})
    cas_ckpt.open(where).close()  # created if missing, then opened with small packs
    root = Path(where)
    return cas_ckpt.Repository(LocalStore(root, pack_size=pack_size), LocalRefStore(root),
                               create=False, location=where)


def main() -> None:
    src, where, pack_size = sys.argv[1], sys.argv[2], int(sys.argv[3])
    replication.BATCH_BYTES = pack_size  # one pack's worth per batch: a kill lands between packs

    def progress(blocks: int, nbytes: int, total_blocks: int, total_bytes: int) -> None:
        print(f"batch {blocks} {nbytes}", flush=True)
        time.sleep(0.05)

    with cas_ckpt.open(src) as repo, open_remote(where, pack_size) as remote:
        report = repo.push(remote, "main", progress=progress)
    print(f"done {report.blocks_sent} {report.bytes_sent} {report.bytes_skipped}", flush=True)


if __name__ == "__main__":
    main()
