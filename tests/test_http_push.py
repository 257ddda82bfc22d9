"""Pushes into ``cas-ckpt serve --write-token``: real server processes on 127.0.0.1.

Only missing blocks move (asked about in batches), every block is hashed before it is stored
and durable before a ref points at it, refs move by compare-and-swap (409 -> RefConflict), the
read token cannot write, uploads are bounded, and a push cut off moves no ref.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("aiohttp")

import urllib3
from http_servers import serve_process

import cas_ckpt
from cas_ckpt.carv1 import car_header, section_prefix
from cas_ckpt.errors import RefConflict, RefDiverged, RemoteError

READ, WRITE = "read-token", "write-token"
MiB = 1024 * 1024


def state(seed: int, mib: int = 3) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {"w": rng.standard_normal(mib * MiB // 8), "b": rng.standard_normal(100), "step": seed}


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(
        np.array_equal(a[k], b[k]) if isinstance(a[k], np.ndarray) else a[k] == b[k] for k in a)


@pytest.fixture
def peer(tmp_path: Path) -> Any:
    cas_ckpt.open(tmp_path / "peer").close()
    with serve_process(tmp_path / "peer", "--token", READ, "--write-token", WRITE) as server:
        yield server


def opts(token: str = WRITE) -> dict[str, Any]:
    return {"token": token}


def post(url: str, body: bytes, token: str | None, content_type: str = "application/json",
         headers: dict[str, str] | None = None) -> urllib3.BaseHTTPResponse:
    sent = {"Content-Type": content_type, **(headers or {})}
    if token:
        sent["Authorization"] = f"Bearer {token}"
    return urllib3.request("POST", url, body=body, headers=sent, retries=False, timeout=30)


def test_a_push_sends_only_what_the_peer_lacks_and_moves_the_ref(peer: Any, tmp_path: Path) -> None:
    local = cas_ckpt.open(tmp_path / "local")
    first = local.save(state(1), ref="main")
    report = local.push(peer.url, "main", storage_options=opts())
    assert report.refs == {"main": first} and report.blocks_sent >= 4
    with cas_ckpt.open(tmp_path / "peer") as there:
        assert same(there.load("main"), state(1))
        entry = there.reflog("main")[-1]
        assert entry.new == bytes(first) and "pushed by 127.0.0.1" in entry.message
    s2 = state(1)
    s2["b"] = s2["b"] + 1  # w's 3 chunks are there already
    second = local.save(s2, ref="main")
    asked: list[int] = []
    real = cas_ckpt.backends.http.HttpRemote.post_json

    def counted(self: Any, path: str, payload: Any, **kw: Any) -> Any:
        if path.endswith("/missing"):
            asked.append(len(payload["cids"]))
        return real(self, path, payload, **kw)

    cas_ckpt.backends.http.HttpRemote.post_json = counted  # type: ignore[method-assign]
    try:
        report = local.push(peer.url, "main", storage_options=opts())
    finally:
        cas_ckpt.backends.http.HttpRemote.post_json = real  # type: ignore[method-assign]
    assert report.previous == {"main": first} and report.refs == {"main": second}
    assert report.blocks_skipped >= 3 and report.bytes_skipped >= 3 * MiB
    assert report.bytes_sent < 64 * 1024  # b, the tree, the commit
    assert asked[0] >= 5 and len(asked) <= 3  # one batch for the data, history asked of little
    with cas_ckpt.open(tmp_path / "peer") as there:
        assert same(there.load("main"), s2)
        assert [c.cid for c in there.log("main")] == [second, first]
        assert there.fsck().ok
    again = local.push(peer.url, "main", storage_options=opts())
    assert again.up_to_date


def test_tokens_the_read_token_cannot_push_and_a_plain_server_is_read_only(peer: Any, tmp_path: Path) -> None:
    local = cas_ckpt.open(tmp_path / "local")
    local.save(state(2), ref="main")
    with pytest.raises(RemoteError, match="403"):
        local.push(peer.url, "main", storage_options=opts(READ))
    with pytest.raises(RemoteError, match="401"):
        local.push(peer.url, "main", storage_options={"token": ""})
    r = post(f"{peer.url}/api/v0/refs/main", b"{}", READ)
    assert r.status == 403 and "write token" in json.loads(r.data)["error"]
    r = post(f"{peer.url}/api/v0/blocks", b"", None)
    assert r.status == 401
    reads = urllib3.request("GET", f"{peer.url}/refs", headers={"Authorization": f"Bearer {WRITE}"})
    assert reads.status == 200  # the write token reads too
    with cas_ckpt.open(tmp_path / "peer") as there:
        assert there.refs() == {}
    cas_ckpt.open(tmp_path / "plain").close()
    with serve_process(tmp_path / "plain") as plain:
        r = post(f"{plain.url}/api/v0/refs/main", b"{}", WRITE)
        assert r.status == 403 and "read-only" in json.loads(r.data)["error"]
        with pytest.raises(RemoteError, match="read-only"):
            local.push(plain.url, "main", storage_options=opts())


def test_refs_move_by_compare_and_swap(peer: Any, tmp_path: Path) -> None:
    a, b = cas_ckpt.open(tmp_path / "a"), cas_ckpt.open(tmp_path / "b")
    base = a.save(state(3), ref="main")
    a.push(peer.url, "main", storage_options=opts())
    b.pull(peer.url, "main", storage_options=opts(READ))
    a_next = a.save(state(4), ref="main")
    b.save(state(5), ref="main")
    a.push(peer.url, "main", storage_options=opts())
    with pytest.raises(RefDiverged):  # b's history lacks a's commit: refused before sending
        b.push(peer.url, "main", storage_options=opts())
    with cas_ckpt.open(peer.url, storage_options=opts()) as remote:  # a stale compare-and-swap
        assert not remote.refs_store.set_if_equals("main", bytes(base), bytes(b.resolve("main")))
        with pytest.raises(RefConflict):  # it holds a_next, not b's head: 409
            remote._move_ref("main", bytes(b.resolve("main")), bytes(base), "stale")
        assert remote.resolve("main") == a_next
    r = post(f"{peer.url}/api/v0/refs/main",
             json.dumps({"old": str(base), "new": str(a_next)}).encode(), WRITE)
    assert r.status == 200  # it holds new already: a retried request succeeds
    r = post(f"{peer.url}/api/v0/refs/main",
             json.dumps({"old": str(base), "new": str(b.resolve("main"))}).encode(), WRITE)
    assert r.status == 409 and json.loads(r.data)["current"] == str(a_next)


def test_a_ref_never_points_at_blocks_the_peer_lacks(peer: Any, tmp_path: Path) -> None:
    local = cas_ckpt.open(tmp_path / "local")
    cid = local.save(state(6), ref="main")  # never pushed
    r = post(f"{peer.url}/api/v0/refs/main", json.dumps({"old": None, "new": str(cid)}).encode(), WRITE)
    assert r.status == 412 and json.loads(r.data)["missing"]
    with cas_ckpt.open(tmp_path / "peer") as there:
        assert there.refs() == {}


def test_blocks_are_hashed_before_they_are_stored(peer: Any, tmp_path: Path) -> None:
    local = cas_ckpt.open(tmp_path / "local")
    cid = local.save(state(7, mib=1), ref="main")
    chunk = next(c for c in local.blocks.keys() if not cas_ckpt.cid.is_node(c))  # noqa: SIM118
    data = bytearray(local.blocks.get(chunk))
    data[100] ^= 1
    body = car_header([chunk]) + section_prefix(chunk, data) + bytes(data)
    r = post(f"{peer.url}/api/v0/blocks", body, WRITE, "application/vnd.ipld.car")
    assert r.status == 400 and "corrupt block" in json.loads(r.data)["error"]
    with cas_ckpt.open(tmp_path / "peer") as there:
        assert not there.blocks.has(chunk)
    r = post(f"{peer.url}/api/v0/blocks", body[: len(body) // 2], WRITE, "application/vnd.ipld.car")
    assert r.status == 400  # cut short
    local.push(peer.url, "main", storage_options=opts())
    with cas_ckpt.open(tmp_path / "peer") as there:
        assert there.resolve("main") == cid and there.fsck().ok


def test_uploads_are_bounded(tmp_path: Path) -> None:
    cas_ckpt.open(tmp_path / "peer").close()
    local = cas_ckpt.open(tmp_path / "local")
    local.save(state(8, mib=4), ref="main")
    with serve_process(tmp_path / "peer", "--write-token", WRITE, "--max-upload", "1MiB") as server:
        with pytest.raises(RemoteError, match="max-upload"):
            local.push(server.url, "main", storage_options=opts())
        r = post(f"{server.url}/api/v0/blocks", b"x" * (2 * MiB), WRITE, "application/vnd.ipld.car")
        assert r.status == 413 and "--max-upload" in json.loads(r.data)["error"]
        chunked = urllib3.PoolManager().request(  # no length declared: cut off past the bound
            "POST", f"{server.url}/api/v0/blocks", body=iter([car_header([bytes(local.resolve("main"))])]
                                                              + [b"\0" * MiB] * 3), chunked=True,
            headers={"Authorization": f"Bearer {WRITE}"}, retries=False, timeout=30)
        assert chunked.status in (400, 413)
    with cas_ckpt.open(tmp_path / "peer") as there:
        assert there.refs() == {} and there.fsck().ok


PUSHER = """
import sys, numpy as np, cas_ckpt
repo = cas_ckpt.open(sys.argv[1])
repo.save({"big": np.random.default_rng(0).bytes(96 * 1024 * 1024)}, ref="main")
print("saved", flush=True)
repo.push(sys.argv[2], "main", storage_options={"token": sys.argv[3]})
print("pushed", flush=True)
"""


def test_a_push_killed_mid_upload_moves_no_ref_and_leaves_garbage_only(peer: Any, tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", PUSHER, str(tmp_path / "local"), peer.url, WRITE],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "saved"
    tmp = tmp_path / "peer" / "tmp"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not any(p.stat().st_size > 8 * MiB for p in tmp.glob("*")):
        time.sleep(0.02)  # until the peer holds part of the upload
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.stdout.read() == ""  # it never finished
    proc.stdout.close()
    time.sleep(0.5)  # the server sees the connection end and drops the batch
    with cas_ckpt.open(tmp_path / "peer") as there:
        assert there.refs() == {}
        assert there.fsck().ok
        there.gc()
        assert there.stats().total_blocks == 0


def test_the_cli_and_a_manager_push_to_a_peer(peer: Any, tmp_path: Path) -> None:
    local = cas_ckpt.open(tmp_path / "local")
    cid = local.save(state(9), ref="runs/a")
    env = {**os.environ, "CAS_CKPT_TOKEN": WRITE}
    done = subprocess.run([str(Path(sys.executable).parent / "cas-ckpt"), "--repo", str(tmp_path / "local"),
                           "push", peer.url, "runs/a"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    with cas_ckpt.open(tmp_path / "peer") as there:
        assert there.resolve("runs/a") == cid
    manager = cas_ckpt.CheckpointManager(tmp_path / "mine", "runs/b", replicate_to=peer.url,
                                         remote_storage_options=opts())
    for step in range(3):
        manager.save(step, state(step, mib=1))
    manager.close()  # waits for replication
    with cas_ckpt.open(tmp_path / "peer") as there:
        assert same(there.load("runs/b"), state(2, mib=1))
        assert there.commit("runs/b").step == 2


def test_a_missing_blocks_query_of_thousands_of_cids_is_read_whole(peer: Any, tmp_path: Path) -> None:
    """A query's JSON arrives in many reads (16,384 CIDs is about 1 MB): the server reads it to its
    end, and a push of 4,096 chunks sends them all and moves the ref."""
    with cas_ckpt.open(tmp_path / "local", chunk_size=4096) as local:
        cid = local.save({"w": np.random.default_rng(0).random(4 << 20, dtype=np.float32)}, ref="run")
        report = local.push(peer.url, "run", storage_options=opts())
    assert report.blocks_sent >= 4096
    with cas_ckpt.open(tmp_path / "peer") as there:
        assert there.resolve("run") == cid and there.fsck().ok
