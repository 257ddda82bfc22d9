"""Block stores and backends: the conformance suites on every medium, and what is local-only."""

from __future__ import annotations

import itertools
import os
import stat
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from collections.abc import Set as AbstractSet
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from helpers import flip_byte, plant
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cas_ckpt
from cas_ckpt import _fs
from cas_ckpt import cid as cidlib
from cas_ckpt.backends import Backend, LocalBackend, MemoryBackend
from cas_ckpt.backends import local as local_backend
from cas_ckpt.backends.base import ObjectInfo
from cas_ckpt.backends.local import GATHER_BYTES, MAPPED_READ, RELEASE_BATCH, SMALL_WRITE
from cas_ckpt.blocks import LocalStore, MemoryStore, PackedBlockStore
from cas_ckpt.errors import CorruptBlock, CorruptStore
from cas_ckpt.testing import BackendTests, PackedStoreTests, raw_block


def flip_byte_in_pack(store: PackedBlockStore, cid: bytes) -> None:
    pack, offset, length = store.locate(cid)
    flip_byte(pack, offset + length // 2)


def damage_memory(backend: Backend, name: str, offset: int) -> None:
    assert isinstance(backend, MemoryBackend)
    data, created = backend.objects[name]
    changed = bytearray(data)
    changed[offset] ^= 0x01
    backend.objects[name] = (bytes(changed), created)


class TestMemoryBackend(BackendTests):
    @pytest.fixture
    def backend(self) -> Iterator[Backend]:
        yield MemoryBackend()


class TestLocalBackend(BackendTests):
    @pytest.fixture
    def backend(self, tmp_path: Path) -> Iterator[Backend]:
        backend = LocalBackend(tmp_path / "repo")
        yield backend
        backend.close()

    @pytest.mark.parametrize("kind", ["directory", "fifo", "dangling-link"])
    def test_set_aside_moves_what_is_no_file(self, backend: Backend, kind: str) -> None:
        """A directory (with what it holds), a FIFO or a link under an object's name is renamed
        beside it, out of every listing; the name is free for a repair to publish."""
        assert isinstance(backend, LocalBackend)
        path = backend.pack_dir / "a.pack"
        plant(path, kind)
        aside = backend.set_aside("a.pack")
        assert aside is not None and Path(aside).parent == backend.pack_dir
        assert Path(aside).name.startswith("a.pack.damaged-") and os.path.lexists(aside)
        assert not os.path.lexists(path) and backend.list() == []
        if kind == "directory":
            assert (Path(aside) / "kept").read_text() == "not cas_ckpt's\n"
        self._object(backend, "a.pack", b"repaired")
        assert backend.read("a.pack", 0, 8) == b"repaired"

    def test_listing_sees_a_pack_replaced_under_its_name(self, backend: Backend) -> None:
        """Sizes and ages are looked up once per file: a new file under a listed name (a repair)
        is a new inode, looked up again."""
        assert isinstance(backend, LocalBackend)
        sink = backend.create()
        sink.write(b"x" * 100)
        assert sink.publish("a.pack")
        assert [(i.name, i.size) for i in backend.list()] == [("a.pack", 100)]
        other = backend.tmp_dir / "b.tmp"
        other.write_bytes(b"y" * 40)
        os.replace(other, backend.pack_dir / "a.pack")
        assert [(i.name, i.size) for i in backend.list()] == [("a.pack", 40)]
        (backend.pack_dir / "a.pack").unlink()
        assert backend.list() == []

    @given(offset=st.integers(0, 3 * MAPPED_READ), size=st.integers(1, 3 * MAPPED_READ))
    @settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    def test_reads_copy_out_of_the_mapping_or_read_the_rest(
        self, backend: Backend, offset: int, size: int
    ) -> None:
        """A read of a chunk's size copies out of the object's mapping; a smaller one is a
        pread; either gives the bytes there, and one past the end is refused as truncated."""
        assert isinstance(backend, LocalBackend)
        data = np.random.default_rng(size).integers(0, 256, 4 * MAPPED_READ, np.uint8).tobytes()
        name = f"{offset}-{size}.pack"
        sink = backend.create()
        sink.write(data)
        assert sink.publish(name)
        backend.forget(name)
        out = bytearray(size)
        if offset + size > len(data):
            with pytest.raises(CorruptStore, match="truncated"):
                backend.read_into(name, offset, memoryview(out))
        else:
            assert backend.read_into(name, offset, memoryview(out))
            assert out == data[offset : offset + size]
        assert (name in backend._maps) == (size >= MAPPED_READ)

    def test_pages_copied_out_of_a_mapping_do_not_stay_resident(self, backend: Backend) -> None:
        """Reading a 96 MiB pack in 1 MiB pieces leaves at most RELEASE_BATCH of its pages mapped
        (released in batches), and none once the backend is closed: a load's resident size is
        what it loads, not twice that."""
        assert isinstance(backend, LocalBackend)
        size, piece = 96 << 20, 1 << 20
        sink = backend.create()
        sink.write(np.random.default_rng(0).integers(0, 256, size, np.uint8).tobytes())
        assert sink.publish("big.pack")
        out = memoryview(bytearray(piece))
        before = _rss_file()
        mapped_peak = 0
        for offset in range(0, size, piece):
            assert backend.read_into("big.pack", offset, out)
            mapped_peak = max(mapped_peak, _rss_file() - before)
        assert mapped_peak <= RELEASE_BATCH + 2 * piece, f"{mapped_peak >> 20} MiB of the pack stayed mapped"
        backend.close()
        assert _rss_file() - before <= piece

    def test_a_pack_too_large_to_map_is_read(self, tmp_path: Path) -> None:
        """Where the address space cannot take a pack's mapping (``RLIMIT_AS``), its chunks are
        read with pread instead of failing the load."""
        root = tmp_path / "big"
        LocalBackend(root).close()
        with open(root / "packs" / "big.pack", "wb") as f:  # sparse: 1 GiB, more than the limit
            f.truncate(1 << 30)
            f.seek(1 << 20)
            f.write(b"\x07" * (1 << 20))
        script = textwrap.dedent(f"""
            import resource
            from cas_ckpt.backends import LocalBackend
            backend = LocalBackend({str(root)!r}, read_only=True)
            out = memoryview(bytearray(1 << 20))
            with open("/proc/self/status") as f:
                size = next(int(line.split()[1]) for line in f if line.startswith("VmSize:")) * 1024
            resource.setrlimit(resource.RLIMIT_AS, (size + (64 << 20), resource.RLIM_INFINITY))
            assert backend.map("big.pack") is None
            assert backend.read_into("big.pack", 1 << 20, out)
            assert bytes(out) == b"\x07" * (1 << 20)
            print("ok")
        """)
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr

    def test_a_sink_left_by_a_dead_writer_is_cleaned(self, backend: Backend) -> None:
        assert isinstance(backend, LocalBackend)
        (backend.tmp_dir / "0123.pack.tmp").write_bytes(b"half a pack")  # nobody holds its flock
        assert backend.clean_temp(0.0) == 1
        assert list(backend.tmp_dir.iterdir()) == []
        staged = [backend.tmp_dir / f"{n}.pack.tmp.new" for n in ("old", "young")]
        for path in staged:  # a writer died between creating and locking its temp file
            path.write_bytes(b"")
        hour_ago = os.stat(staged[1]).st_mtime - local_backend.STAGING_AGE - 1
        os.utime(staged[0], (hour_ago, hour_ago))
        assert backend.clean_temp(0.0) == 1 and list(backend.tmp_dir.iterdir()) == [staged[1]]

    @pytest.mark.parametrize("moment", ["open", "link", "replace"])
    def test_a_sink_is_never_cleaned_from_under_its_writer(
        self, backend: Backend, moment: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """GC's temp cleaning runs right after the temp file is created (before its lock could
        be taken), and right before it is linked or renamed into place (after it is sealed): a
        live writer's file is never taken. Both moments lost it once (docs/reliability.md, 42)."""
        assert isinstance(backend, LocalBackend)
        removed: list[int] = []
        if moment == "open":
            opened = _fs.open_private

            def open_then_clean(path: Path, flags: int, mode: int = 0o777) -> int:
                fd = opened(path, flags, mode)
                removed.append(backend.clean_temp(0.0))
                return fd

            monkeypatch.setattr(local_backend._fs, "open_private", open_then_clean)
        else:
            name = "link" if moment == "link" else "replace"
            call = getattr(os, name)

            def clean_then(*args: object) -> None:
                removed.append(backend.clean_temp(0.0))
                call(*args)

            monkeypatch.setattr(local_backend.os, name, clean_then)
        if moment == "replace":
            first = backend.create()
            first.write(b"old copy")
            assert first.publish("a.pack") is True
        sink = backend.create()
        sink.write(b"the pack")
        if moment == "replace":
            sink.replace("a.pack")
        else:
            assert sink.publish("a.pack") is True
        assert removed and set(removed) == {0}
        assert backend.read("a.pack", 0, 8) == b"the pack"
        assert list(backend.tmp_dir.iterdir()) == []


def _rss_file() -> int:
    """Resident bytes of file mappings in this process (``RssFile``, Linux)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssFile:")) * 1024


WRITES = st.lists(
    st.tuples(
        st.one_of(st.integers(0, 2000), st.sampled_from([SMALL_WRITE - 1, SMALL_WRITE, 700_000])),
        st.booleans(),  # kept
    ),
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(writes=WRITES, settle_after=st.integers(0, 40))
def test_a_local_sink_holds_every_write_in_order(writes: list[tuple[int, bool]], settle_after: int) -> None:
    """Whatever the mix of gathered and direct, kept and copied writes, the pack is the writes in
    order, each as it was when its buffer became the caller's again (write, or settle if kept)."""
    with tempfile.TemporaryDirectory() as root:
        backend = LocalBackend(root)
        sink = backend.create()
        expected, kept = [], []
        for i, (size, keep) in enumerate(writes):
            if i == settle_after:
                sink.settle()
                for buffer in kept:
                    buffer[:] = b"\xee" * len(buffer)
                kept = []
            buffer = bytearray(os.urandom(size))
            expected.append(bytes(buffer))
            sink.write(buffer, keep=keep)
            if keep:
                kept.append(buffer)
            else:
                buffer[:] = b"\xff" * size
        assert sink.publish("x.pack")
        whole = b"".join(expected)
        assert (backend.pack_dir / "x.pack").read_bytes() == whole
        backend.close()


def test_more_gathered_writes_than_one_call_takes(tmp_path: Path) -> None:
    """Thousands of tiny writes under ``GATHER_BYTES`` still go out in calls the kernel takes."""
    backend = LocalBackend(tmp_path / "repo")
    sink = backend.create()
    pieces = [i.to_bytes(4, "big") for i in range(5000)]
    assert sum(map(len, pieces)) < GATHER_BYTES
    for piece in pieces:
        sink.write(piece, keep=True)
    assert sink.publish("many.pack")
    assert (backend.pack_dir / "many.pack").read_bytes() == b"".join(pieces)
    backend.close()


def test_a_short_write_is_resumed_and_a_stopped_one_raises(tmp_path: Path) -> None:
    """``pwritev_all`` goes on after a short write and raises when the file can grow no more
    (here the file size limit: the kernel writes up to it, then refuses)."""
    script = textwrap.dedent(f"""
        import errno, os, resource, signal
        from cas_ckpt import _fs
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (10_000, 10_000))
        fd = os.open({str(tmp_path / "f")!r}, os.O_WRONLY | os.O_CREAT, 0o644)
        pieces = [bytes([i]) * 3000 for i in range(5)]
        try:
            _fs.pwritev_all(fd, pieces, 0)
        except OSError as exc:
            assert exc.errno == errno.EFBIG, exc
            print("refused at", os.fstat(fd).st_size)
        assert _fs.pwritev_all(fd, pieces[:2], 1000) == 6000  # within the limit: whole
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "refused at 10000"
    data = (tmp_path / "f").read_bytes()
    assert data == b"\x00" * 4000 + b"\x01" * 3000 + b"\x02" * 2000 + b"\x03" * 1000


def test_short_writes_are_resumed_where_they_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kernel may take part of a ``pwritev`` (a signal, a full queue): the rest follows."""
    real = os.pwritev

    def short(fd: int, views: list[memoryview], offset: int) -> int:
        return real(fd, [views[0][:777]], offset)  # never more than 777 bytes of the first piece

    monkeypatch.setattr(os, "pwritev", short)
    pieces = [bytes([i]) * size for i, size in enumerate((1, 5000, 0, 777, 2000))]
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        assert _fs.pwritev_all(fd, pieces, 10) == 7778
    finally:
        os.close(fd)
    assert (tmp_path / "f").read_bytes() == b"\x00" * 10 + b"".join(pieces)


class TestMemoryStore(PackedStoreTests):
    @pytest.fixture
    def backend(self) -> Iterator[Backend]:
        yield MemoryBackend()

    def damage(self, backend: Backend, name: str, offset: int) -> None:
        damage_memory(backend, name, offset)


class TestLocalStore(PackedStoreTests):
    @pytest.fixture
    def backend(self, tmp_path: Path) -> Iterator[Backend]:
        backend = LocalBackend(tmp_path / "store")
        yield backend
        backend.close()

    def reopen(self, backend: Backend) -> Backend:
        assert isinstance(backend, LocalBackend)
        return LocalBackend(backend.root)

    def damage(self, backend: Backend, name: str, offset: int) -> None:
        assert isinstance(backend, LocalBackend)
        flip_byte(backend.pack_dir / name, offset)

    def leftovers(self, store: cas_ckpt.blocks.BlockStore) -> list[str]:
        assert isinstance(store, PackedBlockStore) and isinstance(store.backend, LocalBackend)
        return sorted(os.listdir(store.backend.tmp_dir))

    # -- local only ----------------------------------------------------------------------------
    def test_gc_sees_the_age_a_pack_has_now_not_when_first_listed(self, tmp_path: Path) -> None:
        """A save looks only for new packs; GC, which spares young ones, looks up every age."""
        store = LocalStore(tmp_path / "store")
        cid, data = raw_block(1, 500)
        with store.writer() as writer:
            writer.put(cid, data)
        store.refresh()  # the pack is seen, a second old
        assert isinstance(store.backend, LocalBackend)
        (pack,) = store.backend.pack_dir.iterdir()
        size, hour_ago = pack.stat().st_size, pack.stat().st_mtime - 3600
        os.utime(pack, (hour_ago, hour_ago))
        store.refresh()
        assert store.delete({cid}, min_age=600) == (1, size)
        assert not store.has(cid)

    def test_a_refresh_forgets_packs_deleted_by_another_process(self, tmp_path: Path) -> None:
        store, other = LocalStore(tmp_path / "store"), LocalStore(tmp_path / "store")
        blocks = [raw_block(i, 300) for i in range(2)]
        for cid, data in blocks:
            with store.writer() as writer:
                writer.put(cid, data)
        other.refresh()
        assert all(other.has(cid) for cid, _ in blocks)
        assert store.delete({blocks[0][0]})[0] == 1
        other.refresh()
        assert not other.has(blocks[0][0]) and other.has(blocks[1][0])

    def test_a_pack_published_while_listing_stays_in_the_index(self, tmp_path: Path) -> None:
        """A refresh racing this process's own publish (another thread committing between the
        listing and the index update) must not take the new pack for one that is gone."""
        store = LocalStore(tmp_path / "store")
        cid, data = raw_block(7, 400)
        real = store.backend.list_changes

        def list_then_publish(known: AbstractSet[str]) -> tuple[set[str], list[ObjectInfo]]:
            listed = real(known)
            with store.writer() as writer:  # commits: the pack joins the index now
                writer.put(cid, data)
            return listed

        store.backend.list_changes = list_then_publish  # type: ignore[method-assign]
        store.refresh()
        assert store.has(cid) and store.get(cid) == data

    def test_the_block_index_takes_fixed_width_rows_not_an_object_per_block(self, tmp_path: Path) -> None:
        """The index holds every block a store knows (a repository may hold millions): rows of
        54 bytes in sorted tables, at most 64 bytes a block with its buckets, whether written
        here or read back from the packs, and no Python object per block (the cyclic GC would
        walk them at every full collection)."""
        import gc
        import tracemalloc

        count = 20000
        blocks = [raw_block(i, 64) for i in range(count)]
        store = LocalStore(tmp_path / "store")
        with store.writer() as writer:
            for cid, data in blocks:
                writer.put(cid, data)
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            tracked = len(gc.get_objects())
            reader = LocalStore(tmp_path / "store")  # its index read back from the pack
            gc.collect()
            grown = tracemalloc.get_traced_memory()[0] - before
            objects = len(gc.get_objects()) - tracked
        finally:
            tracemalloc.stop()
        assert grown <= 64 * count + 256 * 1024, grown
        assert objects < 1000, objects
        for known in (store, reader):
            assert len(known._blocks) == count
            assert all(known.get(cid) == data for cid, data in blocks)

    def test_blocks_survive_reopening(self, tmp_path: Path) -> None:
        blocks = dict(raw_block(i, 700) for i in range(100))
        store = LocalStore(tmp_path / "store")
        with store.writer() as writer:
            for c, d in blocks.items():
                writer.put(c, d)
        store.close()
        reopened = LocalStore(tmp_path / "store")
        assert {c: reopened.get(c) for c in blocks} == blocks
        assert sorted(os.listdir(reopened.pack_dir)) == sorted(reopened.packs())
        reopened.close()

    def test_read_only_store_refuses_writes(self, tmp_path: Path) -> None:
        LocalStore(tmp_path / "store").close()
        store = LocalStore(tmp_path / "store", read_only=True)
        with pytest.raises(cas_ckpt.errors.RepositoryError, match="read-only"):
            store.writer()
        store.close()

    def test_verify_false_store_returns_damaged_bytes(self, tmp_path: Path) -> None:
        store = LocalStore(tmp_path / "store", verify=False)
        try:
            cid, data = raw_block(3, 500)
            store.put(cid, data)
            flip_byte_in_pack(store, cid)
            assert store.get(cid) != data
            with pytest.raises(cas_ckpt.errors.CorruptBlock):
                store.get(cid, verify=True)
        finally:
            store.close()

    def test_packs_are_plain_files_readable_by_others(self, tmp_path: Path) -> None:
        store = LocalStore(tmp_path / "store")
        store.put(*raw_block(1))
        (pack,) = store.pack_dir.iterdir()
        assert stat.S_ISREG(pack.lstat().st_mode) and pack.stat().st_mode & 0o044
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


def test_each_arrays_chunks_lie_back_to_back_and_load_mapped(tmp_path: Path) -> None:
    """Chunks are copied on the pool threads, but placed in order: every array's chunks lie
    back to back in one pack, so ``mmap=True`` maps each array instead of copying it."""
    rng = np.random.default_rng(3)
    state = {f"w{i}": rng.random(int(rng.integers(1, 5)) * 300_000 + i) for i in range(12)}
    with cas_ckpt.open(tmp_path / "repo") as repo:
        repo.save(state)
        store = repo.blocks
        assert isinstance(store, LocalStore)
        for key, array in state.items():
            data = memoryview(array).cast("B")
            size = 1024 * 1024
            cids = [repo.hasher.raw(data[i : i + size]) for i in range(0, data.nbytes, size)]
            where = [store.locate(c) for c in cids]
            assert len({pack for pack, _, _ in where}) == 1, key
            ends = [offset + length for _, offset, length in where]
            assert [offset for _, offset, _ in where[1:]] == ends[:-1], key
        loaded = repo.load(mmap=True)
        for key, array in state.items():
            assert not loaded[key].flags.writeable and not loaded[key].flags.owndata, key
            assert np.array_equal(loaded[key], array)


SHA = cidlib.Hasher("sha2-256")


@given(layout=st.lists(st.tuples(st.integers(0, 2), st.integers(1, 3000)), min_size=1, max_size=25),
       verify=st.booleans())
@settings(max_examples=40, deadline=None)
def test_start_reads_copies_blocks_out_of_the_runs_they_lie_in(
    layout: list[tuple[int, int]], verify: bool
) -> None:
    """Blocks written by three writers (three packs), asked for in an interleaved order: one
    run per stretch back to back in one pack, each block copied into its own buffer."""
    with tempfile.TemporaryDirectory() as tmp:
        store = LocalStore(Path(tmp) / "blocks")
        blocks = [(i, bytes([i % 256]) * size + i.to_bytes(4, "big"), pack)
                  for i, (pack, size) in enumerate(layout)]
        cids = [SHA.raw(data) for _, data, _ in blocks]
        for pack in range(3):
            with store.writer() as writer:
                for (_, data, where), cid in zip(blocks, cids, strict=True):
                    if where == pack:
                        writer.put(cid, data)
        outs = [memoryview(bytearray(len(data))) for _, data, _ in blocks]
        wait = store.start_reads(cids, outs, verify=verify)
        assert wait is not None
        wait()
        assert [bytes(out) for out in outs] == [data for _, data, _ in blocks]
        runs = store._runs(cids)
        assert runs is not None and sum(count for *_, count in runs) == len(blocks)
        assert len(runs) == 1 + sum(1 for a, b in itertools.pairwise(blocks) if a[2] != b[2])
        assert (store.map_blocks(cids) is not None) == (len(runs) == 1)
        wrong = [memoryview(bytearray(out.nbytes + 1)) for out in outs]
        assert store.start_reads(cids, wrong) is None  # the general read says which
        assert MemoryStore().start_reads(cids, outs) is None
        store.close()


def test_start_reads_takes_a_good_copy_where_the_mapped_one_is_damaged(tmp_path: Path) -> None:
    """The copy made from the mapping fails its check: the block is read again on its own,
    from the other pack that holds it; with no good copy left, CorruptBlock names the block."""
    store = LocalStore(tmp_path / "blocks")
    blocks = [bytes([i]) * 300_000 for i in range(3)]
    cids = [SHA.raw(data) for data in blocks]
    with store.writer() as writer:
        for cid, data in zip(cids, blocks, strict=True):
            writer.put(cid, data)
    first = store.locate(cids[1])
    with store.writer() as writer:  # a second copy of block 1, in a pack of its own
        writer.add_copy(cids[1], blocks[1])
    store.refresh(full=True)
    assert store.locate(cids[1]) == first, "reads try the first pack's copy first"
    store.close()
    with open(first[0], "r+b") as f:
        f.seek(first[1] + 1000)
        f.write(b"\xff")
    store = LocalStore(tmp_path / "blocks")
    outs = [memoryview(bytearray(len(data))) for data in blocks]
    wait = store.start_reads(cids, outs, verify=True)
    assert wait is not None
    wait()
    assert [bytes(out) for out in outs] == blocks
    store.close()
    only = LocalStore(tmp_path / "blocks")
    second = only.locate(cids[1])
    only.close()
    with open(second[0], "r+b") as f:
        f.seek(second[1] + 10)
        f.write(b"\xff")
    store = LocalStore(tmp_path / "blocks")
    wait = store.start_reads(cids, [memoryview(bytearray(len(d))) for d in blocks], verify=True)
    assert wait is not None
    with pytest.raises(CorruptBlock) as caught:
        wait()
    assert cidlib.to_str(cids[1]) in str(caught.value)
    store.close()


# -- a reader whose listing goes stale under GC (docs/reliability.md, row 43) ----------------------
class _MovingBlock:
    """One block in a store, and a second instance (another process's view) that knows only the
    pack first holding it; :meth:`move` merges that block's pack with a new one, as GC does."""

    def __init__(self, backend: Backend, reopened: Backend) -> None:
        self.store = PackedBlockStore(backend)
        self.cid, self.data = raw_block(1, 2000)
        self.store.put(self.cid, self.data)
        self.second = PackedBlockStore(reopened)
        (first,) = self.second.packs()
        self._next = itertools.count(2)
        self.move()
        self.second.backend.forget(first)  # no descriptor kept open: its reads see the pack gone

    def move(self) -> None:
        self.store.put(*raw_block(next(self._next), 500))
        assert self.store.merge_small()[0] == 2


@contextmanager
def _two_local_views(root: Path) -> Iterator[_MovingBlock]:
    backend, reopened = LocalBackend(root), LocalBackend(root)
    try:
        yield _MovingBlock(backend, reopened)
    finally:
        backend.close()
        reopened.close()


@pytest.fixture(params=["memory", "local"])
def moving(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[_MovingBlock]:
    if request.param == "memory":
        backend = MemoryBackend()
        yield _MovingBlock(backend, backend)
        return
    with _two_local_views(tmp_path / "store") as moving:
        yield moving


def test_a_listing_gone_stale_before_it_is_read_is_taken_again(
    moving: _MovingBlock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GC moves the block into a new pack right after each of the reader's first two listings:
    each names a pack gone before its index is read. The reader lists again rather than take the
    stale listing as its view, which lost live blocks under a loaded server. (Object storage
    learns of packs from its index folder, which is listed again already.)"""
    listed = moving.second.backend.list_changes
    stale: list[str] = []

    def list_then_move(known: AbstractSet[str]) -> tuple[set[str], list[ObjectInfo]]:
        names, new = listed(known)
        if len(stale) < 2 and new:
            stale.extend(info.name for info in new)
            moving.move()
        return names, new

    monkeypatch.setattr(moving.second.backend, "list_changes", list_then_move)
    assert moving.second.get(moving.cid) == moving.data
    assert len(stale) == 2 and not set(stale) & set(moving.store.packs())  # both went stale


def test_a_pack_gone_between_listing_and_stat_makes_the_listing_stale(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A directory names a new pack, and GC moves its blocks before its ``stat``: the listing
    is stale already, so the reader lists again (twice here)."""
    with _two_local_views(tmp_path / "store") as moving:
        stat, moved, busy = os.stat, [], []

        def move_then_stat(path: object, *args: object, **kwargs: object) -> os.stat_result:
            if str(path).endswith(".pack") and len(moved) < 2 and not busy:
                busy.append(path)  # the move's own stats pass
                moved.append(path)
                moving.move()
                busy.clear()
            return stat(path, *args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(local_backend.os, "stat", move_then_stat)
        assert moving.second.get(moving.cid) == moving.data
        assert len(moved) == 2
