"""Child of test_fuzz: memory bombs, loaded under an address-space limit.

Each case stores a small hostile DAG in a memory repository, under correct CIDs, that declares far
more than it holds (one chunk repeated, pages repeated, link pages repeated, nodes linked many
times, a huge node), then loads it (and some diff or list it). Prints a JSON object: case ->
"ours:<error> <seconds>", "ok <seconds>" or "other:<error> <seconds>" (CPU seconds: on a
machine shared with other jobs, wall time measures them too). The parent requires
ours/ok, that no case takes long, and that the expanding ones are ``ExpansionLimit``.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from typing import Any

LIMIT = 1024**3
LONG = os.environ.get("CAS_CKPT_LONG") == "1"
resource.setrlimit(resource.RLIMIT_AS, (LIMIT, LIMIT))

import cas_ckpt  # noqa: E402 - after the limit, so everything lives under it
from cas_ckpt import cid as cidlib  # noqa: E402
from cas_ckpt import codec  # noqa: E402
from cas_ckpt.codec import Link, Tagged  # noqa: E402

H = cidlib.Hasher()
MIB = 1024 * 1024


def world() -> tuple[cas_ckpt.Repository, Any]:
    repo = cas_ckpt.Repository(cas_ckpt.blocks.MemoryStore(), cas_ckpt.refs.MemoryRefStore())

    def put(data: bytes, raw: bool = False) -> bytes:
        cid = H.raw(data) if raw else H.node(data)
        repo.blocks.put(cid, data)
        return cid

    return repo, put


def repeated_chunk_array() -> Any:
    repo, put = world()
    chunk = put(b"\0" * MIB, raw=True)
    n = 16384  # 16 GiB declared by a ~600 KB node
    header = {"dtype": "|u1", "shape": [n * MIB], "chunk_size": MIB, "chunks": [Link(chunk)] * n}
    return repo, put(codec.encode(Tagged(3, header)))


def repeated_link_pages() -> Any:
    repo, put = world()
    chunk = put(b"\0" * 4096, raw=True)
    page = put(codec.encode([Link(chunk)] * 16384))
    pages = 4096  # 2**26 chunks of 4 KiB: 256 GiB, from two small nodes
    header = {
        "dtype": "|u1",
        "shape": [pages * 16384 * 4096],
        "chunk_size": 4096,
        "chunk_pages": [Link(page)] * pages,
    }
    return repo, put(codec.encode(Tagged(3, header)))


def repeated_chunk_blob() -> Any:
    repo, put = world()
    chunk = put(b"\1" * MIB, raw=True)
    n = 16384
    return repo, put(codec.encode(Tagged(4, {"size": n * MIB, "chunks": [Link(chunk)] * n})))


def repeated_pages() -> Any:
    repo, put = world()
    page = put(codec.encode([None] * 200_000))
    return repo, put(codec.encode(Tagged(6, {"kind": "list", "pages": [Link(page)] * 100_000})))


def repeated_small_pages() -> Any:
    """issue #40: a 4 MB node linking one 1,000-item page 100,000 times, within every per-node
    limit: 100 million items, 203 s and 1.6 GB to load, a bare MemoryError from diff."""
    repo, put = world()
    page = put(codec.encode([None] * 1000))
    return repo, put(codec.encode(Tagged(6, {"kind": "list", "pages": [Link(page)] * 100_000})))


def repeated_subtree_nodes() -> Any:
    """A 90 KB node (a list of its own, as a writer makes for a container over 64 KiB) linked
    20,000 times: 1.8 GB of nodes to decode from 850 KB stored."""
    repo, put = world()
    shared = put(codec.encode([f"{i:088d}" for i in range(1000)]))
    return repo, put(codec.encode([Link(shared)] * 20_000))


def repeated_map_pages() -> Any:
    repo, put = world()
    page = put(codec.encode({"k": 1}))
    return repo, put(codec.encode(Tagged(6, {"kind": "map", "pages": [Link(page)] * 300_000})))


def repeated_subtrees() -> Any:
    repo, put = world()
    chunk = put(b"\0" * MIB, raw=True)
    array = put(
        codec.encode(
            Tagged(3, {"dtype": "|u1", "shape": [64 * MIB], "chunk_size": MIB, "chunks": [Link(chunk)] * 64})
        )
    )
    return repo, put(codec.encode([Link(array)] * 10_000))  # 640 GiB of arrays


def shared_explosion() -> Any:
    repo, put = world()
    cid = put(codec.encode([None]))
    for _ in range(60):  # 2**60 leaves from 60 tiny nodes: each links twice to the one below
        cid = put(codec.encode([Link(cid), Link(cid)]))
    return repo, cid


def shared_explosion_in_pages() -> Any:
    repo, put = world()
    cid = put(codec.encode([None] * 8))
    for _ in range(40):
        cid = put(codec.encode(Tagged(6, {"kind": "list", "pages": [Link(cid)] * 2})))
        cid = put(codec.encode([Link(cid)]))
    return repo, cid


def huge_declared_shape() -> Any:
    repo, put = world()
    chunk = put(b"\0" * 8, raw=True)
    header = {"dtype": "<f8", "shape": [2**40, 2**20], "chunk_size": MIB, "chunks": [Link(chunk)]}
    return repo, put(codec.encode(Tagged(3, header)))


def big_node() -> Any:
    repo, put = world()
    size = (60 if LONG else 8) * MIB  # near the 64 MiB node limit: linear work, bounded memory
    return repo, put(b"\xdd" + size.to_bytes(4, "big") + b"\xc0" * size)


def big_bigint() -> Any:
    repo, put = world()
    return repo, put(codec.encode(Tagged(2, b"\x7f" * (8 * MIB))))


CASES = [
    repeated_chunk_array,
    repeated_link_pages,
    repeated_chunk_blob,
    repeated_pages,
    repeated_small_pages,
    repeated_subtree_nodes,
    repeated_map_pages,
    repeated_subtrees,
    shared_explosion,
    shared_explosion_in_pages,
    huge_declared_shape,
    big_node,
    big_bigint,
]


def load(repo: cas_ckpt.Repository, root: bytes) -> None:
    value = repo.load(root)
    del value


def diff(repo: cas_ckpt.Repository, root: bytes) -> None:
    repo.diff(root, repo.save({"other": 1}))


def ls(repo: cas_ckpt.Repository, root: bytes) -> None:
    from cas_ckpt.maintenance.diff import leaves
    from cas_ckpt.tree import TreeReader

    leaves(TreeReader(repo.blocks, repo.pool), Link(root))


# Cases run by each of these besides load: (operation, case).
OTHERS = [(diff, repeated_small_pages), (diff, repeated_subtree_nodes), (ls, repeated_small_pages)]


def main() -> None:
    results = {}
    for operation, case in [(load, case) for case in CASES] + OTHERS:
        name = case.__name__ if operation is load else f"{operation.__name__}:{case.__name__}"
        started = time.process_time()  # CPU seconds, all threads: the work, whatever the load
        try:
            operation(*case())
            outcome = "ok"
        except cas_ckpt.CasCkptError as exc:
            outcome = f"ours:{type(exc).__name__}"
        except BaseException as exc:
            outcome = f"other:{type(exc).__name__}:{str(exc)[:80]}"
        results[name] = f"{outcome} {time.process_time() - started:.1f}"
        print(name, results[name], file=sys.stderr, flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
