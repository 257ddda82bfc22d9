"""Index files (``blocks/index_file.py``): round trips, and damage of every kind refused clearly."""

from __future__ import annotations

import hashlib

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_index import cids

from cas_ckpt.blocks import index_file
from cas_ckpt.blocks.index import KEY_SIZE, LOCATION_DTYPE, Table, table_of
from cas_ckpt.blocks.index_file import (
    END,
    HEAD,
    JOURNAL,
    MAGIC,
    SNAPSHOT,
    IndexFile,
    encode,
    file_name,
    parse,
    parse_name,
)
from cas_ckpt.errors import CorruptStore


@st.composite
def index_files(draw: st.DrawFn) -> IndexFile:
    packs = []
    for p in range(draw(st.integers(0, 4))):
        blocks = draw(st.lists(cids, max_size=12, unique=True))
        entries, offset = [], 8
        for cid in blocks:
            length = draw(st.integers(0, 5000))
            codec = draw(st.sampled_from([0, 1, 2]))
            entries.append((cid, offset, length, codec, length if codec == 0 else draw(st.integers(0, 9000))))
            offset += length
        packs.append((f"{p:064x}.pack", entries, offset + draw(st.integers(48, 5000))))
    table = table_of([(name, entries) for name, entries, _ in packs])
    kind = draw(st.sampled_from([SNAPSHOT, JOURNAL]))
    folded = [file_name(JOURNAL, n) for n in draw(st.lists(st.integers(0, 10**19), max_size=3))] \
        if kind == SNAPSHOT else []
    return IndexFile(kind, [(name, size) for name, _, size in packs], table, folded)


@given(index_files())
def test_an_index_file_round_trips(content: IndexFile) -> None:
    again = parse(encode(content), "x")
    assert (again.kind, again.packs, again.folded) == (content.kind, content.packs, content.folded)
    assert again.table.key_bytes == content.table.key_bytes
    assert again.table.location_bytes == content.table.location_bytes


@settings(max_examples=30)
@given(index_files(), st.data())
def test_any_changed_byte_or_cut_is_refused(content: IndexFile, data: st.DataObject) -> None:
    raw = bytearray(encode(content))
    at = data.draw(st.integers(0, len(raw) - 1))
    flipped = bytes(raw[:at]) + bytes([raw[at] ^ data.draw(st.integers(1, 255))]) + bytes(raw[at + 1 :])
    with pytest.raises(CorruptStore, match="where-it-is"):
        parse(flipped, "where-it-is")
    with pytest.raises(CorruptStore):
        parse(bytes(raw[: data.draw(st.integers(0, len(raw) - 1))]), "x")


def _sealed(body: bytes) -> bytes:
    return body + hashlib.sha256(body).digest() + END


def _crafted(header: object, keys: list[bytes], rows: np.ndarray) -> bytes:
    head = msgpack.packb(header, use_bin_type=True)
    return _sealed(MAGIC + HEAD.pack(len(head)) + head + len(keys).to_bytes(8, "little")
                   + b"".join(keys) + rows.tobytes())


def _rows(*rows: tuple[int, int, int, int, int]) -> np.ndarray:
    return np.array(list(rows), LOCATION_DTYPE)


KEY_A, KEY_B = b"\x01" * 32 + b"\x01", b"\x02" * 32 + b"\x01"
PACKS = {"kind": "journal", "packs": [["a.pack", 1000]]}


