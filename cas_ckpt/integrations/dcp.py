"""torch.distributed.checkpoint (DCP) storage in a cas_ckpt repository.

``dcp.save(state, storage_writer=Writer(repo, ref="main"))`` and
``dcp.load(state, storage_reader=Reader(repo, "main"))``. Every rank writes the items DCP's plan
gives it as ordinary cas_ckpt blocks, into a pack of its own, durable before ``write_data``
returns; the coordinator then writes one tree and one commit and moves the ref by
compare-and-swap in ``finish``. Nothing is pickled on disk. See ``docs/scale-out.md``.

The checkpoint's tree (a normal state tree: ``repo.load`` reads it, GC, fsck, diff, export walk it)::

    {"format": "cas_ckpt.dcp", "version": 1,
     "metadata": {"dcp_version": str | None,
                  "tensors": {fqn: {"dtype", "size", "requires_grad", "memory_format",
                                    "pin_memory", "chunks": [[offsets, sizes], ...]}},
                  "values": [fqn, ...],            # non-tensor values, stored as msgpack
                  "planner_data": ...},            # DCP's flattening map (fqn -> key path)
     "data": {fqn: [link, ...]}}                   # one node per chunk (tensors) or value

Each linked node is what ``repo.save`` would write for that shard or value alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import os
import weakref
from collections.abc import Iterable
from typing import Any

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
from cas_ckpt.codec import Link
from cas_ckpt.errors import DecodeError, RepositoryError, StateTypeError
from cas_ckpt.integrations.torch import savable_dtypes
from cas_ckpt.refs import check_ref_name
from cas_ckpt.repository import Repository, Target
from cas_ckpt.tree import TreeReader, TreeWriter

__all__ = ["MixedCheckpoints", "Reader", "ReplicaMismatch", "Writer", "load_full"]

FORMAT = "cas_ckpt.dcp"
VERSION = 1
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
    """A WriteResult's storage_data: the node holding the item (or, for a replica, the node it
    would be: another rank wrote the item, this one only checks its own copy is identical)."""

    node: bytes
    replica: bool = False
    receipt: Any = None  # the rank's packs (on its first result): the coordinator records them


# --------------------------------------------------------------------------------------------
# Saving
# --------------------------------------------------------------------------------------------
class Writer(StorageWriter):
    """A DCP StorageWriter that saves into ``repo`` and moves ``ref`` when the save completes.

    ``step``, ``metadata`` and ``message`` go into the commit as in :meth:`Repository.save`. The
    ref moves by compare-and-swap from ``expected`` (default: what it held when the save
    started), so a save that lost a race fails with :class:`RefConflict` instead of overwriting.
    ``check_replicas`` hashes each item DCP deduplicated away from a rank and fails the save with
    :class:`ReplicaMismatch` if the copies differ. After a save, ``commit`` (coordinator) and
    ``storage_meta.checkpoint_id`` of the returned Metadata (every rank) name the new commit.
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
    ) -> None:
        super().__init__()
        self.repo = repo
        self.ref = check_ref_name(ref)
        self.step, self.metadata, self.message = step, metadata, message
        self.expected = expected
        self.check_replicas = check_replicas
        self.commit: CID | None = None
        self.stats = WriteStats()
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
        """Write this rank's items as blocks in one batch, durable before returning.

        Locations travel in the WriteResults only: ``plan.storage_data`` may be a stale cached one.
        """
        # Each rank learns only what was removed (GC) before its batch, and records nothing: the
        # coordinator takes every rank's packs in at once (one journal on S3), so no rank reads
        # the others' indexes, and the coordinator runs upkeep after the commit.
        with self.repo.transaction(upkeep=False, learn=False) as txn:
            txn.blocks.journal = False
            results = [self._write_item(txn.tree, item, planner, False) for item in plan.items]
        self.stats.add(txn.stats)
        receipt = txn.blocks.receipt()
        if results and receipt:
            results[0] = dataclasses.replace(
                results[0], storage_data=dataclasses.replace(results[0].storage_data, receipt=receipt))
        results += self._replicas(plan, planner)
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def _tree_writer(self, batch: BlockWriter) -> TreeWriter:
        repo = self.repo
        return TreeWriter(batch, repo.hasher, repo.pool, chunk_size=repo.config.chunk_size)

    def _write_item(
        self, writer: TreeWriter, item: WriteItem, planner: SavePlanner, replica: bool
    ) -> WriteResult:
        before = writer.logical_bytes
        value = _item_value(item, planner)
        try:
            node = writer.write(value)
        except StateTypeError as exc:
            raise _at(item.index.fqn, exc) from None
        return WriteResult(item.index, writer.logical_bytes - before, _Stored(node, replica))

    def _replicas(self, plan: SavePlan, planner: SavePlanner) -> list[WriteResult]:
        """Fingerprints of the items DCP left to another rank (hashed, never stored)."""
        if not self.check_replicas:
            return []
        mine = {item.index for item in plan.items}
        others = [item for item in self._local_items if item.index not in mine]
        if not others:
            return []
        with _DryWriter(self.repo.blocks) as dry:
            writer = self._tree_writer(dry)
            return [self._write_item(writer, item, planner, True) for item in others]

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator: write the tree and the commit, move the ref by compare-and-swap."""
        try:
            nodes = _locations(results)
            self.repo.blocks.adopt([r.storage_data.receipt for rank in results for r in rank
                                    if isinstance(r.storage_data, _Stored) and r.storage_data.receipt])
            commit = self.repo.save(
                _tree(metadata, nodes), ref=self.ref, step=self.step, metadata=self.metadata,
                message=self.message, expected=self._parent,
            )
        finally:
            self.close()
        self.commit = commit
        metadata.storage_meta = dataclasses.replace(
            metadata.storage_meta or StorageMeta(), checkpoint_id=str(commit)
        )


class _DryWriter(BlockWriter):
    """A batch that keeps nothing: hashing a value to its node CID without storing it."""

    def _append(self, cid: bytes, stored: Stored, size: int, keep: bool = False) -> None:
        pass

    def commit(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = True


def _item_value(item: WriteItem, planner: SavePlanner) -> Any:
    """The tensor (shard) or the plain value to store for ``item``.

    DCP hands non-tensor values over pickled (``torch.save``); the planner's original object is
    taken instead and stored as msgpack. A planner without ``lookup_object`` has its freshly
    made bytes read back with ``weights_only=True`` (they never touched the disk).
    """
    if item.type != WriteItemType.BYTE_IO:
        return planner.resolve_data(item)
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


def _locations(results: Iterable[Iterable[WriteResult]]) -> dict[_Key, bytes]:
    """Item -> node from every rank's results; :class:`ReplicaMismatch` if replicas differ."""
    written: dict[_Key, bytes] = {}
    replicas: dict[_Key, list[bytes]] = {}
    for rank_results in results:
        for result in rank_results:
            stored = result.storage_data
            if not isinstance(stored, _Stored):
                raise RepositoryError(f"unexpected write result for {result.index.fqn}")
            key = _key(result.index)
            if stored.replica:
                replicas.setdefault(key, []).append(stored.node)
            elif written.setdefault(key, stored.node) != stored.node:
                raise ReplicaMismatch(f"two ranks wrote different values for {_name(key)}")
    for key, nodes in replicas.items():
        if any(node != written.get(key) for node in nodes):
            raise ReplicaMismatch(
                f"ranks hold different values for {_name(key)}; DCP keeps one rank's copy of a "
                "plain (non-DTensor) value: make it identical on every rank, shard it as a "
                "DTensor, or give each rank its own key"
            )
    return written


