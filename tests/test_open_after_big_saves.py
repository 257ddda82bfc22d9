"""An open after big saves (issue #49 item 6): a pack's own index is read as arrays, as an index
snapshot is, never as an object per entry.

The arrays decoder (``pack.parse_index_columns``) is checked against the entry-by-entry one
(``pack.parse_index``) on indexes as cas_ckpt writes them, on valid msgpack it does not write,
and on damage; the tables made of its columns against ``index.table_of``; and a store of four
saves of 50,000 blocks each, opened without upkeep, by what its index holds.
"""

from __future__ import annotations

import hashlib
import mmap
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

import cas_ckpt
from cas_ckpt import cid as cidlib
from cas_ckpt._memory import OWN_PAGES, pages
from cas_ckpt.blocks import index as index_module
from cas_ckpt.blocks import pack as pack_module
from cas_ckpt.blocks.base import size_limit
from cas_ckpt.blocks.compression import CODEC_NONE, CODECS
from cas_ckpt.blocks.index import BlockIndex, table_of, table_of_columns
from cas_ckpt.blocks.pack import (
    CID_HEADS,
    FOOTER,
    FOOTER_MAGIC,
    PACK_MAGIC,
    Columns,
    Entry,
    Location,
    encode_index,
    parse_index,
    parse_index_columns,
)
from cas_ckpt.blocks.packed import LocalStore
from cas_ckpt.errors import CorruptStore

# Bytes that look like a row's start (a fixarray of 3 or 5, bin 8, a CID's length): inside a
# digest or an int they are candidates off the chain, which the decoder must skip.
LOOKALIKES = [b"\x93\xc4\x24", b"\x93\xc4\x25", b"\x95\xc4\x24", b"\x95\xc4\x25\x01\x81\x04\x12\x20"]
# Ints whose msgpack bytes hold those, and each width's edges.
AWKWARD = [0x93C424, 0x93C42501, 0x95C42401, 0x93C4240155122000, 0x7F, 0x80, 0xFF, 0x100, 0xFFFF, 0x10000,
           0xFFFFFFFF, 0x100000000]


@st.composite
def digests(draw: st.DrawFn) -> bytes:
    digest = bytearray(draw(st.binary(min_size=32, max_size=32)))
    if draw(st.booleans()):
        lookalike = draw(st.sampled_from(LOOKALIKES))
        at = draw(st.integers(0, 32 - len(lookalike)))
        digest[at : at + len(lookalike)] = lookalike
    return bytes(digest)


cids = st.builds(lambda head, digest: head + digest, st.sampled_from(CID_HEADS), digests())


@st.composite
def indexes(draw: st.DrawFn, version: int) -> tuple[list[Entry], int]:
    """Entries anywhere inside a pack (not back to back, sometimes repeated), and where its
    index starts."""
    entries = []
    for cid in draw(st.lists(cids | st.sampled_from([CID_HEADS[0] + b"\x93" * 32]), max_size=40)):
        offset = draw(st.integers(len(PACK_MAGIC), 2**40) | st.sampled_from([a for a in AWKWARD if a >= 8]))
        length = draw(st.integers(0, 2**32 - 1) | st.sampled_from([a for a in AWKWARD if a < 2**32]))
        codec = CODEC_NONE if version == 1 else draw(st.sampled_from(CODECS))
        size = length if codec == CODEC_NONE else draw(st.integers(0, size_limit(cid)))
        if codec == CODEC_NONE and length > size_limit(cid):
            length = size = draw(st.integers(0, size_limit(cid)))
        entries.append(Entry(cid, offset, length, codec, size))
    start = max([len(PACK_MAGIC), *(e.offset + e.length for e in entries)])
    return entries, start


def outcome(decode: Any) -> tuple[str, Any]:
    """What a decoder gives: its entries as tuples, or the error it raised (type and text)."""
    try:
        return "entries", [tuple(e) for e in decode()]
    except (CorruptStore, ValueError) as exc:
        return type(exc).__name__, str(exc)


