"""A push SIGKILLed mid-way, then run again: the remote ref never names a missing block, and the
re-run sends only what is still missing (local directory, and S3 on moto and on LocalStack).

Each case pushes a 32 MiB checkpoint in 4 MiB packs, kills the pushing process once some packs are
on the remote, checks the remote (its ref is absent, or at the previous checkpoint, and fsck finds
nothing), kills a resumed push again, then lets one finish and checks what it sent.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import time
from pathlib import Path

import boto3
import numpy as np
import pytest

import cas_ckpt

from ._support import HERE, PYTHON, child_env, digest, load_digest, record

MiB = 1024 * 1024
PACK = 4 * MiB
# Each medium: a directory, and S3 on each of the tests' servers (moto and LocalStack, conftest.py).
S3_MEDIA = ("medium", "s3_server"), [
    pytest.param("local", None, id="local"),
    *(pytest.param("s3", kind, id=f"s3-{kind}") for kind in ("moto", "localstack")),
]


def _label(medium: str, s3_server: tuple[str, str] | None) -> str:
    """The medium's name in the figures: ``s3`` on moto (as before LocalStack), ``s3_localstack``."""
    return medium if s3_server is None or s3_server[0] == "moto" else f"{medium}_{s3_server[0]}"


def _state(seed: int, arrays: int = 8) -> dict[str, object]:
    rng = np.random.default_rng(seed)
    return {f"a{i}": rng.standard_normal(MiB).astype(np.float32) for i in range(arrays)}  # 4 MiB each


@functools.cache
def _client(endpoint: str) -> object:
    return boto3.client("s3", endpoint_url=endpoint)


def _packs(where: str) -> int:
    if where.startswith("s3://"):
        bucket, _, prefix = where[len("s3://"):].partition("/")
        client = _client(os.environ["AWS_ENDPOINT_URL"])
        listing = client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/packs/")  # type: ignore[attr-defined]
        return len(listing.get("Contents", []))
    packs = Path(where) / "packs"
    return len(list(packs.glob("*.pack"))) if packs.is_dir() else 0