def _name(key: _Key) -> str:
    fqn, offsets = key
    return repr(fqn) if offsets is None or not any(offsets) else f"{fqn!r} at {list(offsets)}"


def _tree(metadata: Metadata, nodes: dict[_Key, bytes]) -> dict[str, Any]:
    tensors: dict[str, Any] = {}
    values: list[str] = []
    data: dict[str, list[Link]] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            tensors[fqn] = _tensor_entry(fqn, md)
            keys = [(fqn, tuple(chunk.offsets)) for chunk in md.chunks]
        else:
            values.append(fqn)
            keys = [(fqn, None)]
        missing = [k for k in keys if k not in nodes]
        if missing:
            raise RepositoryError(f"no rank wrote {_name(missing[0])}")
        data[fqn] = [Link(nodes[k]) for k in keys]
    meta = {
        "dcp_version": metadata.version,
        "tensors": tensors,
        "values": values,
        "planner_data": metadata.planner_data,
    }
    return {"format": FORMAT, "version": VERSION, "metadata": meta, "data": data}


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
    """A DCP checkpoint's metadata and where each item's node is."""

    metadata: Metadata
    nodes: dict[_Key, bytes]


def _read_layout(repo: Repository, cid: bytes, reader: TreeReader) -> _Layout:
    name = cidlib.to_str(cid)
    try:
        tree = cidlib.to_bytes(repo.commit(cid).tree)
    except DecodeError:
        tree = cid  # a bare tree node rather than a commit
    root = reader.resolve(Link(tree))
    if not isinstance(root, dict) or root.get("format") != FORMAT:
        raise RepositoryError(f"{name} is not a checkpoint written through cas_ckpt.dcp")
    version = root.get("version")
    if type(version) is not int or version > VERSION:
        raise RepositoryError(f"{name} has cas_ckpt.dcp version {version!r}: upgrade cas_ckpt")
    meta = reader.load(root.get("metadata"))
    data = reader.resolve(root.get("data"))
    if not isinstance(meta, dict) or not isinstance(data, dict):
        raise DecodeError("malformed cas_ckpt.dcp tree", cid=name)
    state_md: dict[str, Any] = {}
    nodes: dict[_Key, bytes] = {}
    for fqn, entry in _dict(meta.get("tensors")).items():
        state_md[fqn] = _tensor_md(fqn, _dict(entry))
        keys: list[_Key] = [(fqn, tuple(c.offsets)) for c in state_md[fqn].chunks]
        nodes.update(zip(keys, _links(reader, data.get(fqn), len(keys), fqn), strict=True))
    for fqn in _list(meta.get("values")):
        state_md[fqn] = BytesStorageMetadata()
        nodes[(fqn, None)] = _links(reader, data.get(fqn), 1, fqn)[0]
    metadata = Metadata(
        state_dict_metadata=state_md,
        planner_data=meta.get("planner_data"),
        storage_meta=StorageMeta(checkpoint_id=name),
        version=meta.get("dcp_version"),
    )
    return _Layout(metadata, nodes)


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


