"""Damaged storage: the specific error naming the CID or file, fsck reports it, never wrong data.

Each stored object is damaged in turn in a fresh repository: a raw chunk, a state node, a commit
node (one bit flipped in place in its pack), a pack's data, index trailer and header, a truncated
and a deleted pack, a ref file (garbage, truncated, empty, deleted, naming a missing block), a
reflog line (in the middle, and the last complete one), a pin, and config.json. Then:

* loading raises the error for it (CorruptBlock / BlockNotFound naming the CID, CorruptStore naming
  the file, RefNotFound, RepositoryError), with ``verify`` on and also with ``mmap=True``;
* ``fsck`` is not ok and names it;
* whatever is not damaged still loads bit for bit.

``verify=False`` is also shown for what it is: no hashing on read, so a flipped bit in a chunk
comes back as is (that is the documented trade).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import cas_ckpt
from cas_ckpt import cid as cidlib
from cas_ckpt.maintenance.walk import data_blocks

from ._support import digest, make_state, record

SCALE = 0.3


class Setup:
    """Three saves; ``snapshot``: upkeep wrote an index snapshot describing the packs (else only
    each pack's own index does, as when upkeep is off or has not run yet)."""

    def __init__(self, root: Path, *, snapshot: bool = False) -> None:
        self.root = root
        with cas_ckpt.open(root, upkeep=snapshot) as repo:
            repo.save(make_state(1, 0, scale=SCALE), ref="main")
            repo.save(make_state(1, 1, scale=SCALE), ref="main")  # index 1 carries pages
            repo.save({"other": list(range(10))}, ref="other")
            self.main = repo.resolve("main")
            self.other = repo.resolve("other")
            self.commit = cidlib.to_bytes(self.main)
            self.tree = cidlib.to_bytes(repo.commit("main").tree)
            blocks = list(data_blocks(repo.blocks, self.commit))
            other_blocks = set(data_blocks(repo.blocks, cidlib.to_bytes(self.other)))
            # Blocks main alone needs (the shared "frozen" array is in every state of seed 1).
            self.raw = next(b for b in blocks if not cidlib.is_node(b) and b not in other_blocks)
            self.node = next(b for b in blocks if cidlib.is_node(b) and b not in (self.commit, self.tree))
            self.locations = {b: repo.blocks.locate(b) for b in blocks}
        self.expected = digest(make_state(1, 1, scale=SCALE))

    def pack_of(self, cid: bytes) -> Path:
        return Path(self.locations[cid][0])

    def flip(self, cid: bytes, at: float = 0.5) -> None:
        path, offset, length = self.locations[cid]
        flip_bit(Path(path), offset + int(length * at))


def flip_bit(path: Path, position: int, bit: int = 3) -> None:
    with open(path, "r+b") as f:
        f.seek(position)
        byte = f.read(1)[0]
        f.seek(position)
        f.write(bytes([byte ^ (1 << bit)]))


def fsck_text(root: Path) -> tuple[bool, str]:
    with cas_ckpt.open(root, create=False) as repo:
        report = repo.fsck()
    text = "\n".join([f"{p.kind} {p.cid} {p.detail}" for p in report.problems] + report.store_problems)
    return report.ok, text


def other_still_loads(root: Path) -> None:
    with cas_ckpt.open(root, create=False) as repo:
        assert repo.load("other") == {"other": list(range(10))}


COUNTS: dict[str, int] = {}


def _count(kind: str) -> None:
    COUNTS[kind] = COUNTS.get(kind, 0) + 1
    record("corruption", **{kind: 1}, total=1)


# ----------------------------------------------------------------------------------------------
# Blocks
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["raw", "node", "tree", "commit"])
@pytest.mark.parametrize("where", [0.0, 0.5, 1.0])
def test_flipped_bit_in_a_block(tmp_path: Path, which: str, where: float) -> None:
    s = Setup(tmp_path / "repo")
    cid = {"raw": s.raw, "node": s.node, "tree": s.tree, "commit": s.commit}[which]
    s.flip(cid, at=min(where, 0.999))
    name = cidlib.to_str(cid)
    for mmap in (False, True):
        with cas_ckpt.open(s.root, create=False) as repo:
            with pytest.raises(cas_ckpt.errors.CorruptBlock) as info:
                repo.load("main", mmap=mmap)
            assert info.value.cid == name and name in str(info.value)
    ok, text = fsck_text(s.root)
    assert not ok and name in text and "corrupt" in text
    with cas_ckpt.open(s.root, create=False) as repo:
        if which == "raw":
            repo.gc()  # GC never reads chunks; it keeps the damaged one, still reported after
            with pytest.raises(cas_ckpt.errors.CorruptBlock, match=name):
                repo.load("main")
        else:
            with pytest.raises(cas_ckpt.errors.RepositoryError, match="gc refused"):
                repo.gc()  # a damaged node hides what it links to: never sweep then
    other_still_loads(s.root)
    _count(f"block_{which}")


