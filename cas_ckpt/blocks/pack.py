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

An open reads an index with :func:`parse_index_columns`: as arrays (:class:`Columns`), a window
of rows at a time, with no object per entry, where it is msgpack as cas_ckpt writes it; any other
valid msgpack, and damage, by :func:`parse_index`, entry by entry, which says what is wrong.
"""

from __future__ import annotations

import hashlib
import itertools
import operator
import struct
from collections.abc import Sequence
from typing import NamedTuple

import msgpack
import numpy as np

from cas_ckpt import cid as cidlib
from cas_ckpt._memory import pages
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
    index, start = _checked_index(tail, size, where)
    return _decode(index, start, where, version)


def _checked_index(tail: bytes, size: int, where: object) -> tuple[bytes, int]:
    """The index bytes at the end of ``tail`` once its length and checksum are checked, and the
    offset in the pack where it starts."""
    need = index_length(tail[-FOOTER.size :], size, where)
    if len(tail) < need:
        raise CorruptStore(where, "pack is truncated")
    _, digest, _ = FOOTER.unpack(tail[-FOOTER.size :])
    index = tail[len(tail) - need : len(tail) - FOOTER.size]
    if hashlib.sha256(index).digest() != digest:
        raise CorruptStore(where, "pack index checksum mismatch")
    return index, size - need


def _decode(index: bytes, start: int, where: object, version: int) -> list[EntryFields]:
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


# --------------------------------------------------------------------------------------------
# The index as columns: no object per entry
# --------------------------------------------------------------------------------------------
CID_HEADS = tuple(sorted(cidlib.PREFIXES))  # the CIDs cas_ckpt writes, before their digest
_DIGEST = cidlib.DIGEST_SIZE
_ROW_HEAD = {1: 0x93, 2: 0x95}  # a row: a msgpack fixarray of 3 (version 1) or 5 (version 2) items
_BIN8 = 0xC4  # a CID: msgpack bin 8, then its length (36 or 37) and bytes
_CID_LENGTHS = sorted({len(head) + _DIGEST for head in CID_HEADS})
assert _CID_LENGTHS == [36, 37]  # raw and messagepack CIDs of 32-byte digests
_MIN_ROW = {1: 3 + 36 + 2, 2: 3 + 36 + 4}  # the fewest bytes a row takes
# The bytes a msgpack unsigned int takes, by its first byte: positive fixint, uint 8/16/32/64
# (0: anything else, which the row-by-row decoder judges).
_WIDTH = np.zeros(256, np.int64)
_WIDTH[:0x80] = 1
_WIDTH[[0xCC, 0xCD, 0xCE, 0xCF]] = [2, 3, 5, 9]
_MAX_STORED = 2**32 - 1  # the index in memory holds a stored and raw length in 32 bits
WINDOW = 256 * 1024  # index bytes decoded at once (~5,500 rows): temporaries of a few hundred KiB
_COLUMNS = np.dtype([("digest", f"V{_DIGEST}"), ("offset", "<u8"), ("length", "<u4"), ("size", "<u4"),
                     ("head", "u1"), ("codec", "u1")])  # the layout of Columns' buffer, field by field


class Columns(NamedTuple):
    """A pack index's entries as arrays, in pack order (the in-memory index takes them so): each
    CID as its head (a position in :data:`CID_HEADS`) and digest, and each location's fields."""

    heads: np.ndarray  # uint8
    digests: np.ndarray  # (n, 32) uint8
    offsets: np.ndarray  # uint64
    lengths: np.ndarray  # uint32: stored lengths
    codecs: np.ndarray  # uint8
    sizes: np.ndarray  # uint32: raw lengths
    # The index bytes they were decoded from, freed with them (after the store's index is built
    # of them), not as soon as each pack is decoded: a large buffer freed raises glibc's mmap
    # threshold, and the temporaries that came after it stayed in the heap (see _memory.pages).
    source: object = None

    @property
    def arrays(self) -> tuple[np.ndarray, ...]:
        return self[:6]

    @classmethod
    def empty(cls, n: int) -> Columns:
        """Columns of ``n`` entries to fill, in one buffer of :func:`~cas_ckpt._memory.pages`
        (one column after the other)."""
        buffer = pages(n * _COLUMNS.itemsize)
        found, at = {}, 0
        for name in _COLUMNS.names:
            dtype = _COLUMNS.fields[name][0]
            found[name] = np.frombuffer(buffer, dtype, n, at)
            at += n * dtype.itemsize
        return cls(found["head"], found["digest"].view(np.uint8).reshape(n, _DIGEST), found["offset"],
                   found["length"], found["codec"], found["size"])

    @classmethod
    def of(cls, entries: Sequence[EntryFields]) -> Columns:
        """The columns of these entries (a block of 4 GiB or more cannot be held: ValueError)."""
        head_of = {head: i for i, head in enumerate(CID_HEADS)}
        n = len(entries)
        found = cls.empty(n)
        digests = b"".join(e[0][-_DIGEST:] for e in entries)
        found.digests[:] = np.frombuffer(digests, np.uint8).reshape(n, _DIGEST)
        found.heads[:] = np.fromiter((head_of[e[0][:-_DIGEST]] for e in entries), np.uint8, n)
        found.offsets[:] = np.fromiter((e[1] for e in entries), np.uint64, n)
        for column, i in ((found.lengths, 2), (found.sizes, 4)):
            values = np.fromiter((e[i] for e in entries), np.uint64, n)
            if n and int(values.max()) > _MAX_STORED:
                raise ValueError("a block of 4 GiB or more cannot be indexed")
            column[:] = values
        found.codecs[:] = np.fromiter((e[3] for e in entries), np.uint8, n)
        return found

    def entries(self) -> list[Entry]:
        """The entries as objects, in pack order (fsck compares them)."""
        cids = [CID_HEADS[h] + bytes(d) for h, d in zip(self.heads.tolist(), self.digests, strict=True)]
        return [Entry(cid, *fields) for cid, *fields in zip(
            cids, self.offsets.tolist(), self.lengths.tolist(), self.codecs.tolist(), self.sizes.tolist(),
            strict=True)]


