"""What the browser view shows, as JSON values: runs, history graphs, metrics, trees, tensor
statistics, diffs and storage.

Read only: nothing here writes to the repository, takes its lock or moves a ref. Every method
blocks (the HTTP layer runs it on its own threads, never on the event loop). Anything keyed by a
CID is cached without expiry, since a CID names one content for ever; what depends on refs is
keyed by the refs it read, so a new save is seen at the next request.
"""

from __future__ import annotations

import collections
import dataclasses
import re
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import Any, Generic, TypeVar

from multiformats import CID

from cas_ckpt import cid as cidlib
from cas_ckpt import codec
from cas_ckpt.blocks.base import BlockStore
from cas_ckpt.codec import HistoryLink, Link, Tagged
from cas_ckpt.commit import Commit
from cas_ckpt.errors import (
    BlockNotFound,
    CasCkptError,
    CheckpointExpired,
    DecodeError,
    PathNotFound,
    RefNotFound,
)
from cas_ckpt.grid import state_root
from cas_ckpt.maintenance.describe import describe_leaf, jsonable, value_group
from cas_ckpt.maintenance.diff import _leaves_below, _short, leaves
from cas_ckpt.maintenance.lanes import GraphRow, ancestry, layout
from cas_ckpt.maintenance.tensors import change_norms, is_array, tensor_stats
from cas_ckpt.maintenance.usage import Usage
from cas_ckpt.maintenance.walk import child_links
from cas_ckpt.refs.base import run_of
from cas_ckpt.repository import Repository
from cas_ckpt.tree import BLOB, NDARRAY, TreeReader

PAGE = 100  # rows of a table page unless the request asks for another number
MAX_PAGE = 1000
REFRESH = 1.0  # seconds between looks for packs other processes published

T = TypeVar("T")


class BadRequest(ValueError):
    """A request the API cannot answer as asked (HTTP 400)."""