def test_verify_false_trusts_the_disk(tmp_path: Path) -> None:
    """What verify=False means: no re-hash on read, a damaged chunk comes back as stored."""
    s = Setup(tmp_path / "repo")
    s.flip(s.raw)
    with cas_ckpt.open(s.root, create=False, verify=False) as repo:
        assert digest(repo.load("main")) != s.expected  # wrong bytes, silently
    with cas_ckpt.open(s.root, create=False) as repo, pytest.raises(cas_ckpt.errors.CorruptBlock):
        repo.load("main", verify=True)


# ----------------------------------------------------------------------------------------------
# Packs
# ----------------------------------------------------------------------------------------------
def _damage_trailer(path: Path) -> None:
    flip_bit(path, path.stat().st_size - 60)


def _truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size * 2 // 3)


def _header(path: Path) -> None:
    flip_bit(path, 2)


PACK_DAMAGE: dict[str, Callable[[Path], None]] = {
    "trailer": _damage_trailer,
    "truncated": _truncate,
    "header": _header,
    "deleted": lambda path: path.unlink(),
    "emptied": lambda path: path.write_bytes(b""),
}


@pytest.mark.parametrize("snapshot", [False, True])
@pytest.mark.parametrize("damage", sorted(PACK_DAMAGE))
def test_damaged_pack(tmp_path: Path, damage: str, snapshot: bool) -> None:
    s = Setup(tmp_path / "repo", snapshot=snapshot)
    pack = s.pack_of(s.raw)
    lost = {b for b, loc in s.locations.items() if Path(loc[0]) == pack}
    PACK_DAMAGE[damage](pack)
    if snapshot and damage in ("header", "trailer"):
        # The snapshot describes the pack and every block in it is whole: loads work (each block
        # hash-checked), and fsck, reading each pack's own index again, reports the damage.
        with cas_ckpt.open(s.root, create=False) as repo:
            assert digest(repo.load("main")) == s.expected
        ok, text = fsck_text(s.root)
        assert not ok and pack.name in text and "damaged pack" in text
        return
    with cas_ckpt.open(s.root, create=False) as repo:
        with pytest.raises(cas_ckpt.errors.BlockNotFound) as info:
            repo.load("main")
        assert cidlib.to_bytes(info.value.cid) in lost
        if damage != "deleted":
            assert pack.name in str(info.value)  # the message points at the damaged pack
    ok, text = fsck_text(s.root)
    assert not ok and "missing" in text
    if damage != "deleted":
        assert pack.name in text
    other_still_loads(s.root)
    _count(f"pack_{damage}")


