"""CAR v1 files: a checkpoint as one archive that IPFS tools read, and back.

A CAR v1 file (https://ipld.io/specs/transport/car/carv1/) is a header, then one section per block::

    varint(len(header)) | DAG-CBOR {"roots": [CID], "version": 1}
    varint(len(cid) + len(data)) | binary CID | block bytes      (repeated)

Export writes the checkpoint's root and every block it needs (strong links only: history is not
followed), each once, parents first, streaming block by block. Import trusts nothing: every varint
and length is bounded, every CID parsed strictly and every block re-hashed, and the file must hold
exactly the blocks its roots reach, each once. Blocks are staged in a :class:`BlockWriter` (a temp
pack on disk, not memory) that is committed only when the whole file has passed, so a bad file
stores nothing.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from multiformats import CID

from cas_ckpt import cid as cidlib
from cas_ckpt import codec
from cas_ckpt.blocks.base import MAX_BLOCK, BlockStore, BlockWriter, size_limit
from cas_ckpt.carv1 import CID_TAG, car_header, encode_header, encode_varint, section_prefix  # noqa: F401 - car.py's API too
from cas_ckpt.codec import Link
from cas_ckpt.errors import CarError, CasCkptError, InvalidCID
from cas_ckpt.maintenance.walk import child_links, data_blocks, float_chunks

# A section holds a CID (36-37 bytes) and a block: every block a repository can hold fits.
MAX_SECTION = MAX_BLOCK + 64
MAX_HEADER = 1024 * 1024
MAX_ROOTS = 1024
_MAX_VARINT_BYTES = 9  # unsigned-varint spec: at most 63 bits

Progress = Callable[[int, int], None]  # (blocks so far, bytes so far)
FileLike = BinaryIO | str | os.PathLike[str]


@dataclass
class CarReport:
    """What an export or import did."""

    roots: list[CID]
    blocks: int = 0  # blocks in the file
    data_bytes: int = 0  # their bytes
    car_bytes: int = 0  # size of the CAR file
    blocks_new: int = 0  # import: blocks the repository did not have yet
    bytes_new: int = 0
    ref: str | None = None
    seconds: float = 0.0

    __repr__ = cidlib.readable_repr


# --------------------------------------------------------------------------------------------
# Varints and the header
# --------------------------------------------------------------------------------------------
def _varint_at(data: bytes, pos: int, what: str) -> tuple[int, int]:
    """Decode a minimal varint at ``data[pos:]``; return (value, position after it)."""
    value = shift = 0
    for i in range(_MAX_VARINT_BYTES):
        if pos + i >= len(data):
            raise CarError(f"truncated varint in {what}")
        byte = data[pos + i]
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            if byte == 0 and i > 0:
                raise CarError(f"non-minimal varint in {what}")
            return value, pos + i + 1
    raise CarError(f"varint in {what} is longer than {_MAX_VARINT_BYTES} bytes")


class _CborReader:
    """The strict DAG-CBOR subset a CAR header needs: maps, arrays, text, bytes, uints, CIDs."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def _take(self, n: int) -> bytes:
        if n > len(self.data) - self.pos:
            raise CarError("truncated CAR header")
        chunk = self.data[self.pos : self.pos + n]
        self.pos += n
        return chunk

    def _head(self) -> tuple[int, int]:
        first = self._take(1)[0]
        major, info = first >> 5, first & 31
        if info < 24:
            return major, info
        if info > 27:
            raise CarError("CAR header uses an indefinite length or a reserved CBOR form")
        size = 1 << (info - 24)
        value = int.from_bytes(self._take(size), "big")
        if value < (24 if size == 1 else 1 << (4 * size)):
            raise CarError("CAR header is not minimally encoded DAG-CBOR")
        return major, value

    def item(self, depth: int = 0) -> Any:
        if depth > 4:
            raise CarError("CAR header nests too deeply")
        major, value = self._head()
        if major == 0:
            return value
        if major in (2, 3):
            raw = self._take(value)
            if major == 2:
                return raw
            try:
                return raw.decode("utf-8")
            except UnicodeDecodeError:
                raise CarError("CAR header holds invalid UTF-8") from None
        if major == 4:
            if value > MAX_ROOTS:
                raise CarError(f"CAR header array of {value} items exceeds {MAX_ROOTS}")
            return [self.item(depth + 1) for _ in range(value)]
        if major == 5:
            return self._map(value, depth)
        if major == 6 and value == CID_TAG:
            return _Root(self.item(depth + 1))
        raise CarError(f"unexpected CBOR item (major type {major}) in CAR header")

    def _map(self, count: int, depth: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        previous: bytes | None = None
        for _ in range(count):
            key = self.item(depth + 1)
            if not isinstance(key, str):
                raise CarError("CAR header map key is not a string")
            encoded = key.encode()
            if previous is not None and (len(previous), previous) >= (len(encoded), encoded):
                raise CarError("CAR header map keys are not in DAG-CBOR order or repeat")
            previous = encoded
            out[key] = self.item(depth + 1)
        return out



class _Root:
    """A tag-42 CID in the header (told apart from a plain byte string)."""

    def __init__(self, payload: Any) -> None:
        if not isinstance(payload, bytes) or payload[:1] != b"\x00":
            raise CarError("CAR root is not a tag-42 CID (bytes starting with 0x00)")
        self.cid = _check_cid(payload[1:], "root")


def decode_header(data: bytes) -> list[bytes]:
    """Parse a CAR v1 header strictly; return its roots as binary CIDs."""
    reader = _CborReader(data)
    header = reader.item()
    if reader.pos != len(data):
        raise CarError("trailing bytes after the CAR header")
    if not isinstance(header, dict):
        raise CarError("CAR header is not a map")
    version = header.get("version")
    if version != 1:
        hint = " (CARv2: convert it to CARv1 first)" if version == 2 else ""
        raise CarError(f"unsupported CAR version {version!r}{hint}")
    if set(header) != {"roots", "version"}:
        raise CarError(f"unexpected CAR header fields {sorted(set(header) - {'roots', 'version'})}")
    roots = header["roots"]
    if not isinstance(roots, list) or not roots or not all(isinstance(r, _Root) for r in roots):
        raise CarError("CAR header roots must be a non-empty list of CIDs")
    return [r.cid for r in roots]


def _check_cid(data: bytes, what: str) -> bytes:
    try:
        return cidlib.check_binary(data)
    except InvalidCID as exc:
        raise CarError(
            f"{what} CID is not one cas_ckpt stores (CIDv1, raw or messagepack, "
            f"sha2-256 or blake3): {exc}"
        ) from None


def split_section(section: bytes) -> tuple[bytes, bytes]:
    """Split a section into (binary CID, block bytes), parsing the CID strictly."""
    if section[:2] == b"\x12\x20":
        raise CarError("block has a CIDv0 (dag-pb); only CIDv1 is supported")
    version, pos = _varint_at(section, 0, "block CID")
    if version != 1:
        raise CarError(f"block CID has version {version}; only CIDv1 is supported")
    for what in ("codec", "multihash code"):
        _, pos = _varint_at(section, pos, f"block CID {what}")
    length, pos = _varint_at(section, pos, "block CID digest length")
    end = pos + length
    if end > len(section):
        raise CarError("block CID runs past the end of its section")
    return _check_cid(section[:end], "block"), section[end:]


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------
class _Stream:
    """Exact reads with a running offset, for error messages."""

    def __init__(self, stream: BinaryIO) -> None:
        self.stream = stream
        self.offset = 0

    def read(self, n: int, what: str) -> bytes:
        parts, need = [], n
        while need:
            chunk = self.stream.read(need)
            if not chunk:
                raise CarError(f"truncated CAR file: {what} ends early", offset=self.offset + n - need)
            parts.append(chunk)
            need -= len(chunk)
        self.offset += n
        return b"".join(parts) if len(parts) != 1 else bytes(parts[0])

    def varint(self, what: str) -> int | None:
        """The next varint, or None at a clean end of file."""
        start = self.offset
        first = self.stream.read(1)
        if not first:
            return None
        data = bytearray(first)
        while data[-1] & 0x80 and len(data) < _MAX_VARINT_BYTES:
            more = self.stream.read(1)
            if not more:
                raise CarError(f"truncated CAR file: {what} length ends early", offset=start)
            data += more
        self.offset += len(data)
        try:
            return _varint_at(bytes(data), 0, what)[0]
        except CarError as exc:
            raise CarError(str(exc), offset=start) from None


def _read_header(stream: BinaryIO) -> tuple[list[bytes], _Stream]:
    """Read a CAR v1 header; return the roots and a reader positioned at the first section."""
    src = _Stream(stream)
    length = src.varint("header")
    if length is None:
        raise CarError("empty file: not a CAR")
    if not 0 < length <= MAX_HEADER:
        raise CarError(f"CAR header length {length} is out of bounds (1..{MAX_HEADER})", offset=0)
    return decode_header(src.read(length, "header")), src


def _iter_blocks(src: _Stream) -> Iterator[tuple[bytes, bytes, int]]:
    """Every section as (CID, data, offset), hash-checked and never repeated."""
    seen: set[bytes] = set()
    while True:
        offset = src.offset
        length = src.varint("section")
        if length is None:
            return
        if not 0 < length <= MAX_SECTION:
            raise CarError(f"section length {length} is out of bounds (1..{MAX_SECTION})", offset=offset)
        section = src.read(length, "section")
        try:
            cid, data = split_section(section)
        except CarError as exc:
            raise CarError(str(exc), offset=offset) from None
        name = cidlib.to_str(cid)
        if cid in seen:
            raise CarError(f"duplicate block {name}", offset=offset)
        if len(data) > size_limit(cid):  # a repository could not hold it (docs/format.md, "Block sizes")
            kind = "node" if cidlib.is_node(cid) else "raw chunk"
            raise CarError(f"block {name} is a {kind} of {len(data)} bytes, over the "
                           f"{size_limit(cid)} a {kind} may hold", offset=offset)
        if not cidlib.matches(cid, data):
            raise CarError(f"corrupt block {name}: content does not match its hash", offset=offset)
        seen.add(cid)
        yield cid, data, offset


def sections(stream: BinaryIO) -> tuple[list[bytes], Iterator[tuple[bytes, bytes, int]]]:
    """A CAR v1 stream's roots, and its blocks as (CID, data, offset) as they are read: each
    hashed against its CID, none repeated, none over its size bound (:class:`CarError`). Nothing
    is checked of what the roots reach: a push sends only the blocks the other side lacks."""
    roots, src = _read_header(stream)
    return roots, _iter_blocks(src)


# --------------------------------------------------------------------------------------------
# Export
# --------------------------------------------------------------------------------------------
def write_car(
    blocks: BlockStore, root: bytes, out: FileLike, *, progress: Progress | None = None
) -> CarReport:
    """Write ``root`` and every block it needs, read from ``blocks``, as a CAR v1 file.

    ``out`` is a binary file object or a path; a path is written to a new temp file beside it
    (created exclusively, so a planted file or link there is never followed), fsynced and renamed
    into place, so it never holds a partial CAR.
    """
    started = time.perf_counter()
    blocks.get(root)  # fail before creating anything when the root is missing
    report = CarReport(roots=[cidlib.to_cid(root)])
    if not isinstance(out, (str, os.PathLike)):
        _write_car(blocks, root, out, report, progress)
    else:
        path = Path(out)
        fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        tmp = Path(name)
        try:
            with os.fdopen(fd, "wb") as f:
                _write_car(blocks, root, f, report, progress)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    report.seconds = time.perf_counter() - started
    return report


def _write_car(
    blocks: BlockStore, root: bytes, out: BinaryIO, report: CarReport, progress: Progress | None
) -> None:
    header = car_header([root])
    out.write(header)
    report.car_bytes = len(header)
    for cid in data_blocks(blocks, root):
        data = blocks.get(cid, verify=True)  # never export a damaged block
        prefix = section_prefix(cid, data)
        out.write(prefix)
        out.write(data)
        report.blocks += 1
        report.data_bytes += len(data)
        report.car_bytes += len(prefix) + len(data)
        if progress is not None:
            progress(report.blocks, report.car_bytes)


# --------------------------------------------------------------------------------------------
# Import
# --------------------------------------------------------------------------------------------
def stage_car(stream: BinaryIO, writer: BlockWriter, progress: Progress | None = None) -> CarReport:
    """Check a CAR v1 stream and write every block into ``writer``; return its roots and figures.

    Raises :class:`CarError` for a malformed, truncated or hostile file, or one whose blocks are
    corrupt, repeated, missing (reachable from a root but absent) or stray (reachable from none),
    before ``writer`` commits: a bad file stores nothing.
    """
    started = time.perf_counter()
    report = _stage(stream, writer, progress)
    report.seconds = time.perf_counter() - started
    return report


def _stage(stream: BinaryIO, writer: BlockWriter, progress: Progress | None) -> CarReport:
    """Check and write every block into ``writer``; raise before it commits if anything is off."""
    roots, src = _read_header(stream)
    report = CarReport(roots=[cidlib.to_cid(r) for r in roots])
    children: dict[bytes, list[bytes]] = {}
    floats: dict[bytes, int] = {}  # chunks of float arrays (parents come first in our CARs)
    for cid, data, offset in _iter_blocks(src):
        stored = None
        if cidlib.is_node(cid):
            try:
                node = codec.decode(data, cid=cid)
            except CasCkptError as exc:
                raise CarError(str(exc), offset=offset) from None
            children[cid] = [link.cid for link, _ in child_links(node) if type(link) is Link]
            if writer.compresses:
                floats.update(float_chunks(node))
        else:
            children[cid] = []
            if writer.compresses:
                stored = writer.encode(cid, data, floats.pop(cid, 0))
        writer.put(cid, data, stored=stored)
        report.blocks += 1
        report.data_bytes += len(data)
        if progress is not None:
            progress(report.blocks, src.offset)
    report.car_bytes = src.offset
    _check_complete(roots, children)
    return report


def _check_complete(roots: list[bytes], children: dict[bytes, list[bytes]]) -> None:
    """Every block the roots reach is in the file, and every block in the file is reached."""
    reached: set[bytes] = set()
    stack = [(root, "root") for root in roots]
    while stack:
        cid, parent = stack.pop()
        if cid in reached:
            continue
        if cid not in children:
            raise CarError(f"missing block {cidlib.to_str(cid)} (linked from {parent})")
        reached.add(cid)
        stack.extend((child, cidlib.to_str(cid)) for child in children[cid])
    stray = len(children) - len(reached)
    if stray:
        example = next(c for c in children if c not in reached)
        raise CarError(
            f"{stray} block(s) are not reachable from the CAR's roots "
            f"(e.g. {cidlib.to_str(example)})"
        )