@pytest.mark.parametrize(("header", "keys", "rows", "why"), [
    (PACKS, [KEY_B, KEY_A], _rows((0, 8, 1, 0, 1), (0, 9, 1, 0, 1)), "not sorted"),
    (PACKS, [b"\x01" * 32 + b"\x07"], _rows((0, 8, 1, 0, 1)), "unknown kind"),
    (PACKS, [KEY_A], _rows((1, 8, 1, 0, 1)), "does not list"),
    (PACKS, [KEY_A], _rows((0, 8, 1, 9, 1)), "unknown codec"),
    (PACKS, [KEY_A], _rows((0, 8, 1, 0, 2)), "another length"),
    (PACKS, [KEY_A], _rows((0, 4, 1, 0, 1)), "outside its pack"),
    (PACKS, [KEY_A], _rows((0, 900, 100, 0, 100)), "outside its pack"),
    (PACKS, [KEY_A], _rows((0, 2**64 - 1, 10, 0, 10)), "outside its pack"),
    ({"kind": "other", "packs": []}, [], _rows(), "known kind"),
    ({"kind": "journal", "packs": [["a.pack", -1]]}, [], _rows(), "wrong shape"),
    ({"kind": "journal", "packs": [["../a.pack", 100]]}, [], _rows(), "wrong shape"),
    ({"kind": "snapshot", "packs": [], "folded": ["x"]}, [], _rows(), "folded"),
])
def test_rows_and_headers_that_make_no_sense_are_refused(
    header: object, keys: list[bytes], rows: np.ndarray, why: str
) -> None:
    with pytest.raises(CorruptStore, match=why):
        parse(_crafted(header, keys, rows), "x")


@pytest.mark.parametrize("at", [0, 2, 3, 4, 5, 9])
@pytest.mark.parametrize("damage", ["order", "pack", "offset"])
def test_rows_are_checked_in_chunks_without_a_gap(
    monkeypatch: pytest.MonkeyPatch, at: int, damage: str
) -> None:
    """Rows are checked a chunk at a time (CHECK_ROWS): a bad row is found in any chunk, and two
    rows out of order across a chunk's boundary too."""
    monkeypatch.setattr(index_file, "CHECK_ROWS", 3)
    keys = [bytes([i + 1]) * 32 + b"\x01" for i in range(10)]
    rows = _rows(*[(0, 8 + i, 1, 0, 1) for i in range(10)])
    parse(_crafted(PACKS, keys, rows), "x")  # sound: passes
    why = {"order": "not sorted", "pack": "does not list", "offset": "outside its pack"}[damage]
    if damage == "order":
        keys[at], keys[at + 1 if at < 9 else at - 1] = keys[at + 1 if at < 9 else at - 1], keys[at]
    elif damage == "pack":
        rows[at]["pack"] = 1
    else:
        rows[at]["offset"] = 2000
    with pytest.raises(CorruptStore, match=why):
        parse(_crafted(PACKS, keys, rows), "x")


def test_a_row_count_that_does_not_fit_is_refused() -> None:
    good = _crafted(PACKS, [KEY_A], _rows((0, 8, 1, 0, 1)))
    body = bytearray(good[: -len(END) - 32])
    count_at = len(body) - KEY_SIZE - LOCATION_DTYPE.itemsize - 8
    body[count_at : count_at + 8] = (2).to_bytes(8, "little")
    with pytest.raises(CorruptStore, match="not 2 rows"):
        parse(_sealed(bytes(body)), "x")


def test_names_sort_journals_then_snapshots_by_sequence() -> None:
    names = [file_name(SNAPSHOT, 5), file_name(JOURNAL, 7), file_name(JOURNAL, 12), file_name(SNAPSHOT, 3)]
    expected = [(JOURNAL, 7, 0), (JOURNAL, 12, 0), (SNAPSHOT, 3, 0), (SNAPSHOT, 5, 0)]
    assert [parse_name(n) for n in sorted(names)] == expected
    assert parse_name(file_name(SNAPSHOT, 9, 4)) == (SNAPSHOT, 9, 4)
    assert parse_name("s-1-abc.idx") is None and parse_name("x.pack") is None
    assert parse_name(file_name(JOURNAL, 3).replace("j-", "s-")) is None


def test_an_empty_table_is_a_valid_snapshot() -> None:
    content = IndexFile(SNAPSHOT, [], Table(b"", b""))
    assert parse(encode(content), "x").table.n == 0
