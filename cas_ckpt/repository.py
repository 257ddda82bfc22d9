"""The repository: save, load and history on top of a block store and a ref store.

The write order is the whole crash-safety argument: every block of a checkpoint (chunks, nodes,
then the commit) is durable before the ref moves, and the ref moves only by compare-and-swap. A
crash at any point leaves the ref at the old checkpoint or the new one, never at a torn one.
"""

from __future__ import annotations

import builtins
import contextlib
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, overload

import numpy as np
from multiformats import CID

from cas_ckpt import car, hf, replication
from cas_ckpt import cid as cidlib
from cas_ckpt.backends.http import HttpRemote, is_http
from cas_ckpt.backends.s3 import S3Bucket
from cas_ckpt.blocks.base import BlockStore, BlockWriter, WriteStats
from cas_ckpt.blocks.compression import SETTINGS, check_setting
from cas_ckpt.blocks.http import HttpBlockStore
from cas_ckpt.blocks.packed import LocalStore, MemoryStore, S3Store
from cas_ckpt.codec import MAX_NODE_SIZE, Link
from cas_ckpt.commit import Commit, encode_commit, is_commit, parse_commit
from cas_ckpt.errors import (
    AmbiguousCID,
    AncestorNotFound,
    BlockNotFound,
    CarError,
    CasCkptError,
    CheckpointExpired,
    CorruptBlock,
    DecodeError,
    InvalidCID,
    InvalidRefName,
    MapLocationError,
    MediumError,
    PathNotFound,
    RefConflict,
    RefError,
    ReflogEntryNotFound,
    RefNotFound,
    RepositoryError,
    StateTypeError,
    StepTargetNotFound,
)
from cas_ckpt.grid import state_root
from cas_ckpt.history import CommitGraphReport, History
from cas_ckpt.maintenance.diff import DiffReport, compare
from cas_ckpt.maintenance.fsck import FsckReport
from cas_ckpt.maintenance.fsck import check as fsck_check
from cas_ckpt.maintenance.gc import DEFAULT_REFLOG_EXPIRY, GCReport
from cas_ckpt.maintenance.gc import collect as gc_collect
from cas_ckpt.maintenance.lanes import GraphRow, ancestry, layout
from cas_ckpt.maintenance.tensors import (
    NonFiniteReport,
    NonFiniteScan,
    TensorStats,
    array_leaves,
    nonfinite_metric,
    tensor_stats,
)
from cas_ckpt.maintenance.upkeep import Policy as UpkeepPolicy
from cas_ckpt.maintenance.upkeep import UpkeepReport, UpkeepStatus
from cas_ckpt.maintenance.upkeep import due as upkeep_due
from cas_ckpt.maintenance.upkeep import run as upkeep_run
from cas_ckpt.maintenance.upkeep import status as upkeep_status
from cas_ckpt.maintenance.usage import Usage, usage
from cas_ckpt.maintenance.walk import walk
from cas_ckpt.paths import select
from cas_ckpt.refs import LocalRefStore, MemoryRefStore, ReflogEntry, RefStore, check_ref_name
from cas_ckpt.refs.base import run_of, step_ref
from cas_ckpt.refs.http import HttpRefStore
from cas_ckpt.replication import TransferReport, Update
from cas_ckpt.tree import MAX_CHUNK, TreeReader, TreeWriter, cast_floats

_log = logging.getLogger("cas_ckpt")

FORMAT = "cas_ckpt"
FORMAT_VERSION = 4  # 2: packs may hold compressed blocks (pack format version 2); 3: index files
# tell which packs exist (object storage: docs/format.md, "Index files"); 4: on S3, refs deleted by
# tombstones and locks released by a state (only conditional PUTs)
# The first release that reads each version, recorded in the config ("requires") from version 4
# on, so that a reader too old to know a later version can name the release to upgrade to.
FIRST_RELEASE = {4: "0.3"}
DEFAULT_COMPRESSION = "none"

Target = CID | str | bytes
# A unique prefix of a node CID's base32 text, as git takes abbreviated hashes (8 characters at least).
_CID_PREFIX = re.compile(r"b[a-z2-7]{7,}")
_REFLOG_SELECTOR = re.compile(r"(.+)@\{(\d+)\}")  # REF@{N}: what REF held N updates ago
_STEP_SELECTOR = re.compile(r"(.+)@(\d+)")  # REF@STEP: REF's checkpoint of that step

# Texts that are meant as CIDs (raw chunks bafk..., nodes bag..., CIDv0 Qm...): say why they are not.
_CID_START = ("baf", "bag", "Qm")


@dataclass
class SaveReport:
    """What a save did: the figures for dedup accounting."""

    cid: CID
    ref: str
    logical_bytes: int
    blocks_written: int
    bytes_written: int
    blocks_reused: int
    bytes_reused: int
    seconds: float
    bytes_stored: int  # what the new blocks take on the medium, after compression

    __repr__ = cidlib.readable_repr

    @classmethod
    def of(cls, txn: Transaction, commit: bytes, ref: str, started: float) -> SaveReport:
        """The report of a save that committed ``commit`` through ``txn`` (begun at ``started``)."""
        s = txn.stats
        return cls(cidlib.to_cid(commit), ref, txn.tree.logical_bytes, s.blocks_written, s.bytes_written,
                   s.blocks_reused, s.bytes_reused, time.perf_counter() - started, s.bytes_stored)


class Transaction:
    """A batch of blocks on its way in (see :meth:`Repository.transaction`).

    ``tree`` writes state values as trees and ``blocks`` takes raw blocks (a CAR import);
    ``move_ref`` queues a ref move for after the blocks are durable.
    """

    def __init__(self, repo: Repository, blocks: BlockWriter) -> None:
        self.repo = repo
        self.blocks = blocks
        self.tree = TreeWriter(blocks, repo.hasher, repo.pool, chunk_size=repo.config.chunk_size)
        self.moves: list[tuple[str, bytes | None, bytes, str]] = []
        self.commits: dict[bytes, bytes] = {}  # the commit nodes written, for the commit graph
        self.pins: list[bytes] = []

    @property
    def stats(self) -> WriteStats:
        return self.blocks.stats

    def put_commit(
        self, tree: bytes, parents: list[bytes], *, step: int | None, metadata: dict[str, Any],
        message: str | None,
    ) -> bytes:
        """Store the commit node of a checkpoint of ``tree``; return its binary CID."""
        node = encode_commit(tree, parents, step=step, time=time.time(), metadata=metadata,
                             message=message)
        if len(node) > MAX_NODE_SIZE:  # no reader would decode it (docs/format.md, "Block sizes")
            raise StateTypeError("metadata", f"the commit of metadata and message takes {len(node)} "
                                 f"bytes, over the {MAX_NODE_SIZE} a node may hold: store large "
                                 "values in the state")
        cid = self.repo.hasher.node(node)
        self.blocks.put(cid, node)
        self.commits[cid] = node
        return cid

    def move_ref(self, ref: str, old: bytes | None, new: bytes, message: str) -> None:
        """Move ``ref`` from ``old`` (None: it must not exist) to ``new`` once the blocks are durable."""
        self.moves.append((check_ref_name(ref), old, new, message))

    def pin(self, cid: bytes) -> None:
        """Pin ``cid`` once the blocks are durable, before any ref moves."""
        self.pins.append(cid)


@dataclass
class _Config:
    hash: str
    chunk_size: int
    compression: str = "none"
    version: int = 1
    extra: dict[str, Any] = field(default_factory=dict)


