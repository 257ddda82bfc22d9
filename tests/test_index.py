"""The block index in memory (``blocks/index.py``): sorted fixed-width tables against a plain model."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from cas_ckpt import cid as cidlib
from cas_ckpt.blocks import index as index_module
from cas_ckpt.blocks.index import KEY_SIZE, BlockIndex, Table, cid_of, key_of, keys_of
from cas_ckpt.blocks.pack import Entry, Location

HASHERS = [cidlib.Hasher("sha2-256"), cidlib.Hasher("blake3")]


def make_cid(seed: int, kind: int = 0) -> bytes:
    hasher = HASHERS[kind // 2]
    data = seed.to_bytes(8, "little")
    return hasher.node(data) if kind % 2 else hasher.raw(data)


cids = st.builds(make_cid, st.integers(0, 40), st.integers(0, 3))


@given(cids)
def test_a_key_names_its_cid_and_sorts_by_digest(cid: bytes) -> None:
    key = key_of(cid)
    assert len(key) == KEY_SIZE and key[:32] == cid[-32:] and cid_of(key) == cid
    assert key[-1] in (1, 2, 3, 4)


@given(st.lists(cids, min_size=1, max_size=50))
def test_keys_of_many_is_key_of_each(many: list[bytes]) -> None:
    assert keys_of(many).tolist() == [key_of(c) for c in many]


def test_keys_of_one_kind_takes_the_array_path() -> None:
    many = [make_cid(i) for i in range(1000)]
    assert keys_of(many).tolist() == [key_of(c) for c in many]


@settings(max_examples=25)
@given(st.lists(st.binary(min_size=KEY_SIZE - 1, max_size=KEY_SIZE - 1), min_size=0, max_size=3000))
def test_a_table_finds_every_key_it_holds_and_no_other(digests: list[bytes]) -> None:
    keys = [d + b"\x01" for d in digests]
    rows = np.zeros(len(keys), index_module.LOCATION_DTYPE)
    rows["offset"] = np.arange(len(keys))
    table = Table.sorted(np.array(keys, dtype=index_module.KEY_DTYPE), rows)
    held = set(keys)
    for key in keys:
        found = list(table.rows(key))
        assert found and all(table.key(r) == key for r in found)
        assert len(found) == keys.count(key)
    for probe in (b"\x00" * 32 + b"\x01", b"\xff" * 32 + b"\x01", hashlib.sha256(b"x").digest() + b"\x02"):
        assert (table.find(probe) >= 0) == (probe in held)
    many = table.find_many(np.array([*keys, b"\xfe" * 33], dtype=index_module.KEY_DTYPE))
    assert (many[:-1] >= 0).all() and (many[-1] == -1 or b"\xfe" * 33 in held)


def test_a_key_spanning_two_rows_is_not_found() -> None:
    a, b = b"\x10" * 32 + b"\x01", b"\x11" * 32 + b"\x01"
    table = Table.sorted(np.array([a, b], dtype=index_module.KEY_DTYPE),
                         np.zeros(2, index_module.LOCATION_DTYPE))
    straddle = (a + b)[5 : 5 + KEY_SIZE]
    assert table.find(straddle) == -1 and list(table.rows(straddle)) == []


class IndexAgainstModel(RuleBasedStateMachine):
    """Packs added, dropped and damaged copies marked: every lookup agrees with a dict model."""

    def __init__(self) -> None:
        super().__init__()
        self.index = BlockIndex()
        self.model: dict[str, list[Entry]] = {}
        self.counter = 0

    @rule(blocks=st.lists(cids, min_size=0, max_size=30))
    def add_pack(self, blocks: list[bytes]) -> None:
        self.counter += 1
        name = f"{self.counter:064x}.pack"
        entries, offset = [], 8
        for cid in dict.fromkeys(blocks):
            entries.append(Entry(cid, offset, 10 + len(entries), 0, 10 + len(entries)))
            offset += 10 + len(entries)
        self.index.add_packs([(name, [tuple(e) for e in entries])])
        self.model[name] = entries

    @rule(data=st.data())
    def drop_pack(self, data: st.DataObject) -> None:
        if self.model:
            name = data.draw(st.sampled_from(sorted(self.model)))
            self.index.drop([name])
            del self.model[name]

    @rule(data=st.data())
    def mark_a_copy_bad(self, data: st.DataObject) -> None:
        every = [Location.of(name, e) for name, entries in self.model.items() for e in entries]
        if every:
            self.index.mark_bad(data.draw(st.sampled_from(every)))

    @rule()
    def fold(self) -> None:
        self.index._compact()

    def copies(self, cid: bytes) -> list[Location]:
        return [Location.of(name, e) for name, entries in self.model.items() for e in entries if e.cid == cid]

    @invariant()
    def lookups_agree(self) -> None:
        probes = [make_cid(seed, kind) for seed in range(0, 41, 3) for kind in range(4)]
        for cid in probes:
            expected = self.copies(cid)
            got = self.index.copies(cid)
            assert sorted(got) == sorted(expected)
            assert [loc in self.index.bad for loc in got] == sorted(loc in self.index.bad for loc in got)
            assert self.index.has(cid) == any(loc not in self.index.bad for loc in expected)
        assert self.index.has_many(probes) == [self.index.has(c) for c in probes]
        present = [c for c in probes if self.copies(c)]
        located = self.index.locate_many(present)
        if located is not None:
            rows, names = located
            for cid, (pack, offset, length, codec, size) in zip(present, rows.tolist(), strict=True):
                assert Location(names[pack], offset, length, codec, size) in self.copies(cid)
        assert sorted(self.index.cids()) == sorted({e.cid for es in self.model.values() for e in es})
        assert self.index.entries() == self.model
        base, delta, _ = self.index._state
        rows = sorted((name, e.cid, e.offset) for name, es in self.model.items() for e in es)
        for table, names in [(base, None), (delta, None), self.index.snapshot()]:
            keys = table.key_array
            assert (keys[1:] >= keys[:-1]).all()  # merged, never left unsorted
            if names is not None:  # the snapshot: every live row, its packs numbered from 0
                found = [(names[pack], cid_of(key), offset) for key, (pack, offset, *_)
                         in zip(keys.tolist(), table.location_array.tolist(), strict=True)]
                assert sorted(found) == rows


TestIndexAgainstModel = IndexAgainstModel.TestCase
TestIndexAgainstModel.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)


def test_a_large_delta_folds_into_the_base(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(index_module, "_MERGE_MIN", 100)
    index = BlockIndex()
    for p in range(30):
        entries = [(make_cid(p * 1000 + i), 8 + i, 1, 0, 1) for i in range(10)]
        index.add_packs([(f"{p:064x}.pack", entries)])
    base, delta, _ = index._state
    assert base.n > 0 and delta.n <= max(100, base.n // 8) and base.n + delta.n == 300
    assert all(index.has(make_cid(p * 1000 + i)) for p in range(30) for i in range(10))
