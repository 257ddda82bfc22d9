"""S3 by conditional PUT only (issue #52): tombstones for deleted refs, locks released by a state,
the probe asking only for what is used, and repositories of the older layout.

The servers are real processes: the tests' moto server (its conditional requests atomic), and the
same server made to ignore what MinIO and LocalStack ignore (``If-Match`` on DELETE), or what a
server too lax to use ignores (conditions on PUT, on CompleteMultipartUpload).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator

import boto3
import numpy as np
import pytest
import s3_server
from hypothesis import given
from hypothesis import strategies as st

import cas_ckpt
from cas_ckpt import cid as cidlib
from cas_ckpt.backends.s3 import S3Bucket, parse_url
from cas_ckpt.errors import LeaseHeld, RepositoryError
from cas_ckpt.refs.s3 import TOMBSTONE_SIZE, S3RefStore, parse_ref, ref_body

FAST = {"lease_timeout": 2.0}


@pytest.fixture(scope="module")
def lax_deletes() -> Iterator[str]:
    """The tests' S3 server ignoring If-Match on DELETE, as MinIO and LocalStack do."""
    with s3_server.running("--ignore", "delete") as endpoint:
        yield endpoint


@pytest.fixture
def lax_url(lax_deletes: str, monkeypatch: pytest.MonkeyPatch, tmp_path: os.PathLike[str]) -> str:
    s3_server.point_aws_at(lax_deletes, monkeypatch, tmp_path)
    return s3_server.new_bucket(lax_deletes)


def _object(url: str, key: str) -> bytes | None:
    bucket, prefix = parse_url(url)
    try:
        return bytes(boto3.client("s3").get_object(Bucket=bucket, Key=prefix + key)["Body"].read())
    except boto3.client("s3").exceptions.NoSuchKey:
        return None


def _keys(url: str, below: str) -> list[str]:
    bucket, prefix = parse_url(url)
    listing = boto3.client("s3").list_objects_v2(Bucket=bucket, Prefix=prefix + below)
    return sorted(o["Key"][len(prefix):] for o in listing.get("Contents", []))


def state(i: int) -> dict[str, object]:
    return {"w": np.full(1000, float(i)), "step": i}


# -- a server that ignores conditional deletes ---------------------------------------------------
def test_a_server_ignoring_conditional_deletes_is_written_safely(lax_url: str) -> None:
    """The server really ignores If-Match on DELETE (a wrong ETag deletes); cas_ckpt opens it for
    writing without the unsafe flag, and saves, deletes and re-creates refs, takes and hands over
    a run's lease, collects garbage and checks the repository."""
    bucket, prefix = parse_url(lax_url)
    client = boto3.client("s3")
    client.put_object(Bucket=bucket, Key=prefix + "x", Body=b"1")
    client.delete_object(Bucket=bucket, Key=prefix + "x", IfMatch='"00000000000000000000000000000000"')
    assert _object(lax_url, "x") is None  # ignored: deleted anyway

    with cas_ckpt.open(lax_url, storage_options=FAST) as repo:
        first = repo.save(state(1), ref="runs/a")
        repo.save(state(2), ref="runs/b")
        repo.delete_ref("runs/a")
        assert repo.refs() == {"runs/b": repo.resolve("runs/b")}
        repo.set_ref("runs/a", first)
        assert [e.message for e in repo.reflog("runs/a")][-2:] == ["delete", f"set to {first}"]
        with cas_ckpt.CheckpointManager(repo, "runs/m", keep_last=1) as manager:
            for step in range(3):
                manager.save(step, state(step))
        with cas_ckpt.CheckpointManager(repo, "runs/m") as again:  # the lease was released
            assert again.latest_step() == 2
        repo.delete_ref("runs/b")
        report = repo.gc(reflog_expiry=0)
        assert report.reflogs_dropped >= 1 and repo.fsck().ok
        assert _object(lax_url, "refs/runs/b") is None  # its tombstone went with its reflog
        np.testing.assert_array_equal(repo.load("runs/a")["w"], state(1)["w"])


@pytest.mark.parametrize(("ignored", "named"), [
    ("put", "If-None-Match: * on PUT"),
    ("complete", "If-None-Match: * on CompleteMultipartUpload"),
])
def test_the_probe_refuses_a_server_ignoring_what_is_used(
    ignored: str, named: str, monkeypatch: pytest.MonkeyPatch, tmp_path: os.PathLike[str]
) -> None:
    with s3_server.running("--ignore", ignored) as endpoint:
        s3_server.point_aws_at(endpoint, monkeypatch, tmp_path)
        url = s3_server.new_bucket(endpoint)
        with pytest.raises(RepositoryError, match=named.replace("*", r"\*")):
            cas_ckpt.open(url)
        with cas_ckpt.open(url, storage_options={"unsafe_no_conditional_writes": True}) as repo:
            repo.save({"x": 1})  # the user's own risk: one writer only
        assert _keys(url, "locks/probe") == []  # the probes cleaned up after themselves


