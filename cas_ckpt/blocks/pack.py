"""The pack format: blocks back to back, then an index, then a footer (``docs/format.md``).

::

    offset 0   "CASPACK1" (version 1) or "CASPACK2" (version 2)
    offset 8   stored block bytes, back to back, no framing
    ...        index: msgpack array of entries, in write order:
                 version 1: [cid: bin, offset: uint, length: uint]
                 version 2: [cid: bin, offset: uint, stored length: uint, codec: uint, raw length: uint]
    end-48     footer: index length (uint64 LE) | sha256(index) (32 bytes) | "CASPKEND"

Version 2 adds the codec of each stored block (:mod:`cas_ckpt.blocks.compression`); writers
that do not compress keep writing version 1, byte for byte as before.

A pack is named ``<hex sha256 of its index and footer>.pack``: two packs of one name hold the same
blocks at the same offsets. The header is at the end (as in restic), so blocks stream out as they are made.
"""

from __future__ import annotations

import hashlib
import itertools
import operator
import struct
from collections.abc import Sequence
from typing import NamedTuple

import msgpack

from cas_ckpt import cid as cidlib
from cas_ckpt.blocks.base import MAX_CHUNK, size_limit
from cas_ckpt.blocks.compression import CODEC_NONE, CODECS
from cas_ckpt.errors import CorruptStore

PACK_MAGIC = b"CASPACK1"
PACK_MAGIC_V2 = b"CASPACK2"
VERSIONS = {PACK_MAGIC: 1, PACK_MAGIC_V2: 2}
MAGICS = {version: magic for magic, version in VERSIONS.items()}
FOOTER_MAGIC = b"CASPKEND"
FOOTER = struct.Struct("<Q32s8s")  # index length, sha256(index), magic
SUFFIX = ".pack"
# An index entry takes at least ~40 bytes (a 36-byte CID, two ints, framing): no pack a writer makes
# has an index near this, so a footer claiming more is damage, refused before anything is read.
MAX_INDEX = 128 * 1024 * 1024
INDEX_READ = 64 * 1024  # first guess at the index size: one read from the end usually suffices
SMALL_PACK = 32 * 1024 * 1024  # GC merges packs smaller than this



class Entry(NamedTuple):
    """One stored block of a pack: ``length`` bytes at ``offset``, decoding to ``size`` bytes."""

    cid: bytes
    offset: int
    length: int
    codec: int
    size: int


class Location(NamedTuple):
    """Where one copy of a block lies, and how it is stored."""

    pack: str
    offset: int
    length: int
    codec: int
    size: int

    @classmethod
    def of(cls, pack: str, e: Entry) -> Location:
        return cls(pack, e.offset, e.length, e.codec, e.size)


EntryFields = tuple[bytes, int, int, int, int]  # an Entry's fields, as the store's index keeps them


def pack_version(entries: Sequence[EntryFields]) -> int:
    """The lowest format version that can hold these entries."""
    return 2 if any(codec != CODEC_NONE for _cid, _offset, _length, codec, _size in entries) else 1


def encode_index(entries: Sequence[EntryFields], version: int = 1) -> tuple[bytes, str]:
    """The index and footer bytes that end a pack of ``entries``, and the pack's name."""
    if version == 1:
        if pack_version(entries) != 1:
            raise ValueError("a version 1 pack holds raw blocks only")
        rows: list[tuple[bytes, int, int] | tuple[bytes, int, int, int, int]] = [
            (cid, offset, length) for cid, offset, length, _codec, _size in entries]
    else:
        rows = [tuple(e) for e in entries]  # an Entry, or the plain tuple of its fields
    index = msgpack.packb(rows, use_bin_type=True)
    tail = index + FOOTER.pack(len(index), hashlib.sha256(index).digest(), FOOTER_MAGIC)
    return tail, hashlib.sha256(tail).hexdigest() + SUFFIX