def test_flipped_bit_in_pack_between_blocks_is_harmless_or_caught(tmp_path: Path) -> None:
    """Every byte of a pack is either a block (hashed), the index (checksummed) or the header."""
    s = Setup(tmp_path / "repo")
    pack = s.pack_of(s.raw)
    size = pack.stat().st_size
    caught = 0
    for position in range(0, size, max(1, size // 23)):
        original = pack.read_bytes()
        flip_bit(pack, position)
        with cas_ckpt.open(s.root, create=False) as repo:
            try:
                assert digest(repo.load("main")) == s.expected
            except (cas_ckpt.errors.CorruptBlock, cas_ckpt.errors.BlockNotFound):
                caught += 1
        ok, _ = fsck_text(s.root)
        assert not ok
        pack.write_bytes(original)
    assert caught > 0
    _count("pack_sweep")


# ----------------------------------------------------------------------------------------------
# Refs, reflogs, pins, config
# ----------------------------------------------------------------------------------------------
REF_DAMAGE: dict[str, Callable[[Path, Setup], Any]] = {
    "garbage": lambda p, s: p.write_bytes(b"\x00\xffnot a cid at all\n"),
    "truncated": lambda p, s: p.write_text(p.read_text()[:30]),
    "empty": lambda p, s: p.write_bytes(b""),
    "other-cid-text": lambda p, s: p.write_text("QmYwAPJzv5CZsnA625s3Xf2nemtYgPpHdWEz79ojWnPbdG\n"),
}


@pytest.mark.parametrize("damage", sorted(REF_DAMAGE))
def test_damaged_ref_file(tmp_path: Path, damage: str) -> None:
    s = Setup(tmp_path / "repo")
    ref = s.root / "refs" / "main"
    REF_DAMAGE[damage](ref, s)
    with cas_ckpt.open(s.root, create=False) as repo:
        with pytest.raises(cas_ckpt.errors.CorruptStore) as info:
            repo.load("main")
        assert info.value.path == str(ref)
        with pytest.raises(cas_ckpt.errors.CorruptStore):
            repo.gc()  # GC cannot know what the ref needed: it must refuse
    ok, text = fsck_text(s.root)
    assert not ok and str(ref) in text
    other_still_loads(s.root)
    _count(f"ref_{damage}")


def test_deleted_ref_file(tmp_path: Path) -> None:
    s = Setup(tmp_path / "repo")
    (s.root / "refs" / "main").unlink()
    with cas_ckpt.open(s.root, create=False) as repo, pytest.raises(cas_ckpt.errors.RefNotFound):
        repo.load("main")
    ok, text = fsck_text(s.root)
    assert not ok and "main" in text  # its reflog says it should hold a checkpoint
    other_still_loads(s.root)
    _count("ref_deleted")


def test_ref_naming_a_missing_block(tmp_path: Path) -> None:
    s = Setup(tmp_path / "repo")
    ghost = cidlib.to_str(cas_ckpt.cid.Hasher().node(b"\x90"))
    (s.root / "refs" / "main").write_text(ghost + "\n")
    with cas_ckpt.open(s.root, create=False) as repo:
        with pytest.raises(cas_ckpt.errors.BlockNotFound) as info:
            repo.load("main")
        assert info.value.cid == ghost
    ok, text = fsck_text(s.root)
    assert not ok and ghost in text
    _count("ref_missing_block")


@pytest.mark.parametrize("line", ["middle", "last"])
def test_damaged_reflog_line(tmp_path: Path, line: str) -> None:
    s = Setup(tmp_path / "repo")
    log = s.root / "logs" / "main"
    lines = log.read_bytes().splitlines(keepends=True)
    assert len(lines) == 2
    index = 0 if line == "middle" else 1
    lines[index] = lines[index].replace(b'"new"', b'"n\xffw"')
    log.write_bytes(b"".join(lines))
    with cas_ckpt.open(s.root, create=False) as repo:
        with pytest.raises(cas_ckpt.errors.CorruptStore) as info:
            repo.reflog("main")
        assert info.value.path == str(log)
        assert digest(repo.load("main")) == s.expected  # the data does not depend on it
    ok, text = fsck_text(s.root)
    assert not ok and str(log) in text
    _count("reflog_line")


def test_torn_last_reflog_line_is_ignored_and_repaired(tmp_path: Path) -> None:
    """An unterminated last line is an append a crash cut short: ignored, and the next append
    does not glue itself to it."""
    s = Setup(tmp_path / "repo")
    log = s.root / "logs" / "main"
    log.write_bytes(log.read_bytes() + b'{"old": "bagaq')
    with cas_ckpt.open(s.root, create=False) as repo:
        assert len(repo.reflog("main")) == 2
        repo.save({"x": 1}, ref="main")
        assert len(repo.reflog("main")) == 3
        assert repo.fsck().ok


def test_garbage_pin(tmp_path: Path) -> None:
    s = Setup(tmp_path / "repo")
    (s.root / "pins" / "bnotacid").write_bytes(b"")
    ok, text = fsck_text(s.root)
    assert not ok and "bnotacid" in text
    with cas_ckpt.open(s.root, create=False) as repo:
        with pytest.raises(cas_ckpt.CasCkptError):
            repo.gc()  # a pin it cannot read could protect anything: refuse
        assert digest(repo.load("main")) == s.expected
    _count("pin")


CONFIG_DAMAGE: dict[str, tuple[Callable[[Path], Any], type[Exception]]] = {
    "garbage": (lambda p: p.write_bytes(b"{not json"), cas_ckpt.errors.CorruptStore),
    "not-an-object": (lambda p: p.write_text("[1, 2]"), cas_ckpt.errors.CorruptStore),
    "other-format": (lambda p: p.write_text('{"format": "zarr"}'), cas_ckpt.errors.RepositoryError),
    "newer-version": (
        lambda p: p.write_text(json.dumps({**json.loads(p.read_text()), "version": 99})),
        cas_ckpt.errors.RepositoryError,
    ),
    "unknown-hash": (
        lambda p: p.write_text(json.dumps({**json.loads(p.read_text()), "hash": "md5"})),
        cas_ckpt.errors.RepositoryError,
    ),
    "deleted": (lambda p: p.unlink(), cas_ckpt.errors.RepositoryError),
    "empty": (lambda p: p.write_bytes(b""), cas_ckpt.errors.CorruptStore),
}


@pytest.mark.parametrize("damage", sorted(CONFIG_DAMAGE))
def test_damaged_config(tmp_path: Path, damage: str) -> None:
    s = Setup(tmp_path / "repo")
    config = s.root / "config.json"
    change, error = CONFIG_DAMAGE[damage]
    change(config)
    for create in (False, True):
        with pytest.raises(error) as info:
            cas_ckpt.open(s.root, create=create)
        assert str(s.root) in str(info.value)
    assert sorted(os.listdir(s.root / "refs")) == ["main", "other"]  # nothing was re-created
    _count(f"config_{damage}")


# ----------------------------------------------------------------------------------------------
# Index files
# ----------------------------------------------------------------------------------------------
INDEX_DAMAGE: dict[str, Callable[[Path], None]] = {
    "flipped": lambda path: flip_bit(path, path.stat().st_size // 2),
    "truncated": _truncate,
    "emptied": lambda path: path.write_bytes(b""),
}


@pytest.mark.parametrize("damage", sorted(INDEX_DAMAGE))
def test_damaged_index_snapshot(tmp_path: Path, damage: str) -> None:
    """The snapshot is detected as damaged; every pack's own index is read instead, so nothing is
    lost; fsck names it; the next upkeep writes a good one and removes it."""
    s = Setup(tmp_path / "repo", snapshot=True)
    (snapshot,) = (s.root / "index").iterdir()
    INDEX_DAMAGE[damage](snapshot)
    with cas_ckpt.open(s.root, create=False, upkeep=False) as repo:
        assert digest(repo.load("main")) == s.expected
        assert repo.upkeep_status().due == ["consolidate-index"]  # type: ignore[union-attr]
    ok, text = fsck_text(s.root)
    assert not ok and "damaged index file" in text and snapshot.name in text
    with cas_ckpt.open(s.root, create=False) as repo:
        report = repo.upkeep()
        assert report.ran == ["consolidate-index"] and not snapshot.exists()
    ok, _ = fsck_text(s.root)
    assert ok
    other_still_loads(s.root)
    _count(f"index_{damage}")


@pytest.mark.parametrize("snapshot", [False, True])
def test_log_of_a_ref_whose_head_commit_is_gone_raises(
    tmp_path: Path, snapshot: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    """``repo.log`` never reads a missing head commit as an empty history, also where a
    commit-graph layer still holds a copy of it; the CLI says the same (exit 3)."""
    from cas_ckpt import cli

    s = Setup(tmp_path / "repo", snapshot=snapshot)
    with cas_ckpt.open(s.root, create=False) as repo:
        repo.update_commit_graph()
        assert repo.history.graph is not None and repo.history.graph.covers(s.commit)
    s.pack_of(s.commit).unlink()
    with cas_ckpt.open(s.root, create=False) as repo:
        with pytest.raises(cas_ckpt.errors.BlockNotFound) as info:
            repo.log("main")
        assert info.value.cid == str(s.main) and "head commit of ref 'main'" in str(info.value)
        with pytest.raises(cas_ckpt.errors.BlockNotFound):
            repo.log(s.main)
        assert [c.cid for c in repo.log("other")] == [s.other]  # the rest reads as before
    assert cli.main(["log", "main", "--repo", str(s.root)]) == 3
    assert f"block {s.main} not found" in capsys.readouterr().err
    _count("log_head_missing")