class Browser:
    """The browser view's data over one open repository (thread-safe)."""

    def __init__(self, repo: Repository) -> None:
        self.repo = repo
        self.links = LinkCache(repo.blocks)
        self._commits: dict[bytes, Commit | None] = {}
        self._leaves: _Lru[bytes, dict[str, Any]] = _Lru(8)
        self._reach: _Lru[frozenset[bytes], set[bytes]] = _Lru(4)  # each up to every block's CID
        self._graphs: _Lru[Hashable, list[GraphRow]] = _Lru(8)
        self._related: _Lru[Hashable, list[str]] = _Lru(16)
        self._metrics: _Lru[Hashable, dict[str, Any]] = _Lru(8)
        self._lineages: _Lru[Hashable, Lineage] = _Lru(4)
        # each run's first reflog entry (time, message): read once while the run exists (a
        # reflog grows by a line a save; its first line stays)
        self._created: dict[str, tuple[float, str] | None] = {}
        self._json: dict[bytes, tuple[bytes, dict[str, Any]]] = {}
        self._diffs: _Lru[Hashable, list[tuple[str, Any, Any]]] = _Lru(8)
        self._storage: tuple[Hashable, Usage] | None = None
        self._storage_lock = threading.Lock()
        self._refreshed = 0.0

    # -- plumbing ------------------------------------------------------------------------------
    def _fresh(self) -> None:
        """See packs other processes published (at most once a second)."""
        now = time.monotonic()
        if now - self._refreshed > REFRESH:
            self.repo.blocks.refresh()
            self._refreshed = now

    def _reader(self) -> TreeReader:
        return TreeReader(self.repo.blocks, self.repo.pool)

    def commit(self, cid: CID | bytes) -> Commit | None:
        """The commit ``cid`` names (cached: a commit never changes); None where it is gone or
        the node is not a commit."""
        key = cidlib.to_bytes(cid)
        if key not in self._commits:
            try:
                found: Commit | None = self.repo.commit(key)
            except (BlockNotFound, DecodeError):
                found = None
            if found is None:
                return None  # not cached: a commit missing now may be published later
            if len(self._commits) > 500_000:
                self._commits.clear()
            self._commits[key] = found
        return self._commits[key]

    def _line(self, head: CID | bytes) -> Iterator[Commit]:
        """``head``'s first-parent history, newest first (as ``repo.log``, from the cache)."""
        seen: set[bytes] = set()
        key = bytes(head)
        commit = self.commit(key)
        while commit is not None and key not in seen:
            seen.add(key)
            yield commit
            key = bytes(commit.parents[0]) if commit.parents else b""
            commit = self.commit(key) if key else None

    def _line_keys(self, head: CID | bytes) -> set[bytes]:
        return {bytes(c.cid) for c in self._line(head)}

    def _commit_json(self, commit: Commit) -> dict[str, Any]:
        key = bytes(commit.cid)
        found = self._json.get(key)
        if found is None:
            tree = bytes(commit.tree)
            found = (tree, {"cid": cidlib.to_str(key), "tree": cidlib.to_str(tree),
                            "parents": [_text(p) for p in commit.parents], "step": commit.step,
                            "time": commit.time, "message": commit.message,
                            "metrics": jsonable(metrics_of(commit))})
            if len(self._json) > 500_000:
                self._json.clear()
            self._json[key] = found
        return {**found[1], "expired": not self.repo.blocks.has(found[0])}

    def _refs(self) -> dict[str, CID]:
        self._fresh()
        return self.repo.refs()

    # -- the repository --------------------------------------------------------------------------
    def overview(self) -> dict[str, Any]:
        config = self.repo.config
        return {"location": self.repo.location, "hash": config.hash, "chunk_size": config.chunk_size,
                "compression": config.compression, "read_only": self.repo.read_only}

    # -- runs ----------------------------------------------------------------------------------
    def runs(
        self, *, prefix: str = "", offset: int = 0, limit: int = PAGE, every: bool = False
    ) -> dict[str, Any]:
        """Runs (or every ref, ``every``) starting with ``prefix``: head commit, retained steps,
        and storage once it has been worked out (see :meth:`storage`)."""
        refs = self._refs()
        members: dict[str, list[str]] = collections.defaultdict(list)
        for name in refs:
            members[run_of(name)].append(name)
        names = sorted(n for n in (refs if every else members) if n.startswith(prefix))
        report = self._storage_ready(refs)
        by_run = {r.run: r for r in report.runs} if report else {}
        page = _page(names, offset, limit)
        lineage = self._lineage_of(refs) if any(run_of(n) == n for n in page) else None
        rows = []
        for name in page:
            run = run_of(name)
            head = refs.get(name) or refs[max(members[run])]
            commit = self.commit(head)
            usage = by_run.get(run) if name == run else None
            fork = lineage.parents.get(run) if lineage and name == run else None
            rows.append({
                "ref": name, "run": run, "cid": _text(head),
                "commit": self._commit_json(commit) if commit else None,
                "steps_kept": sum(1 for n in members[run] if n != run),
                "stored_bytes": usage.stored_bytes if usage else None,
                "exclusive_bytes": usage.exclusive_bytes if usage else None,
                "parent": fork.run if fork else None,
                "fork_step": fork.step if fork else None,
                "fork_cid": _text(fork.cid) if fork else None,
            })
        return {"total": len(names), "offset": offset, "rows": rows, "storage_ready": report is not None}

    # -- which run came from which ----------------------------------------------------------------
    def _lineage_of(self, refs: dict[str, CID]) -> Lineage:
        return self._lineages.get(_refs_key(refs), lambda: self._lineage(refs))

    def _lineage(self, refs: dict[str, CID]) -> Lineage:
        """Each run's parent run and fork point, and the runs whose first-parent line holds
        each commit. A run's ref created by a fork (its reflog's first entry reads ``fork
        from SOURCE``) names its parent; else the parent is the run that existed first (the
        older first reflog entry) among those sharing the newest commit of its line that
        another run's line holds (a fork's, a merge's or a continued run's parent)."""
        members: dict[str, list[str]] = collections.defaultdict(list)
        for name in refs:
            members[run_of(name)].append(name)
        heads = {run: refs.get(run) or refs[max(names)] for run, names in members.items()}
        lines = {run: [bytes(c.cid) for c in self._line(head)] for run, head in sorted(heads.items())}
        owners: dict[bytes, list[str]] = collections.defaultdict(list)
        for run, line in lines.items():
            for key in line:
                owners[key].append(run)
        first = self._created
        for gone in [run for run in list(first) if run not in heads]:  # deleted: made anew, if ever
            first.pop(gone, None)

        def created(run: str) -> tuple[float, str] | None:  # the first reflog entry: time, message
            if run not in first:
                try:
                    entries = self.repo.refs_store.reflog(run if run in refs else max(members[run]))
                except (CasCkptError, OSError):  # no reflog to read: history decides
                    entries = []
                first[run] = (entries[0].time, entries[0].message) if entries else None
            return first[run]

        def next_time(run: str, key: bytes) -> float:  # the time of ``run``'s commit after ``key``
            line = lines[run]
            at = line.index(key)
            commit = self.commit(line[at - 1]) if at else None
            return commit.time if commit is not None else float("-inf")

        def older(other: str, run: str, key: bytes) -> bool:
            mine, theirs = created(run), created(other)
            if mine is not None and theirs is not None and mine[0] != theirs[0]:
                return theirs[0] < mine[0]
            return (next_time(other, key), other) < (next_time(run, key), run)

        parents: dict[str, Fork] = {}
        for run, line in lines.items():
            found = created(run)
            forked = found is not None and found[1].startswith("fork from ")
            source = found[1].removeprefix("fork from ") if found and forked else None
            named = run_of(re.split(r"[~@]", source)[0]) if source else None
            if named in lines and named != run:  # the fork's own record of where it came from
                key = next((k for k in line if named in owners[k]), None)
                if key is not None:
                    parents[run] = self._fork(named, key)
                    continue
            for key in line:
                candidates = [o for o in owners[key] if o != run and older(o, run, key)]
                if candidates:
                    parent = min(candidates, key=lambda o: (created(o) or (float("inf"), ""))[0])
                    parents[run] = self._fork(parent, key)
                    break
        return Lineage(parents, owners)

    def _fork(self, run: str, key: bytes) -> Fork:
        commit = self.commit(key)
        return Fork(run, key, commit.step if commit is not None else None)

    def _run_of_commit(self, target: str, cid: CID, refs: dict[str, CID]) -> str | None:
        """The run a checkpoint belongs to: the run of ``target`` when it names a ref, else the
        run that wrote it (of the runs whose first-parent line holds it, the one whose parent is
        not among them: a fork's parent owns the commits before the fork)."""
        if target in refs:
            return run_of(target)
        base = re.split(r"[~@]", target)[0]
        if base in refs and base != target:
            return run_of(base)
        lineage = self._lineage_of(refs)
        holders = lineage.owners.get(bytes(cid), [])
        roots = [r for r in holders if r not in lineage.parents or lineage.parents[r].run not in holders]
        return min(roots or holders, default=None)

    # -- history -------------------------------------------------------------------------------
    def heads(self, refs: list[str] | None, run: str | None) -> list[str]:
        """The refs a graph draws: ``refs`` as given; ``run`` and every run sharing history
        with it; else every run."""
        known = self._refs()
        for name in [*(refs or []), *([run] if run else [])]:
            if name not in known:
                raise RefNotFound(name)
        if refs:
            return list(dict.fromkeys(refs))
        runs = sorted({run_of(n) for n in known} & set(known))
        if run is None:
            return runs

        def related() -> list[str]:
            ours = {bytes(c.cid) for c in ancestry([known[run]], self.commit)}
            return [run, *(other for other in runs if other != run
                           and not ours.isdisjoint(self._line_keys(known[other])))]

        return self._related.get((_refs_key(known), run), related)

    def graph(self, names: list[str], *, offset: int = 0, limit: int = PAGE) -> dict[str, Any]:
        """The commit graph of the refs ``names`` (see :meth:`heads`), a page of rows: each with
        its commit, lane, lines to the next row, and the lines from the row above (``above``), so
        a page draws on its own."""
        known = self._refs()
        heads = tuple((name, known[name]) for name in names)
        rows = self._graphs.get(heads, lambda: self._layout([c for _, c in heads]))
        labels: dict[CID, list[str]] = collections.defaultdict(list)
        kept: set[CID] = set()
        for name, cid in known.items():
            if run_of(name) == name:
                labels[cid].append(name)
            kept.add(cid)
        out = []
        for i in range(*_window(offset, limit, len(rows)).indices(len(rows))):
            row = rows[i]
            out.append({**self._commit_json(row.commit), "refs": sorted(labels.get(row.commit.cid, [])),
                        "kept": row.commit.cid in kept, "column": row.column, "color": row.color,
                        "edges": row.edges, "above": rows[i - 1].edges if i else [],
                        "children": row.children, "merge": row.merge})
        width = max((max([r.column, *(max(s, e) for s, e, _ in r.edges)]) for r in rows), default=0) + 1
        return {"refs": list(names), "total": len(rows), "offset": offset, "width": width, "rows": out}

    def _layout(self, heads: list[CID]) -> list[GraphRow]:
        """The graph of ``heads``, each commit coloured by the first head whose first-parent
        line holds it (as the metric charts colour that head's series); others after them."""
        lines = [self._line_keys(head) for head in heads]

        def run_color(commit: Commit) -> int:
            key = bytes(commit.cid)
            return next((i for i, line in enumerate(lines) if key in line), len(lines))

        return layout(ancestry(heads, self.commit), run_color)

    def metrics(self, names: list[str]) -> dict[str, Any]:
        """Every metric the commits of each ref's first-parent history carry, against step,
        oldest first: ``series[i]`` has ``steps`` and, per metric, ``values`` in step with them
        (None where a commit lacks the metric; NaN and infinities as "nan", "inf", "-inf")."""
        known = self._refs()
        for name in names:
            if name not in known:
                raise RefNotFound(name)
        heads = tuple((name, known[name]) for name in names)
        return self._metrics.get(heads, lambda: self._metric_series(heads))

    def _metric_series(self, heads: tuple[tuple[str, CID], ...]) -> dict[str, Any]:
        series, found = [], set()
        for name, head in heads:
            line = [c for c in reversed(list(self._line(head))) if c.step is not None]
            values = [metrics_of(c) for c in line]
            names = sorted({m for v in values for m in v})
            found.update(names)
            series.append({"ref": name, "steps": [c.step for c in line],
                           "values": {m: [jsonable(v[m]) if m in v else None for v in values]
                                      for m in names}})
        return {"metrics": sorted(found), "series": series}

    def at_step(self, ref: str, step: int) -> CID:
        """The newest commit of ``ref``'s first-parent history at ``step`` (a chart's point)."""
        known = self._refs()
        if ref not in known:
            raise RefNotFound(ref)
        found = next((c.cid for c in self._line(known[ref]) if c.step == step), None)
        if found is None:
            raise PathNotFound(f"step {step}", ref, detail=f"no commit of {ref} is at step {step}")
        return found

    # -- one checkpoint ------------------------------------------------------------------------
    def _target(self, target: str) -> tuple[CID, Commit | None, bytes]:
        """The CID ``target`` names, its commit (None: a bare tree), and its tree."""
        self._fresh()
        cid = self.repo.resolve(target)
        commit = self.commit(cid)
        if commit is None and not self.repo.blocks.has(cid):
            raise BlockNotFound(_text(cid))
        return cid, commit, state_root(self._reader(), bytes(commit.tree) if commit else cidlib.to_bytes(cid))

    def _leaf_map(self, tree: bytes) -> dict[str, Any]:
        return self._leaves.get(tree, lambda: leaves(self._reader(), Link(tree)))

    def checkpoint(self, target: str) -> dict[str, Any]:
        """A checkpoint's commit, the refs that hold it, and how many values its tree holds."""
        cid, commit, tree = self._target(target)
        expired = commit is not None and self.repo.expired(commit)
        holders = sorted(name for name, head in self._refs().items() if head == cid)
        return {"cid": _text(cid), "tree": cidlib.to_str(tree),
                "commit": self._commit_json(commit) if commit else None, "refs": holders,
                "expired": expired, "values": None if expired else len(self._leaf_map(tree))}

    def tree(
        self, target: str, *, ref: str | None = None, query: str = "", changed: bool = False,
        offset: int = 0, limit: int = PAGE,
    ) -> dict[str, Any]:
        """A page of a checkpoint's values (paths containing ``query``; ``changed``: only those
        that differ from its parent's), each with its bytes: logical, stored (on the medium,
        distinct chunks), new in this checkpoint (chunks its parent lacks), shared with the
        parent (these two None when GC collected the parent's data) and shared with other refs
        (every ref outside ``ref``'s run; without ``ref``, outside the run of the first ref that
        holds this checkpoint)."""
        cid, commit, tree = self._target(target)
        if commit is not None and self.repo.expired(commit):
            raise CheckpointExpired(_text(cid), commit.tree)
        values = self._leaf_map(tree)
        parent = self._parent_tree(commit)
        parent_values = self._leaf_map(parent) if parent else {}
        needle = query.lower()
        paths = [p for p, leaf in values.items() if needle in p.lower()
                 and not (changed and parent_values.get(p) == leaf)]
        parent_blocks = self._reach_of([parent]) if parent else set()
        unknown = parent is None and commit is not None and bool(commit.parents)  # its data collected
        known = self._refs()
        if ref is None:  # the run of the first ref that holds it, if any
            ref = next((name for name, head in sorted(known.items()) if head == cid), None)
        others = [head for name, head in known.items() if ref is None or run_of(name) != run_of(ref)]
        other_blocks = self._reach_of(cidlib.to_bytes(h) for h in others)
        reader = self._reader()
        rows = []
        for path in _page(paths, offset, limit):
            leaf = values[path]
            row = jsonable(describe_leaf(path, leaf))
            chunks = set(_chunks(reader, leaf))
            size = self._stored
            row.update(inline=not chunks and is_array(leaf),
                       stored_bytes=sum(map(size, chunks)),
                       new_bytes=None if unknown else sum(size(c) for c in chunks if c not in parent_blocks),
                       parent_bytes=None if unknown else sum(size(c) for c in chunks if c in parent_blocks),
                       other_bytes=sum(size(c) for c in chunks if c in other_blocks),
                       changed=bool(parent) and parent_values.get(path) != leaf,
                       tensor=is_array(leaf))
            rows.append(row)
        return {"cid": _text(cid), "total": len(paths), "offset": offset, "rows": rows,
                "parent_tree": cidlib.to_str(parent) if parent else None, "parent_expired": unknown}

    def _stored(self, cid: bytes) -> int:
        """Bytes ``cid`` takes on the medium (0 if it is gone meanwhile)."""
        try:
            return self.repo.blocks.stored_size(cid)
        except BlockNotFound:
            return 0

    def _parent_tree(self, commit: Commit | None) -> bytes | None:
        """The tree of ``commit``'s first parent, if its data is still there."""
        parent = self.commit(commit.parents[0]) if commit and commit.parents else None
        if parent is None or self.repo.expired(parent):
            return None
        return state_root(self._reader(), bytes(parent.tree))

    def _reach_of(self, roots: Iterable[bytes]) -> set[bytes]:
        key = frozenset(roots)
        return self._reach.get(key, lambda: self.links.reach(key))

    def stats(self, target: str, path: str) -> dict[str, Any]:
        """The statistics of the tensor at ``path`` (a path as :meth:`tree` lists it)."""
        cid, commit, tree = self._target(target)
        if commit is not None and self.repo.expired(commit):
            raise CheckpointExpired(_text(cid), commit.tree)
        leaf = self._leaf_map(tree).get(path)
        if leaf is None:
            raise PathNotFound(path, _text(cid))
        if not is_array(leaf):
            raise BadRequest(f"{path} is not a tensor")
        return jsonable(tensor_stats(self._reader(), path, leaf))

    # -- two checkpoints -----------------------------------------------------------------------
    def diff(self, a: str, b: str, *, path: str | None = None, order: str = "given") -> dict[str, Any]:
        """What changed from ``a`` to ``b``: paths added and removed, values changed (arrays of
        one shape get norms from :meth:`diff_norms`), each with its group (model, optimizer,
        other: :func:`value_group`), and the bytes the two share. Each side (``side_a``,
        ``side_b``) with its run, step and time. ``order="older"``: from the older checkpoint
        to the newer (commit time, then step), whichever was given first (``swapped`` says)."""
        if order not in ("given", "older"):
            raise BadRequest("order must be 'given' or 'older'")
        side_a, side_b = self._live(a), self._live(b)
        swapped = order == "older" and _newer(side_a[1], side_b[1])
        if swapped:
            a, b, side_a, side_b = b, a, side_b, side_a
        (cid_a, commit_a, tree_a), (cid_b, commit_b, tree_b) = side_a, side_b
        refs = self._refs()
        changed = self._changed(tree_a, tree_b, path)
        reader = self._reader()
        left, right = self._below(tree_a, path), self._below(tree_b, path)
        reach_a, reach_b = self._reach_of([tree_a]), self._reach_of([tree_b])
        size = self.repo.blocks.size
        rows = []
        for where, old, new in changed:
            if _comparable(old, new):
                detail = "array values changed"
                if old.value.get("dtype") != new.value.get("dtype"):
                    detail = f"array {old.value.get('dtype')} -> {new.value.get('dtype')}"
                rows.append({"path": where, "tensor": True, "detail": detail,
                             "group": value_group(where, _dtype_of(where, new))})
            else:
                rows.append({"path": where, "tensor": False,
                             "group": value_group(where, _dtype_of(where, new)),
                             "detail": f"{_short(reader, old)} -> {_short(reader, new)}"})
        return {"a": _text(cid_a), "b": _text(cid_b), "path": path, "swapped": swapped,
                "side_a": self._side(a, cid_a, commit_a, refs),
                "side_b": self._side(b, cid_b, commit_b, refs),
                "added": [p for p in right if p not in left],
                "removed": [p for p in left if p not in right], "changed": rows,
                "unchanged": sum(1 for p in left if p in right and left[p] == right[p]),
                "a_bytes": sum(map(size, reach_a)), "b_bytes": sum(map(size, reach_b)),
                "shared_bytes": sum(map(size, reach_a & reach_b))}

    def diff_norms(self, a: str, b: str, *, path: str | None = None, offset: int = 0,
                   limit: int = PAGE) -> dict[str, Any]:
        """``‖a-b‖/‖a‖``, ``‖a-b‖``, ``‖a‖`` and the largest ``|a-b|`` of a page of the changed
        tensors :meth:`diff` lists (in its order), streamed from both sides' chunks."""
        (_, _, tree_a), (_, _, tree_b) = self._live(a), self._live(b)
        tensors = [(p, old, new) for p, old, new in self._changed(tree_a, tree_b, path)
                   if _comparable(old, new)]
        reader = self._reader()
        rows = []
        for where, old, new in _page(tensors, offset, limit):
            norms = change_norms(reader, old, new)
            rows.append(jsonable({"path": where, "relative": norms.relative, "l2": norms.l2,
                                  "a_norm": norms.a_norm, "max_abs": norms.max_abs}))
        return {"total": len(tensors), "offset": offset, "rows": rows}

    def _side(self, target: str, cid: CID, commit: Commit | None, refs: dict[str, CID]) -> dict[str, Any]:
        return {"cid": _text(cid), "run": self._run_of_commit(target, cid, refs) if commit else None,
                "step": commit.step if commit else None, "time": commit.time if commit else None}

    def _live(self, target: str) -> tuple[CID, Commit | None, bytes]:
        cid, commit, tree = self._target(target)
        if commit is not None and self.repo.expired(commit):
            raise CheckpointExpired(_text(cid), commit.tree)
        return cid, commit, tree

    def _below(self, tree: bytes, path: str | None) -> dict[str, Any]:
        if not path:
            return self._leaf_map(tree)
        return _leaves_below(self._reader(), tree, path)

    def _changed(self, tree_a: bytes, tree_b: bytes, path: str | None) -> list[tuple[str, Any, Any]]:
        def work() -> list[tuple[str, Any, Any]]:
            left, right = self._below(tree_a, path), self._below(tree_b, path)
            if path and not left and not right:
                raise PathNotFound(path, cidlib.to_str(tree_a))
            return [(p, left[p], right[p]) for p in left if p in right and left[p] != right[p]]

        return self._diffs.get((tree_a, tree_b, path), work)

    # -- health and storage --------------------------------------------------------------------
    def nonfinite(self, ref: str, *, path: str | None = None) -> dict[str, Any]:
        """The first checkpoint of ``ref``'s history holding a NaN or an infinity."""
        self._fresh()
        report = self.repo.find_nonfinite(ref, path=path)
        return {"found": report.found, "message": report.message(), **jsonable(report)}

    def storage(self) -> dict[str, Any]:
        """Bytes per run (stored, shared with other runs, pins or history, and exclusive: what
        deleting the run would free) and what GC would free now: ``repo.stats()``, worked out
        once per state of the refs and pins."""
        refs = self._refs()
        with self._storage_lock:
            report = self._storage_ready(refs)
            if report is None:
                key = self._storage_key(refs)
                report = self.repo.stats()
                self._storage = (key, report)
        heads = {run_of(name): name for name in refs if run_of(name) == name}
        runs = [{**jsonable(r), "head": _text(refs[heads[r.run]]) if r.run in heads else None}
                for r in report.runs]
        return {"runs": runs, "stored_bytes": report.stored_bytes, "logical_bytes": report.logical_bytes,
                "total_bytes": report.total_bytes, "total_blocks": report.total_blocks,
                "unreachable_bytes": report.unreachable_bytes,
                "unreachable_blocks": report.unreachable_blocks, "freeable_bytes": report.freeable_bytes,
                "reflog_expiry": report.reflog_expiry}

    def _storage_key(self, refs: dict[str, CID]) -> Hashable:
        return tuple(sorted((n, bytes(c)) for n, c in refs.items())), tuple(map(bytes, self.repo.pins()))

    def _storage_ready(self, refs: dict[str, CID]) -> Usage | None:
        found = self._storage
        if found is not None and found[0] == self._storage_key(refs):
            return found[1]
        return None


