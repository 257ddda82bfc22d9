"""Lossless block codecs: how a block's bytes are stored in a pack, never how they are named.

A CID always names the raw bytes; the codec is a property of one stored copy, recorded in its
pack's index entry (pack format 2, ``docs/format.md``). Codecs:

- ``CODEC_NONE`` (0): the raw bytes.
- ``CODEC_ZSTD`` (1): one zstd frame (RFC 8878) of the raw bytes. Nodes, byte blobs, integer
  arrays.
- ``CODEC_GROUPED`` (2): floating-point array bytes split into byte streams by position within
  each element (all first bytes, then all second bytes, ...). The streams that carry the sign and
  exponent are zstd frames, the mantissa streams are stored raw: trained weights' exponents
  take ~2.7 bits of 8, their mantissas are noise. Layout: ``u8 k`` (element size), then per
  stream ``u8 method`` (0 raw, 1 zstd) and ``u32 LE length``, then the streams back to back,
  then the ``raw_length mod k`` trailing bytes raw.

A block is stored raw when its encoding would not save at least :data:`MIN_SAVING` of it.
zstd (the ``zstandard`` binding) releases the GIL, so blocks are encoded on the writer's pool.
"""

from __future__ import annotations

import struct

import numpy as np
import zstandard

from cas_ckpt.blocks.base import MAX_BLOCK
from cas_ckpt.errors import CorruptStore

CODEC_NONE, CODEC_ZSTD, CODEC_GROUPED = 0, 1, 2
CODECS = (CODEC_NONE, CODEC_ZSTD, CODEC_GROUPED)
SETTINGS = ("none", "zstd")  # a repository's ``compression``
MIN_SAVING = 0.05
MIN_BLOCK = 512  # smaller blocks are stored raw: a frame header eats what they would save
FLOAT_SIZES = (2, 4, 8)

_STREAM = struct.Struct("<BI")
_RAW, _ZSTD = 0, 1
# Exponent streams are a few dozen symbols with short repeats: Huffman-coded literals do the
# work. A tiny match table (hash_log 8) and 7-byte matches find fewer, longer matches: measured on
# real weights, 0.34 of the stream at ~600 MB/s, against 0.39 at ~100 MB/s for level 1.
_EXPONENT_PARAMS = zstandard.ZstdCompressionParameters(
    strategy=zstandard.STRATEGY_FAST, window_log=17, hash_log=8, min_match=7)
_LEVEL = 1


def exponent_streams(itemsize: int) -> tuple[int, ...]:
    """The little-endian byte positions that hold the sign and exponent of a float of this size."""
    # float64's 11 exponent bits spill into its seventh byte; bf16/fp16 and fp32 fit the last one.
    return (6, 7) if itemsize == 8 else (itemsize - 1,)


class Compressor:
    """Encodes blocks for one writer (``setting`` is a repository's ``compression``).

    Thread-safe: every call makes its own zstd context (they are cheap, and not shareable).
    """

    def __init__(self, setting: str) -> None:
        check_setting(setting)
        self.setting = setting
        self.enabled = setting != "none"

    def encode(self, data: bytes | memoryview, float_size: int = 0) -> tuple[int, bytes | memoryview] | None:
        """``(codec, stored bytes)``, or None to store ``data`` raw.

        ``float_size``: the element size when ``data`` is a piece of a float array (2, 4, 8).
        """
        view = memoryview(data).cast("B")
        n = view.nbytes
        if not self.enabled or n < MIN_BLOCK:
            return None
        if float_size in FLOAT_SIZES and n >= float_size * MIN_BLOCK:
            stored = _group(view, float_size)
            codec = CODEC_GROUPED
        else:
            stored = zstandard.ZstdCompressor(level=_LEVEL).compress(view)
            codec = CODEC_ZSTD
        if memoryview(stored).nbytes > n * (1 - MIN_SAVING):
            return None
        return codec, stored


def check_setting(setting: object) -> str:
    if setting not in SETTINGS:
        raise ValueError(f"unknown compression {setting!r}; choose one of {list(SETTINGS)}")
    return setting  # type: ignore[return-value]


