"""CAR v1 export and import: interop with reference tooling, round trips, and hostile files.

The CAR files are checked by parties that share no code with cas_ckpt.car: a minimal parser written
here plus the reference ``multiformats`` hashing, and (when node and ``npm ci --prefix tests/js``
are available) the IPLD project's own ``@ipld/car`` reader and writer.
"""

from __future__ import annotations

import functools
import io
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import assert_state_equal, flip_byte
from hypothesis import given
from hypothesis import strategies as st
from multiformats import CID, multihash

import cas_ckpt
from cas_ckpt import car
from cas_ckpt import cid as cidlib
from cas_ckpt.maintenance.walk import data_blocks

JS_DIR = Path(__file__).parent / "js"
CHUNK = 4096  # small chunks: many blocks from small arrays


def make_state(seed: int = 0) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {
        "model": {
            "w": rng.standard_normal((64, 300)).astype(np.float32),  # 75 KiB: 19 chunks
            "b": np.arange(7, dtype=np.float16),
            "ft": np.asfortranarray(rng.integers(0, 9, (40, 50), dtype=np.int64)),
        },
        "optimizer": [{"m": rng.standard_normal(5000)}, (1, 2.5, None)],
        "blob": bytes(rng.integers(0, 256, 200_000, dtype=np.uint8)),
        "text": "é" * 20_000,
        "step": 3,
        "shared": np.zeros(10_000),  # identical chunks: one block, linked many times
    }


def open_repo(kind: str, tmp_path: Path, name: str, **options: Any) -> cas_ckpt.Repository:
    location = "memory://" if kind == "memory" else str(tmp_path / name)
    return cas_ckpt.open(location, chunk_size=CHUNK, **options)