def fast_path(tail: bytes, start: int, version: int) -> Columns | None:
    """The arrays decoder alone (None: it leaves the index to the entry-by-entry one)."""
    data = np.frombuffer(tail, np.uint8)
    return pack_module._columns(data, 0, len(tail) - FOOTER.size, start, version)


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), version=st.sampled_from([1, 2]))
def test_an_index_as_cas_ckpt_writes_it_is_decoded_by_arrays_to_the_same_entries(
    data: st.DataObject, version: int
) -> None:
    entries, start = data.draw(indexes(version))
    tail, _ = encode_index(entries, version)
    size = start + len(tail)
    columns = parse_index_columns(tail, size, "p.pack", version)
    want = parse_index(tail, size, "p.pack", version)
    assert [tuple(e) for e in columns.entries()] == [tuple(e) for e in want]
    if entries:
        assert fast_path(tail, start, version) is not None  # never the entry-by-entry way
        assert columns.source is tail  # the bytes it was read from, freed with it


@pytest.mark.parametrize("window", [61, 97, 4096])
def test_rows_full_of_lookalikes_are_decoded_by_arrays_in_windows_of_any_size(
    monkeypatch: pytest.MonkeyPatch, window: int
) -> None:
    """Every digest and many offsets hold a row's first bytes; windows of one or two rows each:
    rows and the candidates off the chain straddle the windows' ends."""
    monkeypatch.setattr(pack_module, "WINDOW", window)
    length, first = 0x93C4, 0x93C42400
    entries = [Entry(CID_HEADS[i % 4] + (LOOKALIKES[i % 4] * 11)[:32], first + i * length, length, CODEC_NONE,
                     length) for i in range(1000)]
    for version in (1, 2):
        tail, _ = encode_index(entries, version)
        start = first + 1000 * length
        assert fast_path(tail, start, version) is not None
        assert parse_index_columns(tail, start + len(tail), "p", version).entries() == entries


def test_an_index_claiming_more_rows_than_its_bytes_hold_is_judged_row_by_row() -> None:
    """An array 32 header claiming four billion rows allocates nothing for them."""
    entries = [Entry(CID_HEADS[0] + bytes(32), 8, 1, CODEC_NONE, 1)]
    index = b"\xdd\xff\xff\xff\xff" + encode_index(entries, 1)[0][1 : -FOOTER.size]
    tail = with_checksum(index)
    assert fast_path(tail, 9, 1) is None
    with pytest.raises(CorruptStore, match="unreadable pack index"):
        parse_index_columns(tail, 9 + len(tail), "p", 1)


def with_checksum(index: bytes) -> bytes:
    """A pack's tail for these index bytes: their footer made afresh (so the checksum passes)."""
    return index + FOOTER.pack(len(index), hashlib.sha256(index).digest(), FOOTER_MAGIC)


def agree(tail: bytes, size: int, version: int) -> None:
    """The arrays decoder gives what the entry-by-entry one gives: the same entries or the same
    error, or, for entries of 4 GiB or more, what indexing them always raised."""
    slow = outcome(lambda: parse_index(tail, size, "p.pack", version))
    fast = outcome(lambda: parse_index_columns(tail, size, "p.pack", version).entries())
    if slow[0] == "entries" and any(e[2] >= 2**32 or e[4] >= 2**32 for e in slow[1]):
        assert fast == ("ValueError", "a block of 4 GiB or more cannot be indexed")
    else:
        assert fast == slow


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), version=st.sampled_from([1, 2]),
       edits=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255),
                                st.sampled_from(["set", "add", "drop"])), min_size=1, max_size=4))
def test_damage_inside_an_index_its_checksum_passes_is_judged_as_row_by_row(
    data: st.DataObject, version: int, edits: list[tuple[int, int, str]]
) -> None:
    entries, start = data.draw(indexes(version))
    index = bytearray(encode_index(entries, version)[0][: -FOOTER.size])
    for at, byte, how in edits:
        at %= len(index) + (how == "add")
        if how == "set":
            index[at] = byte
        elif how == "add":
            index.insert(at, byte)
        elif len(index) > 1:
            del index[at]
    tail = with_checksum(bytes(index))
    agree(tail, start + len(tail), version)


def msgpack_uint(value: int, width: int) -> bytes:
    """An unsigned int in msgpack at this width (1: positive fixint), canonical or not."""
    if width == 1:
        return bytes([value])
    return bytes([{2: 0xCC, 3: 0xCD, 5: 0xCE, 9: 0xCF}[width]]) + value.to_bytes(width - 1, "big")


