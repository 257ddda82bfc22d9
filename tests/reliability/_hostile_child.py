"""Child of test_hostile_files: a zygote that runs every user operation on a planted repository.

Prints ``ready``, then for each ``ROOT RESULTS`` line on stdin forks a worker that opens ROOT and
runs the operations below in order, appending one JSON line per finished operation to RESULTS
(``{"op", "ok", "error", "cas", "message", "problems"}``). The zygote prints ``done`` when the
worker exits, or kills it and prints ``timeout`` after TIMEOUT seconds: a hang fails, it never
blocks the test run.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np  # imported once here, not in every worker

import cas_ckpt

TIMEOUT = 10.0

OPS: list[tuple[str, Callable[[cas_ckpt.Repository], Any]]] = [
    ("refs", lambda r: r.refs()),
    ("resolve", lambda r: r.resolve("main")),
    ("load", lambda r: r.load("main")),
    ("reflog", lambda r: r.reflog("main")),
    ("pins", lambda r: r.pins()),
    ("fsck", lambda r: r.fsck()),
    ("gc", lambda r: r.gc()),
    ("save", lambda r: r.save({"x": np.arange(3)}, ref="main")),
    ("pin", lambda r: r.pin(r.resolve("other"))),
    ("unpin", lambda r: r.unpin(r.resolve("other"))),
]


def outcome(op: str, call: Callable[[], Any]) -> dict[str, Any]:
    result: dict[str, Any] = {"op": op, "ok": True, "problems": []}
    try:
        value = call()
    except BaseException as exc:  # everything is reported: the test decides what is acceptable
        return {**result, "ok": False, "error": type(exc).__name__,
                "cas": isinstance(exc, cas_ckpt.CasCkptError), "message": str(exc)[:2000]}
    if op == "fsck":
        problems = [f"{p.kind} {p.cid}: {p.detail}" for p in value.problems]
        result["problems"] = problems + list(value.store_problems)
    return result


def work(root: str, results: str) -> None:
    with open(results, "a") as out:
        def emit(line: dict[str, Any]) -> None:
            out.write(json.dumps(line) + "\n")
            out.flush()

        repo: Any = None

        def opener() -> None:
            nonlocal repo
            repo = cas_ckpt.open(root, create=False)

        emit(outcome("open", opener))
        if repo is None:
            return
        for op, call in OPS:
            emit(outcome(op, lambda call=call: call(repo)))


def serve() -> None:
    print("ready", flush=True)
    for line in sys.stdin:
        root, results = line.split()
        pid = os.fork()
        if pid == 0:
            try:
                work(root, results)
            finally:
                os._exit(0)
        deadline = time.monotonic() + TIMEOUT
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                print("timeout", flush=True)
                break
            time.sleep(0.005)
        else:
            print("done", flush=True)


if __name__ == "__main__":
    serve()