class Repository:
    """Checkpoints as content-addressed blocks, with named refs to the latest ones.

    Thread-safe: threads may share one repository (each save takes the shared save lock and moves
    its ref by compare-and-swap, exactly as separate processes do).
    """

    def __init__(
        self,
        blocks: BlockStore,
        refs: RefStore,
        *,
        hash: str = "sha2-256",
        chunk_size: int = MAX_CHUNK,
        compression: str | None = None,
        create: bool = True,
        location: str = "",
        upkeep: bool | Mapping[str, Any] = True,
        occupied: Callable[[], str | None] = lambda: None,
    ) -> None:
        """``occupied``: asked before a repository is created in ``refs``, what else lies there
        (a sentence; None: nothing), which then refuses the creation."""
        self.blocks = blocks
        self.refs_store = refs
        self.location = location
        self.upkeep_policy = UpkeepPolicy.of(upkeep)
        self.config = _ensure_config(
            refs, location or "this store", create=create and not blocks.read_only, hash=hash,
            chunk_size=chunk_size, compression=compression, read_only=blocks.read_only,
            occupied=occupied,
        )
        if not blocks.read_only and self.config.version < refs.format_version:
            # Before any write of the newer kind: writers that do not know it must stop writing.
            self._update_config(version=refs.format_version)
        self.hasher = cidlib.Hasher(self.config.hash)
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._local = threading.local()
        self.history = History(blocks, lambda: self.pool)  # commits, through the commit graph

    # -- plumbing ------------------------------------------------------------------------------
    @property
    def pool(self) -> ThreadPoolExecutor:
        """Worker threads for hashing and reads (hashlib and blake3 release the GIL)."""
        if self._pool is None:
            with self._pool_lock:
                if self._pool is None:
                    workers = max(2, os.cpu_count() or 2)
                    self._pool = ThreadPoolExecutor(workers, thread_name_prefix="cas_ckpt")
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self.history.close()
        self.blocks.close()

    def __enter__(self) -> Repository:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<cas_ckpt.Repository {self.location or type(self.blocks).__name__}>"

    @property
    def read_only(self) -> bool:
        """True if opened with ``read_only=True``: every write (saves, refs, pins, GC) refuses."""
        return self.blocks.read_only

    def _check_writable(self) -> None:
        if self.read_only:
            raise RepositoryError(f"repository {self.location or 'store'} is open read-only")

    # -- saving --------------------------------------------------------------------------------
    def save(
        self,
        state: Any,
        *,
        ref: str = "main",
        step: int | None = None,
        metadata: Mapping[str, Any] | None = None,
        message: str | None = None,
        expected: Target | None = None,
        compression: str | None = None,
    ) -> CID:
        """Store ``state`` as a new checkpoint and move ``ref`` to it; return its root CID.

        The ref moves by compare-and-swap from ``expected`` (default: whatever it holds when the
        save starts; pass the CID you loaded to make a read-modify-write safe). Raises
        :class:`RefConflict` if it holds something else by then (the blocks stay stored; load the
        new head and save again), :class:`StateTypeError` naming the path of a value that cannot
        be saved. ``compression`` (``"none"``, ``"zstd"``) overrides the repository's for the
        blocks this save writes; CIDs never depend on it.
        """
        return self.commit_tree(lambda tree: tree.write(state), ref=ref, step=step, metadata=metadata,
                                message=message, expected=expected, compression=compression)

    def commit_tree(
        self,
        write: Callable[[TreeWriter], bytes],
        *,
        ref: str = "main",
        step: int | None = None,
        metadata: Mapping[str, Any] | None = None,
        message: str | None = None,
        expected: Target | None = None,
        compression: str | None = None,
    ) -> CID:
        """:meth:`save` of a tree that ``write`` stores through the writer it is given, returning
        its root node's binary CID: for integrations that lay out their own root around a state
        (``cas_ckpt.dcp``). The tree becomes durable, then its commit, then the ref moves, as in
        :meth:`save`."""
        check_ref_name(ref)
        step = _step(step)
        meta = _plain(dict(metadata or {}), "metadata")
        if message is not None and not isinstance(message, str):
            raise StateTypeError("message", "message must be a str")
        started = time.perf_counter()
        with self.transaction(compression=compression) as txn:
            old = self.refs_store.get(ref) if expected is None else self._resolve(expected)
            tree = write(txn.tree)
            commit = txn.put_commit(tree, [old] if old else [], step=step, metadata=meta, message=message)
            txn.move_ref(ref, old, commit, f"save step={step}" if step is not None else "save")
        self._local.last_save = SaveReport.of(txn, commit, ref, started)
        return self._local.last_save.cid

    @property
    def last_save(self) -> SaveReport | None:
        """The report of this thread's latest successful save."""
        return getattr(self._local, "last_save", None)

    @contextlib.contextmanager
    def transaction(
        self, *, verify_existing: bool = False, verify_incoming: bool = False,
        compression: str | None = None, upkeep: bool = True, learn: bool = True,
    ) -> Iterator[Transaction]:
        """The one write path: blocks first, durable, then refs, all under the shared save lock.

        Yields a :class:`Transaction`; everything written into it becomes durable and visible
        when the ``with`` block ends without an exception, and only then do the pins and then the
        ref moves it queued happen, each ref move by compare-and-swap. An exception discards the
        batch and moves nothing. GC (which takes the lock exclusively) cannot sweep a block the transaction
        deduplicated against. ``verify_existing`` re-reads and checks every stored block the
        transaction would reuse, storing a good copy over a damaged one (imports do: a re-import
        repairs). ``verify_incoming`` hashes every block put into it before writing it, and
        refuses (:class:`CorruptBlock`) one that does not match its CID: for blocks received from
        another repository (a push, pull or clone writes through it so, whatever the other side's
        ``verify``). ``compression`` overrides the repository's setting for this batch. A failure
        of the medium raises :class:`MediumError` (an OSError too). Once the refs have moved, upkeep
        runs if it is due and the repository's policy is automatic (``upkeep=False``: not after
        this batch; the ranks of a DCP save leave it to the coordinator). ``learn=False``: the
        block index takes in only removals before the batch, not the blocks other processes stored
        since this one last looked (dedup may miss them; a DCP coordinator shares its ranks').
        """
        codec = self.config.compression if compression is None else check_setting(compression)
        with self._writing(), self.refs_store.lock(exclusive=False):
            self._ensure_format(codec)
            self.blocks.refresh() if learn else self.blocks.refresh(learn=False)
            with self.blocks.writer(verify_existing=verify_existing, verify_incoming=verify_incoming,
                                    compression=codec) as writer:
                txn = Transaction(self, writer)
                yield txn
            for cid in txn.pins:
                self.refs_store.pin(cid)
            for ref, old, new, message in txn.moves:
                self._move_ref(ref, old, new, message)
        if txn.moves:  # the commits are durable and named: the commit graph may hold them now
            self.history.saved([new for _ref, _old, new, _message in txn.moves], txn.commits)
        if upkeep:
            self._auto_upkeep()

    def upkeep(self, *, force: bool = False) -> UpkeepReport:
        """Merge small packs, write an index snapshot and take stored history the commit graph
        lacks into it, each if due (every task with ``force``), as saves do by themselves unless
        the repository was opened with ``upkeep=False``. Safe beside saves, loads and GC in any
        process; one upkeep runs at a time (a second one returns a report saying so). See
        ``docs/gc.md``, "Upkeep"."""
        with self._writing():
            self._ensure_format()
            return upkeep_run(self.blocks, self.refs_store, self.upkeep_policy, self.history, force=force)

    def upkeep_status(self) -> UpkeepStatus | None:
        """Packs, small packs, what an open reads besides the index snapshot, and which upkeep
        tasks are due (None for a store without packs)."""
        return upkeep_status(self.blocks, self.refs_store, self.upkeep_policy, self.history)

    def _auto_upkeep(self) -> None:
        """Upkeep after a write, when due; its failure is logged, never raised (the write is done)."""
        if not self.upkeep_policy.auto or not upkeep_due(
            self.blocks, self.refs_store, self.upkeep_policy, self.history
        ):
            return
        try:
            self.upkeep()
        except (CasCkptError, OSError) as exc:
            _log.warning("upkeep of %s failed, the save itself is complete: %s", self.location or self, exc)

    def _ensure_format(self, codec: str = "none") -> None:
        """Raise the config's format version to what the writes about to happen need, before
        they happen (a version 2 pack, a first index file on object storage)."""
        need = max(self.blocks.format_version, 2 if codec != "none" else 1)
        if self.config.version < need:
            self._update_config(version=need)

    def set_compression(self, compression: str) -> None:
        """Make ``compression`` the repository's setting (recorded in its config) for later saves.

        Blocks already stored keep their encoding; ``"none"`` stops compressing new ones.
        """
        check_setting(compression)
        if compression != self.config.compression:
            with self._writing():
                self._update_config(compression=compression, version=2 if compression != "none" else 1)

    def _update_config(self, *, compression: str | None = None, version: int = 1) -> None:
        """Record settings in the config by compare-and-swap (a racing change is re-read)."""
        for _ in range(8):
            old = self.refs_store.read_config() or {}
            new = _versioned({**old, "version": max(version, old.get("version", 1))})
            if compression is not None:
                new["compression"] = compression
            if old == new or self.refs_store.update_config(old, new) == new:
                self.config = _check_config(new, self.location or "this store")
                return
        raise RepositoryError(f"the config of {self.location or 'the repository'} keeps changing")

    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        """Refuse on a read-only repository; a failure of the medium becomes :class:`MediumError`
        (an OSError too, errno and file kept) naming the repository."""
        self._check_writable()
        try:
            yield
        except MediumError:
            raise
        except OSError as exc:
            raise MediumError(f"writing to {self.location or 'the repository'} failed", exc) from exc

    def _move_ref(self, ref: str, old: bytes | None, new: bytes, message: str) -> None:
        if old is None:
            moved = self.refs_store.add_if_new(ref, new, message=message)
        else:
            moved = self.refs_store.set_if_equals(ref, old, new, message=message)
        if not moved:
            actual = self.refs_store.get(ref)
            raise RefConflict(
                ref,
                cidlib.to_str(old) if old else None,
                cidlib.to_str(actual) if actual else None,
            )

    # -- loading -------------------------------------------------------------------------------
    def resolve(self, target: Target = "main") -> CID:
        """The root CID a target stands for: a ref, a CID in any form, ``REF~N``, ``REF@{N}``,
        ``REF@STEP``, a CID prefix.

        ``REF~N`` is the N-th first-parent ancestor (``main~0`` is ``main``); ``REF@{N}`` what the
        ref held N updates ago; ``REF@STEP`` the checkpoint of that step (the run's
        ``REF.steps/N`` ref, else the newest commit at that step in its history); a prefix is at
        least 8 characters of a stored node's base32 CID (:class:`AmbiguousCID` if several
        match). A ref wins over the other readings of the same text.
        """
        return cidlib.to_cid(self._resolve(target))

    def _resolve(self, target: Target) -> bytes:
        if isinstance(target, (CID, bytes, bytearray, memoryview)):
            return cidlib.to_bytes(target)
        if not isinstance(target, str):
            raise InvalidCID(f"expected a ref name or CID, got {type(target).__name__}")
        try:
            found = self.refs_store.get(target)
        except InvalidRefName:
            found = None
        if found is not None:  # a ref wins over a CID, a prefix or an ancestor spelt the same
            return found
        base, tilde, depth = target.rpartition("~")
        if tilde and base and depth.isdigit():
            return self._ancestor(target, self._resolve(base), int(depth))
        if selector := _REFLOG_SELECTOR.fullmatch(target):
            return self._reflog_entry(target, selector[1], int(selector[2]))
        if selector := _STEP_SELECTOR.fullmatch(target):
            return self._at_step(target, selector[1], int(selector[2]))
        try:
            return cidlib.to_bytes(target)
        except InvalidCID as exc:
            error = exc
        if _CID_PREFIX.fullmatch(target):
            stored = self.blocks.keys()  # binary CIDs (iterating the store gives CID objects)
            matches = sorted({text for key in stored if cidlib.is_node(key)
                              and (text := cidlib.to_str(key)).startswith(target)})
            if len(matches) == 1:
                return cidlib.to_bytes(matches[0])
            if matches:
                raise AmbiguousCID(target, matches)
            if target.startswith(_CID_START):
                raise BlockNotFound(target, " (no ref, and no stored node CID starts so)")
        if target.startswith(_CID_START) or (len(target) > 40 and target[:1] == "b"):
            raise InvalidCID(f"{target!r} is neither a ref nor a valid CID: {error}") from None
        check_ref_name(target)
        raise self._no_ref(target) from None

    def _no_ref(self, name: str) -> RefNotFound:
        """The error for a ref that is not there, naming those that are (nearest first)."""
        try:
            existing = list(self.refs_store.names())
        except CasCkptError:  # a damaged ref store: the error at hand is still this one
            existing = None
        return RefNotFound(name, existing)

    def _reflog_entry(self, target: str, ref: str, back: int) -> bytes:
        """What ``ref`` held ``back`` updates ago (``REF@{N}``, as git's; ``@{0}`` is now)."""
        entries = self.refs_store.reflog(check_ref_name(ref))[::-1]
        if back >= len(entries):
            raise ReflogEntryNotFound(target, f"the reflog of {ref!r} has {len(entries)} entries")
        held = entries[back].new
        if held is None:
            raise ReflogEntryNotFound(
                target, f"that update deleted {ref!r}; it held {cidlib.to_str(entries[back].old)} "
                        f"before ({ref}@{{{back + 1}}})" if entries[back].old else "a deletion")
        return held

    def _at_step(self, target: str, ref: str, step: int) -> bytes:
        """``REF@STEP``: the run's ``REF.steps/N`` ref (a checkpoint manager's, while retained),
        else the newest commit at ``step`` in ``ref``'s stored first-parent history."""
        held = self.refs_store.get(step_ref(check_ref_name(ref), step))
        if held is not None:
            return held
        head = self.refs_store.get(ref)
        if head is None:
            raise self._no_ref(ref)
        found = next((c.cid for c in self.history.log(head) if c.step == step), None)
        if found is None:
            raise StepTargetNotFound(target, f"no {ref}.steps/ ref holds step {step}, and no commit of "
                                             f"{ref}'s stored history is at that step")
        return cidlib.to_bytes(found)

    def _ancestor(self, target: str, cid: bytes, depth: int) -> bytes:
        """The ``depth``-th first-parent ancestor of commit ``cid`` (``target`` names it)."""
        lookup = self.history.lookup()
        for step in range(depth):
            try:
                parents = self.history.parents(cid, lookup)
            except BlockNotFound:  # history collected: the ancestor is not stored
                parents = []
            if not parents:
                raise AncestorNotFound(target, step)
            cid = parents[0]
        return cid

    def load(
        self,
        target: Target = "main",
        *,
        path: str | Sequence[Any] | None = None,
        verify: bool | None = None,
        map_location: Any = None,
        mmap: bool = False,
        dtype: Any = None,
    ) -> Any:
        """Load a checkpoint (or the sub-tree at ``path``, e.g. ``"optimizer.state.3"``).

        ``target`` is a ref name or a CID. Only the blocks of the requested sub-tree are read.
        ``path`` is a sequence of exact keys and indices, or a dotted string, read every way the
        keys allow (they may hold dots, as a state dict's do): a key (``"model.layer.0.weight"``),
        or a key prefix, which gives the map of the keys under it, named as in their map
        (``"model.encoder.layer.5"``: ``{"encoder.layer.5.attn.weight": ...}``, what
        ``module.load_state_dict(..., strict=False)`` takes); a path ending in ``.`` is a prefix
        only. :class:`PathNotFound` if no reading finds anything, :class:`AmbiguousPath` if
        several do (``docs/guide.md``, "Loading part of a checkpoint").
        Torch tensors come back as torch tensors (on ``map_location`` if given), numpy as numpy.
        ``mmap=True`` returns numpy arrays as read-only views of the pack files where a
        store can map them, and torch tensors over copy-on-write mappings (writable; a write
        copies that page, never touches the pack): no copy, pages read on first touch, and
        hashed first unless ``verify=False``. Arrays that cannot be mapped (another medium,
        chunks not back to back in one pack) are copied, and a warning is logged.
        ``dtype`` (a numpy or torch dtype) casts every floating-point array and tensor, copying
        it; integer and bool values stay as they are. ``map_location`` only places tensors.
        """
        root = self._resolve(target)
        reader = self._reader(verify, map_location, mmap)
        tree = self._tree_of(root, reader)
        try:
            value = Link(tree)
            if path is not None:
                value = select(reader, value, path, cidlib.to_str(root)).value
            loaded = reader.load(value)
            if reader.copied:
                _log.warning(
                    "mmap=True: %d of %d arrays of %s were copied, not mapped (chunks not back to "
                    "back in one local pack, or a medium that cannot map)",
                    reader.copied, reader.copied + reader.mapped, cidlib.to_str(root),
                )
            return loaded if dtype is None else cast_floats(loaded, dtype)
        except (MapLocationError, DecodeError) as exc:  # the reader named the path below ``path``
            if path:
                exc.inside(path if isinstance(path, str) else ".".join(map(str, path)))
            raise
        except BlockNotFound as exc:
            if tree != root and not self._held(root):
                raise CheckpointExpired(cidlib.to_str(root), exc.cid) from None
            raise  # GC keeps what refs and pins hold: a block missing there is damage

    def _held(self, root: bytes) -> bool:
        """True if a ref or a pin holds ``root`` (so GC never removed its data)."""
        try:
            store = self.refs_store
            return root in store.pins() or any(store.get(n) == root for n in store.names())
        except CasCkptError:
            return False

    def _reader(self, verify: bool | None, map_location: Any, mmap: bool = False) -> TreeReader:
        return TreeReader(self.blocks, self.pool, verify=verify, map_location=map_location, mmap=mmap)

    def tree(self, target: Target = "main") -> CID:
        """The root node of the state a checkpoint holds: its commit's tree (for a sharded save,
        the state that tree holds), or the node itself if no commit."""
        return cidlib.to_cid(self._tree_of(self._resolve(target), self._reader(None, None)))

    def _tree_of(self, root: bytes, reader: TreeReader) -> bytes:
        """The root node of the state checkpoint ``root`` holds (a sharded save's state: see
        :func:`grid.state_root`)."""
        if not cidlib.is_node(root):
            raise RepositoryError(f"{cidlib.to_str(root)} is a raw chunk, not a checkpoint")
        node = reader.node(root)
        return state_root(reader, bytes(parse_commit(root, node).tree) if is_commit(node) else root)

    def commit(self, target: Target = "main") -> Commit:
        """The commit record a ref or CID names."""
        return self.history.commit(self._resolve(target))

    # -- history and refs ----------------------------------------------------------------------
    def log(self, ref: Target = "main", *, limit: int | None = None) -> Iterator[Commit]:
        """Commits newest first, following each commit's first parent.

        Stops quietly where history was garbage collected, below the head; a head commit whose
        block is gone raises :class:`BlockNotFound` naming it (and ``ref``). Commits come from the
        commit graph where it holds them (a few requests for any history on S3), else from their
        blocks.
        """
        head = self._resolve(ref)
        try:
            return self.history.log(head, limit=limit)
        except BlockNotFound as exc:
            if exc.cid != cidlib.to_str(head):
                raise
            what = f"the head commit of ref {ref!r}" if isinstance(ref, str) and ref != exc.cid \
                else "the commit the log starts at"
            raise BlockNotFound(exc.cid, f" ({what}: the repository is damaged)") from None

    def expired(self, commit: Commit) -> bool:
        """True if GC removed ``commit``'s data (its tree node is gone): loading it would fail."""
        return not self.blocks.has(commit.tree)

    def forks(self, history: Iterable[Commit]) -> dict[CID, list[str]]:
        """Fork points in ``history``: for each run (a ref, with a manager's ``<ref>.steps/N``
        refs) whose refs lead off it, the newest shared commit, naming the run once."""
        on_line = {c.cid for c in history}
        point: dict[CID, CID | None] = {}  # commit off the line -> its fork point (None: none)
        found: dict[CID, list[str]] = {}
        for name, head in sorted(self.refs().items()):
            fork = self._fork_point(head, on_line, point)
            if fork is not None:
                runs = found.setdefault(fork, [])
                if run_of(name) not in runs:
                    runs.append(run_of(name))
        return found

    def _fork_point(self, head: CID, on_line: set[CID], point: dict[CID, CID | None]) -> CID | None:
        """The newest commit of ``head``'s history on the line (None if ``head`` is on it, or
        never meets it); ``point`` remembers it for every commit walked, so refs sharing a
        history (a run's step refs) walk it once."""
        if head in on_line:
            return None  # on this line (a head or a .steps/N ref), not a fork
        walked: list[CID] = []
        fork: CID | None = None
        try:
            history = self.log(head)
        except BlockNotFound:
            return None  # a damaged ref is no fork of this line (fsck reports it)
        for commit in history:
            if commit.cid in point:
                fork = point[commit.cid]
                break
            if commit.cid in on_line:
                fork = commit.cid
                break
            walked.append(commit.cid)
        point.update(dict.fromkeys(walked, fork))
        return fork

    def refs(self, prefix: str = "") -> dict[str, CID]:
        """Every ref (optionally only those under ``prefix``) and the root CID it holds."""
        return {name: cidlib.to_cid(value) for name, value in self.refs_store.values(prefix).items()}

    def reflog(self, ref: str = "main") -> list[ReflogEntry]:
        """Every update of ``ref``, oldest first, also after the ref was deleted (the last entry
        then has ``new`` None and ``old`` what it held); :class:`RefNotFound` if there is neither
        the ref nor a reflog of it. ``REF@{N}`` as a target is what ``ref`` held N updates ago."""
        entries = self.refs_store.reflog(check_ref_name(ref))
        if not entries and self.refs_store.get(ref) is None:
            raise self._no_ref(ref)
        return entries

    def restore_ref(self, ref: str) -> CID:
        """Create deleted ``ref`` again at what it held when it was deleted (its reflog says).

        :class:`RefNotFound` if its reflog records no deletion, :class:`RefError` if the ref
        exists, :class:`CheckpointExpired` if GC has freed that checkpoint's data since.
        """
        entries = self.refs_store.reflog(check_ref_name(ref))
        held = next((e.old for e in reversed(entries) if e.new is None and e.old is not None), None)
        if held is None:
            raise RefNotFound(ref)
        current = self.refs_store.get(ref)
        if current is not None:
            raise RefError(f"ref {ref!r} exists (it holds {cidlib.to_str(current)}): only a "
                           "deleted ref is restored")
        with self._writing(), self.refs_store.lock(exclusive=False):  # GC cannot sweep in between
            self.check_complete(held)
            self._move_ref(ref, None, held, f"restore {cidlib.to_str(held)}")
        return cidlib.to_cid(held)

    def drop_reflog(self, ref: str) -> None:
        """Forget the reflog of deleted ``ref``: what only it kept from GC goes at the next
        collection (GC drops such a reflog itself once every entry is past the expiry).

        :class:`RefError` if the ref exists, :class:`RefNotFound` if it has no reflog.
        """
        with self._writing():
            if self.refs_store.drop_reflog(check_ref_name(ref)):
                return
        if self.refs_store.get(ref) is not None:
            raise RefError(f"ref {ref!r} exists: only the reflog of a deleted ref is dropped")
        raise RefNotFound(ref)

    def set_ref(self, ref: str, target: Target, *, expected: Target | None = None) -> CID:
        """Point ``ref`` at ``target`` (compare-and-swap against ``expected`` when given)."""
        new = self._resolve(target)
        with self._writing(), self.refs_store.lock(exclusive=False):  # GC cannot sweep in between
            self.check_complete(new)  # never point a ref at a partial checkpoint
            old = self._resolve(expected) if expected is not None else self.refs_store.get(ref)
            self._move_ref(ref, old, new, f"set to {cidlib.to_str(new)}")
        return cidlib.to_cid(new)

    def delete_ref(self, ref: str, *, expected: Target | None = None) -> None:
        """Delete ``ref`` (only if it still holds ``expected``, when given)."""
        old = self._resolve(expected) if expected is not None else self.refs_store.get(ref)
        if old is None:
            raise self._no_ref(ref)
        with self._writing():
            removed = self.refs_store.remove_if_equals(ref, old, message="delete")
        if not removed:
            actual = self.refs_store.get(ref)
            raise RefConflict(ref, cidlib.to_str(old), cidlib.to_str(actual) if actual else None)

    def run_refs(self, ref: str) -> dict[str, CID]:
        """``ref``, the refs below it (``ref/...``), and its companions: a checkpoint manager's
        step refs (``ref.steps/...``) and Lightning's file refs (``ref.files/...``); each with the
        CID it holds."""
        companions = tuple(f"{check_ref_name(ref)}{suffix}" for suffix in ("/", ".steps/", ".files/"))
        return {name: cid for name, cid in self.refs().items()
                if name == ref or name.startswith(companions)}

    def delete_run(self, ref: str, *, dry_run: bool = False) -> dict[str, CID]:
        """Delete :meth:`run_refs` of ``ref``, ``ref`` itself last, each by compare-and-swap from
        the CID listed; return them (what would be deleted, with ``dry_run``).

        Their reflogs stay, so GC keeps their checkpoints for the reflog expiry and
        :meth:`restore_ref` brings each back. :class:`RefNotFound` if there is none;
        :class:`RefConflict` if one moved meanwhile (those before it are deleted: run it again).
        """
        found = self.run_refs(ref)
        if not found:
            raise RefNotFound(ref)
        if not dry_run:
            for name in sorted(found, key=lambda name: name == ref):
                self.delete_ref(name, expected=found[name])
        return found

    def rename_ref(self, old: str, new: str) -> CID:
        """Rename ``old`` to ``new`` (RefConflict if ``new`` exists); return the CID it holds.

        Two compare-and-swaps: ``new`` is created at ``old``'s CID, then ``old`` is deleted only if
        it still holds that CID. A crash (or a concurrent move of ``old``) in between leaves both
        refs, ``new`` at the CID ``old`` had: nothing is lost, and deleting ``old`` finishes it.
        """
        self._check_writable()
        cid = self.refs_store.get(check_ref_name(old))
        if cid is None:
            raise self._no_ref(old)
        with self._writing():
            with self.refs_store.lock(exclusive=False):
                self._move_ref(check_ref_name(new), None, cid, f"rename from {old}")
            moved = self.refs_store.remove_if_equals(old, cid, message=f"rename to {new}")
        if not moved:
            actual = self.refs_store.get(old)
            raise RefConflict(old, cidlib.to_str(cid), cidlib.to_str(actual) if actual else None)
        return cidlib.to_cid(cid)

    def fork(self, source: Target, ref: str) -> CID:
        """Start a new ``ref`` at ``source``'s checkpoint (RefConflict if ``ref`` exists).

        Saves to ``ref`` continue its history, and share every unchanged block with ``source``.
        """
        new = self._resolve(source)
        with self._writing(), self.refs_store.lock(exclusive=False):
            self.check_complete(new)
            self._move_ref(check_ref_name(ref), None, new, f"fork from {source}")
        return cidlib.to_cid(new)

    # -- maintenance ---------------------------------------------------------------------------
    def pin(self, target: Target) -> CID:
        """Keep ``target`` and everything it reaches through GC, without a ref."""
        cid = self._resolve(target)
        with self._writing(), self.refs_store.lock(exclusive=False):
            self.check_complete(cid)
            self.refs_store.pin(cid)
        return cidlib.to_cid(cid)

    def check_complete(self, target: Target) -> None:
        """Raise unless every block checkpoint ``target`` needs is stored and sound (nodes read
        and hashed, chunks looked up): :class:`CheckpointExpired` naming a missing block.

        A ref or pin at a partial checkpoint (say, a commit from the history whose data GC removed)
        would not load, and would make every later GC refuse to run. Call with the save lock held.
        """
        cid = self._resolve(target)
        self.blocks.refresh()
        self.blocks.get(cid)  # BlockNotFound / CorruptBlock for the root itself
        lookup = self.history.lookup()
        problems = walk(self.blocks, {cid: "target"}, check_raw=True, nodes=lookup.links).problems
        if problems:
            first = next(iter(problems.values()))
            if first.kind == "missing":
                raise CheckpointExpired(cidlib.to_str(cid), first.cid)
            if first.kind == "corrupt":
                raise CorruptBlock(first.cid)
            raise DecodeError(first.detail)

    def unpin(self, target: Target) -> bool:
        """Drop a pin; False if it was not pinned."""
        with self._writing():
            return self.refs_store.unpin(self._resolve(target))

    def pins(self) -> list[CID]:
        return sorted((cidlib.to_cid(c) for c in self.refs_store.pins()), key=str)

    def gc(
        self,
        *,
        grace: float = 0.0,
        reflog_expiry: float = DEFAULT_REFLOG_EXPIRY,
        expire_reflogs: Iterable[str] = (),
        dry_run: bool = False,
        progress: Callable[[str, int], None] | None = None,
    ) -> GCReport:
        """Remove blocks no ref, pin or reflog entry newer than ``reflog_expiry`` s reaches.

        Reflog entries (default: 30 days) keep what is still there; ``reflog_expiry=0`` keeps only
        what refs and pins reach. ``expire_reflogs``: refs a retention policy governs, whose
        reflogs keep nothing (``"run.steps/"`` covers every ref below). Blocks stored less than
        ``grace`` seconds ago are kept. Waits for saves in progress and blocks new ones while it
        runs. See ``docs/gc.md``.
        """
        if isinstance(self.refs_store, HttpRefStore) and not dry_run:  # the server collects its own
            self._check_writable()
            found = self.refs_store.collect(list(expire_reflogs))
            return GCReport(**{k: v for k, v in found.items() if k in GCReport.__dataclass_fields__})
        with contextlib.nullcontext() if dry_run else self._writing():
            if not dry_run:
                self._ensure_format()
            return gc_collect(
                self.blocks, self.refs_store, grace=grace, reflog_expiry=reflog_expiry,
                expire_reflogs=expire_reflogs, dry_run=dry_run, progress=progress,
                commits=self.history.lookup().links,  # lineage from the commit graph, not a read each
            )

    def fsck(
        self,
        *,
        sample: float | None = None,
        progress: Callable[[str, int, int], None] | None = None,
    ) -> FsckReport:
        """Re-hash every block (or a ``sample`` fraction) and resolve every link from refs; the
        commit graph's layers are checked too (a damaged one is a store problem: history reads
        past it, and :meth:`update_commit_graph` rewrites it)."""
        report = fsck_check(self.blocks, self.refs_store, sample=sample, progress=progress)
        report.store_problems.extend(
            f"damaged commit-graph layer {name}: {why} (ignored by reads; `cas-ckpt commit-graph` "
            "rewrites it)" for name, why in sorted(self.history.check().items()))
        return report

    def update_commit_graph(self, *, consolidate: bool = False) -> CommitGraphReport:
        """Bring the commit graph up to date: every commit a ref or pin reaches copied into it (a
        repository written by 0.2 gets one), what damaged layers held rebuilt; ``consolidate``
        merges all layers into one, leaving out commits GC removed.

        Saves keep the graph up to date on their own, a layer every 16 commits, and history
        queries read what it lacks from the blocks: this is for upkeep. See ``docs/format.md``.
        """
        with self._writing():
            return self.history.update(self.refs_store, consolidate=consolidate)

    @overload
    def stats(self, *, reflog_expiry: float = DEFAULT_REFLOG_EXPIRY) -> Usage: ...

    @overload
    def stats(self, target: Target, path: str | None = None) -> list[TensorStats]: ...

    def stats(
        self, target: Target | None = None, path: str | None = None, *,
        reflog_expiry: float = DEFAULT_REFLOG_EXPIRY,
    ) -> Usage | list[TensorStats]:
        """Without ``target``: logical versus stored bytes per ref, per run (shared, and
        exclusive: what deleting the run would free) and for the repository (shared bytes once),
        and what GC would free: its ``unreachable`` is :meth:`gc`'s with the same
        ``reflog_expiry`` (see :class:`Usage`), and where upkeep stands (``Usage.upkeep``).

        With ``target``: the statistics of every tensor of that checkpoint (below the dotted
        ``path``, or of the one tensor there), in the state's order: min, max, mean, std and L2
        norm of the finite elements, and the count of NaN and infinite ones
        (:class:`~cas_ckpt.maintenance.tensors.TensorStats`). Chunks are streamed: memory stays at
        a few chunks whatever the checkpoint's size.
        """
        if target is None:
            if path is not None:
                raise TypeError("stats(path=...) needs a target")
            found = usage(self.blocks, self.refs_store, reflog_expiry=reflog_expiry)
            found.upkeep = self.upkeep_status()
            return found
        root = self._resolve(target)
        reader = TreeReader(self.blocks, self.pool)
        tree = self._tree_of(root, reader)
        with self._expired_named(root, tree):
            start: Any = Link(tree)
            if path:
                start = select(reader, start, path, cidlib.to_str(root)).value
            return [tensor_stats(reader, where, leaf)
                    for where, leaf in array_leaves(reader, start, path or "")]

    def find_nonfinite(self, ref: Target = "main", *, path: str | None = None) -> NonFiniteReport:
        """The first checkpoint of ``ref``'s history (oldest first, following first parents) in
        which any tensor (below the dotted ``path``) holds a NaN or an infinity, with those
        tensors' statistics. Checkpoints whose data GC removed are passed over and counted (with
        the first one's step, and the first with a NaN or infinite metric: their data is gone,
        not their metadata); :meth:`NonFiniteReport.message` says so. Each chunk is read once,
        however many checkpoints share it.
        """
        history = list(self.log(ref))[::-1]
        reader = TreeReader(self.blocks, self.pool)
        scan = NonFiniteScan(reader)
        report = NonFiniteReport(ref if isinstance(ref, str) else cidlib.to_str(self._resolve(ref)))
        missing: PathNotFound | None = None
        for commit in history:
            if self.expired(commit):
                report.expired += 1
                if report.first_expired_step is None:
                    report.first_expired_step = commit.step
                if report.metric is None and (metric := nonfinite_metric(commit.metadata)) is not None:
                    report.metric, report.metric_step = metric, commit.step
                continue
            start: Any = Link(state_root(reader, bytes(commit.tree)))
            if path:
                try:
                    start = select(reader, start, path, cidlib.to_str(bytes(commit.cid))).value
                except PathNotFound as exc:
                    missing = missing or exc
                    continue
            report.checked += 1
            found = scan.scan(start, path or "")
            if found:
                report.commit, report.step = commit.cid, commit.step
                report.tensors = [tensor_stats(reader, where, leaf) for where, leaf in found]
                return report
        if missing is not None and not report.checked:
            raise missing
        return report

    def graph(self, refs: Iterable[str] | None = None, *, limit: int | None = None) -> list[GraphRow]:
        """The commits of ``refs`` (default: every ref but a manager's ``<run>.steps/<step>``
        ones) through every parent, children first and otherwise newest first, each in its lane
        as ``git log --graph`` draws it: forks join where they branched, merges open a lane per
        parent (:class:`~cas_ckpt.maintenance.lanes.GraphRow`). ``limit``: the first rows only.
        """
        names = [n for n in self.refs() if run_of(n) == n] if refs is None else list(refs)
        rows = layout(ancestry([self.resolve(name) for name in names], self._commit_or_none))
        return rows if limit is None else rows[:limit]

    def _commit_or_none(self, cid: CID) -> Commit | None:
        """The commit ``cid`` names; None where its node is gone or is not a commit."""
        try:
            return self.commit(cid)
        except (BlockNotFound, DecodeError):
            return None

    @contextlib.contextmanager
    def _expired_named(self, root: bytes, tree: bytes) -> Iterator[None]:
        """A block missing below a checkpoint GC expired raises CheckpointExpired, not damage."""
        try:
            yield
        except BlockNotFound as exc:
            if tree != root and not self._held(root):
                raise CheckpointExpired(cidlib.to_str(root), exc.cid) from None
            raise

    def diff(self, a: Target, b: Target, *, path: str | None = None) -> DiffReport:
        """Values added, removed and changed from checkpoint ``a`` to ``b`` (below the dotted
        ``path`` only, if given), in the state's order, and the bytes the two share. A changed
        array of one shape carries ``max_abs``, ``l2`` (``‖a-b‖``), ``a_norm`` and ``relative``
        (``‖a-b‖/‖a‖``), streamed chunk by chunk from both sides; arrays with the same CIDs are
        unchanged and never read (``report.by_tensor()`` sorts the changed ones)."""
        reader = TreeReader(self.blocks, self.pool, tensor_factory=lambda array, _: array)
        tree_a = self._tree_of(self._resolve(a), reader)
        tree_b = self._tree_of(self._resolve(b), reader)
        return compare(reader, self.blocks, tree_a, tree_b, path)

    # -- replication ---------------------------------------------------------------------------
    def push(
        self, remote: Repository | str | os.PathLike[str], ref: str = "main", *,
        remote_ref: str | None = None, force: bool = False, head_only: bool = False,
        progress: replication.Progress | None = None, storage_options: Mapping[str, Any] | None = None,
    ) -> TransferReport:
        """Send ``ref``'s checkpoint and history to ``remote`` and move ``remote_ref`` (default
        ``ref``) there; only the blocks ``remote`` lacks travel. A run moves as a run: its
        checkpoint manager's step refs (``ref.steps/N``) move too, as ``remote_ref.steps/N``,
        unless ``head_only``.

        ``remote`` is a location (a directory, ``s3://bucket/prefix``, created if missing, with
        this repository's hash; ``http(s)://`` a ``cas-ckpt serve --write-token`` server, its
        write token in ``storage_options={"token": ...}`` or ``$CAS_CKPT_TOKEN``) or an open
        :class:`Repository`. The remote ref moves by compare-and-swap once every block is durable
        there; :class:`RefDiverged` (before anything is sent) if it holds a commit not in ``ref``'s
        history, unless ``force``; :class:`RefConflict` if it moved meanwhile. A push that died is
        simply run again: it sends only what is still missing. ``storage_options`` open a remote
        given by its location, as :func:`open` takes them. See ``docs/scale-out.md``.
        """
        updates = _run_updates(self, ref, remote_ref or ref, force=force, head_only=head_only)
        with _other(remote, self, create=True, storage_options=storage_options) as dst:
            try:
                report = replication.transfer(self, dst, updates, progress=progress)
            except CheckpointExpired:
                if not is_http(dst.location or ""):
                    raise
                # the server collected a block it had when asked, before the ref moved: ask again
                report = replication.transfer(self, dst, updates, progress=progress)
        self._local.last_transfer = report
        return report

    def pull(
        self, remote: Repository | str | os.PathLike[str], ref: str = "main", *,
        remote_ref: str | None = None, force: bool = False, head_only: bool = False,
        progress: replication.Progress | None = None, storage_options: Mapping[str, Any] | None = None,
    ) -> TransferReport:
        """Fetch ``remote_ref`` (default ``ref``) from ``remote`` into this repository's ``ref``:
        :meth:`push` the other way round (:class:`RefDiverged` if ``ref`` here holds commits the
        remote's history lacks, unless ``force``; the run's step refs too, unless ``head_only``).
        ``storage_options`` open a remote given by its location (as :func:`open` takes them: an
        HTTP server's ``token``, ``timeout``...)."""
        check_ref_name(ref)
        with _other(remote, self, create=False, read_only=True, storage_options=storage_options) as src:
            updates = _run_updates(src, remote_ref or ref, ref, force=force, head_only=head_only)
            report = replication.transfer(src, self, updates, progress=progress)
        self._local.last_transfer = report
        return report

    def fetch(
        self, cid: Target, *, gateway: str, ref: str | None = None, pin: bool = False,
        force: bool = False, progress: replication.Progress | None = None,
        storage_options: Mapping[str, Any] | None = None,
    ) -> TransferReport:
        """Fetch checkpoint ``cid`` (a root CID from anywhere) from any IPFS trustless gateway
        (``cas-ckpt serve`` is one), block by block, each verified against its CID before it is
        stored; only the blocks this repository lacks travel.

        ``ref``: move it to the checkpoint afterwards, as :meth:`pull` does (:class:`RefDiverged`
        unless ``force`` if it holds a commit not in the fetched history); ``pin``: pin it.
        Without either, the blocks are stored unreferenced and the next GC removes them. A
        gateway that answers with wrong bytes is refused (:class:`RemoteError` naming the CID and
        the URL, after bounded retries); nothing unverified is stored. ``storage_options`` go to
        the HTTP client (``token``, ``workers``, ``timeout``, ``min_rate``, ``attempts``...).
        """
        if not isinstance(cid, (CID, bytes, bytearray, memoryview)) and not isinstance(cid, str):
            raise InvalidCID(f"expected a CID, got {type(cid).__name__}")
        root = cidlib.to_bytes(cid)
        if ref is not None:
            check_ref_name(ref)
        self._check_writable()  # before anything travels
        source = gateway_source(gateway, **(storage_options or {}))
        try:
            updates = [Update(ref, root, force)] if ref is not None else []
            report = replication.transfer(source, self, updates, progress=progress,
                                          roots=[root] if pin or ref is None else [], pin=pin)
        finally:
            source.blocks.close()
        self._local.last_transfer = report
        return report

    @property
    def last_transfer(self) -> TransferReport | None:
        """The report of this thread's latest push, pull or clone of this repository."""
        return getattr(self._local, "last_transfer", None)

    def _head(self, ref: str) -> bytes:
        head = self.refs_store.get(check_ref_name(ref))
        if head is None:
            raise self._no_ref(ref)
        return head

    def export_car(
        self, target: Target, out: car.FileLike, *, progress: car.Progress | None = None
    ) -> car.CarReport:
        """Write checkpoint ``target`` and every block it needs as a CAR v1 file (see car.py)."""
        return car.write_car(self.blocks, self._resolve(target), out, progress=progress)

    def import_car(
        self, src: car.FileLike, *, ref: str | None = None, progress: car.Progress | None = None
    ) -> car.CarReport:
        """Store a CAR v1 file's blocks, all or nothing; point ``ref`` at its root if given.

        Without ``ref`` (or a pin) the imported blocks are unreferenced, and GC will remove them.
        """
        started = time.perf_counter()
        if ref is not None:
            check_ref_name(ref)
        with contextlib.ExitStack() as stack:
            stream = src if not isinstance(src, (str, os.PathLike)) else stack.enter_context(
                builtins.open(src, "rb")
            )
            with self.transaction(verify_existing=True) as txn:  # a re-import repairs damage
                report = car.stage_car(stream, txn.blocks, progress)
                if ref is not None:
                    if len(report.roots) != 1:
                        raise CarError(f"a ref needs a CAR with one root; this one has {len(report.roots)}")
                    root = bytes(report.roots[0])
                    txn.move_ref(ref, self.refs_store.get(ref), root, f"import {cidlib.to_str(root)}")
                    report.ref = ref
        report.blocks_new = txn.stats.blocks_written
        report.bytes_new = txn.stats.bytes_written
        report.seconds = time.perf_counter() - started
        return report


    def import_safetensors(
        self,
        src: str | os.PathLike[str],
        *,
        ref: str = "main",
        prefix: str = "model",
        step: int | None = None,
        message: str | None = None,
    ) -> CID:
        """Store a ``.safetensors`` file or a Hugging Face model folder as a checkpoint on ``ref``.

        Tensors become ordinary arrays under ``prefix`` (read through mmap, never whole), so
        identical tensors are stored once across fine-tunes and shardings; the headers and a
        folder's other files are kept so :meth:`export_safetensors` re-creates it byte for byte.
        A malformed file raises :class:`SafetensorsError` naming it and the tensor, and nothing is
        committed. ``repo.last_save`` reports the bytes written. See ``docs/guide.md``.
        """
        check_ref_name(ref)
        step = _step(step)
        if message is not None and not isinstance(message, str):
            raise StateTypeError("message", "message must be a str")
        started = time.perf_counter()
        with self.transaction() as txn:
            old = self.refs_store.get(ref)
            tree = hf.import_tree(txn.tree, src, prefix=prefix)
            commit = txn.put_commit(tree, [old] if old else [], step=step, metadata={}, message=message)
            txn.move_ref(ref, old, commit, f"import {os.path.basename(os.fspath(src))}")
        self._local.last_save = SaveReport.of(txn, commit, ref, started)
        return self._local.last_save.cid

    def export_safetensors(
        self,
        target: Target,
        out: str | os.PathLike[str],
        *,
        path: str | None = None,
        max_shard_size: int | str | None = None,
        tied: bool = False,
        model: bool = False,
    ) -> hf.SafetensorsReport:
        """Write checkpoint ``target`` as safetensors: ``out`` ending ``.safetensors`` is a file,
        anything else a folder.

        An imported file or folder comes back byte for byte (``path=None``); ``max_shard_size``
        (``"5GB"``, ``"500MiB"``, bytes) re-shards it. Any other checkpoint, or the dotted ``path``
        below it, is written as ``safetensors`` ``save_file`` writes the same tensors (strings go
        to ``__metadata__``), in shards with ``model.safetensors.index.json`` when
        ``max_shard_size`` is given. ``tied=True`` writes identical tensors once, as
        ``safetensors.torch.save_model`` writes tied weights (a checkpoint does not record which
        tensors were tied, only which are equal). Chunks stream from the store: memory stays at a
        few chunks.

        ``model=True`` writes a Hugging Face model folder (``cas-ckpt export --hf``): ``out`` is a
        folder whatever its name, holding ``model.safetensors`` (or shards and
        ``model.safetensors.index.json``) with the tensors only; every other value is left out and
        listed in the report's ``skipped``. A DCP checkpoint saved by many ranks is one state of
        whole tensors: it is written as one process's save of the same state is.
        """
        root = self._resolve(target)
        reader = self._reader(None, None)
        return hf.export(self.blocks, self.pool, self._tree_of(root, reader), out, path=path,
                         max_shard_size=max_shard_size, tied=tied, model=model)


