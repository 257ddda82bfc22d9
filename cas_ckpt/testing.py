"""Conformance suites that every store implementation must pass (needs pytest).

:class:`BackendTests` checks a :class:`~cas_ckpt.backends.Backend` against its contract;
:class:`PackedStoreTests` runs :class:`BlockStoreTests` and the pack-specific tests over the packed
store on one backend. A new medium subclasses both (see ``tests/test_store.py``).

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

import itertools
import os
import random
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
from multiformats import CID

from cas_ckpt import cid as cidlib
from cas_ckpt.backends.base import Backend, Read
from cas_ckpt.blocks.base import MAX_CHUNK, BlockStore
from cas_ckpt.blocks.compression import CODEC_GROUPED, CODEC_NONE, CODEC_ZSTD
from cas_ckpt.blocks.pack import PACK_MAGIC, PACK_MAGIC_V2
from cas_ckpt.blocks.packed import PackedBlockStore
from cas_ckpt.codec import MAX_NODE_SIZE
from cas_ckpt.errors import BlockNotFound, BlockTooLarge, CorruptBlock, CorruptStore, RepositoryError
from cas_ckpt.refs import MemoryRefStore
from cas_ckpt.repository import Repository

_SHA = cidlib.Hasher("sha2-256")
_BLAKE = cidlib.Hasher("blake3")


def raw_block(i: int, size: int = 100, *, hasher: cidlib.Hasher = _SHA) -> tuple[bytes, bytes]:
    """A raw block (binary CID, bytes) with content that depends on ``i``."""
    seed = i.to_bytes(8, "little")
    data = (seed * (size // 8 + 1))[:size]
    return hasher.raw(data), data


def float_block(i: int, n: int = 4096) -> tuple[bytes, bytes]:
    """A raw block of ``n`` float32 values shaped like trained weights (it compresses grouped)."""
    values = np.random.default_rng(i).normal(0, 0.05, n).astype(np.float32)
    data = values.tobytes()
    return _SHA.raw(data), data


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

    def test_blocks_no_reader_accepts_are_never_stored(self, store: BlockStore) -> None:
        """A chunk over 1 MiB and a node over the node limit (docs/format.md, "Block sizes")."""
        chunk = raw_block(5, MAX_CHUNK + 1)
        node = b"\xc4" + b"\0"  # a node's bytes are not decoded on the way in: any will do
        big = node * ((MAX_NODE_SIZE + 2) // 2)
        for cid, data in (chunk, (_SHA.node(big), big)):
            with pytest.raises(BlockTooLarge, match=cidlib.to_str(cid)):
                store.put(cid, data)
            with pytest.raises(BlockTooLarge), store.writer() as writer:
                writer.put_many([(cid, memoryview(data), None)])
            assert not store.has(cid)
        assert list(store.keys()) == []

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

    def test_put_many_is_put_for_each_block(self, store: BlockStore) -> None:
        blocks = [raw_block(i, 300 + i) for i in range(20, 30)]
        store.put(*blocks[0])
        with store.writer() as writer:
            assert writer.put_many([(c, memoryview(d), None) for c, d in blocks + blocks[3:5]],
                                   keep=True) == 9
        assert (writer.stats.blocks_written, writer.stats.blocks_reused) == (9, 3)
        assert writer.stats.bytes_written == sum(len(d) for _, d in blocks[1:])
        assert all(store.get(c) == d for c, d in blocks)

    def test_a_writer_verifying_what_it_receives_refuses_a_mismatch(self, store: BlockStore) -> None:
        blocks = [raw_block(i, 2000 + i) for i in range(40, 44)]
        (cid, data), (other, _) = blocks[0], blocks[1]
        with store.writer(verify_incoming=True) as writer:
            with pytest.raises(CorruptBlock, match=cidlib.to_str(other)):
                writer.put(other, data)  # bytes that are not the block named
            items = [(c, memoryview(d), None) for c, d in blocks]
            items[2] = (items[2][0], memoryview(bytes(len(blocks[2][1]))), None)
            with pytest.raises(CorruptBlock, match=cidlib.to_str(blocks[2][0])):
                writer.put_many(items)  # nothing of a batch with one damaged block goes in
            assert writer.put(cid, data) is True
        assert [store.has(c) for c, _ in blocks] == [True, False, False, False]
        assert store.get(cid) == data

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


class PackedStoreTests(BlockStoreTests):
    """:class:`BlockStoreTests` for the packed store over one backend, plus what packs add.

    Override ``backend`` to yield a fresh, empty backend, :meth:`reopen` to give a second instance
    of the same medium (as another process would open it), and :meth:`damage` to flip one stored
    byte of an object in place. Everything else is written once here for every medium.
    """

    pack_options: dict[str, Any] = {}

    @pytest.fixture
    def backend(self) -> Iterator[Backend]:
        raise NotImplementedError("override the backend fixture to yield a fresh, empty backend")

    def reopen(self, backend: Backend) -> Backend:
        """Another instance of the medium ``backend`` is on (the same instance where it lives in
        memory)."""
        return backend

    def damage(self, backend: Backend, name: str, offset: int) -> None:
        """Flip one bit of the byte at ``offset`` of object ``name``, keeping its length."""
        raise NotImplementedError

    @pytest.fixture
    def store(self, backend: Backend) -> Iterator[BlockStore]:
        store = PackedBlockStore(backend, **self.pack_options)
        yield store
        store.close()

    def corrupt(self, store: BlockStore, cid: bytes) -> None:
        assert isinstance(store, PackedBlockStore)
        loc = store._copies(cid)[0]
        self.damage(store.backend, loc.pack, loc.offset + loc.length // 2)

    def _second(self, store: PackedBlockStore) -> PackedBlockStore:
        return PackedBlockStore(self.reopen(store.backend), **self.pack_options)

    # -- packing -------------------------------------------------------------------------------
    def test_second_instance_sees_committed_blocks(self, store: PackedBlockStore) -> None:
        second = self._second(store)
        cid, data = raw_block(1)
        store.put(cid, data)
        assert second.get(cid) == data  # a miss lists the packs again
        more = dict(raw_block(i) for i in range(2, 12))
        with store.writer() as writer:
            for c, d in more.items():
                writer.put(c, d)
        second.refresh()
        assert set(second.keys()) == {cid, *more}
        assert set(second.packs()) == set(store.packs())

    def test_one_writer_makes_one_pack_with_blocks_back_to_back(self, store: PackedBlockStore) -> None:
        blocks = dict(raw_block(i, 1000) for i in range(300))
        with store.writer() as writer:
            for c, d in blocks.items():
                writer.put(c, d)
        assert len(store.packs()) == 1 and len(writer.published) == 1
        locations = [store.locate(c) for c in blocks]
        assert all(a[1] + a[2] == b[1] for a, b in itertools.pairwise(locations))

    def test_packs_roll_over_at_the_pack_size(self, backend: Backend) -> None:
        store = PackedBlockStore(backend, pack_size=64 * 1024)
        blocks = dict(raw_block(i, 4096) for i in range(100))
        with store.writer() as writer:
            for c, d in blocks.items():
                writer.put(c, d)
        sizes = [info.size for info in backend.list()]
        assert 6 <= len(sizes) <= 8 and all(size < 80 * 1024 for size in sizes)
        assert all(store.get(c) == d for c, d in blocks.items())

    def test_delete_rewrites_a_pack_with_the_survivors(self, store: PackedBlockStore) -> None:
        blocks = dict(raw_block(i, 10_000) for i in range(20))
        with store.writer() as writer:
            for c, d in blocks.items():
                writer.put(c, d)
        (old,) = store.packs()
        dead = set(list(blocks)[::2])
        removed, freed = store.delete(dead)
        (new,) = store.packs()
        assert new != old and removed == 10 and freed >= 10 * 10_000
        second = self._second(store)
        assert set(second.keys()) == set(blocks) - dead
        assert all(second.get(c) == blocks[c] for c in set(blocks) - dead)

    def test_a_wholly_dead_pack_is_deleted_without_writing(self, store: PackedBlockStore) -> None:
        keep, keep_data = raw_block(1, 5000)
        store.put(keep, keep_data)
        dead = dict(raw_block(i, 5000) for i in range(2, 6))
        with store.writer() as writer:
            for c, d in dead.items():
                writer.put(c, d)
        before = set(store.packs())
        assert store.delete(set(dead))[0] == 4
        assert set(store.packs()) < before  # only a deletion: no new pack
        assert store.get(keep) == keep_data

    # -- damage and copies ---------------------------------------------------------------------
    def test_a_damaged_pack_leaves_the_report_once_it_is_gone(self, store: PackedBlockStore) -> None:
        cid, data = raw_block(1, 3000)
        store.put(cid, data)
        (name,) = store.packs()
        info = next(i for i in store.backend.list() if i.name == name)
        self.damage(store.backend, name, info.size - 1)  # the footer's magic
        second = self._second(store)
        assert name in second.damaged()
        store.backend.delete(name)
        second.refresh()
        assert second.damaged() == {}

    def _two_copies(self, store: PackedBlockStore) -> tuple[bytes, bytes, list[str]]:
        """One block stored in two packs (as two racing writers leave it); the first copy damaged."""
        cid, data = raw_block(7, 4000)
        for i in (1, 2):
            writer = store.writer()
            writer.add_copy(cid, data)
            writer.put(*raw_block(100 + i, 500))  # two different packs
            writer.commit()
        copies = store._copies(cid)
        assert len(copies) == 2
        self.damage(store.backend, copies[0].pack, copies[0].offset + 10)
        return cid, data, [loc.pack for loc in copies]

    def test_a_damaged_copy_never_wins_over_a_good_one(self, store: PackedBlockStore) -> None:
        cid, data, _ = self._two_copies(store)
        assert store.get(cid) == data
        out = bytearray(len(data))
        self._second(store).get_into(cid, memoryview(out))
        assert bytes(out) == data
        damaged = self._second(store).check_copies([cid])
        assert list(damaged) == [cid]  # fsck sees the damaged copy although reads still work

    def test_dropping_a_pack_keeps_its_blocks_readable_from_their_other_copies(
        self, store: PackedBlockStore
    ) -> None:
        cid, data, (first, _) = self._two_copies(store)
        store.backend.delete(first)
        store.refresh()
        assert store.get(cid) == data and store.check_copies([cid]) == {}

    def test_gc_keeps_the_verified_copy(self, store: PackedBlockStore) -> None:
        cid, data, packs = self._two_copies(store)
        dead = {raw_block(101, 500)[0], raw_block(102, 500)[0]}
        store.delete(dead)  # both packs lose a block: merged, each live block verified
        assert not set(packs) & set(store.packs())
        second = self._second(store)
        assert second.get(cid) == data and second.check_copies([cid]) == {}

    def test_an_existing_damaged_pack_of_the_same_name_is_replaced(self, store: PackedBlockStore) -> None:
        blocks = dict(raw_block(i, 3000) for i in range(4))
        with store.writer() as writer:
            for c, d in blocks.items():
                writer.put(c, d)
        (name,) = writer.published
        victim = next(iter(blocks))
        self.corrupt(store, victim)
        again = store.writer()  # the very same pack again (a GC merge can produce one)
        for c, d in blocks.items():
            again.add_copy(c, d)
        again.commit()
        assert again.published == [name]
        second = self._second(store)
        assert second.check_copies(list(blocks)) == {}
        assert all(second.get(c) == d for c, d in blocks.items())

    def test_a_put_over_a_damaged_copy_stores_a_good_one(self, store: PackedBlockStore) -> None:
        cid, data = raw_block(3, 2000)
        store.put(cid, data)
        self.corrupt(store, cid)
        assert store.put(cid, data) is True  # put verifies what it would reuse
        assert store.get(cid) == data
        fresh = self._second(store)
        assert fresh.get(cid) == data

    def test_a_writer_verifying_existing_blocks_repairs_them(self, store: PackedBlockStore) -> None:
        cid, data = raw_block(4, 2000)
        store.put(cid, data)
        self.corrupt(store, cid)
        with store.writer() as plain:
            assert plain.put(cid, data) is False  # a save trusts what it has not read
        with store.writer(verify_existing=True) as checking:
            assert checking.put(cid, data) is True
        assert self._second(store).get(cid) == data

    # -- compression (pack format 2) -------------------------------------------------------------
    def _compressed(self, store: PackedBlockStore) -> dict[bytes, bytes]:
        """Blocks of every codec, written by a compressing writer: grouped floats, zstd'd
        repeats, and random bytes that stay raw."""
        blocks = dict([float_block(1), float_block(2, 3001), raw_block(3, 5000),
                       (lambda d: (_SHA.raw(d), d))(os.urandom(3000))])
        with store.writer(compression="zstd") as writer:
            for i, (c, d) in enumerate(blocks.items()):
                writer.put(c, d, stored=writer.encode(c, d, 4) if i < 2 else None)
        return blocks

    def test_compressed_blocks_read_back_raw_through_every_path(self, store: PackedBlockStore) -> None:
        blocks = self._compressed(store)
        (name, entries), = store.packs().items()
        assert [e.codec for e in entries] == [CODEC_GROUPED, CODEC_GROUPED, CODEC_ZSTD, CODEC_NONE]
        assert store.backend.read(name, 0, len(PACK_MAGIC_V2)) == PACK_MAGIC_V2
        second = self._second(store)
        cids, datas = list(blocks), list(blocks.values())
        for c, d in blocks.items():
            assert second.get(c) == d and second.size(c) == len(d)
            out = bytearray(len(d))
            second.get_into(c, memoryview(out))
            assert out == d
        assert sum(second.stored_size(c) for c in cids) < 0.9 * sum(map(len, datas))
        out = bytearray(sum(map(len, datas)))
        with ThreadPoolExecutor(2) as pool:
            second.get_many_into(cids, [len(d) for d in datas], memoryview(out), pool)
        assert bytes(out) == b"".join(datas)
        assert second.map_blocks(cids[:1]) is None  # mapped loads apply to raw blocks only

    def test_a_writer_that_does_not_compress_writes_version_1_packs(self, store: PackedBlockStore) -> None:
        cid, data = float_block(5)
        store.put(cid, data)
        (name, entries), = store.packs().items()
        assert store.backend.read(name, 0, len(PACK_MAGIC)) == PACK_MAGIC
        assert entries[0].codec == CODEC_NONE and entries[0].length == len(data)

    def test_damage_inside_a_compressed_block_is_detected(self, store: PackedBlockStore) -> None:
        blocks = self._compressed(store)
        victims = list(blocks)[:3]  # grouped, grouped, zstd
        for cid in victims:
            self.corrupt(store, cid)
        second = self._second(store)
        for cid in victims:
            with pytest.raises(CorruptBlock):
                second.get(cid)
        assert set(second.check_copies(list(blocks))) == set(victims)
        out = memoryview(bytearray(sum(map(len, blocks.values()))))
        with ThreadPoolExecutor(2) as pool, pytest.raises(CorruptBlock):
            second.get_many_into(list(blocks), [len(d) for d in blocks.values()], out, pool)

    def test_gc_moves_compressed_copies_as_they_are(self, store: PackedBlockStore) -> None:
        blocks = self._compressed(store)
        before = {e.cid: e for entries in store.packs().values() for e in entries}
        dead = list(blocks)[1]
        store.delete({dead})
        ((name, entries),) = store.packs().items()
        assert store.backend.read(name, 0, len(PACK_MAGIC_V2)) == PACK_MAGIC_V2
        assert {e.cid: (e.codec, e.length, e.size) for e in entries} == {
            c: (e.codec, e.length, e.size) for c, e in before.items() if c != dead}
        second = self._second(store)
        assert all(second.get(c) == d for c, d in blocks.items() if c != dead)


    # -- index files ---------------------------------------------------------------------------
    def _batches(self, store: PackedBlockStore, first: int, count: int) -> dict[bytes, bytes]:
        """``count`` batches of 3 blocks, each its own pack."""
        blocks: dict[bytes, bytes] = {}
        for b in range(first, first + count):
            with store.writer() as writer:
                for i in range(3):
                    cid, data = raw_block(b * 10 + i, 700)
                    writer.put(cid, data)
                    blocks[cid] = data
        return blocks

    def _index_backend(self, store: PackedBlockStore) -> Backend:
        assert store._catalog is not None
        return store._catalog.backend

    def _rewrite(self, backend: Backend, name: str, change: Callable[[bytearray], bytes]) -> None:
        """Put ``change(data)`` in place of object ``name`` (damage planted through the medium)."""
        size = next(info.size for info in backend.list() if info.name == name)
        data = backend.read(name, 0, size)
        assert data is not None
        with backend.create() as sink:
            sink.write(change(bytearray(data)))
            sink.replace(name)

    def test_a_reopened_store_reads_the_snapshot_and_only_what_came_after(
        self, store: PackedBlockStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        before = self._batches(store, 0, 6)
        snapshot = store.consolidate()
        assert snapshot is not None and store.layout().uncovered == 0
        after = self._batches(store, 6, 2)
        assert store.layout().uncovered == 2  # two packs, or two journals
        described: list[str] = []
        original = PackedBlockStore._read_indexes

        def counting(self: PackedBlockStore, infos: list[Any]) -> Any:
            described.extend(info.name for info in infos)
            return original(self, infos)

        monkeypatch.setattr(PackedBlockStore, "_read_indexes", counting)
        second = self._second(store)
        # Where packs are listed, the two after the snapshot are described by their own indexes;
        # elsewhere the journal written with them describes them.
        assert len(described) == (0 if store.writes_journals else 2)
        assert all(second.get(c) == d for c, d in {**before, **after}.items())
        assert second.layout().snapshot == snapshot and second.packs() == store.packs()

    def test_consolidating_again_supersedes_the_older_index_files(self, store: PackedBlockStore) -> None:
        self._batches(store, 0, 3)
        first = store.consolidate()
        self._batches(store, 3, 2)
        second = store.consolidate()
        assert first is not None and second is not None and second > first
        assert [info.name for info in self._index_backend(store).list()] == [second]
        reopened = self._second(store)
        assert reopened.layout().snapshot == second and reopened.layout().uncovered == 0

    def test_a_snapshot_keeps_every_copy_and_forgets_deleted_packs(self, store: PackedBlockStore) -> None:
        cid, data, (first, second_pack) = self._two_copies(store)  # the first copy is damaged
        store.consolidate()
        reopened = self._second(store)
        assert [loc.pack for loc in reopened._copies(cid)] == [first, second_pack]
        assert reopened.get(cid) == data  # the damaged copy is tried, marked, the other read
        store.delete({raw_block(102, 500)[0]})  # GC: the second pack is rewritten
        again = self._second(store)
        assert second_pack not in again.packs()
        assert again.get(cid) == data

    @pytest.mark.parametrize("harm", ["flip", "truncate", "garbage"])
    def test_a_damaged_snapshot_is_detected_and_rebuilt_from_the_packs(
        self, store: PackedBlockStore, harm: str
    ) -> None:
        blocks = self._batches(store, 0, 4)
        name = store.consolidate()
        assert name is not None
        changes: dict[str, Callable[[bytearray], bytes]] = {
            "flip": lambda data: bytes(data[:50]) + bytes([data[50] ^ 1]) + bytes(data[51:]),
            "truncate": lambda data: bytes(data[: len(data) // 2]),
            "garbage": lambda data: b"\0" * len(data),
        }
        self._rewrite(self._index_backend(store), name, changes[harm])
        reopened = self._second(store)
        assert name in reopened.corrupt_indexes  # detected...
        assert all(reopened.get(c) == d for c, d in blocks.items())  # ...nothing lost
        assert any(name in where for where in reopened.damaged())
        rebuilt = reopened.consolidate()  # upkeep writes it again from the packs
        assert rebuilt != name and reopened.corrupt_indexes == {}
        assert [info.name for info in self._index_backend(store).list()] == [rebuilt]
        clean = self._second(store)
        assert clean.corrupt_indexes == {} and clean.layout().snapshot == rebuilt
        assert all(clean.get(c) == d for c, d in blocks.items())

    def test_a_store_that_listed_a_superseded_index_file_reads_the_newer_one(
        self, store: PackedBlockStore
    ) -> None:
        blocks = self._batches(store, 0, 3)
        store.consolidate()
        reader = self._second(store)
        blocks.update(self._batches(store, 3, 2))
        newest = store.consolidate()  # deletes the snapshot the reader took in
        blocks.update(self._batches(store, 5, 1))
        reader.refresh()
        assert all(reader.get(c) == d for c, d in blocks.items())
        if store.writes_journals:
            assert reader.layout().snapshot == newest


class BackendTests:
    """The contract of :class:`~cas_ckpt.backends.Backend`, for any medium.

    Override ``backend`` to yield a fresh, empty backend.
    """

    @pytest.fixture
    def backend(self) -> Iterator[Backend]:
        raise NotImplementedError("override the backend fixture to yield a fresh, empty backend")

    def _object(self, backend: Backend, name: str, data: bytes) -> None:
        sink = backend.create()
        sink.write(data[: len(data) // 2])
        sink.write(memoryview(data)[len(data) // 2 :])
        assert sink.publish(name) is True

    def test_empty(self, backend: Backend) -> None:
        assert backend.list() == []
        assert backend.read("absent.pack", 0, 1) is None
        assert backend.read_into("absent.pack", 0, memoryview(bytearray(1))) is False

    def test_publish_makes_the_whole_object_visible(self, backend: Backend) -> None:
        data = bytes(range(256)) * 40
        sink = backend.create()
        sink.write(data)
        assert backend.list() == []  # nothing before publish
        assert sink.publish("a.pack") is True
        (info,) = backend.list()
        assert (info.name, info.size) == ("a.pack", len(data)) and info.age >= -5
        assert backend.read("a.pack", 0, len(data)) == data
        out = bytearray(100)
        assert backend.read_into("a.pack", 1000, memoryview(out)) is True
        assert bytes(out) == data[1000:1100]

    def test_set_aside_leaves_readable_objects_alone(self, backend: Backend) -> None:
        """Only what is no readable object is set aside: an object stays, an absent name is None."""
        self._object(backend, "a.pack", b"whole")
        assert backend.set_aside("a.pack") is None
        assert backend.set_aside("absent.pack") is None
        assert [info.name for info in backend.list()] == ["a.pack"]
        assert backend.read("a.pack", 0, 5) == b"whole"

    def test_publish_never_replaces_an_existing_object(self, backend: Backend) -> None:
        self._object(backend, "a.pack", b"first")
        sink = backend.create()
        sink.write(b"other")
        assert sink.publish("a.pack") is False
        assert backend.read("a.pack", 0, 5) == b"first"
        sink.replace("a.pack")  # the explicit repair does
        assert backend.read("a.pack", 0, 5) == b"other"
        assert [i.name for i in backend.list()] == ["a.pack"]

    def test_kept_writes_land_in_write_order(self, backend: Backend) -> None:
        """Kept writes may be held by reference while later ones are made; the published
        object is the writes in the order they were made."""
        rng = random.Random(7)
        pieces = [bytes([i]) * rng.choice((3, 5000, 300_000, 1 << 20)) for i in range(40)]
        sink = backend.create()
        for i, piece in enumerate(pieces):
            sink.write(memoryview(piece) if i % 3 else piece, keep=i % 2 == 0)
        assert sink.publish("kept.pack") is True
        whole = b"".join(pieces)
        assert backend.read("kept.pack", 0, len(whole)) == whole
        assert [(i.name, i.size) for i in backend.list()] == [("kept.pack", len(whole))]

    def test_buffers_are_the_callers_again_once_written_or_settled(self, backend: Backend) -> None:
        """A buffer written without ``keep`` may be reused when ``write`` returns, a kept one
        when ``settle`` returns: the object holds the bytes as they were then."""
        rng = random.Random(11)
        sizes = (1, 700, 9000, 200_000, 262_143, 262_144, 600_000)
        expected, kept = [], []
        sink = backend.create()
        for i in range(123):  # the last few small and kept: a sink that gathers holds them
            buffer = bytearray(bytes([i % 251]) * (rng.choice(sizes) if i < 120 else 700))
            expected.append(bytes(buffer))
            keep = rng.random() < 0.7 or i >= 120
            sink.write(memoryview(buffer), keep=keep)
            if keep:
                kept.append(buffer)
            else:
                buffer[:] = b"\xff" * len(buffer)  # reused at once
        sink.settle()
        for buffer in kept:
            buffer[:] = b"\xee" * len(buffer)
        expected.append(b"tail")
        sink.write(b"tail")
        assert sink.publish("reused.pack") is True
        whole = b"".join(expected)
        assert backend.read("reused.pack", 0, len(whole)) == whole

    def test_list_changes_names_everything_and_describes_the_unknown(self, backend: Backend) -> None:
        for name in ("a.pack", "b.pack", "c.pack"):
            self._object(backend, name, name.encode() * 10)
        names, new = backend.list_changes({"a.pack", "gone.pack"})
        assert names == {"a.pack", "b.pack", "c.pack"}
        listed = {info.name: info.size for info in backend.list()}
        assert sorted((info.name, info.size) for info in new) == [
            ("b.pack", listed["b.pack"]), ("c.pack", listed["c.pack"])]
        backend.delete("b.pack")
        assert backend.list_changes({"a.pack", "b.pack", "c.pack"}) == ({"a.pack", "c.pack"}, [])

    def test_abort_leaves_nothing(self, backend: Backend) -> None:
        sink = backend.create()
        sink.write(b"x" * 1000)
        sink.abort()
        sink.abort()  # idempotent
        assert backend.list() == []
        assert backend.clean_temp(0.0) == 0

    def test_a_read_past_the_end_is_damage(self, backend: Backend) -> None:
        self._object(backend, "a.pack", b"0123456789")
        with pytest.raises(CorruptStore, match=r"a\.pack"):
            backend.read_into("a.pack", 5, memoryview(bytearray(10)))
        results = backend.read_many([Read("a.pack", 0, memoryview(bytearray(4)), [0]),
                                     Read("a.pack", 8, memoryview(bytearray(4)), [8]),
                                     Read("gone.pack", 0, memoryview(bytearray(4)), [0])])
        assert results[0] is True and isinstance(results[1], CorruptStore) and results[2] is False

    def test_delete_is_idempotent(self, backend: Backend) -> None:
        self._object(backend, "a.pack", b"abc")
        self._object(backend, "b.pack", b"def")
        backend.delete("a.pack")
        backend.delete("a.pack")
        assert [i.name for i in backend.list()] == ["b.pack"]
        assert backend.read("a.pack", 0, 3) is None

    def test_a_sibling_keeps_its_objects_apart(self, backend: Backend) -> None:
        """Objects of another kind (the commit graph's layers) live beside the packs, never
        among them, and every sibling of one directory sees the same objects."""
        sibling = backend.sibling("commit-graph", ".graph")
        if sibling is None:
            pytest.skip("this medium keeps packs only")
        self._object(backend, "a.pack", b"pack bytes")
        self._object(sibling, "b.graph", b"graph bytes")
        assert [i.name for i in backend.list()] == ["a.pack"]
        again = backend.sibling("commit-graph", ".graph")
        assert again is not None
        assert [(i.name, i.size) for i in again.list()] == [("b.graph", 11)]
        assert again.read("b.graph", 0, 11) == b"graph bytes" and sibling.read("a.pack", 0, 4) is None
        other = backend.sibling("elsewhere", ".graph")
        assert other is not None and other.list() == []
        again.delete("b.graph")
        assert sibling.list() == [] and [i.name for i in backend.list()] == ["a.pack"]
        sibling.close()
        again.close()
        other.close()
        assert backend.read("a.pack", 0, 4) == b"pack"  # closing a sibling leaves this one open

    def test_a_sibling_folder_holds_objects_of_its_own(self, backend: Backend) -> None:
        index = backend.sibling("index", ".idx")
        if index is None:
            pytest.skip("this medium keeps no second folder")
        self._object(backend, "a.pack", b"pack")
        for name in ("j-2.idx", "j-1.idx", "s-1.idx"):
            self._object(index, name, name.encode())
        assert [i.name for i in backend.list()] == ["a.pack"]
        assert sorted(i.name for i in index.list()) == ["j-1.idx", "j-2.idx", "s-1.idx"]
        assert [i.name for i in index.list_after("j-1.idx")] == ["j-2.idx", "s-1.idx"]
        assert [i.name for i in index.list_after("k")] == ["s-1.idx"]
        assert index.read("s-1.idx", 0, 7) == b"s-1.idx" and backend.read("s-1.idx", 0, 1) is None
        index.delete("j-1.idx")
        assert [i.name for i in index.list()] == ["j-2.idx", "s-1.idx"]

    def test_a_live_sink_survives_temp_cleaning(self, backend: Backend) -> None:
        sink = backend.create()
        sink.write(b"in progress")
        backend.clean_temp(0.0)
        assert sink.publish("a.pack") is True
        assert backend.read("a.pack", 0, 11) == b"in progress"