# -- tombstones ----------------------------------------------------------------------------------
def test_a_deleted_ref_is_a_tombstone_that_listings_skip(s3_url: str) -> None:
    refs = S3RefStore(s3_url)
    a, b = (cidlib.Hasher().node(bytes([i])) for i in range(2))
    assert refs.add_if_new("runs/x", a)
    assert refs.remove_if_equals("runs/x", a, message="delete")
    body = _object(s3_url, "refs/runs/x")
    assert body is not None and len(body) == TOMBSTONE_SIZE and body.startswith(b"\n")
    assert refs.get("runs/x") is None and refs.names() == [] and refs.values() == {}
    assert not refs.remove_if_equals("runs/x", a)  # nothing to delete twice
    # "runs" may be created above a tombstone, and a ref below a tombstoned name
    assert refs.add_if_new("runs", b) and refs.remove_if_equals("runs", b)
    assert refs.add_if_new("runs/x/y", b)
    assert refs.names() == ["runs/x/y"]
    assert refs.remove_if_equals("runs/x/y", b)  # a tombstone below is no clash either
    # re-created over its tombstone, the ref's reflog goes on from its deletion
    assert refs.add_if_new("runs/x", b)
    assert [(e.old, e.new) for e in refs.reflog("runs/x")] == [(None, a), (a, None), (None, b)]


def test_threads_racing_to_create_over_a_tombstone_leave_one_winner(s3_url: str) -> None:
    refs = S3RefStore(s3_url)
    values = [cidlib.Hasher().node(bytes([i])) for i in range(8)]
    assert refs.add_if_new("main", values[0]) and refs.remove_if_equals("main", values[0])
    wins: list[bytes] = []

    def create(value: bytes) -> None:
        if refs.add_if_new("main", value):
            wins.append(value)

    threads = [threading.Thread(target=create, args=(v,)) for v in values[1:]]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(wins) == 1 and refs.get("main") == wins[0]
    assert [e.new for e in refs.reflog("main")] == [values[0], None, wins[0]]


def test_tombstones_are_removed_only_under_the_gc_lock(s3_url: str) -> None:
    """A tombstone goes once its reflog is gone, and only by a holder of GC's exclusive lock: the
    one writer that could make it live again (a create over it) holds the shared lock."""
    refs = S3RefStore(s3_url, lease_timeout=2.0, poll=0.05)
    a = cidlib.Hasher().node(b"a")
    assert refs.add_if_new("gone", a) and refs.remove_if_equals("gone", a)
    assert refs.drop_reflog("gone")  # no GC lock: the reflog goes, the tombstone stays
    assert _object(s3_url, "refs/gone") is not None
    assert refs.prune_deleted() == 0
    with refs.lock(exclusive=True):
        assert refs.prune_deleted() == 1
    assert _object(s3_url, "refs/gone") is None
    # a tombstone whose reflog is kept stays
    assert refs.add_if_new("kept", a) and refs.remove_if_equals("kept", a)
    with refs.lock(exclusive=True):
        assert refs.prune_deleted() == 0
    assert _object(s3_url, "refs/kept") is not None


@given(st.sampled_from(["sha2-256", "blake3"]), st.binary(max_size=64),
       st.integers(0, 10**20 - 1), st.binary(min_size=16, max_size=16))
def test_ref_bodies_round_trip_and_a_live_ref_is_never_tombstone_sized(
    hash: str, data: bytes, seq: int, nonce: bytes
) -> None:
    entry = f"{seq:020d}-{nonce.hex()}"
    cid = cidlib.Hasher(hash).node(data)
    live = ref_body(cid, entry)
    assert len(live) != TOMBSTONE_SIZE
    head = parse_ref(live, '"e"')
    assert (head.cid, head.entry) == (cid, entry)
    tomb = ref_body(None, entry)
    assert len(tomb) == TOMBSTONE_SIZE
    head = parse_ref(tomb, '"e"')
    assert (head.cid, head.entry) == (None, entry)


