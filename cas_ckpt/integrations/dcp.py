"""torch.distributed.checkpoint (DCP) storage in a cas_ckpt repository.

``dcp.save(state, storage_writer=Writer(repo, ref="main"))`` and
``dcp.load(state, storage_reader=Reader(repo, "main"))``. The checkpoint is the state as the
ranks saved it, one tensor node per tensor whoever wrote its pieces: ``repo.load``, ``diff``,
``stats``, ``ls``, the browser and ``export`` see whole tensors by their state names.

Saving: every rank learns every rank's shards (one small all-gather), and stores the chunks of
each tensor's grid (:mod:`cas_ckpt.grid`: the 1 MiB grid a single-process save cuts) that start
in its shard, into a pack of its own, durable before ``write_data`` returns. A chunk across
shards is assembled from its neighbours' edge bytes, sent over ``process_group`` in rounds of at
most 16 MiB a rank. The coordinator then writes the state (each tensor's node from its chunks'
CIDs: byte for byte the node ``repo.save`` writes for that tensor), DCP's metadata beside it,
one commit, and moves the ref by compare-and-swap in ``finish``. Nothing is pickled on disk.

The checkpoint's tree (layout 2; ``docs/format.md``, "Sharded checkpoints")::

    {"format": "cas_ckpt.dcp", "version": 2,
     "state": <link to the state, nested as saved: DCP's flattening undone>,
     "dcp": <link to {"dcp_version": str | None,
                      "tensors": {fqn: {"dtype", "size", "requires_grad", "memory_format",
                                        "pin_memory", "chunks": [[offsets, sizes], ...]}},
                      "values": [fqn, ...], "paths": {fqn: [key, ...]},
                      "planner_data": ...}>}

Layout 1 (0.2: each shard an array of its own under ``data``) is still read by :class:`Reader`
and :func:`load_full`. See ``docs/scale-out.md``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import io
import math
import os
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch
from multiformats import CID
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from cas_ckpt import cid as cidlib
from cas_ckpt.blocks.base import BlockWriter, Stored, WriteStats
from cas_ckpt.codec import Link, Tagged
from cas_ckpt.errors import DecodeError, RepositoryError, StateTypeError
from cas_ckpt.grid import SHARDED_FORMAT, SHARDED_LAYOUT, Exchange, Piece, Round, read_region, state_root
from cas_ckpt.integrations.torch import numpy_dtype_of, numpy_to_tensor, savable_dtypes, tensor_to_numpy
from cas_ckpt.refs import check_ref_name
from cas_ckpt.repository import Repository, Target
from cas_ckpt.tree import INLINE_LIMIT, NDARRAY, TUPLE, TreeReader, TreeWriter, dtype_name

__all__ = ["MixedCheckpoints", "Reader", "ReplicaMismatch", "Writer", "load_full"]

FORMAT = SHARDED_FORMAT
VERSION = SHARDED_LAYOUT
VALUE_LIMIT = 1024 * 1024  # a value larger than this is written by its rank, not sent on
_MEMORY_FORMATS = {
    "contiguous_format": torch.contiguous_format,
    "channels_last": torch.channels_last,
    "preserve_format": torch.preserve_format,
}
_Key = tuple[str, tuple[int, ...] | None]


class ReplicaMismatch(RepositoryError):
    """Ranks hold different values under one key; DCP would silently keep one rank's."""


class MixedCheckpoints(RepositoryError):
    """The ranks of one load resolved their target to different commits."""


@dataclasses.dataclass(frozen=True)
class _Stored:
    """A WriteResult's storage_data, gathered by the coordinator.

    ``kind``: "chunks" (``data``: {grid chunk: CID} this rank stored of the tensor), "bytes" (a
    small tensor's shard, its raw bytes), "value" (the value, or a link to it where large) or
    "replica" (an item DCP left to another rank; only ``fingerprint``). ``fingerprint``: a hash
    of the item, where another rank holds a replica of it.
    """

    kind: str
    data: Any = None
    fingerprint: bytes | None = None
    receipt: Any = None  # the rank's packs (on its first result): the coordinator records them


@dataclasses.dataclass(frozen=True)
class _Shard:
    """What every rank tells the others of a tensor shard it writes."""

    fqn: str
    size: tuple[int, ...]
    dtype: str  # torch's name
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.size) * _itemsize(self.dtype)


@functools.cache
def _torch_dtype(name: str) -> torch.dtype:
    return _dtypes()[name]


def _itemsize(name: str) -> int:
    return torch.empty(0, dtype=_torch_dtype(name)).element_size()


def _stored_name(torch_dtype: torch.dtype) -> str:
    """The dtype name cas_ckpt stores a tensor of ``torch_dtype`` under."""
    found = numpy_dtype_of(torch_dtype)
    name = dtype_name(found) if found is not None else None
    if name is None:
        raise StateTypeError("", f"unsupported torch dtype {torch_dtype}")
    return name


