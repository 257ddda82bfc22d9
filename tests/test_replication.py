"""Replication between repositories (memory, local, real S3 servers: moto and LocalStack): push, pull, clone,
only missing blocks sent, history without expired data, races on a remote ref, and the two-tier
CheckpointManager (background pushes, retention per side, lag, retries, restore from the remote).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import assert_state_equal, flip_byte
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from strategies import states

import cas_ckpt
from cas_ckpt import cid as cidlib
from cas_ckpt import cli
from cas_ckpt.errors import RefConflict, RefDiverged, RefNotFound, ReplicationFailed, RepositoryError

FAST = {"min_grace": 0.0}  # remote GC may collect what was just pushed
MiB = 1024 * 1024


def _state(seed: int, arrays: int = 10, size: int = MiB) -> dict[str, Any]:
    """``arrays`` arrays of ``size`` bytes of random float32 (incompressible, no dedup inside)."""
    rng = np.random.default_rng(seed)
    return {"layers": {f"l{i}": rng.standard_normal(size // 4).astype(np.float32) for i in range(arrays)},
            "step": seed}


# Each medium: a directory, and S3 on each of the tests' servers (moto and LocalStack, conftest.py).
S3_MEDIA = ("medium", "s3_server"), [
    pytest.param("local", None, id="local"),
    *(pytest.param("s3", kind, id=f"s3-{kind}") for kind in ("moto", "localstack")),
]


@pytest.fixture(params=["memory", "local", "s3-moto", "s3-localstack"])
def remote(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[cas_ckpt.Repository]:
    """An empty remote repository on each medium (S3: on moto and on LocalStack)."""
    if request.param.startswith("s3-"):
        url = request.getfixturevalue("s3_url_on")(request.param[len("s3-") :])
        repo = cas_ckpt.open(url, storage_options=FAST)
    elif request.param == "local":
        repo = cas_ckpt.open(tmp_path / "remote")
    else:
        repo = cas_ckpt.open("memory://")
    with repo:
        yield repo


@pytest.fixture
def local(tmp_path: Path) -> Iterator[cas_ckpt.Repository]:
    with cas_ckpt.open(tmp_path / "local") as repo:
        yield repo


# -- round trips ---------------------------------------------------------------------------------
@settings(max_examples=25)
@given(state=states())
def test_any_state_round_trips_through_push_and_pull(state: Any) -> None:
    with cas_ckpt.open("memory://") as a, cas_ckpt.open("memory://") as b, \
            cas_ckpt.open("memory://") as c:
        a.save(state, ref="main", step=1)
        a.push(b, "main")
        c.pull(b, "main")
        assert_state_equal(state, c.load("main"))
        assert c.resolve("main") == a.resolve("main")


def test_push_pull_clone_round_trip(local: cas_ckpt.Repository, remote: cas_ckpt.Repository,
                                    tmp_path: Path) -> None:
    for step in range(3):
        local.save(_state(step, arrays=3), ref="main", step=step)
    local.save({"other": np.arange(10)}, ref="other")
    local.pin(local.save({"pinned": 1}, ref="tmp"))
    local.delete_ref("tmp")

    report = local.push(remote, "main")
    assert report.refs == {"main": local.resolve("main")} and report.previous == {"main": None}
    assert report.commits_sent == 2  # the two older commits travel as history
    assert [c.step for c in remote.log("main")] == [2, 1, 0]
    assert remote.expired(next(iter(remote.log("main~1"))))  # only the head's data travelled
    assert_state_equal(_state(2, arrays=3), remote.load("main"))
    assert remote.fsck().problems == []

    again = local.push(remote, "main")
    assert again.up_to_date and again.blocks_sent == 0 and again.blocks_skipped > 0

    with cas_ckpt.open(tmp_path / "puller") as puller:
        pulled = puller.pull(remote, "copy", remote_ref="main")
        assert pulled.refs == {"copy": local.resolve("main")}
        assert_state_equal(_state(2, arrays=3), puller.load("copy"))

    with cas_ckpt.clone(local, tmp_path / "clone") as clone:
        assert clone.refs() == local.refs()
        assert clone.pins() == local.pins()
        assert clone.last_transfer is not None and clone.last_transfer.blocks_sent > 0
        assert clone.load("main~0")["step"] == 2 and clone.load(local.pins()[0]) == {"pinned": 1}
        assert clone.fsck().problems == []
    with cas_ckpt.clone(local, tmp_path / "clone") as again:  # run again: nothing left to do
        assert again.last_transfer is not None and again.last_transfer.up_to_date
        again.save({"mine": 1}, ref="elsewhere")
    with pytest.raises(RepositoryError, match=r"holds refs or pins that .* does not \(elsewhere\)"):
        cas_ckpt.clone(local, tmp_path / "clone")


def test_locations_are_opened_and_created(local: cas_ckpt.Repository, tmp_path: Path, s3_url: str) -> None:
    local.save(_state(1, arrays=2), ref="main", step=1)
    local.push(s3_url, "main", remote_ref="runs/a")
    local.push(tmp_path / "dir", "main")
    with cas_ckpt.open(s3_url) as s3, cas_ckpt.open(tmp_path / "dir") as folder:
        assert s3.resolve("runs/a") == folder.resolve("main") == local.resolve("main")
    with cas_ckpt.clone(s3_url, tmp_path / "from-s3") as clone:
        assert_state_equal(_state(1, arrays=2), clone.load("runs/a"))
    with pytest.raises(RepositoryError, match="no cas_ckpt repository"):
        local.pull(tmp_path / "missing", "main")
    with pytest.raises(RefNotFound):
        local.push(tmp_path / "dir", "no-such-ref")


# -- only what is missing ------------------------------------------------------------------------
def test_a_push_of_a_checkpoint_that_changed_10_percent_sends_about_10_percent(
    local: cas_ckpt.Repository, remote: cas_ckpt.Repository
) -> None:
    state = _state(0)
    local.save(state, ref="main", step=1)
    first = local.push(remote, "main")
    total = sum(a.nbytes for a in state["layers"].values())
    assert total <= first.bytes_sent < total + 64 * 1024
    state["layers"]["l3"] = state["layers"]["l3"] + 1  # one array of ten: 10% of the bytes
    local.save(state, ref="main", step=2)
    second = local.push(remote, "main")
    assert total // 10 <= second.bytes_sent < total // 10 + 64 * 1024
    assert second.bytes_skipped >= total * 9 // 10
    assert second.previous == {"main": first.refs["main"]}
    assert_state_equal(state, remote.load("main"))


def test_history_travels_but_expired_data_does_not(local: cas_ckpt.Repository,
                                                    remote: cas_ckpt.Repository) -> None:
    with cas_ckpt.CheckpointManager(local, "run", keep_last=1) as mgr:
        for step in range(1, 5):
            mgr.save(step, _state(step, arrays=2))
    report = local.push(remote, "run")
    assert report.bytes_sent < 2 * (2 * MiB) + 64 * 1024  # the head only, not four checkpoints
    history = list(remote.log("run"))
    assert [c.step for c in history] == [4, 3, 2, 1]
    assert [remote.expired(c) for c in history] == [False, True, True, True]


# -- refs move like git's ------------------------------------------------------------------------
def test_a_diverged_remote_is_refused_before_anything_is_sent_unless_forced(
    local: cas_ckpt.Repository, remote: cas_ckpt.Repository
) -> None:
    local.save(_state(1, arrays=2), ref="main", step=1)
    local.push(remote, "main")
    theirs = remote.save({"theirs": 1}, ref="main", step=2)
    local.save(_state(2, arrays=2), ref="main", step=2)
    stored = len(remote.blocks)
    with pytest.raises(RefDiverged, match="not an ancestor") as caught:
        local.push(remote, "main")
    assert isinstance(caught.value, RefConflict) and caught.value.ref == "main"
    assert len(remote.blocks) == stored and remote.resolve("main") == theirs
    with pytest.raises(RefDiverged):
        local.pull(remote, "main")
    forced = local.push(remote, "main", force=True)
    assert forced.previous == {"main": theirs} and remote.resolve("main") == local.resolve("main")
    local.pull(remote, "main")  # now a fast-forward: nothing to do
    assert local.last_transfer is not None and local.last_transfer.up_to_date


@pytest.mark.parametrize(*S3_MEDIA, indirect=["s3_server"])
def test_a_remote_that_moved_during_a_push_is_a_conflict(
    medium: str, s3_server: tuple[str, str] | None, local: cas_ckpt.Repository, tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    where = request.getfixturevalue("s3_url") if medium == "s3" else tmp_path / "remote"
    local.save(_state(1, arrays=2), ref="main", step=1)
    base = local.push(where, "main").refs["main"]
    local.save(_state(2, arrays=2), ref="main", step=2)
    with cas_ckpt.open(tmp_path / "other") as other:
        other.pull(where, "main")
        other.save({"other": 1}, ref="main", step=9)
        interleaved = []

        def push_other_first(sent: int, *_: int) -> None:
            if not interleaved:  # once, after our push read the remote ref and before it moves it
                interleaved.append(other.push(where, "main"))

        with pytest.raises(RefConflict) as caught:
            local.push(where, "main", progress=push_other_first)
        assert not isinstance(caught.value, RefDiverged)
        assert interleaved[0].previous == {"main": base}
        with cas_ckpt.open(where) as remote:
            assert remote.resolve("main") == other.resolve("main")
            assert remote.fsck().problems == []


_RACER = textwrap.dedent("""
    import sys
    import cas_ckpt
    from cas_ckpt.errors import RefConflict
    remote, local, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
    with cas_ckpt.open(local) as repo:
        done = conflicts = 0
        while done < rounds:
            repo.pull(remote, "main", force=True)  # start from the remote's head
            count = repo.load("main")["count"]
            repo.save({"count": count + 1}, ref="main", step=count + 1)
            try:
                repo.push(remote, "main")
                done += 1
            except RefConflict:  # RefDiverged too: another pusher got there first
                conflicts += 1
        print(conflicts)