@settings(max_examples=100)
@given(data=st.data(), version=st.sampled_from([1, 2]), wide=st.sampled_from([5, 9]),
       cid_as=st.sampled_from(["bin8", "bin16", "bin32"]), rows_as=st.sampled_from(["fixarray", "array16"]),
       top_as=st.sampled_from(["canonical", "array32"]))
def test_valid_msgpack_that_cas_ckpt_does_not_write_gives_the_same_entries(
    data: st.DataObject, version: int, wide: int, cid_as: str, rows_as: str, top_as: str
) -> None:
    """Ints wider than they need be, CIDs as bin 16 or 32, rows and the index as array 16 or 32:
    any msgpack encoder's index reads as msgpack reads it (the entry-by-entry way where the arrays
    decoder does not know the form)."""
    entries, start = data.draw(indexes(version))
    arity = 3 if version == 1 else 5
    top = b"\xdd" + len(entries).to_bytes(4, "big") if top_as == "array32" else _array_header(len(entries))
    parts = [top]
    for e in entries:
        parts.append(bytes([0x90 | arity]) if rows_as == "fixarray" else b"\xdc" + arity.to_bytes(2, "big"))
        parts.append({"bin8": b"\xc4" + bytes([len(e.cid)]), "bin16": b"\xc5" + len(e.cid).to_bytes(2, "big"),
                      "bin32": b"\xc6" + len(e.cid).to_bytes(4, "big")}[cid_as] + e.cid)
        fields = (e.offset, e.length) if version == 1 else (e.offset, e.length, e.codec, e.size)
        parts += [msgpack_uint(value, wide if value < 2 ** (8 * (wide - 1)) else 9) for value in fields]
    index = b"".join(parts)
    assert msgpack.unpackb(index, raw=False) == [list(e[:arity]) for e in entries]
    tail = with_checksum(index)
    agree(tail, start + len(tail), version)
    assert [tuple(e) for e in parse_index_columns(tail, start + len(tail), "p", version).entries()] == \
        [tuple(e) for e in entries]


def _array_header(n: int) -> bytes:
    return bytes([0x90 | n]) if n < 16 else b"\xdc" + n.to_bytes(2, "big") if n < 2**16 else \
        b"\xdd" + n.to_bytes(4, "big")


# ------------------------------------------------------------------------------------------------
# Tables of columns
# ------------------------------------------------------------------------------------------------
# Few distinct blocks, some alike in their first bytes: copies in two packs, and ties the sort
# by leading bits must settle by the whole key.
SHARED = [head + bytes(8) + bytes([i]) * 24 for head in CID_HEADS for i in range(3)]
pool_cids = cids | st.sampled_from(SHARED)


@st.composite
def packs(draw: st.DrawFn) -> list[tuple[str, list[Entry]]]:
    found = []
    for p in range(draw(st.integers(0, 5))):
        blocks = draw(st.lists(pool_cids, max_size=30))
        entries = [Entry(cid, 8 + i, i, CODEC_NONE, i) for i, cid in enumerate(blocks)]
        found.append((f"{p:064x}.pack", entries))
    return found


@settings(max_examples=150)
@given(every=packs(), split=st.integers(0, 5))
def test_a_table_of_columns_is_the_table_of_entries(every: list[tuple[str, list[Entry]]], split: int) -> None:
    """Rows sorted by key, copies of a block in pack order: the packs before ``split`` given as a
    table already made, the others as columns."""
    split = min(split, len(every))
    made = table_of([(name, [tuple(e) for e in entries]) for name, entries in every[:split]])
    got = table_of_columns([Columns.of([tuple(e) for e in entries]) for _, entries in every[split:]],
                           range(split, len(every)), [made])
    want = table_of([(name, [tuple(e) for e in entries]) for name, entries in every])
    assert bytes(got.key_bytes) == bytes(want.key_bytes)
    assert bytes(got.location_bytes) == bytes(want.location_bytes)


