"""Conformance suites that every store implementation must pass (needs pytest).

Subclass :class:`BlockStoreTests` in a test module, name the subclass ``Test...``, override the
``store`` fixture to yield a fresh, empty store, and override :meth:`BlockStoreTests.corrupt` to
damage one stored block in place. Every test then runs against your store::

    class TestMyStore(BlockStoreTests):
        @pytest.fixture
        def store(self, tmp_path):
            with closing(MyStore(tmp_path)) as s:
                yield s

        def corrupt(self, store, cid):
            ...
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from multiformats import CID

from cas_ckpt import cid as cidlib
from cas_ckpt.blocks.base import BlockStore
from cas_ckpt.errors import BlockNotFound, CorruptBlock, RepositoryError
from cas_ckpt.refs import MemoryRefStore
from cas_ckpt.repository import Repository

_SHA = cidlib.Hasher("sha2-256")
_BLAKE = cidlib.Hasher("blake3")


def raw_block(i: int, size: int = 100, *, hasher: cidlib.Hasher = _SHA) -> tuple[bytes, bytes]:
    """A raw block (binary CID, bytes) with content that depends on ``i``."""
    seed = i.to_bytes(8, "little")
    data = (seed * (size // 8 + 1))[:size]
    return hasher.raw(data), data


class BlockStoreTests:
    """The behaviour the repository relies on, for any :class:`BlockStore`."""

    @pytest.fixture
    def store(self) -> Iterator[BlockStore]:
        raise NotImplementedError("override the store fixture to yield a fresh, empty store")

    def corrupt(self, store: BlockStore, cid: bytes) -> None:
        """Change the stored bytes of ``cid`` in place, keeping their length."""
        raise NotImplementedError

    def leftovers(self, store: BlockStore) -> list[str]:
        """Temporary files or objects; a committed or aborted writer must leave none."""
        return []

    # -- empty store and lookups -------------------------------------------------------------
    def test_empty_store(self, store: BlockStore) -> None:
        cid, _ = raw_block(0)
        assert list(store) == []
        assert list(store.keys()) == []
        assert len(store) == 0
        assert not store.has(cid)
        assert cid not in store

    def test_missing_block_is_block_not_found(self, store: BlockStore) -> None:
        cid, data = raw_block(0)
        name = cidlib.to_str(cid)
        with pytest.raises(BlockNotFound, match=name) as info:
            store.get(cid)
        assert isinstance(info.value, KeyError)
        assert info.value.cid == name
        with pytest.raises(BlockNotFound, match=name):
            store.size(cid)
        with pytest.raises(BlockNotFound, match=name):
            store.get_into(cid, memoryview(bytearray(len(data))))

    # -- put / get -----------------------------------------------------------------------------
    def test_put_get_has_size(self, store: BlockStore) -> None:
        cid, data = raw_block(1, 1000)
        assert store.put(cid, data) is True
        assert store.get(cid) == data
        assert store.has(cid)
        assert store.size(cid) == 1000
        out = bytearray(1000)
        store.get_into(cid, memoryview(out))
        assert bytes(out) == data

    def test_put_again_is_a_no_op(self, store: BlockStore) -> None:
        cid, data = raw_block(1)
        assert store.put(cid, data) is True
        assert store.put(cid, data) is False
        assert list(store.keys()) == [cid]

    def test_every_cid_form_is_accepted(self, store: BlockStore) -> None:
        cid, data = raw_block(2)
        text = cidlib.to_str(cid)
        assert store.put(text, data) is True
        assert store.get(CID.decode(text)) == data
        assert store.get(text) == data
        assert store.get(cid) == data
        assert CID.decode(text) in store
        assert text in store

    def test_blocks_of_both_codecs_and_hashes(self, store: BlockStore) -> None:
        blocks = {
            _SHA.raw(b"raw sha"): b"raw sha",
            _SHA.node(b"\x81\xa1a\x01"): b"\x81\xa1a\x01",
            _BLAKE.raw(b"raw blake3"): b"raw blake3",
            _BLAKE.node(b"\x90"): b"\x90",
            _SHA.raw(b""): b"",
        }
        for cid, data in blocks.items():
            assert store.put(cid, data)
        for cid, data in blocks.items():
            assert store.get(cid) == data
        assert set(store.keys()) == set(blocks)

    def test_large_block(self, store: BlockStore) -> None:
        cid, data = raw_block(3, 1024 * 1024)
        store.put(cid, data)
        assert store.get(cid) == data
        assert store.size(cid) == len(data)

    def test_put_rejects_bytes_that_do_not_match(self, store: BlockStore) -> None:
        cid, data = raw_block(4)
        with pytest.raises(CorruptBlock, match=cidlib.to_str(cid)):
            store.put(cid, data + b"!")
        assert not store.has(cid)
        assert list(store.keys()) == []

    def test_iteration_yields_multiformats_cids(self, store: BlockStore) -> None:
        blocks = dict(raw_block(i) for i in range(20))
        for cid, data in blocks.items():
            store.put(cid, data)
        listed = list(store)
        assert all(isinstance(c, CID) for c in listed)
        assert {bytes(c) for c in listed} == set(blocks)
        assert all(str(c) == cidlib.to_str(bytes(c)) for c in listed)
        assert len(store) == 20

    def test_delete(self, store: BlockStore) -> None:
        blocks = dict(raw_block(i) for i in range(10))
        with store.writer() as writer:
            for cid, data in blocks.items():
                writer.put(cid, data)
        gone = set(list(blocks)[:4])
        store.delete(gone)
        for cid, data in blocks.items():
            if cid in gone:
                assert not store.has(cid)
                with pytest.raises(BlockNotFound):
                    store.get(cid)
            else:
                assert store.get(cid) == data
        assert set(store.keys()) == set(blocks) - gone
        store.delete(set(blocks))
        assert list(store.keys()) == []
        # A deleted block can be stored again.
        cid, data = next(iter(blocks.items()))
        assert store.put(cid, data) is True
        assert store.get(cid) == data

    # -- writers -------------------------------------------------------------------------------
    def test_writer_blocks_appear_on_commit(self, store: BlockStore) -> None:
        blocks = dict(raw_block(i) for i in range(50))
        writer = store.writer()
        for cid, data in blocks.items():
            assert writer.put(cid, data) is True
        assert not any(store.has(c) for c in blocks)
        writer.commit()
        assert all(store.get(c) == d for c, d in blocks.items())
        assert writer.stats.blocks_written == 50
        assert writer.stats.bytes_written == sum(map(len, blocks.values()))
        assert self.leftovers(store) == []

    def test_writer_abort_discards_everything(self, store: BlockStore) -> None:
        kept, kept_data = raw_block(100)
        store.put(kept, kept_data)
        blocks = dict(raw_block(i) for i in range(50))
        writer = store.writer()
        for cid, data in blocks.items():
            writer.put(cid, data)
        writer.abort()
        assert not any(store.has(c) for c in blocks)
        store.refresh()
        assert set(store.keys()) == {kept}
        assert self.leftovers(store) == []
        with pytest.raises(RepositoryError):
            writer.put(*raw_block(999))

    def test_writer_context_aborts_on_error(self, store: BlockStore) -> None:
        cid, data = raw_block(5)
        with pytest.raises(RuntimeError), store.writer() as writer:
            writer.put(cid, data)
            raise RuntimeError("save failed half-way")
        assert not store.has(cid)
        assert self.leftovers(store) == []

    def test_writer_skips_stored_and_repeated_blocks(self, store: BlockStore) -> None:
        old, old_data = raw_block(6)
        new, new_data = raw_block(7)
        store.put(old, old_data)
        with store.writer() as writer:
            assert writer.put(old, old_data) is False
            assert writer.put(new, new_data) is True
            assert writer.put(new, new_data) is False
        assert writer.stats.blocks_written == 1
        assert writer.stats.blocks_reused == 2
        assert writer.stats.bytes_reused == len(old_data) + len(new_data)
        assert store.get(new) == new_data

    def test_writer_accepts_memoryviews_and_copies_them(self, store: BlockStore) -> None:
        cid, data = raw_block(8, 5000)
        buffer = bytearray(data)
        with store.writer() as writer:
            writer.put(cid, memoryview(buffer))
            buffer[:] = b"\x00" * len(buffer)  # the caller reuses its buffer before commit
        assert store.get(cid) == data

    def test_threads_share_one_writer(self, store: BlockStore) -> None:
        blocks = dict(raw_block(i, 3000) for i in range(400))
        items = list(blocks.items())
        with store.writer() as writer:

            def put(part: list[tuple[bytes, bytes]]) -> None:
                for cid, data in part:
                    writer.put(cid, data)

            threads = [threading.Thread(target=put, args=(items[i::4] + items,)) for i in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        assert writer.stats.blocks_written == 400
        assert all(store.get(c) == d for c, d in items)

    # -- verification --------------------------------------------------------------------------
    def test_corrupt_block_is_detected(self, store: BlockStore) -> None:
        cid, data = raw_block(9, 2000)
        other, other_data = raw_block(10, 2000)
        store.put(cid, data)
        store.put(other, other_data)
        self.corrupt(store, cid)
        name = cidlib.to_str(cid)
        with pytest.raises(CorruptBlock, match=name) as info:
            store.get(cid)
        assert info.value.cid == name
        with pytest.raises(CorruptBlock, match=name):
            store.get_into(cid, memoryview(bytearray(2000)))
        damaged = store.get(cid, verify=False)
        assert len(damaged) == len(data) and damaged != data
        assert store.get(other) == other_data

    def test_corrupt_chunk_fails_a_load_naming_it(self, store: BlockStore) -> None:
        import numpy as np

        array = np.arange(100_000, dtype=np.float64)
        with Repository(store, MemoryRefStore(), chunk_size=64 * 1024) as repo:
            root = repo.save({"w": array, "b": 1})
            chunks = [bytes(c) for c in store if not cidlib.is_node(bytes(c))]
            assert len(chunks) > 1
            victim = chunks[len(chunks) // 2]
            self.corrupt(store, victim)
            with pytest.raises(CorruptBlock, match=cidlib.to_str(victim)):
                repo.load(root)
            assert repo.load(root, path="b") == 1  # the rest of the checkpoint still loads
            damaged = repo.load(root, verify=False)["w"]
            assert damaged.shape == array.shape and not np.array_equal(damaged, array)

    def test_corrupt_node_fails_a_load_naming_it(self, store: BlockStore) -> None:
        with Repository(store, MemoryRefStore()) as repo:
            root = repo.save({"a": [1, 2, 3]})
            tree = cidlib.to_bytes(repo.commit(root).tree)
            self.corrupt(store, tree)
            with pytest.raises(CorruptBlock, match=cidlib.to_str(tree)):
                repo.load(root)

    # -- a repository on top -------------------------------------------------------------------
    def test_repository_round_trip(self, store: BlockStore) -> None:
        import numpy as np

        state: dict[str, Any] = {"w": np.arange(50_000, dtype=np.int32), "s": "x", "t": (1, 2)}
        with Repository(store, MemoryRefStore(), chunk_size=16 * 1024) as repo:
            root = repo.save(state)
            loaded = repo.load(root)
        assert np.array_equal(loaded["w"], state["w"]) and loaded["w"].dtype == np.int32
        assert loaded["s"] == "x" and loaded["t"] == (1, 2)
        assert self.leftovers(store) == []
