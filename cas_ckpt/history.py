"""A repository's history: commits read through the commit graph, and the graph kept up to date.

Queries (:meth:`History.log`, :meth:`History.commits`, GC's lineage through :meth:`History.lookup`)
take a commit's node from the graph (:mod:`cas_ckpt.commit_graph`) when a layer holds a copy that
matches its CID *and* the block store still holds the commit, else from the block store: the
answer is the one the blocks give, whatever state the graph is in. A query lists the layers again
(one request on S3) only at the first commit they lack.

Writes keep the cost of a save constant. After a transaction moves refs, :meth:`History.saved`
notes the commits it wrote (their bytes are in hand), walks back from the new heads and from the
graph's frontier through history no layer covers, reading at most :data:`WALK_LIMIT` commits, and
once :data:`GRAPH_EVERY` commits are waiting writes them as a layer (merging layers as
``commit_graph`` says). :func:`update_commit_graph` does the same from every ref and pin without
limits (a repository written by 0.2 is taken in whole), rebuilds around damaged layers, and with
``consolidate`` merges everything into one layer: what upkeep calls.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

from cas_ckpt import cid as cidlib
from cas_ckpt import codec
from cas_ckpt.blocks.base import BlockStore
from cas_ckpt.codec import Link
from cas_ckpt.commit import Commit, is_commit, parse_commit
from cas_ckpt.commit_graph import DIRECTORY, SUFFIX, CommitGraph, Written
from cas_ckpt.errors import BlockNotFound, CasCkptError, DecodeError
from cas_ckpt.refs import RefStore

_log = logging.getLogger("cas_ckpt")

GRAPH_EVERY = 16  # a save writes a layer once this many commits it knows of are in none
WALK_LIMIT = 32  # commit nodes a save reads at most, looking for history no layer covers


@dataclass
class CommitGraphReport:
    """What an update of the commit graph did, and how the graph stands after it."""

    commits_added: int  # commits no layer held before
    commits: int  # commits the graph holds now
    layers: int  # its layers now
    layers_merged: int  # layers rewritten into the new one (and deleted)
    layers_dropped: int  # damaged layers deleted (what they held is in the new layer or read again)
    bytes_written: int
    damaged: dict[str, str]  # damage found before the update (layer -> why), now repaired
    seconds: float


class Lookup:
    """Commit nodes for one query: the graph's copy if it holds one and the store the block,
    else ``None``; the layers are listed again at most once, at the first commit they lack."""

    def __init__(self, history: History, *, listed: bool = False) -> None:
        self.history = history
        self.listed = listed

    def __call__(self, cid: bytes) -> bytes | None:
        graph = self.history.graph
        if graph is None:
            return None
        data = graph.node(cid)
        if data is None and not self.listed:
            self.listed = True
            if self.history.refresh():
                data = graph.node(cid)
        # Only while the store holds it: a commit GC removed reads as gone, as from the blocks.
        return data if data is not None and self.history.blocks.has(cid) else None

    def node(self, cid: bytes) -> bytes:
        """The commit's node, from the graph or the store (BlockNotFound, CorruptBlock)."""
        data = self(cid)
        return data if data is not None else self.history.blocks.get(cid)

    def links(self, cid: bytes) -> dict[str, Any] | None:
        """For walks that follow links only (GC, completeness checks): commit ``cid``'s node
        reduced to its type, tree and parents, from the graph's copy (None where :meth:`__call__`
        gives none). Kept once made: a long-lived repository walks its history again for free."""
        made = self.history._links.get(cid)
        if made is not None:
            return made if self.history.blocks.has(cid) else None
        data = self(cid)
        if data is None:
            return None
        value = codec.decode(data, cid=cid)
        if not is_commit(value):
            return None
        made = {"type": value["type"], "tree": value.get("tree"), "parents": value.get("parents")}
        self.history._links[cid] = made
        return made