def _plain(value: Any, path: str) -> Any:
    """Check metadata holds only plain msgpack values (str-keyed dicts, lists, scalars)."""
    if value is None or type(value) in (bool, float, str, bytes):
        return value
    if type(value) is int:
        if not -(2**63) <= value < 2**64:
            raise StateTypeError(path, "metadata ints must fit 64 bits")
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v, f"{path}.{i}") for i, v in enumerate(value)]
    if isinstance(value, dict):
        for key in value:
            if not isinstance(key, str):
                raise StateTypeError(f"{path}.{key}", "metadata keys must be str")
        return {k: _plain(v, f"{path}.{k}") for k, v in value.items()}
    scalar_array = isinstance(value, np.ndarray) and value.ndim == 0
    if isinstance(value, np.generic) or scalar_array or _is_scalar_tensor(value):  # metrics
        try:
            item = value.item()
        except (RuntimeError, NotImplementedError) as exc:  # a meta tensor has no value to read
            raise StateTypeError(path, f"cannot read the value of this tensor: {exc}") from exc
        return _plain(item, path)
    raise StateTypeError(path, f"metadata cannot hold {type(value).__name__}")


def _is_scalar_tensor(value: Any) -> bool:
    return type(value).__module__.startswith("torch") and getattr(value, "numel", lambda: 0)() == 1


