"""The block store's side of trust: odd files in packs/, damaged duplicate copies, repairs, full disks.

Each test reproduces a defect found on 0.1.0 (issue #10) through the public API, with real files:

* a FIFO, a directory, a link or a hostile sparse file named like a pack must never hang or exhaust
  memory: open, load, fsck and GC report it as damage and carry on;
* when racing writers leave one CID in two packs and one copy is damaged, loads, GC and fsck use
  and keep the good copy, and a GC merge whose output name is taken by a damaged pack replaces it;
* a CAR re-import stores good copies over damaged ones (``docs/gc.md`` offers it as the repair);
* on a real, full filesystem GC frees space and saves work again (root only: a tmpfs is mounted).
"""

from __future__ import annotations

import ast
import contextlib
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import zstandard

import cas_ckpt
from cas_ckpt import cid as cidlib
from cas_ckpt.blocks import LocalStore
from cas_ckpt.blocks.compression import CODEC_NONE, CODEC_ZSTD
from cas_ckpt.blocks.pack import (
    FOOTER,
    FOOTER_MAGIC,
    PACK_MAGIC,
    PACK_MAGIC_V2,
    encode_index,
    index_length,
    parse_index,
)

from ._support import PYTHON, child_env, digest, fsck_problems, record

HEX_NAME = "ab" * 32 + ".pack"


def _state(i: int) -> dict[str, object]:
    rng = np.random.default_rng(i)
    return {"w": rng.random(40_000), "b": np.arange(100) + i, "step": i}


def _raw(data: bytes) -> tuple[bytes, bytes]:
    return cidlib.Hasher("sha2-256").raw(data), data


