"""A soak of ``cas-ckpt serve`` (issue #48): one server process over a local repository while
another process keeps saving checkpoints to it, deleting old refs, collecting garbage and running
upkeep, and the test's threads are hostile and honest clients at once:

* slow readers: a CAR requested, a little read, a stall, then the connection closed;
* resets: a CAR requested, some bytes read, then the socket closed with ``SO_LINGER`` 0 (an RST);
* drips: a request sent one byte every 0.5 s;
* clients that request CARs and never read a byte, a handful held open at a time;
* verified readers: ``cas_ckpt.open(url).load(...)`` of a step the saver saved, compared with the
  values the step determines (the saver fills them from an RNG seeded by the step), and whole CAR
  downloads whose every block is hashed against its CID and which, imported into a memory
  repository, load to the same values.

At the end: no completed read gave a wrong byte; the server's anonymous RSS, sampled throughout,
stayed under its start (after a warm-up) + :data:`PEAK_BOUND`, and came back to within
:data:`SETTLE_BOUND` of it once the clients left; the server still answers; its stderr holds no
``Traceback``. A read that GC raced (a 404, a stream cut short, a load naming a missing block) is
counted, not a failure: the server is right to refuse what is no longer there, and wrong only if
it sends wrong bytes.

The default run lasts :data:`SHORT_SECONDS` (about 20 s of traffic, under a minute in all); the
``slow`` one (``CAS_CKPT_LONG=1``) ``CAS_CKPT_SOAK_SECONDS`` (default 1800). All traffic is to
127.0.0.1; every loop is bounded by the deadline and a count.
"""

from __future__ import annotations

import io
import os
import random
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import urllib3
from helpers import assert_state_equal
from http_servers import ServerProcess

import cas_ckpt
from cas_ckpt import car
from cas_ckpt import cid as cidlib

MiB = 1024 * 1024
SHORT_SECONDS = 20.0
LONG_SECONDS = float(os.environ.get("CAS_CKPT_SOAK_SECONDS", "1800"))
PEAK_BOUND = 128 * MiB  # the server's heap above its warmed-up start, at any sample
SETTLE_BOUND = 32 * MiB  # ... once every client has left
SETTLE_WAIT = 30.0  # seconds the heap may take to come back
KEEP = 6  # refs the saver keeps: older steps are deleted, and GC collects them

# The values of step n: the saver stores them, a reader recomputes them (about 6 MiB: a CAR that
# socket buffers do not hold, so a reader that stalls stalls the stream).
STATE = '''
import numpy as np

def soak_state(step):
    rng = np.random.default_rng(1000 + step)
    return {"w": rng.random(2 * 1024 * 1024 // 2, np.float32), "x": rng.random(200_000),
            "b": np.full(1000, step, np.int64), "step": step}
'''
_namespace: dict[str, Any] = {}
exec(STATE, _namespace)
soak_state = _namespace["soak_state"]

# The other process: saves step after step as ref soak/<step>, deletes the ref KEEP steps back,
# collects garbage every 3 saves (reflog_expiry=0, grace 0: what no ref holds goes) and runs
# upkeep every 5, until the stop file appears or max_steps; prints one line per step.
SAVER = STATE + '''
import os, sys, time
import cas_ckpt

repo_path, stop, keep, max_steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
freed = 0
with cas_ckpt.open(repo_path) as repo:
    step = max(int(name.split("/")[1]) for name in repo.refs("soak/"))
    while not os.path.exists(stop) and step < max_steps:
        step += 1
        repo.save(soak_state(step), ref=f"soak/{step}", step=step)
        if repo.refs_store.get(f"soak/{step - keep}") is not None:
            repo.delete_ref(f"soak/{step - keep}")
        if step % 3 == 0:
            freed += repo.gc(reflog_expiry=0).blocks_freed
        if step % 5 == 0:
            repo.upkeep(force=True)
        print(step, freed, flush=True)
        time.sleep(0.2)
'''


