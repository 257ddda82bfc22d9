"""S3 repositories against real S3-protocol server processes (moto and LocalStack: conftest.py).

Faults (503s, connections reset mid-body, conditional headers dropped) come from a real HTTP proxy
in front of moto, never from stand-ins for cas_ckpt's own classes.
"""

from __future__ import annotations

import http.client
import itertools
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Iterator
from contextlib import closing
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import boto3
import numpy as np
import pytest
import s3_server
from helpers import assert_state_equal

import cas_ckpt
from cas_ckpt import cid as cidlib
from cas_ckpt import cli
from cas_ckpt.backends import Backend
from cas_ckpt.backends.s3 import S3Backend, S3Bucket
from cas_ckpt.blocks import PackedBlockStore, S3Store
from cas_ckpt.blocks.base import BlockStore
from cas_ckpt.refs.s3 import S3RefStore
from cas_ckpt.testing import BackendTests, PackedStoreTests, raw_block

FAST = {"min_grace": 0.0}  # tests may collect what they just wrote


def _split(url: str) -> tuple[str, str]:
    bucket, _, prefix = url[len("s3://") :].partition("/")
    return bucket, prefix + "/"


def _keys(url: str, below: str = "") -> list[str]:
    bucket, prefix = _split(url)
    listing = boto3.client("s3").list_objects_v2(Bucket=bucket, Prefix=prefix + below)
    return sorted(o["Key"][len(prefix) :] for o in listing.get("Contents", []))


def _held_locks(url: str) -> list[str]:
    """Lock objects in a holder's state, and any save registration (released ones are deleted):
    locks once released stay, in their released state."""
    bucket, prefix = _split(url)
    client = boto3.client("s3")
    held = []
    for key in _keys(url, "locks/"):
        body = client.get_object(Bucket=bucket, Key=prefix + key)["Body"].read()
        if key.startswith("locks/saves/") or "released" not in json.loads(body):
            held.append(key)
    return held


# -- a fault-injecting HTTP proxy in front of moto -------------------------------------------------
class Proxy:
    """Forwards requests to moto; can answer 503, reset connections, cut bodies, drop headers.

    ``fail``: that many next requests get ``503 SlowDown``; ``reset``: that many are closed without an
    answer; ``cut``: that many ranged GETs lose the second half of their body. Every request is
    recorded as (method, path, range header).
    """

    def __init__(self, upstream: str) -> None:
        parts = urllib.parse.urlsplit(upstream)
        self.upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.requests: list[tuple[str, str, str]] = []
        self.fail = self.reset = self.cut = 0
        self.failed = 0
        self.strip: set[str] = set()
        self.active = self.max_active = 0
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _Forward)
        self.server.daemon_threads = True
        self.server.proxy = self  # type: ignore[attr-defined]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def take(self, what: str) -> bool:
        with self.lock:
            if getattr(self, what) > 0:
                setattr(self, what, getattr(self, what) - 1)
                return True
            return False

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def gets(self, below: str = "/packs/") -> list[tuple[str, str, str]]:
        return [r for r in self.requests if r[0] == "GET" and below in r[1]]


