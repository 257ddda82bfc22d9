"""Compression inside packs: codecs, pack format 2, and compressed repositories end to end.

CIDs name the raw bytes, so every test that compresses also checks that nothing a user sees
(CIDs, loaded values, CAR exports) depends on the codec.
"""

from __future__ import annotations

import hashlib
import io
import json
import struct
import sys
import tempfile
from pathlib import Path
from typing import Any

import ml_dtypes
import msgpack
import numpy as np
import pytest
import zstandard
from helpers import assert_state_equal, flip_byte
from hypothesis import example, given, settings
from hypothesis import strategies as st
from strategies import states

import cas_ckpt
from cas_ckpt.blocks import pack as pack_module
from cas_ckpt.blocks.base import MAX_BLOCK, MAX_CHUNK, size_limit
from cas_ckpt.blocks.compression import (
    CODEC_GROUPED,
    CODEC_NONE,
    CODEC_ZSTD,
    CODECS,
    Compressor,
    decode,
    decode_into,
)
from cas_ckpt.blocks.pack import (
    FOOTER,
    FOOTER_MAGIC,
    MAX_INDEX,
    PACK_MAGIC,
    PACK_MAGIC_V2,
    Entry,
    encode_index,
    index_length,
    parse_index,
)
from cas_ckpt.codec import MAX_NODE_SIZE
from cas_ckpt.errors import CorruptStore, RepositoryError
from cas_ckpt.repository import FORMAT_VERSION