# --------------------------------------------------------------------------------------------
# Saving
# --------------------------------------------------------------------------------------------
class Writer(StorageWriter):
    """A DCP StorageWriter that saves into ``repo`` and moves ``ref`` when the save completes.

    ``step``, ``metadata`` and ``message`` go into the commit as in :meth:`Repository.save`. The
    ref moves by compare-and-swap from ``expected`` (default: what it held when the save
    started), so a save that lost a race fails with :class:`RefConflict` instead of overwriting.
    ``check_replicas`` hashes each item DCP deduplicated away from a rank and fails the save with
    :class:`ReplicaMismatch` if the copies differ. ``process_group``: the group the ranks
    exchange shard edges over, the one given to ``dcp.save`` / ``dcp.async_save`` (default: the
    default group, where one is initialized; every rank of it must take part in the save).
    After a save, ``commit`` (coordinator) and ``storage_meta.checkpoint_id`` of the returned
    Metadata (every rank) name the new commit.
    """

    def __init__(
        self,
        repo: Repository,
        ref: str = "main",
        *,
        step: int | None = None,
        metadata: dict[str, Any] | None = None,
        message: str | None = None,
        expected: Target | None = None,
        check_replicas: bool = True,
        process_group: Any = None,
    ) -> None:
        super().__init__()
        self.repo = repo
        self.ref = check_ref_name(ref)
        self.step, self.metadata, self.message = step, metadata, message
        self.expected = expected
        self.check_replicas = check_replicas
        self.process_group = process_group
        self.commit: CID | None = None
        self.stats = WriteStats()
        self.moved_bytes = 0  # shard-edge bytes this rank sent to others in its last save
        self.is_coordinator = False
        self._parent: bytes | None = None
        self._local_items: list[WriteItem] = []
        self._hold: weakref.finalize[Any, Any] | None = None

    # -- lifecycle -----------------------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """A ``checkpoint_id`` passed to ``dcp.save`` names the ref to write."""
        if checkpoint_id is not None:
            self.ref = check_ref_name(os.fspath(checkpoint_id))

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False  # needs a repository: never picked automatically from a bare id

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("use_collectives") is False:
            raise ValueError(
                "cas_ckpt.dcp.Writer needs use_collectives=True: one commit holds every rank's items"
            )
        self.close()
        self.is_coordinator, self.commit, self.stats = is_coordinator, None, WriteStats()
        if is_coordinator:
            # Held until finish: GC cannot sweep blocks the ranks write or reuse before the
            # commit links them (the save lock of Repository.save, stretched over the DCP save).
            # Released by finish, close, the next save, or when the Writer is dropped.
            held = contextlib.ExitStack()
            held.enter_context(self.repo.refs_store.lock(exclusive=False))
            self._hold = weakref.finalize(self, held.close)
            given = self.expected
            self._parent = self.repo.refs_store.get(self.ref) if given is None else (
                cidlib.to_bytes(self.repo.resolve(given))
            )

    def close(self) -> None:
        """Release the repository lock a coordinator holds from set-up until ``finish``.

        A save that fails on some rank never reaches ``finish``: close (or drop) the Writer then,
        or GC waits for it.
        """
        hold, self._hold = self._hold, None
        if hold is not None:
            hold()

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.ref)

    # -- planning ------------------------------------------------------------------------------
    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        if plan.usable:  # with plan caching an unchanged plan arrives empty: keep the last one
            self._local_items = list(plan.items)
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    # -- writing -------------------------------------------------------------------------------
    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Store this rank's grid chunks, small shards' bytes and values, durable before returning.

        Collective over ``process_group``: every rank of it calls this once per save (DCP does).
        A rank that fails keeps taking part in the exchange, so that the others fail through
        DCP's gathered results rather than hang. Locations travel in the WriteResults only:
        ``plan.storage_data`` may be a stale cached one.
        """
        group = _Group.of(self.process_group)
        mine = {item.index for item in plan.items}
        replicas = [item for item in self._local_items if item.index not in mine and self.check_replicas]
        shards = [_shard_of(item) for item in plan.items if item.type != WriteItemType.BYTE_IO]
        everyone = group.all_gather((shards, [_key(item.index) for item in replicas]))
        held = {key for _, keys in everyone for key in keys}  # items some rank holds a replica of
        grid, dtypes = _grid(everyone, self.repo.config.chunk_size, group.world)
        # Each rank records nothing: the coordinator takes every rank's packs in at once (one
        # journal on S3), so no rank reads the others' indexes, and runs upkeep after the commit.
        with self.repo.transaction(upkeep=False, learn=False) as txn:
            txn.blocks.journal = False
            save = _RankSave(txn.tree, group, planner, plan.items, grid, dtypes)
            chunks = save.run()
            self.moved_bytes = save.moved
            results = [self._result(txn.tree, item, planner, chunks, save.data, _key(item.index) in held,
                                    item.index.fqn in dtypes) for item in plan.items]
        self.stats.add(txn.stats)
        receipt = txn.blocks.receipt()
        if results and receipt:
            results[0] = dataclasses.replace(
                results[0], storage_data=dataclasses.replace(results[0].storage_data, receipt=receipt))
        results += self._replicas(replicas, planner)
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def _result(self, tree: TreeWriter, item: WriteItem, planner: SavePlanner,
                chunks: dict[str, dict[int, bytes]], data: dict[str, np.ndarray], held: bool,
                gridded: bool) -> WriteResult:
        """What the coordinator learns of ``item``: the grid chunks this rank stored of a
        ``gridded`` tensor (none, where its shard holds no chunk's most bytes), a small tensor's
        bytes, or a value."""
        fqn = item.index.fqn
        if item.type == WriteItemType.BYTE_IO:
            value = _item_value(item, planner)
            fingerprint = _value_fingerprint(self.repo, value, fqn)  # refused here if unsavable
            if _larger_than(value, VALUE_LIMIT):
                value = Link(tree.write(value))
            return WriteResult(item.index, 0, _Stored("value", value, fingerprint if held else None))
        raw = data[fqn]
        fingerprint = hashlib.sha256(raw).digest() if held else None
        if gridded:
            return WriteResult(item.index, raw.nbytes, _Stored("chunks", chunks.get(fqn, {}), fingerprint))
        return WriteResult(item.index, raw.nbytes, _Stored("bytes", raw.tobytes(), fingerprint))

    def _replicas(self, items: list[WriteItem], planner: SavePlanner) -> list[WriteResult]:
        """Fingerprints of the items DCP left to another rank (hashed, never stored)."""
        results = []
        for item in items:
            if item.type == WriteItemType.BYTE_IO:
                fingerprint = _value_fingerprint(self.repo, _item_value(item, planner), item.index.fqn)
            else:
                fingerprint = hashlib.sha256(_host_bytes(planner.resolve_data(item))).digest()
            results.append(WriteResult(item.index, 0, _Stored("replica", None, fingerprint)))
        return results

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator: write the state, DCP's metadata and the commit; move the ref by
        compare-and-swap."""
        try:
            gathered = _Gathered(results)
            self.repo.blocks.adopt(gathered.receipts)
            commit = self.repo.commit_tree(
                lambda tree: _write_root(tree, metadata, gathered), ref=self.ref, step=self.step,
                metadata=self.metadata, message=self.message, expected=self._parent,
            )
        finally:
            self.close()
        self.commit = commit
        metadata.storage_meta = dataclasses.replace(
            metadata.storage_meta or StorageMeta(), checkpoint_id=str(commit)
        )


class _Group:
    """The process group a save's ranks exchange over (none: one process)."""

    def __init__(self, group: Any, rank: int, world: int) -> None:
        self.group, self.rank, self.world = group, rank, world

    @classmethod
    def of(cls, group: Any) -> _Group:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            return cls(None, 0, 1)
        group = group or dist.group.WORLD
        return cls(group, dist.get_rank(group), dist.get_world_size(group))

    def all_gather(self, value: Any) -> list[Any]:
        if self.group is None:
            return [value]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, value, group=self.group)
        return out

    def all_to_all(self, send: np.ndarray, send_sizes: list[int], recv_sizes: list[int]) -> np.ndarray:
        import torch.distributed as dist

        out = torch.empty(sum(recv_sizes), dtype=torch.uint8)
        dist.all_to_all_single(out, torch.from_numpy(send), recv_sizes, send_sizes, group=self.group)
        return out.numpy()