class _Forward(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:
        pass

    def _forward(self) -> None:
        proxy: Proxy = self.server.proxy  # type: ignore[attr-defined]
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        with proxy.lock:
            proxy.requests.append((self.command, self.path, self.headers.get("Range", "")))
        if proxy.take("fail"):
            proxy.failed += 1
            self._answer(503, b"<Error><Code>SlowDown</Code><Message>reduce your rate</Message></Error>")
            return
        if proxy.take("reset"):
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        headers = {k: v for k, v in self.headers.items() if k.lower() not in proxy.strip}
        with proxy.lock:
            proxy.active += 1
            proxy.max_active = max(proxy.max_active, proxy.active)
        try:
            conn = http.client.HTTPConnection(*proxy.upstream, timeout=60)
            conn.request(self.command, self.path, body=body, headers=headers)
            response = conn.getresponse()
            data = response.read()
            conn.close()
        finally:
            with proxy.lock:
                proxy.active -= 1
        self.send_response(response.status)
        for key, value in response.getheaders():
            if key.lower() not in ("transfer-encoding", "connection", "server", "date", "content-length"):
                self.send_header(key, value)
        length = response.getheader("Content-Length", str(len(data)))
        self.send_header("Content-Length", length)
        self.end_headers()
        if self.command == "HEAD":
            return
        if self.headers.get("Range") and len(data) > 1 and proxy.take("cut"):
            self.wfile.write(data[: len(data) // 2])
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        self.wfile.write(data)

    def _answer(self, status: int, data: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward


@pytest.fixture
def proxy(s3_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Proxy]:
    """A proxy in front of moto; AWS_ENDPOINT_URL points at it (the bucket of s3_url exists)."""
    p = Proxy(os.environ["AWS_ENDPOINT_URL"])
    monkeypatch.setenv("AWS_ENDPOINT_URL", p.url)
    yield p
    p.close()


def state(step: int) -> dict[str, Any]:
    rng = np.random.default_rng(step)
    return {"w": rng.random((300, 200)), "b": np.arange(10, dtype=np.int16) + step, "step": step,
            "blob": bytes(range(256)) * 200, "name": f"run-{step}"}


# -- the block-store conformance suite ------------------------------------------------------------
class TestS3Backend(BackendTests):
    @pytest.fixture
    def backend(self, s3_url: str) -> Iterator[Backend]:
        with closing(S3Backend(s3_url, **FAST)) as b:
            yield b


class TestS3Store(PackedStoreTests):
    @pytest.fixture
    def backend(self, s3_url: str) -> Iterator[Backend]:
        with closing(S3Backend(s3_url, **FAST)) as b:
            yield b

    def reopen(self, backend: Backend) -> Backend:
        assert isinstance(backend, S3Backend)
        return S3Backend(backend.bucket.url, **FAST)

    def damage(self, backend: Backend, name: str, offset: int) -> None:
        """Rewrite the pack object with one byte flipped."""
        assert isinstance(backend, S3Backend)
        client, bucket = backend.bucket.client, backend.bucket.bucket
        key = f"{backend.bucket.prefix}packs/{name}"
        data = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
        data[offset] ^= 0x01
        client.put_object(Bucket=bucket, Key=key, Body=bytes(data))

    def leftovers(self, store: BlockStore) -> list[str]:
        assert isinstance(store, PackedBlockStore) and isinstance(store.backend, S3Backend)
        uploads = [key for key, _, _ in store.backend.bucket.uploads("")]
        spool = store.backend.spool_dir
        return (sorted(os.listdir(spool)) if spool.exists() else []) + uploads

    # -- S3 only -------------------------------------------------------------------------------
    def test_big_packs_upload_in_parallel_parts_and_roll_over(self, proxy: Proxy, s3_url: str) -> None:
        blocks = dict(raw_block(i, 1024 * 1024) for i in range(24))
        with closing(S3Store(s3_url, pack_size=13 * 2**20, part_size=5 * 2**20)) as store:
            with store.writer() as writer:
                for cid, data in blocks.items():
                    writer.put(cid, data)
            assert len(writer.published) == 2  # rolled over at 13 MiB
            assert all(store.get(c) == d for c, d in blocks.items())
        bucket, prefix = _split(s3_url)
        client = boto3.client("s3")
        for name in writer.published:
            etag = client.head_object(Bucket=bucket, Key=f"{prefix}packs/{name}")["ETag"]
            assert etag.strip('"').endswith("-3")  # three multipart parts
        assert proxy.max_active >= 2, "parts were uploaded one at a time"

    @pytest.mark.parametrize("size", [3000, 1024 * 1024], ids=["one PUT", "multipart"])
    def test_an_existing_pack_is_never_overwritten(self, s3_url: str, tmp_path: Path, size: int) -> None:
        blocks = dict(raw_block(i, size) for i in range(6))
        with closing(S3Store(s3_url, part_size=5 * 2**20)) as store:
            with store.writer() as writer:
                for cid, data in blocks.items():
                    writer.put(cid, data)
            (name,) = writer.published
            copy = tmp_path / name
            copy.write_bytes(store.bucket.get(f"packs/{name}")[0])  # type: ignore[index]
            victim = next(iter(blocks))
            loc = store._copies(victim)[0]
            TestS3Store().damage(store.backend, loc.pack, loc.offset + loc.length // 2)
            # The very same pack uploaded again (a writer that had not seen it): created only if
            # absent, so the (now damaged) object stays as it is.
            assert store.bucket.put_file(f"packs/{name}", copy, part_size=5 * 2**20) is False
            with pytest.raises(cas_ckpt.errors.CorruptBlock):
                store.get(victim)
            assert store.bucket.uploads("") == []  # the refused multipart upload was aborted

    @pytest.mark.parametrize("size", [3000, 1024 * 1024], ids=["one PUT", "multipart"])
    def test_a_create_refused_for_an_object_deleted_since_is_made_again(
        self, s3_url: str, tmp_path: Path, size: int
    ) -> None:
        """As a local link would: a content-named object (a commit-graph layer two merges write)
        that exists when S3 refuses the create and is deleted by another writer before the
        check is created again; put_file raised "refused to create ... and it does not exist"
        (test_commit_graph_faults on S3, long mode)."""
        body = tmp_path / "layer"
        body.write_bytes(bytes(range(256)) * (size // 256))
        with closing(S3Store(s3_url, part_size=5 * 2**20)) as store:
            bucket = store.bucket
            assert bucket.put_file("graph/x", body, part_size=5 * 2**20) is True
            refused = []

            def delete_after_refusal(http_response: Any, parsed: Any, **_: Any) -> None:
                if http_response.status_code == 412 and not refused:  # the other writer's merge
                    refused.append(True)
                    bucket.client.delete_object(Bucket=bucket.bucket, Key=bucket.prefix + "graph/x")

            events = bucket.client.meta.events
            for op in ("PutObject", "CompleteMultipartUpload"):
                events.register(f"after-call.s3.{op}", delete_after_refusal)
            try:
                assert bucket.put_file("graph/x", body, part_size=5 * 2**20) is True
            finally:
                for op in ("PutObject", "CompleteMultipartUpload"):
                    events.unregister(f"after-call.s3.{op}", delete_after_refusal)
            assert refused and bucket.get("graph/x")[0] == body.read_bytes()  # type: ignore[index]
            assert bucket.uploads("") == []

    def test_delete_rewrites_a_pack_with_the_survivors(self, s3_url: str) -> None:
        blocks = dict(raw_block(i, 5000) for i in range(10))
        with closing(S3Store(s3_url)) as store, store.writer() as writer:
            for cid, data in blocks.items():
                writer.put(cid, data)
        (old,) = _keys(s3_url, "packs/")
        gone = set(list(blocks)[:4])
        with closing(S3Store(s3_url, **FAST)) as fresh:  # a GC process that never wrote
            assert fresh.delete(gone)[0] == 4
            (new,) = _keys(s3_url, "packs/")
            assert new != old  # the survivors' new pack was made, then the old one deleted
            assert set(fresh.keys()) == set(blocks) - gone
        with closing(S3Store(s3_url)) as reader:
            assert all(reader.get(c) == d for c, d in blocks.items() if c not in gone)
            assert not any(reader.has(c) for c in gone)

    def test_a_truncated_pack_names_the_block(self, s3_url: str) -> None:
        blocks = dict(raw_block(i, 4000) for i in range(4))
        with closing(S3Store(s3_url)) as store:
            with store.writer() as writer:
                for cid, data in blocks.items():
                    writer.put(cid, data)
            first, *_, last = blocks
            (loc,) = store._copies(last)
            client, bucket = store.bucket.client, store.bucket.bucket
            key = f"{store.bucket.prefix}packs/{loc.pack}"
            whole = client.get_object(Bucket=bucket, Key=key)["Body"].read()
            client.put_object(Bucket=bucket, Key=key, Body=whole[: loc.offset + 10])
            with pytest.raises(cas_ckpt.errors.CorruptBlock, match=f"{cidlib.to_str(last)}.*truncated"):
                store.get(last)
            assert store.get(first) == blocks[first]

    def test_gc_keeps_packs_younger_than_the_grace_period(self, s3_url: str) -> None:
        cid, data = raw_block(1)
        with closing(S3Store(s3_url)) as store:  # min_grace: one hour by default
            store.put(cid, data)
            assert store.delete({cid}) == (0, 0)
            assert store.get(cid) == data
        with closing(S3Store(s3_url, **FAST)) as store:
            removed, freed = store.delete({cid})
            assert removed == 1 and freed > len(data)
            assert _keys(s3_url, "packs/") == []

    def test_clean_temp_aborts_abandoned_uploads(self, s3_url: str) -> None:
        bucket, prefix = _split(s3_url)
        boto3.client("s3").create_multipart_upload(Bucket=bucket, Key=f"{prefix}packs/dead.pack")
        with closing(S3Store(s3_url, **FAST)) as store:
            assert [k for k, _, _ in store.bucket.uploads("")] == ["packs/dead.pack"]
            assert store.clean_temp() == 1
            assert store.bucket.uploads("") == []


# -- repositories through cas_ckpt.open("s3://...") ------------------------------------------------
def test_save_load_log_reflog_gc_fsck(s3_url: str) -> None:
    with cas_ckpt.open(s3_url, chunk_size=16 * 1024, storage_options=FAST) as repo:
        cids = [repo.save(state(i), step=i, message=f"s{i}") for i in range(3)]
        repo.save({"x": 1}, ref="runs/exp-1")
        assert_state_equal(state(2), repo.load())
        assert_state_equal(state(0)["w"], repo.load(cids[0], path="w"))
        assert [c.step for c in repo.log()] == [2, 1, 0]
        assert [e.new for e in repo.reflog()] == [cidlib.to_bytes(c) for c in cids]
        assert sorted(repo.refs()) == ["main", "runs/exp-1"]
        report = repo.gc(reflog_expiry=0)  # reflogs keep nothing: only heads survive
        assert report.blocks_freed > 0  # steps 0 and 1 had their own arrays
        with pytest.raises(cas_ckpt.errors.CheckpointExpired):
            repo.load(cids[0])
        assert_state_equal(state(2), repo.load())
        assert repo.fsck().ok
        repo.delete_ref("runs/exp-1")
        assert [e.message for e in repo.reflog("runs/exp-1")] == ["save", "delete"]  # kept
        assert repo.gc().reflogs_dropped == 0  # a GC root for 30 days
        assert repo.restore_ref("runs/exp-1") == repo.resolve("runs/exp-1@{2}")
        repo.delete_ref("runs/exp-1")
        assert repo.gc(reflog_expiry=0).reflogs_dropped == 1
        with pytest.raises(cas_ckpt.errors.RefNotFound):  # neither the ref nor its reflog now
            repo.reflog("runs/exp-1")
        assert _keys(s3_url, "logs/runs/") == []
    with cas_ckpt.open(s3_url, create=False, read_only=True) as again:
        assert_state_equal(state(2), again.load())
        with pytest.raises(cas_ckpt.errors.RepositoryError, match="read-only"):
            again.save({"x": 2})
    layout = {key.split("/")[0] for key in _keys(s3_url)}
    assert layout == {"config.json", "index", "locks", "logs", "packs", "refs"}
    assert _held_locks(s3_url) == []  # locks released; no probe objects or registrations left
    assert not [k for k in _keys(s3_url, "refs/") if k.startswith("refs/runs/")]  # tombstone gone


def test_open_reads_the_config_once(proxy: Proxy, s3_url: str) -> None:
    """Creating and opening each read config.json once (it was read twice, a GET in each open)."""
    config = f"/{_split(s3_url)[0]}/{_split(s3_url)[1]}config.json"
    for create in (True, False):
        proxy.requests.clear()
        with cas_ckpt.open(s3_url, create=create, storage_options=FAST):
            pass
        gets = [path for method, path, _ in proxy.requests if method == "GET" and path == config]
        assert len(gets) == 1, (create, [f"{m} {p.split('/repo/')[-1]}" for m, p, _ in proxy.requests])


def test_open_refuses_missing_repositories_and_foreign_prefixes(s3_url: str) -> None:
    with pytest.raises(cas_ckpt.errors.RepositoryError, match="no cas_ckpt repository"):
        cas_ckpt.open(s3_url, create=False)
    bucket, prefix = _split(s3_url)
    boto3.client("s3").put_object(Bucket=bucket, Key=f"{prefix}someone-else.txt", Body=b"x")
    with pytest.raises(cas_ckpt.errors.RepositoryError, match="holds other objects"):
        cas_ckpt.open(s3_url)
    with pytest.raises(ValueError, match="storage_options"):
        cas_ckpt.open("memory://", storage_options={"cache_dir": "x"})


def test_car_export_and_import(s3_url: str, tmp_path: Path) -> None:
    with cas_ckpt.open(s3_url) as repo:
        root = repo.save(state(1))
        repo.export_car(root, tmp_path / "c.car")
    with cas_ckpt.open(tmp_path / "local") as local:
        local.import_car(tmp_path / "c.car", ref="main")
        assert_state_equal(state(1), local.load())
    with cas_ckpt.open(s3_url.replace("/repo", "/copy")) as other:
        assert other.import_car(tmp_path / "c.car", ref="main").roots == [root]
        assert_state_equal(state(1), other.load())


def test_cli_on_s3(s3_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def run(*argv: str) -> tuple[int, str]:
        code = cli.main(["--repo", s3_url, *argv])
        out, err = capsys.readouterr()
        assert "Traceback" not in err
        return code, out

    assert run("init")[0] == 0
    with cas_ckpt.open(s3_url, storage_options=FAST) as repo:
        first = repo.save(state(1), step=1)
        second = repo.save(state(2), step=2)
    code, out = run("log")
    assert code == 0 and str(second) in out and str(first) in out
    assert run("refs")[1].split() == [str(second), "main"]
    code, out = run("fsck")
    assert code == 0 and "ok" in out
    code, out = run("export", "main", "-o", str(tmp_path / "m.car"))
    assert code == 0 and (tmp_path / "m.car").stat().st_size > 0
    code, out = run("gc", "--dry-run", "--reflog-expiry", "0")  # step 1 is garbage only then
    assert code == 0 and "would remove" in out
    code, out = run("gc")  # the one-hour minimum grace on S3 keeps what was just written
    assert code == 0 and "removed 0 blocks" in out
    assert cli.main(["--repo", s3_url.replace("/repo", "/none"), "log"]) != 0
    assert "no cas_ckpt repository" in capsys.readouterr().err


# -- refs: races, reflog chains, leases -----------------------------------------------------------
RACER = """
import os, sys, time
import cas_ckpt

url, go, name, count = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
with cas_ckpt.open(url) as repo:
    print("ready", flush=True)
    while not os.path.exists(go):
        time.sleep(0.01)
    for _ in range(count):
        while True:  # read, increment, write back only if nobody moved the ref meanwhile
            head = repo.resolve("main")
            value = repo.load(head, path="i")
            try:
                cid = repo.save({"i": value + 1, "writer": name}, expected=head)
            except cas_ckpt.errors.RefConflict:
                continue
            print("saved", cid, flush=True)
            break
"""


def test_processes_racing_on_one_ref_lose_no_update(s3_url: str, tmp_path: Path) -> None:
    with cas_ckpt.open(s3_url) as repo:
        start = repo.save({"i": 0, "writer": "start"})
    script, go = tmp_path / "racer.py", tmp_path / "go"
    script.write_text(RACER)
    count, names = 15, ("alpha", "beta", "gamma")
    env = {**os.environ, "PYTHONPATH": str(Path(cas_ckpt.__file__).parent.parent)}
    procs = [
        subprocess.Popen([sys.executable, str(script), s3_url, str(go), name, str(count)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for name in names
    ]
    for proc in procs:  # all started: race from the same instant
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    go.touch()
    saved: list[str] = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        words = out.split()
        saved += [words[i + 1] for i, word in enumerate(words) if word == "saved"]
    assert len(set(saved)) == len(names) * count
    with cas_ckpt.open(s3_url) as repo:
        assert repo.load("main", path="i") == len(names) * count  # every increment survived
        log = repo.reflog("main")[1:]
        assert sorted(cidlib.to_str(e.new) for e in log) == sorted(saved)
        assert log[0].old == cidlib.to_bytes(start)
        assert all(a.new == b.old for a, b in itertools.pairwise(log))
        history = [str(c.cid) for c in repo.log("main")]
        assert history == [cidlib.to_str(e.new) for e in reversed(log)] + [str(start)]
    assert len(_keys(s3_url, "logs/main/")) == len(saved) + 1  # losers removed their entries
    assert _held_locks(s3_url) == []


def test_an_update_whose_answer_was_lost_is_found_on_the_chain(s3_url: str) -> None:
    """A PUT that landed but whose answer was lost (then retried, failing its condition on its own
    success) must not delete its reflog entry once another writer built on it: the chain needs it."""
    refs = S3RefStore(s3_url)
    a, b, c = (cidlib.Hasher().node(bytes([i])) for i in range(3))
    assert refs.add_if_new("main", a)
    head = refs._head("main")
    assert head is not None and head.entry is not None
    ours = head.entry
    assert refs.set_if_equals("main", a, b) and refs.set_if_equals("main", b, c)  # others built on it
    assert refs._landed("main", ours)
    assert not refs._landed("main", f"{10**19:020d}-{'0' * 32}")  # newer than the head: not landed
    assert not refs._landed("main", f"{1:020d}-{'0' * 32}")  # older, and not on the chain
    assert [e.new for e in refs.reflog("main")] == [a, b, c]


def test_threads_racing_unconditional_sets_keep_one_chain(s3_url: str) -> None:
    refs = S3RefStore(s3_url)
    values = [cidlib.Hasher().node(bytes([i])) for i in range(40)]

    def writer(part: list[bytes]) -> None:
        for value in part:
            assert refs.set_if_equals("main", None, value)

    threads = [threading.Thread(target=writer, args=(values[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    log = refs.reflog("main")
    assert sorted(e.new for e in log) == sorted(values)
    assert all(a.new == b.old for a, b in itertools.pairwise(log)) and log[-1].new == refs.get("main")
    # An entry a crash left behind (written, but its ref update never happened) is not in the chain.
    bucket, prefix = _split(s3_url)
    orphan = {"old": None, "new": cidlib.to_str(values[0]), "time": 1.0, "message": "x", "prev": None}
    boto3.client("s3").put_object(Bucket=bucket, Key=f"{prefix}logs/main/{'0' * 20}-dead.json",
                                  Body=json.dumps(orphan).encode())
    assert refs.reflog("main") == log


def test_gc_waits_for_a_save_in_progress(s3_url: str) -> None:
    options = {**FAST, "lease_timeout": 30.0}
    with cas_ckpt.open(s3_url, storage_options=options) as repo:
        old = repo.save({"w": np.arange(300_000.0)})
        repo.delete_ref("main")  # old's blocks are now unreachable...
        done: dict[str, Any] = {}

        def collect() -> None:
            done["report"] = repo.gc()
            done["gc"] = time.monotonic()

        with repo.refs_store.lock(exclusive=False):  # ...but a save in progress reuses them
            gc = threading.Thread(target=collect)
            gc.start()
            time.sleep(1.5)
            assert gc.is_alive(), "GC ran while a save held the lock"
            assert _keys(s3_url, "locks/gc")  # it holds its own lease, waiting
            repo.set_ref("main", old)
            done["save"] = time.monotonic()
        gc.join(timeout=60)
        assert done["gc"] > done["save"] and done["report"].live_blocks > 0
        assert np.array_equal(repo.load()["w"], np.arange(300_000.0))
        assert repo.fsck().ok


def test_saves_and_gc_in_threads_of_one_process(s3_url: str) -> None:
    with cas_ckpt.open(s3_url, storage_options=FAST) as repo:
        errors: list[BaseException] = []

        def run(work: Any) -> None:
            try:
                work()
            except BaseException as exc:
                errors.append(exc)

        saver = threading.Thread(target=run, args=(lambda: [repo.save(state(i)) for i in range(6)],))
        collector = threading.Thread(target=run, args=(lambda: [repo.gc(reflog_expiry=0) for _ in range(3)],))
        saver.start()
        collector.start()
        saver.join(timeout=120)
        collector.join(timeout=120)
        assert not saver.is_alive() and not collector.is_alive(), "deadlock"
        assert errors == []
        assert_state_equal(state(5), repo.load())
        assert repo.fsck().ok
    assert _held_locks(s3_url) == []


def test_save_waits_for_gc_and_stale_leases_are_broken(s3_url: str) -> None:
    with cas_ckpt.open(s3_url, storage_options={**FAST, "lease_timeout": 1.0}) as repo:
        bucket, prefix = _split(s3_url)
        client = boto3.client("s3")
        # A GC that died holding its lock: a save waits until the lease is stale, then breaks it.
        client.put_object(Bucket=bucket, Key=f"{prefix}locks/gc", Body=b"{}")
        started = time.monotonic()
        repo.save({"a": 1})
        assert time.monotonic() - started >= 0.9
        # A save that died registered: GC waits until the registration is stale, then removes it.
        client.put_object(Bucket=bucket, Key=f"{prefix}locks/saves/dead", Body=b"{}")
        started = time.monotonic()
        repo.gc()
        assert time.monotonic() - started >= 0.9
        assert _held_locks(s3_url) == []


def test_a_save_that_lost_its_lease_moves_no_ref(s3_url: str) -> None:
    with cas_ckpt.open(s3_url, storage_options={"lease_timeout": 1.0}) as repo:
        first = repo.save({"a": 1})
        bucket, prefix = _split(s3_url)
        second = repo.save({"a": 2}, ref="other")
        with repo.refs_store.lock(exclusive=False):
            (key,) = _keys(s3_url, "locks/saves/")  # a GC judged us dead and removed it
            boto3.client("s3").delete_object(Bucket=bucket, Key=prefix + key)
            time.sleep(0.3)  # more than a heartbeat interval (lease_timeout / 4)
            with pytest.raises(cas_ckpt.errors.RepositoryError, match="lost the repository lease"):
                repo.set_ref("main", second)
        assert repo.resolve() == first and len(repo.reflog()) == 1


# -- reads: ranged, coalesced, cached --------------------------------------------------------------
def test_chunks_of_an_array_come_in_one_ranged_get(proxy: Proxy, s3_url: str) -> None:
    array = np.random.default_rng(0).random(512 * 1024)  # 4 MiB: 64 chunks of 64 KiB
    with cas_ckpt.open(s3_url, chunk_size=64 * 1024) as repo:
        repo.save({"w": array})
    with cas_ckpt.open(s3_url) as repo:
        before = len(proxy.gets())
        assert np.array_equal(repo.load()["w"], array)
        gets = proxy.gets()[before:]
    assert all(r[2].startswith("bytes=") for r in gets)
    assert len(gets) <= 6, gets  # commit, tree node, one run of 64 chunks (plus the index read)


def test_local_cache_serves_repeated_loads(proxy: Proxy, s3_url: str, tmp_path: Path) -> None:
    options = {"cache_dir": str(tmp_path / "cache")}
    with cas_ckpt.open(s3_url, chunk_size=64 * 1024, storage_options=options) as repo:
        repo.save(state(1))
        first_gets = len(proxy.gets())
        assert_state_equal(state(1), repo.load())
        assert len(proxy.gets()) > first_gets
    def block_reads(since: int) -> list[tuple[str, str, str]]:
        return [r for r in proxy.gets()[since:] if not r[2].startswith("bytes=-")]  # not index reads

    with cas_ckpt.open(s3_url, storage_options=options) as repo:  # a new process, say
        before = len(proxy.gets())
        assert_state_equal(state(1), repo.load())
        assert block_reads(before) == []  # every block came from the cache
    # A damaged cache copy fails its hash and is fetched again.
    cached = next(p for p in (tmp_path / "cache").iterdir() if p.suffix == ".pack")
    data = bytearray(cached.read_bytes())
    data[len(data) // 3 : len(data) // 3 + 64] = b"\xff" * 64
    cached.write_bytes(bytes(data))
    with cas_ckpt.open(s3_url, storage_options=options) as repo:
        before = len(proxy.gets())
        assert_state_equal(state(1), repo.load())
        assert block_reads(before) != []


def test_links_planted_in_the_cache_are_never_followed(s3_url: str, tmp_path: Path) -> None:
    """A ``*.pack`` or ``*.have`` in the cache folder that is a link is neither read nor written
    through: loads go to S3, and the file the link names is untouched."""
    options = {"cache_dir": str(tmp_path / "cache")}
    with cas_ckpt.open(s3_url, chunk_size=64 * 1024, storage_options=options) as repo:
        repo.save(state(2))
        names = list(repo.blocks.packs())
    shutil.rmtree(tmp_path / "cache")
    (tmp_path / "cache").mkdir()
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    for name in names:
        (tmp_path / "cache" / name).symlink_to(victim)
        (tmp_path / "cache" / f"{name}.have").symlink_to(victim)
    with cas_ckpt.open(s3_url, storage_options=options) as repo:
        assert_state_equal(state(2), repo.load())
        assert_state_equal(state(2), repo.load())
    assert victim.read_bytes() == b"precious"


# -- failures --------------------------------------------------------------------------------------
def test_transient_failures_are_retried(proxy: Proxy, s3_url: str) -> None:
    proxy.fail = 2
    with cas_ckpt.open(s3_url, chunk_size=16 * 1024) as repo:
        assert proxy.failed == 2 and proxy.fail == 0
        proxy.reset = 1
        repo.save(state(1))
        assert proxy.reset == 0
        proxy.cut = 2  # two ranged GETs lose half their body: read again
        assert_state_equal(state(1), repo.load())
        assert proxy.cut == 0


def test_persistent_failures_end_with_a_clear_error(
    proxy: Proxy, s3_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")  # the standard variable is honoured
    proxy.fail = 10**6
    started = time.monotonic()
    with pytest.raises(cas_ckpt.errors.RepositoryError, match="SlowDown"):
        cas_ckpt.open(s3_url)
    assert time.monotonic() - started < 15
    assert 2 <= len(proxy.requests) <= 4  # the probe's PUT twice, then its clean-up DELETE twice


def test_missing_bucket_and_plain_http_are_refused(s3_env: str) -> None:
    with pytest.raises(cas_ckpt.errors.RepositoryError, match="bucket 'no-such-bucket' does not exist"):
        cas_ckpt.open("s3://no-such-bucket/repo")
    with pytest.raises(cas_ckpt.errors.RepositoryError, match="refusing plain http"):
        S3Bucket("s3://b/p", endpoint_url="http://192.0.2.1:9000")
    assert S3Bucket("s3://b/p", endpoint_url="http://192.0.2.1:9000", allow_http=True).prefix == "p/"


@pytest.fixture(scope="module")
def auth_server() -> Iterator[tuple[str, dict[str, str]]]:
    """A second moto server that checks credentials (after its first 3 requests set up a user)."""
    env = {**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "3"}
    with s3_server.running(env=env) as endpoint:
        setup = {"endpoint_url": endpoint, "region_name": "us-east-1",
                 "aws_access_key_id": "setup", "aws_secret_access_key": "setup"}
        iam = boto3.client("iam", **setup)
        iam.create_user(UserName="nobody")  # no policy: may do nothing
        key = iam.create_access_key(UserName="nobody")["AccessKey"]
        boto3.client("s3", **setup).create_bucket(Bucket="guarded")
        yield endpoint, {"id": key["AccessKeyId"], "secret": key["SecretAccessKey"]}


@pytest.mark.parametrize("s3_server", ["moto"], indirect=True)  # auth_server is moto's
@pytest.mark.parametrize(
    ("key_id", "secret", "message"),
    [
        ("AKIAUNKNOWN000000000", "x", "does not know this access key"),
        (None, "wrong", "SignatureDoesNotMatch"),
        (None, None, "denied"),
    ],
    ids=["unknown key", "bad secret", "no permission"],
)
def test_credential_errors_say_what_is_wrong(
    auth_server: tuple[str, dict[str, str]], s3_env: str, monkeypatch: pytest.MonkeyPatch,
    key_id: str | None, secret: str | None, message: str,
) -> None:
    endpoint, user = auth_server
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key_id or user["id"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret or user["secret"])
    with pytest.raises(cas_ckpt.errors.RepositoryError, match=message):
        cas_ckpt.open("s3://guarded/repo")


def test_no_credentials_at_all(s3_env: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(cas_ckpt.errors.RepositoryError, match="no AWS credentials"):
        cas_ckpt.open("s3://any-bucket/repo")


def test_servers_without_conditional_writes_are_refused(proxy: Proxy, s3_url: str) -> None:
    with cas_ckpt.open(s3_url) as repo:  # made while the server still honoured them
        root = repo.save({"a": 1})
    proxy.strip = {"if-none-match", "if-match"}
    with pytest.raises(cas_ckpt.errors.RepositoryError, match="ignores conditional requests"):
        cas_ckpt.open(s3_url)
    with cas_ckpt.open(s3_url, create=False, read_only=True) as reader:  # reading needs none
        assert reader.load(root) == {"a": 1}
    unsafe = {"unsafe_no_conditional_writes": True}
    with cas_ckpt.open(s3_url, storage_options=unsafe) as repo:
        assert repo.save({"a": 2}, expected=root) != root
        assert repo.load() == {"a": 2}


def test_boto3_is_imported_only_for_s3() -> None:
    code = (
        "import sys, cas_ckpt; cas_ckpt.open('memory://').save({'a': 1}); "
        "print(sorted(m for m in sys.modules if m.startswith(('boto', 'moto'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# -- index files on S3: journals, snapshots, no listing of every pack ----------------------------
def _lists_of(proxy: Proxy, folder: str) -> list[str]:
    """The LIST requests the proxy saw for objects below ``folder`` of the repository."""
    below = urllib.parse.quote(f"repo/{folder}", safe="")
    return [path for method, path, _ in proxy.requests if method == "GET" and "list-type=2" in path
            and f"prefix={below}" in path]


def test_a_store_learns_new_packs_from_journals_without_listing_packs(proxy: Proxy, s3_url: str) -> None:
    with closing(S3Store(s3_url, **FAST)) as writer_store, closing(S3Store(s3_url, **FAST)) as reader:
        first = dict(raw_block(i, 3000) for i in range(5))
        with writer_store.writer() as writer:
            for cid, data in first.items():
                writer.put(cid, data)
        writer_store.consolidate()  # from here on the index folder says which packs exist
        reader.refresh()
        assert all(reader.get(c) == d for c, d in first.items())
        more = dict(raw_block(i, 3000) for i in range(5, 9))
        with writer_store.writer() as writer:
            for cid, data in more.items():
                writer.put(cid, data)
        (journal,) = _keys(s3_url, "index/j-")
        proxy.requests.clear()
        reader.refresh()
        assert _lists_of(proxy, "packs/") == [] and len(_lists_of(proxy, "index/")) == 1
        gets = [path for method, path, _ in proxy.requests if method == "GET" and "list-type" not in path]
        assert gets == [f"/{_split(s3_url)[0]}/repo/{journal}"]  # the journal, no pack's index
        assert all(reader.has(c) for c in more)
        proxy.requests.clear()
        assert all(reader.get(c) == d for c, d in more.items())
        assert _lists_of(proxy, "packs/") == []


@pytest.mark.parametrize("learn", [True, False])
def test_gc_removals_reach_other_stores_before_the_packs_go(s3_url: str, learn: bool) -> None:
    """A save in another process must never count on a block GC removed: GC writes a snapshot
    without the packs it is about to delete (a new removal epoch), and a store catching up drops
    them, even one that learns only of removals (a DCP rank)."""
    with closing(S3Store(s3_url, **FAST)) as gc_store, closing(S3Store(s3_url, **FAST)) as saver:
        dead = dict(raw_block(i, 3000) for i in range(4))
        with gc_store.writer() as writer:
            for cid, data in dead.items():
                writer.put(cid, data)
        gc_store.consolidate()
        saver.refresh()
        assert all(saver.has(c) for c in dead)
        assert gc_store.delete(set(dead))[0] == 4
        assert _keys(s3_url, "packs/") == []
        saver.refresh(learn=learn)
        assert not any(saver.has(c) for c in dead)  # a dedup check now writes them again
        with saver.writer() as writer:
            assert all(writer.put(c, d) for c, d in dead.items())
        with closing(S3Store(s3_url, **FAST)) as fresh:
            assert all(fresh.get(c) == d for c, d in dead.items())


def test_a_pack_no_index_file_names_is_found_when_a_read_misses(s3_url: str) -> None:
    """A pack published without a journal (a writer that died in between, or one of 0.2's) is
    read after a miss, from a listing of every pack."""
    with closing(S3Store(s3_url, **FAST)) as store:
        store.put(*raw_block(1, 2000))
        store.consolidate()
        cid, data = raw_block(2, 2000)
        with store.writer() as writer:
            writer.journal = False  # as if the writer died before its journal
            writer.put(cid, data)
        with closing(S3Store(s3_url, **FAST)) as reader:
            assert not reader.has(cid)  # the index folder does not name it...
            assert reader.get(cid) == data  # ...but a read that misses lists every pack


@pytest.mark.parametrize("s3_server", ["moto"], indirect=True)  # counts cas_ckpt's requests: one server
def test_saves_cost_the_same_requests_at_any_history_and_list_no_pack(proxy: Proxy, s3_url: str) -> None:
    """Upkeep on S3 merges small packs at once (it deletes no block: no grace period to wait
    for) and folds journals into snapshots, so a save's requests do not grow with history."""
    per_save: list[list[tuple[str, str, str]]] = []
    with cas_ckpt.open(s3_url, upkeep={"small_packs": 6, "uncovered": 4}) as repo:
        cids = []
        for i in range(36):
            proxy.requests.clear()
            cids.append(repo.save({"w": np.full(3000, i, np.float32), "step": i}, step=i))
            per_save.append(list(proxy.requests))
        status = repo.upkeep_status()
    assert status is not None and status.snapshot is not None and status.packs <= 7
    counts = [len(requests) for requests in per_save]
    assert max(counts[18:]) <= max(counts[2:18]), counts
    below = urllib.parse.quote("repo/packs/", safe="")
    listed_packs = [i for i, requests in enumerate(per_save)
                    if any("list-type=2" in path and f"prefix={below}" in path for _, path, _ in requests)]
    assert listed_packs == [0], listed_packs  # the first save's upkeep wrote the first snapshot
    assert len(_keys(s3_url, "index/")) <= 5
    with cas_ckpt.open(s3_url, read_only=True) as again:
        assert [int(again.load(cid)["step"]) for cid in cids] == list(range(36))


def test_a_store_learning_only_of_removals_skips_snapshots_that_removed_no_block(
    proxy: Proxy, s3_url: str
) -> None:
    with closing(S3Store(s3_url, **FAST)) as keeper, closing(S3Store(s3_url, **FAST)) as rank:
        blocks = {}
        for i in range(4):  # four small packs
            cid, data = raw_block(i, 3000)
            keeper.put(cid, data)
            blocks[cid] = data
        keeper.consolidate()
        rank.refresh()
        assert keeper.merge_small()[0] == 4  # a snapshot without them, then they go: no block does
        proxy.requests.clear()
        rank.refresh(learn=False)
        assert not any("/index/s-" in path for method, path, _ in proxy.requests if method == "GET")
        assert all(rank.get(c) == d for c, d in blocks.items())  # a read finds them moved


def test_a_store_that_skipped_a_snapshot_still_learns_what_it_removed(s3_url: str) -> None:
    """GC's snapshot folds the journal naming a pack it deletes, and the journal goes; a later
    snapshot no longer lists it. A store that took the journal in and reads only the later
    snapshot must drop the pack all the same (it would otherwise count on deleted blocks)."""
    with closing(S3Store(s3_url, **FAST)) as saver, closing(S3Store(s3_url, **FAST)) as gc_store:
        saver.put(*raw_block(1, 2000))
        saver.consolidate()
        dead, data = raw_block(2, 2000)
        saver.put(dead, data)  # its own pack and journal, taken in by the saver itself
        gc_store.refresh()
        assert gc_store.delete({dead})[0] == 1  # snapshot folding the journal, then both go
        gc_store.consolidate()  # a later snapshot: the journal is gone, so it is not listed
        saver.refresh()
        assert not saver.has(dead)
        with saver.writer() as writer:
            assert writer.put(dead, data) is True  # stored again, not counted on
        with closing(S3Store(s3_url, **FAST)) as fresh:
            assert fresh.get(dead) == data