""")


def test_two_pushers_racing_on_one_remote_ref_lose_no_update(
    s3_url: str, s3_env: str, tmp_path: Path
) -> None:
    with cas_ckpt.open("memory://") as seed:
        seed.save({"count": 0}, ref="main", step=0)
        seed.push(s3_url, "main")
    rounds = 4
    procs = [subprocess.Popen([sys.executable, "-c", _RACER, s3_url, str(tmp_path / f"p{i}"),
                               str(rounds)], stdout=subprocess.PIPE, text=True) for i in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    with cas_ckpt.open(s3_url) as remote:
        assert remote.load("main")["count"] == 2 * rounds
        assert [c.step for c in remote.log("main")] == list(range(2 * rounds, -1, -1))
        assert remote.fsck().problems == []
    assert all(out.strip().isdigit() for out in outs)


# -- the command line ----------------------------------------------------------------------------
def test_cli_push_pull_clone(local: cas_ckpt.Repository, tmp_path: Path, s3_url: str,
                             capsys: pytest.CaptureFixture[str]) -> None:
    local.save(_state(1, arrays=2), ref="main", step=1)
    local.save(_state(2, arrays=2), ref="main", step=2)
    repo = str(local.location)
    assert cli.main(["--repo", repo, "push", s3_url, "--json"]) == cli.EXIT_OK
    pushed = json.loads(capsys.readouterr().out)
    assert pushed["refs"] == {"main": str(local.resolve("main"))} and pushed["commits_sent"] == 1
    assert pushed["bytes_sent"] >= 2 * MiB and pushed["blocks_skipped"] == 0 and pushed["seconds"] >= 0
    assert cli.main(["--repo", repo, "push", s3_url, "main", "--remote-ref", "copy"]) == cli.EXIT_OK
    assert "sent 0 blocks" in capsys.readouterr().out
    assert cli.main(["clone", s3_url, str(tmp_path / "c"), "--json"]) == cli.EXIT_OK
    cloned = json.loads(capsys.readouterr().out)
    assert set(cloned["refs"]) == {"main", "copy"}
    local.set_ref("main", "main~1")
    local.save({"diverged": 1}, ref="main", step=3)
    assert cli.main(["--repo", repo, "push", s3_url]) == cli.EXIT_ERROR
    assert "not an ancestor" in capsys.readouterr().err
    assert cli.main(["--repo", repo, "pull", s3_url, "--force"]) == cli.EXIT_OK
    assert "pulled" in capsys.readouterr().out
    assert local.resolve("main") == cas_ckpt.open(tmp_path / "c").resolve("main")
    assert cli.main(["--repo", repo, "pull", str(tmp_path / "nowhere")]) == cli.EXIT_REPO


# -- the two-tier manager ------------------------------------------------------------------------
def test_two_tier_manager_replicates_in_the_background_with_its_own_retention(
    local: cas_ckpt.Repository, remote: cas_ckpt.Repository
) -> None:
    with cas_ckpt.CheckpointManager(local, "run", keep_last=2, replicate_to=remote,
                                    remote_retention={"keep_every": 2}, async_save=True) as mgr:
        for step in range(1, 8):
            mgr.save(step, _state(step, arrays=2), metrics={"loss": 1.0 / step})
            lag = mgr.replication_lag
            assert lag is not None and lag.steps >= 0 and lag.bytes >= 0
        mgr.wait()
        lag = mgr.replication_lag
        assert lag is not None and (lag.steps, lag.bytes, lag.replicated_step) == (0, 0, 7)
        assert {6, 7} <= set(mgr.steps())  # and any kept until it had reached the remote
        mgr.save(8, _state(8, arrays=2))
        mgr.wait()
        assert mgr.steps() == [7, 8]  # the last 2 locally, now that all are replicated
    steps = sorted(int(n.rpartition("/")[2]) for n in remote.refs("run.steps/"))
    assert steps == [2, 4, 6, 8]  # every 2nd remotely (and the latest)
    history = {c.step: c for c in remote.log("run")}
    assert sorted(history) == list(range(1, 9))
    assert [s for s, c in sorted(history.items()) if not remote.expired(c)] == [2, 4, 6, 8]  # GC ran
    assert_state_equal(_state(4, arrays=2), remote.load("run.steps/000000000004"))
    assert remote.fsck().problems == []


def test_local_retention_applies_once_steps_reach_the_remote_and_at_close(
    local: cas_ckpt.Repository, remote: cas_ckpt.Repository
) -> None:
    """keep_last=1 and 8 quick saves: retention ran only inside save(), while the steps were
    still on their way, so 2 (a folder) to 7 (S3) steps stayed after close(), lag 0."""
    mgr = cas_ckpt.CheckpointManager(local, "run", keep_last=1, replicate_to=remote)
    for step in range(1, 9):
        mgr.save(step, {"step": step, "w": np.full(4096, step)})
    mgr.wait()  # returns once what follows the last push (local retention) is done too
    assert mgr.replication_lag.steps == 0 and mgr.steps() == [8]  # type: ignore[union-attr]
    mgr.close()
    assert sorted(local.refs()) == ["run", "run.steps/000000000008"]
    assert len(local.blocks) == len(cas_ckpt.maintenance.walk.walk(
        local.blocks, {cidlib.to_bytes(local.resolve("run")): "run"}).data) + 7  # commits of 1-7 only
    assert sorted(remote.refs()) == ["run", "run.steps/000000000008"]


def test_retention_at_close_catches_up_with_a_remote_that_came_back(
    local: cas_ckpt.Repository, tmp_path: Path
) -> None:
    blocker = tmp_path / "remote"
    blocker.write_text("not yet")  # the remote is away while the run saves
    local.save({"step": 0}, ref="run", step=0)
    mgr = cas_ckpt.CheckpointManager(local, "run", keep_last=1, replicate_to=blocker)
    for step in (1, 2, 3):
        mgr.save(step, {"step": step})
    assert mgr.steps() == [0, 1, 2, 3]  # all kept: none has reached the remote
    blocker.unlink()
    mgr.close()
    assert sorted(local.refs()) == ["run", "run.steps/000000000003"]


RESTARTED_TRAINER = """
import sys
import cas_ckpt
repo = cas_ckpt.open(sys.argv[1])
manager = cas_ckpt.CheckpointManager(repo, "run", keep_last=2, replicate_to=sys.argv[2],
                                     remote_retention={})