ROOT = Path(__file__).resolve().parent.parent
FEWER = settings(max_examples=max(10, settings().max_examples // 3))
ZSTD = Compressor("zstd")


def weights(seed: int, n: int, dtype: Any) -> np.ndarray[Any, Any]:
    """Values distributed like trained weights (compressible exponents, noisy mantissas)."""
    values = np.random.default_rng(seed).normal(0, 0.02, n)
    if np.dtype(dtype).kind == "c":
        return (values + 1j * values[::-1]).astype(dtype)
    if np.dtype(dtype).kind in "iu":
        return (values * 1000).astype(dtype)
    return values.astype(dtype)


WEIGHT_DTYPES = [np.float16, ml_dtypes.bfloat16, np.float32, np.float64, np.complex64, np.int64,
                 np.uint8, ml_dtypes.float8_e4m3fn]


@st.composite
def weight_arrays(draw: st.DrawFn) -> np.ndarray[Any, Any]:
    dtype = draw(st.sampled_from(WEIGHT_DTYPES))
    n = draw(st.integers(0, 12_000))
    array = weights(draw(st.integers(0, 2**32 - 1)), n, dtype)
    return array.reshape(-1, 3) if n % 3 == 0 and n else array


# -- codecs ----------------------------------------------------------------------------------------
@given(data=st.binary(max_size=9000), float_size=st.sampled_from([0, 2, 4, 8]))
def test_any_bytes_round_trip_through_the_codecs(data: bytes, float_size: int) -> None:
    encoded = ZSTD.encode(data, float_size)
    if encoded is None:
        return  # stored raw
    codec, stored = encoded
    assert len(stored) <= 0.95 * len(data)
    assert decode(codec, stored, len(data), "block") == data


@given(array=weight_arrays())
def test_float_arrays_round_trip_grouped(array: np.ndarray[Any, Any]) -> None:
    data = array.tobytes()
    size = array.itemsize // 2 if array.dtype.kind == "c" else array.itemsize
    encoded = ZSTD.encode(data, size if array.dtype.kind in "fc" or array.dtype == ml_dtypes.bfloat16 else 0)
    if encoded is not None:
        out = bytearray(len(data))
        decode_into(encoded[0], encoded[1], memoryview(out), "block")
        assert out == data


def test_trained_like_weights_use_the_grouped_codec_and_shrink() -> None:
    for dtype, size, most in ((np.float32, 4, 0.85), (ml_dtypes.bfloat16, 2, 0.72)):
        data = weights(1, 100_000, dtype).tobytes()
        codec, stored = ZSTD.encode(data, size)  # type: ignore[misc]
        assert codec == CODEC_GROUPED and len(stored) < most * len(data)


def test_incompressible_and_tiny_blocks_stay_raw() -> None:
    assert ZSTD.encode(np.random.default_rng(0).bytes(100_000), 4) is None
    assert ZSTD.encode(b"\0" * 100) is None  # under MIN_BLOCK: a frame would eat the saving
    assert Compressor("none").encode(b"\0" * 100_000) is None
    assert ZSTD.encode(b"\0" * 100_000)[0] == CODEC_ZSTD  # type: ignore[index]


@example(stored=b"", codec=CODEC_GROUPED, size=8)  # no element size: ValueError inside
@example(stored=b"junk", codec=CODEC_ZSTD, size=4)  # not a frame: ZstdError inside
@given(stored=st.binary(max_size=300), codec=st.sampled_from(CODECS), size=st.integers(0, 4000))
def test_garbage_never_decodes_to_anything_but_its_size(stored: bytes, codec: int, size: int) -> None:
    out = bytearray(size)
    try:
        decode_into(codec, stored, memoryview(out), "pack p")
    except CorruptStore as exc:
        assert "pack p" in str(exc)


def test_a_damaged_stream_or_frame_is_corrupt_store() -> None:
    data = weights(2, 50_000, np.float32).tobytes()
    codec, view = ZSTD.encode(data, 4)  # type: ignore[misc]
    stored = bytes(view)
    for cut in (stored[:-1], stored[:20], b"\x03" + stored[1:], stored + b"x"):
        with pytest.raises(CorruptStore):
            decode(codec, cut, len(data), "pack p")
    with pytest.raises(CorruptStore, match="unknown codec"):
        decode(9, stored, len(data), "pack p")


def _grouped(*streams: tuple[int, int, bytes]) -> bytes:
    """A grouped block of 2-byte elements, by hand: (method, declared length, body) per stream."""
    heads = b"".join(struct.pack("<BI", method, n) for method, n, _ in streams)
    return bytes([2]) + heads + b"".join(body for _, _, body in streams)


_ONE_BYTE = zstandard.ZstdCompressor(write_content_size=False).compress(b"b")  # declares no size
GROUPED_DAMAGE = {  # each one numpy would broadcast into the block unchecked
    "a raw stream too short": (_grouped((0, 1, b"a"), (0, 4, b"bbbb")), "raw stream of 1 bytes, not 4"),
    "a stream past the block": (_grouped((0, 4, b"aaaa"), (0, 4, b"b")), "stream runs past the block"),
    "an unknown stream method": (_grouped((0, 4, b"aaaa"), (7, 4, b"bbbb")), "unknown stream method 7"),
    "a zstd stream too short": (_grouped((0, 4, b"aaaa"), (1, len(_ONE_BYTE), _ONE_BYTE)),
                                "zstd frame holds 1 bytes, not 4"),
}


@pytest.mark.parametrize(("stored", "match"), GROUPED_DAMAGE.values(), ids=GROUPED_DAMAGE.keys())
def test_a_damaged_grouped_block_is_corrupt_store(stored: bytes, match: str) -> None:
    assert decode(CODEC_GROUPED, _grouped((0, 4, b"aaaa"), (0, 4, b"bbbb")), 8, "pack p") == b"ab" * 4
    with pytest.raises(CorruptStore, match=f"corrupt pack p: stored block does not decode: {match}"):
        decode(CODEC_GROUPED, stored, 8, "pack p")


def test_a_zstd_frame_declaring_more_than_its_block_is_corrupt_before_it_is_inflated() -> None:
    # decompress() sizes its output by the content size a frame header declares, whatever
    # max_output_size says: a 16-byte frame declaring 1 TiB was a bare MemoryError.
    huge = struct.pack("<IBQ", 0xFD2FB528, 0xE0, 2**40) + (1).to_bytes(3, "little")  # one empty block
    for frame, declared in ((huge, 2**40), (zstandard.ZstdCompressor().compress(b"x" * 5), 5)):
        with pytest.raises(CorruptStore, match=rf"corrupt pack p: .*declares {declared} bytes, not 4"):
            decode(CODEC_ZSTD, frame, 4, "pack p")


# -- the pack index, versions 1 and 2 -------------------------------------------------------------
HASHER = cas_ckpt.cid.Hasher("sha2-256")
cids = st.builds(HASHER.raw, st.binary(max_size=8)) | st.builds(HASHER.node, st.binary(max_size=8))


@st.composite
def indexes(draw: st.DrawFn, version: int) -> list[Entry]:
    entries, offset = [], len(PACK_MAGIC)
    for cid in draw(st.lists(cids, max_size=20)):
        length = draw(st.integers(0, 5000))
        codec = CODEC_NONE if version == 1 else draw(st.sampled_from(CODECS))
        size = length if codec == CODEC_NONE else draw(st.integers(0, size_limit(cid)))
        entries.append(Entry(cid, offset, length, codec, size))
        offset += length
    return entries


@given(data=st.data(), version=st.sampled_from([1, 2]))
def test_pack_indexes_round_trip(data: st.DataObject, version: int) -> None:
    entries = data.draw(indexes(version))
    tail, _ = encode_index(entries, version)
    end = entries[-1].offset + entries[-1].length if entries else len(PACK_MAGIC)
    assert parse_index(tail, end + len(tail), "p", version) == entries
    if entries:
        with pytest.raises(CorruptStore, match="index entry"):
            parse_index(tail, end + len(tail), "p", 3 - version)  # the other version's arity


@pytest.mark.parametrize("kind, limit", [("raw", MAX_CHUNK), ("node", MAX_NODE_SIZE)])
@pytest.mark.parametrize("claim", [1, 2, 2**30, 3 * 2**30, 2**40, 2**63])
def test_an_index_claiming_a_raw_length_no_writer_makes_is_damage(kind: str, limit: int, claim: int) -> None:
    """issue #40: a raw length had no bound, so an entry claiming 1 TiB was a bare MemoryError
    and one claiming 3 GiB allocated 3 GiB for a 100-byte block. Chunks are at most 1 MiB, nodes
    at most the node limit: a larger claim is refused when the index is read, naming the pack."""
    cid = getattr(HASHER, kind)(b"block")
    entries = [Entry(HASHER.raw(b"a"), len(PACK_MAGIC), 100, CODEC_ZSTD, 4096),
               Entry(cid, len(PACK_MAGIC) + 100, 100, CODEC_ZSTD, limit + claim - 1)]
    tail, _ = encode_index(entries, 2)
    size = len(PACK_MAGIC) + 200 + len(tail)
    if claim == 1:  # exactly at the bound: a block some writer could make
        assert parse_index(tail, size, "p.pack", 2) == entries
        return
    with pytest.raises(CorruptStore, match=rf"corrupt p.pack: index entry of {cas_ckpt.cid.to_str(cid)} "
                       rf"claims a .* of {limit + claim - 1} bytes, over the {limit}"):
        parse_index(tail, size, "p.pack", 2)


@pytest.mark.parametrize("codec", CODECS)
def test_decoding_never_allocates_past_the_largest_block(codec: int) -> None:
    """``decode`` sized its output by the claimed raw length before any check (issue #40)."""
    frame = zstandard.ZstdCompressor().compress(b"\0" * 1000)
    for size in (MAX_BLOCK + 1, 2**40):
        with pytest.raises(CorruptStore, match=rf"corrupt pack p: .*raw length of {size} bytes"):
            decode(codec, frame, size, "pack p")


@given(rows=st.lists(st.tuples(cids | st.binary(min_size=30, max_size=40), st.integers(0, 10**6),
                                st.integers(0, 10**6) | st.booleans()), max_size=8).map(tuple))
def test_an_index_checked_in_bulk_gives_what_row_by_row_checks_give(rows: tuple[Any, ...]) -> None:
    """The bulk path of a version 1 index accepts only what the row-by-row checks accept, and
    gives the same entries; where it declines, the row-by-row path decides (and says why)."""
    bulk = pack_module._plain_entries(rows)
    try:
        one_by_one = pack_module._entries(rows, 1)
    except (ValueError, cas_ckpt.errors.InvalidCID):
        assert bulk is None
        return
    assert bulk is None or bulk == one_by_one
    if rows and all(type(n) is int for row in rows for n in row[1:]) \
            and all(c[:-32] in cas_ckpt.cid.PREFIXES and len(c) > 32 for c, _, _ in rows):
        assert bulk == one_by_one  # the CIDs cas_ckpt writes never take the slow path


msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.binary(max_size=40)
    | st.text(max_size=5) | cids,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=12,
)


position = st.integers(-10, 10**6) | st.booleans() | st.none()
near_rows = (st.tuples(cids | st.binary(max_size=40), position, position)
             | st.tuples(cids, position, position, st.integers(-1, 3), position)).map(list)


_A_CID = cas_ckpt.cid.Hasher("sha2-256").raw(b"x")


@settings(max_examples=300)  # microseconds each
@example(rows=[[_A_CID, None, 5]], version=1, size=1000)  # each field of the wrong type, once
@example(rows=[[_A_CID, 9, 5.0]], version=1, size=1000)
@example(rows=[[_A_CID, 9, 5, 0, "5"]], version=2, size=1000)
@example(rows=[[_A_CID, 9, 5, None, 5]], version=2, size=1000)
@example(rows=[[_A_CID, 0, 5]], version=1, size=1000)  # an offset inside the pack's header
@example(rows=[[_A_CID, 7, 5, 0, 5]], version=2, size=1000)
@example(rows=[[_A_CID, 9, -1]], version=1, size=1000)  # a negative length
@example(rows=[[_A_CID, 9, 10**6]], version=1, size=1000)  # a block past the index
@example(rows=[[_A_CID, 9, 5, 7, 5]], version=2, size=1000)  # an unknown codec
@example(rows=[[_A_CID, 9, 5, 1, -1]], version=2, size=1000)  # a negative raw length
@example(rows=[[_A_CID, 9, 5, 0, 6]], version=2, size=1000)  # a raw block whose sizes differ
@example(rows=[[_A_CID, 9, 5, False, 5]], version=2, size=1000)  # a boolean codec
@example(rows=[[b"not a cid", 9, 5, 0, 5]], version=2, size=1000)
@example(rows=[[list(_A_CID), 9, 5, 0, 5]], version=2, size=1000)  # a CID as an array of ints
@example(rows=[dict.fromkeys("abcde", 0)], version=2, size=1000)  # a 5-item map, not an array
@given(rows=st.lists(near_rows, min_size=1, max_size=6)
       | st.lists(msgpack_values | near_rows | st.lists(msgpack_values, min_size=3, max_size=5),
                  max_size=6)
       | msgpack_values,
       version=st.sampled_from([1, 2]), size=st.integers(0, 10**6))
def test_a_hostile_index_is_corrupt_store_or_entries_inside_the_pack(
    rows: Any, version: int, size: int
) -> None:
    """Any msgpack value under a valid footer: CorruptStore, or entries that lie inside the pack."""
    index = msgpack.packb(rows, use_bin_type=True)
    tail = index + FOOTER.pack(len(index), hashlib.sha256(index).digest(), FOOTER_MAGIC)
    size = max(size, len(tail))
    try:
        entries = parse_index(tail, size, "p", version)
    except CorruptStore:
        return
    assert [list(e[:3]) if version == 1 else list(e) for e in entries] == rows  # exactly as stored
    for e in map(Entry._make, entries):
        assert tuple(map(type, e)) == (bytes, int, int, int, int)
        assert cas_ckpt.cid.check_binary(e.cid) == e.cid
        assert len(PACK_MAGIC) <= e.offset
        assert e.length >= 0 and e.offset + e.length <= size - len(tail)
        assert e.codec in CODECS and e.size >= 0 and (e.codec != CODEC_NONE or e.size == e.length)


@pytest.mark.parametrize("rows", [{}, "", b"", 0, None])
def test_an_index_that_is_not_an_array_is_corrupt(rows: Any) -> None:
    index = msgpack.packb(rows, use_bin_type=True)
    tail = index + FOOTER.pack(len(index), hashlib.sha256(index).digest(), FOOTER_MAGIC)
    with pytest.raises(CorruptStore, match="not an array"):
        parse_index(tail, 1000, "p", 1)


def _footer(length: int, index: bytes = b"") -> bytes:
    return FOOTER.pack(length, hashlib.sha256(index).digest(), FOOTER_MAGIC)


def test_a_file_too_short_for_a_header_and_footer_is_not_a_pack() -> None:
    smallest = len(PACK_MAGIC) + FOOTER.size
    for footer, size in ((_footer(0)[1:], 1000), (_footer(0), smallest - 1)):
        with pytest.raises(CorruptStore, match=r"corrupt packs/a\.pack: not a cas_ckpt pack \(too short\)"):
            index_length(footer, size, "packs/a.pack")
    with pytest.raises(CorruptStore, match="too short"):
        parse_index(b"", 1000, "packs/a.pack")
    assert index_length(_footer(0), smallest, "packs/a.pack") == FOOTER.size


def test_a_footer_claiming_an_index_past_the_header_or_over_the_limit_is_corrupt() -> None:
    for length, size in ((945, 1000), (MAX_INDEX + 1, 4 * MAX_INDEX)):  # 945: one byte into the header
        with pytest.raises(CorruptStore, match=rf"corrupt packs/a\.pack: .*an index of {length} bytes"):
            index_length(_footer(length), size, "packs/a.pack")
    assert index_length(_footer(944), 1000, "packs/a.pack") == 944 + FOOTER.size
    assert index_length(_footer(MAX_INDEX), 4 * MAX_INDEX, "packs/a.pack") == MAX_INDEX + FOOTER.size


def test_a_tail_shorter_than_the_index_its_footer_claims_is_truncated() -> None:
    index = msgpack.packb([[_A_CID, 8, 10]], use_bin_type=True)
    # The footer claims twice the index and a footer more: sliced without the length check, the
    # tail's first bytes would be taken for the whole index, and their checksum matches.
    tail = index + _footer(2 * len(index) + FOOTER.size, index)
    with pytest.raises(CorruptStore, match=r"corrupt packs/a\.pack: pack is truncated"):
        parse_index(tail, 10_000, "packs/a.pack")


def test_a_version_1_index_cannot_hold_compressed_blocks() -> None:
    with pytest.raises(ValueError):
        encode_index([Entry(b"\x01" * 36, 8, 10, CODEC_ZSTD, 100)], 1)


# -- repositories ---------------------------------------------------------------------------------
@given(state=states(), chunk_size=st.sampled_from([4099, 1024 * 1024]))
def test_compressed_round_trip_is_bit_exact_and_names_the_same_cids(state: Any, chunk_size: int) -> None:
    with cas_ckpt.open("memory://", compression="zstd", chunk_size=chunk_size) as packed, \
            cas_ckpt.open("memory://", chunk_size=chunk_size) as plain:
        commits = packed.save(state), plain.save(state)
        assert packed.commit(commits[0]).tree == plain.commit(commits[1]).tree
        assert_state_equal(state, packed.load("main"))


@FEWER
@given(arrays=st.lists(weight_arrays(), min_size=1, max_size=6))
def test_compressible_arrays_round_trip_on_disk_with_a_chunk_that_splits_elements(
    arrays: list[np.ndarray[Any, Any]],
) -> None:
    state = {f"w{i}": a for i, a in enumerate(arrays)}
    with tempfile.TemporaryDirectory() as tmp:
        with cas_ckpt.open(tmp, compression="zstd", chunk_size=4099) as repo:
            cid = repo.save(state)
        with cas_ckpt.open(tmp) as again:
            assert_state_equal(state, again.load(cid))
            assert_state_equal(state, again.load(cid, mmap=True))  # mapped loads fall back to copies


def test_real_weights_meet_the_size_targets(tmp_path: Path) -> None:
    real_model = pytest.importorskip("real_model", reason="benchmarks/ on the path")
    try:
        state = real_model.model_weights()
    except real_model.ModelUnavailable:
        pytest.skip("the models extra is not installed")
    bf16 = {k: v.astype(ml_dtypes.bfloat16) if v.dtype == np.float32 else v for k, v in state.items()}
    for weights_, most in ((state, 0.85), (bf16, 0.70)):
        with cas_ckpt.open(tmp_path / str(most), compression="zstd") as repo:
            repo.save(weights_)
            report = repo.last_save
            assert report is not None and report.bytes_stored <= most * report.bytes_written
            usage = repo.stats()
            assert usage.stored_bytes == pytest.approx(report.bytes_stored, rel=0.01)


def test_compression_is_recorded_and_switches(tmp_path: Path) -> None:
    path = tmp_path / "repo"
    with cas_ckpt.open(path) as repo:
        assert repo.config.compression == "none" and repo.config.version == 1
    with cas_ckpt.open(path, compression="zstd") as repo:  # an existing repository switches
        assert repo.config.compression == "zstd" and repo.config.version == 2
    config = json.loads((path / "config.json").read_text())
    assert config["compression"] == "zstd" and config["version"] == 2
    with cas_ckpt.open(path) as repo:
        assert repo.config.compression == "zstd"  # kept when not given
        repo.set_compression("none")
    with cas_ckpt.open(path, read_only=True) as repo:
        assert repo.config.compression == "none" and repo.config.version == 2  # v2 packs may exist
        with pytest.raises(RepositoryError, match="read-only"):
            cas_ckpt.open(path, read_only=True, compression="zstd")
    with pytest.raises(ValueError, match="unknown compression"):
        cas_ckpt.open(path, compression="lz4")


def test_a_per_save_override_compresses_and_raises_the_format_version(tmp_path: Path) -> None:
    state = {"w": weights(3, 300_000, np.float32)}
    with cas_ckpt.open(tmp_path / "r") as repo:
        plain = repo.save(state)
        assert (repo.last_save.bytes_stored == repo.last_save.bytes_written)  # type: ignore[union-attr]
        state["w"] = state["w"] * 2
        repo.save(state, compression="zstd")
        assert repo.last_save.bytes_stored < 0.9 * repo.last_save.bytes_written  # type: ignore[union-attr]
        assert repo.config.version == 2 and repo.config.compression == "none"
        magics = {p.read_bytes()[:8] for p in (tmp_path / "r" / "packs").rglob("*.pack")}
        assert magics == {PACK_MAGIC, PACK_MAGIC_V2}
        assert repo.load(plain)["w"].tobytes() == weights(3, 300_000, np.float32).tobytes()


@pytest.mark.parametrize("version", [FORMAT_VERSION + 1, "2"])
def test_a_newer_or_malformed_format_version_is_refused_clearly(tmp_path: Path, version: Any) -> None:
    path = tmp_path / "repo"
    cas_ckpt.open(path, compression="zstd").close()
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "version": version}))
    with pytest.raises(RepositoryError, match=r"format version.*upgrade cas_ckpt"):
        cas_ckpt.open(path)


