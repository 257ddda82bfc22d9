"""Many payloads through cas_ckpt._headers.decode_map, and containers through pick_small, for
valgrind (tests/test_codec.py, slow).

Headers of the subset and outside it, each also cut short at every length and with bytes
changed at random; what is decoded must be msgpack's value. Each decoded header then stands in
a container for pick_small, beside values of other kinds; every key must come back, the
arrays it makes being of the header's shape. Prints ``ok``.
"""

from __future__ import annotations

import random

import msgpack
import numpy as np

from cas_ckpt import cid as cidlib
from cas_ckpt import codec, tree
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
    out, cids, arrays, rest = tree._pick_small(container)
    assert list(out) == list(container) and len(cids) == len(arrays) == len(out) - len(rest)
    assert all(type(a) is np.ndarray for a in arrays) and out["usual"].shape == (3, 2)
print("ok")