def _refs_key(refs: dict[str, CID]) -> tuple[tuple[str, bytes], ...]:
    return tuple(sorted((name, bytes(cid)) for name, cid in refs.items()))


def _text(cid: CID | bytes) -> str:
    """A CID's base32 text (``str(CID)`` takes half a millisecond: thousands of commits add up)."""
    return cidlib.to_str(cidlib.to_bytes(cid))


def metrics_of(commit: Commit) -> dict[str, float | int]:
    """A commit's numeric metrics: ``metadata["metrics"]`` (a manager's), else its metadata's
    numbers."""
    metadata = commit.metadata
    values = metadata.get("metrics") if isinstance(metadata.get("metrics"), dict) else metadata
    return {k: v for k, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def _newer(a: Commit | None, b: Commit | None) -> bool:
    """True if commit ``a`` is newer than ``b`` (time, then step); False where either is none."""
    if a is None or b is None:
        return False
    return (a.time, a.step if a.step is not None else -1) > (b.time, b.step if b.step is not None else -1)


def _dtype_of(path: str, leaf: Any) -> str:
    """A leaf's dtype for :func:`value_group`: an array's, else "" (no array)."""
    return str(describe_leaf(path, leaf).get("dtype", "")) if is_array(leaf) else ""


@dataclasses.dataclass(frozen=True)
class Fork:
    """Where a run came from: its parent ``run`` and the commit (``cid``, ``step``) it shares
    last with it."""

    run: str
    cid: bytes
    step: int | None


@dataclasses.dataclass(frozen=True)
class Lineage:
    """Each run's :class:`Fork` (runs sharing no history with an older run have none) and, for
    each commit, the runs whose first-parent line holds it."""

    parents: dict[str, Fork]
    owners: dict[bytes, list[str]]


def _comparable(old: Any, new: Any) -> bool:
    return _is_ndarray(old) and _is_ndarray(new) and old.value.get("shape") == new.value.get("shape")


def _is_ndarray(value: Any) -> bool:
    return isinstance(value, Tagged) and value.code == NDARRAY and isinstance(value.value, dict)


def _chunks(reader: TreeReader, leaf: Any) -> list[bytes]:
    """The blocks an array's or a blob's bytes lie in (none when inline)."""
    if isinstance(leaf, Tagged) and leaf.code in (NDARRAY, BLOB) and isinstance(leaf.value, dict) \
            and "data" not in leaf.value:
        return reader.chunk_links(leaf.value)
    return []


def _page(items: list[T], offset: int, limit: int) -> list[T]:
    return items[_window(offset, limit, len(items))]


def _window(offset: int, limit: int, total: int) -> slice:
    """The rows of a page: ``offset`` >= 0, ``limit`` 1..MAX_PAGE (else :class:`BadRequest`)."""
    if offset < 0 or not 1 <= limit <= MAX_PAGE:
        raise BadRequest(f"offset must be >= 0 and limit 1..{MAX_PAGE}")
    return slice(offset, min(offset + limit, total))


class LinkCache:
    """Each node's data links, decoded once: a CID names one content for ever, so the reach of
    a checkpoint worked out again after a save reads only the new nodes (bounded: emptied past
    ``limit`` nodes)."""

    def __init__(self, store: BlockStore, *, limit: int = 2_000_000) -> None:
        self.store = store
        self.limit = limit
        self._links: dict[bytes, tuple[bytes, ...]] = {}
        self._lock = threading.Lock()

    def links(self, cid: bytes) -> tuple[bytes, ...] | None:
        """The data links of node ``cid`` (history links left out); None where it is not stored."""
        found = self._links.get(cid)
        if found is not None:
            return found
        try:
            node = codec.decode(self.store.get(cid), cid=cid)
        except BlockNotFound:
            return None
        found = tuple(link.cid for link, _ in child_links(node) if not isinstance(link, HistoryLink))
        with self._lock:
            if len(self._links) >= self.limit:
                self._links.clear()
            self._links[cid] = found
        return found

    def reach(self, start: Iterable[bytes]) -> set[bytes]:
        """Every stored block ``start`` reaches through data links (missing blocks left out)."""
        seen: set[bytes] = set()
        stack = list(start)
        while stack:
            cid = stack.pop()
            if cid in seen:
                continue
            if not cidlib.is_node(cid):
                if self.store.has(cid):
                    seen.add(cid)
                continue
            links = self.links(cid)
            if links is None:
                continue
            seen.add(cid)
            stack.extend(c for c in links if c not in seen)
        return seen


K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class _Lru(Generic[K, V]):
    """A few recent results, made by ``make`` on a miss (outside the lock: two threads may make
    the same one at once, to the same value)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._items: collections.OrderedDict[K, V] = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: K, make: Callable[[], V]) -> V:
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return self._items[key]
        value = make()
        with self._lock:
            self._items[key] = value
            while len(self._items) > self.size:
                self._items.popitem(last=False)
        return value
