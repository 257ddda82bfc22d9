"""safetensors files and Hugging Face model folders in and out of a repository.

The format (``safetensors/src/tensor.rs``): an 8-byte little-endian header length N, N bytes of
JSON (``{"name": {"dtype", "shape", "data_offsets": [begin, end]}, ..., "__metadata__": {str: str}}``),
then the tensors' bytes back to back. The safetensors package is never needed: files are parsed
and validated here, read through mmap, and written here, streaming.

An import stores each tensor as an ordinary array (so identical tensors share their blocks across
fine-tunes, shards and re-shardings), and beside them the original header bytes and a folder's
other files, so that :func:`export` re-creates the exact file or folder. The state tree an import
writes (``docs/format.md``, "safetensors imports")::

    {prefix: {tensor name: array, ...},
     "safetensors": {"version": 1, "prefix": prefix, "folder": bool,
                     "files": [{"path": "model.safetensors", "header": bytes}, ...],
                     "blobs": {"config.json": bytes, ...}}}

:func:`export` with ``model=True`` writes any checkpoint (a training state, a DCP checkpoint of
many ranks) as a Hugging Face model folder: its tensors only, streamed a window of chunks at a
time.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import mmap
import os
import re
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO

import numpy as np

from cas_ckpt import _fs, codec
from cas_ckpt import cid as cidlib
from cas_ckpt.blocks.base import BlockStore
from cas_ckpt.codec import Link, Tagged
from cas_ckpt.errors import DecodeError, SafetensorsError, StateTypeError
from cas_ckpt.paths import select
from cas_ckpt.tree import (
    BLOB,
    MAX_DIMS,
    MAX_LINKS,
    NDARRAY,
    TUPLE,
    Encoded,
    TreeReader,
    TreeWriter,
    float_size,
    parse_dtype,
)

MAX_HEADER = 100_000_000  # safetensors' own limit (MAX_HEADER_SIZE)
LAYOUT = "safetensors"  # the state key holding the layout record of an import
LAYOUT_VERSION = 1
INDEX = "model.safetensors.index.json"
SUFFIX = ".safetensors"
# Tensors up to this size go through the tree writer whole; larger ones are written a window at a
# time (the same encoding), so an import's resident memory stays near this size whatever the model.
WINDOW = 64 * 1024 * 1024
READ_WINDOW = 16 * 1024 * 1024  # bytes of chunks an export holds at once
WRITEBACK_STEP = 32 * 1024 * 1024

# safetensors dtype -> (bits per element, cas_ckpt dtype name), in the order of safetensors' Dtype
# enum: save_file sorts tensors by this order, descending, then by name. F4 and F6 pack elements
# below a byte; they are stored as their raw bytes (a uint8 array of the byte count).
DTYPES: dict[str, tuple[int, str]] = {
    "BOOL": (8, "|b1"),
    "F4": (4, "|u1"),
    "F6_E2M3": (6, "|u1"),
    "F6_E3M2": (6, "|u1"),
    "U8": (8, "|u1"),
    "I8": (8, "|i1"),
    "F8_E5M2": (8, "float8_e5m2"),
    "F8_E4M3": (8, "float8_e4m3fn"),
    "F8_E8M0": (8, "float8_e8m0fnu"),
    "F8_E4M3FNUZ": (8, "float8_e4m3fnuz"),
    "F8_E5M2FNUZ": (8, "float8_e5m2fnuz"),
    "I16": (16, "<i2"),
    "U16": (16, "<u2"),
    "F16": (16, "<f2"),
    "BF16": (16, "bfloat16"),
    "I32": (32, "<i4"),
    "U32": (32, "<u4"),
    "F32": (32, "<f4"),
    "C64": (64, "<c8"),
    "F64": (64, "<f8"),
    "I64": (64, "<i8"),
    "U64": (64, "<u8"),
}
RANK = {name: i for i, name in enumerate(DTYPES)}
PACKED = ("F4", "F6_E2M3", "F6_E3M2")
# A stored dtype name (either byte order) -> the safetensors dtype it is written as.
_EXPORT_DTYPE = {
    **{name: st for st, (_, name) in DTYPES.items() if st not in PACKED},
    **{">" + name[1:]: st for st, (_, name) in DTYPES.items() if name[0] == "<"},
}


# --------------------------------------------------------------------------------------------
# The header
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Entry:
    """One tensor of a header: its name, safetensors dtype, shape and byte range in the data."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass
class Header:
    """A parsed, validated header: the raw bytes, the tensors by offset, the ``__metadata__``."""

    raw: bytes
    entries: list[Entry]
    metadata: dict[str, str] | None

    @property
    def data_start(self) -> int:
        return 8 + len(self.raw)

    @property
    def data_size(self) -> int:
        return self.entries[-1].end if self.entries else 0