def _shard_of(item: WriteItem) -> _Shard:
    data = item.tensor_data
    assert data is not None
    props = data.properties
    name = str(props.dtype).removeprefix("torch.")
    if props.dtype not in savable_dtypes() or props.layout != torch.strided:
        raise StateTypeError(item.index.fqn, f"cannot save a {props.layout} tensor of {props.dtype} "
                             "through DCP")
    return _Shard(item.index.fqn, tuple(data.size), name, tuple(data.chunk.offsets), tuple(data.chunk.sizes))


def _grid(everyone: list[tuple[list[_Shard], list[_Key]]], chunk_size: int, world: int
          ) -> tuple[Exchange, dict[str, str]]:
    """The exchange of every tensor above the inline limit (the same on every rank), and the
    dtype each is stored as."""
    pieces: dict[str, list[Piece]] = {}
    kinds: dict[str, _Shard] = {}
    for rank, (shards, _) in enumerate(everyone):
        for shard in shards:
            if shard.nbytes > INLINE_LIMIT:
                if any(p.rank == rank for p in pieces.get(shard.fqn, ())):
                    raise RepositoryError(f"rank {rank} holds two shards of {shard.fqn!r}")
                pieces.setdefault(shard.fqn, []).append(Piece(rank, shard.offsets, shard.sizes))
                kinds[shard.fqn] = shard
    exchange = Exchange([(fqn, kinds[fqn].size, _itemsize(kinds[fqn].dtype), pieces[fqn])
                         for fqn in sorted(pieces)], chunk_size, world)
    return exchange, {fqn: _stored_name(_torch_dtype(shard.dtype)) for fqn, shard in kinds.items()}