class IndexOfColumnsAgainstModel(RuleBasedStateMachine):
    """Packs taken in as columns (as an open reads them) or as entries (as a save adds them),
    dropped and folded, with a small fold threshold: every lookup agrees with a dict model."""

    def __init__(self) -> None:
        super().__init__()
        self.merge_min = index_module._MERGE_MIN
        index_module._MERGE_MIN = 16
        self.index = BlockIndex()
        self.model: dict[str, list[Entry]] = {}
        self.counter = 0

    def teardown(self) -> None:
        index_module._MERGE_MIN = self.merge_min

    @rule(many=st.lists(st.lists(pool_cids, max_size=12), min_size=1, max_size=3), as_columns=st.booleans())
    def add_packs(self, many: list[list[bytes]], as_columns: bool) -> None:
        batch = []
        for blocks in many:
            self.counter += 1
            entries = [Entry(cid, 8 + i, i, CODEC_NONE, i) for i, cid in enumerate(dict.fromkeys(blocks))]
            batch.append((f"{self.counter:064x}.pack", entries))
            self.model[batch[-1][0]] = entries
        if as_columns:
            self.index.add_columns((name, Columns.of(entries)) for name, entries in batch)
        else:
            self.index.add_packs((name, [tuple(e) for e in entries]) for name, entries in batch)

    @rule(data=st.data())
    def drop_pack(self, data: st.DataObject) -> None:
        if self.model:
            name = data.draw(st.sampled_from(sorted(self.model)))
            self.index.drop([name])
            del self.model[name]

    @invariant()
    def lookups_agree(self) -> None:
        for cid in {*SHARED, *(e.cid for entries in self.model.values() for e in entries)}:
            want = [Location.of(name, e) for name, entries in self.model.items()
                    for e in entries if e.cid == cid]
            assert sorted(self.index.copies(cid)) == sorted(want)
        assert self.index.entries() == self.model
        base, delta, _ = self.index._state
        for table in (base, delta):
            assert (table.key_array[1:] >= table.key_array[:-1]).all()


TestIndexOfColumnsAgainstModel = IndexOfColumnsAgainstModel.TestCase
TestIndexOfColumnsAgainstModel.settings = settings(max_examples=40, stateful_step_count=20, deadline=None)


def test_large_buffers_are_mappings_of_their_own() -> None:
    small, large = pages(OWN_PAGES - 1), pages(OWN_PAGES)
    assert isinstance(small, bytearray) and len(small) == OWN_PAGES - 1
    assert isinstance(large, mmap.mmap) and len(large) == OWN_PAGES
    view = np.frombuffer(large, np.uint8)
    assert not view.any()  # zeroed
    view[-1] = 7  # writable
    assert large[-1] == 7


# ------------------------------------------------------------------------------------------------
# A store after big saves
# ------------------------------------------------------------------------------------------------
SAVES, BLOCKS = 4, 50_000


def held_bytes(index: BlockIndex) -> int:
    """The bytes the index's tables keep: each buffer once, and the buckets."""
    base, delta, _ = index._state
    buffers = {id(b): len(b) for table in (base, delta) for b in (table._keys, table._locations)}
    return sum(buffers.values()) + sum(len(table._buckets) * 4 for table in (base, delta))


