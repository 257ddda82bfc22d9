"""The commit graph under SIGKILL, concurrent writers and GC, on a local directory and on S3.

* **kill**: a child process saves and merges the whole graph (3,000 commits and more on disk,
  300 on S3) in a loop (``_graph_child.py``: a merge publishes a new layer, then deletes the old
  ones) and is SIGKILLed at a random moment within 20 ms of a merge's start, so mostly inside
  one. After each kill a fresh process must see only whole layers (none damaged), every ref's
  history exactly as the commit blocks give it, and a clean fsck; the next child carries on from
  there. CI kills 4 times on disk and 2 on S3; ``CAS_CKPT_LONG=1`` 40 and 8.
* **concurrency**: two child processes save (12 times each; 60 in long mode) to refs of their own
  and merge the graph after each save, while this process merges it too and collects garbage
  (having deleted a ref whose commits the graph holds copies of). Afterwards nothing is damaged,
  each child's history is exactly its saves, read through the graph as from the blocks, and one
  more merge covers every commit.
"""

from __future__ import annotations

import random
import subprocess
import threading
import time
import traceback
from pathlib import Path

import pytest
from helpers import from_blocks

import cas_ckpt

from ._support import HERE, LONG, PYTHON, child_env, fsck_problems, record


def _location(medium: str, tmp_path: Path, request: pytest.FixtureRequest) -> str:
    """A repository on ``medium``: ``local``, or ``s3-moto`` / ``s3-localstack`` (a fresh bucket)."""
    if medium.startswith("s3-"):
        return str(request.getfixturevalue("s3_url_on")(medium[len("s3-"):]))
    return str(tmp_path / "repo")


def _check(location: str) -> int:
    """What a fresh process sees is whole and exact; returns the commits the graph holds."""
    with cas_ckpt.open(location, create=False) as repo:
        graph = repo.history.graph
        assert graph is not None
        graph.refresh()
        assert not graph.damaged, graph.damaged  # a layer is published whole or not at all
        for ref in repo.refs():
            assert list(repo.log(ref)) == from_blocks(repo, repo.resolve(ref)), ref
        problems = fsck_problems(repo)
        assert not problems, problems
        return len(graph)


def _history(repo: cas_ckpt.Repository, commits: int) -> None:
    """``commits`` commits on ``run``, written at once (their layers too)."""
    with repo.transaction() as txn:
        tree = txn.tree.write({"n": 0})
        parent: list[bytes] = []
        for n in range(commits):
            parent = [txn.put_commit(tree, parent, step=n, metadata={"n": n}, message=None)]
        txn.move_ref("run", None, parent[0], "history")


def _progress(children: list[subprocess.Popen[str]], logs: list[Path]) -> None:
    """Wait until a child finished another round (or all ended): GC back to back would keep
    saves waiting (on S3 a save waits for a running GC, and GC for registered saves)."""
    def rounds() -> int:
        return sum(log.read_text().count("done") for log in logs if log.exists())

    start = rounds()
    while rounds() == start and any(c.poll() is None for c in children):
        time.sleep(0.005)


def _child(location: str, ref: str, rounds: int, log: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([PYTHON, str(HERE / "_graph_child.py"), location, ref, str(rounds), str(log)],
                            env=child_env(), stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize("medium", ["local", "s3-moto", "s3-localstack"])
def test_sigkill_while_the_graph_is_written(
    medium: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    location = _location(medium, tmp_path, request)
    with cas_ckpt.open(location) as repo:
        # A graph whose merge takes longer than a save, so that most kills land in one.
        _history(repo, 3000 if medium == "local" else 300)
    kills = (40 if LONG else 4) if medium == "local" else (8 if LONG else 2)
    log, rng, inside = tmp_path / "log", random.Random(medium), 0
    for _ in range(kills):
        offset = log.stat().st_size if log.exists() else 0
        child = _child(location, "run", 0, log)
        deadline = time.monotonic() + 120
        while child.poll() is None and time.monotonic() < deadline:  # a merge has begun
            if log.exists() and b"begin" in log.read_bytes()[offset:]:
                break
            time.sleep(0.002)
        assert child.poll() is None, f"the child ended by itself: {child.communicate()[1]}"
        time.sleep(rng.uniform(0.0, 0.02))
        child.kill()
        child.communicate()
        inside += log.read_text().splitlines()[-1].startswith("begin")
        _check(location)
    assert inside >= kills // 3, f"only {inside} of {kills} kills landed inside a merge"
    with cas_ckpt.open(location, create=False) as repo:
        repo.update_commit_graph(consolidate=True)
        assert len(repo.history.graph.layers()) == 1  # type: ignore[union-attr]
        repo.gc()  # what the dead children left (temp files) goes
    if medium == "local":
        assert list((Path(location) / "tmp").glob("*.tmp")) == []
    record("commit_graph_kill", **{medium: kills, f"{medium}_inside": inside})


@pytest.mark.parametrize("medium", ["local", "s3-moto", "s3-localstack"])
def test_writers_merges_and_gc_at_once(medium: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    location = _location(medium, tmp_path, request)
    rounds = 60 if LONG else 12
    with cas_ckpt.open(location) as repo:
        for n in range(20):  # history whose commits GC will free while the graph holds them
            repo.save({"n": n}, ref="doomed", step=n)
        doomed = [bytes(c.cid) for c in repo.log("doomed")]
        children = [_child(location, ref, rounds, tmp_path / f"{ref}.log") for ref in ("a", "b")]
        stop = threading.Event()
        errors: list[str] = []

        def upkeep() -> None:
            try:
                while not stop.is_set():
                    repo.update_commit_graph(consolidate=True)
            except BaseException:  # reported below, where it happened included
                errors.append(traceback.format_exc())

        thread = threading.Thread(target=upkeep)
        thread.start()
        try:
            repo.delete_ref("doomed")
            while any(c.poll() is None for c in children):
                repo.gc(reflog_expiry=0)
                _progress(children, [tmp_path / f"{ref}.log" for ref in ("a", "b")])
        finally:
            stop.set()
            thread.join()
        for child in children:
            _, err = child.communicate()
            assert child.returncode == 0, err
        assert not errors, "\n".join(errors)
    held = _check(location)
    with cas_ckpt.open(location, create=False) as repo:
        for ref in ("a", "b"):
            assert [c.message for c in repo.log(ref)] == [f"{ref} {n}" for n in reversed(range(rounds))]
        repo.update_commit_graph(consolidate=True)  # what GC freed is left out (S3: after its grace)
        kept = sum(map(repo.blocks.has, doomed))
        assert len(repo.history.graph) == 2 * rounds + kept  # type: ignore[arg-type]
        assert held >= 2 * rounds  # the last merge of each child covered every save made before
