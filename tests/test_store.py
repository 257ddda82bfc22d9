"""Block stores: the shared conformance suite on every store, and LocalStore's packing."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import cas_ckpt
from cas_ckpt import cid as cidlib
from cas_ckpt.blocks.base import BlockStore
from cas_ckpt.testing import BlockStoreTests, raw_block


class TestMemoryStore(BlockStoreTests):
    @pytest.fixture
    def store(self) -> Iterator[BlockStore]:
        store = cas_ckpt.blocks.MemoryStore()
        yield store
        store.close()

    def corrupt(self, store: BlockStore, cid: bytes) -> None:
        assert isinstance(store, cas_ckpt.blocks.MemoryStore)
        data = bytearray(store._blocks[cid])
        data[len(data) // 2] ^= 0x01
        store._blocks[cid] = bytes(data)


def flip_byte_in_pack(store: cas_ckpt.blocks.LocalStore, cid: bytes) -> None:
    pack, offset, length = store.locate(cid)
    position = offset + length // 2
    with open(pack, "r+b") as f:
        f.seek(position)
        byte = f.read(1)
        f.seek(position)
        f.write(bytes([byte[0] ^ 0x01]))


class TestLocalStore(BlockStoreTests):
    @pytest.fixture
    def store(self, tmp_path: Path) -> Iterator[BlockStore]:
        store = cas_ckpt.blocks.LocalStore(tmp_path / "store")
        yield store
        store.close()

    def corrupt(self, store: BlockStore, cid: bytes) -> None:
        assert isinstance(store, cas_ckpt.blocks.LocalStore)
        flip_byte_in_pack(store, cid)

    def leftovers(self, store: BlockStore) -> list[str]:
        assert isinstance(store, cas_ckpt.blocks.LocalStore)
        return sorted(os.listdir(store.tmp_dir))

    # -- LocalStore only -----------------------------------------------------------------------
    def test_second_instance_sees_committed_blocks(self, tmp_path: Path) -> None:
        first = cas_ckpt.blocks.LocalStore(tmp_path / "store")
        second = cas_ckpt.blocks.LocalStore(tmp_path / "store")
        try:
            cid, data = raw_block(1)
            first.put(cid, data)
            assert second.get(cid) == data  # a miss re-reads the pack directory
            more = dict(raw_block(i) for i in range(2, 12))
            with first.writer() as writer:
                for c, d in more.items():
                    writer.put(c, d)
            second.refresh()
            assert all(second.has(c) for c in more)
            assert set(second.keys()) == {cid, *more}
            # And a third, opened afterwards, reads everything from the packs' own indexes.
            third = cas_ckpt.blocks.LocalStore(tmp_path / "store")
            assert all(third.get(c) == d for c, d in more.items())
            third.close()
        finally:
            first.close()
            second.close()

    def test_blocks_survive_reopening(self, tmp_path: Path) -> None:
        blocks = dict(raw_block(i, 700) for i in range(100))
        store = cas_ckpt.blocks.LocalStore(tmp_path / "store")
        with store.writer() as writer:
            for c, d in blocks.items():
                writer.put(c, d)
        store.close()
        reopened = cas_ckpt.blocks.LocalStore(tmp_path / "store")
        assert {c: reopened.get(c) for c in blocks} == blocks
        reopened.close()

    def test_one_writer_makes_one_pack(self, store: BlockStore) -> None:
        assert isinstance(store, cas_ckpt.blocks.LocalStore)
        blocks = dict(raw_block(i, 1000) for i in range(1000))
        with store.writer() as writer:
            for c, d in blocks.items():
                writer.put(c, d)
        assert len(os.listdir(store.pack_dir)) == 1
        assert len(store.packs()) == 1
        # Blocks written in order lie in order, back to back, in the pack.
        locations = [store.locate(c) for c in blocks]
        assert [loc[1] for loc in locations] == sorted(loc[1] for loc in locations)
        assert all(a[1] + a[2] == b[1] for a, b in itertools.pairwise(locations))

    def test_packs_roll_over_at_the_pack_size(self, tmp_path: Path) -> None:
        store = cas_ckpt.blocks.LocalStore(tmp_path / "store", pack_size=64 * 1024)
        try:
            blocks = dict(raw_block(i, 4096) for i in range(100))
            with store.writer() as writer:
                for c, d in blocks.items():
                    writer.put(c, d)
            packs = os.listdir(store.pack_dir)
            assert 6 <= len(packs) <= 8  # 400 kB in packs of at most 64 kB
            assert all(os.path.getsize(store.pack_dir / p) < 80 * 1024 for p in packs)
            assert all(store.get(c) == d for c, d in blocks.items())
        finally:
            store.close()

    def test_delete_rewrites_a_pack_with_the_survivors(self, store: BlockStore) -> None:
        assert isinstance(store, cas_ckpt.blocks.LocalStore)
        blocks = dict(raw_block(i, 10_000) for i in range(20))
        with store.writer() as writer:
            for c, d in blocks.items():
                writer.put(c, d)
        (old_pack,) = os.listdir(store.pack_dir)
        dead = set(list(blocks)[::2])
        store.delete(dead)
        (new_pack,) = os.listdir(store.pack_dir)
        assert new_pack != old_pack
        assert os.path.getsize(store.pack_dir / new_pack) < 11 * 10_000
        reopened = cas_ckpt.blocks.LocalStore(store.root)
        assert set(reopened.keys()) == set(blocks) - dead
        assert all(reopened.get(c) == blocks[c] for c in set(blocks) - dead)
        reopened.close()

    def test_read_only_store_refuses_writes(self, tmp_path: Path) -> None:
        cas_ckpt.blocks.LocalStore(tmp_path / "store").close()
        store = cas_ckpt.blocks.LocalStore(tmp_path / "store", read_only=True)
        with pytest.raises(cas_ckpt.errors.RepositoryError, match="read-only"):
            store.writer()
        store.close()

    def test_verify_false_store_returns_damaged_bytes(self, tmp_path: Path) -> None:
        store = cas_ckpt.blocks.LocalStore(tmp_path / "store", verify=False)
        try:
            cid, data = raw_block(3, 500)
            store.put(cid, data)
            flip_byte_in_pack(store, cid)
            assert store.get(cid) != data
            with pytest.raises(cas_ckpt.errors.CorruptBlock):
                store.get(cid, verify=True)
        finally:
            store.close()


# -- a repository on the local store -------------------------------------------------------------
def test_files_grow_far_slower_than_blocks(tmp_path: Path) -> None:
    with cas_ckpt.open(tmp_path / "repo", chunk_size=4096) as repo:
        rng = np.random.default_rng(0)
        for step in range(5):
            repo.save({"w": rng.random(100_000), "step": step}, step=step)  # ~200 chunks each
        blocks = len(list(repo.blocks))
    files = [p for p in (tmp_path / "repo").rglob("*") if p.is_file()]
    packs = list((tmp_path / "repo" / "packs").iterdir())
    assert blocks > 900  # 196 chunks, a tree and a commit per save
    assert len(packs) == 5  # one per save
    assert len(files) < 20  # packs, config, one ref, one reflog, lock files
    assert not list((tmp_path / "repo" / "tmp").iterdir())


def test_corrupted_block_in_a_repository_on_disk(tmp_path: Path) -> None:
    with cas_ckpt.open(tmp_path / "repo", chunk_size=4096) as repo:
        array = np.arange(20_000, dtype=np.float32)
        root = repo.save({"model": {"w": array}, "step": 3})
        store = repo.blocks
        assert isinstance(store, cas_ckpt.blocks.LocalStore)
        chunk = next(c for c in list(store.keys()) if not cidlib.is_node(c))
        flip_byte_in_pack(store, chunk)
        with pytest.raises(cas_ckpt.errors.CorruptBlock, match=cidlib.to_str(chunk)):
            repo.load(root)
        assert repo.load(root, path="step") == 3
        loaded = repo.load(root, verify=False)["model"]["w"]
        assert (loaded != array).sum() == 1
    # The same from a fresh process-like reopen, and with verification switched off there.
    with (
        cas_ckpt.open(tmp_path / "repo") as repo,
        pytest.raises(cas_ckpt.errors.CorruptBlock, match=cidlib.to_str(chunk)),
    ):
        repo.load(root, path="model.w")
    with cas_ckpt.open(tmp_path / "repo", verify=False) as repo:
        assert (repo.load(root, path="model.w") != array).sum() == 1
