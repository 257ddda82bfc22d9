"""The packed block store: blocks in packs on any backend, one index, one writer, one repack.

Creating an object costs far more than writing a megabyte, so blocks are appended to packs (as
git, restic and Xet do), each pack carrying its own index (:mod:`cas_ckpt.blocks.pack`). This
module is the only one that knows packs: it keeps the index of every pack the backend lists,
writes new packs through the backend's sinks, and rewrites packs for GC. A medium adds only a
backend (:mod:`cas_ckpt.backends`).

Copies. Racing writers can leave one CID in two packs. Every copy is indexed; reads use the first
that passes its hash and mark the others, so a damaged copy is never returned while a good one
exists, and a put of a CID whose only known copies are damaged stores it again. A published pack
whose name is taken by an existing object is verified before it is trusted; a damaged one is
replaced.
"""

from __future__ import annotations

import errno
import itertools
import os
import threading
from collections.abc import Callable, Collection, Iterable, Iterator, MutableSet, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from cas_ckpt import cid as cidlib
from cas_ckpt._memory import cyclic_gc_paused
from cas_ckpt.backends.base import Backend, ObjectInfo, Read, Sink
from cas_ckpt.backends.local import LocalBackend
from cas_ckpt.backends.memory import MemoryBackend
from cas_ckpt.backends.s3 import DEFAULT_GRACE, PART_SIZE, READ_SIZE, S3Backend, S3Bucket
from cas_ckpt.blocks.base import BlockStore, BlockWriter, HeldBack, Layout, Stored
from cas_ckpt.blocks.catalog import FOLDER, Catalog, Listed
from cas_ckpt.blocks.catalog import SUFFIX as INDEX_SUFFIX
from cas_ckpt.blocks.compression import CODEC_NONE, Compressor, decode, decode_into
from cas_ckpt.blocks.index import LOCATION_DTYPE, MAX_LENGTH, BlockIndex, Table, cid_of, table_of
from cas_ckpt.blocks.index_file import JOURNAL, SEQUENCE_DIGITS, SNAPSHOT, IndexFile, parse_name
from cas_ckpt.blocks.pack import (
    FOOTER,
    INDEX_READ,
    MAGICS,
    PACK_MAGIC,
    SMALL_PACK,
    SUFFIX,
    VERSIONS,
    Columns,
    Entry,
    EntryFields,
    Location,
    encode_index,
    index_length,
    parse_index_columns,
)
from cas_ckpt.blocks.sweep import RowMarks, plan, rows_by_pack
from cas_ckpt.errors import BlockNotFound, CorruptBlock, CorruptStore, RepositoryError

REPACK_READ = 16 * 1024 * 1024  # the most GC reads at once when copying live blocks
SPACE_MARGIN = 1024 * 1024  # GC merges only with this much room left over (indexes, metadata)
_MAX_MOVES = 16  # a block whose pack GC compacts again and again under a read is followed this often
_RELISTS = 4  # an index folder listed again this often when a file listed is gone when read
# A save lists the journals of the last hour (and every snapshot), not all: a journal whose name
# is older when it lands is missed by a process that saw newer ones (dedup may miss; a read that
# misses lists every pack).
JOURNAL_WINDOW_US = 3600 * 1_000_000


class PackWriter(BlockWriter):
    """Appends blocks to a pack in a backend sink; seals and publishes it past the pack size.

    A sealed pack becomes visible in this store when the writer commits, once every pack of the
    batch is durable on the medium. A writer that compresses (``compression`` other than
    ``"none"``) writes version 2 packs; one that does not writes version 1 (``version`` forces 2,
    for GC moving compressed copies).
    """

    def __init__(
        self, store: PackedBlockStore, *, verify_existing: bool = False, verify_incoming: bool = False,
        compression: str = "none", version: int = 1,
    ) -> None:
        super().__init__(store, verify_incoming=verify_incoming)
        self._packed = store
        self.verify_existing = verify_existing
        self._compressor = Compressor(compression)
        self.version = 2 if self._compressor.enabled else version
        self._sink: Sink | None = None
        self._entries: list[EntryFields] = []  # plain tuples, as the pack index takes them
        self._offset = 0
        self._run_end = 0  # no cut before this offset: the end of an array's chunks (expect_run)
        self._sealed: list[Future[tuple[ObjectInfo, list[EntryFields]]]] = []
        self.published: list[str] = []
        self.published_packs: list[tuple[ObjectInfo, list[EntryFields]]] = []
        self.journal = True  # record the packs in a journal file on commit (where the store keeps them)

    def _stored(self, cid: bytes) -> bool:
        if not self._packed._has(cid):
            return False
        return not self.verify_existing or self._packed._intact(cid)

    def _all_stored(self, cids: list[bytes]) -> bool:
        return not self.verify_existing and self._packed._has_all(cids)

    def _stored_many(self, cids: list[bytes]) -> list[bool]:
        if self.verify_existing:
            return [self._stored(cid) for cid in cids]
        return self._packed._has_many(cids)

    @property
    def compresses(self) -> bool:
        return self._compressor.enabled

    def encode(self, cid: bytes, data: bytes | memoryview, float_size: int = 0) -> Stored | None:
        if not self._compressor.enabled or cid in self._pending or self._packed._has(cid):
            return None  # a block already stored is not compressed again (an index look-up only)
        encoded = self._compressor.encode(data, float_size)
        return Stored(*encoded) if encoded else Stored(CODEC_NONE, data)

    def _append(self, cid: bytes, stored: Stored, size: int, keep: bool = False) -> None:
        length = size if stored.codec == CODEC_NONE else memoryview(stored.data).nbytes
        if size > MAX_LENGTH:
            raise RepositoryError(f"block {cidlib.to_str(cid)} holds {size} bytes: 4 GiB or more")
        if self._sink is not None and self._offset + length > self._packed.pack_size and self._entries \
                and self._offset >= self._run_end:
            self._seal()
        if self._sink is None:
            self._sink = self._packed.backend.create()
            self._sink.write(MAGICS[self.version])
            self._offset = len(PACK_MAGIC)
        self._sink.write(stored.data, keep=keep or type(stored.data) is bytes)
        self._entries.append((cid, self._offset, length, stored.codec, size))
        self._offset += length
        self.stats.bytes_stored += length

    def settle(self) -> None:
        with self._lock:
            if self._sink is not None:
                self._sink.settle()

    def expect_run(self, nbytes: int) -> None:
        """Keep the next ``nbytes`` in one pack where packs are mapped: a new pack if they do not
        fit the current one, and no cut inside them (the pack grows past the pack size instead;
        blocks found stored already only end the run sooner)."""
        if not self._packed.backend.can_mmap:
            return  # an object store's loads never map: its packs keep their size for the uploads
        with self._lock:
            if self._sink is not None and self._entries and self._offset + nbytes > self._packed.pack_size:
                self._seal()
            self._run_end = (self._offset if self._sink is not None else len(PACK_MAGIC)) + nbytes

    def receipt(self) -> list[tuple[ObjectInfo, list[EntryFields]]]:
        """The packs this batch published and their entries, for :meth:`PackedBlockStore.adopt`
        in another process (picklable)."""
        return list(self.published_packs)

    def add_copy(self, cid: bytes, data: bytes | memoryview, *, stored: Stored | None = None) -> None:
        """Write a block again even though the store has it (GC moving live blocks), as
        ``stored`` if given (a copy keeps its encoding)."""
        with self._lock:
            if cid not in self._pending:
                self._pending.add(cid)
                self._append(cid, stored or Stored(CODEC_NONE, data), memoryview(data).nbytes)

    def _seal(self) -> None:
        sink, entries = self._sink, self._entries
        assert sink is not None
        self._sink, self._entries = None, []
        tail, name = encode_index(entries, self.version)
        try:
            sink.write(tail)
        except BaseException:
            sink.abort()
            raise
        info = ObjectInfo(name, self._offset + len(tail), 0.0)
        publish = self._packed._publish
        if self._packed.backend.publish_in_background:
            self._sealed.append(self._packed._publisher.submit(publish, sink, info, entries, self.version))
        else:
            done: Future[tuple[ObjectInfo, list[EntryFields]]] = Future()
            done.set_result(publish(sink, info, entries, self.version))
            self._sealed.append(done)

    def commit(self) -> None:
        with self._lock:
            try:
                if self._sink is not None:
                    self._seal()
                packs = self._wait()
                if packs and self.journal and self._packed.writes_journals:
                    self._packed._write_journal(packs)
            except BaseException:
                self._discard()
                raise
            finally:
                self.closed = True
            self._packed._add_packs(packs)
            self.published = [info.name for info, _ in packs]
            self.published_packs = packs

    def abort(self) -> None:
        with self._lock:
            self._discard()
            self.closed = True

    def _discard(self) -> None:
        if self._sink is not None:
            self._sink.abort()
            self._sink = None
        # Packs already published stay, unreferenced, for GC to collect.
        for future in self._sealed:
            future.exception()
        self._sealed = []

    def _wait(self) -> list[tuple[ObjectInfo, list[EntryFields]]]:
        """Every sealed pack, once all have finished publishing; the first failure raised."""
        results, first = [], None
        for future in self._sealed:
            try:
                results.append(future.result())
            except BaseException as exc:  # reported once every publish has ended
                first = first or exc
        self._sealed = []
        if first is not None:
            raise first
        return results


