"""Index files: the entries of many packs in one object, so that an open reads a few files, not
every pack's index (``docs/format.md``, "Index files").

::

    offset 0   "CASIDX01"                                                   8 bytes
    offset 8   header length H (uint32 LE), then H bytes: a msgpack map
                 {"kind": "snapshot" | "journal", "packs": [[name: str, size: uint], ...],
                  "folded": [journal name: str, ...]}            ("folded": snapshots only)
    ...        row count N (uint64 LE)
    ...        N keys of 33 bytes, in ascending byte order          (blocks/index.py: KEY_SIZE)
    ...        N locations of 21 bytes, in the keys' order           (blocks/index.py: LOCATION)
    end-40     sha256 of every byte before it (32 bytes) | "CASIDXND"

A location's pack is a position in ``packs``. The columns are the in-memory index's own
(:class:`~cas_ckpt.blocks.index.Table`): reading a file is a read, a checksum and a few array
checks, with no work per row in Python.

Names: ``j-<sequence>-<16 hex digits>.idx`` for a journal (the packs one batch published, on
media where listing every pack costs requests), ``s-<sequence>-<epoch>-<16 hex digits>.idx`` for a
snapshot (every pack the store knew); sequence and epoch are 20 digits. The sequence orders them:
a writer takes the greater of the time in microseconds and one more than the largest it has seen,
so a snapshot written after another was read sorts after it. A snapshot's epoch is the sequence of
the newest snapshot written when blocks were removed (GC): a process that needs to learn only of
removals reads a snapshot only when the epoch grew.
"""

from __future__ import annotations

import hashlib
import os
import struct
from dataclasses import dataclass, field
from typing import NamedTuple

import msgpack
import numpy as np

from cas_ckpt.blocks.compression import CODEC_NONE, CODECS
from cas_ckpt.blocks.index import KEY_DTYPE, KEY_SIZE, KINDS, LOCATION_DTYPE, Table
from cas_ckpt.blocks.pack import FOOTER, PACK_MAGIC
from cas_ckpt.errors import CorruptStore

MAGIC = b"CASIDX01"
END = b"CASIDXND"
HEAD = struct.Struct("<I")
COUNT = struct.Struct("<Q")
TAIL = 32 + len(END)
ROW = KEY_SIZE + LOCATION_DTYPE.itemsize
SUFFIX = ".idx"
SNAPSHOT, JOURNAL = "snapshot", "journal"
LETTERS = {SNAPSHOT: "s", JOURNAL: "j"}
MAX_HEADER = 256 * 1024 * 1024  # a header naming a million packs takes ~90 MiB
SEQUENCE_DIGITS = 20
CHECK_ROWS = 65536  # rows checked at once when an index file is read


@dataclass
class IndexFile:
    """An index file's content: what kind, the packs (name, size) its rows' pack ids index,
    the rows, and (snapshots) the journals it folded in."""

    kind: str
    packs: list[tuple[str, int]]
    table: Table
    folded: list[str] = field(default_factory=list)

    @property
    def pack_names(self) -> list[str]:
        return [name for name, _ in self.packs]


class Name(NamedTuple):
    """What an index file's name says: its kind, sequence and (snapshots) removal epoch."""

    kind: str
    sequence: int
    epoch: int


def file_name(kind: str, sequence: int, epoch: int = 0) -> str:
    """A new index file's name: its kind's letter, the sequence, (snapshots) the epoch, a random tail."""
    digits = f"{sequence:0{SEQUENCE_DIGITS}d}"
    if kind == SNAPSHOT:
        digits += f"-{epoch:0{SEQUENCE_DIGITS}d}"
    return f"{LETTERS[kind]}-{digits}-{os.urandom(8).hex()}{SUFFIX}"


def parse_name(name: str) -> Name | None:
    """What an index file's name says; None for any other name."""
    letter, *parts = name.split("-")
    kind = {letter: kind for kind, letter in LETTERS.items()}.get(letter)
    if kind is None or len(parts) != (3 if kind == SNAPSHOT else 2):
        return None
    *numbers, tail = parts
    if not all(len(n) == SEQUENCE_DIGITS and n.isdigit() for n in numbers) \
            or len(tail) != 16 + len(SUFFIX) or not tail.endswith(SUFFIX):
        return None
    return Name(kind, int(numbers[0]), int(numbers[1]) if kind == SNAPSHOT else 0)


def encode(content: IndexFile) -> bytes:
    """The bytes of an index file."""
    return b"".join(encode_parts(content))


def encode_parts(content: IndexFile) -> list[bytes | memoryview]:
    """The bytes of an index file in pieces, written one after the other: the rows are not
    copied (a million rows' snapshot is 54 MB, and joining it took twice that again)."""
    header = {"kind": content.kind, "packs": [list(p) for p in content.packs]}
    if content.kind == SNAPSHOT:
        header["folded"] = list(content.folded)
    head = msgpack.packb(header, use_bin_type=True)
    parts: list[bytes | memoryview] = [MAGIC, HEAD.pack(len(head)), head, COUNT.pack(content.table.n),
                                       content.table.key_bytes, content.table.location_bytes]
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part)
    return [*parts, digest.digest(), END]