def _step(step: Any) -> int | None:
    if step is None or type(step) is int:
        return step
    if isinstance(step, np.integer):
        return int(step)
    raise StateTypeError("step", f"step must be an int, not {type(step).__name__}")


def _ensure_config(
    refs: RefStore, location: str, *, create: bool, hash: str, chunk_size: int,
    compression: str | None = None, read_only: bool = False,
    occupied: Callable[[], str | None] = lambda: None,
) -> _Config:
    """The repository's config; created first if missing, ``create`` allows it and ``occupied()``
    finds nothing else at ``location`` (else it says what). The one place a repository is created.

    ``compression`` given for an existing repository that records another is recorded instead.
    """
    found = refs.read_config()
    if found is None:
        if not create:
            raise RepositoryError(f"no cas_ckpt repository at {location}")
        clash = occupied()
        # Another process (a rank of the same job) may have created it between the two looks:
        # its config is written before anything else lands there.
        found = refs.read_config() if clash else None
        if clash and found is None:
            raise RepositoryError(f"{location} {clash} and is not a cas_ckpt repository")
        if found is None:
            found = refs.init_config(_new_config(hash, chunk_size, compression or DEFAULT_COMPRESSION,
                                                 refs.format_version))
    config = _check_config(found, location)
    if compression is not None and compression != config.compression:
        if read_only:
            raise RepositoryError(f"repository {location} is opened read-only: its compression "
                                  f"({config.compression}) cannot become {compression}")
        new = {**found, "compression": compression,
               "version": max(config.version, 2 if compression != "none" else 1)}
        config = _check_config(refs.update_config(found, new), location)
    return config


