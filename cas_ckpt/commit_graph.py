"""The commit graph: copies of commit nodes in a few files, so history is not read block by block.

A walk through history (``log``, ``REF~N``, GC's lineage, retention's metrics) reads a commit to
learn its parent: on object storage that was one request per commit, one after the other. As git's
commit-graph keeps parents, trees and times of all commits in one file, the commit graph keeps
verbatim copies of commit nodes in *layers*, files beside the packs (``commit-graph/*.graph``) that
a reader fetches whole, a few requests for any history. It is derived data, a cache, never the
truth (``docs/format.md``, "Commit graph"):

* a copy is used only once its bytes hash to its CID: it *is* the commit node, or it is ignored
  (the layer is then reported damaged, and the next write leaves it out);
* a layer is written only after the commits it holds are durable, published atomically under the
  hash of its index (never overwritten but to repair it), and deleted only after a layer holding
  everything it held was published;
* what no layer covers (new commits, repositories written by 0.2, a damaged layer) is read from
  the blocks, as before.

Layers merge as git's split commit-graphs do: a new layer takes in every layer not more than twice
as large as what it holds so far (smallest first), so a history of N commits lies in about
log2(N / 16) layers and each commit is rewritten about as many times over its life.

A layer's *frontier* lists the parents of its commits that no layer covered when it was written
(where its writer stopped walking): a later writer resumes there, so history written before the
graph existed is taken in a bounded number of commits at a time.
"""

from __future__ import annotations

import hashlib
import logging
import struct
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import msgpack

from cas_ckpt import cid as cidlib
from cas_ckpt.backends.base import Backend, Read
from cas_ckpt.errors import CasCkptError, CorruptStore

_log = logging.getLogger("cas_ckpt")

MAGIC = b"CASGRPH1"
FOOTER_MAGIC = b"CASGREND"
FOOTER = struct.Struct("<Q32s8s")  # index length, sha256(index), magic
DIRECTORY = "commit-graph"
SUFFIX = ".graph"
MAX_INDEX = 128 * 1024 * 1024  # an entry takes ~45 bytes: no layer a writer makes comes near this
MERGE_RATIO = 2  # a new layer takes in every layer at most this many times its size so far


class ForeignLayer(CasCkptError):
    """A layer of a later format version: left alone, neither read nor deleted."""


@dataclass(frozen=True)
class Layer:
    """One layer as read: its bytes, where each commit's node lies in them, and its frontier."""

    name: str
    data: bytes
    entries: dict[bytes, tuple[int, int]]  # commit CID -> (offset, length) in ``data``
    frontier: frozenset[bytes]


@dataclass
class Written:
    """What one write of the graph did."""

    name: str | None = None  # the layer published (None: nothing to write)
    commits: int = 0  # commits it holds
    new: int = 0  # of which no layer held before
    merged: list[str] = field(default_factory=list)  # layers it replaced (deleted after it)
    dropped: list[str] = field(default_factory=list)  # damaged layers deleted
    bytes: int = 0


def encode_layer(commits: Mapping[bytes, bytes], frontier: Iterable[bytes]) -> tuple[bytes, str]:
    """A layer's bytes holding ``commits`` (binary CID -> node bytes, in CID order), and its name."""
    pieces, rows, offset = [MAGIC], [], len(MAGIC)
    for cid in sorted(commits):
        node = commits[cid]
        rows.append((cid, offset, len(node)))
        pieces.append(node)
        offset += len(node)
    index = msgpack.packb({"commits": rows, "frontier": sorted(set(frontier))}, use_bin_type=True)
    tail = index + FOOTER.pack(len(index), hashlib.sha256(index).digest(), FOOTER_MAGIC)
    pieces.append(tail)
    return b"".join(pieces), hashlib.sha256(tail).hexdigest() + SUFFIX