# -- locks ---------------------------------------------------------------------------------------
def test_locks_are_released_by_a_state_and_taken_by_if_match(s3_url: str) -> None:
    one = S3RefStore(s3_url, lease_timeout=2.0, poll=0.05)
    two = S3RefStore(s3_url, lease_timeout=2.0, poll=0.05)
    with one.lock(exclusive=True):
        held = json.loads(_object(s3_url, "locks/gc") or b"{}")
        assert "pid" in held and "released" not in held
    assert "released" in json.loads(_object(s3_url, "locks/gc") or b"{}")
    with two.lock(exclusive=True):  # taken at once: a released lock is free
        assert "released" not in json.loads(_object(s3_url, "locks/gc") or b"{}")
    lease = one.lease("runs/x")
    with pytest.raises(LeaseHeld):
        two.lease("runs/x")
    lease.release()
    assert "released" in json.loads(_object(s3_url, "locks/runs/runs%2Fx.lease") or b"{}")
    taken = two.lease("runs/x")
    assert taken.held()
    taken.release()
    with one.lock(exclusive=False):  # a save's registration, a key of its own...
        assert len(_keys(s3_url, "locks/saves/")) == 1
    assert _keys(s3_url, "locks/saves/") == []  # ...deleted when it ends


def test_a_dead_saves_registration_is_released_before_it_is_removed(s3_url: str) -> None:
    """GC judges a registration without heartbeat dead, and writes its released state with
    If-Match before deleting it: the holder, were it alive, finds its next heartbeat refused."""
    refs = S3RefStore(s3_url, lease_timeout=1.0, poll=0.05)
    bucket = S3Bucket(s3_url)
    etag = bucket.put("locks/saves/dead", b'{"pid": 1}', create=True)
    assert etag is not None
    with refs.lock(exclusive=True):  # waits until it is stale
        assert _keys(s3_url, "locks/saves/") == []
    assert bucket.put("locks/saves/dead", b'{"pid": 1}', match=etag) is None  # its heartbeat: lost


def test_a_fresh_lock_of_the_older_layout_is_held_and_a_stale_one_taken(s3_url: str) -> None:
    """cas_ckpt 0.2's lock bodies have no released state: fresh, a holder; stale, taken over."""
    refs = S3RefStore(s3_url, lease_timeout=1.0, poll=0.05)
    bucket = S3Bucket(s3_url)
    bucket.put("locks/runs/main.lease", b'{"host": "old", "pid": 7, "time": 0, "beat": 0}', create=True)
    with pytest.raises(LeaseHeld, match="old"):
        refs.lease("main")
    while (meta := bucket.head("locks/runs/main.lease")) is not None and meta.age <= 1.0:
        time.sleep(0.1)  # until the old holder's lease is stale, by the server's clock
    lease = refs.lease("main")
    assert lease.held()
    lease.release()


# -- the format version, and repositories of the older layout ------------------------------------
def test_opening_for_writing_raises_an_older_repository_to_version_4(s3_url: str) -> None:
    with cas_ckpt.open(s3_url) as repo:
        repo.save({"x": 1})
    bucket = S3Bucket(s3_url)
    got = bucket.get("config.json")
    assert got is not None and json.loads(got[0])["version"] == 4
    old = {**json.loads(got[0]), "version": 3}  # as cas_ckpt 0.2 left it
    bucket.put("config.json", json.dumps(old).encode())
    with cas_ckpt.open(s3_url, read_only=True) as reader:
        assert reader.load()["x"] == 1
    got = bucket.get("config.json")
    assert got is not None and json.loads(got[0])["version"] == 3  # a reader changes nothing
    with cas_ckpt.open(s3_url) as writer:
        assert writer.config.version == 4
    got = bucket.get("config.json")
    assert got is not None and json.loads(got[0])["version"] == 4  # 0.2 refuses it from now on
    assert json.loads(got[0])["requires"] == "cas_ckpt>=0.3"  # what a later refusal names


def test_a_ref_deleted_by_the_older_layout_keeps_its_reflog(s3_url: str) -> None:
    """cas_ckpt 0.2 deleted a ref's object after writing the deletion entry: no tombstone. Its
    reflog reads, and a ref created again continues it."""
    from cas_ckpt.refs.base import ReflogEntry

    refs = S3RefStore(s3_url)
    a, b = (cidlib.Hasher().node(bytes([i])) for i in range(2))
    assert refs.add_if_new("old", a)
    head = refs._head("old")
    assert head is not None
    refs._write_entry("old", head.entry, ReflogEntry(a, None, 1.0, "delete"))
    S3Bucket(s3_url).delete("refs/old")  # as 0.2 did, with If-Match
    assert refs.get("old") is None and refs.names() == []
    assert [(e.old, e.new) for e in refs.reflog("old")] == [(None, a), (a, None)]
    assert refs.add_if_new("old", b)
    assert [(e.old, e.new) for e in refs.reflog("old")] == [(None, a), (a, None), (None, b)]