def parse_index_columns(tail: bytes | bytearray | memoryview, size: int, where: object,
                        version: int = 1) -> Columns:
    """:func:`parse_index` as :class:`Columns`: the same checks, the same errors. An index as
    cas_ckpt writes it (canonical msgpack, the CIDs it writes) is decoded a window at a time in a
    few array operations each, without an object per entry; any other, entry by entry."""
    view = memoryview(tail).cast("B")
    index, start = _checked_index(view, size, where)  # type: ignore[arg-type]
    found = _columns(np.frombuffer(view, np.uint8), len(view) - len(index) - FOOTER.size,
                     len(view) - FOOTER.size, start, version)
    if found is not None:
        return found._replace(source=tail)
    return Columns.of(_decode(bytes(index), start, where, version))


def _columns(data: np.ndarray, lo: int, hi: int, start: int, version: int) -> Columns | None:
    """The entries of the index ``data[lo:hi]`` (the 48-byte footer after it) of a pack whose
    index starts at offset ``start``; None where the entry-by-entry decoder must judge (anything
    cas_ckpt does not write, damage included: it says what is wrong).

    A row is ``[bin 8 CID, uint, uint]`` (version 2: four uints); rows differ in length only by
    their CID's and their ints' widths. Every place where a row's first two bytes stand is a
    candidate; each candidate's length comes from its own bytes, and the rows are the chain of
    candidates from the first, each starting where the one before ends, up to the end exactly:
    the sequential decoder's rows, found by arrays. A CID's or an int's bytes that look like a
    row's start are candidates off the chain, skipped."""
    first = int(data[lo]) if hi > lo else 0
    if 0x90 <= first <= 0x9F:
        count, at = first & 0x0F, lo + 1
    elif first in (0xDC, 0xDD):
        width = 2 if first == 0xDC else 4
        count, at = int.from_bytes(data[lo + 1 : lo + 1 + width].tobytes(), "big"), lo + 1 + width
    else:
        return None
    if not count or count * _MIN_ROW[version] > hi - at:
        return None
    out, row = Columns.empty(count), 0
    while at < hi:
        window = _window(data, at, min(hi, at + WINDOW), hi, version)
        if window is None or row + len(window[0]) > count:
            return None
        rows, lengths, fields, at = window
        chosen = slice(row, row + len(rows))
        row += len(rows)
        if not _fill(out, chosen, data, rows, lengths, fields, start, version):
            return None
    return out if row == count and at == hi else None


def _window(
    data: np.ndarray, at: int, stop: int, hi: int, version: int
) -> tuple[np.ndarray, np.ndarray, list[tuple[np.ndarray, np.ndarray]], int] | None:
    """The rows that start in ``[at, stop)``, the first at ``at``: their starts, their CIDs'
    lengths, each of their ints' place and first byte, and where the row after the last
    starts; None if the chain breaks (or a row runs past ``hi``)."""
    region = data[at : stop + 1]  # a row's second byte may lie just past the window (the footer follows)
    rows = np.flatnonzero(region[:-1] == _ROW_HEAD[version])
    rows = rows[region[rows + 1] == _BIN8] + at
    last = len(data) - 1
    lengths = data[np.minimum(rows + 2, last)]
    ok = (lengths == _CID_LENGTHS[0]) | (lengths == _CID_LENGTHS[-1])
    fields, end = [], rows + 3 + lengths  # each int: where it starts, and its first byte
    for _ in range(2 if version == 1 else 4):  # offset, stored length (version 2: codec, raw length)
        marker = data[np.minimum(end, last)]
        width = _WIDTH[marker]
        ok &= width > 0
        fields.append((end, marker))
        end = end + width
    ok &= end <= hi
    chain = _chain(rows[ok], end[ok], at, stop)
    if chain is None:
        return None
    chosen = ok if chain[0] is None else np.flatnonzero(ok)[chain[0]]
    return rows[chosen], lengths[chosen], [(p[chosen], m[chosen]) for p, m in fields], chain[1]