class _RankSave:
    """One rank's part of the grid: the rounds of the exchange, and the chunks it stores."""

    def __init__(self, tree: TreeWriter, group: _Group, planner: SavePlanner, items: Sequence[WriteItem],
                 grid: Exchange, dtypes: dict[str, str]) -> None:
        self.tree, self.group, self.grid, self.dtypes = tree, group, grid, dtypes
        self.moved = 0
        self.failure: BaseException | None = None
        self.data: dict[str, np.ndarray] = {}  # this rank's shard of each tensor, its raw bytes
        try:
            for item in items:
                if item.type != WriteItemType.BYTE_IO:
                    self.data[item.index.fqn] = _host_bytes(planner.resolve_data(item))
        except Exception as exc:  # re-raised once the exchange is over
            self.failure = exc

    def run(self) -> dict[str, dict[int, bytes]]:
        """Every round: send edges, receive edges, store the chunks this rank owns. Returns
        {fqn: {chunk: CID}} of the chunks stored."""
        stored: dict[str, dict[int, bytes]] = {}
        for round_ in self.grid.rounds:
            received = self._exchange(round_)
            if self.failure is None:
                try:
                    self._store(round_, received, stored)
                except Exception as exc:  # re-raised once the exchange is over
                    self.failure = exc
        if self.failure is not None:
            raise self.failure
        return stored

    def _exchange(self, round_: Round) -> dict[tuple[int, int], np.ndarray]:
        """Send this rank's edge pieces of the round's chunks to their owners; return the pieces
        it received."""
        rank, world = self.group.rank, self.group.world
        if self.group.group is None or not round_.send.any():
            return {}
        parts = self.grid.outgoing(rank, round_, self.data)
        send = np.concatenate(parts)
        self.moved += send.nbytes
        recv_sizes = [int(round_.send[src, rank]) for src in range(world)]
        got = self.group.all_to_all(send, [p.nbytes for p in parts], recv_sizes)
        starts = np.cumsum([0, *recv_sizes])
        return self.grid.incoming(rank, round_, [got[starts[i] : starts[i + 1]] for i in range(world)])

    def _store(self, round_: Round, received: dict[tuple[int, int], np.ndarray],
               stored: dict[str, dict[int, bytes]]) -> None:
        for t, ks, chunks, views in self.grid.stored(self.group.rank, round_, self.data, received):
            tensor = self.grid.tensors[t]
            if len(ks) == tensor.chunks:  # all of it here: one run in one pack, mappable
                self.tree.writer.expect_run(tensor.nbytes)
            # a view of the shard stays as it is until the transaction commits: written in place
            cids = self.tree.write_chunks(chunks, self.dtypes[tensor.name], views)
            stored.setdefault(tensor.name, {}).update(zip(ks, cids, strict=True))


def _host_bytes(tensor: Any) -> np.ndarray:
    """A tensor's bytes in row-major order, as a flat uint8 array (a view where it can be)."""
    array, _ = tensor_to_numpy(tensor, "")
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8)


def _larger_than(value: Any, limit: int) -> bool:
    """True if ``value`` (a value DCP hands over whole) may take over ``limit`` bytes."""
    stack, total = [value], 0
    while stack:
        item = stack.pop()
        if isinstance(item, (str, bytes, bytearray)):
            total += len(item)
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
            total += 8 * len(item)
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
            total += 8 * len(item)
        elif isinstance(item, (np.ndarray, torch.Tensor)):
            total += item.nbytes
        else:
            total += 16
        if total > limit:
            return True
    return False


def _value_fingerprint(repo: Repository, value: Any, fqn: str) -> bytes:
    """The CID ``repo.save`` would give ``value``'s node (hashed, never stored)."""
    with _DryWriter(repo.blocks) as dry:
        try:
            return TreeWriter(dry, repo.hasher, repo.pool, chunk_size=repo.config.chunk_size).write(value)
        except StateTypeError as exc:
            raise _at(fqn, exc) from None


