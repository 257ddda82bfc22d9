"""Reachability: which blocks a set of roots needs, with the state path that needs each one.

Two ways a block can be reached:

* **data**: through strong links (ext 42) from a ref, pin or live reflog entry. Everything below is
  needed to load the checkpoint. Refs and pins are strong roots: a block missing below one is
  damage. Reflog entries are weak roots: GC keeps what they still reach, but an earlier GC (with a
  shorter expiry) may have removed part of it, and that is an expired record, not damage.
* **lineage**: through a commit's history links (ext 43). Only the commit nodes themselves are
  kept, so ``log`` still shows expired checkpoints without pinning their data.

Raw chunks are leaves: the walk never reads them, it only notes that they are needed. Memory grows
with the number of reachable blocks (one set entry each), never with anything larger.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, MutableSet
from dataclasses import dataclass, field
from typing import Any

from cas_ckpt import cid as cidlib
from cas_ckpt import codec
from cas_ckpt.blocks.base import BlockStore
from cas_ckpt.codec import HistoryLink, Link, Tagged
from cas_ckpt.commit import is_commit
from cas_ckpt.errors import BlockNotFound, CasCkptError, CorruptBlock
from cas_ckpt.tree import BLOB, NDARRAY, PAGES, float_size, join_path


@dataclass(frozen=True)
class Where:
    """Who needs a block: the root's name (a ref, ``pin``, ``reflog:<ref>``) and the state path."""

    root: str
    path: str

    def __str__(self) -> str:
        return f"{self.root}:{self.path or '<root>'}"


@dataclass
class Problem:
    """A reachable block that is missing, corrupt or undecodable."""

    cid: str
    kind: str  # "missing" | "corrupt" | "undecodable"
    detail: str
    needed_by: list[Where] = field(default_factory=list)


@dataclass
class Reach:
    """The outcome of a walk."""

    data: set[bytes] = field(default_factory=set)
    lineage: set[bytes] = field(default_factory=set)
    problems: dict[bytes, Problem] = field(default_factory=dict)
    where: dict[bytes, Where] = field(default_factory=dict)
    track_where: bool = True

    @property
    def live(self) -> set[bytes]:
        return self.data | self.lineage


def child_links(value: Any, path: str = "") -> Iterator[tuple[Link, str]]:
    """Every link in a decoded node with the state path it sits at (chunks as ``path[i]``)."""
    stack: list[tuple[Any, str]] = [(value, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, Link):
            yield item, where
        elif isinstance(item, dict):
            stack.extend((v, join_path(where, k)) for k, v in reversed(list(item.items())))
        elif isinstance(item, list):
            stack.extend((v, join_path(where, i)) for i, v in reversed(list(enumerate(item))))
        elif isinstance(item, Tagged):
            if item.code in (NDARRAY, BLOB, PAGES) and isinstance(item.value, dict):
                yield from _sequence_links(item.value, where)
            else:
                stack.append((item.value, where))


def float_chunks(value: Any) -> dict[bytes, int]:
    """The chunks of float arrays a decoded node lists, with their element size (compression
    groups their bytes by it)."""
    found: dict[bytes, int] = {}
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, Tagged):
            header = item.value
            if item.code == NDARRAY and isinstance(header, dict) and isinstance(header.get("dtype"), str):
                size = float_size(header["dtype"])
                chunks = header.get("chunks")
                if size and isinstance(chunks, list):
                    found.update((link.cid, size) for link in chunks if isinstance(link, Link))
            else:
                stack.append(header)
    return found


def _sequence_links(header: dict[Any, Any], where: str) -> Iterator[tuple[Link, str]]:
    """Links of an array's or blob's chunks, or of a container's pages: ``path[i]``."""
    for key in ("chunks", "chunk_pages", "pages"):
        links = header.get(key)
        if isinstance(links, list):
            for i, link in enumerate(links):
                if isinstance(link, Link):
                    # Pages continue their container: their entries keep the container's path.
                    yield link, f"{where}[{i}]" if key == "chunks" else where


