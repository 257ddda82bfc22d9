"""Many payloads through cas_ckpt._headers.decode_map, for valgrind (tests/test_codec.py, slow).

Headers of the subset and outside it, each also cut short at every length and with bytes
changed at random; what is decoded must be msgpack's value. Prints ``ok``.
"""

from __future__ import annotations

import random

import msgpack

from cas_ckpt import cid as cidlib
from cas_ckpt import codec
from cas_ckpt.codec import Link

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
    for variant in variants:
        fast = codec._decode_map(variant)
        assert fast is None or fast == decoded_by_msgpack(variant), variant.hex()
print("ok")