def index_length(footer: bytes, size: int, where: object) -> int:
    """Bytes the index and footer take at the end of a pack of ``size`` bytes, from its last 48."""
    if size < len(PACK_MAGIC) + FOOTER.size or len(footer) != FOOTER.size:
        raise CorruptStore(where, "not a cas_ckpt pack (too short)")
    length, _, magic = FOOTER.unpack(footer)
    if magic != FOOTER_MAGIC:
        raise CorruptStore(where, "bad pack footer")
    if length > MAX_INDEX or size - FOOTER.size - length < len(PACK_MAGIC):
        raise CorruptStore(where, f"pack footer claims an index of {length} bytes")
    return length + FOOTER.size


def parse_index(tail: bytes, size: int, where: object, version: int = 1) -> list[EntryFields]:
    """Check and decode the index of a version ``version`` pack of ``size`` bytes from its last
    bytes (``tail``): its entries' fields, as plain tuples (the store's index keeps them so).

    ``tail`` holds at least the index and footer; :class:`CorruptStore` naming ``where`` if damaged.
    """
    need = index_length(tail[-FOOTER.size :], size, where)
    if len(tail) < need:
        raise CorruptStore(where, "pack is truncated")
    _, digest, _ = FOOTER.unpack(tail[-FOOTER.size :])
    start = size - need
    index = tail[len(tail) - need : len(tail) - FOOTER.size]
    if hashlib.sha256(index).digest() != digest:
        raise CorruptStore(where, "pack index checksum mismatch")
    try:
        rows = msgpack.unpackb(index, raw=False, use_list=False)
        entries = (_plain_entries(rows) if version == 1 else None) or _entries(rows, version)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise CorruptStore(where, f"unreadable pack index: {exc}") from None
    if entries:
        _, offsets, lengths, _, sizes = zip(*entries, strict=True)
        if min(offsets) < len(PACK_MAGIC) or min(lengths) < 0 \
                or max(map(operator.add, offsets, lengths)) > start:
            raise CorruptStore(where, "pack index points outside the pack")
        if max(sizes) > MAX_CHUNK:  # only nodes may be larger: checked one by one
            _check_sizes(entries, where)
    return entries


def _check_sizes(entries: list[EntryFields], where: object) -> None:
    """:class:`CorruptStore` naming the pack if an entry claims a raw length no writer makes
    (``docs/format.md``, "Block sizes"): refused before anything is allocated for it."""
    for cid, _offset, _length, _codec, size in entries:
        if size > size_limit(cid):
            kind = "node" if cidlib.is_node(cid) else "raw chunk"
            raise CorruptStore(where, f"index entry of {cidlib.to_str(cid)} claims a {kind} of {size} "
                               f"bytes, over the {size_limit(cid)} a {kind} may hold")


def _plain_entries(rows: object) -> list[EntryFields] | None:
    """A version 1 index's rows as entries, checked in bulk; None if any row needs the row-by-row
    checks (:func:`_entries`), which say what is wrong.

    An index of 10,000 small blocks: 1.2 ms, against 5.8 ms row by row.
    """
    if type(rows) is not tuple or not rows or set(map(type, rows)) != {tuple} or set(map(len, rows)) != {3}:
        return None
    cids, offsets, lengths = zip(*rows, strict=True)
    if set(map(type, cids)) != {bytes} or set(map(type, offsets)) != {int} \
            or set(map(type, lengths)) != {int} or not cidlib.all_written_here(cids):
        return None
    return list(zip(cids, offsets, lengths, itertools.repeat(CODEC_NONE), lengths, strict=False))


def _entries(rows: object, version: int) -> list[EntryFields]:
    if type(rows) is not tuple:
        raise ValueError("pack index is not an array")
    return [tuple(_entry(row, version)) for row in rows]


def _entry(row: object, version: int) -> Entry:
    arity = 3 if version == 1 else 5
    if not (isinstance(row, tuple) and len(row) == arity):
        raise ValueError(f"index entry is not a {arity}-item array")
    if not (isinstance(row[0], bytes) and all(type(n) is int for n in row[1:])):
        raise ValueError("index entry has the wrong types")
    if version == 1:
        return Entry(cidlib.check_binary(row[0]), row[1], row[2], CODEC_NONE, row[2])
    cid, offset, length, codec, size = row
    if codec not in CODECS or size < 0 or (codec == CODEC_NONE and size != length):
        raise ValueError(f"index entry has codec {codec} and raw length {size}")
    return Entry(cidlib.check_binary(cid), offset, length, codec, size)