def _push_and_kill(src: Path, where: str, after_packs: int) -> bool:
    """Run the child; SIGKILL it once ``after_packs`` packs are on the remote. False if it ended
    first (nothing was left to send)."""
    proc = subprocess.Popen([PYTHON, str(HERE / "_push_child.py"), str(src), where, str(PACK)],
                            env=child_env(), stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    try:
        while proc.poll() is None and _packs(where) < after_packs:
            assert time.monotonic() < deadline, "the push made no progress"
            time.sleep(0.01)
        if proc.poll() is not None:
            return False
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        return True
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()


def _check_remote(where: str, allowed: set[str | None]) -> str | None:
    """The remote opens, its ref holds one of ``allowed`` (digests; None: no ref), and nothing it
    names is missing. Returns what it holds."""
    with cas_ckpt.open(where) as remote:
        held = None if remote.refs_store.get("main") is None else load_digest(remote, "main")
        assert held in allowed
        assert remote.fsck().problems == []
    return held


@pytest.mark.parametrize(*S3_MEDIA, indirect=["s3_server"])
def test_a_killed_push_resumes_sending_only_what_is_missing(
    medium: str, s3_server: tuple[str, str] | None, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    where = request.getfixturevalue("s3_url") if medium == "s3" else str(tmp_path / "remote")
    src = tmp_path / "src"
    first, second = _state(1), _state(1)
    second["a5"] = second["a5"] + 1  # the second version changes 1 array of 8
    total = sum(a.nbytes for a in first.values())  # type: ignore[attr-defined]
    kills = 0
    with cas_ckpt.open(src) as repo:
        repo.save(first, ref="main", step=1)
        # A first push, killed twice: the remote ref never appears early.
        for after in (2, 4):  # far from the end: the ref cannot have moved yet
            kills += _push_and_kill(src, where, after)
            _check_remote(where, {None})
        published = _packs(where)
        assert published >= 4
        report = repo.push(where, "main")
        assert report.bytes_skipped >= (published - 1) * PACK // 2  # what the killed pushes left
        assert report.bytes_sent < total - report.bytes_skipped + 64 * 1024
        assert report.bytes_sent + report.bytes_skipped >= total
        _check_remote(where, {digest(first)})
        # A push of the changed version, killed once its first pack is there: the remote holds
        # the first version, whole (or the second, if the kill came after the ref moved).
        repo.save(second, ref="main", step=2)
        before = _packs(where)
        killed = _push_and_kill(src, where, before + 1)
        kills += killed
        held = _check_remote(where, {digest(first), digest(second)} if killed else {digest(second)})
        final = repo.push(where, "main")
        assert final.bytes_sent <= 4 * MiB + 64 * 1024  # at most the changed array (or its rest)
        assert final.up_to_date == (held == digest(second))
        _check_remote(where, {digest(second)})
    assert kills >= 2
    record("push_kill", **{f"{_label(medium, s3_server)}_kills": kills})


def _clone_source(path: Path) -> tuple[dict[str, object], list[object]]:
    """A repository of many refs (a managed run's steps, plain refs) and two pins."""
    with cas_ckpt.open(path) as repo:
        with cas_ckpt.CheckpointManager(repo, "runs/a") as manager:
            for step in range(1, 16):
                manager.save(step, {"w": np.full(2048, step, np.float32)})
        for i in range(12):
            repo.save({"i": i, "w": np.full(1024, i, np.float64)}, ref=f"plain/r{i:02d}")
        pins = [repo.pin(repo.save({"pinned": i, "w": np.full(4096, -i)}, ref="scratch")) for i in (1, 2)]
        repo.delete_ref("scratch")
        return dict(repo.refs()), pins


@pytest.mark.parametrize(
    ("medium", "s3_server", "refs_done"),
    [("local", None, 0), ("local", None, 1), ("local", None, 17), ("s3", "moto", 9), ("s3", "localstack", 9)],
    ids=["local-0", "local-1", "local-17", "s3-moto-9", "s3-localstack-9"], indirect=["s3_server"],
)
def test_a_clone_killed_in_its_ref_phase_is_run_again(
    medium: str, s3_server: tuple[str, str] | None, refs_done: int, tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    """kill -9 of a clone whose refs are partly moved: the pins are all there (a GC there keeps
    the pinned checkpoints), no ref names a missing block, and running the clone again completes
    it (it refused: "already holds refs or pins")."""
    where = request.getfixturevalue("s3_url") if medium == "s3" else str(tmp_path / "dst")
    src = tmp_path / "src"
    refs, pins = _clone_source(src)
    proc = subprocess.Popen([PYTHON, str(HERE / "_clone_child.py"), str(src), where, str(refs_done)],
                            env=child_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == f"refs {refs_done}\n"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.communicate(timeout=60)
    # On S3 the killed clone's save lease stays until it is judged stale: quickly, here.
    options = {"storage_options": {"min_grace": 0.0, "lease_timeout": 2.0}} if medium == "s3" else {}
    with cas_ckpt.open(where, **options) as left:
        assert len(left.refs()) == refs_done and set(left.pins()) == set(pins)
        assert left.fsck().problems == []
        left.gc()  # a GC on what the kill left keeps the pinned checkpoints
        assert sorted(left.load(pin)["pinned"] for pin in pins) == [1, 2]
    with cas_ckpt.clone(src, where) as again:
        assert again.refs() == refs and set(again.pins()) == set(pins)
        assert again.last_transfer is not None and again.last_transfer.blocks_skipped > 0
        assert again.fsck().problems == []
    with cas_ckpt.clone(src, where) as done:  # a finished clone run again: nothing to do
        assert done.last_transfer is not None and done.last_transfer.up_to_date
    record("clone_kill", **{f"{_label(medium, s3_server)}_ref_phase_kills_after_{refs_done}_refs": 1})
