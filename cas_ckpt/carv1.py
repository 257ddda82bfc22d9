"""The bytes of a CAR v1 stream (https://ipld.io/specs/transport/car/carv1/), written::

    varint(len(header)) | DAG-CBOR {"roots": [CID], "version": 1}
    varint(len(cid) + len(data)) | binary CID | block bytes      (repeated)

Encoding only, below the block stores: an export (:mod:`cas_ckpt.car`) and a push over HTTP
(:mod:`cas_ckpt.blocks.http`) write these; :mod:`cas_ckpt.car` reads them back.
"""

from __future__ import annotations

__all__ = ["CID_TAG", "car_header", "encode_header", "encode_varint", "section_prefix"]

CID_TAG = 42


def encode_varint(value: int) -> bytes:
    """Unsigned LEB128 (multiformats unsigned-varint)."""
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _cbor_head(major: int, value: int) -> bytes:
    if value < 24:
        return bytes([major << 5 | value])
    for info, size in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if value < 1 << (8 * size):
            return bytes([major << 5 | info]) + value.to_bytes(size, "big")
    raise ValueError("CBOR argument too large")


def encode_header(roots: list[bytes]) -> bytes:
    """The DAG-CBOR header ``{"roots": [...], "version": 1}`` (keys in DAG-CBOR order)."""
    out = bytearray(_cbor_head(5, 2))
    out += _cbor_head(3, 5) + b"roots" + _cbor_head(4, len(roots))
    for root in roots:
        payload = b"\x00" + root  # tag 42 holds the identity multibase prefix, then the CID
        out += _cbor_head(6, CID_TAG) + _cbor_head(2, len(payload)) + payload
    out += _cbor_head(3, 7) + b"version" + _cbor_head(0, 1)
    return bytes(out)


def car_header(roots: list[bytes]) -> bytes:
    """The start of a CAR v1 file with these roots: the header and its length."""
    header = encode_header(roots)
    return encode_varint(len(header)) + header


def section_prefix(cid: bytes, data: bytes | memoryview) -> bytes:
    """What goes before a block's bytes in a CAR v1 file: the section's length and the CID."""
    return encode_varint(len(cid) + memoryview(data).nbytes) + cid