def parse_layer(data: bytes, name: str, where: object) -> Layer:
    """Check and read a layer's index; :class:`CorruptStore` naming ``where`` if it is damaged,
    :class:`ForeignLayer` if a later version wrote it. Nodes are checked when used."""
    if len(data) < len(MAGIC) + FOOTER.size:
        raise CorruptStore(where, "not a commit-graph layer (too short)")
    if data[:len(MAGIC)] != MAGIC:
        if data[:len(MAGIC) - 1] == MAGIC[:-1]:
            raise ForeignLayer(f"{where} is a commit-graph layer of a later version")
        raise CorruptStore(where, "not a commit-graph layer (bad header)")
    length, digest, magic = FOOTER.unpack(data[-FOOTER.size:])
    if magic != FOOTER_MAGIC:
        raise CorruptStore(where, "bad commit-graph footer")
    start = len(data) - FOOTER.size - length
    if length > MAX_INDEX or start < len(MAGIC):
        raise CorruptStore(where, f"commit-graph footer claims an index of {length} bytes")
    index = data[start : len(data) - FOOTER.size]
    if hashlib.sha256(index).digest() != digest:
        raise CorruptStore(where, "commit-graph index checksum mismatch")
    try:
        value = msgpack.unpackb(index, raw=False, use_list=False)
        rows, frontier = value["commits"], value["frontier"]
        if not isinstance(rows, tuple) or not isinstance(frontier, tuple):
            raise ValueError("commits and frontier must be arrays")
        entries = {}
        for cid, offset, size in rows:
            if type(offset) is not int or type(size) is not int or not cidlib.is_node(cid):
                raise ValueError("an entry is not [node CID, offset, length]")
            if offset < len(MAGIC) or size < 0 or offset + size > start:
                raise ValueError("an entry points outside the layer's nodes")
            entries[cidlib.check_binary(cid)] = (offset, size)
        parents = frozenset(cidlib.check_binary(cid) for cid in frontier)
    except (ValueError, TypeError, KeyError, msgpack.UnpackException) as exc:
        raise CorruptStore(where, f"unreadable commit-graph index: {exc}") from None
    return Layer(name, data, entries, parents)


def merge_set(new: int, sizes: Mapping[str, int]) -> list[str]:
    """The layers (name -> commits held) a new layer of ``new`` commits takes in: smallest
    first, each while it holds at most :data:`MERGE_RATIO` times what the new layer holds so far."""
    chosen, total = [], new
    for name, size in sorted(sizes.items(), key=lambda item: (item[1], item[0])):
        if size > MERGE_RATIO * total:
            break
        chosen.append(name)
        total += size
    return chosen