class Soak:
    """The clients' shared state: the live refs, the tallies, the problems."""

    def __init__(self, server: ServerProcess, seconds: float) -> None:
        self.server = server
        self.deadline = time.monotonic() + seconds
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.refs: dict[int, str] = {}  # step -> commit CID, as /refs last said
        self.counts: Counter[str] = Counter()
        self.problems: list[str] = []  # wrong bytes, a dead server, a client crashed
        self.rss: list[int] = []

    def running(self) -> bool:
        return not self.stop.is_set() and time.monotonic() < self.deadline

    def count(self, what: str) -> None:
        with self.lock:
            self.counts[what] += 1

    def problem(self, what: str) -> None:
        with self.lock:
            self.problems.append(what)

    def pick(self) -> tuple[int, str] | None:
        with self.lock:
            if not self.refs:
                return None
            step = random.choice(sorted(self.refs))
            return step, self.refs[step]

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.server.port), timeout=30)

    def car_request(self, root: str) -> bytes:
        return (f"GET /ipfs/{root}?format=car HTTP/1.1\r\nHost: 127.0.0.1:{self.server.port}\r\n"
                "Connection: close\r\n\r\n").encode()


def _guard(soak: Soak, name: str, body: Any) -> Any:
    """A client thread: runs ``body(soak)`` in a loop until the deadline; an exception it did not
    expect is a problem (connection errors are the point of most clients, so those pass)."""

    def loop() -> None:
        rounds = 0
        while soak.running() and rounds < 1_000_000:
            rounds += 1
            try:
                body(soak)
            except (ConnectionRefusedError, socket.gaierror) as exc:
                soak.problem(f"{name}: the server refused a connection: {exc!r}")
                time.sleep(1)
            except (OSError, urllib3.exceptions.HTTPError):
                soak.count(f"{name}: connection error")
            except Exception as exc:  # reported with the others, never lost in a thread
                soak.problem(f"{name}: {exc!r}")
                time.sleep(0.5)

    return threading.Thread(target=loop, name=name, daemon=True)


def _sleep(soak: Soak, seconds: float) -> None:
    soak.stop.wait(max(0.0, min(seconds, soak.deadline - time.monotonic())))


# --------------------------------------------------------------------------------------------
# The clients
# --------------------------------------------------------------------------------------------
def watch_refs(soak: Soak, http: urllib3.PoolManager) -> None:
    r = http.request("GET", f"{soak.server.url}/refs?prefix=soak/", timeout=30)
    if r.status != 200:
        soak.count(f"refs: {r.status}")
    else:
        refs = {int(name.split("/")[1]): cid for name, cid in r.json().items()}
        with soak.lock:
            soak.refs = refs
    _sleep(soak, 0.5)


def slow_reader(soak: Soak) -> None:
    picked = soak.pick()
    if picked is None:
        return _sleep(soak, 0.2)
    with soak.connect() as sock:
        sock.sendall(soak.car_request(picked[1]))
        got = sock.recv(65536)
        soak.count("slow: started" if got.startswith(b"HTTP/1.1 200") else f"slow: {got[:12]!r}")
        _sleep(soak, random.uniform(1.0, 4.0))
        if got:
            sock.recv(65536)
    soak.count("slow: closed")


def resetter(soak: Soak) -> None:
    picked = soak.pick()
    if picked is None:
        return _sleep(soak, 0.2)
    sock = soak.connect()
    try:
        sock.sendall(soak.car_request(picked[1]))
        want, got = random.randint(1, 3 * MiB), 0
        while got < want:
            piece = sock.recv(min(65536, want - got))
            if not piece:
                break
            got += len(piece)
    finally:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()  # an RST, mid-stream
    soak.count("reset")
    _sleep(soak, 0.1)


def dripper(soak: Soak) -> None:
    request = "GET /pins HTTP/1.1\r\nHost: a\r\n\r\n"  # 31 bytes: 15 s
    with soak.connect() as sock:
        for i, byte in enumerate(request.encode()):
            if not soak.running():
                soak.count("drip: left unfinished")
                return
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                soak.count(f"drip: cut off by the server after {i} bytes")
                return
            _sleep(soak, 0.5)
        sock.settimeout(30)
        answer = sock.recv(65536)
        soak.count(f"drip: answered {answer[:12]!r}" if answer else "drip: closed without an answer")