class PackedBlockStore(BlockStore):
    """Content-addressed blocks in packs on ``backend`` (see the module docstring)."""

    def __init__(self, backend: Backend, *, verify: bool = True, pack_size: int | None = None) -> None:
        super().__init__(verify=verify, read_only=backend.read_only)
        self.backend = backend
        self.pack_size = pack_size or backend.pack_size
        self._lock = threading.RLock()
        self._refresh_lock = threading.RLock()
        self._blocks = BlockIndex()  # every copy of every block: fixed-width rows, no object each
        self._info: dict[str, ObjectInfo] = {}
        self.corrupt_packs: dict[str, str] = {}  # packs whose index cannot be read, and why
        sibling = backend.sibling(FOLDER, INDEX_SUFFIX)
        self._catalog = Catalog(sibling) if sibling is not None else None
        self.corrupt_indexes: dict[str, str] = {}  # index files found damaged, and why
        self._snapshot: str | None = None  # the newest snapshot this view took in or wrote
        self._covered: set[str] = set()  # the packs that snapshot describes
        self._folded: set[str] = set()  # the journals it folded in
        self._epoch = 0  # its removal epoch: the newest snapshot written when GC removed blocks
        self._journals: dict[str, list[str]] = {}  # journals taken in since, and their packs
        self._unrecorded: set[str] = set()  # packs known from a listing alone, where journals are kept
        self._publisher_pool: ThreadPoolExecutor | None = None
        self.refresh()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.backend.describe()}>"

    @property
    def writes_journals(self) -> bool:
        """Whether each batch records its packs in a journal file: where other processes learn of
        new packs from the index folder instead of listing every pack (``cheap_listing`` False)."""
        return self._catalog is not None and not self.backend.cheap_listing

    @property
    def format_version(self) -> int:
        """The repository format this store's writes need: 3 where journals and snapshots tell
        other processes which packs exist (writers that do not keep them, 0.2's GC, must not
        write there), else 1."""
        return 3 if self.writes_journals else 1

    # -- the index -----------------------------------------------------------------------------
    def refresh(self, *, full: bool = False, learn: bool = True) -> None:
        """Take in the packs published since the last look, forget those gone.

        Where listing is cheap (a directory) the listing of ``packs/`` decides which packs
        exist; an unknown pack is described by the newest snapshot if it covers it, else by its
        own index. On object storage the index folder decides: new journals and a newer snapshot
        are read, and no pack is listed, until no snapshot exists yet (a repository written by
        0.2). ``full`` lists every pack, and looks up every pack's size and age again (GC, which
        spares young packs, fsck, and a read that found nothing otherwise). ``learn=False`` takes
        in only what was removed (packs gone, a newer snapshot's removals), never a new pack: the
        ranks of a DCP save, which the coordinator tells of each other's packs, ask for that.
        """
        with self._refresh_lock:
            if full or self._catalog is None or self.backend.cheap_listing or not self._refresh_index(learn):
                self._refresh_listing(full=full, learn=learn or full)

    def _refresh_listing(self, *, full: bool, learn: bool = True) -> None:
        # A new pack listed may be gone before it is described: GC moved its blocks into a pack
        # published after the listing, which only another listing shows. Under load a reader
        # kept taking such a stale listing as its view, and lost every block GC was moving.
        for _ in range(_MAX_MOVES):
            if not self._list_once(full=full, learn=learn):
                return

    def _list_once(self, *, full: bool, learn: bool) -> bool:
        """Take in one listing of the packs; True if a new pack it named was gone before it was
        described (the listing is stale: list again)."""
        with self._lock:
            known = self._blocks.ids.keys() | self.corrupt_packs.keys()
        if full:
            listing = {info.name: info for info in self.backend.list() if info.name.endswith(SUFFIX)}
            names = set(listing)
            infos = [info for name, info in sorted(listing.items()) if name not in known]
        else:
            names, changes = self.backend.list_changes(known)
            infos = sorted((i for i in changes if i.name.endswith(SUFFIX)), key=lambda i: i.name)
        gone = known - names
        self._drop_packs(gone)
        with self._lock:
            if full:
                self._info.update((name, info) for name, info in listing.items() if name in self._blocks)
        if not learn:
            return False
        # Names neither known nor described, counted first: a save lists thousands of packs.
        unseen = len(names) - (len(known) - len(gone)) - len(infos)
        described = {info.name for info in infos} if unseen else set()
        stale = unseen > 0 and any(name.endswith(SUFFIX) and name not in described for name in names - known)
        if infos and self._catalog is not None and self.backend.cheap_listing:
            infos = self._describe_from_snapshot(infos)
        return self._describe_from_packs(infos) or stale

    def _describe_from_packs(self, infos: list[ObjectInfo]) -> bool:
        """Read these packs' own indexes (each from its end, as arrays) and take them in; True
        if one of them was gone."""
        found, gone = [], False
        with cyclic_gc_paused():  # a few objects per block where an index needs them: see _memory
            for info, result in zip(infos, self._read_indexes(infos), strict=True):
                if isinstance(result, str):
                    with self._lock:
                        self.corrupt_packs[info.name] = result
                elif result is None:
                    gone = True
                else:
                    found.append((info, result))
            with self._lock:
                self._blocks.add_columns((info.name, columns) for info, columns in found)
                self._info.update((info.name, info) for info, _ in found)
            if self.writes_journals:
                with self._lock:  # no index file names them (yet): see merge_small
                    self._unrecorded.update(info.name for info, _ in found)
        return gone

    def _describe_from_snapshot(self, infos: list[ObjectInfo]) -> list[ObjectInfo]:
        """Take in the packs of ``infos`` that the newest snapshot describes (at the size
        listed); return the others."""
        for _ in range(_RELISTS):  # the newest listed may be gone when read: a newer one replaced it
            snapshots = [(f.sequence, f.info) for f in self._listing() if f.kind == SNAPSHOT]
            if not snapshots:
                return infos
            _, newest = max(snapshots, key=lambda s: (s[0], s[1].name))
            if newest.name == self._snapshot:
                return infos  # read before: what it covers is known already
            content = self._read_index_file(newest)
            if content is None:
                if newest.name in self.corrupt_indexes:
                    return infos  # damaged: the packs' own indexes describe them
                continue
            wanted = {info.name: info for info in infos}
            take = [name for name, size in content.packs if name in wanted and wanted[name].size == size]
            self._take(content, take, {name: wanted[name] for name in take})
            with self._lock:
                self._snapshot, self._covered = newest.name, set(content.pack_names)
                self._folded, self._epoch = set(content.folded), _epoch(newest.name)
            return [info for info in infos if info.name not in self._blocks]
        return infos

    def _listing(self, after: str | None = None) -> list[Listed]:
        assert self._catalog is not None
        return self._catalog.listing(after)

    def _read_index_file(self, info: ObjectInfo) -> IndexFile | None:
        """An index file's content; None if it is gone or damaged (recorded for fsck)."""
        assert self._catalog is not None
        try:
            return self._catalog.read(info)
        except CorruptStore as exc:
            with self._lock:
                self.corrupt_indexes[info.name] = str(exc)
            return None

    def _take(self, content: IndexFile, names: Collection[str], infos: dict[str, ObjectInfo]) -> None:
        """Take in the rows of these packs of an index file."""
        with self._lock:
            self._unrecorded.difference_update(content.pack_names)
            self._blocks.add_table(content.table, content.pack_names, only=set(names))
            self._info.update((name, infos[name]) for name in names if name not in self._info)

    def _refresh_index(self, learn: bool = True) -> bool:
        """Catch up from the index folder (journals new since the last look, a newer snapshot);
        False if there is no snapshot to start from, or it is damaged (the caller lists packs)."""
        for _ in range(_RELISTS):  # a file listed may be gone when read: a newer snapshot replaced it
            start = f"j-{max(0, self._newest_journal() - JOURNAL_WINDOW_US):0{SEQUENCE_DIGITS}d}"
            listing = self._listing(after=start)
            snapshots = [f for f in listing if f.kind == SNAPSHOT]
            if not snapshots:
                return False
            last = max(snapshots, key=lambda f: (f.sequence, f.info.name))
            newest = last.info
            if not learn and last.epoch <= self._epoch:
                return True  # no block removed since this view was made: nothing to learn
            base = None
            if newest.name != self._snapshot:
                base = self._read_index_file(newest)
                if base is None:
                    if newest.name in self.corrupt_indexes:
                        return False
                    continue
            folded = set(base.folded) if base is not None else self._folded
            journals = []
            for kind, _, _, info in listing if learn else ():
                if kind == JOURNAL and info.name not in folded and info.name not in self._journals:
                    content = self._read_index_file(info)
                    if content is None and info.name not in self.corrupt_indexes:
                        break  # gone: folded into a snapshot written since the listing
                    if content is not None:
                        journals.append((info, content))
            else:
                listed = {info.name for kind, _, _, info in listing if kind == JOURNAL}
                self._catch_up(newest, base, journals, listed)
                return True
        return False

    def _catch_up(
        self, newest: ObjectInfo, base: IndexFile | None, journals: list[tuple[ObjectInfo, IndexFile]],
        listed: set[str],
    ) -> None:
        """Take in a newer snapshot (forgetting the packs it and the journals since no longer
        name: GC or upkeep removed them) and new journals.

        A journal this view took in before is kept only while it is still listed and the new
        snapshot does not fold it: one gone was folded into a snapshot at or before the new one,
        which says what became of its packs (a snapshot between them may have folded it and
        had its packs deleted; this view never read that one).
        """
        if base is not None:
            with self._lock:
                self._journals = {j: packs for j, packs in self._journals.items()
                                  if j not in base.folded and j in listed}
            keep = set(base.pack_names).union(*self._journals.values(), *(c.pack_names for _, c in journals))
            with self._lock:
                gone = [name for name in self._blocks.ids if name not in keep]
            self._drop_packs(gone)
            sizes = {name: ObjectInfo(name, size, 0.0) for name, size in base.packs}
            self._take(base, [name for name in base.pack_names if name not in self._blocks], sizes)
            with self._lock:
                self._snapshot, self._folded = newest.name, set(base.folded)
                self._covered = set(base.pack_names)
                self._epoch = _epoch(newest.name)
        for info, content in journals:
            sizes = {name: ObjectInfo(name, size, 0.0) for name, size in content.packs}
            self._take(content, [name for name in content.pack_names if name not in self._blocks], sizes)
            with self._lock:
                self._journals[info.name] = content.pack_names

    def _newest_journal(self) -> int:
        sequences = [parsed.sequence for name in self._journals if (parsed := parse_name(name))]
        sequences += [parsed.sequence for name in self._folded if (parsed := parse_name(name))]
        return max(sequences, default=0)

    def _write_journal(self, packs: list[tuple[ObjectInfo, list[EntryFields]]]) -> None:
        """Record newly published packs in a journal file (before anyone is told of them)."""
        assert self._catalog is not None
        table = table_of([(info.name, entries) for info, entries in packs])
        written = self._catalog.write(JOURNAL, [(info.name, info.size) for info, _ in packs], table)
        with self._lock:
            self._journals[written.name] = [info.name for info, _ in packs]

    def adopt(self, receipts: Sequence[Any]) -> None:
        """Take in packs other processes published (their writers' :meth:`PackWriter.receipt`),
        recorded in one journal where the medium keeps journals: the coordinator of a DCP save
        tells every later reader of its ranks' packs at once."""
        packs = [(info, list(entries)) for receipt in receipts for info, entries in receipt]
        packs = [(info, entries) for info, entries in packs if info.name not in self._blocks]
        if not packs:
            return
        self._check_writable()
        if self.writes_journals:
            self._write_journal(packs)
        self._add_packs(packs)

    def consolidate(self, *, excluding: Collection[str] = (), removing: bool = False) -> str | None:
        """Write a snapshot: one index file of every pack this store knows, folding in the
        journals it has read; then remove the index files it supersedes. Returns its name (None
        where the medium keeps no index files).

        Deletes no pack and no block, so it needs no lock against GC beyond a save's; on object
        storage the first one lists every pack (a repository 0.2 wrote gets its index here).
        ``excluding``: packs about to be deleted, left out; ``removing``: blocks are removed with
        them (GC), which every writer must learn of (the snapshot starts a new removal epoch).
        """
        self._check_writable()
        if self._catalog is None:
            return None
        with self._refresh_lock:
            self.refresh(full=self._snapshot is None and not self.backend.cheap_listing)
            listing = self._listing()
            journals = self._journal_packs(f.info for f in listing if f.kind == JOURNAL)
            with self._lock:
                table, names = self._blocks.snapshot(excluding)
                packs = [(name, self._info[name].size) for name in names]
            # A journal is folded in (and deleted after) once the snapshot covers its packs or
            # they are being deleted: a reader of the snapshot then never takes them in again.
            covered = set(names).union(excluding)
            folded = {name for name, held in journals.items() if held is None or covered.issuperset(held)}
            epoch = max([self._epoch, *(f.epoch for f in listing if f.kind == SNAPSHOT)])
            written = self._catalog.write(SNAPSHOT, packs, table, folded, epoch=None if removing else epoch)
            with self._lock:
                self._snapshot, self._covered, self._folded = written.name, set(names), folded
                self._unrecorded.difference_update(names)
                self._epoch = _epoch(written.name)
                self._journals = {j: p for j, p in self._journals.items() if j not in folded}
            mine = parse_name(written.name)
            assert mine is not None
            newer = (mine.sequence, written.name)
            superseded = [f.info.name for f in listing if f.info.name in folded
                          or (f.kind == SNAPSHOT and (f.sequence, f.info.name) < newer)]
            # One the medium could not read may be no file at all (a directory no delete
            # removes): it stays for upkeep to set aside, and fails no GC meanwhile.
            superseded = [name for name in superseded if name not in self._catalog.unreadable]
            self._catalog.delete(superseded)
            with self._lock:
                for name in superseded:
                    self.corrupt_indexes.pop(name, None)
            return written.name

    def set_aside_damaged(self) -> dict[str, str]:
        self._check_writable()
        if self._catalog is None:
            return {}
        with self._lock:
            damaged = sorted(self._catalog.unreadable.intersection(self.corrupt_indexes))
        moved = {}
        for name in damaged:
            aside = self._catalog.set_aside(name)
            if aside is not None:
                moved[self._catalog.where(name)] = aside
                with self._lock:
                    self.corrupt_indexes.pop(name, None)
        return moved

    def _journal_packs(self, infos: Iterable[ObjectInfo]) -> dict[str, list[str] | None]:
        """The packs each journal names (None: folded into the snapshot this view started from);
        journals not taken in yet are read."""
        found: dict[str, list[str] | None] = {}
        for info in infos:
            if info.name in self._journals:
                found[info.name] = self._journals[info.name]
            elif info.name in self._folded:
                found[info.name] = None
            else:
                content = self._read_index_file(info)
                if content is not None:
                    found[info.name] = content.pack_names
        return found

    def layout(self, *, small: int | None = None) -> Layout:
        """What upkeep decides from: packs, small packs, and what an open reads besides the
        newest snapshot (packs' own indexes where listing is cheap, journals elsewhere)."""
        small = self.small_pack if small is None else small
        with self._lock:
            sizes = {name: self._info[name].size for name in self._blocks.ids if name in self._info}
            uncovered = (len(self._journals) if not self.backend.cheap_listing
                         else sum(1 for name in sizes if name not in self._covered))
            rows = self._blocks.pack_rows
            uncovered_rows = sum(rows.get(name, 0) for name in sizes if name not in self._covered)
            return Layout(
                packs=len(sizes), bytes=sum(sizes.values()),
                small_packs=sum(1 for size in sizes.values() if size < small),
                blocks=len(self._blocks), indexed=self._catalog is not None,
                snapshot=self._snapshot, uncovered=uncovered if self._snapshot else len(sizes),
                damaged_indexes=len(self.corrupt_indexes),
                unreadable_indexes=len(self._catalog.unreadable.intersection(self.corrupt_indexes))
                if self._catalog is not None else 0,
                uncovered_rows=uncovered_rows if self._snapshot else len(self._blocks),
            )

    @property
    def small_pack(self) -> int:
        """Packs under this size are small: upkeep and GC merge them."""
        return min(SMALL_PACK, self.pack_size // 2)

    def _read_indexes(self, infos: list[ObjectInfo]) -> list[Columns | str | None]:
        """Each pack's entries as arrays, read from its end; a reason if damaged; None if it is gone."""
        tails = [bytearray(min(info.size, INDEX_READ)) for info in infos]
        heads = [bytearray(len(PACK_MAGIC) if info.size > INDEX_READ else 0) for info in infos]
        reads = [Read(i.name, i.size - len(t), memoryview(t), []) for i, t in zip(infos, tails, strict=True)]
        reads += [Read(i.name, 0, memoryview(h), []) for i, h in zip(infos, heads, strict=True) if h]
        found = iter(self.backend.read_many(reads))
        tail_found = [next(found) for _ in infos]
        results: list[Columns | str | None] = []
        for info, tail, head, ok in zip(infos, tails, heads, tail_found, strict=True):
            head_ok = next(found) if head else ok
            try:
                magic = bytes(head or tail[: len(PACK_MAGIC)])
                results.append(self._parse_tail(info, tail, ok if ok is not True else head_ok, magic))
            except CorruptStore as exc:
                results.append(str(exc))
        return results

    def _parse_tail(
        self, info: ObjectInfo, tail: bytearray, found: bool | CorruptStore, magic: bytes
    ) -> Columns | None:
        where = self.backend.where(info.name)
        if isinstance(found, CorruptStore):
            raise found
        if not found:
            return None
        need = index_length(bytes(tail[-FOOTER.size :]), info.size, where)
        version = VERSIONS.get(magic)
        if version is None:
            raise CorruptStore(where, "not a cas_ckpt pack (bad header)")
        if need > len(tail):
            longer = self.backend.read(info.name, info.size - need, need)
            if longer is None:
                return None
            return parse_index_columns(longer, info.size, where, version)
        return parse_index_columns(tail, info.size, where, version)

    def _add_packs(self, packs: Sequence[tuple[ObjectInfo, Sequence[EntryFields]]]) -> None:
        with self._lock:
            self._blocks.add_packs((info.name, entries) for info, entries in packs)
            self._info.update((info.name, info) for info, _ in packs)

    def _drop_packs(self, names: Collection[str]) -> None:
        """Forget packs that left the medium; their blocks stay readable from their other copies."""
        if not names:
            return
        with self._lock:
            self._blocks.drop(names)
            self._unrecorded.difference_update(names)
            for name in names:
                self._info.pop(name, None)
                self.corrupt_packs.pop(name, None)
        for name in names:
            self.backend.forget(name)

    def _copies(self, cid: bytes) -> list[Location]:
        """Every known copy of ``cid``, the ones not known to be damaged first."""
        return self._blocks.copies(cid)

    def _locate(self, cid: bytes) -> list[Location]:
        copies = self._copies(cid)
        if not copies:
            self.refresh()  # another process may have published it
            copies = self._copies(cid)
        if not copies and not self.backend.cheap_listing:
            self.refresh(full=True)  # in a pack no index file names (its writer died before its journal)
            copies = self._copies(cid)
        return copies

    def _mark_bad(self, cid: bytes, loc: Location) -> None:
        with self._lock:
            self._blocks.mark_bad(loc)

    def _prefer(self, cid: bytes, loc: Location) -> None:
        """Make ``loc`` the copy reads try first (a good copy found behind a damaged one)."""
        if not self._blocks.bad and not self._blocks._first:
            return  # no copy was ever found damaged: the usual case, no lock taken
        with self._lock:
            copies = self._blocks.copies(cid)
            if copies and copies[0] != loc and loc in copies:
                self._blocks.prefer(cid, loc)

    def check_storage(self) -> dict[str, str]:
        """Every pack's own index read again and compared with what the store's index (an index
        file, maybe) says of it; damaged packs and index files, and why."""
        with self._lock:
            infos = [self._info[name] for name in sorted(self._blocks.ids) if name in self._info]
        for start in range(0, len(infos), 256):
            part = infos[start : start + 256]
            with self._lock:
                indexed = self._blocks.entries([info.name for info in part])
            for info, result in zip(part, self._read_indexes(part), strict=True):
                if isinstance(result, str):
                    with self._lock:
                        self.corrupt_packs[info.name] = result
                elif result is not None and sorted(result.entries()) != sorted(indexed[info.name]):
                    with self._lock:
                        self.corrupt_packs[info.name] = "its index disagrees with the index file"
        return self.damaged()

    def damaged(self) -> dict[str, str]:
        """Damaged packs by name, and damaged index files as ``index/<name>`` (their packs'
        own indexes were read instead: nothing is lost, and the next upkeep rewrites them)."""
        with self._lock:
            indexes = {f"{FOLDER}/{name}": why for name, why in self.corrupt_indexes.items()}
            return {**self.corrupt_packs, **indexes}

    def _missing_hint(self) -> str:
        if not self.corrupt_packs:
            return ""
        names = ", ".join(sorted(self.corrupt_packs)[:3])
        return f" (the repository has {len(self.corrupt_packs)} damaged pack(s) that may hold it: {names})"

    def packs(self) -> dict[str, list[Entry]]:
        """Each pack's entries (binary CID, offset, stored length, codec, raw length), by offset."""
        self.refresh()
        with self._lock:
            return self._blocks.entries()

    def locate(self, cid: bytes) -> tuple[str, int, int]:
        """Where the copy reads use lies: the pack (its path or URL), offset and stored length."""
        copies = self._locate(cid)
        if not copies:
            raise BlockNotFound(cidlib.to_str(cid), self._missing_hint())
        loc = copies[0]
        return self.backend.where(loc.pack), loc.offset, loc.length

    # -- reads ---------------------------------------------------------------------------------
    def _read_good(self, cid: bytes, verify: bool, read: Callable[[Location], Any]) -> Any:
        """Read a copy of ``cid`` with ``read`` (None: the pack is gone) that passes its hash.

        Tries every copy; follows a pack GC compacted away under the read; raises CorruptBlock
        naming each damaged copy only when no good one is left.
        """
        for _ in range(_MAX_MOVES):
            copies = self._locate(cid)
            if not copies:
                break
            damage: list[str] = []
            for loc in copies:
                try:
                    data = read(loc)
                    if data is not None and verify and not cidlib.matches(cid, data):
                        if self.backend.discard_cached(loc.pack, loc.offset):
                            data = read(loc)  # the cached copy was bad: the medium's may not be
                        if data is not None and not cidlib.matches(cid, data):
                            raise CorruptStore(self.backend.where(loc.pack),
                                               f"the copy at offset {loc.offset} does not match its hash")
                except CorruptStore as exc:
                    self._mark_bad(cid, loc)
                    damage.append(str(exc))
                    continue
                if data is None:
                    self._drop_packs([loc.pack])  # gone (GC or upkeep rewrote it): look again
                    damage = []
                    break
                self._prefer(cid, loc)
                return data
            if damage:
                raise CorruptBlock(cidlib.to_str(cid), "; ".join(damage))
            self.refresh()
        raise BlockNotFound(cidlib.to_str(cid), self._missing_hint())

    def _fetch(self, loc: Location) -> bytes | None:
        """The raw bytes of the copy at ``loc`` (None: its pack is gone); CorruptStore if they
        do not decode."""
        data = self.backend.read(loc.pack, loc.offset, loc.length)
        if data is None or loc.codec == CODEC_NONE:
            return data
        return decode(loc.codec, data, loc.size, self.backend.where(loc.pack))

    def _read(self, cid: bytes) -> bytes | None:
        try:
            return self._read_good(cid, False, self._fetch)
        except BlockNotFound:
            return None

    def get(self, cid: cidlib.CIDLike, *, verify: bool | None = None) -> bytes:
        key = cidlib.to_bytes(cid)
        check = self.verify if verify is None else verify
        data: bytes = self._read_good(key, check, self._fetch)
        return data

    def get_into(self, cid: bytes, out: memoryview, *, verify: bool | None = None) -> None:
        check = self.verify if verify is None else verify

        def read(loc: Location) -> memoryview | None:
            if loc.size != out.nbytes:
                raise CorruptBlock(cidlib.to_str(cid), f"stored size {loc.size} != expected {out.nbytes}")
            if loc.codec == CODEC_NONE:
                return out if self.backend.read_into(loc.pack, loc.offset, out) else None
            stored = self.backend.read(loc.pack, loc.offset, loc.length)
            if stored is None:
                return None
            decode_into(loc.codec, stored, out, self.backend.where(loc.pack))
            return out

        self._read_good(cid, check, read)

    def get_many_into(
        self, cids: list[bytes], sizes: list[int], out: memoryview, pool: Executor, *,
        verify: bool | None = None,
    ) -> None:
        """Read blocks into consecutive slices of ``out``; blocks lying back to back in one pack
        travel as one ranged read on a medium that coalesces (``backend.read_coalesce``), raw
        ones straight into ``out``, compressed ones into a scratch buffer decoded on ``pool``."""
        if self.backend.can_mmap:  # no slices made for a medium that never maps
            offsets = [0, *itertools.accumulate(sizes)]
            finish = self.start_reads(
                cids, [out[offsets[i] : offsets[i + 1]] for i in range(len(cids))], verify=verify
            )
            if finish is not None:
                finish()
                return
        if not self.backend.read_coalesce or len(cids) == 1:
            super().get_many_into(cids, sizes, out, pool, verify=verify)
            return
        check = self.verify if verify is None else verify
        offsets = [0, *itertools.accumulate(sizes)]
        locs = []
        for cid, size in zip(cids, sizes, strict=True):
            copies = self._locate(cid)
            if not copies:
                raise BlockNotFound(cidlib.to_str(cid), self._missing_hint())
            if copies[0].size != size:
                raise CorruptBlock(cidlib.to_str(cid), f"stored size {copies[0].size} != expected {size}")
            locs.append(copies[0])
        raw = [i for i, loc in enumerate(locs) if loc.codec == CODEC_NONE]
        packed = [i for i, loc in enumerate(locs) if loc.codec != CODEC_NONE]
        scratch_at = dict(zip(packed, itertools.accumulate((locs[i].length for i in packed), initial=0),
                              strict=False))
        scratch = memoryview(bytearray(sum(locs[i].length for i in packed)))

        def target(i: int, last: int) -> memoryview:
            if i in scratch_at:
                return scratch[scratch_at[i] : scratch_at[last] + locs[last].length]
            return out[offsets[i] : offsets[last + 1]]

        runs = [[group[j] for j in run] for group in (raw, packed)
                for run in _runs([locs[i] for i in group], self.backend.read_coalesce)]
        reads = [Read(locs[run[0]].pack, locs[run[0]].offset, target(run[0], run[-1]),
                      [locs[i].offset for i in run]) for run in runs]
        redo = {i for run, ok in zip(runs, self.backend.read_many(reads), strict=True) if ok is not True
                for i in run}  # gone or damaged: each block on its own finds a good copy or says why

        def finish(i: int) -> None:
            dest = out[offsets[i] : offsets[i + 1]]
            if i not in redo:
                try:
                    if i in scratch_at:
                        loc = locs[i]
                        decode_into(loc.codec, target(i, i), dest, self.backend.where(loc.pack))
                    if not check or cidlib.matches(cids[i], dest):
                        return
                except CorruptStore:
                    pass
            self.get_into(cids[i], dest, verify=check)

        for future in [pool.submit(finish, i) for i in range(len(cids)) if check or i in redo
                       or i in scratch_at]:
            future.result()

    def map_blocks(self, cids: list[bytes], *, private: bool = False) -> memoryview | None:
        runs = self._runs(cids)
        if runs is None or len(runs) != 1:
            return None
        pack, start, end, _ = runs[0]
        if private:
            return self.backend.map_private(pack, start, end - start)
        mapped = self.backend.map(pack)
        return None if mapped is None else mapped[start:end]

    def start_reads(
        self, cids: list[bytes], outs: Sequence[Any], *, verify: bool | None = None
    ) -> Callable[[], None] | None:
        """Blocks lying in mapped packs are copied out of the mappings (and checked) by
        :func:`cid.start_copies`: one job per run of them back to back, no call per block. A
        block that fails its check is read again on its own, which finds a good copy or says
        why. None if one is missing, compressed or of another size than its buffer (the
        general read says which), or the backend cannot map."""
        runs = self._runs(cids, [out.nbytes for out in outs])
        if runs is None:
            return None
        check = self.verify if verify is None else verify
        parts, start = [], 0
        for pack, begin, end, count in runs:
            parts.append((pack, begin, end, slice(start, start + count)))
            start += count
        jobs = []
        for pack, begin, end, part in parts:
            mapped = self.backend.map(pack)
            if mapped is None:
                break  # gone meanwhile: what is left is read block by block
            jobs.append((pack, begin, end, part, cidlib.start_copies(
                cids[part] if check else None, outs[part], mapped[begin:end])))

        def finish() -> None:
            for pack, begin, end, part, wrong in jobs:
                for i in wrong():
                    self.get_into(cids[part][i], memoryview(outs[part][i]).cast("B"), verify=True)
                self.backend.copied(pack, begin, end)
            for _, _, _, part in parts[len(jobs):]:
                for cid, out in zip(cids[part], outs[part], strict=True):
                    self.get_into(cid, memoryview(out).cast("B"), verify=check)

        return finish

    def _runs(self, cids: list[bytes], sizes: list[int] | None = None
              ) -> list[tuple[str, int, int, int]] | None:
        """``cids`` as runs of blocks back to back in one pack: (pack, start, end, how many);
        None if one is missing or compressed, is not of its ``sizes`` entry, or the backend
        cannot map."""
        if not self.backend.can_mmap or not cids:
            return None
        # The copy reads try first; with none known damaged, found for all in a few array
        # operations (a batch of small arrays maps thousands of blocks per load).
        located = self._blocks.locate_many(cids)
        if located is None:
            copies = [self._locate(c) for c in cids]
            if not all(copies):
                return None
            names = sorted({c[0].pack for c in copies})
            number = {name: i for i, name in enumerate(names)}
            rows = np.array([(number[c[0].pack], *c[0][1:]) for c in copies], LOCATION_DTYPE)
        else:
            rows, names = located
        if rows["codec"].any():
            return None  # mapped loads apply to raw blocks only
        lengths = rows["length"].astype(np.int64)
        if sizes is not None and not np.array_equal(lengths, sizes):
            return None
        packs, offsets = rows["pack"], rows["offset"].astype(np.int64)
        cuts = np.flatnonzero((packs[1:] != packs[:-1]) | (offsets[1:] != offsets[:-1] + lengths[:-1])) + 1
        starts = [0, *cuts.tolist()]
        ends = [*cuts.tolist(), len(cids)]
        return [(names[int(packs[a])], int(offsets[a]), int(offsets[b - 1] + lengths[b - 1]), b - a)
                for a, b in zip(starts, ends, strict=True)]

    def _has(self, cid: bytes) -> bool:
        return self._blocks.has(cid)

    def _has_all(self, cids: list[bytes]) -> bool:
        """:meth:`_has` of each, in a few array operations."""
        return all(self._blocks.has_many(cids))

    def _has_many(self, cids: list[bytes]) -> list[bool]:
        return self._blocks.has_many(cids)

    def _intact(self, cid: bytes) -> bool:
        """Read every copy of ``cid``: True if one passes its hash (the others are marked)."""
        try:
            self._read_good(cid, True, self._fetch)
        except (CorruptBlock, BlockNotFound):
            return False
        return True

    def stored_size(self, cid: cidlib.CIDLike) -> int:
        return self.locate(cidlib.to_bytes(cid))[2]

    def _size(self, cid: bytes) -> int:
        copies = self._locate(cid)
        if not copies:
            raise BlockNotFound(cidlib.to_str(cid), self._missing_hint())
        return copies[0].size

    def keys(self) -> Iterator[bytes]:
        self.refresh()
        with self._lock:
            return iter(self._blocks.cids())

    def check_copies(
        self, cids: list[bytes], *, progress: Callable[[int, int], None] | None = None
    ) -> dict[bytes, str]:
        """Re-hash every copy of these blocks, in every pack that holds one."""
        damaged: dict[bytes, str] = {}
        for i, cid in enumerate(cids):
            if progress is not None and i % 256 == 0:
                progress(i, len(cids))
            for loc in self._copies(cid):
                try:
                    data = self._fetch(loc)
                    if data is None or cidlib.matches(cid, data):
                        continue  # gone (a concurrent GC), or sound
                    why = f"the copy in pack {loc.pack} at offset {loc.offset} does not match its hash"
                except CorruptStore as exc:
                    why = str(exc)
                self._mark_bad(cid, loc)
                damaged[cid] = "; ".join(filter(None, (damaged.get(cid), why)))
        return damaged

    # -- writes --------------------------------------------------------------------------------
    def writer(
        self, *, verify_existing: bool = False, verify_incoming: bool = False, compression: str = "none"
    ) -> PackWriter:
        self._check_writable()
        return PackWriter(self, verify_existing=verify_existing, verify_incoming=verify_incoming,
                          compression=compression)

    @property
    def _publisher(self) -> ThreadPoolExecutor:
        """Publishes sealed packs while the next one is written (media where that is a transfer)."""
        with self._lock:
            if self._publisher_pool is None:
                self._publisher_pool = ThreadPoolExecutor(
                    self.backend.publish_workers, thread_name_prefix="cas_ckpt-publish")
            return self._publisher_pool

    def _publish(
        self, sink: Sink, info: ObjectInfo, entries: list[EntryFields], version: int
    ) -> tuple[ObjectInfo, list[EntryFields]]:
        """Publish a sealed pack; an existing object of its name is trusted only once verified."""
        name = info.name
        try:
            if not sink.publish(name):
                if self._pack_intact(name, entries, version):
                    sink.abort()
                else:
                    sink.replace(name)  # the existing copy was damaged: ours takes its place
                    self._drop_packs([name])
        except BaseException:
            sink.abort()
            raise
        return info, entries

    def _pack_intact(self, name: str, entries: Sequence[EntryFields], version: int) -> bool:
        """True if the object ``name`` is the version ``version`` pack of ``entries``, each block
        passing its hash."""
        entries = list(map(Entry._make, entries))
        try:
            if self.backend.read(name, 0, len(PACK_MAGIC)) != MAGICS[version]:
                return False
            for stored, e in self._stored_blocks(name, entries):
                if not cidlib.matches(e.cid, self._decoded(name, e, stored)):
                    return False
            expected = encode_index(entries, version)[0]
            end = entries[-1].offset + entries[-1].length if entries else len(PACK_MAGIC)
            return self.backend.read(name, end, len(expected)) == expected
        except (CorruptStore, RepositoryError):
            return False

    def _stored_blocks(self, name: str, entries: list[Entry]) -> Iterator[tuple[memoryview, Entry]]:
        """The stored bytes of each entry of pack ``name``, read in runs of at most REPACK_READ."""
        for run in _runs([Location.of(name, e) for e in entries], REPACK_READ):
            first, last = entries[run[0]], entries[run[-1]]
            data = self.backend.read(name, first.offset, last.offset + last.length - first.offset)
            if data is None:
                raise _PackGone(f"pack {self.backend.where(name)} vanished while it was being read")
            view = memoryview(data)
            for i in run:
                e = entries[i]
                yield view[e.offset - first.offset : e.offset - first.offset + e.length], e

    def _decoded(self, name: str, e: Entry, stored: memoryview) -> bytes | memoryview:
        if e.codec == CODEC_NONE:
            return stored
        return decode(e.codec, stored, e.size, self.backend.where(name))

    def marks(self) -> RowMarks:
        """GC's marks: a flag per row of the index, folded into one table now."""
        with self._lock:
            table, _ = self._blocks.fold()
        return RowMarks(table)

    def count_kept(self, keep: MutableSet[bytes]) -> int:
        if not isinstance(keep, RowMarks):
            return super().count_kept(keep)
        return keep.kept_blocks() + sum(1 for cid in keep.outside if self._has(cid))

    def unkept(self, keep: MutableSet[bytes]) -> tuple[int, int]:
        if not isinstance(keep, RowMarks):
            return super().unkept(keep)
        return keep.unkept()

    def unkept_cids(self, keep: MutableSet[bytes]) -> Iterator[bytes]:
        if not isinstance(keep, RowMarks):
            return super().unkept_cids(keep)
        return keep.unkept_cids()

    def delete(
        self, cids: set[bytes], *, min_age: float = 0.0, before_unlink: Callable[[], None] | None = None
    ) -> tuple[int, int]:
        """Remove these blocks (see :meth:`sweep`)."""
        self._check_writable()
        self.refresh(full=True)
        with self._lock:
            table, _ = self._blocks.fold()
        keep = RowMarks(table, everything=True)
        for cid in cids:
            keep.discard(cid)
        return self.sweep(keep, min_age=min_age, before_unlink=before_unlink)

    def sweep(
        self, keep: MutableSet[bytes], *, min_age: float = 0.0,
        before_unlink: Callable[[], None] | None = None,
    ) -> tuple[int, int]:
        """Remove every block not in ``keep`` (marks from :meth:`marks`) from packs older than
        ``max(min_age, backend.min_grace)`` seconds.

        Packs left with nothing kept are deleted first (that needs no space, so GC frees space
        on a full medium). Packs losing some blocks, and small packs, are then merged: their
        kept blocks, each verified, are written into new packs, published durably, and only then
        are the old packs deleted; in groups that fit in the room the medium has, so a full disk
        is compacted step by step. Returns (blocks removed, bytes freed). The plan is made over
        the index's table and the marks' flags: no object per block.
        """
        if not isinstance(keep, RowMarks):
            return super().sweep(keep, min_age=min_age, before_unlink=before_unlink)
        self._check_writable()
        self.refresh(full=True)  # every pack's size and age, and packs no index file named
        with self._lock:
            table, names = self._blocks.fold()
            sizes = {name: self._info[name].size for name in self._blocks.ids if name in self._info}
            ages = {name: self._info[name].age for name in sizes}
        kept = keep.flags_for(table)
        found = plan(table, names, kept, sizes, ages, max(min_age, self.backend.min_grace), self.small_pack)
        if before_unlink is not None and (found.dead or found.merge):
            before_unlink()
        removed = freed = 0
        if found.dead:
            self._retire(found.dead)
            removed = sum(found.rows[name] for name in found.dead)
            freed = sum(sizes[name] for name in found.dead)
        live = _LiveEntries(table, names, kept, found.merge)
        for batch in self._batches(found.live_bytes):
            written, held = self._repack(batch, live)
            if not written and held == set(batch):
                break  # the medium is full: what is left waits for the next GC
            if before_unlink is not None:
                before_unlink()
            # Not those rewritten byte for byte (an identical pack), nor those holding the only copy.
            doomed = [name for name in batch if name not in written and name not in held]
            self._retire(doomed)
            for name in doomed:
                removed += found.rows[name] - live.count(name)
                freed += sizes[name]
            with self._lock:  # what the new packs take (an identical rewrite was never deleted)
                freed -= sum(self._info[name].size for name in written
                             if name in self._info and name not in batch)
        return removed, freed

    def held_back(self, keep: MutableSet[bytes], *, min_age: float = 0.0) -> HeldBack:
        """The packs :meth:`sweep` of ``keep`` with ``min_age`` would touch that the backend's
        ``min_grace`` (S3: an hour, for writers on other machines) spares, and the copies of
        blocks not kept in them."""
        grace = self.backend.min_grace
        if grace <= min_age:
            return HeldBack(grace=grace)
        if not isinstance(keep, RowMarks):
            keep = self._marks_of(keep)
        self.refresh(full=True)
        with self._lock:
            table, names = self._blocks.fold()
            sizes = {name: self._info[name].size for name in self._blocks.ids if name in self._info}
            ages = {name: self._info[name].age for name in sizes}
        kept = keep.flags_for(table)
        wide = plan(table, names, kept, sizes, ages, min_age, self.small_pack)
        narrow = plan(table, names, kept, sizes, ages, grace, self.small_pack)
        spared = set(wide.dead + wide.merge) - set(narrow.dead + narrow.merge)
        ids = [pack for pack, name in enumerate(names) if name in spared]
        held = np.isin(table.location_array["pack"], ids) & ~kept
        return HeldBack(len(spared), int(np.count_nonzero(held)),
                        int(table.location_array["length"][held].sum()), grace)

    def _marks_of(self, keep: Iterable[bytes]) -> RowMarks:
        marks = self.marks()
        for cid in keep:
            marks.add(cid)
        return marks

    def merge_small(self) -> tuple[int, int, int]:
        """Merge the small packs into as few packs as the pack size allows, every block kept
        (each verified as it is copied), then delete them: fewer files for every later open,
        listing and read. Needs no grace period: no block goes. Returns (packs merged, packs
        written, bytes copied); a full medium merges nothing and says so by (0, 0, 0).
        """
        self._check_writable()
        self.refresh()
        with self._lock:
            # Where journals say which packs exist, a pack known from a listing alone may be one a
            # writer published and has not recorded yet: merging and deleting it would leave its
            # journal, written next, naming a pack that is gone. It waits for a snapshot.
            small = [name for _, name in sorted((info.size, name) for name, info in self._info.items()
                                                if name in self._blocks and info.size < self.small_pack
                                                and name not in self._unrecorded)]
            if len(small) < 2:
                return 0, 0, 0
            table, names = self._blocks.fold()
        live = _LiveEntries(table, names, np.ones(table.n, bool), small)
        written, kept = self._repack(small, live)
        doomed = [name for name in small if name not in written and name not in kept]
        self._retire(doomed, removing=False)  # every block of theirs is in the new packs
        copied = sum(live.bytes(name) for name in doomed)
        return len(doomed), len([name for name in written if name not in small]), copied

    def _retire(self, names: list[str], *, removing: bool = True) -> None:
        """Delete packs whose live blocks are stored elsewhere (or dead). Where index files tell
        other processes which packs exist, a snapshot without them is written first: a save that
        reads it never counts on them, and a crash in between leaves packs no index names, which
        the next GC finds by listing."""
        if not names:
            return
        if self.writes_journals:
            self.consolidate(excluding=set(names), removing=removing)
        for name in names:
            self.backend.delete(name)
        self._drop_packs(names)

    def _batches(self, live_bytes: dict[str, int]) -> Iterator[list[str]]:
        """The packs to merge in groups whose live blocks fit in the room the medium has left.

        Packs with the fewest live bytes come first: on a full disk each group is rewritten and
        its old packs deleted before the next is written, so the room grows as GC goes.
        """
        order = sorted(live_bytes, key=live_bytes.__getitem__)
        while order:
            free = self.backend.free_space()
            batch: list[str] = []
            need = 0
            for name in order:
                live = live_bytes[name]
                if free is not None and batch and need + live + SPACE_MARGIN > free:
                    break
                batch.append(name)
                need += live
            if free is not None and need + SPACE_MARGIN > free:
                return  # not even the smallest fits
            order = order[len(batch) :]
            yield batch

    def _repack(self, merge: list[str], live: _LiveEntries) -> tuple[list[str], set[str]]:
        """Copy the live blocks of these packs into new packs, each verified first.

        A block whose copy here is damaged is taken from another copy; if none is good, its
        pack is kept (returned in the second item) so nothing that might be recovered is lost.
        Returns the new packs' names and the packs to keep. A full medium stops the rewrite:
        nothing is deleted then, and the old packs stay.
        """
        # Copies keep their codec: a version 2 pack is rewritten as one.
        writer = PackWriter(self, version=live.version(merge))
        kept: set[str] = set()
        try:
            for name in merge:
                try:
                    complete = self._copy_live(writer, name, live.entries(name))
                except _PackGone:
                    self._drop_packs([name])  # its blocks live on where its remover put them
                    complete = False
                if not complete:
                    kept.add(name)
            writer.commit()
        except OSError as exc:
            writer.abort()
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                return [], set(merge)
            raise
        except BaseException:
            writer.abort()
            raise
        return writer.published, kept

    def _copy_live(self, writer: PackWriter, name: str, live: list[Entry]) -> bool:
        """Append the verified live blocks of pack ``name`` to ``writer``; False if one has no good copy."""
        complete = True
        for stored, e in self._stored_blocks(name, live):
            try:
                raw = self._decoded(name, e, stored)
                if cidlib.matches(e.cid, raw):
                    writer.add_copy(e.cid, raw, stored=Stored(e.codec, stored))
                    continue
            except CorruptStore:
                pass
            self._mark_bad(e.cid, Location.of(name, e))
            try:
                writer.add_copy(e.cid, self._read_good(e.cid, True, self._fetch))
            except (CorruptBlock, BlockNotFound):
                complete = False
        return complete

    def sibling(self, directory: str, suffix: str) -> Backend | None:
        return self.backend.sibling(directory, suffix)

    def clean_temp(self) -> int:
        self._check_writable()
        return self.backend.clean_temp(self.backend.min_grace)

    def close(self) -> None:
        with self._lock:
            pool, self._publisher_pool = self._publisher_pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        if self._catalog is not None:
            self._catalog.backend.close()  # a sibling: its own descriptors, the medium stays open
        self.backend.close()


class _PackGone(RepositoryError):
    """A pack being copied is gone (another process merged or collected it first)."""


class _LiveEntries:
    """The kept entries of the packs a sweep or merge rewrites, made one pack at a time (a
    rewrite of every pack must not hold an object per block of all of them)."""

    def __init__(self, table: Table, names: list[str], kept: np.ndarray, packs: list[str]) -> None:
        self.table, self.names, self.kept = table, names, kept
        ids = {name: pack for pack, name in enumerate(names)}
        found = rows_by_pack(table, [ids[name] for name in packs])
        self._rows = {names[pack]: rows for pack, rows in found.items()}

    def _kept_rows(self, name: str) -> np.ndarray:
        rows = self._rows[name]
        return rows[self.kept[rows]]

    def entries(self, name: str) -> list[Entry]:
        rows = self._kept_rows(name)
        keys = self.table.key_array[rows].tolist()
        locations = self.table.location_array[rows].tolist()
        return [Entry(cid_of(key), offset, length, codec, size)
                for key, (_, offset, length, codec, size) in zip(keys, locations, strict=True)]

    def count(self, name: str) -> int:
        return len(self._kept_rows(name))

    def bytes(self, name: str) -> int:
        return int(self.table.location_array["length"][self._kept_rows(name)].sum())

    def version(self, names: list[str]) -> int:
        """The pack format a rewrite of these packs' kept blocks needs (2 if one is compressed)."""
        codecs = self.table.location_array["codec"]
        return 2 if any(codecs[self._kept_rows(name)].any() for name in names) else 1


def _epoch(name: str) -> int:
    parsed = parse_name(name)
    return parsed.epoch if parsed is not None else 0


def _runs(locs: list[Location], limit: int) -> Iterator[list[int]]:
    """Group consecutive locations that lie back to back in one pack, at most ``limit`` bytes each."""
    run: list[int] = []
    for i, loc in enumerate(locs):
        if run:
            last, start = locs[run[-1]], locs[run[0]].offset
            if (loc.pack == last.pack and loc.offset == last.offset + last.length
                    and loc.offset + loc.length - start <= limit):
                run.append(i)
                continue
            yield run
        run = [i]
    if run:
        yield run


# --------------------------------------------------------------------------------------------
# The packed store on each medium: only the backend differs
# --------------------------------------------------------------------------------------------
class LocalStore(PackedBlockStore):
    """Packed blocks in a directory (``packs/`` and ``tmp/`` below ``root``)."""

    def __init__(
        self, root: str | Path, *, verify: bool = True, read_only: bool = False,
        pack_size: int | None = None,
    ) -> None:
        super().__init__(LocalBackend(root, read_only=read_only), verify=verify, pack_size=pack_size)
        self.local: LocalBackend = self.backend  # type: ignore[assignment]

    @property
    def root(self) -> Path:
        return self.local.root

    @property
    def pack_dir(self) -> Path:
        return self.local.pack_dir

    @property
    def tmp_dir(self) -> Path:
        return self.local.tmp_dir


class MemoryStore(PackedBlockStore):
    """Packed blocks in memory, for tests and throwaway repositories."""

    def __init__(self, *, verify: bool = True, pack_size: int | None = None) -> None:
        super().__init__(MemoryBackend(), verify=verify, pack_size=pack_size)
        self.memory: MemoryBackend = self.backend  # type: ignore[assignment]


class S3Store(PackedBlockStore):
    """Packed blocks in an S3 bucket: ``<prefix>packs/<name>.pack`` objects (see S3Backend).

    ``bucket`` is an :class:`~cas_ckpt.backends.S3Bucket` or an ``s3://bucket/prefix`` URL.
    """

    def __init__(
        self, bucket: S3Bucket | str, *, verify: bool = True, read_only: bool = False,
        pack_size: int | None = None, part_size: int = PART_SIZE, read_size: int = READ_SIZE,
        cache_dir: str | os.PathLike[str] | None = None, min_grace: float = DEFAULT_GRACE,
    ) -> None:
        backend = S3Backend(bucket, read_only=read_only, part_size=part_size, read_size=read_size,
                            cache_dir=cache_dir, min_grace=min_grace)
        super().__init__(backend, verify=verify, pack_size=pack_size)
        self.s3: S3Backend = backend

    @property
    def bucket(self) -> S3Bucket:
        return self.s3.bucket

    @property
    def tmp_dir(self) -> Path:
        return self.s3.spool_dir