for step in range(2, 7):
    manager.save(step, {"step": step})
print(manager.replication_lag.steps, manager.steps(), flush=True)
sys.stdin.readline()  # killed here, with steps 2-6 not replicated
"""


@pytest.mark.parametrize(*S3_MEDIA, indirect=["s3_server"])
def test_steps_saved_while_the_remote_was_away_are_sent_after_a_restart(
    tmp_path: Path, medium: str, s3_server: tuple[str, str] | None, request: pytest.FixtureRequest
) -> None:
    """A trainer saves steps 2-6 while its remote is away and is killed (kill -9); restarted on
    the same disk with the remote back, its first save expired steps 2-5 locally before any push:
    the queue lived in memory only, and those steps were nowhere."""
    where = request.getfixturevalue("s3_url") if medium == "s3" else str(tmp_path / "remote")
    local_dir = tmp_path / "local"
    options = {"keep_last": 2, "remote_retention": {}}
    with cas_ckpt.CheckpointManager(local_dir, "run", replicate_to=where, **options) as first:
        first.save(1, {"step": 1})  # replicated
    env = dict(os.environ)
    if medium == "s3":
        env["AWS_ENDPOINT_URL"] = "http://127.0.0.1:9"  # the proxy is down: nothing answers there
    else:
        (tmp_path / "remote").rename(tmp_path / "remote.away")  # away, its data intact
        (tmp_path / "remote").write_text("down")
    trainer = subprocess.Popen([sys.executable, "-c", RESTARTED_TRAINER, str(local_dir), where],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                               text=True, env=env)
    try:
        assert trainer.stdout is not None
        # The lag shows them (and step 1, which a remote out of reach cannot confirm it holds).
        assert trainer.stdout.readline() == "6 [1, 2, 3, 4, 5, 6]\n"
    finally:
        trainer.kill()
        trainer.communicate(timeout=60)
    if medium == "local":
        (tmp_path / "remote").unlink()
        (tmp_path / "remote.away").rename(tmp_path / "remote")  # back
    with cas_ckpt.CheckpointManager(local_dir, "run", replicate_to=where, **options) as restarted:
        assert restarted.replication_lag.steps == 5  # type: ignore[union-attr]
        restarted.save(7, {"step": 7})
        restarted.wait()
        assert restarted.steps() == [6, 7]
    with cas_ckpt.open(where) as remote:
        steps = sorted(int(n.rpartition("/")[2]) for n in remote.refs("run.steps/"))
        assert steps == [1, 2, 3, 4, 5, 6, 7]
        assert [remote.load(f"run.steps/{s:012d}")["step"] for s in steps] == steps
        assert remote.load("run") == {"step": 7}


def test_a_restart_with_the_remote_still_away_keeps_every_local_step_until_it_is_back(
    tmp_path: Path,
) -> None:
    remote = tmp_path / "remote"
    options = {"keep_last": 1, "remote_retention": {}}
    with cas_ckpt.CheckpointManager(tmp_path / "local", "run", replicate_to=remote, **options) as first:
        first.save(1, {"step": 1})
    remote.rename(tmp_path / "away")
    remote.write_text("down")
    with cas_ckpt.open(tmp_path / "local") as local:
        local.save({"step": 2}, ref="run", step=2)  # saved by a run that died before pushing it
        local.set_ref("run.steps/000000000002", "run")
        mgr = cas_ckpt.CheckpointManager(local, "run", replicate_to=remote, **options)
        mgr.save(3, {"step": 3})
        assert mgr.steps() == [1, 2, 3]  # unknown to be there: kept
        remote.unlink()
        (tmp_path / "away").rename(remote)
        mgr.close()
        assert sorted(local.refs()) == ["run", "run.steps/000000000003"]
    with cas_ckpt.open(remote) as back:
        assert sorted(back.refs("run.steps/")) == [f"run.steps/{s:012d}" for s in (1, 2, 3)]


def test_deleting_a_two_tier_run_stops_replication_without_waiting_for_the_remote(
    local: cas_ckpt.Repository, tmp_path: Path
) -> None:
    blocker = tmp_path / "remote"
    blocker.write_text("away")
    local.save({"step": 0}, ref="run", step=0)
    mgr = cas_ckpt.CheckpointManager(local, "run", replicate_to=blocker)
    mgr.save(1, {"step": 1})
    assert sorted(mgr.delete()) == ["run", "run.steps/000000000000", "run.steps/000000000001"]
    assert local.refs() == {} and blocker.read_text() == "away"  # nothing sent, nothing raised


def test_replicate_every_nth_save_and_always_the_last_at_close(local: cas_ckpt.Repository,
                                                               remote: cas_ckpt.Repository) -> None:
    with cas_ckpt.CheckpointManager(local, "run", replicate_to=remote, replicate_every=3) as mgr:
        for step in range(1, 8):
            mgr.save(step, {"step": step})
        mgr.wait()
        assert sorted(remote.refs("run.steps/")) == ["run.steps/000000000003", "run.steps/000000000006"]
        assert remote.load("run")["step"] == 6
    assert len(remote.refs("run.steps/")) == 3 and remote.load("run")["step"] == 7  # close sent it


def test_a_new_node_with_an_empty_disk_resumes_from_the_remote(
    tmp_path: Path, s3_url: str
) -> None:
    with cas_ckpt.open(tmp_path / "node1") as node1, \
            cas_ckpt.CheckpointManager(node1, "run", keep_last=1, replicate_to=s3_url,
                                       remote_retention={}) as mgr:
        for step in range(1, 4):
            mgr.save(step, _state(step, arrays=2))
    with cas_ckpt.open(tmp_path / "node2") as node2, \
            cas_ckpt.CheckpointManager(node2, "run", keep_last=1, replicate_to=s3_url,
                                       remote_retention={}) as mgr:
        assert mgr.latest_step() == 3
        assert_state_equal(_state(3, arrays=2), mgr.restore())
        assert_state_equal(_state(1, arrays=2), mgr.restore(1))  # only the remote kept step 1
        mgr.save(4, _state(4, arrays=2))
    with cas_ckpt.open(s3_url) as remote:
        assert [c.step for c in remote.log("run")] == [4, 3, 2, 1]  # one history across nodes
        assert len(remote.refs("run.steps/")) == 4


def test_a_node_whose_disk_is_older_than_the_remote_catches_up_first(tmp_path: Path) -> None:
    remote = tmp_path / "remote"
    with cas_ckpt.open(tmp_path / "a") as a:
        with cas_ckpt.CheckpointManager(a, "run", replicate_to=remote) as mgr:
            mgr.save(1, {"step": 1})
        with cas_ckpt.open(tmp_path / "b") as b, \
                cas_ckpt.CheckpointManager(b, "run", replicate_to=remote) as other:  # node a is down
            other.save(2, {"step": 2})
            other.save(3, {"step": 3})
        with cas_ckpt.CheckpointManager(a, "run", replicate_to=remote) as mgr:  # a is back
            assert mgr.latest_step() == 3 and mgr.restore() == {"step": 3}
            mgr.save(4, {"step": 4})
        a.set_ref("run", "run~1")  # this disk's history now parts from the remote's
        a.save({"elsewhere": 1}, ref="run", step=5)
    with cas_ckpt.open(remote) as r:
        assert [c.step for c in r.log("run")] == [4, 3, 2, 1]
    with cas_ckpt.open(tmp_path / "a") as a, pytest.raises(RefDiverged):
        cas_ckpt.CheckpointManager(a, "run", replicate_to=remote)  # two histories: refuse to mix


def test_a_local_checkpoint_that_fails_verification_is_fetched_again(
    local: cas_ckpt.Repository, remote: cas_ckpt.Repository, caplog: pytest.LogCaptureFixture
) -> None:
    with cas_ckpt.CheckpointManager(local, "run", replicate_to=remote) as mgr:
        mgr.save(1, _state(1, arrays=2))
        mgr.wait()
        pack, offset, _ = local.blocks.locate(_first_chunk(local))
        path = local.blocks.pack_dir / pack
        flip_byte(path, offset + 10, 0xFF)  # damage one byte of a chunk, in place
        with caplog.at_level(logging.WARNING, "cas_ckpt"):
            assert_state_equal(_state(1, arrays=2), mgr.restore())
        assert "fetching it from" in caplog.text
    with cas_ckpt.open(local.location) as reopened:  # a good copy is stored now, beside the bad one
        assert_state_equal(_state(1, arrays=2), reopened.load("run"))


def _damage(repo: cas_ckpt.Repository, cid: bytes) -> None:
    """Flip one byte of ``cid``'s first stored copy, in place (bit rot)."""
    pack, offset, _ = repo.blocks.locate(cid)
    flip_byte(repo.blocks.pack_dir / pack, offset + 10, 0xFF)


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_a_transfer_from_an_unverified_source_never_stores_damaged_blocks(
    tmp_path: Path, remote: cas_ckpt.Repository, compression: str
) -> None:
    """The source reads without hashing (verify=False); the destination hashes what it receives,
    so a damaged block is refused there, the ref does not move, and the destination stays clean."""
    if compression == "zstd":
        remote.set_compression("zstd")
    with cas_ckpt.open(tmp_path / "src") as src:
        src.save(_state(1, arrays=3), ref="main", step=1)
        chunk = _first_chunk(src)
        _damage(src, chunk)
    with cas_ckpt.open(tmp_path / "src", verify=False) as unverified:
        assert not cidlib.matches(chunk, unverified.blocks.get(chunk))  # it does hand out rot
        with pytest.raises(cas_ckpt.errors.CorruptBlock, match=cidlib.to_str(chunk)):
            remote.pull(unverified, "main")
        with pytest.raises(cas_ckpt.errors.CorruptBlock):
            unverified.push(remote, "main")
    assert remote.refs() == {}
    remote.blocks.refresh()
    assert remote.fsck().ok and not remote.blocks.has(chunk)