def parse_header(data: bytes | memoryview | mmap.mmap, size: int, where: str) -> Header:
    """Parse and validate the header at the start of ``data`` (a file of ``size`` bytes).

    The checks are safetensors' own (``Metadata::validate``): a header of at most 100,000,000
    bytes that fits the file, UTF-8 JSON of an object, known dtypes, offsets that run contiguously
    from 0 to the end of the file, and each tensor's size equal to its elements times its dtype's
    size. :class:`SafetensorsError` names ``where`` and the tensor at fault.
    """
    if size < 8:
        raise SafetensorsError(where, f"{size} bytes is too short for a safetensors file")
    length = int.from_bytes(bytes(data[:8]), "little")
    if length > MAX_HEADER:
        raise SafetensorsError(where, f"header length {length} is over the {MAX_HEADER} byte limit")
    if length + 8 > size:
        raise SafetensorsError(where, f"header length {length} runs past the end of the file")
    header = parse_raw(bytes(data[8 : 8 + length]), where)
    if 8 + length + header.data_size != size:
        raise SafetensorsError(where, f"the tensors cover {header.data_size} bytes of data, the "
                               f"file holds {size - 8 - length} after the header")
    return header


def parse_raw(raw: bytes, where: str) -> Header:
    """Parse and validate header bytes (the JSON, without the length before it)."""
    try:
        parsed = json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except UnicodeDecodeError as exc:
        raise SafetensorsError(where, f"header is not UTF-8: {exc.reason}") from None
    except (ValueError, RecursionError) as exc:
        raise SafetensorsError(where, f"header is not JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise SafetensorsError(where, "header is not a JSON object")
    metadata = _metadata(parsed.pop("__metadata__", None), where)
    entries = sorted((_entry(name, info, where) for name, info in parsed.items()),
                     key=lambda e: (e.begin, e.end))
    start = 0
    for entry in entries:
        if entry.begin != start or entry.end < entry.begin:
            raise SafetensorsError(where, f"offsets {[entry.begin, entry.end]} do not follow the "
                                   f"previous tensor (which ends at {start})", tensor=entry.name)
        bits = math.prod(entry.shape) * DTYPES[entry.dtype][0]
        if bits % 8:
            raise SafetensorsError(where, f"{entry.dtype} tensor of shape {list(entry.shape)} does "
                                   "not end on a byte boundary", tensor=entry.name)
        if entry.end - entry.begin != bits // 8:
            raise SafetensorsError(where, f"holds {entry.end - entry.begin} bytes, but shape "
                                   f"{list(entry.shape)} of {entry.dtype} needs {bits // 8}",
                                   tensor=entry.name)
        start = entry.end
    return Header(raw, entries, metadata)


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")  # Python reads NaN and Infinity; JSON (and serde) do not


def _text(value: str, where: str, what: str) -> str:
    """``value``, unless it holds a lone surrogate (a ``\\ud800`` escape), which UTF-8 cannot hold."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise SafetensorsError(where, f"{what} {value!r} is not valid Unicode") from None
    return value


def _metadata(value: Any, where: str) -> dict[str, str] | None:
    if value is None:
        return None
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise SafetensorsError(where, "__metadata__ must map strings to strings")
    for key, text in value.items():
        _text(key, where, "metadata key")
        _text(text, where, "metadata value")
    return value


def _entry(name: str, info: Any, where: str) -> Entry:
    _text(name, where, "tensor name")
    if not isinstance(info, dict):
        raise SafetensorsError(where, "tensor info is not a JSON object", tensor=name)
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise SafetensorsError(where, f"unknown dtype {dtype!r}", tensor=name)
    if not isinstance(shape, list) or not all(_uint(d) for d in shape):
        raise SafetensorsError(where, f"shape {shape!r} is not a list of sizes", tensor=name)
    if _overflows(shape, DTYPES[dtype][0]):
        raise SafetensorsError(where, f"shape of {len(shape)} dimensions overflows 64 bits as "
                               "safetensors counts elements (left to right)", tensor=name)
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_uint(o) for o in offsets):
        raise SafetensorsError(where, f"data_offsets {offsets!r} is not two offsets", tensor=name)
    return Entry(name, dtype, tuple(shape), offsets[0], offsets[1])


def _uint(value: Any) -> bool:
    return type(value) is int and 0 <= value < 2**64


def _overflows(shape: list[int], bits: int) -> bool:
    """safetensors' own check (``Metadata::validate``): the element count, multiplied out left to
    right, and then its bits, each fit 64 bits (so ``[2**63, 2**63, 0]`` is refused)."""
    count = 1
    for size in shape:
        count *= size
        if count >= 2**64:
            return True
    return count * bits >= 2**64


def write_header(
    tensors: list[tuple[str, str, tuple[int, ...], int]], metadata: dict[str, str] | None
) -> tuple[bytes, list[tuple[str, str, tuple[int, ...], int]]]:
    """The header save_file writes for ``(name, dtype, shape, nbytes)`` tensors, and their order.

    As safetensors' ``prepare``: tensors sorted by dtype (descending enum order) then name, compact
    JSON with ``__metadata__`` first, padded with spaces to a multiple of 8 bytes.
    """
    ordered = sorted(tensors, key=lambda t: (-RANK[t[1]], t[0]))
    body: dict[str, Any] = {} if metadata is None else {"__metadata__": metadata}
    offset = 0
    for name, dtype, shape, nbytes in ordered:
        body[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    return raw + b" " * (-len(raw) % 8), ordered


# --------------------------------------------------------------------------------------------
# Import
# --------------------------------------------------------------------------------------------
def import_tree(tree: TreeWriter, src: str | os.PathLike[str], *, prefix: str) -> bytes:
    """Store the safetensors file or folder ``src`` through ``tree``; return its tree's CID."""
    if not isinstance(prefix, str) or not prefix or prefix == LAYOUT:
        raise StateTypeError("prefix", f"prefix must be a non-empty str other than {LAYOUT!r}")
    root = Path(src)
    if not root.exists():
        raise SafetensorsError(str(root), "no such file or directory")
    folder = root.is_dir()
    files, blobs = _folder(root) if folder else ([root.name], [])
    base = root if folder else root.parent
    if not files:
        raise SafetensorsError(str(root), "holds no .safetensors file")
    tensors: dict[str, Link] = {}
    records = []
    for rel in files:
        header = _import_file(tree, base / rel, tensors, _key_prefix(rel))
        records.append({"path": rel, "header": header})
    layout = {"version": LAYOUT_VERSION, "prefix": prefix, "folder": folder, "files": records,
              "blobs": {rel: _write_blob(tree, base / rel) for rel in blobs}}
    return tree.write({prefix: tensors, LAYOUT: layout})


def _folder(root: Path) -> tuple[list[str], list[str]]:
    """The folder's .safetensors files and its other files (relative POSIX paths, sorted)."""
    files, blobs = [], []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames[:] = sorted(d for d in dirnames if d != ".git")
        for name in dirnames:
            if Path(dirpath, name).is_symlink():  # never followed (a loop), never skipped quietly
                raise SafetensorsError(str(Path(dirpath, name)), "is a link to a folder: copy it in")
        for name in sorted(filenames):
            path = Path(dirpath, name)
            rel = path.relative_to(root).as_posix()
            if not path.is_file():  # a FIFO or a dangling link: never opened
                raise SafetensorsError(str(path), "is not a regular file")
            (files if name.endswith(SUFFIX) else blobs).append(rel)
    return sorted(files), sorted(blobs)


def _key_prefix(rel: str) -> str:
    """Tensors of files in a sub-folder (a diffusers pipeline) are keyed ``sub/dir/name``."""
    parent = PurePosixPath(rel).parent.as_posix()
    return "" if parent == "." else parent + "/"


def _write_blob(tree: TreeWriter, path: Path) -> bytes | Encoded:
    """A folder's other file, streamed (an optimizer.pt beside the model can be gigabytes)."""
    with open(path, "rb") as f:
        return tree.write_blob(f)


def _import_file(tree: TreeWriter, path: Path, tensors: dict[str, Link], key_prefix: str) -> bytes:
    """Store the tensors of one file (each as its own array node); return its header bytes."""
    where = str(path)
    with open(path, "rb") as f:  # the mapping keeps its own descriptor
        size = os.fstat(f.fileno()).st_size
        if size < 8:
            raise SafetensorsError(where, f"{size} bytes is too short for a safetensors file")
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    # Closed here on success only: after an error the traceback's frames still hold views of the
    # mapping (closing would raise BufferError over the real error); the collector unmaps it.
    header = parse_header(mapped, size, where)
    view = memoryview(mapped)
    for entry in header.entries:
        key = key_prefix + entry.name
        if key in tensors:
            raise SafetensorsError(where, "a tensor of this name is in another file of the folder "
                                   "too", tensor=entry.name)
        start = header.data_start + entry.begin
        data = view[start : header.data_start + entry.end]
        tensors[key] = Link(_write_tensor(tree, entry, data, mapped, start, where))
        data.release()
    view.release()
    mapped.close()
    return header.raw


def _write_tensor(tree: TreeWriter, entry: Entry, data: memoryview, mapped: mmap.mmap,
                  start: int, where: str) -> bytes:
    """Store one tensor as an array node; return the node's CID."""
    name = DTYPES[entry.dtype][1]
    dtype = parse_dtype(name)
    shape = [data.nbytes] if entry.dtype in PACKED else list(entry.shape)
    _check_shape(shape, dtype.itemsize, where, entry.name)
    if data.nbytes <= WINDOW:
        array = np.frombuffer(data, dtype=dtype).reshape(shape)
        cid = tree.write(array)
        del array
    else:
        cid = _write_large(tree, name, shape, data, mapped, start)
    _drop(mapped, start, data.nbytes)
    return cid


def _check_shape(shape: list[int], itemsize: int, where: str, tensor: str) -> None:
    """A shape an array can have (numpy's limits, which the tree keeps on load too): at most
    64 dimensions, and its nonzero sizes times the item size within a signed 64-bit size."""
    if len(shape) > MAX_DIMS:
        raise SafetensorsError(where, f"shape of {len(shape)} dimensions: an array has at most "
                               f"{MAX_DIMS}", tensor=tensor)
    if math.prod(d for d in shape if d) * itemsize >= 2**63:
        raise SafetensorsError(where, f"shape {shape} is larger than any array", tensor=tensor)


def _write_large(tree: TreeWriter, dtype: str, shape: list[int], data: memoryview,
                 mapped: mmap.mmap, start: int) -> bytes:
    """A large array, one window of chunks at a time: the node ``tree.write`` would write.

    ``docs/format.md`` (ndarray): chunks of ``chunk_size`` bytes from the array's start, each a raw
    block, listed in ``chunks`` (or in link pages past 16384).
    """
    size = tree.chunk_size
    links: list[Link] = []
    digest = functools.partial(tree._digest, float_size=float_size(dtype))  # hash (and compress)
    for at in range(0, data.nbytes, WINDOW):
        window = data[at : at + WINDOW]
        chunks = [window[i : i + size] for i in range(0, window.nbytes, size)]
        for chunk, (cid, stored) in zip(chunks, tree.pool.map(digest, chunks), strict=True):
            tree.writer.put(cid, chunk, stored=stored)
            links.append(Link(cid))
        _drop(mapped, start + at, window.nbytes)
    header: dict[str, Any] = {"dtype": dtype, "shape": shape, "chunk_size": size}
    if len(links) > MAX_LINKS:
        pages = [links[i : i + MAX_LINKS] for i in range(0, len(links), MAX_LINKS)]
        header["chunk_pages"] = [Link(_put_node(tree, codec.encode(p))) for p in pages]
    else:
        header["chunks"] = links
    tree.logical_bytes += data.nbytes
    return _put_node(tree, codec.encode(Tagged(NDARRAY, header)))


def _put_node(tree: TreeWriter, node: bytes) -> bytes:
    cid = tree.hasher.node(node)
    tree.writer.put(cid, node)
    return cid


def _drop(mapped: mmap.mmap, start: int, length: int) -> None:
    """Release the pages of a stored range from this process (they stay in the page cache)."""
    if hasattr(mmap, "MADV_DONTNEED") and length:
        aligned = start - start % mmap.PAGESIZE
        mapped.madvise(mmap.MADV_DONTNEED, aligned, min(length + start - aligned, len(mapped) - aligned))


def looks_like_safetensors(path: str | os.PathLike[str]) -> bool:
    """True if ``path`` is a folder, or a file that starts as a safetensors file does."""
    target = Path(path)
    if target.is_dir():
        return True
    try:
        with open(target, "rb") as f:
            head = f.read(64)
            size = os.fstat(f.fileno()).st_size
    except OSError:
        return False
    if len(head) < 9:
        return False
    length = int.from_bytes(head[:8], "little")
    return 2 <= length <= MAX_HEADER and length + 8 <= size and head[8:].lstrip()[:1] == b"{"


# --------------------------------------------------------------------------------------------
# Export
# --------------------------------------------------------------------------------------------
@dataclass
class SafetensorsReport:
    """What an export wrote: the files (in order), tensors, bytes, and whether it was a re-creation."""

    files: list[str] = field(default_factory=list)
    tensors: int = 0
    bytes: int = 0
    exact: bool = False  # the imported file or folder re-created byte for byte
    seconds: float = 0.0
    # A model folder (``model=True``): the values left out as not tensors, by state path
    # (the outermost map or list holding no tensor, e.g. ``optim.param_groups``), in state order.
    skipped: list[str] = field(default_factory=list)


@dataclass
class _Tensor:
    name: str
    dtype: str  # safetensors dtype
    shape: tuple[int, ...]
    nbytes: int
    value: Tagged  # the stored ndarray
    path: str  # where it is in the state


class _Exporter:
    def __init__(self, store: BlockStore, pool: Executor, verify: bool | None, where: str) -> None:
        self.reader = TreeReader(store, pool, verify=verify, tensor_factory=lambda array, _: array)
        self.store = store
        self.pool = pool
        self.where = where  # what errors in the checkpoint's records name: the export's target
        self.buffers: list[np.ndarray[Any, Any] | None] = [None, None]
        self.report = SafetensorsReport()
        self.staged = _Staged()

    # -- reading the state -----------------------------------------------------------------------
    def leaves(self, value: Any, path: str, base: str, tensors: list[_Tensor],
               metadata: dict[str, str], skipped: list[str] | None = None) -> bool:
        """Collect the tensors below ``value`` by dotted name, and its strings as metadata; True
        if it holds a tensor. With ``skipped`` (a model folder), every other value (strings too)
        is left out and its path listed there instead: the outermost map or list below ``value``
        that holds no tensor as one path. Only the nodes of maps and lists are read for this,
        never an array's chunks."""
        value = self.reader.resolve(value)
        items: Any = None
        if isinstance(value, dict):
            items = value.items()
        elif isinstance(value, list) or (isinstance(value, Tagged) and value.code == TUPLE):
            items = value if isinstance(value, list) else value.value
            if not isinstance(items, list):
                raise DecodeError("malformed tuple: expected a list", path=base)
            items = enumerate(items)
        if items is not None:
            mark = len(skipped) if skipped is not None else 0
            found = False
            for key, item in items:
                found |= self.leaves(item, _join(path, key), _join(base, key), tensors, metadata,
                                     skipped)
            if skipped is not None and not found and path:  # one path for a subtree of values
                del skipped[mark:]
                skipped.append(base)
            return found
        if isinstance(value, Tagged) and value.code == NDARRAY:
            tensors.append(self.tensor(value, path, base))
            return True
        if skipped is not None:
            skipped.append(base or "(root)")
        elif isinstance(value, str) or (isinstance(value, Tagged) and value.code == BLOB
                                        and isinstance(value.value, dict) and value.value.get("str")):
            metadata[path] = value if isinstance(value, str) else self.reader.load(value)
        else:
            kind = type(value.value).__name__ if isinstance(value, Tagged) else type(value).__name__
            raise StateTypeError(base or "(root)", f"a value of type {kind} is neither a tensor "
                                 "nor a str: safetensors holds tensors, and strings as __metadata__ "
                                 "(export only the tensors below a path: path=, --path)")
        return False

    def tensor(self, value: Tagged, name: str, path: str) -> _Tensor:
        if not name:
            raise StateTypeError(path or "(root)", "a tensor needs a name: export a dict of tensors")
        stored, shape = _stored_array(value, self.where, name)
        dtype = _EXPORT_DTYPE.get(stored)
        if dtype is None:
            raise StateTypeError(path or name, f"dtype {stored} has no safetensors dtype")
        nbytes = math.prod(shape) * parse_dtype(stored).itemsize
        return _Tensor(name, dtype, tuple(shape), nbytes, value, path or name)

    # -- writing ---------------------------------------------------------------------------------
    def write_file(self, out: _Sink, raw: bytes, tensors: list[_Tensor]) -> None:
        """Write a whole file: the header, then every tensor's bytes in order.

        Chunks come straight from the store a window at a time, the next window read (and
        verified) while the one before is written: two windows in memory whatever the size.
        """
        out.write(len(raw).to_bytes(8, "little"))
        out.write(raw)
        self._stream(out, self._jobs(tensors))
        self.report.bytes += 8 + len(raw) + sum(t.nbytes for t in tensors)
        self.report.tensors += len(tensors)

    def write_blob(self, out: _Sink, value: bytes | Tagged, name: str) -> None:
        """Write one of a folder's other files (``value`` from :func:`_stored_files`): its
        chunks a window at a time, as tensors are, never the whole file at once."""
        if isinstance(value, bytes):
            out.write(value)
            self.report.bytes += len(value)
            return
        size = value.value.get("size")
        cids = self.reader._chunk_links(value.value)
        sizes = [self.store.size(c) for c in cids]
        if sum(sizes) != size:
            raise SafetensorsError(name, f"its chunks hold {sum(sizes)} bytes, the file {size}")
        self._stream(out, (([cids[i] for i in group], [sizes[i] for i in group])
                           for group in _groups(sizes, READ_WINDOW)))
        self.report.bytes += size

    def _stream(self, out: _Sink, jobs: Iterator[tuple[list[bytes], list[int]] | memoryview]) -> None:
        """Write what ``jobs`` name, in order, reading each while the one before is written."""
        with ThreadPoolExecutor(1, thread_name_prefix="cas_ckpt-export") as ahead:
            current: Future[memoryview] | None = None
            for slot, job in enumerate(jobs):
                following = self._start(job, slot % 2, ahead)
                if current is not None:
                    out.write(current.result())
                current = following
            if current is not None:
                out.write(current.result())

    def _jobs(self, tensors: list[_Tensor]) -> Iterator[tuple[list[bytes], list[int]] | memoryview]:
        """Windows of chunks to read, or bytes converted in memory (inline, Fortran, big-endian)."""
        for tensor in tensors:
            header = tensor.value.value
            stored = parse_dtype(header["dtype"])
            chunked = "chunks" in header or "chunk_pages" in header
            if not (chunked and header.get("order", "C") == "C" and stored.byteorder != ">"):
                array = np.asarray(self.reader.load(tensor.value))
                array = np.ascontiguousarray(array.astype(array.dtype.newbyteorder("<"), copy=False))
                yield memoryview(array.reshape(-1).view(np.uint8))
                continue
            cids = self.reader._chunk_links(header)
            sizes = self.store.sizes(cids)
            if sum(sizes) != tensor.nbytes:
                raise SafetensorsError(tensor.path, f"chunks hold {sum(sizes)} bytes, shape needs "
                                       f"{tensor.nbytes}")
            for group in _groups(sizes, READ_WINDOW):
                yield [cids[i] for i in group], [sizes[i] for i in group]

    def _start(self, job: tuple[list[bytes], list[int]] | memoryview, slot: int,
               ahead: Executor) -> Future[memoryview]:
        if isinstance(job, memoryview):
            done: Future[memoryview] = Future()
            done.set_result(job)
            return done
        cids, sizes = job
        if self.buffers[slot] is None:
            self.buffers[slot] = np.empty(READ_WINDOW, dtype=np.uint8)
        view = memoryview(self.buffers[slot])[: sum(sizes)]

        def read() -> memoryview:
            self.store.get_many_into(cids, sizes, view, self.pool, verify=self.reader.verify)
            return view

        return ahead.submit(read)


def _stored_array(value: Tagged, where: str, name: str) -> tuple[str, list[int]]:
    """The dtype name and shape of a stored array, checked (the checkpoint is data, not trusted):
    :class:`SafetensorsError` naming the export and the tensor if either is malformed."""
    header = value.value
    if not isinstance(header, dict):
        raise SafetensorsError(where, "the stored array's header is not a map", tensor=name)
    dtype, shape = header.get("dtype"), header.get("shape")
    if not isinstance(dtype, str):
        raise SafetensorsError(where, f"the stored dtype {dtype!r} is not a name", tensor=name)
    if not (isinstance(shape, list) and len(shape) <= MAX_DIMS
            and all(type(d) is int and 0 <= d < 2**63 for d in shape)):
        raise SafetensorsError(where, f"the stored shape {shape!r} is not a list of at most "
                               f"{MAX_DIMS} sizes", tensor=name)
    return dtype, shape


def _groups(sizes: list[int], limit: int) -> Iterator[list[int]]:
    """Indices of consecutive chunks, in groups of at most ``limit`` bytes (one chunk at least)."""
    group: list[int] = []
    total = 0
    for i, size in enumerate(sizes):
        if group and total + size > limit:
            yield group
            group, total = [], 0
        group.append(i)
        total += size
    if group:
        yield group


def _join(path: str, key: object) -> str:
    return f"{path}.{key}" if path else str(key)


def export(
    store: BlockStore, pool: Executor, tree: bytes, out: str | os.PathLike[str], *,
    path: str | None = None, max_shard_size: int | str | None = None, tied: bool = False,
    verify: bool | None = None, model: bool = False,
) -> SafetensorsReport:
    """Write the checkpoint whose state tree is ``tree`` as safetensors (see the module docstring).

    An imported file or folder, with ``path`` None, is re-created byte for byte (or re-sharded,
    with ``max_shard_size``). Otherwise the tensors below ``path`` (dotted names) are written as
    save_file writes them; ``out`` ending in ``.safetensors`` is a file, anything else a folder.
    ``tied``: tensors with identical stored contents are written once, as save_model writes tied
    weights (each dropped name recorded in ``__metadata__`` as ``dropped: kept``).

    ``model``: ``out`` is a Hugging Face model folder whatever its name: ``model.safetensors``,
    or with ``max_shard_size`` ``model-0000i-of-0000n.safetensors`` shards and
    ``model.safetensors.index.json``; every value that is not a tensor (ints, floats, lists of
    them, strings, bytes, None) is left out and listed in the report's ``skipped``, and each
    file's ``__metadata__`` is ``{"format": "pt"}``, as ``save_pretrained`` writes it.
    """
    started = time.perf_counter()
    limit = parse_size(max_shard_size) if max_shard_size is not None else None
    target = Path(out)
    exporter = _Exporter(store, pool, verify, str(target))
    try:
        _export(exporter, tree, target, path, limit, tied, model)
        exporter.staged.commit()
    except BaseException:
        exporter.staged.abort()
        raise
    exporter.report.seconds = time.perf_counter() - started
    return exporter.report


def _export(exporter: _Exporter, tree: bytes, target: Path, path: str | None, limit: int | None,
            tied: bool, model: bool = False) -> None:
    """Everything :func:`export` does but putting the files in place."""
    reader = exporter.reader
    root = reader.resolve(Link(tree))
    layout = _layout(reader, root) if path is None else None
    if layout is not None and limit is None:
        _export_layout(exporter, root, layout, target, model)
    else:
        value, base = root, ""
        if path is not None:
            selection = select(reader, Link(tree), path, cidlib.to_str(tree))
            value, base = selection.value, selection.path
        blobs: dict[str, bytes | Tagged] = {}
        metadata: dict[str, str] = {}
        tensors: list[_Tensor] = []
        if layout is not None:  # re-sharding an import: its tensors, its other files
            nested = [f["path"] for f in layout["files"] if _key_prefix(f["path"])]
            if nested:
                raise SafetensorsError(nested[0], "re-sharding a folder with safetensors files in "
                                       "sub-folders (a pipeline) is not supported: export it whole, or "
                                       "each sub-folder's tensors with path=")
            value = root[layout["prefix"]]
            blobs = {k: v for k, v in layout["blobs"].items() if k != INDEX}
            metadata = _common_metadata(layout)
        skipped = exporter.report.skipped if model and layout is None else None
        exporter.leaves(value, "", base, tensors, metadata, skipped)
        if model and not tensors:
            raise StateTypeError(base or "(root)", "holds no tensor: a model folder holds tensors "
                                 "(name the model's part of the state: path=, --path)")
        if model and layout is None:
            metadata = {"format": "pt"}  # as save_pretrained writes; the state's strings are skipped
        if tied:
            tensors = _untie(tensors, metadata)
        _export_tensors(exporter, tensors, metadata or None, target, limit, blobs,
                        folder=model, reserved=() if model else metadata)


def _layout(reader: TreeReader, root: Any) -> dict[str, Any] | None:
    """The layout record of an imported checkpoint, or None for any other state."""
    if not isinstance(root, dict) or LAYOUT not in root:
        return None
    record = reader.resolve(root[LAYOUT])
    if not isinstance(record, dict):
        return None
    blobs = record.get("blobs")  # the other files are streamed, never loaded (write_blob)
    layout = reader.load({key: value for key, value in record.items() if key != "blobs"})
    if layout.get("version") != LAYOUT_VERSION:
        return None
    prefix = layout.get("prefix")
    if not isinstance(prefix, str) or prefix not in root:
        return None
    files = layout.get("files")
    blobs = layout["blobs"] = _stored_files(reader, blobs)
    if not (isinstance(files, list) and files and blobs is not None
            and isinstance(layout.get("folder"), bool)
            and all(isinstance(f, dict) and isinstance(f.get("path"), str)
                    and isinstance(f.get("header"), bytes) for f in files)):
        raise SafetensorsError(LAYOUT, "the layout record of this import is malformed "
                               "(docs/format.md, \"safetensors imports\"); pass path= to export its tensors")
    return layout


def _stored_files(reader: TreeReader, value: Any) -> dict[str, bytes | Tagged] | None:
    """An import's other files by path, each as stored (bytes, or a blob not yet read), or
    None if the record is malformed."""
    files = reader.resolve(value)
    if not isinstance(files, dict):
        return None
    found: dict[str, bytes | Tagged] = {}
    for name, stored in files.items():
        stored = reader.resolve(stored)
        if not isinstance(name, str) or not (isinstance(stored, bytes) or (
                isinstance(stored, Tagged) and stored.code == BLOB and isinstance(stored.value, dict)
                and not stored.value.get("str"))):
            return None
        found[name] = stored
    return found


def _common_metadata(layout: dict[str, Any]) -> dict[str, str]:
    """The ``__metadata__`` every imported file had (``{"format": "pt"}``...), else none."""
    found = [parse_raw(f["header"], f["path"]).metadata for f in layout["files"]]
    return dict(found[0] or {}) if all(m == found[0] for m in found) else {}


def _export_layout(exporter: _Exporter, root: dict[Any, Any], layout: dict[str, Any],
                   target: Path, model: bool = False) -> None:
    """Re-create the imported file or folder exactly (a file imported alone, as a model folder:
    the same bytes as ``model.safetensors`` in ``target``)."""
    stored = exporter.reader.resolve(root[layout["prefix"]])
    if not isinstance(stored, dict):
        raise SafetensorsError(layout["prefix"], "the imported tensors are not a map")
    files = layout["files"]
    single = target.name.endswith(SUFFIX) and not model
    if single and (layout["folder"] or len(files) != 1):
        raise SafetensorsError(str(target), "this checkpoint is a folder: export it to a directory")
    for record in files:
        rel = _safe_relative(record["path"])
        raw = record["header"]
        header = parse_raw(raw, rel)
        tensors = []
        for entry in header.entries:
            key = _key_prefix(rel) + entry.name
            if key not in stored:
                raise SafetensorsError(rel, "the checkpoint lacks this tensor", tensor=entry.name)
            value = exporter.reader.resolve(stored[key])
            tensors.append(_check_entry(exporter, value, entry, f"{layout['prefix']}.{key}", rel))
        place = target if single else target / (
            "model.safetensors" if model and not layout["folder"] else rel)
        exporter.staged.write(place, lambda f, raw=raw, tensors=tensors: exporter.write_file(f, raw, tensors))
        exporter.report.files.append(str(place))
    if not single:
        for rel, data in layout["blobs"].items():
            exporter.staged.write(target / _safe_relative(rel),
                                  lambda f, rel=rel, data=data: exporter.write_blob(f, data, rel))
            exporter.report.files.append(str(target / rel))
    exporter.report.exact = True


def _check_entry(exporter: _Exporter, value: Any, entry: Entry, path: str, rel: str) -> _Tensor:
    """The stored tensor for a header entry; it must still have the entry's dtype and size."""
    if not (isinstance(value, Tagged) and value.code == NDARRAY):
        raise SafetensorsError(rel, f"{path} is not an array", tensor=entry.name)
    stored, stored_shape = _stored_array(value, rel, entry.name)
    expected = DTYPES[entry.dtype][1]
    shape = [entry.end - entry.begin] if entry.dtype in PACKED else list(entry.shape)
    if stored != expected or stored_shape != shape:
        raise SafetensorsError(rel, f"{path} is now {stored} {stored_shape}, the "
                               f"file's header says {entry.dtype} {list(entry.shape)}: pass path= "
                               "to write a new header", tensor=entry.name)
    return _Tensor(entry.name, entry.dtype, entry.shape, entry.end - entry.begin, value, path)


def _export_tensors(exporter: _Exporter, tensors: list[_Tensor], metadata: dict[str, str] | None,
                    target: Path, limit: int | None, blobs: dict[str, bytes | Tagged], *,
                    folder: bool = False, reserved: Any = None) -> None:
    """Write tensors as save_file does: one file, or shards and an index as transformers does.

    ``folder``: ``target`` is a folder whatever its name. ``reserved``: names no tensor may have
    (the state's strings, written as ``__metadata__``); ``metadata``'s keys if None."""
    if reserved is None:
        reserved = metadata or {}
    seen: dict[str, str] = {}
    for tensor in tensors:
        if tensor.name in seen:
            raise StateTypeError(tensor.path, f"two tensors are named {tensor.name!r} "
                                 f"({seen[tensor.name]} and {tensor.path})")
        if tensor.name == "__metadata__" or tensor.name in reserved:
            raise StateTypeError(tensor.path, f"tensor name {tensor.name!r} clashes with __metadata__")
        seen[tensor.name] = tensor.path
    shards = _shards(tensors, limit) if limit is not None else [tensors]
    single = target.name.endswith(SUFFIX) and not folder
    if single and (len(shards) > 1 or blobs):
        raise SafetensorsError(str(target), "this export is a folder (shards or other files): "
                               "export it to a directory")
    names = ([target.name] if single else ["model.safetensors"]) if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    folder = target.parent if single else target
    for name, shard in zip(names, shards, strict=True):
        raw, ordered = write_header([(t.name, t.dtype, t.shape, t.nbytes) for t in shard], metadata)
        by_name = {t.name: t for t in shard}
        exporter.staged.write(folder / name, lambda f, raw=raw, ordered=ordered, by_name=by_name:
                              exporter.write_file(f, raw, [by_name[t[0]] for t in ordered]))
        exporter.report.files.append(str(folder / name))
    if len(shards) > 1:
        index = {"metadata": {"total_parameters": sum(math.prod(t.shape) for t in tensors),
                              "total_size": sum(t.nbytes for t in tensors)},
                 "weight_map": {t.name: name for name, shard in zip(names, shards, strict=True)
                                for t in shard}}
        data = (json.dumps(index, indent=2, sort_keys=True) + "\n").encode()
        exporter.staged.write(folder / INDEX, lambda f: f.write(data))
        exporter.report.files.append(str(folder / INDEX))
    for rel, data in blobs.items():
        exporter.staged.write(folder / _safe_relative(rel),
                              lambda f, rel=rel, data=data: exporter.write_blob(f, data, rel))
        exporter.report.files.append(str(folder / rel))


def _untie(tensors: list[_Tensor], metadata: dict[str, str]) -> list[_Tensor]:
    """One tensor per group of identical ones, as ``safetensors.torch.save_model`` keeps them.

    The name kept is the first in sorted order; each other is noted in ``metadata`` as
    ``dropped: kept`` unless the metadata already holds that key.
    """
    groups: dict[bytes, list[_Tensor]] = {}
    for tensor in tensors:  # same dtype, shape and chunks (or inline bytes): the same tensor
        groups.setdefault(codec.encode(tensor.value), []).append(tensor)
    kept = []
    for tensor in tensors:
        group = groups[codec.encode(tensor.value)]
        keep = min(group, key=lambda t: t.name)
        if tensor is keep:
            kept.append(tensor)
        else:
            metadata.setdefault(tensor.name, keep.name)
    return kept


def _shards(tensors: list[_Tensor], limit: int) -> list[list[_Tensor]]:
    """Tensors in state order, split as huggingface_hub's ``split_state_dict_into_shards`` does."""
    shards: list[list[_Tensor]] = []
    current: list[_Tensor] = []
    size = 0
    for tensor in tensors:
        if tensor.nbytes > limit:  # alone in a shard of its own
            shards.append([tensor])
            continue
        if size + tensor.nbytes > limit and current:
            shards.append(current)
            current, size = [], 0
        current.append(tensor)
        size += tensor.nbytes
    if current or not shards:
        shards.append(current)
    return shards


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.I)
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size: int | str) -> int:
    """Bytes for ``5GB`` (10**9 each, as transformers counts), ``512MiB``, or an int."""
    if type(size) is int:
        value = size
    else:
        match = _SIZE.match(str(size))
        if match is None:
            raise ValueError(f"cannot read {size!r} as a size (say 5GB, 500MB, 2GiB or bytes)")
        value = int(float(match.group(1)) * _UNITS[(match.group(2) or "B").upper()])
    if value < 1:
        raise ValueError(f"max_shard_size must be at least 1 byte, not {size!r}")
    return value