def test_a_newer_version_names_the_release_it_requires(tmp_path: Path) -> None:
    """From version 4 on a config names the first release that reads it, and a reader too old
    for it says which release to upgrade to."""
    path = tmp_path / "repo"
    cas_ckpt.open(path).close()
    config = json.loads((path / "config.json").read_text())
    newer = {**config, "version": FORMAT_VERSION + 1, "requires": "cas_ckpt>=9.1"}
    (path / "config.json").write_text(json.dumps(newer))
    with pytest.raises(RepositoryError, match=r"upgrade cas_ckpt \(cas_ckpt>=9\.1\) to open it"):
        cas_ckpt.open(path)


def test_a_version_1_config_naming_compression_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "repo"
    cas_ckpt.open(path).close()
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "compression": "zstd"}))
    with pytest.raises(RepositoryError, match="invalid compression"):
        cas_ckpt.open(path)


def _state() -> dict[str, Any]:
    return {"model": {f"layer{i}": weights(i, 200_000, np.float32) for i in range(3)},
            "meta": {"step": 7, "note": "x" * 40_000}}


def test_fsck_finds_damage_inside_a_compressed_block(tmp_path: Path) -> None:
    with cas_ckpt.open(tmp_path / "r", compression="zstd") as repo:
        repo.save(_state())
        assert repo.fsck().ok
        chunk = next(c for c in list(repo.blocks.keys()) if not cas_ckpt.cid.is_node(c))
        pack, offset, length = repo.blocks.locate(chunk)
        flip_byte(pack, offset + length // 2, 0x10)
    with cas_ckpt.open(tmp_path / "r") as repo:
        report = repo.fsck()
        assert not report.ok and str(cas_ckpt.cid.to_cid(chunk)) in str(report)


def test_gc_of_a_compressed_repository_keeps_the_rest_compressed(tmp_path: Path) -> None:
    with cas_ckpt.open(tmp_path / "r", compression="zstd") as repo:
        keep = repo.save(_state(), ref="keep")
        other = _state()
        other["model"]["layer0"] = other["model"]["layer0"] + 1
        repo.save(other, ref="drop")
        stored = repo.stats().total_bytes
        repo.delete_ref("drop")
        result = repo.gc(grace=0, reflog_expiry=0)
        assert result.blocks_freed > 0
        assert repo.stats().total_bytes < stored
        packs = repo.blocks.packs()
        assert any(e.codec != CODEC_NONE for entries in packs.values() for e in entries)
        assert_state_equal(_state(), repo.load(keep))
        assert repo.fsck().ok


def test_car_export_is_the_same_compressed_or_not_and_imports_compressed(tmp_path: Path) -> None:
    cars = []
    for compression in ("none", "zstd"):
        with cas_ckpt.open(tmp_path / compression, compression=compression) as repo:
            tree = repo.commit(repo.save(_state())).tree  # a commit records its time
            out = io.BytesIO()
            repo.export_car(tree, out)
            cars.append(out.getvalue())
    assert cars[0] == cars[1]  # the raw bytes IPFS expects, whatever the storage
    with cas_ckpt.open(tmp_path / "imported", compression="zstd") as repo:
        repo.import_car(io.BytesIO(cars[0]), ref="main")
        assert_state_equal(_state(), repo.load("main"))
        assert repo.stats().stored_bytes < 0.9 * repo.stats().logical_bytes


def test_compressed_repository_on_s3(s3_url: str) -> None:
    state = _state()
    with cas_ckpt.open(s3_url, compression="zstd") as repo:
        cid = repo.save(state)
        assert repo.last_save.bytes_stored < 0.9 * repo.last_save.bytes_written  # type: ignore[union-attr]
    with cas_ckpt.open(s3_url) as again:
        assert again.config.compression == "zstd"
        assert_state_equal(state, again.load(cid))
        assert again.fsck().ok


sys.path.insert(0, str(ROOT / "benchmarks"))


@pytest.mark.parametrize("window", [64 << 20, 1 << 20])  # whole, and the windowed large-tensor writer
def test_safetensors_import_into_a_compressed_repository_exports_byte_identical(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, window: int
) -> None:
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    from cas_ckpt import hf

    monkeypatch.setattr(hf, "WINDOW", window)
    src = tmp_path / "model.safetensors"
    safetensors_numpy.save_file({"a": weights(1, 800_000, np.float32),
                                 "b": weights(2, 300_000, np.float16)}, str(src))
    with cas_ckpt.open(tmp_path / "r", compression="zstd") as repo:
        repo.import_safetensors(src, ref="m")
        report = repo.last_save
        assert report is not None and 0 < report.bytes_stored < 0.88 * report.bytes_written
        repo.export_safetensors("m", tmp_path / "out.safetensors")
    assert (tmp_path / "out.safetensors").read_bytes() == src.read_bytes()


def test_a_push_to_a_compressed_remote_stores_float_chunks_grouped(tmp_path: Path) -> None:
    with cas_ckpt.open(tmp_path / "local") as local:
        local.save(_state())
        with cas_ckpt.open(tmp_path / "remote", compression="zstd") as remote:
            report = local.push(remote, "main")
            assert report.bytes_sent > 0
            codecs = {e.codec for entries in remote.blocks.packs().values() for e in entries}
            assert CODEC_GROUPED in codecs
            assert remote.stats().stored_bytes < 0.9 * local.stats().stored_bytes
            assert_state_equal(_state(), remote.load("main"))


def test_small_tensors_given_blocks_of_their_own_are_compressed_grouped(tmp_path: Path) -> None:
    state = {"layers": {f"b{i}": weights(i, 2048, np.float32) for i in range(40)}}  # 8 KiB each
    with cas_ckpt.open(tmp_path / "r", compression="zstd") as repo:
        cid = repo.save(state)
        codecs = [e.codec for entries in repo.blocks.packs().values() for e in entries]
        assert codecs.count(CODEC_GROUPED) == 40
        assert_state_equal(state, repo.load(cid))