def test_a_damaged_copy_in_the_source_is_replaced_by_its_intact_one(
    tmp_path: Path, remote: cas_ckpt.Repository
) -> None:
    state = _state(2, arrays=3)
    with cas_ckpt.open(tmp_path / "src") as src:
        src.save(state, ref="main", step=1)
        chunk = _first_chunk(src)
        with src.blocks.writer() as writer:  # a second copy, in a pack of its own
            writer.add_copy(chunk, src.blocks.get(chunk))
    with cas_ckpt.open(tmp_path / "src", verify=False) as unverified:
        _damage(unverified, chunk)  # the copy this process reads first
        assert not cidlib.matches(chunk, unverified.blocks.get(chunk))
        report = remote.pull(unverified, "main")
    assert report.refs == {"main": remote.resolve("main")}
    assert_state_equal(state, remote.load("main"))
    assert remote.fsck().ok


def test_a_two_tier_push_never_sends_local_bit_rot_to_the_backup(tmp_path: Path) -> None:
    shared = _state(3, arrays=2)
    with cas_ckpt.open(tmp_path / "local", verify=False) as local, \
            cas_ckpt.open(tmp_path / "remote") as backup:
        mgr = cas_ckpt.CheckpointManager(local, "run", replicate_to=backup, replicate_every=2)
        mgr.save(1, shared)  # not due: stays local
        chunk = _first_chunk(local)
        _damage(local, chunk)  # rots on the local disk
        mgr.save(2, {**shared, "step": 2})  # reuses the rotten chunk; due: pushed
        with pytest.raises(ReplicationFailed, match="CorruptBlock") as failed:
            mgr.close()
        assert failed.value.steps == [2]
        assert backup.refs() == {} and backup.fsck().ok and not backup.blocks.has(chunk)