def walk(
    store: BlockStore,
    roots: dict[bytes, str],
    *,
    weak: dict[bytes, str] | None = None,
    check_raw: bool = False,
    progress: Callable[[int], None] | None = None,
    reach: Reach | None = None,
    nodes: Callable[[bytes], Any] | None = None,
    marks: MutableSet[bytes] | None = None,
    where: bool = True,
) -> Reach:
    """Mark everything ``roots`` (binary CID -> root name) reach; record problems, never raise.

    ``weak`` roots (reflog entries) keep what is still there: a block missing below one is an
    expired record, not a problem. They are walked after the strong ones, so a block both need is
    always judged as the strong root needs it. ``check_raw`` also checks that raw chunks exist
    (fsck); GC does not need to. ``reach``: an earlier walk's, to go on from (what it marked is
    not walked again). ``nodes``: a stored node, decoded, where known without reading its block
    (None: read it); what it gives must hold the links the block holds. ``marks``: the set to mark
    data blocks in (``Reach.data``; GC passes its store's compact one). ``where=False`` records
    the path needing each block only for problems (``Reach.where`` stays empty: GC's memory then
    holds no object per block). ``marks`` and ``where`` apply to a new walk, not one ``reach``
    goes on from.
    """
    if reach is None:
        reach = Reach(data=set() if marks is None else marks)  # type: ignore[arg-type]
        reach.track_where = where
    counter = _Counter(progress)
    read = _Reader(store, nodes)
    _mark(read, reach, roots, strong=True, check_raw=check_raw, counter=counter)
    if weak:
        _mark(read, reach, weak, strong=False, check_raw=check_raw, counter=counter)
    return reach


@dataclass
class _Reader:
    """A walk's nodes, decoded: what ``nodes`` knows first, else the store's block (verified)."""

    store: BlockStore
    nodes: Callable[[bytes], Any] | None

    def __call__(self, cid: bytes) -> Any:
        node = self.nodes(cid) if self.nodes is not None else None
        return node if node is not None else codec.decode(self.store.get(cid, verify=True), cid=cid)


@dataclass
class _Counter:
    progress: Callable[[int], None] | None
    visited: int = 0

    def tick(self) -> None:
        self.visited += 1
        if self.progress is not None and self.visited % 1024 == 0:
            self.progress(self.visited)


def _mark(
    read: _Reader,
    reach: Reach,
    roots: dict[bytes, str],
    *,
    strong: bool,
    check_raw: bool,
    counter: _Counter,
) -> None:
    # (cid, root name, path, data?) ; data=False means lineage-only
    stack: list[tuple[bytes, str, str, bool]] = [(c, name, "", True) for c, name in roots.items()]
    while stack:
        cid, root, path, data = stack.pop()
        seen = reach.data if data else reach.lineage
        if cid in seen or (not data and cid in reach.data):
            continue
        seen.add(cid)
        if reach.track_where:
            reach.where.setdefault(cid, Where(root, path))
        counter.tick()
        if not cidlib.is_node(cid):
            if check_raw and strong and not read.store.has(cid):
                _problem(reach, cid, "missing", "block not found", Where(root, path))
            continue
        node = _read_node(read, reach, cid, Where(root, path), strong=strong)
        if node is None:
            continue
        top = is_commit(node)  # a commit's tree starts the state paths afresh
        for link, where in child_links(node, "" if top else path):
            if isinstance(link, HistoryLink):
                stack.append((link.cid, root, "<history>", False))
            elif data:
                stack.append((link.cid, root, "" if top else where, True))


def _read_node(read: _Reader, reach: Reach, cid: bytes, where: Where, *, strong: bool) -> Any:
    try:
        return read(cid)
    except BlockNotFound:
        if where.path == "<history>" or not strong:
            return None  # lineage past a collected commit, or data an earlier GC expired
        _problem(reach, cid, "missing", "block not found", where)
    except CorruptBlock as exc:
        _problem(reach, cid, "corrupt", str(exc), where)
    except CasCkptError as exc:
        _problem(reach, cid, "undecodable", str(exc), where)
    return None


def _problem(reach: Reach, cid: bytes, kind: str, detail: str, where: Where) -> None:
    problem = reach.problems.get(cid)
    if problem is None:
        problem = reach.problems[cid] = Problem(cidlib.to_str(cid), kind, detail)
    problem.needed_by.append(where)


def data_blocks(store: BlockStore, root: bytes) -> Iterator[bytes]:
    """Blocks needed to load ``root``, each once, parents before children (export order)."""
    seen: set[bytes] = set()
    stack = [root]
    while stack:
        cid = stack.pop()
        if cid in seen:
            continue
        seen.add(cid)
        yield cid
        if cidlib.is_node(cid):
            node = codec.decode(store.get(cid), cid=cid)
            children = [link.cid for link, _ in child_links(node) if type(link) is Link]
            stack.extend(reversed(children))