def never_reader(soak: Soak) -> None:
    """Up to 8 connections at a time that ask for a CAR and never read; each is dropped after a
    while and replaced."""
    held: list[tuple[float, socket.socket]] = []
    try:
        while soak.running():
            while len(held) < 8 and (picked := soak.pick()) is not None:
                sock = soak.connect()
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                sock.sendall(soak.car_request(picked[1]))
                held.append((time.monotonic() + random.uniform(3.0, 10.0), sock))
                soak.count("never: opened")
            now = time.monotonic()
            for entry in [e for e in held if e[0] <= now]:
                entry[1].close()
                held.remove(entry)
            _sleep(soak, 0.2)
    finally:
        for _, sock in held:
            sock.close()


def loader(soak: Soak) -> None:
    """``cas_ckpt.open(url).load`` of a live step, compared with the values of that step."""
    picked = soak.pick()
    if picked is None:
        return _sleep(soak, 0.2)
    step, root = picked
    try:
        with cas_ckpt.open(soak.server.url) as remote:
            loaded = remote.load(root)
    except (cas_ckpt.errors.BlockNotFound, cas_ckpt.errors.RefNotFound, cas_ckpt.errors.CheckpointExpired,
            cas_ckpt.errors.RemoteError) as exc:
        soak.count(f"load: gone or refused ({type(exc).__name__})")
        return
    try:
        assert_state_equal(soak_state(step), loaded)
    except AssertionError as exc:
        soak.problem(f"WRONG BYTES: a load of step {step} ({root}) gave other values: {exc}")
        return
    soak.count("load: verified")


def car_reader(soak: Soak, http: urllib3.PoolManager) -> None:
    """A whole CAR: every block hashed against its CID, then imported and loaded and compared."""
    picked = soak.pick()
    if picked is None:
        return _sleep(soak, 0.2)
    step, root = picked
    r = http.request("GET", f"{soak.server.url}/ipfs/{root}?format=car", preload_content=False,
                     timeout=urllib3.Timeout(connect=10, read=60))
    try:
        if r.status != 200:
            soak.count(f"car: {r.status}")
            r.read()
            return
        try:
            body = r.read()
        except urllib3.exceptions.ProtocolError:
            soak.count("car: cut short (GC took a block)")
            return
    finally:
        r.release_conn()
    try:
        roots, src = car._read_header(io.BytesIO(body))
        blocks = list(car._iter_blocks(src))  # each hashed against its CID
    except cas_ckpt.errors.CarError as exc:
        soak.problem(f"WRONG BYTES: a complete CAR of step {step} ({root}) is bad: {exc}")
        return
    if roots != [cidlib.to_bytes(root)] or blocks[0][0] != roots[0]:
        soak.problem(f"WRONG BYTES: the CAR of {root} has roots {roots}")
        return
    with cas_ckpt.open("memory://") as mem:
        try:
            mem.import_car(io.BytesIO(body))  # all of the root's DAG, each block once
            loaded = mem.load(root)
            assert_state_equal(soak_state(step), loaded)
        except (cas_ckpt.errors.CasCkptError, AssertionError) as exc:
            soak.problem(f"WRONG BYTES: the CAR of step {step} ({root}) does not load as it was saved: {exc}")
            return
    soak.count("car: verified")


def sample_rss(soak: Soak) -> None:
    soak.rss.append(soak.server.rss_anon())
    _sleep(soak, 0.25)


# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------
def soak_serve(tmp_path: Path, seconds: float) -> None:
    path = tmp_path / "repo"
    with cas_ckpt.open(path) as repo:
        repo.save(soak_state(1), ref="soak/1", step=1)
    stop_file = tmp_path / "stop"
    server = ServerProcess(path)
    saver = subprocess.Popen([sys.executable, "-c", SAVER, str(path), str(stop_file), str(KEEP),
                              str(int(seconds * 10) + 100)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log = ""
    try:
        http = urllib3.PoolManager(maxsize=4, retries=False, timeout=urllib3.Timeout(connect=10, read=60))
        warm = Soak(server, 60.0)
        r = http.request("GET", f"{server.url}/refs?prefix=soak/")
        warm.refs = {int(n.split("/")[1]): c for n, c in r.json().items()}
        loader(warm)
        car_reader(warm, http)  # warmed up: imports done, pools started
        assert not warm.problems, warm.problems
        start = server.rss_anon()

        soak = Soak(server, seconds)
        soak.refs = dict(warm.refs)
        clients = [_guard(soak, "refs", lambda s: watch_refs(s, http)),
                   _guard(soak, "rss", sample_rss),
                   *[_guard(soak, f"slow-{i}", slow_reader) for i in range(4)],
                   *[_guard(soak, f"reset-{i}", resetter) for i in range(2)],
                   *[_guard(soak, f"drip-{i}", dripper) for i in range(2)],
                   _guard(soak, "never", never_reader),
                   *[_guard(soak, f"load-{i}", loader) for i in range(2)],
                   _guard(soak, "car", lambda s: car_reader(s, http))]
        for client in clients:
            client.start()
        for client in clients:
            client.join(timeout=seconds + 120)
        hung = [c.name for c in clients if c.is_alive()]
        soak.stop.set()

        stop_file.touch()
        out, err = saver.communicate(timeout=300)
        steps = [line.split() for line in out.splitlines() if line.strip()]
        settled = [server.rss_anon()]
        limit = time.monotonic() + SETTLE_WAIT
        while settled[-1] > start + SETTLE_BOUND and time.monotonic() < limit:
            time.sleep(0.5)
            settled.append(server.rss_anon())
        alive = server.proc.poll() is None
        final = http.request("GET", f"{server.url}/refs", timeout=10) if alive else None
    finally:
        stop_file.touch()
        if saver.poll() is None:
            saver.kill()
            saver.communicate(timeout=60)
        log = server.stop()

    peak = max(soak.rss, default=start)
    summary = (f"{seconds:.0f} s: saver {steps[-1] if steps else 'none'} (last step, blocks GC freed); "
               f"clients {dict(sorted(soak.counts.items()))}; server heap {start / MiB:.0f} MiB at the "
               f"start, {peak / MiB:.0f} MiB at most ({len(soak.rss)} samples), {settled[-1] / MiB:.0f} MiB "
               f"after the clients left; stderr {len(log.splitlines())} lines")
    print(summary)
    failures = []
    if saver.returncode != 0:
        failures.append(f"the saver failed: {err[-3000:]}")
    if hung:
        failures.append(f"client threads still running past the deadline: {hung}")
    failures += soak.problems[:30]
    if not (alive and final is not None and final.status == 200):
        failures.append("the server no longer answers")
    if len(steps) < 5 or int(steps[-1][1]) == 0:
        failures.append("the saver saved or collected too little")
    if not (soak.counts["load: verified"] > 0 and soak.counts["car: verified"] > 0):
        failures.append("no load or no CAR download was verified")
    if peak >= start + PEAK_BOUND:
        failures.append(f"the server's heap peaked {(peak - start) / MiB:.0f} MiB above its start "
                        f"(bound {PEAK_BOUND // MiB} MiB)")
    if settled[-1] >= start + SETTLE_BOUND:
        failures.append(f"the server's heap stayed {(settled[-1] - start) / MiB:.0f} MiB above its start "
                        f"{SETTLE_WAIT:.0f} s after the clients left (bound {SETTLE_BOUND // MiB} MiB)")
    if "Traceback" in log:
        failures.append(f"{log.count('Traceback')} tracebacks in the server's stderr; the last:\n"
                        + log[log.rindex("Traceback") - 200:][:3000])
    assert not failures, "\n".join(failures) + f"\n{summary}"


def test_serve_soak_short(tmp_path: Path) -> None:
    soak_serve(tmp_path, SHORT_SECONDS)


@pytest.mark.slow
def test_serve_soak(tmp_path: Path) -> None:
    soak_serve(tmp_path, LONG_SECONDS)