class _DryWriter(BlockWriter):
    """A batch that keeps nothing: hashing a value to its node CID without storing it."""

    def _append(self, cid: bytes, stored: Stored, size: int, keep: bool = False) -> None:
        pass

    def commit(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = True


def _item_value(item: WriteItem, planner: SavePlanner) -> Any:
    """The plain value to store for a BYTE_IO ``item``.

    DCP hands non-tensor values over pickled (``torch.save``); the planner's original object is
    taken instead and stored as msgpack. A planner without ``lookup_object`` has its freshly
    made bytes read back with ``weights_only=True`` (they never touched the disk).
    """
    lookup = getattr(planner, "lookup_object", None)
    if lookup is not None:
        return lookup(item.index)
    return torch.load(planner.resolve_data(item), weights_only=True)


def _at(fqn: str, exc: StateTypeError) -> StateTypeError:
    reason = str(exc).removeprefix(f"{exc.path or '<root>'}: ")
    if not exc.path:
        reason += " (non-tensor values are stored as msgpack, never pickled)"
    return StateTypeError(f"{fqn}.{exc.path}" if exc.path else fqn, reason)


def _key(index: MetadataIndex) -> _Key:
    return index.fqn, None if index.offset is None else tuple(index.offset)


def _name(key: _Key) -> str:
    fqn, offsets = key
    return repr(fqn) if offsets is None or not any(offsets) else f"{fqn!r} at {list(offsets)}"


class _Gathered:
    """Every rank's results, by item: chunk CIDs, small shards, values; replicas checked."""

    def __init__(self, results: Iterable[Iterable[WriteResult]]) -> None:
        self.chunks: dict[str, dict[int, bytes]] = {}
        self.shards: dict[str, list[tuple[tuple[int, ...], bytes]]] = {}
        self.values: dict[str, Any] = {}
        self.receipts: list[Any] = []
        written: dict[_Key, bytes | None] = {}
        replicas: dict[_Key, list[bytes]] = {}
        for rank_results in results:
            for result in rank_results:
                stored = result.storage_data
                if not isinstance(stored, _Stored):
                    raise RepositoryError(f"unexpected write result for {result.index.fqn}")
                if stored.receipt:
                    self.receipts.append(stored.receipt)
                key, fqn = _key(result.index), result.index.fqn
                if stored.kind == "replica":
                    replicas.setdefault(key, []).append(stored.fingerprint or b"")
                    continue
                if key in written:
                    raise ReplicaMismatch(f"two ranks wrote {_name(key)}")
                written[key] = stored.fingerprint
                if stored.kind == "chunks":
                    self.chunks.setdefault(fqn, {}).update(stored.data)
                elif stored.kind == "bytes":
                    self.shards.setdefault(fqn, []).append((key[1] or (), stored.data))
                else:
                    self.values[fqn] = stored.data
        for key, prints in replicas.items():
            if any(p != written.get(key) for p in prints):
                raise ReplicaMismatch(
                    f"ranks hold different values for {_name(key)}; DCP keeps one rank's copy of a "
                    "plain (non-DTensor) value: make it identical on every rank, shard it as a "
                    "DTensor, or give each rank its own key"
                )


def _write_root(tree: TreeWriter, metadata: Metadata, gathered: _Gathered) -> bytes:
    """Store the state, DCP's metadata beside it and the root linking both; return the root."""
    flat: dict[str, Any] = {}
    tensors: dict[str, Any] = {}
    values: list[str] = []
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            tensors[fqn] = _tensor_entry(fqn, md)
            flat[fqn] = _tensor_value(tree, fqn, md, gathered)
        else:
            if fqn not in gathered.values:
                raise RepositoryError(f"no rank wrote {fqn!r}")
            values.append(fqn)
            flat[fqn] = gathered.values[fqn]
    paths = _paths(metadata.planner_data, flat)
    flat = {fqn: flat[fqn] for fqn in paths}  # in the state's own order, as DCP flattened it
    state = tree.write(_nest(flat, paths))
    meta = tree.write({"dcp_version": metadata.version, "tensors": tensors, "values": values,
                       "paths": {fqn: list(path) for fqn, path in paths.items()},
                       "planner_data": metadata.planner_data})
    return tree.write({"format": FORMAT, "version": VERSION, "state": Link(state), "dcp": Link(meta)})


def _tensor_value(tree: TreeWriter, fqn: str, md: TensorStorageMetadata, gathered: _Gathered) -> Any:
    """A tensor of the state: its node from its grid chunks' CIDs, or a small one assembled."""
    dtype = md.properties.dtype
    size = list(md.size)
    nbytes = math.prod(size) * torch.empty(0, dtype=dtype).element_size()
    if nbytes > INLINE_LIMIT:
        chunks = gathered.chunks.get(fqn, {})
        count = -(-nbytes // tree.chunk_size)
        missing = [k for k in range(count) if k not in chunks]
        if missing:
            raise RepositoryError(f"no rank stored chunk {missing[0]} of {fqn!r}")
        return tree.array_value(_stored_name(dtype), size, "torch", [chunks[k] for k in range(count)])
    whole = torch.empty(size, dtype=dtype)
    covered = 0
    for offsets, raw in gathered.shards.get(fqn, []):
        sizes = [c.sizes for c in md.chunks if tuple(c.offsets) == tuple(offsets)]
        if not sizes:
            raise RepositoryError(f"a rank wrote {fqn!r} at {list(offsets)}, where no shard lies")
        piece = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.zeros(0).byte()
        _region(whole, offsets, sizes[0]).copy_(piece.view(dtype).reshape(sizes[0]))
        covered += len(raw)
    if covered != nbytes:
        raise RepositoryError(f"the ranks wrote {covered} of the {nbytes} bytes of {fqn!r}")
    return whole


def _paths(planner_data: Any, flat: dict[str, Any]) -> dict[str, tuple[Any, ...]]:
    """Where each item lies in the state as saved: DCP's flattening map where it names every
    item, else each at its own key."""
    if isinstance(planner_data, dict) and planner_data.keys() == flat.keys() and all(
            isinstance(p, (tuple, list)) and p and all(type(k) in (str, int) for k in p)
            for p in planner_data.values()):
        return {fqn: tuple(path) for fqn, path in planner_data.items()}
    return {fqn: (fqn,) for fqn in flat}


def _nest(flat: dict[str, Any], paths: dict[str, tuple[Any, ...]]) -> Any:
    """The state as saved, from its items and their paths (lists where DCP flattened lists)."""
    if all(len(p) == 1 for p in paths.values()):
        return {paths[fqn][0]: value for fqn, value in flat.items()}
    from torch.distributed.checkpoint._nested_dict import unflatten_state_dict

    return unflatten_state_dict(flat, paths)


def _tensor_entry(fqn: str, md: TensorStorageMetadata) -> dict[str, Any]:
    props = md.properties
    if props.layout != torch.strided:
        raise StateTypeError(fqn, f"cannot save a {props.layout} tensor through DCP")
    formats = {v: k for k, v in _MEMORY_FORMATS.items()}
    return {
        "dtype": str(props.dtype).removeprefix("torch."),
        "size": list(md.size),
        "requires_grad": bool(props.requires_grad),
        "memory_format": formats.get(props.memory_format, "contiguous_format"),
        "pin_memory": bool(props.pin_memory),
        "chunks": [[list(c.offsets), list(c.sizes)] for c in md.chunks],
    }


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass
class _Layout:
    """A DCP checkpoint's metadata, and where each item is: layout 1 a node per saved shard
    (``nodes``), layout 2 its value inside the state (``located``: an array or a link)."""

    metadata: Metadata
    version: int
    nodes: dict[_Key, bytes] = dataclasses.field(default_factory=dict)
    located: dict[str, Any] = dataclasses.field(default_factory=dict)


def _read_layout(repo: Repository, cid: bytes, reader: TreeReader) -> _Layout:
    name = cidlib.to_str(cid)
    root = reader.resolve(Link(_tree(repo, cid)))
    if not isinstance(root, dict) or root.get("format") != FORMAT:
        raise RepositoryError(f"{name} is not a checkpoint written through cas_ckpt.dcp")
    version = root.get("version")
    if type(version) is not int or not 1 <= version <= VERSION:
        raise RepositoryError(f"{name} has cas_ckpt.dcp version {version!r}: upgrade cas_ckpt")
    meta = reader.load(root.get("dcp" if version > 1 else "metadata"))
    if not isinstance(meta, dict):
        raise DecodeError("malformed cas_ckpt.dcp metadata", cid=name)
    state_md: dict[str, Any] = {}
    layout = _Layout(Metadata(state_dict_metadata=state_md, planner_data=meta.get("planner_data"),
                              storage_meta=StorageMeta(checkpoint_id=name), version=meta.get("dcp_version")),
                     version)
    tensors, values = _dict(meta.get("tensors")), _list(meta.get("values"))
    for fqn in values:
        state_md[fqn] = BytesStorageMetadata()
    if version > 1:  # one whole chunk per tensor: any rank reads any box of it from the grid
        for fqn, entry in tensors.items():
            state_md[fqn] = _tensor_md(fqn, _dict(entry), whole=True)
        state = root.get("state")
        if type(state) is not Link:
            raise DecodeError("malformed cas_ckpt.dcp tree: no state link", cid=name)
        paths = {fqn: _list(path) for fqn, path in _dict(meta.get("paths")).items()}
        if paths.keys() != state_md.keys():
            raise DecodeError("malformed cas_ckpt.dcp metadata: paths do not name every item", cid=name)
        layout.located = _locate(reader, state, paths)
        return layout
    data = reader.resolve(root.get("data"))
    if not isinstance(data, dict):
        raise DecodeError("malformed cas_ckpt.dcp tree", cid=name)
    for fqn, entry in tensors.items():
        state_md[fqn] = _tensor_md(fqn, _dict(entry))
        keys: list[_Key] = [(fqn, tuple(c.offsets)) for c in state_md[fqn].chunks]
        layout.nodes.update(zip(keys, _links(reader, data.get(fqn), len(keys), fqn), strict=True))
    for fqn in values:
        layout.nodes[(fqn, None)] = _links(reader, data.get(fqn), 1, fqn)[0]
    return layout


def _tree(repo: Repository, cid: bytes) -> bytes:
    """The tree of the commit ``cid`` (or ``cid``, a bare tree node)."""
    try:
        return cidlib.to_bytes(repo.commit(cid).tree)
    except DecodeError:
        return cid


def _locate(reader: TreeReader, state: Any, paths: dict[str, list[Any]]) -> dict[str, Any]:
    """Each item's value in the state, by its path: every node on the way read once."""
    found: dict[str, Any] = {}

    def walk(value: Any, entries: list[tuple[str, list[Any]]], depth: int) -> None:
        deeper: dict[Any, list[tuple[str, list[Any]]]] = {}
        for fqn, path in entries:
            if len(path) == depth:
                found[fqn] = value
            else:
                deeper.setdefault(path[depth], []).append((fqn, path))
        if not deeper:
            return
        container = reader.resolve(value)
        if isinstance(container, Tagged) and container.code == TUPLE:
            container = container.value
        for key, sub in deeper.items():
            try:
                item = container[key]
            except (KeyError, IndexError, TypeError):
                raise DecodeError(f"{sub[0][0]!r} is not in the checkpoint's state "
                                  f"(no {key!r} at {'.'.join(map(str, sub[0][1][:depth])) or 'the root'})"
                                  ) from None
            walk(item, sub, depth + 1)

    walk(state, list(paths.items()), 0)
    return found


def _links(reader: TreeReader, value: Any, count: int, fqn: str) -> list[bytes]:
    links = reader.resolve(value)
    if not isinstance(links, list) or len(links) != count or not all(
        type(link) is Link for link in links
    ):
        raise DecodeError(f"malformed cas_ckpt.dcp data entry for {fqn!r}")
    return [link.cid for link in links]


@functools.cache
def _dtypes() -> dict[str, torch.dtype]:
    """The torch dtypes a checkpoint may name: those cas_ckpt stores bit for bit."""
    return {str(dt).removeprefix("torch."): dt for dt in savable_dtypes()}


def _tensor_md(fqn: str, entry: dict[str, Any], *, whole: bool = False) -> TensorStorageMetadata:
    dtypes = _dtypes()
    dtype, fmt = entry.get("dtype"), entry.get("memory_format", "contiguous_format")
    if dtype not in dtypes or fmt not in _MEMORY_FORMATS:
        raise DecodeError(f"{fqn!r}: unknown dtype {dtype!r} or memory format {fmt!r}")
    size = torch.Size(_ints(entry.get("size"), fqn))
    chunks = [ChunkStorageMetadata(torch.Size([0] * len(size)), size)] if whole else [
        ChunkStorageMetadata(torch.Size(_ints(off, fqn)), torch.Size(_ints(sizes, fqn)))
        for off, sizes in _list(entry.get("chunks"))
    ]
    props = TensorProperties(
        dtype=dtypes[dtype],
        requires_grad=entry.get("requires_grad") is True,
        memory_format=_MEMORY_FORMATS[fmt],
        pin_memory=entry.get("pin_memory") is True,
    )
    return TensorStorageMetadata(props, size, chunks)


def _ints(value: Any, fqn: str) -> list[int]:
    if not isinstance(value, list) or not all(type(v) is int and v >= 0 for v in value):
        raise DecodeError(f"{fqn!r}: malformed offsets or sizes {value!r}")
    return value


def _dict(value: Any) -> dict[Any, Any]:
    if not isinstance(value, dict):
        raise DecodeError("malformed cas_ckpt.dcp metadata: expected a map")
    return value


def _list(value: Any) -> list[Any]:
    if not isinstance(value, list):
        raise DecodeError("malformed cas_ckpt.dcp metadata: expected a list")
    return value


class Reader(StorageReader):
    """A DCP StorageReader for the checkpoint ``target`` (a ref or a CID) of ``repo``.

    The target is resolved to one commit when the Reader is made (or reset with a new id) and
    every later read uses that commit. The coordinator checks that all ranks hold the same one
    (:class:`MixedCheckpoints` otherwise, before anything is loaded); pass a CID
    (``repo.resolve(ref)``, broadcast from one rank) to rule that out. Non-tensor values are
    decoded from msgpack and handed to the planner as a ``torch.save`` buffer made in memory:
    nothing read from storage is ever unpickled.
    """

    def __init__(self, repo: Repository, target: Target = "main", *, verify: bool | None = None) -> None:
        super().__init__()
        self.repo = repo
        self.verify = verify
        self.target = target
        self.cid = repo.resolve(target)
        self.is_coordinator = False
        self._layout: _Layout | None = None

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """A ``checkpoint_id`` passed to ``dcp.load`` re-targets (a ref or a CID)."""
        if checkpoint_id is not None:
            self.target = os.fspath(checkpoint_id)
            self.cid = self.repo.resolve(self.target)
            self._layout = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False

    def _reader(self) -> TreeReader:
        return TreeReader(self.repo.blocks, self.repo.pool, verify=self.verify)

    def layout(self) -> _Layout:
        if self._layout is None:
            self._layout = _read_layout(self.repo, cidlib.to_bytes(self.cid), self._reader())
        return self._layout

    def read_metadata(self, *args: Any, **options: Any) -> Metadata:
        # (named ``options``, not ``kwargs``: DCP would then retry per-rank metadata files)
        return self.layout().metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return dataclasses.replace(plan, storage_data=str(self.cid))

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        commits = {plan.storage_data for plan in plans}
        if len(commits) > 1:
            raise MixedCheckpoints(
                f"ranks resolved {self.target!r} to different commits {sorted(map(str, commits))} "
                "(the ref moved while they started): retry, or pass every rank the same CID"
            )
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read each requested box of a tensor from its grid chunks (layout 1: each stored shard
        once), hash-verified, and copy it into place."""
        layout, reader = self.layout(), self._reader()
        if layout.version == 1:
            self._read_shards(layout, reader, plan, planner)
        else:
            for req in plan.items:
                _deliver_box(req, layout, reader, planner)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _read_shards(self, layout: _Layout, reader: TreeReader, plan: LoadPlan, planner: LoadPlanner) -> None:
        by_node: dict[bytes, list[ReadItem]] = {}
        for req in plan.items:
            node = layout.nodes.get(_key(req.storage_index))
            if node is None:
                raise DecodeError(f"{req.storage_index.fqn!r} is not in checkpoint {self.cid}")
            by_node.setdefault(node, []).append(req)
        for node, reqs in by_node.items():
            value = reader.load(Link(node))
            for req in reqs:
                _deliver(req, value, layout.metadata, planner)


def _deliver_box(req: ReadItem, layout: _Layout, reader: TreeReader, planner: LoadPlanner) -> None:
    fqn = req.storage_index.fqn
    if fqn not in layout.located:
        raise DecodeError(f"{fqn!r} is not in checkpoint {layout.metadata.storage_meta}")
    value = layout.located[fqn]
    if req.type == LoadItemType.BYTE_IO:
        _deliver_value(req, reader.load(value), planner)
        return
    md = layout.metadata.state_dict_metadata[fqn]
    assert isinstance(md, TensorStorageMetadata)
    node = reader.resolve(value)
    if not (isinstance(node, Tagged) and node.code == NDARRAY and isinstance(node.value, dict)):
        raise DecodeError(f"{fqn!r} is not a tensor in the checkpoint's state")
    base = req.storage_index.offset or [0] * len(md.size)
    offsets = [a + b for a, b in zip(base, req.storage_offsets, strict=True)]
    try:
        source = numpy_to_tensor(read_region(reader, node.value, offsets, list(req.lengths)), node.value)
    except DecodeError as exc:
        raise exc.inside(fqn) from None
    if source.dtype != md.properties.dtype or list(node.value.get("shape", [])) != list(md.size):
        raise DecodeError(f"stored tensor {fqn!r} does not match its metadata")
    target = planner.resolve_tensor(req).detach()
    if target.shape != source.shape:
        raise DecodeError(f"{req.dest_index.fqn!r}: region {list(source.shape)} != {list(target.shape)}")
    target.copy_(source)
    planner.commit_tensor(req, target)


def _deliver_value(req: ReadItem, value: Any, planner: LoadPlanner) -> None:
    buffer = io.BytesIO()
    torch.save(value, buffer)  # plain values decoded from msgpack, pickled in memory only
    buffer.seek(0)
    planner.load_bytes(req, buffer)


def _deliver(req: ReadItem, value: Any, metadata: Metadata, planner: LoadPlanner) -> None:
    if req.type == LoadItemType.BYTE_IO:
        _deliver_value(req, value, planner)
        return
    md = metadata.state_dict_metadata[req.storage_index.fqn]
    assert isinstance(md, TensorStorageMetadata)
    source = _region(_checked(value, md, req.storage_index), req.storage_offsets, req.lengths)
    target = planner.resolve_tensor(req).detach()
    if target.shape != source.shape:
        raise DecodeError(f"{req.dest_index.fqn!r}: region {list(source.shape)} != {list(target.shape)}")
    target.copy_(source)
    planner.commit_tensor(req, target)


def _checked(value: Any, md: TensorStorageMetadata, index: MetadataIndex) -> torch.Tensor:
    """``value`` if it is the tensor the metadata says the chunk at ``index`` holds."""
    offsets = tuple(index.offset or ())
    sizes = [c.sizes for c in md.chunks if tuple(c.offsets) == offsets]
    if not sizes:
        raise DecodeError(f"{index.fqn!r} has no chunk at {list(offsets)}")
    if not isinstance(value, torch.Tensor) or value.shape != sizes[0] or (
        value.dtype != md.properties.dtype
    ):
        raise DecodeError(f"stored chunk of {index.fqn!r} at {list(offsets)} does not match its metadata")
    return value


def _region(tensor: torch.Tensor, offsets: Iterable[int], lengths: Iterable[int]) -> torch.Tensor:
    for dim, (start, length) in enumerate(zip(offsets, lengths, strict=True)):
        tensor = tensor.narrow(dim, start, length)
    return tensor


def load_full(repo: Repository, target: Target = "main", *, verify: bool | None = None) -> dict[str, Any]:
    """A DCP checkpoint as one process's state dict, nested as it was saved, no process group
    needed: ``repo.load`` (layout 1: the full tensors stitched from the stored shards)."""
    cid = cidlib.to_bytes(repo.resolve(target))
    reader = TreeReader(repo.blocks, repo.pool, verify=verify)
    tree = _tree(repo, cid)
    if state_root(reader, tree) != tree:
        return repo.load(cid, verify=verify)  # type: ignore[no-any-return]
    layout = _read_layout(repo, cid, reader)
    flat: dict[str, Any] = {}
    for fqn, md in layout.metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            flat[fqn] = reader.load(Link(layout.nodes[(fqn, None)]))
            continue
        full = torch.empty(md.size, dtype=md.properties.dtype)
        for chunk in md.chunks:
            index = MetadataIndex(fqn, chunk.offsets)
            shard = _checked(reader.load(Link(layout.nodes[_key(index)])), md, index)
            _region(full, chunk.offsets, chunk.sizes).copy_(shard)
        flat[fqn] = full
    mapping = layout.metadata.planner_data
    if isinstance(mapping, dict) and mapping.keys() == flat.keys():
        from torch.distributed.checkpoint._nested_dict import unflatten_state_dict

        return unflatten_state_dict(flat, mapping)
    return flat
