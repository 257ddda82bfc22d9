"""Every-step checkpoints over tiers: a RAM (tmpfs) repository, a peer's ``cas-ckpt serve``
written to over HTTP, a disk and object storage, with real servers on 127.0.0.1.

Each save is pushed to every tier in the background, each tier keeps its own retention and
reports its own lag, a dead tier delays no other, and a new manager restores the newest step any
tier holds from the first tier that holds it, fetching only what its repository lacks.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("aiohttp")

from http_servers import serve_process

import cas_ckpt
from cas_ckpt.errors import ReplicationFailed

WRITE = "tier-write-token"
MiB = 1024 * 1024


def state(step: int) -> dict[str, Any]:
    """A 2 MiB weight fixed from the start, and a 1 MiB one that changes every step."""
    fixed = np.random.default_rng(0).standard_normal(2 * MiB // 8)
    moving = np.random.default_rng(step + 1).standard_normal(MiB // 8)
    return {"fixed": fixed, "moving": moving, "step": step}


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(np.array_equal(a[k], b[k]) if isinstance(a[k], np.ndarray) else a[k] == b[k] for k in a)


@pytest.fixture
def ram() -> Iterator[Path]:
    """A folder in tmpfs where the machine has one (the memory tier)."""
    base = "/dev/shm" if Path("/dev/shm").is_dir() else None
    folder = Path(tempfile.mkdtemp(prefix="cas-ckpt-tier-", dir=base))
    yield folder / "ckpts"
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def peer(tmp_path: Path) -> Iterator[Any]:
    cas_ckpt.open(tmp_path / "peer").close()
    with serve_process(tmp_path / "peer", "--write-token", WRITE) as server:
        yield server


def steps_there(location: Path, ref: str = "run") -> list[int]:
    with cas_ckpt.open(location) as repo:
        return sorted(int(n.rsplit("/", 1)[1]) for n in repo.refs(f"{ref}.steps/"))


def test_every_save_reaches_every_tier_each_with_its_retention(ram: Path, peer: Any, tmp_path: Path) -> None:
    tiers = [peer.url, str(tmp_path / "disk"), str(tmp_path / "far")]
    manager = cas_ckpt.CheckpointManager(
        ram, "run", keep_last=1, async_save=True, replicate_to=tiers,
        remote_retention=[{"keep_last": 2}, {"keep_last": 3}, {}],
        remote_storage_options=[{"token": WRITE}, None, None])
    for step in range(6):
        manager.save(step, state(step))
    manager.wait()
    lags = manager.replication_lag
    assert isinstance(lags, list) and [lag.tier for lag in lags] == tiers
    assert all(lag.steps == 0 and lag.replicated_step == 5 and lag.failures == 0 for lag in lags)
    manager.close()
    assert steps_there(tmp_path / "peer") == [4, 5]
    assert steps_there(tmp_path / "disk") == [3, 4, 5]
    assert steps_there(tmp_path / "far") == [0, 1, 2, 3, 4, 5]
    assert steps_there(ram) == [5]  # RAM holds keep_last steps once every tier has them
    for where in (tmp_path / "peer", tmp_path / "disk", tmp_path / "far"):
        with cas_ckpt.open(where) as repo:
            assert same(repo.load("run"), state(5)) and repo.fsck().ok
    with cas_ckpt.open(tmp_path / "peer") as repo:  # the peer's retention collected what it dropped
        assert repo.stats().total_bytes < 2 * MiB + 2 * MiB + 256 * 1024


def test_a_dead_tier_delays_neither_the_loop_nor_the_other_tiers(ram: Path, tmp_path: Path,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    cas_ckpt.open(tmp_path / "peer").close()
    server = serve_process(tmp_path / "peer", "--write-token", WRITE)
    peer = server.__enter__()
    url = peer.url
    manager = cas_ckpt.CheckpointManager(ram, "run", keep_last=2, replicate_to=[url, str(tmp_path / "disk")],
                                         remote_storage_options=[{"token": WRITE, "attempts": 1}, None])
    manager.save(0, state(0))
    manager.wait()
    server.__exit__(None, None, None)  # the peer dies
    for step in range(1, 5):  # each returns once it is in RAM: the dead tier's retries run apart
        manager.save(step, state(step))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (manager.replication_lag[1].replicated_step,
                                            manager.replication_lag[1].steps) != (4, 0):
        time.sleep(0.05)  # the disk tier's thread pushes on its own
    peer_lag, disk_lag = manager.replication_lag
    assert disk_lag.replicated_step == 4 and disk_lag.steps == 0  # the disk tier kept up
    assert peer_lag.replicated_step == 0 and peer_lag.steps >= 1 and peer_lag.failures >= 1
    assert "RemoteError" in (peer_lag.error or "")
    assert steps_there(ram) == [1, 2, 3, 4]  # steps the peer lacks stay in RAM; 0 reached both
    with pytest.raises(ReplicationFailed):
        manager.close()
    assert steps_there(tmp_path / "disk") == [3, 4]


def test_a_new_host_restores_from_the_first_tier_holding_the_newest_step(ram: Path, peer: Any,
                                                                        tmp_path: Path) -> None:
    tiers = [peer.url, str(tmp_path / "disk")]
    options = [{"token": WRITE}, None]
    with cas_ckpt.CheckpointManager(ram, "run", keep_last=2, replicate_to=tiers,
                                    remote_storage_options=options) as manager:
        for step in range(3):
            manager.save(step, state(step))
    shutil.copytree(tmp_path / "disk", tmp_path / "lagging")  # a node's disk as of step 2
    with cas_ckpt.CheckpointManager(ram, "run", keep_last=2, replicate_to=tiers,
                                    remote_storage_options=options) as manager:
        report = manager.last_restore  # a restarted process: its RAM tier has everything
        assert report is not None and (report.tier, report.step, report.bytes) == ("local", 2, 0)
        manager.save(3, state(3))
    shutil.rmtree(ram)  # the host is gone, RAM and disk
    shutil.rmtree(tmp_path / "disk")
    fresh = cas_ckpt.CheckpointManager(ram, "run", replicate_to=tiers, remote_storage_options=options)
    report = fresh.last_restore
    assert report is not None and report.tier == peer.url and report.step == 3
    assert same(fresh.restore(), state(3))
    with cas_ckpt.open(ram) as repo:  # the bytes moved are exactly the blocks it lacked: all of them
        held = [repo.blocks.size(c) for c in repo.blocks.keys()]  # noqa: SIM118
    assert (report.blocks, report.bytes) == (len(held), sum(held))
    fresh.close()
    # A node whose disk survived with step 2: only what step 3 changed moves.
    behind = cas_ckpt.CheckpointManager(tmp_path / "lagging", "run", replicate_to=[peer.url],
                                        remote_storage_options={"token": WRITE})
    report = behind.last_restore
    assert report is not None and report.tier == peer.url and report.step == 3
    assert MiB <= report.bytes < MiB + 64 * 1024  # "moving", its tree and commit; "fixed" stays
    assert same(behind.restore(), state(3))
    behind.close()


def test_recovery_skips_a_tier_out_of_reach_or_with_damaged_blocks(
    ram: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    with cas_ckpt.CheckpointManager(tmp_path / "old", "run", replicate_to=[str(first), str(second)]) as m:
        for step in range(3):
            m.save(step, state(step))
    needle = state(2)["moving"].tobytes()[:64]  # the first tier's copy of step 2's new chunk, damaged
    damaged = 0
    for pack in (first / "packs").glob("*.pack"):
        data = bytearray(pack.read_bytes())
        at = data.find(needle)
        if at >= 0:
            data[at] ^= 0xFF
            pack.write_bytes(bytes(data))
            damaged += 1
    assert damaged == 1
    dead = "http://127.0.0.1:9"  # nothing listens: refused
    with caplog.at_level(logging.WARNING, logger="cas_ckpt"):
        fresh = cas_ckpt.CheckpointManager(ram, "run", replicate_to=[dead, str(first), str(second)],
                                           remote_storage_options=[{"attempts": 1}, None, None])
    report = fresh.last_restore
    assert report is not None and report.tier == str(second) and report.step == 2
    assert same(fresh.restore(), state(2))
    text = caplog.text
    assert f"tier {dead} is out of reach" in text and f"from {first} failed" in text
    with pytest.raises(ReplicationFailed):  # the dead tier never caught up
        fresh.close()