def parse(data: bytes, where: object) -> IndexFile:
    """Check and decode an index file; :class:`CorruptStore` naming ``where`` if it is damaged."""
    if len(data) < len(MAGIC) + HEAD.size + COUNT.size + TAIL or data[:8] != MAGIC:
        raise CorruptStore(where, "not a cas_ckpt index file (bad header or too short)")
    if data[-len(END) :] != END:
        raise CorruptStore(where, "index file is truncated (no end marker)")
    body = memoryview(data)[:-TAIL]
    if hashlib.sha256(body).digest() != data[-TAIL : -len(END)]:
        raise CorruptStore(where, "index file checksum mismatch")
    (head_length,) = HEAD.unpack_from(data, 8)
    rows_at = 8 + HEAD.size + head_length
    if head_length > MAX_HEADER or rows_at + COUNT.size > len(body):
        raise CorruptStore(where, f"index file header claims {head_length} bytes")
    try:
        header = msgpack.unpackb(body[8 + HEAD.size : rows_at], raw=False, use_list=True)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise CorruptStore(where, f"unreadable index file header: {exc}") from None
    kind, packs, folded = _header(header, where)
    (count,) = COUNT.unpack_from(data, rows_at)
    keys_at = rows_at + COUNT.size
    if count * ROW != len(body) - keys_at:
        raise CorruptStore(where, f"index file holds {len(body) - keys_at} bytes of rows, not {count} rows")
    data = bytes(data)  # rows read in place: a bytearray or memoryview is copied once here
    locations_at = keys_at + count * KEY_SIZE
    _check_rows(np.frombuffer(data, KEY_DTYPE, count, keys_at),
                np.frombuffer(data, LOCATION_DTYPE, count, locations_at), packs, where)
    return IndexFile(kind, packs, Table(data, data, count, key_at=keys_at, location_at=locations_at), folded)


def _header(header: object, where: object) -> tuple[str, list[tuple[str, int]], list[str]]:
    if not isinstance(header, dict) or header.get("kind") not in LETTERS:
        raise CorruptStore(where, "index file header is not a map with a known kind")
    packs, folded = header.get("packs"), header.get("folded", [])
    if not isinstance(packs, list) or not all(
        isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) and p[0].endswith(".pack")
        and "/" not in p[0] and type(p[1]) is int and p[1] >= 0 for p in packs
    ):
        raise CorruptStore(where, "index file header lists packs of the wrong shape")
    if not isinstance(folded, list) or not all(isinstance(j, str) and parse_name(j) for j in folded):
        raise CorruptStore(where, "index file header lists folded journals of the wrong shape")
    return header["kind"], [(name, size) for name, size in packs], folded


def _check_rows(keys: np.ndarray, locations: np.ndarray, packs: list[tuple[str, int]], where: object) -> None:
    """Rows sorted, of known kinds and codecs, each lying inside its pack before the pack's footer.

    Checked :data:`CHECK_ROWS` rows at a time: a million rows' temporaries at once (100 MiB and
    more) stayed in the process after the open, held by the allocator."""
    limits = np.array([max(size - FOOTER.size, 0) for _, size in packs], np.uint64)
    for start in range(0, len(keys), CHECK_ROWS):
        stop = min(start + CHECK_ROWS, len(keys))
        after = keys[start + 1 : stop + 1]  # each row's successor, the next chunk's first included
        if not (after >= keys[start : start + len(after)]).all():
            raise CorruptStore(where, "index file rows are not sorted")
        _check_locations(keys[start:stop], locations[start:stop], limits, where)


def _check_locations(keys: np.ndarray, locations: np.ndarray, limits: np.ndarray, where: object) -> None:
    kinds = np.ascontiguousarray(keys).view(np.uint8)[KEY_SIZE - 1 :: KEY_SIZE]
    if not np.isin(kinds, list(KINDS.values())).all():
        raise CorruptStore(where, "index file row names an unknown kind of CID")
    pack = locations["pack"]
    if int(pack.max()) >= len(limits):
        raise CorruptStore(where, "index file row points to a pack it does not list")
    if not np.isin(locations["codec"], list(CODECS)).all():
        raise CorruptStore(where, "index file row names an unknown codec")
    raw = locations["codec"] == CODEC_NONE
    if (locations["length"][raw] != locations["size"][raw]).any():
        raise CorruptStore(where, "index file row stores a raw block at another length than its own")
    # Blocks lie between a pack's header and its footer (uint64 throughout: no overflow).
    ends = limits[pack]
    offsets = locations["offset"]
    room = ends - np.minimum(offsets, ends)
    if ((offsets < len(PACK_MAGIC)) | (offsets > ends) | (locations["length"] > room)).any():
        raise CorruptStore(where, "index file row points outside its pack")