@pytest.fixture(params=["local", "memory"])
def source(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[cas_ckpt.Repository]:
    """A repository holding two commits on main (the second has a history link to the first)."""
    with open_repo(request.param, tmp_path, "src") as repo:
        repo.save(make_state(1), ref="main", step=1)
        repo.save(make_state(2), ref="main", step=2, message="second")
        yield repo


@pytest.fixture
def memory_repo() -> Iterator[cas_ckpt.Repository]:
    with cas_ckpt.open("memory://", chunk_size=CHUNK) as repo:
        yield repo


def export_bytes(repo: cas_ckpt.Repository, target: str = "main") -> bytes:
    buffer = io.BytesIO()
    repo.export_car(target, buffer)
    return buffer.getvalue()


# --------------------------------------------------------------------------------------------
# An independent minimal CAR parser (shares nothing with cas_ckpt.car)
# --------------------------------------------------------------------------------------------
def read_uvarint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, pos


def uvarint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    return bytes(out) + bytes([value])


def parse_car(data: bytes) -> tuple[bytes, list[tuple[CID, bytes, bytes]]]:
    """(header bytes, [(CID, raw section, block bytes)]): CIDs cut by the CID's own length."""
    length, pos = read_uvarint(data, 0)
    header = data[pos : pos + length]
    pos += length
    sections = []
    while pos < len(data):
        start = pos
        length, pos = read_uvarint(data, pos)
        body = data[pos : pos + length]
        assert len(body) == length, "truncated section"
        pos += length
        # CIDv1: version, codec, multihash code, digest length, digest.
        at = 0
        for _ in range(3):
            _, at = read_uvarint(body, at)
        size, at = read_uvarint(body, at)
        cid = CID.decode(body[: at + size])
        sections.append((cid, data[start:pos], body[at + size :]))
    return header, sections


def expected_header(root: CID) -> bytes:
    """DAG-CBOR {"roots": [root], "version": 1}, spelled out byte by byte."""
    cid = bytes(root)
    tagged = b"\xd8\x2a" + bytes([0x58, len(cid) + 1]) + b"\x00" + cid  # tag 42, bytes(n)
    return b"\xa2" + b"\x65roots" + b"\x81" + tagged + b"\x67version" + b"\x01"


def rebuild(header: bytes, sections: list[bytes]) -> bytes:
    return uvarint(len(header)) + header + b"".join(sections)


# --------------------------------------------------------------------------------------------
# What export writes
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("hash_name", ["sha2-256", "blake3"])
def test_every_block_rehashes_with_multiformats(tmp_path: Path, hash_name: str) -> None:
    with open_repo("local", tmp_path, "r", hash=hash_name) as repo:
        root = repo.save(make_state(), ref="main")
        data = export_bytes(repo)
        needed = [cidlib.to_cid(c) for c in data_blocks(repo.blocks, bytes(root))]
    header, sections = parse_car(data)
    assert header == expected_header(root)
    assert [cid for cid, _, _ in sections] == needed  # each needed block once, parents first
    assert sections[0][0] == root
    for cid, _, block in sections:
        assert cid.version == 1 and cid.codec.name in ("raw", "messagepack")
        assert cid.hashfun.name == hash_name
        assert cid.digest == multihash.digest(block, hash_name, size=32)
        assert CID("base32", 1, cid.codec, cid.digest) == cid
    assert len(sections) > 25  # chunked arrays and blobs


def test_export_follows_no_history(source: cas_ckpt.Repository) -> None:
    first = source.commit("main").parents[0]
    _, sections = parse_car(export_bytes(source))
    cids = {cid for cid, _, _ in sections}
    assert first not in cids
    assert cids == {cidlib.to_cid(c) for c in data_blocks(source.blocks, bytes(source.resolve("main")))}


def test_export_streams_block_by_block(source: cas_ckpt.Repository) -> None:
    class Sink(io.RawIOBase):
        def __init__(self) -> None:
            self.sizes: list[int] = []

        def writable(self) -> bool:
            return True

        def write(self, data: Any) -> int:
            self.sizes.append(len(data))
            return len(data)

    sink = Sink()
    report = source.export_car("main", sink)  # type: ignore[arg-type]
    _, sections = parse_car(export_bytes(source))
    assert report.blocks == len(sections) and sum(sink.sizes) == report.car_bytes
    assert len(sink.sizes) == 1 + 2 * report.blocks  # header, then (length + CID, data) per block
    assert max(sink.sizes) == max(len(block) for _, _, block in sections)


def test_export_to_path_is_atomic_and_refuses_corrupt_blocks(tmp_path: Path) -> None:
    with open_repo("local", tmp_path, "r") as repo:
        root = repo.save(make_state(), ref="main")
        target = tmp_path / "out.car"
        report = repo.export_car("main", target)
        assert target.stat().st_size == report.car_bytes and report.roots == [root]
        chunk = next(c for c in data_blocks(repo.blocks, bytes(root)) if not cidlib.is_node(c))
        pack, offset, _ = repo.blocks.locate(chunk)
        flip_byte(pack, offset, 0xFF)
        bad = tmp_path / "bad.car"
        with pytest.raises(cas_ckpt.errors.CorruptBlock):
            repo.export_car("main", bad)
        assert sorted(os.listdir(tmp_path)) == ["out.car", "r"]  # no partial file, no temp left
        with pytest.raises(cas_ckpt.errors.RefNotFound):
            repo.export_car("nope", bad)


# --------------------------------------------------------------------------------------------
# Round trips
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dest_kind", ["local", "memory"])
def test_round_trip_bit_exact(source: cas_ckpt.Repository, tmp_path: Path, dest_kind: str) -> None:
    path = tmp_path / "ckpt.car"
    exported = source.export_car("main", path)
    with open_repo(dest_kind, tmp_path, "dst") as dest:
        report = dest.import_car(path, ref="imported")
        assert report.roots == exported.roots and report.ref == "imported"
        assert report.blocks == report.blocks_new == exported.blocks == len(dest.blocks)
        assert report.car_bytes == exported.car_bytes == path.stat().st_size
        assert dest.resolve("imported") == source.resolve("main")
        assert_state_equal(make_state(2), dest.load("imported"))
        assert dest.fsck().ok
        assert [c.step for c in dest.log("imported")] == [2]  # history was not exported
        again = dest.import_car(path, ref="imported")  # idempotent: nothing new
        assert again.blocks_new == 0 and len(dest.blocks) == report.blocks


def test_import_from_a_stream_with_short_reads(source: cas_ckpt.Repository, memory_repo: Any) -> None:
    class Dribble(io.RawIOBase):
        def __init__(self, data: bytes) -> None:
            self.data, self.pos = data, 0

        def readable(self) -> bool:
            return True

        def read(self, n: int = -1) -> bytes:
            chunk = self.data[self.pos : self.pos + min(n, 7)]
            self.pos += len(chunk)
            return chunk

    seen: list[tuple[int, int]] = []
    report = memory_repo.import_car(Dribble(export_bytes(source)), ref="x",
                                    progress=lambda b, n: seen.append((b, n)))
    assert_state_equal(make_state(2), memory_repo.load("x"))
    assert seen[-1] == (report.blocks, report.car_bytes) and len(seen) == report.blocks


def test_import_moves_an_existing_ref_and_logs_it(source: cas_ckpt.Repository, memory_repo: Any) -> None:
    old = memory_repo.save({"x": 1}, ref="main")
    memory_repo.import_car(io.BytesIO(export_bytes(source)), ref="main")
    assert memory_repo.resolve("main") == source.resolve("main")
    assert memory_repo.reflog("main")[-1].old == bytes(old)


def test_import_without_ref_leaves_blocks_for_gc(source: cas_ckpt.Repository, memory_repo: Any) -> None:
    report = memory_repo.import_car(io.BytesIO(export_bytes(source)))
    assert report.ref is None and memory_repo.refs() == {}
    assert memory_repo.gc().blocks_freed == report.blocks


# --------------------------------------------------------------------------------------------
# Bad files store nothing
# --------------------------------------------------------------------------------------------
@functools.cache
def small_car_bytes() -> bytes:
    with cas_ckpt.open("memory://", chunk_size=CHUNK) as repo:
        repo.save({"a": np.arange(2000, dtype=np.int32), "b": b"z" * 20_000, "c": [1, "x"]}, ref="main")
        return export_bytes(repo)


@pytest.fixture
def small_car() -> bytes:
    return small_car_bytes()


def assert_rejected(repo: cas_ckpt.Repository, data: bytes, match: str, tmp_path: Path | None = None) -> None:
    before = len(repo.blocks)
    with pytest.raises(cas_ckpt.errors.CarError, match=match):
        repo.import_car(io.BytesIO(data), ref="bad")
    assert len(repo.blocks) == before
    assert repo.refs() == {} or "bad" not in repo.refs()


@pytest.mark.parametrize("kind", ["local", "memory"])
def test_corrupt_missing_duplicate_and_stray_blocks(tmp_path: Path, small_car: bytes, kind: str) -> None:
    header, sections = parse_car(small_car)
    raw = [s for _, s, _ in sections]
    last = bytearray(raw[-1])
    last[-1] ^= 1  # same length, wrong content
    stray_block = b"not part of the checkpoint"
    stray = uvarint(36 + len(stray_block)) + cidlib.Hasher().raw(stray_block) + stray_block
    cases = {
        "corrupt block": [*raw[:-1], bytes(last)],
        "missing block": raw[:1] + raw[2:],
        "duplicate block": [*raw, raw[1]],
        "not reachable": [*raw, stray],
    }
    with open_repo(kind, tmp_path, "dst") as repo:
        repo.save({"other": 1}, ref="other")
        for match, body in cases.items():
            assert_rejected(repo, rebuild(header, body), match)
        if kind == "local":
            assert os.listdir(Path(repo.location) / "tmp") == []  # aborted temp packs removed
        repo.import_car(io.BytesIO(small_car), ref="good")  # the intact file still imports
        assert repo.fsck().ok


def test_every_truncation_is_rejected(small_car: bytes, memory_repo: Any) -> None:
    # Every cut in the header and first sections, around every section boundary, and a sample.
    boundaries, at = [], len(small_car)
    for _, section, _ in reversed(parse_car(small_car)[1]):
        at -= len(section)
        boundaries.append(at)
    cuts = set(range(400)) | set(range(0, len(small_car), 97))
    cuts |= {b + d for b in boundaries for d in range(-3, 4)}
    for cut in sorted(c for c in cuts if 0 <= c < len(small_car)):
        with pytest.raises(cas_ckpt.errors.CarError, match=r"truncated|missing|empty file|header"):
            memory_repo.import_car(io.BytesIO(small_car[:cut]), ref="x")
    assert len(memory_repo.blocks) == 0 and memory_repo.refs() == {}


@pytest.mark.parametrize(
    ("suffix", "match"),
    [
        (b"\x00", "section length 0 is out of bounds"),
        (b"\x05abc", "truncated"),
        (b"\xff" * 12, "longer than 9 bytes"),
        (uvarint(2**62), "out of bounds"),
        (uvarint(car.MAX_SECTION + 1) + b"\x01" * 64, "out of bounds"),
        (b"\x80\x00", "non-minimal"),
        (uvarint(40) + b"\x12\x20" + bytes(38), "CIDv0"),
        (uvarint(40) + b"\x01\x70\x12\x20" + bytes(36), "not one cas_ckpt stores"),
        (uvarint(40) + b"\x02\x55\x12\x20" + bytes(36), "version 2"),
        (uvarint(10) + b"\x01\x55\x12\x20" + bytes(6), "runs past"),
        (uvarint(3) + b"\x01\x55\x12", "truncated varint in block CID digest length"),
    ],
)
def test_trailing_garbage_and_hostile_sections(
    small_car: bytes, memory_repo: Any, suffix: bytes, match: str
) -> None:
    assert_rejected(memory_repo, small_car + suffix, match)


def test_a_block_no_repository_holds_is_refused(small_car: bytes, memory_repo: Any) -> None:
    """A raw chunk over 1 MiB (a section allows 64 MiB, for nodes) would be stored in a pack that
    every reader then refuses as damaged (docs/format.md, "Block sizes"): the import refuses it."""
    block = b"\x01" * ((1 << 20) + 1)
    cid = cidlib.Hasher().raw(block)
    assert_rejected(memory_repo, small_car + uvarint(len(cid) + len(block)) + cid + block,
                    rf"block {cidlib.to_str(cid)} is a raw chunk of {len(block)} bytes, over the 1048576")


def _header_case(cbor: bytes) -> bytes:
    return uvarint(len(cbor)) + cbor


_ROOT = b"\xd8\x2a\x58\x25\x00" + cidlib.Hasher().raw(b"root")  # tag 42, 37 bytes: 0x00 and a CID


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"", "empty file"),
        (uvarint(2**40), "header length"),
        (b"\x00", "header length 0"),
        (_header_case(b"\xa1\x67version\x02"), "CARv2"),
        (_header_case(b"\xa1\x67version\x01"), r"unexpected CAR header fields|roots"),
        (_header_case(b"\xa2\x65roots\x80\x67version\x01"), "non-empty list"),
        (_header_case(b"\xa2\x65roots\x81\x41\x00\x67version\x01"), "non-empty list of CIDs"),
        (_header_case(b"\xa2\x67version\x01\x65roots\x80"), "DAG-CBOR order"),
        (_header_case(b"\x81\x01"), "not a map"),
        (_header_case(b"\xa2\x65roots\x9f\xff\x67version\x01"), "indefinite"),
        (_header_case(b"\xa2\x78\x05roots\x80\x67version\x01"), "minimally"),
        (_header_case(b"\xa2\x65roots\x80\x67version\x01\x00"), "trailing bytes"),
        (_header_case(b"\xa2\x65roots\x81\xd8\x2a\x45\x00\x01\x55\x12\x20\x67version\x01"), "root CID"),
        (_header_case(b"\xa2\x65roots\x81\xd8\x2a\x43\x01\x02\x03\x67version\x01"), "0x00"),
        (_header_case(b"\xa2\x65roots\x81\xd8\x2a\x01\x67version\x01"), "tag-42 CID"),  # an int
        (_header_case(b"\xa2\x65roots" + _ROOT + b"\x67version\x01"), "non-empty list of CIDs"),
        (_header_case(b"\xa1\x65roo"), "truncated CAR header"),  # a text longer than the header
        (_header_case(b"\xa2\x79\x00\x05roots\x80\x67version\x01"), "minimally"),  # 2-byte length 5
        (_header_case(b"\xa2\x65roots" + b"\x81" * 100_000 + b"\x80\x67version\x01"), "nests too deeply"),
        (_header_case(b"\xa1\x62\xff\xfe\x01"), "invalid UTF-8"),
        (_header_case(b"\xa2\x65roots\x80\x67version\xf9\x3c\x00"), r"major type 7"),  # version 1.0
        (_header_case(b"\xa1\x01\x01"), "key is not a string"),
        (_header_case(b"\xa3\x65roots\x81" + _ROOT + b"\x65roots\x81" + _ROOT + b"\x67version\x01"),
         "order or repeat"),
    ],
)
def test_hostile_headers(data: bytes, match: str, memory_repo: Any) -> None:
    assert_rejected(memory_repo, data, match)


