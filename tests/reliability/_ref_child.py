"""Child of test_ref_races: a process updating refs, started once the parent has touched GO.

``_ref_child.py saver REPO GO NAME COUNT``: COUNT saves to ``main`` through ``cas_ckpt.open``
(each a compare-and-swap from the head it read; RefConflict retried); prints ``saved CID`` for each.

``_ref_child.py churn ROOT GO REF ROUNDS``: creates and deletes REF with a ``LocalRefStore``, then
drops its reflog, ROUNDS times; after each create, the ref and its one-line reflog must read back,
and after each delete the reflog must end in the deletion. Prints the rounds done.

``_ref_child.py s3writer URL GO K COUNT``: COUNT unconditional sets of ``main`` in an S3 ref store,
each to a CID of its own (compare-and-swap retried inside the store, losers removing their reflog
entries). Prints the CIDs set.

Each prints ``ready`` once set up, then waits for GO. Any error ends the child with a traceback and a
non-zero status.
"""

from __future__ import annotations

import os
import sys
import time

import cas_ckpt
from cas_ckpt import cid as cidlib


def wait_for(go: str) -> None:
    print("ready", flush=True)
    while not os.path.exists(go):
        time.sleep(0.001)


def saver(repo_dir: str, go: str, name: str, count: int) -> None:
    with cas_ckpt.open(repo_dir) as repo:
        wait_for(go)
        for i in range(count):
            while True:
                try:
                    cid = repo.save({"writer": name, "i": i}, ref="main")
                except cas_ckpt.errors.RefConflict:
                    continue
                print("saved", cid, flush=True)
                break


def churn(root: str, go: str, ref: str, count: int) -> None:
    store = cas_ckpt.refs.LocalRefStore(root)
    value = cidlib.Hasher().node(ref.encode())
    wait_for(go)
    rounds = 0
    for _ in range(count):
        assert store.add_if_new(ref, value, message="create"), f"{ref} existed"
        assert store.get(ref) == value, f"{ref} did not read back"
        log = store.reflog(ref)
        assert [(e.old, e.new) for e in log] == [(None, value)], f"{ref}: reflog is {log}"
        assert store.remove_if_equals(ref, value, message="delete"), f"{ref} vanished"
        log = store.reflog(ref)
        assert [(e.old, e.new) for e in log] == [(None, value), (value, None)], f"{ref}: reflog is {log}"
        assert store.drop_reflog(ref), f"{ref}: its reflog was not dropped"
        rounds += 1
    print(rounds)


def s3writer(url: str, go: str, k: int, count: int) -> None:
    from cas_ckpt.refs.s3 import S3RefStore

    store = S3RefStore(url)
    wait_for(go)
    for i in range(count):
        value = cidlib.Hasher().node(f"{k}-{i}".encode())
        assert store.set_if_equals("main", None, value, message=f"{k}-{i}")
        print(cidlib.to_str(value), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "saver":
        saver(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
    elif sys.argv[1] == "churn":
        churn(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
    else:
        s3writer(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