def _run(code: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter; a hang fails the test instead of blocking it."""
    return subprocess.run([PYTHON, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, env=child_env(), check=False)


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


# ----------------------------------------------------------------------------------------------
# Odd files where packs belong
# ----------------------------------------------------------------------------------------------
def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _directory(path: Path) -> None:
    path.mkdir()
    (path / "inside").write_bytes(b"x")


def _link(path: Path) -> None:
    target = path.parent.parent / "elsewhere.pack"
    target.write_bytes(PACK_MAGIC + b"\x00" * 100)
    path.symlink_to(target)


def _huge_index(path: Path) -> None:
    """A sparse 9 GiB file whose footer claims an 8 GiB index (read whole, it would exhaust memory)."""
    size = 9 << 30
    with open(path, "wb") as f:
        f.write(PACK_MAGIC)
        f.seek(size - FOOTER.size)
        f.write(FOOTER.pack(8 << 30, b"\x00" * 32, FOOTER_MAGIC))


ODD_PACKS = {"fifo": _fifo, "directory": _directory, "symlink": _link, "huge-index": _huge_index}


@pytest.mark.parametrize("kind", sorted(ODD_PACKS))
def test_odd_files_named_like_packs_are_damage_not_hangs(tmp_path: Path, kind: str) -> None:
    root = tmp_path / "repo"
    with cas_ckpt.open(root) as repo:
        repo.save(_state(1), step=1)
        expected = digest(repo.load())
    ODD_PACKS[kind](root / "packs" / HEX_NAME)
    # Under a 2 GiB address-space limit: a bounded read of the footer, never the claimed index.
    result = _run(f"""
        import resource, cas_ckpt
        from _support import digest
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
        with cas_ckpt.open({str(root)!r}) as repo:
            assert digest(repo.load()) == {expected!r}
            report = repo.fsck()
            assert not report.ok and any({HEX_NAME!r} in p for p in report.store_problems), report
            repo.gc()
            assert digest(repo.load()) == {expected!r}
            repo.save({{"again": 1}}, ref="other")
        print("ok")
    """)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
    record("odd_pack_files", kinds=1)


@pytest.mark.parametrize("kind", ["fifo", "directory", "symlink"])
def test_odd_files_among_temp_packs_are_left_alone(tmp_path: Path, kind: str) -> None:
    """GC removes the temp packs of dead writers; a FIFO, directory or link there is not one of
    them: it is neither opened (a FIFO would block) nor followed, nor removed."""
    root = tmp_path / "repo"
    with cas_ckpt.open(root) as repo:
        repo.save(_state(1), step=1)
    planted = root / "tmp" / "0123abcd.pack.tmp"
    ODD_PACKS[kind](planted)
    (root / "tmp" / "dead-writer.pack.tmp").write_bytes(PACK_MAGIC + b"half")  # a real leftover
    result = _run(f"""
        import cas_ckpt
        with cas_ckpt.open({str(root)!r}) as repo:
            report = repo.gc()
            repo.save({{"again": 1}}, ref="other")
            print(report.temp_files_removed)
    """)
    assert result.returncode == 0 and result.stdout.split() == ["1"], result.stderr
    assert os.path.lexists(planted) and not (root / "tmp" / "dead-writer.pack.tmp").exists()


# ----------------------------------------------------------------------------------------------
# Index entries lying about a block's raw length (issue #40)
# ----------------------------------------------------------------------------------------------
def _rewrite_pack(path: Path, entries: list[tuple[bytes, int, int, int, int]], body: bytes) -> Path:
    """Replace the pack at ``path`` by ``body`` (magic and blocks) and an index of ``entries``,
    under the name that index gives it."""
    tail, name = encode_index(entries, 2)
    path.unlink()
    (path.parent / name).write_bytes(body + tail)
    return path.parent / name


def _lie(claim: int) -> Callable[[Path, bytes], Path]:
    """A compressed chunk of the pack claims ``claim`` raw bytes (its stored bytes unchanged)."""

    def plant(path: Path, _commit: bytes) -> Path:
        data = path.read_bytes()
        entries = parse_index(data, len(data), path, 2)
        i = next(i for i, e in enumerate(entries) if e[3] != CODEC_NONE and not cidlib.is_node(e[0]))
        entries[i] = (*entries[i][:4], claim)
        blocks_end = len(data) - index_length(data[-FOOTER.size :], len(data), path)
        return _rewrite_pack(path, entries, data[:blocks_end])

    return plant


def _node_bomb(path: Path, commit: bytes) -> Path:
    """The commit, as a 32 KB zstd frame of 1 GiB of zeros that claims to be 1 GiB."""
    compressor = zstandard.ZstdCompressor(level=1).compressobj(size=1 << 30)
    zeros = bytes(1 << 20)
    frame = b"".join([*(compressor.compress(zeros) for _ in range(1024)), compressor.flush()])
    entry = (commit, len(PACK_MAGIC_V2), len(frame), CODEC_ZSTD, 1 << 30)
    return _rewrite_pack(path, [entry], PACK_MAGIC_V2 + frame)


LIES = {"chunk-1TiB": _lie(1 << 40), "chunk-3GiB": _lie(3 << 30), "chunk-1MiB+1": _lie((1 << 20) + 1),
        "node-zstd-bomb": _node_bomb}


@pytest.mark.parametrize("lie", sorted(LIES))
def test_a_raw_length_no_writer_makes_is_damage_not_memory(tmp_path: Path, lie: str) -> None:
    """An index entry of a compressed pack claiming 1 TiB made load, fsck, gc and push raise a bare
    MemoryError; 3 GiB allocated and zero-filled 3 GiB for a 100-byte block; a 32 KB frame stored
    as a node claiming 1 GiB cost a 17 s, 2 GB load. A chunk is at most 1 MiB and a node at most
    the node limit: the pack is damage (fsck names it), skipped, and never allocated for."""
    root = tmp_path / "repo"
    with cas_ckpt.open(root, compression="zstd") as repo:
        repo.save({"other": np.arange(1000.0)}, ref="other")
        good = set((root / "packs").iterdir())
        commit = bytes(repo.save({"zeros": np.zeros(300_000), "w": _state(1)["w"]}, ref="main"))
        expected = digest(repo.load("other"))
    (target,) = set((root / "packs").iterdir()) - good
    lied = LIES[lie](target, commit)
    # Under a 2 GiB address-space limit: the claim is refused, never allocated.
    result = _run(f"""
        import resource, cas_ckpt
        from _support import digest
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
        outcomes = {{}}
        with cas_ckpt.open({str(root)!r}) as repo:
            for name, run in [("load", repo.load), ("fsck", repo.fsck), ("gc", repo.gc),
                              ("push", lambda: repo.push({str(tmp_path / "remote")!r}))]:
                try:
                    outcomes[name] = type(run()).__name__
                except cas_ckpt.CasCkptError as exc:
                    outcomes[name] = "ours"
                except BaseException as exc:
                    outcomes[name] = f"other {{type(exc).__name__}}: {{exc}}"
            report = repo.fsck()
            assert not report.ok and any({lied.name!r} in p and "claims" in p
                                         for p in report.store_problems), report
            assert digest(repo.load("other")) == {expected!r}
        print(outcomes)
    """, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    outcomes = ast.literal_eval(result.stdout)
    assert not [o for o in outcomes.values() if o.startswith("other")], outcomes
    assert outcomes["load"] == "ours" and outcomes["push"] == "ours", outcomes
    assert lied.exists()  # GC keeps a damaged pack: it may hold the only copy of something
    record("raw_length_lies", kinds=1)


# ----------------------------------------------------------------------------------------------
# Damaged duplicate copies
# ----------------------------------------------------------------------------------------------
def _two_savers_race(root: Path) -> tuple[bytes, str]:
    """Two writers that had not seen each other's pack store the same state: two copies of every
    block. Returns the array chunk to damage and the digest of the checkpoint."""
    with cas_ckpt.open(root) as repo:
        first = LocalStore(root)  # a second writer, opened before the first one's pack existed
        root_cid = repo.save(_state(3), ref="a")
        chunk = next(c for c in list(repo.blocks.keys()) if not cidlib.is_node(c))
        with first.writer() as writer:  # its own batch: other blocks around, another order
            writer.put(*_raw(b"the other writer's own block"))
            for cid in reversed(list(repo.blocks.keys())):
                writer.add_copy(cid, repo.blocks.get(cid))
        first.close()
        return chunk, digest(repo.load(root_cid))


def test_a_damaged_duplicate_never_wins(tmp_path: Path) -> None:
    root = tmp_path / "repo"
    chunk, expected = _two_savers_race(root)
    with cas_ckpt.open(root) as repo:
        assert len(repo.blocks.packs()) == 2
        pack, offset, length = repo.blocks.locate(chunk)  # the copy reads try first
        _flip(Path(pack), offset + length // 2)
    with cas_ckpt.open(root) as repo:
        assert digest(repo.load("a")) == expected
        report = repo.fsck()  # every copy is checked, so the damaged one is reported
        assert not report.ok and any(p.cid == cidlib.to_str(chunk) for p in report.problems)
        repo.gc()
        assert digest(repo.load("a")) == expected


def test_a_gc_merge_never_trusts_a_damaged_pack_of_its_name(tmp_path: Path) -> None:
    """GC merging packs into one whose name equals an existing, damaged pack (0.1.0 kept the damaged
    file, dropped the good output and unlinked the good packs: loads then failed)."""
    root = tmp_path / "repo"
    with cas_ckpt.open(root) as repo:
        small = [repo.save({"i": i, "x": np.full(2000, i)}, ref=f"r{i}") for i in range(3)]
        expected = [digest(repo.load(c)) for c in small]
    # What a merge of these packs writes is deterministic: make it once, keep it, damage it.
    scratch = tmp_path / "scratch"
    shutil.copytree(root, scratch)
    with cas_ckpt.open(scratch) as copy:
        copy.gc()
        (merged,) = (scratch / "packs").iterdir()
    planted = root / "packs" / merged.name
    shutil.copy(merged, planted)
    _flip(planted, len(PACK_MAGIC) + 5)  # a block byte: the index stays readable
    with cas_ckpt.open(root) as repo:
        repo.gc()  # merges the three packs into an output of the planted name
        assert [digest(repo.load(c)) for c in small] == expected
        assert repo.fsck().ok
    with cas_ckpt.open(root) as fresh:
        assert [digest(fresh.load(c)) for c in small] == expected


@pytest.mark.parametrize("damage", ["block", "index"])
def test_a_car_re_import_repairs(tmp_path: Path, damage: str) -> None:
    """Re-importing a CAR of a damaged checkpoint stores good copies, and loads work again.
    (Written without upkeep: no index snapshot describes the pack, its own index alone does.)"""
    root = tmp_path / "repo"
    with cas_ckpt.open(root, upkeep=False) as repo:
        cid = repo.save(_state(4), ref="main")
        expected = digest(repo.load())
        repo.export_car("main", tmp_path / "good.car")
        (pack,) = (root / "packs").iterdir()
        size = pack.stat().st_size
    _flip(pack, len(PACK_MAGIC) + 100 if damage == "block" else size - FOOTER.size - 3)
    with cas_ckpt.open(root) as repo:
        with pytest.raises((cas_ckpt.errors.CorruptBlock, cas_ckpt.errors.BlockNotFound)):
            repo.load("main")
        report = repo.import_car(tmp_path / "good.car", ref="main")
        assert report.blocks_new > 0  # the damaged copies did not count as stored
        assert digest(repo.load(cid)) == expected
    with cas_ckpt.open(root) as fresh:
        assert digest(fresh.load("main")) == expected
        problems = fsck_problems(fresh)
        # The damaged pack is still there (nothing deletes evidence) but every block has a good copy.
        assert all("damaged pack" in p or "does not match" in p for p in problems), problems


def test_a_damaged_pack_index_that_a_snapshot_describes_is_still_found_by_fsck(tmp_path: Path) -> None:
    """The snapshot describes the pack, so loads never read its own index: they work (every block
    is hash-checked); fsck reads each pack's own index again and reports the damage."""
    root = tmp_path / "repo"
    with cas_ckpt.open(root) as repo:
        repo.save(_state(4), ref="main")
        expected = digest(repo.load())
        assert repo.upkeep_status().snapshot is not None  # type: ignore[union-attr]
        (pack,) = (root / "packs").iterdir()
    _flip(pack, pack.stat().st_size - FOOTER.size - 3)
    with cas_ckpt.open(root) as repo:
        assert digest(repo.load("main")) == expected
        problems = fsck_problems(repo)
        assert problems and all("damaged pack" in p for p in problems), problems


# ----------------------------------------------------------------------------------------------
# A real full disk
# ----------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _small_tmpfs(where: Path, size_mib: int) -> Iterator[Path]:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs", str(where)],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_gc_frees_a_full_disk_and_saves_work_again(tmp_path: Path) -> None:
    with _small_tmpfs(tmp_path / "mnt", 64) as mnt:
        root = mnt / "repo"
        rng = np.random.default_rng(0)
        saved = 0
        with cas_ckpt.open(root) as repo:
            with pytest.raises(OSError) as full:  # MediumError: a CasCkptError and an OSError
                for step in range(1000):
                    repo.save({"w": rng.random(1 << 20), "step": step}, ref="run", step=step)  # 8 MiB
                    saved += 1
            assert full.value.errno in (28, 122) and isinstance(full.value, cas_ckpt.CasCkptError)
            assert saved >= 3
            head = repo.resolve("run")
            expected = digest(repo.load(head))
            repo.set_ref("run", head)  # keep only the last checkpoint: the rest is garbage
            for name in list(repo.refs()):
                if name != "run":
                    repo.delete_ref(name)
            report = repo.gc(reflog_expiry=0)
            assert report.bytes_freed > 8 << 20, report
            assert digest(repo.load("run")) == expected
            repo.save({"w": rng.random(1 << 20), "step": 10_000}, ref="run", step=10_000)
            assert repo.fsck().ok
    record("full_disk", runs=1)


def test_a_failed_save_on_a_full_disk_names_the_repository(tmp_path: Path) -> None:
    with _small_tmpfs(tmp_path / "mnt", 16) as mnt, cas_ckpt.open(mnt / "repo") as repo:
        with pytest.raises(cas_ckpt.errors.MediumError, match=str(mnt / "repo")) as info:
            repo.save({"w": np.random.default_rng(1).random(4 << 20)})
        assert info.value.errno == 28 and info.value.filename
        assert list((mnt / "repo" / "tmp").iterdir()) == []  # the temp pack went with the error


def test_import_of_a_damaged_car_stores_nothing_and_names_it(tmp_path: Path) -> None:
    with cas_ckpt.open(tmp_path / "src") as src:
        src.save(_state(5))
        src.export_car("main", tmp_path / "x.car")
    data = bytearray((tmp_path / "x.car").read_bytes())
    data[len(data) // 2] ^= 0x01
    (tmp_path / "bad.car").write_bytes(bytes(data))
    with cas_ckpt.open(tmp_path / "dst") as dst:
        with pytest.raises(cas_ckpt.errors.CarError):
            dst.import_car(tmp_path / "bad.car", ref="main")
        assert list(dst.blocks.keys()) == [] and dst.refs() == {}


if __name__ == "__main__":  # pragma: no cover - for running one by hand
    sys.exit(pytest.main([__file__, "-v"]))
