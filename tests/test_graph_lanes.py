"""The commit graph: lanes that connect every commit to each of its parents, in an order that puts
children first, drawn by ``cas-ckpt log --graph`` as git draws forks and merges."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

import cas_ckpt
from cas_ckpt import cid as cidlib
from cas_ckpt.cli import graph_lines
from cas_ckpt.commit import Commit
from cas_ckpt.maintenance.lanes import GraphRow, ancestry, layout, passing

BIN = Path(sys.executable).parent


def fake_cid(i: int) -> Any:
    return cidlib.to_cid(cidlib.Hasher().node(f"commit {i}".encode()))


@st.composite
def histories(draw: st.DrawFn) -> list[Commit]:
    """Commits whose parents are earlier commits (a DAG), at random times, some merges."""
    count = draw(st.integers(1, 40))
    cids = [fake_cid(i) for i in range(count)]
    tree = cids[0]
    commits = []
    for i, cid in enumerate(cids):
        parents = draw(st.lists(st.integers(0, i - 1), max_size=3, unique=True)) if i else []
        time = draw(st.floats(0, 100))
        commits.append(Commit(cid, tree, tuple(cids[p] for p in parents), i, time, {}, None))
    return commits


def follow(rows: list[GraphRow], i: int, start: int, end: int) -> int:
    """The row a line leaving row ``i`` (edge ``start -> end``) arrives at, going down its lane."""
    position, row = end, i + 1
    while position != rows[row].column:
        onward = [e for s, e, _ in rows[row].edges if s == position]
        assert len(onward) == 1, (row, position, rows[row].edges)
        position, row = onward[0], row + 1
    return row


@given(histories())
def test_every_commit_is_joined_to_each_parent_by_its_own_line(commits: list[Commit]) -> None:
    by_cid = {c.cid: c for c in commits}
    order = ancestry([c.cid for c in commits], lambda key: by_cid.get(cidlib.to_cid(key)))
    assert sorted(map(str, (c.cid for c in order))) == sorted(map(str, by_cid))
    place = {c.cid: i for i, c in enumerate(order)}
    for commit in order:  # children first
        assert all(place[p] > place[commit.cid] for p in commit.parents)
    rows = layout(order)
    for i, row in enumerate(rows):
        lines = [(s, e) for s, e, _ in row.edges if s == row.column]
        reached = {rows[follow(rows, i, s, e)].commit.cid for s, e in lines}
        assert reached == set(row.commit.parents)
        assert len(lines) == len(set(row.commit.parents))
        starts = [s for s, _, _ in row.edges if s != row.column]  # lanes going past: one each
        assert len(starts) == len(set(starts))
        assert row.column not in passing(rows, i)
        assert row.children == sum(row.commit.cid in c.parents for c in order)


def draw(commits: list[Commit]) -> list[str]:
    order = ancestry([c.cid for c in commits], lambda key: next(c for c in commits if bytes(c.cid) == key))
    return list(graph_lines(layout(order), lambda row: f"{row.commit.step}"))


def test_a_fork_and_a_merge_drawn_as_git_draws_them() -> None:
    c = [fake_cid(i) for i in range(7)]
    commit = lambda i, parents, t: Commit(c[i], c[0], tuple(c[p] for p in parents), i, t, {}, None)  # noqa: E731
    # 1 <- 2 <- 3 (a) ; 2 <- 4 (b, forked at 2) ; 5 merges 3 and 4
    history = [commit(1, [], 1), commit(2, [1], 2), commit(3, [2], 3), commit(4, [2], 4),
               commit(5, [3, 4], 5)]
    assert draw(history) == [
        "*    5",
        "|\\",
        "| *  4",
        "* |  3",
        "|/",
        "*  2",
        "*  1",
    ]


def test_log_graph_in_the_terminal(tmp_path: Path) -> None:
    with cas_ckpt.open(tmp_path / "repo") as repo:
        for step in (1, 2, 3):
            repo.save({"w": np.full(4, step)}, ref="runs/a", step=step,
                      metadata={"metrics": {"loss": 1 / step}})
        repo.fork("runs/a~1", "runs/b")
        repo.save({"w": np.zeros(4)}, ref="runs/b", step=10)
        repo.save({"w": np.ones(9)}, ref="alone", step=1)
        with cas_ckpt.CheckpointManager(repo, "runs/a") as manager:
            manager.save(4, {"w": np.full(4, 4)})
        a = [str(c.cid) for c in repo.log("runs/a")]
        b_head = str(repo.resolve("runs/b"))
    done = subprocess.run([str(BIN / "cas-ckpt"), "--repo", str(tmp_path / "repo"), "log", "--graph",
                           "runs/a"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    graph = [line.split("  ")[0] for line in lines]
    assert graph == ["*", "| *", "* |", "|/", "*", "*"]  # a's step 4, b's 10, a's 3, the fork, 2, 1
    assert lines[0].startswith(f"*  {a[0][:16]}") and "(runs/a)" in lines[0]
    assert lines[1].startswith(f"| *  {b_head[:16]}") and "(runs/b)" in lines[1]
    assert "loss=0.5" in lines[4] and "alone" not in done.stdout  # no history shared with runs/a
    every = subprocess.run([str(BIN / "cas-ckpt"), "--repo", str(tmp_path / "repo"), "log", "--graph",
                            "--json"], capture_output=True, text=True, timeout=60)
    rows = json.loads(every.stdout)
    assert len(rows) == 6 and {name for r in rows for name in r["refs"]} == {"runs/a", "runs/b", "alone"}
    assert all(".steps/" not in name for r in rows for name in r["refs"])
    fork = next(r for r in rows if r["step"] == 2)
    assert fork["children"] == 2 and fork["column"] == 0
    limited = subprocess.run([str(BIN / "cas-ckpt"), "--repo", str(tmp_path / "repo"), "log", "--graph",
                              "-n", "2"], capture_output=True, text=True, timeout=60)
    assert len(limited.stdout.splitlines()) == 2


def test_repo_graph_draws_every_run_by_default(tmp_path: Path) -> None:
    with cas_ckpt.open(tmp_path / "repo") as repo:
        with cas_ckpt.CheckpointManager(repo, "runs/a") as manager:
            for step in (1, 2):
                manager.save(step, {"x": step})
        repo.save({"x": 0}, ref="other")
        rows = repo.graph()
        assert [r.commit.step for r in rows] == [None, 2, 1]
        assert [r.commit.step for r in repo.graph(["runs/a"], limit=1)] == [2]