def _tensor_md(fqn: str, entry: dict[str, Any]) -> TensorStorageMetadata:
    dtypes = _dtypes()
    dtype, fmt = entry.get("dtype"), entry.get("memory_format", "contiguous_format")
    if dtype not in dtypes or fmt not in _MEMORY_FORMATS:
        raise DecodeError(f"{fqn!r}: unknown dtype {dtype!r} or memory format {fmt!r}")
    chunks = [
        ChunkStorageMetadata(torch.Size(_ints(off, fqn)), torch.Size(_ints(size, fqn)))
        for off, size in _list(entry.get("chunks"))
    ]
    props = TensorProperties(
        dtype=dtypes[dtype],
        requires_grad=entry.get("requires_grad") is True,
        memory_format=_MEMORY_FORMATS[fmt],
        pin_memory=entry.get("pin_memory") is True,
    )
    return TensorStorageMetadata(props, torch.Size(_ints(entry.get("size"), fqn)), chunks)


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
        """Read each stored node once (hash-verified) and copy the requested regions."""
        layout, reader = self.layout(), self._reader()
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
        future: Future[None] = Future()
        future.set_result(None)
        return future


def _deliver(req: ReadItem, value: Any, metadata: Metadata, planner: LoadPlanner) -> None:
    if req.type == LoadItemType.BYTE_IO:
        buffer = io.BytesIO()
        torch.save(value, buffer)  # plain values decoded from msgpack, pickled in memory only
        buffer.seek(0)
        planner.load_bytes(req, buffer)
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
    """A DCP checkpoint as one process's state dict: full tensors stitched from the shards.

    Nested the way the saved state was (DCP's flattening undone); no process group needed.
    """
    reader = TreeReader(repo.blocks, repo.pool, verify=verify)
    layout = _read_layout(repo, cidlib.to_bytes(repo.resolve(target)), reader)
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
