"""CIDs: the fast path is byte-identical to multiformats, and parsing is strict."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given
from hypothesis import strategies as st
from multiformats import CID, multihash

import cas_ckpt
from cas_ckpt import cid as cidlib

HASHES = ["sha2-256", "blake3"]
CODECS = ["raw", "messagepack"]
EMPTY_RAW_SHA256 = "bafkreihdwdcefgh4dqkjv67uzcmw7ojee6xedzdetojuzjevtenxquvyku"
BASE32 = "abcdefghijklmnopqrstuvwxyz234567"


def reference_cid(data: bytes, codec: str, hash_name: str) -> CID:
    """The CID multiformats computes itself (its own hashing, its own encoding)."""
    return CID("base32", 1, codec, multihash.digest(data, hash_name, size=32))


def fast_cid(data: bytes, codec: str, hash_name: str) -> bytes:
    hasher = cidlib.Hasher(hash_name)
    return hasher.raw(data) if codec == "raw" else hasher.node(data)


@given(
    data=st.binary(max_size=2048),
    codec=st.sampled_from(CODECS),
    hash_name=st.sampled_from(HASHES),
)
def test_fast_path_equals_multiformats(data: bytes, codec: str, hash_name: str) -> None:
    expected = reference_cid(data, codec, hash_name)
    binary = fast_cid(data, codec, hash_name)
    assert binary == bytes(expected)
    assert cidlib.to_str(binary) == str(expected)
    assert cidlib.to_cid(binary) == expected
    assert str(cidlib.to_cid(binary)) == str(expected)
    assert cidlib.to_cid(binary).codec.name == codec
    assert cidlib.to_cid(binary).hashfun.name == hash_name
    # Every accepted form parses back to the same binary CID.
    assert cidlib.to_bytes(str(expected)) == binary
    assert cidlib.to_bytes(expected) == binary
    assert cidlib.to_bytes(expected.set(base="base58btc")) == binary
    assert cidlib.to_bytes(expected.encode("base58btc")) == binary
    assert cidlib.to_bytes(bytes(expected)) == binary
    assert cidlib.matches(binary, data)
    assert cidlib.is_node(binary) == (codec == "messagepack")
    assert cidlib.codec_of(binary) == (cidlib.RAW if codec == "raw" else cidlib.MSGPACK)
    # to_cid skips multiformats' runtime checks: the object must be the one decode gives.
    built, decoded = cidlib.to_cid(binary), CID.decode(binary).set(base="base32")
    assert type(built) is CID and hash(built) == hash(decoded)
    assert (built.base, built.version, built.codec, built.hashfun, built.digest, built.raw_digest) == (
        decoded.base, decoded.version, decoded.codec, decoded.hashfun, decoded.digest,
        decoded.raw_digest)
    assert (str(built), repr(built), bytes(built)) == (str(decoded), repr(decoded), bytes(decoded))
    assert built.set(base="base58btc") == decoded.set(base="base58btc")


@given(data=st.binary(min_size=1, max_size=256), hash_name=st.sampled_from(HASHES))
def test_matches_rejects_other_content(data: bytes, hash_name: str) -> None:
    binary = cidlib.Hasher(hash_name).raw(data)
    assert not cidlib.matches(binary, data[:-1])
    assert not cidlib.matches(binary, bytes([data[0] ^ 1]) + data[1:])


def test_known_vector_empty_raw_block() -> None:
    assert cidlib.to_str(cidlib.Hasher().raw(b"")) == EMPTY_RAW_SHA256
    assert str(cidlib.to_cid(cidlib.Hasher().raw(b""))) == EMPTY_RAW_SHA256
    assert cidlib.to_bytes(EMPTY_RAW_SHA256).hex() == (
        "01551220e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
    )


def test_known_vector_through_a_repository_store() -> None:
    with cas_ckpt.open("memory://") as repo:
        assert repo.blocks.put(EMPTY_RAW_SHA256, b"") is True
        assert repo.blocks.get(CID.decode(EMPTY_RAW_SHA256)) == b""


def test_blake3_digest_is_the_blake3_of_the_data() -> None:
    import blake3

    binary = cidlib.Hasher("blake3").raw(b"abc")
    assert binary[-32:] == blake3.blake3(b"abc").digest()
    assert binary[:4] == b"\x01\x55\x1e\x20"
    binary = cidlib.Hasher("sha2-256").node(b"abc")
    assert binary == b"\x01\x81\x04\x12\x20" + hashlib.sha256(b"abc").digest()


def test_unknown_hash_name_is_refused() -> None:
    with pytest.raises(ValueError, match="sha2-512"):
        cidlib.Hasher("sha2-512")


# -- strict parsing ------------------------------------------------------------------------------
_SHA = hashlib.sha256(b"x").digest()
_VALID = b"\x01\x55\x12\x20" + _SHA


def _mh(code: int, digest: bytes) -> bytes:
    return bytes([code, len(digest)]) + digest


INVALID_BINARY = {
    "cidv0": bytes(CID("base58btc", 0, "dag-pb", multihash.wrap(_SHA, "sha2-256"))),
    "version 2": b"\x02\x55\x12\x20" + _SHA,
    "short digest": b"\x01\x55" + _mh(0x12, _SHA[:31]),
    "long digest": b"\x01\x55" + _mh(0x12, _SHA + b"\x00"),
    "truncated digest": _VALID[:-1],
    "trailing byte": _VALID + b"\x00",
    "trailing cid": _VALID + _VALID,
    "dag-cbor codec": bytes(CID("base32", 1, "dag-cbor", multihash.wrap(_SHA, "sha2-256"))),
    "dag-pb codec": bytes(CID("base32", 1, "dag-pb", multihash.wrap(_SHA, "sha2-256"))),
    "sha2-512": bytes(CID("base32", 1, "raw", multihash.digest(b"x", "sha2-512"))),
    "identity hash": bytes(CID("base32", 1, "raw", multihash.wrap(b"x" * 32, "identity"))),
    "empty": b"",
    "prefix only": b"\x01\x55\x12\x20",
    "codec only": b"\x01\x55",
    "msgpack codec cut": b"\x01\x81",
    "msgpack codec, hash code only": b"\x01\x81\x04\x12",  # no digest length byte
    "digest length byte wrong": b"\x01\x55\x12\x21" + _SHA,  # declares 33, holds 32
}


@pytest.mark.parametrize("binary", INVALID_BINARY.values(), ids=INVALID_BINARY.keys())
def test_invalid_binary_cids_are_rejected(binary: bytes) -> None:
    with pytest.raises(cas_ckpt.errors.InvalidCID):
        cidlib.to_bytes(binary)
    with pytest.raises(cas_ckpt.errors.InvalidCID):
        cidlib.to_bytes(bytearray(binary))
    with pytest.raises(cas_ckpt.errors.InvalidCID):
        cidlib.check_binary(binary)


def _b32(binary: bytes) -> str:
    import base64

    return "b" + base64.b32encode(binary).decode().lower().rstrip("=")


INVALID_STRINGS = {
    "cidv0": str(CID("base58btc", 0, "dag-pb", multihash.wrap(_SHA, "sha2-256"))),
    "cidv0 lookalike": "Qm" + "a" * 44,
    "base58 v0 marker": "1" + "a" * 40,
    "empty": "",
    "multibase only": "b",
    "garbage": "hello world",
    "not base32": "b" + "!" * 50,
    "digits outside base32": "b" + "1890" * 14,
    "non-ascii": "bafkrei" + "é" * 50,
    "leading space": " " + EMPTY_RAW_SHA256,
    "trailing newline": EMPTY_RAW_SHA256 + "\n",
    "truncated": EMPTY_RAW_SHA256[:-4],
    "extra character": EMPTY_RAW_SHA256 + "a",
    "non-zero pad bits": EMPTY_RAW_SHA256[:-1] + "l",
    "unknown multibase": "\x00" + EMPTY_RAW_SHA256[1:],
    **{f"{name} (base32)": _b32(b) for name, b in INVALID_BINARY.items() if b},
}


@pytest.mark.parametrize("text", INVALID_STRINGS.values(), ids=INVALID_STRINGS.keys())
def test_invalid_cid_strings_are_rejected(text: str) -> None:
    with pytest.raises(cas_ckpt.errors.InvalidCID):
        cidlib.to_bytes(text)


@pytest.mark.parametrize("value", [None, 42, 1.5, ["bafy"], object()])
def test_non_cid_types_are_rejected(value: object) -> None:
    with pytest.raises(cas_ckpt.errors.InvalidCID, match=type(value).__name__):
        cidlib.to_bytes(value)  # type: ignore[arg-type]


def test_invalid_cid_is_a_value_error_in_the_hierarchy() -> None:
    with pytest.raises(ValueError) as info:
        cidlib.to_bytes("Qm" + "a" * 44)
    assert isinstance(info.value, cas_ckpt.CasCkptError)
    assert "CIDv0" in str(info.value)


def test_base32_case_and_padding_are_accepted_like_multiformats() -> None:
    for text in [
        "b" + EMPTY_RAW_SHA256[1:].upper(),
        "B" + EMPTY_RAW_SHA256[1:].upper(),
        EMPTY_RAW_SHA256 + "======",
    ]:
        assert cidlib.to_bytes(text) == bytes(CID.decode(text))


# -- fuzz ----------------------------------------------------------------------------------------
def _accepted_like_multiformats(value: object, parsed: bytes) -> None:
    """Whatever to_bytes accepts is a valid CID multiformats reads identically."""
    assert len(parsed) in (36, 37)
    assert cidlib.check_binary(parsed) == parsed
    assert cidlib.to_bytes(cidlib.to_str(parsed)) == parsed
    if isinstance(value, str):
        assert bytes(CID.decode(value)) == parsed


def _parse(value: object) -> None:
    try:
        parsed = cidlib.to_bytes(value)  # type: ignore[arg-type]
    except cas_ckpt.errors.InvalidCID:
        return
    _accepted_like_multiformats(value, parsed)


@given(st.binary(max_size=80))
def test_fuzz_random_bytes_raise_only_invalid_cid(data: bytes) -> None:
    _parse(data)
    _parse(b"\x01" + data)
    _parse(_VALID[: len(data) % 40] + data)


@given(st.text(max_size=80))
def test_fuzz_random_strings_raise_only_invalid_cid(text: str) -> None:
    _parse(text)
    _parse("b" + text)
    _parse("z" + text)


@given(
    data=st.binary(max_size=64),
    codec=st.sampled_from(CODECS),
    hash_name=st.sampled_from(HASHES),
    position=st.integers(0, 200),
    replacement=st.sampled_from(BASE32 + BASE32.upper() + "=018!"),
    cut=st.integers(0, 3),
)
def test_fuzz_mutated_valid_strings(
    data: bytes, codec: str, hash_name: str, position: int, replacement: str, cut: int
) -> None:
    text = str(reference_cid(data, codec, hash_name))
    i = position % len(text)
    mutated = text[:i] + replacement + text[i + 1 :]
    _parse(mutated)
    _parse(text[: len(text) - cut])
    _parse(text + replacement * cut)
    # Mutated binary forms: a flipped byte anywhere is either another valid CID or rejected.
    binary = bytearray(bytes(reference_cid(data, codec, hash_name)))
    binary[position % len(binary)] ^= 1 << (position % 8)
    _parse(bytes(binary))


def test_every_last_character_parses_exactly_like_multiformats() -> None:
    # The last base32 character carries padding bits: only the canonical ones are accepted.
    for char in BASE32:
        text = EMPTY_RAW_SHA256[:-1] + char
        try:
            expected: bytes | None = bytes(CID.decode(text))
        except Exception:
            expected = None
        try:
            ours: bytes | None = cidlib.to_bytes(text)
        except cas_ckpt.errors.InvalidCID:
            ours = None
        assert ours == expected, text
