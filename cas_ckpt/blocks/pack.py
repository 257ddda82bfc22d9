"""The pack format: blocks back to back, then an index, then a footer (``docs/format.md``).

::

    offset 0   "CASPACK1"
    offset 8   block bytes, back to back, no framing
    ...        index: msgpack array of [cid: bin, offset: uint, length: uint], in write order
    end-48     footer: index length (uint64 LE) | sha256(index) (32 bytes) | "CASPKEND"

A pack is named ``<hex sha256 of its index and footer>.pack``: two packs of one name hold the same
blocks at the same offsets. The header is at the end (as in restic), so blocks stream out as they are made.
"""

from __future__ import annotations

import hashlib
import struct
from typing import NamedTuple

import msgpack

from cas_ckpt import cid as cidlib
from cas_ckpt.errors import CorruptStore

PACK_MAGIC = b"CASPACK1"
FOOTER_MAGIC = b"CASPKEND"
FOOTER = struct.Struct("<Q32s8s")  # index length, sha256(index), magic
SUFFIX = ".pack"
# An index entry takes at least ~40 bytes (a 36-byte CID, two ints, framing): no pack a writer makes
# has an index near this, so a footer claiming more is damage, refused before anything is read.
MAX_INDEX = 128 * 1024 * 1024
INDEX_READ = 64 * 1024  # first guess at the index size: one read from the end usually suffices
SMALL_PACK = 32 * 1024 * 1024  # GC merges packs smaller than this

Entry = tuple[bytes, int, int]  # binary CID, offset, length


class Location(NamedTuple):
    """Where one copy of a block lies."""

    pack: str
    offset: int
    length: int


def encode_index(entries: list[Entry]) -> tuple[bytes, str]:
    """The index and footer bytes that end a pack of ``entries``, and the pack's name."""
    index = msgpack.packb(entries, use_bin_type=True)
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


def parse_index(tail: bytes, size: int, where: object) -> list[Entry]:
    """Check and decode the index of a pack of ``size`` bytes from its last bytes (``tail``).

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
        entries = [_entry(e) for e in msgpack.unpackb(index, raw=False, use_list=False)]
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise CorruptStore(where, f"unreadable pack index: {exc}") from None
    for _, offset, n in entries:
        if offset < len(PACK_MAGIC) or n < 0 or offset + n > start:
            raise CorruptStore(where, "pack index points outside the pack")
    return entries


def _entry(entry: object) -> Entry:
    if not (isinstance(entry, tuple) and len(entry) == 3):
        raise ValueError("index entry is not a (cid, offset, length) triple")
    cid, offset, length = entry
    if not (isinstance(cid, bytes) and type(offset) is int and type(length) is int):
        raise ValueError("index entry has the wrong types")
    return cidlib.check_binary(cid), offset, length


def plan_sweep(
    packs: dict[str, tuple[list[Entry], int, float]], cids: set[bytes], min_age: float
) -> dict[str, list[Entry]]:
    """Which packs a sweep touches: pack -> its surviving entries (empty: delete it whole).

    ``packs`` maps each pack to (entries, size in bytes, age in seconds). Packs younger than
    ``min_age`` are left alone. A pack losing blocks is rewritten with its survivors (or deleted,
    when none survive); small packs (under ``SMALL_PACK``) are merged along when at least two packs
    would be written anyway.
    """
    doomed: dict[str, list[Entry]] = {}
    small: dict[str, list[Entry]] = {}
    for name, (entries, size, age) in packs.items():
        if age < min_age:
            continue
        live = [e for e in entries if e[0] not in cids]
        if len(live) < len(entries):
            doomed[name] = live
        elif size < SMALL_PACK:
            small[name] = live
    if len(small) + sum(1 for live in doomed.values() if live) >= 2:
        doomed.update(small)  # worth merging: fewer files for every later open and read
    return doomed
