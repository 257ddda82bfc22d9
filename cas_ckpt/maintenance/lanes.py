"""The commit graph of several refs, laid out in lanes as ``git log --graph`` draws it.

Commits come newest first, every child before its parents (git's ``--date-order``). Each commit
sits in a lane (a column); a lane waits for the next commit it expects (a parent of the one
above). Two children of one commit (a fork) are two lanes that join where that commit is drawn,
so the fork shows where it happened; a merge opens one lane per further parent. A row carries
the lines from it to the next row, so any run of rows draws on its own (a page of a long log).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from multiformats import CID

from cas_ckpt.commit import Commit


@dataclass
class GraphRow:
    """One commit of the graph: its lane (``column``), the lane's colour (an index into any
    palette), and ``edges``: each line from this row to the next as (column here, column there,
    colour). ``children`` counts the commits drawn above that have it as a parent (two or more: a
    fork point); ``merge`` is True for a commit with several parents in the graph."""

    commit: Commit
    column: int
    color: int
    edges: list[tuple[int, int, int]] = field(default_factory=list)
    children: int = 0

    @property
    def merge(self) -> bool:
        return len(self.commit.parents) > 1


def ancestry(heads: Iterable[CID | bytes], commit_of: Callable[[bytes], Commit | None]) -> list[Commit]:
    """Every commit reachable from ``heads`` through any parent, children before parents and
    otherwise newest first. ``commit_of`` gives None for a commit whose node is gone (history
    collected): the walk stops there."""
    found: dict[bytes, Commit] = {}
    parents: dict[bytes, list[bytes]] = {}
    stack = [bytes(h) for h in heads]
    while stack:
        key = stack.pop()
        if key in found:
            continue
        commit = commit_of(key)
        if commit is None:
            continue
        found[key] = commit
        parents[key] = [bytes(p) for p in commit.parents]
        stack.extend(p for p in parents[key] if p not in found)
    return _date_order(found, parents)


def _date_order(commits: dict[bytes, Commit], parents: dict[bytes, list[bytes]]) -> list[Commit]:
    """Kahn's order: a commit comes once every child of it has; among those ready, newest first.
    (Commits are keyed by their binary CIDs: hashing CID objects cost more than the rest.)"""
    waiting = dict.fromkeys(commits, 0)
    for key in commits:
        for parent in set(parents[key]):
            if parent in waiting:
                waiting[parent] += 1
    ready = [(-c.time, key) for key, c in commits.items() if waiting[key] == 0]
    heapq.heapify(ready)
    order: list[Commit] = []
    while ready:
        _, key = heapq.heappop(ready)
        order.append(commits[key])
        for parent in set(parents[key]):
            if parent in waiting:
                waiting[parent] -= 1
                if waiting[parent] == 0:
                    heapq.heappush(ready, (-commits[parent].time, parent))
    return order


def layout(commits: Sequence[Commit], color_of: Callable[[Commit], int] | None = None) -> list[GraphRow]:
    """Lanes and lines for ``commits`` in the order given (see :func:`ancestry`). Parents not in
    ``commits`` get no line (history collected, or left out).

    Colours: by default each lane has its own and a first parent continues its child's;
    ``color_of`` colours each commit (say, by run) and the lines that leave it with its colour.
    """
    keys = [bytes(c.cid) for c in commits]
    shown = set(keys)
    lanes: list[tuple[bytes, int]] = []  # per column: the commit this lane waits for, its colour
    colors = _Colors()
    rows: list[GraphRow] = []
    expects: list[list[bytes]] = []  # per row: what the lane of each edge waits for
    children: dict[bytes, int] = {}
    for key, commit in zip(keys, commits, strict=True):
        waiting = [j for j, (cid, _) in enumerate(lanes) if cid == key]
        if waiting:
            column, color = waiting[0], lanes[waiting[0]][1]
        else:
            column, color = len(lanes), colors.new()
            lanes.append((key, color))
        if color_of is not None:
            color = color_of(commit)
        parents = [p for p in dict.fromkeys(bytes(p) for p in commit.parents) if p in shown]
        for parent in parents:
            children[parent] = children.get(parent, 0) + 1
        following: list[tuple[bytes, int] | None] = [
            None if j in waiting or j == column else lane for j, lane in enumerate(lanes)
        ]
        origin = {j: j for j, lane in enumerate(following) if lane is not None}
        if parents:
            following[column], origin[column] = (parents[0], color), column
        joins: list[int] = []  # lanes already waiting for a further parent: a line into them
        for parent in parents[1:]:
            there = next((j for j, lane in enumerate(following) if lane and lane[0] == parent), None)
            if there is not None:
                joins.append(there)
                continue
            there = next((j for j, lane in enumerate(following) if lane is None and j != column),
                         len(following))
            if there == len(following):
                following.append(None)
            following[there], origin[there] = (parent, color if color_of else colors.new()), column
        kept = [j for j, lane in enumerate(following) if lane is not None]
        place = {j: i for i, j in enumerate(kept)}
        edges = [(origin[j], place[j], following[j][1]) for j in kept]  # type: ignore[index]
        edges += [(column, place[j], following[j][1]) for j in joins]  # type: ignore[index]
        expects.append([following[j][0] for j in kept] + [following[j][0] for j in joins])  # type: ignore[index]
        rows.append(GraphRow(commit, column, color, edges))
        lanes = [following[j] for j in kept]  # type: ignore[misc]
    for i, row in enumerate(rows[:-1]):  # lines into the next commit end at its node
        below, below_key = rows[i + 1], keys[i + 1]
        row.edges = [(start, below.column if expects[i][k] == below_key else end, color)
                     for k, (start, end, color) in enumerate(row.edges)]
    for key, row in zip(keys, rows, strict=True):
        row.children = children.get(key, 0)
    return rows


class _Colors:
    def __init__(self) -> None:
        self.next = 0

    def new(self) -> int:
        self.next += 1
        return self.next - 1


def passing(rows: Sequence[GraphRow], i: int) -> list[int]:
    """The columns of the lines that pass row ``i`` beside its commit (drawn ``|``)."""
    if i == 0:
        return []
    ends = {end for _, end, _ in rows[i - 1].edges}
    return sorted(ends - {rows[i].column})