def test_a_header_holds_at_most_max_roots_roots() -> None:
    roots = [cidlib.Hasher().raw(b"%d" % i) for i in range(car.MAX_ROOTS + 1)]
    assert car.decode_header(car.encode_header(roots[:-1])) == roots[:-1]
    with pytest.raises(cas_ckpt.errors.CarError, match=f"array of {car.MAX_ROOTS + 1} items exceeds"):
        car.decode_header(car.encode_header(roots))


def test_a_node_that_hashes_right_but_does_not_decode_is_a_car_error(memory_repo: Any) -> None:
    root = cidlib.Hasher().node(b"\xc1")  # 0xc1: a byte msgpack never uses
    data = rebuild(car.encode_header([root]), [uvarint(len(root) + 1) + root + b"\xc1"])
    assert_rejected(memory_repo, data, rf"malformed msgpack node.*{cidlib.to_str(root)}.*\(at byte \d+\)")


def test_header_from_reference_roots_round_trips() -> None:
    roots = [cidlib.Hasher().node(b"a"), cidlib.Hasher("blake3").raw(b"b")]
    assert car.decode_header(car.encode_header(roots)) == roots
    assert car.encode_header(roots[:1]) == expected_header(cidlib.to_cid(roots[0]))


def test_ref_needs_exactly_one_root(small_car: bytes, memory_repo: Any) -> None:
    _, sections = parse_car(small_car)
    first = sections[0][0]
    extra = cidlib.Hasher().raw(b"two")
    two_roots = car.encode_header([bytes(first), extra])
    body = [s for _, s, _ in sections] + [uvarint(36 + 3) + extra + b"two"]
    assert_rejected(memory_repo, rebuild(two_roots, body), "one root")
    report = memory_repo.import_car(io.BytesIO(rebuild(two_roots, body)))  # fine without a ref
    assert [bytes(r) for r in report.roots] == [bytes(first), extra]
    with pytest.raises(cas_ckpt.errors.InvalidRefName):
        memory_repo.import_car(io.BytesIO(small_car), ref="../x")