def _first_chunk(repo: cas_ckpt.Repository) -> bytes:
    return next(key for key in repo.blocks.keys() if not cidlib.is_node(key))  # noqa: SIM118 - a store


def test_a_replication_failure_is_reported_and_retried(local: cas_ckpt.Repository, tmp_path: Path,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "remote"
    blocker.write_text("not a repository")  # the remote cannot be created: every push fails
    local.save({"w": np.arange(4)}, ref="run", step=0)  # the run exists here: nothing to fetch
    with caplog.at_level(logging.WARNING, "cas_ckpt"):
        mgr = cas_ckpt.CheckpointManager(local, "run", replicate_to=blocker)
        mgr.save(1, {"w": np.arange(5)})
        mgr.save(2, {"w": np.arange(6)})
        # Step 0 too: with the remote out of reach at start, nothing says it holds step 0.
        with pytest.raises(ReplicationFailed, match="behind by 3") as caught:
            mgr.wait()
        assert caught.value.steps == [0, 1, 2] and "exists and is not" in str(caught.value)
        lag = mgr.replication_lag
        assert lag is not None and lag.steps == 3 and lag.failures >= 3 and lag.error
        assert "replicating steps [0, 1" in caplog.text and "failed (attempt 3" in caplog.text
        blocker.unlink()  # the remote comes back: the next retry catches up
        mgr.wait()  # retries at once, without sitting out the backoff
        assert mgr.replication_lag.steps == 0  # type: ignore[union-attr]
        mgr.close()
    with cas_ckpt.open(blocker) as remote:
        assert remote.load("run")["w"].tolist() == list(range(6))
        assert sorted(remote.refs("run.steps/")) == [f"run.steps/00000000000{s}" for s in (0, 1, 2)]


def test_each_failed_attempt_is_logged_before_anyone_sees_it_counted(
    local: cas_ckpt.Repository, tmp_path: Path
) -> None:
    """wait() raises once it sees 3 failures; the third warning must be in the log by then (it
    was logged after the count was published, and a test reading the log at once failed)."""
    blocker = tmp_path / "remote"
    blocker.write_text("not a repository")
    local.save({"w": np.arange(4)}, ref="run", step=0)
    seen: list[tuple[int, int]] = []  # (attempt logged, failures visible then)
    managers: list[cas_ckpt.CheckpointManager] = []

    class Witness(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "failed (attempt" in record.getMessage():
                lag = managers[0].replication_lag
                assert lag is not None
                seen.append((int(record.getMessage().split("attempt ")[1].split(",")[0]), lag.failures))

    witness = Witness()
    logging.getLogger("cas_ckpt").addHandler(witness)
    try:
        managers.append(cas_ckpt.CheckpointManager(local, "run", replicate_to=blocker))
        managers[0].save(1, {"w": np.arange(5)})
        with pytest.raises(ReplicationFailed):
            managers[0].wait()
    finally:
        logging.getLogger("cas_ckpt").removeHandler(witness)
        blocker.unlink()
        managers[0].close()
    assert len(seen) >= 3 and all(failures == attempt - 1 for attempt, failures in seen), seen


def test_close_raises_when_replication_cannot_catch_up(local: cas_ckpt.Repository, tmp_path: Path) -> None:
    blocker = tmp_path / "remote"
    blocker.write_text("x")
    local.save({"a": 0}, ref="run", step=0)
    mgr = cas_ckpt.CheckpointManager(local, "run", replicate_to=blocker)
    mgr.save(1, {"a": 1})
    with pytest.raises(ReplicationFailed):
        mgr.close()
    assert local.load("run") == {"a": 1}  # saved locally all the same
    with cas_ckpt.open(tmp_path / "empty") as empty, \
            pytest.raises(RepositoryError, match="exists and is not"):
        cas_ckpt.CheckpointManager(empty, "run", replicate_to=blocker)  # cannot know what to resume


# -- the docs ------------------------------------------------------------------------------------
def test_the_replication_section_of_scale_out_runs() -> None:
    import doctest

    text = (Path(__file__).parent.parent / "docs" / "scale-out.md").read_text()
    start = text.index("## Replication: push, pull, clone")
    end = text.find("\n## ", start + 10)
    section = text[start : end if end >= 0 else len(text)]
    test = doctest.DocTestParser().get_doctest(section, {}, "scale-out.md (replication)", None, 0)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    runner.run(test)
    assert runner.summarize(verbose=False).failed == 0 and len(test.examples) >= 10


def test_the_replication_benchmark_runs(s3_env: str, tmp_path: Path) -> None:
    """benchmarks/replicate_bench.py at a tiny size, on the test server (no speed asserted)."""
    sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
    import replicate_bench

    out = tmp_path / "bench.json"
    assert replicate_bench.main(["--size-mb", "8", "--arrays", "2", "--loop-mb", "4", "--steps", "2",
                                 "--workdir", str(tmp_path), "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert figures["figures"]["push"]["bytes_sent"] >= 8 * MiB
    assert figures["figures"]["push 10%"]["bytes_sent"] < figures["figures"]["push"]["bytes_sent"]
    assert set(figures["two_tier"]) == {"local only", "two-tier"}


def test_dcp_saves_of_a_two_tier_manager_are_replicated(local: cas_ckpt.Repository,
                                                         tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    import warnings

    with warnings.catch_warnings():  # DCP warns that it runs without a process group
        warnings.simplefilter("ignore")
        with cas_ckpt.CheckpointManager(local, "run", replicate_to=tmp_path / "remote") as mgr:
            for step in (1, 2):
                mgr.save_dcp(step, {"w": torch.full((256, 256), float(step))})
            mgr.wait()
            lag = mgr.replication_lag
            assert lag is not None and lag.replicated_step == 2
    with cas_ckpt.open(tmp_path / "remote") as remote, cas_ckpt.open(tmp_path / "fresh") as node, \
            cas_ckpt.CheckpointManager(node, "run", replicate_to=remote) as fresh, \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")
        target = {"w": torch.zeros(256, 256)}
        fresh.restore_dcp(target)
        assert float(target["w"][0, 0]) == 2.0 and fresh.steps() == [2]


# -- a model of pushes and pulls -----------------------------------------------------------------
class PushPullMachine(RuleBasedStateMachine):
    """Two clones saving, pushing and pulling through one remote, against a model of git's rules:
    a push or pull is refused exactly when it is not a fast-forward (unless forced), the ref on
    the receiving side then holds the sender's head, and every ref anywhere loads what was saved."""

    def __init__(self) -> None:
        super().__init__()
        self.repos = {name: cas_ckpt.open("memory://") for name in ("a", "b", "remote")}
        self.saved: dict[Any, Any] = {}  # commit -> state
        self.step = 0

    def teardown(self) -> None:
        for repo in self.repos.values():
            repo.close()

    def _chain(self, repo: cas_ckpt.Repository) -> list[Any]:
        return [c.cid for c in repo.log("main")] if "main" in repo.refs() else []

    @rule(who=st.sampled_from(["a", "b"]), value=st.integers(0, 3), size=st.integers(0, 3000))
    def save(self, who: str, value: int, size: int) -> None:
        self.step += 1
        state = {"v": np.full(size, value, np.int32), "step": self.step}
        cid = self.repos[who].save(state, ref="main", step=self.step)
        self.saved[cid] = state

    @rule(who=st.sampled_from(["a", "b"]), force=st.booleans(), pull=st.booleans())
    def transfer(self, who: str, force: bool, pull: bool) -> None:
        here, remote = self.repos[who], self.repos["remote"]
        src, dst = (remote, here) if pull else (here, remote)
        if "main" not in src.refs():
            with pytest.raises(RefNotFound):
                (dst.pull(src) if pull else src.push(dst))
            return
        theirs = self._chain(dst)
        ok = force or not theirs or theirs[0] in self._chain(src)
        try:
            report = dst.pull(src, force=force) if pull else src.push(dst, force=force)
        except RefDiverged:
            assert not ok
            return
        assert ok
        assert dst.resolve("main") == src.resolve("main") == report.refs["main"]

    @invariant()
    def every_ref_loads_what_was_saved(self) -> None:
        for repo in self.repos.values():
            for cid in repo.refs().values():
                assert_state_equal(self.saved[cid], repo.load(cid))


TestPushPull = PushPullMachine.TestCase
TestPushPull.settings = settings(max_examples=30, stateful_step_count=15)