def _chain(rows: np.ndarray, ends: np.ndarray, at: int, stop: int) -> tuple[np.ndarray | None, int] | None:
    """The positions in ``rows`` (sorted) of the chain from the row at ``at``, each row starting
    where the one before ends, while rows start before ``stop`` (None: every one), and where
    the row after it starts; None if a row's successor is no candidate."""
    if not len(rows) or rows[0] != at:
        return None
    follows = ends[:-1] == rows[1:]
    if ends[-1] >= stop and follows.all():
        return None, int(ends[-1])  # every candidate a row: none off the chain
    breaks = np.flatnonzero(~follows)  # rows whose successor is not the next candidate
    runs, i = [], 0
    while True:
        b = int(np.searchsorted(breaks, i))
        j = int(breaks[b]) if b < len(breaks) else len(rows) - 1  # the run's last row
        runs.append(np.arange(i, j + 1))
        end = int(ends[j])
        if end >= stop:
            return np.concatenate(runs), end
        i = int(np.searchsorted(rows, end))
        if i >= len(rows) or rows[i] != end:
            return None


def _fill(out: Columns, chosen: slice, data: np.ndarray, rows: np.ndarray, lengths: np.ndarray,
          fields: list[tuple[np.ndarray, np.ndarray]], start: int, version: int) -> bool:
    """Decode these rows into ``out[chosen]``; False if one is not as cas_ckpt writes it or
    lies outside the pack (the entry-by-entry decoder says which)."""
    cids = rows + 3
    words = np.ndarray((len(data) - 7,), ">u8", data, 0, (1,))  # 8 bytes big endian from each place
    heads = _heads(words[cids], lengths)
    if heads is None:
        return False
    values = [_uint(words, place, marker) for place, marker in fields]
    offsets, stored = values[0], values[1]
    codecs, raw = (None, stored) if version == 1 else (values[2], values[3])
    if ((offsets < len(PACK_MAGIC)) | (offsets > start) | (stored > np.uint64(start) - offsets)).any():
        return False
    if (stored > _MAX_STORED).any() or (version == 2 and (raw > _MAX_STORED).any()):
        return False
    if codecs is not None:
        if (codecs >= len(CODECS)).any():
            return False
        raw_ones = codecs == CODEC_NONE
        if (raw[raw_ones] != stored[raw_ones]).any():
            return False
    if len(raw) and int(raw.max()) > MAX_CHUNK:  # only nodes may be larger
        limits = np.array([size_limit(head + bytes(_DIGEST)) for head in CID_HEADS], np.uint64)
        if (raw > limits[heads]).any():
            return False
    digests = np.ndarray((len(data) - _DIGEST + 1,), f"V{_DIGEST}", data, 0, (1,))
    out.digests.view(f"V{_DIGEST}")[chosen, 0] = digests[cids + lengths - _DIGEST]
    out.heads[chosen], out.offsets[chosen] = heads, offsets
    out.lengths[chosen], out.sizes[chosen] = stored, raw
    out.codecs[chosen] = CODEC_NONE if codecs is None else codecs
    return True


# Each head (CID_HEADS) as the number its bytes make, big endian, and its position there.
_HEAD_VALUES = sorted((int.from_bytes(head, "big"), i) for i, head in enumerate(CID_HEADS))
_HEAD_NUMBERS = np.array([value for value, _ in _HEAD_VALUES], np.uint64)
_HEAD_PLACES = np.array([i for _, i in _HEAD_VALUES], np.uint8)
_HEAD_LENGTHS = np.array([len(CID_HEADS[i]) + _DIGEST for _, i in _HEAD_VALUES], np.uint8)


def _heads(words: np.ndarray, lengths: np.ndarray) -> np.ndarray | None:
    """Each CID's head (a position in :data:`CID_HEADS`) from its first 8 bytes (``words``) and
    length; None if one is not a CID cas_ckpt writes."""
    value = words >> ((np.uint64(8 + _DIGEST) - lengths) * np.uint64(8))  # its head's bytes
    found = np.minimum(np.searchsorted(_HEAD_NUMBERS, value), len(_HEAD_NUMBERS) - 1)
    if not ((_HEAD_NUMBERS[found] == value) & (_HEAD_LENGTHS[found] == lengths)).all():
        return None
    return _HEAD_PLACES[found]


# How far a msgpack uint's 8 bytes after its first one shift right to its value, by that byte.
_SHIFT = np.zeros(256, np.uint64)
_SHIFT[[0xCC, 0xCD, 0xCE, 0xCF]] = [56, 48, 32, 0]


def _uint(words: np.ndarray, at: np.ndarray, marker: np.ndarray) -> np.ndarray:
    """The msgpack unsigned ints at ``at`` whose first bytes are ``marker`` (widths checked)."""
    value = words[np.minimum(at + 1, len(words) - 1)] >> _SHIFT[marker]
    fixint = marker < 0x80
    value[fixint] = marker[fixint]
    return value