@given(st.data())
def test_mutated_files_store_nothing_or_the_right_thing(data: st.DataObject) -> None:
    small_car = small_car_bytes()
    blob = bytearray(small_car)
    for _ in range(data.draw(st.integers(1, 3))):
        blob[data.draw(st.integers(0, len(blob) - 1))] = data.draw(st.integers(0, 255))
    with cas_ckpt.open("memory://") as repo:
        try:
            repo.import_car(io.BytesIO(bytes(blob)), ref="x")
        except cas_ckpt.errors.CarError:
            assert len(repo.blocks) == 0 and repo.refs() == {}
        else:  # only a no-op mutation can pass
            assert bytes(blob) == small_car


# --------------------------------------------------------------------------------------------
# The reference JavaScript implementation (@ipld/car)
# --------------------------------------------------------------------------------------------
def node_tool() -> list[str]:
    node = shutil.which("node")
    ready = node and (JS_DIR / "node_modules" / "@ipld" / "car").is_dir()
    if not ready:
        message = "needs node and `npm ci --prefix tests/js` (the @ipld/car reference reader)"
        if os.environ.get("CAS_CKPT_REQUIRE_NODE") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return [str(node), str(JS_DIR / "car_tool.mjs")]


def run_node(*args: str) -> Any:
    result = subprocess.run([*node_tool(), *args], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.mark.parametrize("hash_name", ["sha2-256", "blake3"])
def test_ipld_car_reads_and_verifies_the_export(tmp_path: Path, hash_name: str) -> None:
    node_tool()
    with open_repo("local", tmp_path, "r", hash=hash_name) as repo:
        root = repo.save(make_state(), ref="main")
        path = tmp_path / "x.car"
        repo.export_car("main", path)
        expected = [cidlib.to_str(c) for c in data_blocks(repo.blocks, bytes(root))]
        sizes = [repo.blocks.size(c) for c in data_blocks(repo.blocks, bytes(root))]
    listing = run_node("verify", str(path))
    assert listing["roots"] == [str(root)]
    assert [b["cid"] for b in listing["blocks"]] == expected
    assert [b["size"] for b in listing["blocks"]] == sizes
    assert all(b["ok"] and b["version"] == 1 for b in listing["blocks"])
    assert {b["codec"] for b in listing["blocks"]} == {cidlib.RAW, cidlib.MSGPACK}
    assert {b["hash"] for b in listing["blocks"]} == {cidlib.HASH_CODES[hash_name]}


def test_ipld_car_writer_output_is_identical_and_imports(source: cas_ckpt.Repository, tmp_path: Path) -> None:
    node_tool()
    ours, theirs = tmp_path / "ours.car", tmp_path / "theirs.car"
    source.export_car("main", ours)
    run_node("rewrite", str(ours), str(theirs))  # @ipld/car's CarWriter, same roots and blocks
    assert theirs.read_bytes() == ours.read_bytes()
    with cas_ckpt.open("memory://") as dest:
        dest.import_car(theirs, ref="js")
        assert_state_equal(make_state(2), dest.load("js"))


def test_ipld_car_rejects_a_truncated_export(small_car: bytes, tmp_path: Path) -> None:
    path = tmp_path / "cut.car"
    path.write_bytes(small_car[:-5])
    result = subprocess.run([*node_tool(), "verify", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "car_tool:" in result.stderr


def test_export_to_a_path_never_follows_a_link_planted_beside_it(tmp_path: Path) -> None:
    """0.1 wrote ``.NAME.PID.tmp`` and followed a link planted there; the temp name is now random
    and created exclusively."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    out = tmp_path / "ckpt.car"
    for pid in range(os.getpid() - 2, os.getpid() + 3):
        (tmp_path / f".{out.name}.{pid}.tmp").symlink_to(victim)
    with cas_ckpt.open("memory://") as repo:
        repo.save({"w": np.arange(1000)})
        repo.export_car("main", out)
    assert victim.read_bytes() == b"precious"
    assert out.is_file() and not out.is_symlink() and out.stat().st_size > 8000
    assert sorted(p.name for p in tmp_path.iterdir() if not p.is_symlink()) == ["ckpt.car", "victim"]
