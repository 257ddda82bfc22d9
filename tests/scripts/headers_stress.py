"""Many payloads through cas_ckpt._headers.decode_map, and containers through pick_small and
small_container, for valgrind (tests/test_codec.py, slow).

Headers of the subset and outside it, each also cut short at every length and with bytes
changed at random; what is decoded must be msgpack's value. Each decoded header then stands in
a container for pick_small, beside values of other kinds; every key must come back, the
arrays it makes being of the header's shape. Containers of arrays of many shapes and dtypes,
keys of every width and CIDs of several lengths then go through small_container, whose bytes
must be the item-by-item encoding (or None where it gives way). Prints ``ok``.
"""

from __future__ import annotations

import random

import msgpack
import numpy as np

from cas_ckpt import _headers, _small, codec, tree
from cas_ckpt import cid as cidlib
from cas_ckpt.codec import Link, Tagged

rng = random.Random(7)
hasher = cidlib.Hasher()
links = [Link(hasher.raw(bytes([i]))) for i in range(4)] + [Link(hasher.node(b"n"))]
values = ["<f4", "x" * 31, "y" * 32, "é" * 20, 0, 127, 128, 2**16, 2**32, 2**64 - 1, [],
          [3, 100], links[:2], [1, links[4]], True, None, -1, b"raw"]


def payloads() -> list[bytes]:
    made = []
    for _ in range(300):
        names = ["dtype", "shape", "chunk_size", "chunks", "order", "kind", "k" * 31]
        keys = rng.sample(names, rng.randint(0, len(names)))
        made.append(codec.encode({k: rng.choice(values) for k in keys}))
    return made


def decoded_by_msgpack(payload: bytes) -> object:
    try:
        return msgpack.unpackb(payload, ext_hook=codec._Decoder(None).ext_hook, raw=False,
                               strict_map_key=False, use_list=True)
    except Exception:
        return Exception


arena: list[object] = [None, 0, 0]  # one load's buffers of small arrays, kept across containers
for payload in payloads():
    variants = [payload[:n] for n in range(len(payload) + 1)]
    for _ in range(20):
        changed = bytearray(payload)
        if changed:
            changed[rng.randrange(len(changed))] = rng.randrange(256)
        variants.append(bytes(changed))
    variants.append(rng.randbytes(rng.randint(0, 64)))
    container = {}
    for i, variant in enumerate(variants):
        fast = codec._decode_map(variant)
        assert fast is None or fast == decoded_by_msgpack(variant), variant.hex()
        container[i] = Tagged(tree.NDARRAY, fast) if fast is not None else variant
    container["usual"] = Tagged(tree.NDARRAY, {"dtype": "<f4", "shape": [3, 2], "chunk_size": 64,
                                               "chunks": links[:1]})
    out, cids, arrays, rest = tree._pick_small(container, arena)
    assert list(out) == list(container) and len(cids) == len(arrays) == len(out) - len(rest)
    assert all(type(a) is np.ndarray for a in arrays) and out["usual"].shape == (3, 2)
    for array in arrays:
        array.view(np.uint8).fill(0xAB)  # every byte of every array is inside its buffer

packer = codec.packer()
dtypes = [np.dtype(n) for n in ("<f4", "<f8", "|u1", ">i2", "<c8")]
keys_pool = ["", "k" * 31, "k" * 32, "é" * 200, "k" * 70000, 0, 127, 2**16, 2**63, -1, "\ud800"]
for _ in range(300):
    count = rng.randint(0, 40)
    shapes = [tuple(rng.choice([0, 1, 3, 300, 70000]) for _ in range(rng.randint(0, 3)))
              if rng.random() < 0.9 else (0,) * rng.randint(0, 20) for _ in range(count)]
    arrays = [np.lib.stride_tricks.as_strided(np.zeros(1, rng.choice(dtypes)), s, (0,) * len(s))
              for s in shapes]  # any shape, no memory behind it
    cids = [hasher.raw(bytes([i % 256])) if rng.random() < 0.95 else bytes(rng.randint(0, 40))
            for i in range(count)]
    keys = [rng.choice(keys_pool) for _ in range(count)] if rng.random() < 0.7 else None
    parts: dict[int, tuple[bytes, bytes]] = {}
    limit = rng.choice([1 << 20, rng.randint(0, 4000)])
    while type(got := _headers.small_container(keys, arrays, cids, tree.NDARRAY, parts, limit)) is int:
        before, after = _small._around_shape(tree._small_dtype(arrays[got]), 4096, packer)
        parts[id(arrays[got].dtype)] = (before, after + _small._LINK_36)
    if got is not None:
        encodings = _small.one_chunk_encodings(tree.NDARRAY, arrays, cids, 4096, packer, tree._small_dtype)
        pairs = encodings if keys is None else \
            [packer.pack(k) + e for k, e in zip(keys, encodings, strict=True)]
        head = packer.pack_array_header(count) if keys is None else packer.pack_map_header(count)
        assert got == head + b"".join(pairs)
print("ok")