def _group(view: memoryview, k: int) -> memoryview:
    m = view.nbytes // k
    elements = np.frombuffer(view, np.uint8, m * k).reshape(m, k)
    coded = exponent_streams(k)  # always the last streams: the raw ones have fixed offsets
    head = 1 + k * _STREAM.size
    out = np.empty(head + view.nbytes, np.uint8)  # never larger: a stream that grows stays raw
    out[0] = k
    pos = head
    for j in range(k - len(coded)):
        out[pos : pos + m] = elements[:, j]
        _STREAM.pack_into(out, 1 + j * _STREAM.size, _RAW, m)
        pos += m
    for j in coded:
        stream = np.ascontiguousarray(elements[:, j])
        packed = zstandard.ZstdCompressor(compression_params=_EXPONENT_PARAMS).compress(stream)
        method, body = (_ZSTD, packed) if len(packed) <= m * (1 - MIN_SAVING) else (_RAW, stream)
        n = len(body) if method == _ZSTD else m
        out[pos : pos + n] = np.frombuffer(body, np.uint8)
        _STREAM.pack_into(out, 1 + j * _STREAM.size, method, n)
        pos += n
    tail = view.nbytes - m * k
    out[pos : pos + tail] = np.frombuffer(view[m * k :], np.uint8)
    return memoryview(out[: pos + tail])


def decode_into(codec: int, stored: bytes | memoryview, out: memoryview, where: object) -> None:
    """Decode a stored block into ``out`` (exactly its raw size); :class:`CorruptStore` naming
    ``where`` if the stored bytes do not decode to that size."""
    out = out.cast("B")
    if out.nbytes > MAX_BLOCK:
        raise CorruptStore(where, f"stored block claims a raw length of {out.nbytes} bytes, over "
                           f"the {MAX_BLOCK} any block may hold")
    try:
        if codec == CODEC_NONE:
            if memoryview(stored).nbytes != out.nbytes:
                raise ValueError("stored size differs from the block size")
            out[:] = stored
        elif codec == CODEC_ZSTD:
            out[:] = _unzstd(stored, out.nbytes)
        elif codec == CODEC_GROUPED:
            _ungroup_into(memoryview(stored).cast("B"), out)
        else:
            raise ValueError(f"unknown codec {codec}")
    except (ValueError, zstandard.ZstdError, struct.error) as exc:
        raise CorruptStore(where, f"stored block does not decode: {exc}") from None


def decode(codec: int, stored: bytes | memoryview, size: int, where: object) -> bytes:
    """The raw bytes of a stored block of raw ``size`` bytes.

    A size over any block's (``MAX_BLOCK``) is :class:`CorruptStore` before anything is
    allocated: the index a size comes from is data, not trusted.
    """
    if codec == CODEC_NONE and memoryview(stored).nbytes == size:
        return bytes(stored)
    if not 0 <= size <= MAX_BLOCK:
        raise CorruptStore(where, f"stored block claims a raw length of {size} bytes, over the "
                           f"{MAX_BLOCK} any block may hold")
    out = bytearray(size)
    decode_into(codec, stored, memoryview(out), where)
    return bytes(out)


def _unzstd(frame: bytes | memoryview, size: int) -> bytes:
    # decompress() sizes its output by the content size a frame declares, ignoring
    # max_output_size: a frame declaring another size is refused before anything is allocated.
    # ``size`` itself is bounded by the callers (decode, decode_into: MAX_BLOCK at most).
    declared = zstandard.frame_content_size(frame)
    if declared not in (-1, size):  # -1: not declared
        raise ValueError(f"zstd frame declares {declared} bytes, not {size}")
    # max_output_size bounds the work on a frame that declares no size; one byte more catches a longer one.
    raw = zstandard.ZstdDecompressor().decompress(frame, max_output_size=size + 1)
    if len(raw) != size:
        raise ValueError(f"zstd frame holds {len(raw)} bytes, not {size}")
    return raw


def _ungroup_into(stored: memoryview, out: memoryview) -> None:
    k = stored[0] if stored.nbytes else 0
    if k not in FLOAT_SIZES:
        raise ValueError(f"bad element size {k}")
    m = out.nbytes // k
    heads = [_STREAM.unpack_from(stored, 1 + j * _STREAM.size) for j in range(k)]
    pos = 1 + k * _STREAM.size
    elements = np.frombuffer(out, np.uint8, m * k).reshape(m, k)
    for j, (method, length) in enumerate(heads):
        body = stored[pos : pos + length]
        if body.nbytes != length:
            raise ValueError("stream runs past the block")
        pos += length
        if method == _RAW:
            if length != m:
                raise ValueError(f"raw stream of {length} bytes, not {m}")
            elements[:, j] = np.frombuffer(body, np.uint8)
        elif method == _ZSTD:
            elements[:, j] = np.frombuffer(_unzstd(body, m), np.uint8)
        else:
            raise ValueError(f"unknown stream method {method}")
    tail = stored[pos:]
    if tail.nbytes != out.nbytes - m * k:
        raise ValueError("trailing bytes do not match the block size")
    out[m * k :] = tail
