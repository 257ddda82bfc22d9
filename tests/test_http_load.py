"""``cas-ckpt serve`` under load, with real processes: 64 connections at once while another process
saves and collects garbage, a streamed CAR whose server memory stays flat, and a pull SIGKILLed
mid-transfer that resumes sending only what is missing.
"""

from __future__ import annotations

import hashlib
import io
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import urllib3
from http_servers import fault_proxy, serve_process

import cas_ckpt
from cas_ckpt import cid as cidlib
from cas_ckpt.maintenance.walk import data_blocks

MiB = 1024 * 1024
CLIENTS = 64

# The other process: saves a new checkpoint on ref "churn" and collects the old one, again and
# again, until the test creates the stop file (at most 100 rounds); prints how many rounds it ran.
CHURN = """
import sys, os, numpy as np, cas_ckpt
repo, stop = sys.argv[1], sys.argv[2]
rounds = 0
with cas_ckpt.open(repo) as r:
    while not os.path.exists(stop) and rounds < 100:
        r.save({"w": np.random.default_rng(rounds).random(2 * 262_144, np.float32)}, ref="churn")
        r.gc(reflog_expiry=0)
        rounds += 1
print(rounds)
"""


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_64_connections_while_saving_and_gc(tmp_path: Path) -> None:
    path = tmp_path / "repo"
    with cas_ckpt.open(path) as repo:
        root = bytes(repo.save({"w": np.random.default_rng(0).random(4 * 262_144, np.float32),
                                "b": np.arange(100)}))
        blocks = {c: repo.blocks.get(c) for c in data_blocks(repo.blocks, root)}
        export = io.BytesIO()
        repo.export_car(root, export)
    expected_car = export.getvalue()
    stop = tmp_path / "stop"
    problems: list[str] = []
    done = {"raw": 0, "car": 0, "churn": 0}
    lock = threading.Lock()
    with serve_process(path) as server:
        churn = subprocess.Popen([sys.executable, "-c", CHURN, str(path), str(stop)],
                                 stdout=subprocess.PIPE, text=True)
        start = threading.Barrier(CLIENTS)

        def client(i: int) -> None:
            try:
                rounds_of(i)
            except Exception as exc:  # reported with the others, not lost in a thread
                with lock:
                    problems.append(f"client {i}: {exc!r}")

        def rounds_of(i: int) -> None:
            http = urllib3.PoolManager(maxsize=1, retries=False, timeout=urllib3.Timeout(connect=10, read=60))
            start.wait()  # 64 connections open at once
            for round in range(3):
                cid = list(blocks)[(i + round) % len(blocks)]
                raw = http.request("GET", f"{server.url}/ipfs/{cidlib.to_str(cid)}?format=raw")
                car = http.request("GET", f"{server.url}/ipfs/{cidlib.to_str(root)}?format=car")
                churned = http.request("GET", f"{server.url}/refs/churn")
                with lock:
                    if raw.status != 200 or raw.data != blocks[cid]:
                        problems.append(f"raw {cidlib.to_str(cid)}: {raw.status}")
                    if car.status != 200 or _sha(car.data) != _sha(expected_car):
                        problems.append(f"car: {car.status}, {len(car.data)} bytes")
                    done["raw"] += 1
                    done["car"] += 1
                if churned.status == 200:  # a block the other process may collect any moment
                    other = cidlib.to_bytes(churned.json()["cid"])
                    answer = http.request("GET", f"{server.url}/ipfs/{cidlib.to_str(other)}?format=raw")
                    with lock:
                        if answer.status == 200 and not cidlib.matches(other, answer.data):
                            problems.append(f"wrong bytes for {cidlib.to_str(other)}")
                        elif answer.status not in (200, 404):
                            problems.append(f"churn {answer.status}")
                        done["churn"] += 1
            http.clear()

        threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=300)
        stop.touch()
        rounds = int(churn.communicate(timeout=120)[0])
        assert server.proc.poll() is None  # still serving
        log = server.stop() if problems else ""
    assert problems == [], f"the server's log:\n{log}"
    assert done["raw"] == done["car"] == CLIENTS * 3
    assert rounds >= 1


def test_a_large_car_streams_in_bounded_server_memory(tmp_path: Path) -> None:
    size = 256 * MiB if os.environ.get("CAS_CKPT_LONG") == "1" else 96 * MiB
    path = tmp_path / "repo"
    with cas_ckpt.open(path) as repo:
        rng = np.random.default_rng(3)
        root = repo.save({f"a{i}": rng.random(2 * 262_144, np.float32) for i in range(size // (2 * MiB))})
    with serve_process(path) as server:
        http = urllib3.PoolManager(retries=False)
        before = server.rss_anon()
        response = http.request("GET", f"{server.url}/ipfs/{root}?format=car", preload_content=False)
        received, peak = 0, before
        for piece in response.stream(MiB):
            received += len(piece)
            if received % (8 * MiB) < len(piece):
                peak = max(peak, server.rss_anon())
        peak = max(peak, server.rss_anon())
    assert received > size
    grown = (peak - before) / MiB
    assert grown < 48, f"the server's heap grew by {grown:.0f} MiB streaming {size // MiB} MiB"


PULL = """
import sys, cas_ckpt
dst, url, pack = sys.argv[1], sys.argv[2], int(sys.argv[3])
with cas_ckpt.open(dst) as repo:
    repo.blocks.pack_size = pack
    report = repo.pull(url, "main")
    print(report.blocks_sent, report.blocks_skipped)
"""


def test_a_pull_killed_mid_transfer_resumes(tmp_path: Path) -> None:
    path, dst = tmp_path / "repo", tmp_path / "dst"
    with cas_ckpt.open(path) as repo:
        rng = np.random.default_rng(4)
        state = {f"a{i}": rng.random(262_144, np.float32) for i in range(48)}  # 48 MiB, 48 chunks
        repo.save(state)
    with serve_process(path) as server, fault_proxy(server.url) as proxy:
        proxy.spoil("hang", after=40)  # the pull's 41st block request never gets an answer
        pull = subprocess.Popen([sys.executable, "-c", PULL, str(dst), proxy.url, str(4 * MiB)],
                                stdout=subprocess.PIPE, text=True)
        try:
            assert proxy.reached.wait(timeout=120), "the pull made no progress"
            # The first batch (32 MiB) was read before the hang; wait until it is published.
            deadline = time.monotonic() + 60
            while len(list((dst / "packs").glob("*.pack"))) < 2:
                assert time.monotonic() < deadline and pull.poll() is None, "nothing was published"
                time.sleep(0.01)
            os.kill(pull.pid, signal.SIGKILL)
            pull.communicate(timeout=30)
        finally:
            if pull.poll() is None:
                pull.kill()
                pull.communicate()
        with cas_ckpt.open(dst) as half:
            assert half.refs() == {}  # no ref names a partial checkpoint
            assert half.fsck().ok
            kept = len(half.blocks)
        assert kept >= 2  # two packs at least, of three chunks each
        proxy.spoil(None)
        resumed = subprocess.run([sys.executable, "-c", PULL, str(dst), proxy.url, str(4 * MiB)],
                                 capture_output=True, text=True, timeout=120)
    assert resumed.returncode == 0, resumed.stderr
    sent, skipped = map(int, resumed.stdout.split())
    assert skipped == kept and sent + skipped == 48 + 2  # the chunks, the tree, the commit
    with cas_ckpt.open(dst) as done:
        loaded = done.load("main")
        assert all(np.array_equal(loaded[k], state[k]) for k in state)
        assert done.fsck().ok