class CommitGraph:
    """The layers of one repository's commit graph on ``backend``, as last listed.

    Thread-safe. ``verify=False`` trusts copies without hashing them (as a store opened so does).
    """

    def __init__(self, backend: Backend, *, verify: bool = True) -> None:
        self.backend = backend
        self.verify = verify
        self.loaded = False  # listed at least once
        self.damaged: dict[str, str] = {}  # layers found damaged (unreadable, or a bad copy), why
        self._layers: dict[str, Layer] = {}
        self._where: dict[bytes, str] = {}  # commit CID -> a layer holding it
        self._unread: set[str] = set()  # damaged beyond reading, or of a later version
        self._foreign: set[str] = set()
        self._misplaced: set[str] = set()  # damaged layers the medium could not read whole
        self._lock = threading.RLock()

    def __len__(self) -> int:
        return len(self._where)

    def layers(self) -> dict[str, int]:
        """Each readable layer and the commits it holds."""
        with self._lock:
            return {name: len(layer.entries) for name, layer in self._layers.items()}

    # -- reading -------------------------------------------------------------------------------
    def refresh(self) -> bool:
        """List the layers: read new ones, forget those gone. True if anything changed."""
        listing = {i.name: i for i in self.backend.list() if i.name.endswith(SUFFIX)}
        with self._lock:
            known = self._layers.keys() | self._unread
            gone = known - listing.keys()
            new = [info for name, info in sorted(listing.items()) if name not in known]
        buffers = [bytearray(info.size) for info in new]
        reads = [Read(info.name, 0, memoryview(b), []) for info, b in zip(new, buffers, strict=True)]
        results = self.backend.read_many(reads) if reads else []
        with self._lock:
            for name in gone:
                self._forget(name)
            for info, buffer, result in zip(new, buffers, results, strict=True):
                if result is not False:  # False: deleted since the listing (merged into another)
                    self._take(info.name, result if isinstance(result, CorruptStore) else bytes(buffer))
            self.loaded = True
        return bool(gone or new)

    def _take(self, name: str, data: bytes | CorruptStore) -> None:
        """Take in layer ``name`` as read (or the damage reading it found)."""
        try:
            if isinstance(data, CorruptStore):
                self._misplaced.add(name)  # maybe no file at all: set aside before any delete
                raise data
            layer = parse_layer(data, name, self.backend.where(name))
        except ForeignLayer:
            self._unread.add(name)
            self._foreign.add(name)
            return
        except CorruptStore as exc:
            self._unread.add(name)
            self._report(name, str(exc))
            return
        self._layers[name] = layer
        for cid in layer.entries:
            self._where.setdefault(cid, name)

    def _forget(self, name: str) -> None:
        self._unread.discard(name)
        self._foreign.discard(name)
        self._misplaced.discard(name)
        self.damaged.pop(name, None)
        layer = self._layers.pop(name, None)
        if layer is None:
            return
        for cid in layer.entries:
            if self._where.get(cid) == name:
                del self._where[cid]
                other = next((n for n, held in self._layers.items() if cid in held.entries), None)
                if other is not None:
                    self._where[cid] = other

    def _report(self, name: str, why: str) -> None:
        if name not in self.damaged:
            _log.warning("commit graph: %s; it is ignored, and the next update of the graph "
                         "rewrites what it held", why)
            self.damaged[name] = why

    def covers(self, cid: bytes) -> bool:
        """True if a layer holds a copy of commit ``cid`` (not yet checked against its CID)."""
        return cid in self._where

    def node(self, cid: bytes) -> bytes | None:
        """The node of commit ``cid`` from a layer that holds a copy matching its CID; None if
        no layer does (a copy that does not match is reported, and skipped)."""
        for _ in range(4):  # a bad copy sends the lookup to another layer holding the commit
            name = self._where.get(cid)
            layer = self._layers.get(name) if name is not None else None
            if layer is None:
                return None
            found = layer.entries.get(cid)
            if found is None:
                return None
            offset, length = found
            data = layer.data[offset : offset + length]
            if not self.verify or cidlib.matches(cid, data):
                return data
            with self._lock:
                self._report(name, f"corrupt {self.backend.where(name)}: the copy of commit "
                                   f"{cidlib.to_str(cid)} does not match its hash")
                if self._where.get(cid) == name:
                    others = [n for n, held in self._layers.items() if n != name and cid in held.entries]
                    if others:
                        self._where[cid] = others[0]
                    else:
                        del self._where[cid]
        return None

    def frontier(self) -> set[bytes]:
        """Parents of covered commits that no layer covers: where history not yet in the graph
        may continue (some may be commits GC removed)."""
        with self._lock:
            found = set().union(*(layer.frontier for layer in self._layers.values()))
        return {cid for cid in found if cid not in self._where}

    def copies(self) -> dict[bytes, bytes]:
        """Every commit the layers hold, each a copy checked against its CID."""
        with self._lock:
            cids = list(self._where)
        return {cid: data for cid in cids if (data := self.node(cid)) is not None}

    # -- writing -------------------------------------------------------------------------------
    def write(
        self, commits: Mapping[bytes, bytes], frontier: Iterable[bytes], *, merge_all: bool = False,
        keep: Callable[[bytes], bool] | None = None,
    ) -> Written:
        """Publish a layer holding ``commits`` (CID -> node bytes; durable commits whose bytes
        match their CIDs) and the layers :func:`merge_set` picks (every layer with
        ``merge_all``; damaged ones always), then delete the layers it took in.

        ``frontier``: parents of ``commits`` not walked. ``keep``: commits of merged layers to
        carry over (the others, say commits GC removed, are left out). Call :meth:`refresh` first.
        """
        written = Written()
        with self._lock:
            fresh = {cid: node for cid, node in commits.items() if cid not in self._where}
            written.new = len(fresh)
            sizes = {name: len(layer.entries) for name, layer in self._layers.items()}
            names = list(sizes) if merge_all else merge_set(len(fresh), sizes)
            damaged = [n for n in self.damaged if n not in names and n not in self._foreign]
            names += damaged
            chosen = [self._layers[n] for n in names if n in self._layers]
            written.dropped = [n for n in names if n not in self._layers]
            if not fresh and not chosen and not written.dropped:
                return written  # nothing new, nothing to rewrite
        entries = dict(fresh)
        for layer in chosen:
            for cid in layer.entries:
                if cid not in entries and (keep is None or keep(cid)):
                    data = self._copy(layer, cid)
                    if data is not None:
                        entries[cid] = data
        carried = set().union(frontier, *(layer.frontier for layer in chosen))
        with self._lock:
            others = [layer for n, layer in self._layers.items() if n not in names]
        open_parents = {cid for cid in carried if cid not in entries
                        and not any(cid in layer.entries for layer in others)}
        written.merged = [layer.name for layer in chosen]
        if entries:
            data, name = encode_layer(entries, open_parents)
            if names == [name] and name not in self.damaged:
                return Written()  # the one layer merged holds exactly this already
            self._publish(data, name)
            written.name, written.commits, written.bytes = name, len(entries), len(data)
            with self._lock:
                self._forget(name)
                self._take(name, data)
        for name in [n for n in names if n != written.name]:
            if name in self._misplaced:
                continue  # maybe no file at all (a directory): upkeep sets it aside
            self.backend.delete(name)
            with self._lock:
                self._forget(name)
        return written

    @property
    def misplaced(self) -> bool:
        """Whether a damaged layer could not be read at all (maybe no file: :meth:`set_aside_damaged`)."""
        return bool(self._misplaced)

    def set_aside_damaged(self) -> dict[str, str]:
        """Move damaged layers that are no readable object at all (a directory, a FIFO, a
        link...) out of the way (:meth:`Backend.set_aside`): where each was -> where it went.
        What they held is no layer's now: the next update of the graph takes it in again."""
        with self._lock:
            misplaced = sorted(self._misplaced)
        moved = {}
        for name in misplaced:
            aside = self.backend.set_aside(name)
            with self._lock:
                if aside is None:
                    self._misplaced.discard(name)  # a file after all: the next write deletes it
                else:
                    moved[self.backend.where(name)] = aside
                    self._forget(name)
        return moved

    def _copy(self, layer: Layer, cid: bytes) -> bytes | None:
        """``cid``'s node from ``layer`` if it matches its CID (merges check every copy)."""
        offset, length = layer.entries[cid]
        data = layer.data[offset : offset + length]
        if cidlib.matches(cid, data):
            return data
        self._report(layer.name, f"corrupt {self.backend.where(layer.name)}: the copy of commit "
                                 f"{cidlib.to_str(cid)} does not match its hash")
        return None

    def _publish(self, data: bytes, name: str) -> None:
        """Publish ``data`` as ``name``; a damaged object of that name is replaced."""
        sink = self.backend.create()
        try:
            sink.write(data)
            if not sink.publish(name) and name in self.damaged:
                sink.replace(name)  # the same name holds the same commits: this copy is whole
        finally:
            sink.abort()