def _new_config(hash: str, chunk_size: int, compression: str, version: int = 1) -> dict[str, Any]:
    """A new repository's config, at the lowest version its medium (``version``) and settings
    need: an uncompressed local repository stays readable by cas_ckpt 0.2."""
    config: dict[str, Any] = {"format": FORMAT, "version": version, "hash": hash, "chunk_size": chunk_size}
    if compression != "none":
        config.update(version=max(version, 2), compression=compression)
    return _versioned(config)


def _versioned(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` with ``requires`` naming the first release that reads its version (4 and up)."""
    release = FIRST_RELEASE.get(config.get("version", 1))
    return {**config, "requires": f"cas_ckpt>={release}"} if release else config


def _check_config(config: dict[str, Any], location: str) -> _Config:
    if config.get("format") != FORMAT:
        raise RepositoryError(f"{location} is not a cas_ckpt repository")
    version = config.get("version")
    if type(version) is int and version < 1:
        raise RepositoryError(f"repository {location} has invalid format version {version!r}")
    if type(version) is not int or version > FORMAT_VERSION:
        needed = config.get("requires")
        to = f" ({needed})" if isinstance(needed, str) and len(needed) < 64 else ""
        raise RepositoryError(
            f"repository {location} has format version {version!r}; this cas_ckpt supports up "
            f"to {FORMAT_VERSION}: upgrade cas_ckpt{to} to open it"
        )
    hash_name, chunk_size = config.get("hash"), config.get("chunk_size", MAX_CHUNK)
    if hash_name not in cidlib.HASH_CODES:
        raise RepositoryError(f"repository {location} uses unknown hash {hash_name!r}")
    if type(chunk_size) is not int or not 4096 <= chunk_size <= MAX_CHUNK:
        raise RepositoryError(f"repository {location} has invalid chunk_size {chunk_size!r}")
    compression = config.get("compression", "none")
    if compression not in SETTINGS or (compression != "none" and version < 2):
        raise RepositoryError(f"repository {location} has invalid compression {compression!r}")
    known = ("format", "version", "hash", "chunk_size", "compression", "requires")
    extra = {k: v for k, v in config.items() if k not in known}
    return _Config(hash_name, chunk_size, compression, version, extra)


MEMORY = "memory://"
S3 = "s3://"
_SKELETON = ("refs", "logs", "pins", "locks", "packs", "index", "tmp")


def _local_occupied(root: Path) -> str | None:
    """None if ``root`` is missing or holds at most what a creation cut short leaves (empty
    skeleton directories and temp files: the config is written last); else what is wrong."""
    if not root.exists():
        return None
    if not root.is_dir() or not _blank(root):
        return "exists and is not an empty directory"
    return None


def _blank(root: Path) -> bool:
    """True if the directory ``root`` holds only empty skeleton directories and temp files."""
    for entry in root.iterdir():
        if entry.is_symlink():
            return False
        if entry.name in _SKELETON and entry.is_dir():
            if any(entry.iterdir()):
                return False
        elif not (entry.name.endswith(".tmp") and entry.is_file()):
            return False
    return True


def open(
    path: str | os.PathLike[str] = "cas-ckpt-repo",
    *,
    create: bool = True,
    hash: str = "sha2-256",
    chunk_size: int = MAX_CHUNK,
    compression: str | None = None,
    verify: bool = True,
    read_only: bool = False,
    storage_options: Mapping[str, Any] | None = None,
    upkeep: bool | Mapping[str, Any] = True,
) -> Repository:
    """Open the repository at ``path``, creating it if missing (unless ``create=False``).

    ``path`` is a directory (``~`` is expanded), ``"s3://bucket/prefix"`` for S3 or any
    S3-compatible server (the AWS environment variables apply; ``storage_options`` such as
    ``cache_dir`` are described in ``docs/scale-out.md``), or ``"memory://"`` for a throwaway
    in-memory repository. ``hash`` (``"sha2-256"`` or ``"blake3"``) and ``chunk_size`` apply when
    creating; an existing repository keeps its own. ``compression`` (``"none"`` or ``"zstd"``,
    ``docs/guide.md``) is how new blocks are stored: given, it is recorded in the config (an
    existing repository switches to it); omitted, the repository keeps its own (new ones:
    ``"none"``). ``verify=False`` skips re-hashing blocks on reads. ``read_only=True`` refuses
    every write. ``upkeep``: saves merge small packs and write index snapshots by themselves
    once thresholds pass (``False``: only :meth:`Repository.upkeep` does; a mapping sets
    ``small_packs`` and ``uncovered``, 0 meaning never: ``docs/gc.md``, "Upkeep").
    """
    policy = UpkeepPolicy.of(upkeep)
    if compression is not None:
        check_setting(compression)
    if hash not in cidlib.HASH_CODES:
        raise ValueError(f"unsupported hash {hash!r}; choose one of {sorted(cidlib.HASH_CODES)}")
    if not 4096 <= chunk_size <= MAX_CHUNK:
        raise ValueError(f"chunk_size must be between 4096 and {MAX_CHUNK} bytes")
    location = os.fspath(path)
    if not (location.startswith(S3) or is_http(location)) and storage_options:
        raise ValueError("storage_options apply to s3:// and http(s):// repositories only")
    if is_http(location):  # a server's repository: never created from here; writes are pushes
        blocks, refs = _http_stores(location, verify=verify, read_only=read_only, **(storage_options or {}))
        settings = {"create": False, "hash": hash, "chunk_size": chunk_size, "compression": None,
                    "read_only": read_only, "upkeep": False}
        return _assemble(blocks, refs, location.rstrip("/"), settings)
    settings = {"create": create and not read_only, "hash": hash, "chunk_size": chunk_size,
                "compression": compression, "read_only": read_only, "upkeep": policy}
    if location.startswith(S3):
        blocks, refs = _s3_stores(location, verify=verify, read_only=read_only, **(storage_options or {}))
        return _assemble(blocks, refs, location, settings, lambda: _s3_occupied(refs))
    if location == MEMORY:
        return _assemble(MemoryStore(verify=verify), MemoryRefStore(), MEMORY, settings)
    root = Path(location).expanduser()
    try:
        local_refs = LocalRefStore(root)
        _ensure_config(local_refs, str(root), occupied=lambda: _local_occupied(root),
                       **{k: v for k, v in settings.items() if k != "upkeep"})
        if not read_only:
            local_refs.ensure_dirs()
        store = LocalStore(root, verify=verify, read_only=read_only)
    except OSError as exc:  # unwritable, a file where a directory should be, a full disk...
        raise MediumError(f"cannot open a repository at {root}", exc) from exc
    return _assemble(store, local_refs, str(root), settings)


def _assemble(
    blocks: BlockStore, refs: RefStore, location: str, settings: dict[str, Any],
    occupied: Callable[[], str | None] = lambda: None,
) -> Repository:
    """The repository over these stores (closing the block store if that fails): its config read
    once (one request on S3), or created there."""
    try:
        settings = {k: v for k, v in settings.items() if k != "read_only"}  # the stores' own
        return Repository(blocks, refs, location=location, occupied=occupied, **settings)
    except BaseException:
        blocks.close()
        raise


def _s3_occupied(refs: Any) -> str | None:
    """What lies under the prefix beside another process's leases and probes (None: nothing)."""
    # Lease and probe objects may be another process's, creating this repository right now.
    foreign = [m for m in refs.bucket.list("", limit=100) if not m.key.startswith("locks/")]
    return "holds other objects" if foreign and refs.read_config() is None else None


def _s3_stores(
    url: str,
    *,
    verify: bool = True,
    read_only: bool = False,
    client: Any = None,
    endpoint_url: str | None = None,
    allow_http: bool = False,
    unsafe_no_conditional_writes: bool = False,
    workers: int | None = None,
    lease_timeout: float | None = None,
    lock_timeout: float | None = None,
    **store_options: Any,
) -> tuple[BlockStore, RefStore]:
    """The block store and ref store of the repository at ``url``, sharing one client.

    ``store_options`` go to the block store (``cache_dir``, ``min_grace``, ``pack_size``...).
    """
    from cas_ckpt.refs.s3 import LEASE_TIMEOUT, S3RefStore  # boto3 only when a bucket is opened

    bucket = S3Bucket(
        url, client=client, endpoint_url=endpoint_url, allow_http=allow_http,
        unsafe_no_conditional_writes=unsafe_no_conditional_writes,
        **({"workers": workers} if workers else {}),
    )
    refs = S3RefStore(bucket, lease_timeout=lease_timeout or LEASE_TIMEOUT, lock_timeout=lock_timeout,
                      read_only=read_only)
    return S3Store(bucket, verify=verify, read_only=read_only, **store_options), refs



def _http_stores(
    url: str, *, verify: bool = True, cache_dir: str | os.PathLike[str] | None = None,
    read_only: bool = True, **remote: Any,
) -> tuple[BlockStore, RefStore]:
    """The block and ref stores of the repository ``cas-ckpt serve`` serves at ``url`` (pushing
    to it unless ``read_only``).

    ``remote`` goes to :class:`HttpRemote` (``token``, ``workers``, ``timeout``, ``min_rate``...);
    ``cache_dir`` keeps fetched blocks in a local block store there.
    """
    server = HttpRemote(url, **remote)
    cache = None
    if cache_dir is not None:
        try:
            cache = LocalStore(Path(cache_dir).expanduser(), verify=verify)
        except OSError as exc:
            server.close()
            raise MediumError(f"cannot use {cache_dir} as a block cache", exc) from exc
    return (HttpBlockStore(server, verify=verify, cache=cache, read_only=read_only),
            HttpRefStore(server, read_only=read_only))


def gateway_source(
    gateway: str, *, verify: bool = True, cache_dir: str | os.PathLike[str] | None = None,
    **remote: Any,
) -> replication.Gateway:
    """Blocks from any IPFS trustless gateway at ``gateway``, for :meth:`Repository.fetch`."""
    blocks, _ = _http_stores(gateway, verify=verify, cache_dir=cache_dir, **remote)
    assert isinstance(blocks, HttpBlockStore)
    return replication.Gateway(blocks, blocks.remote.url, blocks.remote.pool)


RepoOrPath = Repository | str | os.PathLike[str]


def ensure_open(
    repo_or_path: RepoOrPath, storage_options: Mapping[str, Any] | None = None
) -> tuple[Repository, bool]:
    """The repository, and whether this call opened it (a location, then its caller closes it;
    ``storage_options`` as :func:`open` takes them)."""
    if isinstance(repo_or_path, Repository):
        return repo_or_path, False
    if isinstance(repo_or_path, (str, os.PathLike)):
        return open(repo_or_path, storage_options=storage_options), True
    raise TypeError(f"expected a cas_ckpt.Repository or a location (a path, 'memory://', "
                    f"'s3://...'), not {type(repo_or_path).__name__}")


@contextlib.contextmanager
def _other(
    remote: Repository | str | os.PathLike[str], like: Repository | None, *, create: bool,
    read_only: bool = False, storage_options: Mapping[str, Any] | None = None,
) -> Iterator[Repository]:
    """``remote`` as an open repository (opened here, and closed after, if it is a location)."""
    if isinstance(remote, Repository):
        yield remote
        return
    settings = {} if like is None else {"hash": like.config.hash, "chunk_size": like.config.chunk_size}
    with open(remote, create=create, read_only=read_only, storage_options=storage_options,
              **settings) as other:
        yield other


def _run_updates(src: Repository, ref: str, dest: str, *, force: bool, head_only: bool) -> list[Update]:
    """The ref moves a push or pull of ``src``'s ``ref`` to ``dest`` makes: the head, and unless
    ``head_only`` each step ref a checkpoint manager keeps for it (``ref.steps/N`` ->
    ``dest.steps/N``). Step refs the destination holds beyond these stay: its retention decides."""
    updates = [Update(check_ref_name(dest), src._head(ref), force)]
    if not head_only:
        steps = step_ref(ref, 0).rsplit("/", 1)[0] + "/"
        for name, cid in sorted(src.refs_store.values(steps).items()):
            updates.append(Update(check_ref_name(dest + name[len(ref):]), cid, force))
    return updates


def clone(
    src: Repository | str | os.PathLike[str],
    dst: Repository | str | os.PathLike[str],
    *,
    progress: replication.Progress | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> Repository:
    """Copy every ref and pin of ``src`` (with the data each names, and history) into ``dst``.

    ``dst`` is a location (created, with ``src``'s hash and chunk size) or an open repository.
    It must hold no ref or pin that ``src`` lacks: a clone that died (killed at any point) is run
    again into what it left, and sends only what is missing. The pins are set once every block
    is durable, before any ref moves; each ref then moves as a pull's does (created, or moved
    forward if ``src``'s moved on since). Returns ``dst`` open (its ``last_transfer`` has the
    figures). Reflogs stay behind: they record what happened in ``src``. ``storage_options``
    open ``src`` when it is a location (as :func:`open` takes them: an HTTP server's ``token``,
    ``timeout``...).
    """
    with _other(src, None, create=False, read_only=True, storage_options=storage_options) as source:
        target = dst if isinstance(dst, Repository) else open(
            dst, hash=source.config.hash, chunk_size=source.config.chunk_size
        )
        try:
            refs = {name: cid for name in source.refs_store.names()
                    if (cid := source.refs_store.get(name)) is not None}
            pins = sorted(source.refs_store.pins())
            foreign = sorted(set(target.refs_store.names()) - set(refs)) + sorted(
                cidlib.to_str(pin) for pin in target.refs_store.pins() - set(pins))
            if foreign:
                raise RepositoryError(
                    f"cannot clone into {target.location or target}: it holds refs or pins that "
                    f"{source.location or source} does not ({', '.join(foreign[:3])}"
                    f"{', ...' if len(foreign) > 3 else ''}); a clone goes into a new repository, "
                    "or into what a clone of the same source left"
                )
            updates = [Update(name, cid) for name, cid in refs.items()]
            report = replication.transfer(source, target, updates, progress=progress, roots=pins, pin=True)
            target._local.last_transfer = report
        except BaseException:
            if target is not dst:
                target.close()
            raise
    return target