def test_an_open_after_four_big_saves_holds_a_snapshots_memory_and_no_object_per_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four saves of 50,000 blocks, one pack each, no upkeep after the first (which wrote the
    snapshot): an open reads three packs' own indexes. Each is decoded by arrays (no msgpack
    object per entry), and the index holds at most 64 bytes a block, as after upkeep."""
    hasher = cidlib.Hasher("sha2-256")
    store = LocalStore(tmp_path)
    for save in range(SAVES):
        with store.writer() as writer:
            for i in range(save * BLOCKS, (save + 1) * BLOCKS):
                data = i.to_bytes(8, "little") * 32
                writer.put(hasher.raw(data), data)
        if save == 0:
            store.consolidate()
    store.close()
    assert len(list((tmp_path / "packs").iterdir())) == SAVES

    decoded: list[int] = []  # the bytes of each msgpack document decoded during the open
    unpackb = msgpack.unpackb
    monkeypatch.setattr(msgpack, "unpackb",
                        lambda data, **kw: decoded.append(len(data)) or unpackb(data, **kw))
    reopened = LocalStore(tmp_path, read_only=True)
    monkeypatch.undo()
    layout = reopened.layout()
    assert layout.blocks == SAVES * BLOCKS and layout.uncovered == SAVES - 1
    assert max(decoded, default=0) < 4096  # index file headers; no pack's index (2.3 MB each)
    assert held_bytes(reopened._blocks) <= 64 * SAVES * BLOCKS
    for i in range(0, SAVES * BLOCKS, 997):
        data = i.to_bytes(8, "little") * 32
        assert reopened.get(hasher.raw(data)) == data
    assert not reopened._blocks.has(hasher.raw(b"never stored"))
    reopened.close()


def test_a_damaged_pack_index_is_still_reported_by_the_open(tmp_path: Path) -> None:
    """A pack whose index fails its checks is reported damaged and skipped, its neighbours read
    by arrays as ever."""
    hasher = cidlib.Hasher("sha2-256")
    store = LocalStore(tmp_path)
    for save in range(2):  # blocks of under 128 bytes: each row ends in a one-byte int
        with store.writer() as writer:
            for i in range(save * 100, save * 100 + 100):
                data = bytes([i]) * (i % 100 + 1)
                writer.put(hasher.raw(data), data)
    store.close()
    victim = sorted((tmp_path / "packs").iterdir())[0]
    data = bytearray(victim.read_bytes())
    length, _, _ = FOOTER.unpack(data[-FOOTER.size :])
    index = bytearray(data[-FOOTER.size - length : -FOOTER.size])
    index[-1] = 0xC0  # the last row's last int is nil now: msgpack reads it, the checks refuse it
    data[-FOOTER.size - length :] = with_checksum(bytes(index))
    victim.write_bytes(bytes(data))
    reopened = LocalStore(tmp_path, read_only=True)
    assert list(reopened.corrupt_packs) == [victim.name]
    assert "wrong types" in reopened.corrupt_packs[victim.name]
    assert reopened.layout().packs == 1
    reopened.close()



def put_blocks(repo: Any, start: int, stop: int) -> None:
    """Blocks ``start`` to ``stop - 1`` in one pack, as one save's."""
    with repo.blocks.writer() as writer:
        for i in range(start, stop):
            data = i.to_bytes(8, "little") * 4
            writer.put(repo.hasher.raw(data), data)


def test_upkeep_is_due_once_a_snapshots_eighth_or_the_limit_of_rows_lie_outside_it(tmp_path: Path) -> None:
    """Big saves leave few packs but many rows for an open to read and sort: upkeep writes a
    snapshot once ``uncovered_rows`` block copies lie outside the last one (or an eighth of
    those in it, if more), whatever the packs' count."""
    with cas_ckpt.open(tmp_path / "repo", upkeep={"uncovered_rows": 1000, "small_packs": 0}) as repo:
        put_blocks(repo, 0, 500)
        assert repo.upkeep().ran == ["consolidate-index"]  # the first snapshot
        put_blocks(repo, 500, 1499)
        status = repo.upkeep_status()
        assert status is not None and (status.uncovered, status.uncovered_rows) == (1, 999)
        assert status.due == []
        put_blocks(repo, 1499, 1500)
        assert repo.upkeep_status().due == ["consolidate-index"]  # type: ignore[union-attr]
        assert repo.upkeep().ran == ["consolidate-index"]
        assert repo.upkeep_status().uncovered_rows == 0  # type: ignore[union-attr]
        put_blocks(repo, 1500, 10_000)  # 8,500 rows outside; 1,500 in the snapshot
        repo.upkeep()
        put_blocks(repo, 10_000, 11_249)  # 1,249 outside: under an eighth of the 10,000 in it
        assert repo.upkeep_status().due == []  # type: ignore[union-attr]
        put_blocks(repo, 11_249, 11_250)
        assert repo.upkeep_status().due == ["consolidate-index"]  # type: ignore[union-attr]
    with cas_ckpt.open(tmp_path / "never", upkeep={"uncovered_rows": 0, "small_packs": 0}) as repo:
        put_blocks(repo, 0, 10)
        repo.upkeep()
        put_blocks(repo, 10, 5000)
        assert repo.upkeep_status().due == []  # type: ignore[union-attr]