def _safe_relative(rel: str) -> str:
    """A stored file name, refused unless it stays inside the export folder."""
    parts = PurePosixPath(rel).parts
    if not parts or rel.startswith("/") or "\\" in rel or any(p in ("..", ".", "") for p in parts):
        raise SafetensorsError(rel, "file name in the checkpoint leaves the export folder")
    if "\0" in rel:
        raise SafetensorsError(repr(rel), "file name in the checkpoint holds a NUL byte")
    return rel


class _Sink:
    """A file being written, asking the kernel to write each 32 MiB back at once: the disk works
    while later chunks are read, and the closing fsync is short."""

    def __init__(self, f: BinaryIO) -> None:
        self.f = f
        self.size = self.written_back = 0

    def write(self, data: bytes | memoryview) -> None:
        self.f.write(data)
        self.size += memoryview(data).nbytes
        if self.size - self.written_back >= WRITEBACK_STEP:
            self.f.flush()
            _fs.start_writeback(self.f.fileno(), self.written_back, self.size - self.written_back)
            self.written_back = self.size


class _Staged:
    """The files of one export: each written under a temporary name beside its place and
    fsynced, and all renamed into place only once every one is complete. An export that fails
    (a malformed record, a missing block, a full disk) leaves nothing: no file, and no folder
    it made."""

    def __init__(self) -> None:
        self.files: list[tuple[Path, Path]] = []  # (temporary, destination)
        self.folders: list[Path] = []  # made by this export, outermost first

    def write(self, path: Path, write: Callable[[_Sink], Any]) -> None:
        missing = [p for p in (path.parent, *path.parent.parents) if not p.exists()]
        path.parent.mkdir(parents=True, exist_ok=True)
        self.folders += reversed(missing)
        fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        self.files.append((Path(name), path))
        with os.fdopen(fd, "wb", buffering=1 << 20) as f:
            write(_Sink(f))
            f.flush()
            os.fsync(f.fileno())
        os.chmod(name, 0o644 & ~_umask())

    def commit(self) -> None:
        for tmp, path in self.files:
            os.replace(tmp, path)
        self.files = []

    def abort(self) -> None:
        for tmp, _ in self.files:
            tmp.unlink(missing_ok=True)
        for folder in reversed(self.folders):
            with contextlib.suppress(OSError):
                folder.rmdir()  # only if nothing else was put there meanwhile
        self.files, self.folders = [], []


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