class History:
    """The commits of the repository whose blocks are ``blocks``, through its commit graph.

    Thread-safe. Where the store has no place for the graph (``BlockStore.sibling`` is None),
    every commit is read from the store.
    """

    def __init__(self, blocks: BlockStore, pool: Callable[[], Executor]) -> None:
        self.blocks = blocks
        try:
            backend = blocks.sibling(DIRECTORY, SUFFIX)
        except CasCkptError as exc:  # a link where its folder goes: not followed (a failing disk raises)
            _log.warning("%s has no usable place for a commit graph (%s: %s); history is read from "
                         "the commits' blocks", blocks, type(exc).__name__, exc)
            backend = None
        self.graph = None if backend is None else CommitGraph(backend, verify=blocks.verify)
        self._pool = pool
        self._pending: dict[bytes, bytes] = {}  # commits no layer holds, with their nodes
        self._absent: set[bytes] = set()  # frontier commits the store lacks (collected)
        self._links: dict[bytes, dict[str, Any]] = {}  # commits reduced to their links (Lookup.links)
        self._lock = threading.Lock()  # one writer of the graph in this process at a time
        self._warned = False

    def refresh(self) -> bool:
        """List the graph's layers again (True if they changed). A graph that cannot be listed
        or read is a cache missed, not an error: the commits are read from their blocks."""
        if self.graph is None:
            return False
        try:
            return self.graph.refresh()
        except (CasCkptError, OSError) as exc:
            if not self._warned:
                self._warned = True
                _log.warning("cannot read the commit graph of %s (%s: %s); reading commits from "
                             "their blocks", self.blocks, type(exc).__name__, exc)
            return False

    def check(self) -> dict[str, str]:
        """Every damaged layer of the graph (layer -> why), each copy checked against its CID."""
        if self.graph is None:
            return {}
        self.graph.refresh()
        self.graph.copies()  # checks every copy: one that does not match marks its layer
        return dict(self.graph.damaged)

    def set_aside_damaged(self) -> dict[str, str]:
        """:meth:`CommitGraph.set_aside_damaged` (nothing without a graph)."""
        return {} if self.graph is None else self.graph.set_aside_damaged()

    def close(self) -> None:
        """Release the graph's open files (its layers stay read, in memory)."""
        if self.graph is not None:
            self.graph.backend.close()

    # -- queries -------------------------------------------------------------------------------
    def lookup(self, *, listed: bool = False) -> Lookup:
        """A lookup for one query (``listed``: never list the layers again, use what is known)."""
        return Lookup(self, listed=listed)

    def commit(self, cid: bytes, lookup: Lookup | None = None) -> Commit:
        """The commit ``cid`` names: :class:`DecodeError` if it is another node."""
        node = codec.decode((lookup or self.lookup(listed=True)).node(cid), cid=cid)
        if not is_commit(node):
            raise DecodeError("not a commit node", cid=cidlib.to_str(cid))
        return parse_commit(cid, node)

    def parents(self, cid: bytes, lookup: Lookup | None = None) -> list[bytes]:
        """The parents of commit ``cid`` (binary CIDs), without making a :class:`Commit`."""
        parents = _parents(cid, (lookup or self.lookup(listed=True)).node(cid))
        if parents is None:
            raise DecodeError("not a commit node", cid=cidlib.to_str(cid))
        return parents

    def log(self, head: bytes, *, limit: int | None = None) -> Iterator[Commit]:
        """Commits newest first from ``head``, following first parents; stops quietly where history
        was collected, below the head. The head is read at once: :class:`BlockNotFound` if its
        block is gone (damage, never an empty history), even where a graph layer holds a copy."""
        lookup = self.lookup()
        self.commit(head, lookup)  # Lookup gives a graph copy only while the block is stored
        return self._walk(head, lookup, limit)

    def _walk(self, head: bytes, lookup: Lookup, limit: int | None) -> Iterator[Commit]:
        cid: bytes | None = head
        seen: set[bytes] = set()
        while cid is not None and cid not in seen and (limit is None or len(seen) < limit):
            seen.add(cid)
            try:
                commit = self.commit(cid, lookup)
            except BlockNotFound:
                return
            yield commit
            cid = cidlib.to_bytes(commit.parents[0]) if commit.parents else None

    def commits(self, cids: Iterable[bytes]) -> dict[bytes, Commit]:
        """The commits of ``cids`` that can be read, at once: the graph's, then the rest in
        parallel from the store. What cannot be read is left out (reading it alone says why)."""
        lookup = self.lookup()
        wanted = list(dict.fromkeys(cids))
        found: dict[bytes, Commit] = {}
        missing = []
        for cid in wanted:
            if lookup(cid) is None:
                missing.append(cid)
            else:
                with contextlib.suppress(CasCkptError):
                    found[cid] = self.commit(cid, lookup)

        def read(cid: bytes) -> Commit | None:
            try:
                return self.commit(cid, Lookup(self, listed=True))
            except CasCkptError:
                return None

        reads = self._pool().map(read, missing) if len(missing) > 1 else map(read, missing)
        found.update((cid, commit) for cid, commit in zip(missing, reads, strict=True) if commit)
        return {cid: found[cid] for cid in wanted if cid in found}

    # -- keeping the graph up to date ----------------------------------------------------------
    def behind(self) -> bool:
        """Whether :meth:`update` has work, judged from what this process knows (no request): a
        damaged layer, or a stored commit that a layer or a waiting commit names as a parent and
        no layer holds (history older than the graph, which saves do not walk to)."""
        graph = self.graph
        if graph is None or not graph.loaded or self.blocks.read_only:
            return False
        with self._lock:
            if graph.damaged:
                return True
            named = graph.frontier().union(
                *(_parents(c, n) or () for c, n in self._pending.items()))
            return any(cid not in self._pending and cid not in self._absent and not graph.covers(cid)
                       and self.blocks.has(cid) for cid in named)

    def saved(self, heads: Iterable[bytes], written: Mapping[bytes, bytes]) -> None:
        """Refs moved to ``heads``; ``written``: the commit nodes the transaction stored. Takes
        them (and at most :data:`WALK_LIMIT` commits read back from them) into the graph, a layer
        at a time; a failure is logged, never raised: the save is done."""
        graph = self.graph
        if graph is None or self.blocks.read_only:
            return
        try:
            with self._lock:
                if not graph.loaded:
                    graph.refresh()
                self._pending.update((c, n) for c, n in written.items() if not graph.covers(c))
                self._collect([*heads, *sorted(graph.frontier())], WALK_LIMIT)
                if len(self._pending) >= GRAPH_EVERY or graph.damaged:
                    self._write(exact=bool(graph.damaged))
        except (CasCkptError, OSError) as exc:
            _log.warning("could not update the commit graph of %s (%s: %s); history queries read "
                         "the commits it lacks from their blocks", self.blocks, type(exc).__name__, exc)

    def update(self, refs: RefStore, *, consolidate: bool = False) -> CommitGraphReport:
        """Take every commit reachable from a ref or pin into the graph, and rebuild what damaged
        layers held; ``consolidate``: merge all layers into one, leaving out commits GC removed."""
        started = time.perf_counter()
        graph = self.graph
        if graph is None:
            return CommitGraphReport(0, 0, 0, 0, 0, 0, {}, time.perf_counter() - started)
        with self._lock:
            graph.refresh()
            damaged = dict(graph.damaged)
            heads = [*refs.values().values(), *sorted(refs.pins())]
            self._collect([*heads, *self._open_parents()], None)
            written = self._write(exact=False, merge_all=consolidate)
        return CommitGraphReport(
            commits_added=written.new, commits=len(graph), layers=len(graph.layers()),
            layers_merged=len(written.merged), layers_dropped=len(written.dropped),
            bytes_written=written.bytes, damaged=damaged, seconds=time.perf_counter() - started,
        )

    def _collect(self, starts: Iterable[bytes], limit: int | None) -> None:
        """Walk back from ``starts`` through commits no layer holds (reading at most ``limit``),
        into ``_pending``. The walk stops at covered commits; what it leaves stays a frontier."""
        graph = self.graph
        assert graph is not None
        reads = 0
        stack = list(starts)
        seen: set[bytes] = set()
        while stack:
            cid = stack.pop()
            if cid in seen or cid in self._absent or graph.covers(cid) or not cidlib.is_node(cid):
                continue
            seen.add(cid)
            node = self._pending.get(cid)
            if node is None:
                if not self.blocks.has(cid):  # collected (or in a pack this process has not seen)
                    self._absent.add(cid)
                    continue
                if limit is not None and reads >= limit:
                    continue  # left for a later save: its child's layer lists it in the frontier
                reads += 1
                try:
                    node = self.blocks.get(cid)
                except CasCkptError:
                    continue  # missing or damaged now: fsck reports it, the graph has no part in it
            parents = _parents(cid, node)
            if parents is None:
                continue  # not a commit: a ref may name any node
            self._pending[cid] = node
            stack.extend(parents)

    def _write(self, *, exact: bool, merge_all: bool = False) -> Written:
        """Write the pending commits as a layer. ``exact``: recompute the frontier from every
        covered commit (a damaged layer may have held parents nobody lists)."""
        graph = self.graph
        assert graph is not None
        graph.refresh()  # layers other writers published: merged along, and what they hold is done
        if merge_all:
            # After the listing: every commit a listed layer holds was in a published pack before
            # the layer was, so a commit the store lacks now was collected, not unseen.
            self.blocks.refresh()
        pending = {c: n for c, n in self._pending.items() if not graph.covers(c)}
        frontier = {p for c, n in pending.items() for p in _parents(c, n) or () if p not in pending}
        if exact:
            frontier |= self._open_parents()
        keep = self.blocks.has if merge_all else None
        written = graph.write(pending, frontier, merge_all=merge_all, keep=keep)
        self._pending.clear()
        return written

    def _open_parents(self) -> set[bytes]:
        """Parents of covered commits that no layer covers and the store holds, from every copy."""
        graph = self.graph
        assert graph is not None
        parents = {p for c, n in graph.copies().items() for p in _parents(c, n) or ()}
        return {p for p in parents if not graph.covers(p) and self.blocks.has(p)}


def _parents(cid: bytes, node: bytes) -> list[bytes] | None:
    """A commit node's parents (history links); None if ``node`` is not a commit."""
    try:
        value = codec.decode(node, cid=cid)
    except DecodeError:
        return None
    if not is_commit(value):
        return None
    parents = value.get("parents")
    return [p.cid for p in parents if isinstance(p, Link)] if isinstance(parents, list) else []

