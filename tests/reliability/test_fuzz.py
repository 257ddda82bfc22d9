"""Hostile input: only cas_ckpt's own errors, no hang, bounded memory.

Hostile nodes are stored under their correct CIDs (so every hash check passes and the decoder and
tree reader must defend themselves): random bytes, random msgpack with random extension types,
and structured lies (array headers with huge or negative shapes and few chunks, object and
datetime dtypes, wrong chunk sizes, missing or raw targets, malformed pages, bad bigints and
scalars, hostile commits). Each is loaded, sub-path selected, walked by fsck, GC and stats, and
logged. Also: the CID parser, ref-name validation (accepted names must work on disk), and CAR
import (mutated valid files: all or nothing). Deep link chains, deeply nested nodes, and memory
bombs (a small node declaring gigabytes through one repeated chunk, pages repeated) run in a child
process under an address-space limit and a timeout.

CI: a few hundred examples per target. ``CAS_CKPT_LONG=1``: many more, plus a seeded mutation
fuzzer over the decoder, CID parser, ref names and CAR import (over a million inputs in all).
"""

from __future__ import annotations

import io
import json
import math
import os
import random
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cas_ckpt
from cas_ckpt import cid as cidlib
from cas_ckpt import codec, hf
from cas_ckpt.codec import HistoryLink, Link, Tagged
from cas_ckpt.refs import check_ref_name

from ._support import HERE, LONG, PYTHON, child_env, record

EXAMPLES = 4000 if LONG else 300
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
COUNTS: dict[str, int] = {}
HASHER = cidlib.Hasher()


def _count(target: str, n: int = 1) -> None:
    COUNTS[target] = COUNTS.get(target, 0) + n


@pytest.fixture(scope="module", autouse=True)
def _figures() -> Iterator[None]:
    started = time.perf_counter()
    yield
    record("fuzz", **COUNTS, total=sum(COUNTS.values()), seconds=round(time.perf_counter() - started, 1))


def only_ours(call: Any, *args: Any, **kwargs: Any) -> Any:
    """Run ``call``; any exception must be a cas_ckpt error (returned instead of raised)."""
    try:
        return call(*args, **kwargs)
    except cas_ckpt.CasCkptError as exc:
        return exc


# ----------------------------------------------------------------------------------------------
# The node decoder
# ----------------------------------------------------------------------------------------------
@FUZZ
@given(st.binary(max_size=512))
def test_decode_random_bytes(data: bytes) -> None:
    _count("decode")
    only_ours(codec.decode, data)


leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=True),
    st.text(max_size=12),
    st.binary(max_size=24),
)
cid_payloads = st.one_of(
    st.just(HASHER.node(b"\xc0")),
    st.just(HASHER.raw(b"x")),
    st.binary(max_size=40),
    st.builds(lambda d: b"\x01\x55\x12\x20" + d, st.binary(min_size=30, max_size=34)),
)


def _ext(code: int, payload: Any) -> msgpack.ExtType:
    return msgpack.ExtType(code, payload if isinstance(payload, bytes) else msgpack.packb(payload))


raw_msgpack = st.recursive(
    leaves,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5),
        st.dictionaries(st.one_of(st.text(max_size=5), st.integers(-5, 5)), inner, max_size=5),
        st.builds(_ext, st.sampled_from([0, 1, 2, 3, 4, 5, 6, 7, 42, 43, 99, 127]), inner),
        st.builds(lambda p: msgpack.ExtType(42, p), cid_payloads),
        st.builds(lambda p: msgpack.ExtType(43, p), cid_payloads),
    ),
    max_leaves=30,
)


@FUZZ
@given(raw_msgpack, st.integers(0, 3), st.integers(0, 2**32))
def test_decode_random_msgpack(value: Any, mutate: int, seed: int) -> None:
    _count("decode")
    data = bytearray(msgpack.packb(value))
    rng = random.Random(seed)
    if mutate == 1 and data:
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    elif mutate == 2:
        del data[rng.randrange(len(data) + 1) :]
    elif mutate == 3:
        data.insert(rng.randrange(len(data) + 1), rng.randrange(256))
    only_ours(codec.decode, bytes(data))


def test_deeply_nested_node_is_refused() -> None:
    for depth in (600, 5_000, 100_000):
        data = b"\x91" * depth + b"\xc0"  # [[[...None...]]]
        result = only_ours(codec.decode, data)
        assert isinstance(result, (list, cas_ckpt.errors.DecodeError))
        ext_nest = b"\xc0"
        for _ in range(min(depth, 2_000)):
            ext_nest = codec.ext(1, ext_nest)
        assert isinstance(only_ours(codec.decode, ext_nest), (Tagged, cas_ckpt.errors.DecodeError))
        _count("decode", 2)


# ----------------------------------------------------------------------------------------------
# The tree reader, on hostile nodes stored under their correct CIDs
# ----------------------------------------------------------------------------------------------
class World:
    """A memory repository with a few real chunks and nodes that hostile nodes can link to."""

    def __init__(self) -> None:
        self.repo = cas_ckpt.Repository(cas_ckpt.blocks.MemoryStore(), cas_ckpt.refs.MemoryRefStore())
        self.chunks = [self.raw(bytes([i]) * size) for i, size in enumerate((1, 8, 4096, 5000))]
        self.nodes = [self.node(codec.encode(v)) for v in ({"a": 1}, [1, 2, 3], None)]
        self.missing = [HASHER.raw(b"never stored"), HASHER.node(b"\x90\x90")]

    def raw(self, data: bytes) -> bytes:
        cid = HASHER.raw(data)
        self.repo.blocks.put(cid, data)
        return cid

    def node(self, data: bytes) -> bytes:
        cid = HASHER.node(data)
        self.repo.blocks.put(cid, data)
        return cid


DTYPES = [
    "<f4",
    "<f8",
    "|u1",
    "|b1",
    "<i8",
    ">f4",
    "bfloat16",
    "int4",
    "float8_e4m3fn",
    "|O8",
    "<M8",
    "<m8",
    "<U4",
    "|V8",
    "|S3",
    "object",
    "<c16",
    "f4",
    "",
    3,
    None,
]


@st.composite
def hostile(draw: st.DrawFn, world: World, depth: int = 0) -> Any:
    """A value for a hostile node (links point at real, missing or raw blocks, or hostile nodes)."""
    choice = draw(st.integers(0, 11 if depth < 3 else 3))
    if choice == 0:
        return draw(leaves)
    if choice == 1:
        return Link(draw(st.sampled_from(world.chunks + world.nodes + world.missing)))
    if choice == 2:
        return HistoryLink(draw(st.sampled_from(world.nodes + world.missing)))
    if choice == 3:
        return Tagged(draw(st.integers(0, 127)), draw(leaves))
    if choice == 4:
        return draw(st.lists(hostile(world, depth + 1), max_size=4))
    if choice == 5:
        keys = st.one_of(st.text(max_size=4), st.integers(-3, 3), st.none(), st.binary(max_size=3))
        return draw(st.dictionaries(keys, hostile(world, depth + 1), max_size=4))
    if choice == 6:
        return Tagged(1, draw(st.one_of(st.lists(hostile(world, depth + 1), max_size=3), leaves)))
    if choice == 7:
        return Tagged(3, draw(array_header(world)))
    if choice == 8:
        header = {
            "size": draw(st.one_of(st.integers(-5, 20_000), st.just(2**64 - 1), leaves)),
            "chunks": draw(chunk_links(world)),
        }
        if draw(st.booleans()):
            header["str"] = draw(st.one_of(st.booleans(), leaves))
        return Tagged(4, header)
    if choice == 9:
        return Tagged(5, {"dtype": draw(st.sampled_from(DTYPES)), "data": draw(st.binary(max_size=17))})
    if choice == 10:
        pages = [
            Link(world.node(codec.encode(draw(hostile(world, depth + 1)))))
            for _ in range(draw(st.integers(0, 3)))
        ]
        pages += draw(
            st.lists(st.sampled_from([Link(c) for c in world.missing + world.chunks]) | leaves, max_size=2)
        )
        kind = draw(st.sampled_from(["map", "list", "tuple", "set", 7]))
        return Tagged(6, {"kind": kind, "pages": pages} if draw(st.booleans()) else pages)
    # a link to a hostile node of its own
    return Link(world.node(codec.encode(draw(hostile(world, depth + 1)))))


@st.composite
def chunk_links(draw: st.DrawFn, world: World) -> Any:
    links = draw(
        st.lists(
            st.sampled_from([Link(c) for c in world.chunks + world.missing + world.nodes]) | leaves,
            max_size=6,
        )
    )
    return links if draw(st.integers(0, 5)) else draw(leaves)


@st.composite
def array_header(draw: st.DrawFn, world: World) -> Any:
    dims = st.one_of(
        st.integers(0, 64),
        st.integers(-3, -1),
        st.just(2**63 - 1),
        st.just(2**64 - 1),
        st.floats(),
        st.text(max_size=2),
    )
    header: dict[str, Any] = {
        "dtype": draw(st.sampled_from(DTYPES)),
        "shape": draw(
            st.one_of(st.lists(dims, max_size=5), st.lists(st.just(0), min_size=60, max_size=70), leaves)
        ),
    }
    if draw(st.booleans()):
        header["data"] = draw(st.one_of(st.binary(max_size=64), leaves))
    else:
        header["chunk_size"] = draw(st.one_of(st.integers(-1, 2**21), leaves))
        if draw(st.integers(0, 4)):
            header["chunks"] = draw(chunk_links(world))
        else:
            page = world.node(codec.encode(draw(chunk_links(world))))
            header["chunk_pages"] = [Link(page), *draw(st.lists(leaves, max_size=1))]
    for key, values in (("order", ["C", "F", "K", 1]), ("kind", ["numpy", "torch", "jax", None])):
        if draw(st.booleans()):
            header[key] = draw(st.sampled_from(values))
    return header


def _commit(world: World, tree: Any, draw: st.DrawFn) -> bytes:
    node = {
        "type": "cas_ckpt.commit",
        "version": draw(st.sampled_from([1, 0, 2, -1, "1", None])),
        "tree": tree,
        "parents": draw(
            st.one_of(
                st.lists(st.sampled_from([HistoryLink(n) for n in world.nodes]) | leaves, max_size=2), leaves
            )
        ),
        "step": draw(st.one_of(st.integers(-5, 5), leaves)),
        "time": draw(st.one_of(st.floats(), leaves)),
        "metadata": draw(st.one_of(st.dictionaries(st.text(max_size=3), leaves, max_size=2), leaves)),
        "message": draw(st.one_of(st.text(max_size=5), leaves)),
    }
    return world.node(codec.encode(node))


@settings(FUZZ, max_examples=EXAMPLES)
@given(st.data())
def test_tree_reader_on_hostile_nodes(data: st.DataObject) -> None:
    world = World()
    value = data.draw(hostile(world))
    root = world.node(codec.encode(value))
    tree = Link(root) if data.draw(st.booleans()) else data.draw(hostile(world))
    commit = _commit(world, tree, data.draw)
    repo = world.repo
    _count("tree_reader")
    for target in (root, commit):
        only_ours(repo.load, target)
        only_ours(repo.load, target, path=data.draw(st.sampled_from(["0", "a", "a.0", "-1", "x.y"])))
        only_ours(repo.load, target, path=[data.draw(st.one_of(st.integers(-2, 2), st.text(max_size=2)))])
    only_ours(repo.commit, commit)
    only_ours(lambda: list(repo.log(commit)))
    only_ours(repo.diff, root, commit)
    repo.refs_store.set_if_equals("main", None, commit)
    repo.refs_store.set_if_equals("other", None, root)
    report = repo.fsck()  # reports, never raises
    assert isinstance(report.ok, bool)
    only_ours(repo.stats)
    only_ours(repo.gc)


def test_deep_link_chains_are_refused_not_overflowed() -> None:
    world = World()
    for depth in (100, 300, 2_000, 20_000) if LONG else (100, 300, 2_000):
        cid = world.chunks[0]
        tail = world.node(codec.encode([1]))
        for shape in ("link", "list", "dict", "tuple"):
            cid = tail
            for _ in range(depth):
                wrapped = {
                    "link": Link(cid),
                    "list": [Link(cid)],
                    "dict": {"k": Link(cid)},
                    "tuple": Tagged(1, [Link(cid)]),
                }[shape]
                cid = world.node(codec.encode(wrapped))
            result = only_ours(world.repo.load, cid)
            assert depth <= 300 or isinstance(result, cas_ckpt.errors.DecodeError), (depth, shape)
            world.repo.refs_store.set_if_equals("deep", None, cid)
            assert isinstance(world.repo.fsck().ok, bool)
            only_ours(world.repo.gc)
            _count("tree_reader")


# ----------------------------------------------------------------------------------------------
# Memory bombs: in a child with an address-space limit and a timeout
# ----------------------------------------------------------------------------------------------
def test_memory_bombs_under_an_address_space_limit() -> None:
    proc = subprocess.run(  # the timeout catches a hang; the CPU time each case took, the work
        [PYTHON, str(HERE / "_bomb_child.py")], capture_output=True, text=True, env=child_env(), timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    bad = {case: outcome for case, outcome in results.items() if not outcome.startswith(("ours:", "ok"))}
    assert not bad, f"not a cas_ckpt error: {bad}"
    seconds = {case: float(outcome.rsplit(" ", 1)[1]) for case, outcome in results.items()}
    slow = {case: results[case] for case, cpu in seconds.items() if cpu > 30}
    assert not slow, f"took too long: {slow}"
    assert sum(seconds.values()) < 120, results
    # Trees that expand far beyond their stored bytes are refused as such, whatever memory is left.
    expanding = {case: outcome for case, outcome in results.items()
                 if case.endswith(("repeated_small_pages", "repeated_subtree_nodes"))}
    assert len(expanding) == 5, results
    assert all(o.startswith("ours:ExpansionLimit") for o in expanding.values()), expanding
    _count("memory_bombs", len(results))


# ----------------------------------------------------------------------------------------------
# safetensors: hostile headers in, hostile checkpoint records out (issue #40)
# ----------------------------------------------------------------------------------------------
ST_DTYPES = st.one_of(
    st.sampled_from(list(hf.DTYPES)),
    st.sampled_from(["f32", "", "F32 ", "BF16\0", "__proto__"]),
    st.lists(st.sampled_from(["F32", "U8"]), max_size=2),
    st.dictionaries(st.text(max_size=2), st.integers(-5, 5), max_size=1),
    st.integers(-1, 2**64 - 1), st.none(), st.booleans(), st.floats(),
)
ST_SHAPES = st.one_of(
    st.lists(st.integers(0, 6), max_size=4),
    st.lists(st.just(1), min_size=60, max_size=120),
    st.just([1] * 10_000),
    st.sampled_from([[2**63, 2**63, 0], [2**62, 2**62, 0], [2**64 - 1, 0], [0, 2**64 - 1], [2**61, 0]]),
    st.lists(st.integers(-2, 2**64 - 1), max_size=3),
    st.lists(st.text(max_size=2) | st.floats() | st.none(), max_size=2),
    st.integers(-1, 9), st.text(max_size=3), st.none(), st.floats(),
)


json_leaves = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(),
                        st.text(max_size=6))


def _st_nbytes(dtype: Any, shape: Any) -> int | None:
    """The bytes a well-formed tensor of this dtype and shape holds, if that is small."""
    if not (isinstance(dtype, str) and dtype in hf.DTYPES and isinstance(shape, list)
            and all(type(d) is int and d >= 0 for d in shape)):
        return None
    bits = math.prod(shape) * hf.DTYPES[dtype][0]
    return bits // 8 if bits % 8 == 0 and bits <= 8 * 4096 else None


@st.composite
def safetensors_files(draw: st.DrawFn) -> bytes:
    """A safetensors file whose header may lie anywhere: dtypes, shapes, offsets, metadata."""
    header: dict[str, Any] = {}
    data = bytearray()
    for i in range(draw(st.integers(0, 3))):
        dtype, shape = draw(ST_DTYPES), draw(ST_SHAPES)
        nbytes = _st_nbytes(dtype, shape)
        size = nbytes if nbytes is not None else draw(st.integers(0, 64))
        offsets: Any = [len(data), len(data) + size]
        if draw(st.integers(0, 4)):
            data += bytes(size)
        else:
            offsets = draw(st.one_of(st.lists(st.integers(-1, 2**64), max_size=3), json_leaves))
        info: Any = {"dtype": dtype, "shape": shape, "data_offsets": offsets}
        if not draw(st.integers(0, 6)):
            info = draw(st.one_of(json_leaves, st.just({"dtype": dtype})))
        header[draw(st.sampled_from([f"t{i}", f"layer.{i}.w", "__metadata__", "\ud800", ""]))] = info
    if draw(st.booleans()):
        header["__metadata__"] = draw(st.one_of(st.dictionaries(st.text(max_size=3), st.text(max_size=3)
                                                                | st.integers(), max_size=2), json_leaves))
    raw = json.dumps(header).encode()
    raw += b" " * draw(st.integers(0, 7))
    if not draw(st.integers(0, 5)) and raw:
        raw = bytearray(raw)
        raw[draw(st.integers(0, len(raw) - 1))] = draw(st.integers(0, 255))
        raw = bytes(raw)
    length = len(raw) if draw(st.integers(0, 7)) else draw(st.integers(0, 2**64 - 1))
    return length.to_bytes(8, "little") + raw + bytes(data)


def _nothing_in(folder: Path) -> bool:
    return not any(folder.iterdir())


@settings(FUZZ, max_examples=EXAMPLES)
@given(safetensors_files(), st.booleans())
def test_safetensors_import_of_hostile_headers(file: bytes, in_folder: bool) -> None:
    """Only cas_ckpt errors escape an import, and a failed one stores nothing and moves no ref;
    one that succeeds exports back to the same bytes."""
    _count("safetensors")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "in"
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(file)
        if in_folder:
            (folder / "optimizer.pt").write_bytes(b"\x80" * 20_000)
        repo = cas_ckpt.Repository(cas_ckpt.blocks.MemoryStore(), cas_ckpt.refs.MemoryRefStore())
        result = only_ours(repo.import_safetensors, folder if in_folder else folder / "model.safetensors",
                           ref="m")
        if isinstance(result, cas_ckpt.CasCkptError):
            expected = (cas_ckpt.errors.SafetensorsError, cas_ckpt.errors.StateTypeError)
            assert isinstance(result, expected), result
            assert repo.refs() == {} and len(repo.blocks) == 0
            return
        out = Path(tmp) / ("out" if in_folder else "out.safetensors")
        repo.export_safetensors("m", out)
        assert (out / "model.safetensors" if in_folder else out).read_bytes() == file


ST_PATHS = st.one_of(
    st.sampled_from(["model.safetensors", "unet/model.safetensors", "../x.safetensors", "/abs.safetensors",
                     "a\0b.safetensors", "", ".", "a//b", "a\\b", "a/./b"]),
    leaves,
)


@st.composite
def checkpoint_records(draw: st.DrawFn, world: World) -> tuple[bytes, str | None]:
    """A checkpoint an import might have written, with hostile tensors, headers, paths, files."""
    good = Tagged(3, {"dtype": "<f4", "shape": [2], "data": bytes(8)})
    tensors: dict[Any, Any] = {}
    for name in draw(st.lists(st.sampled_from(["w", "b", "unet/w", "x.y"]), max_size=3, unique=True)):
        value = draw(st.one_of(st.just(good), st.builds(lambda h: Tagged(3, h), array_header(world)),
                               st.builds(lambda h: Tagged(3, h), st.fixed_dictionaries(
                                   {"dtype": ST_DTYPES | st.sampled_from(DTYPES),
                                    "shape": ST_SHAPES, "data": st.binary(max_size=16)})),
                               hostile(world)))
        tensors[name] = Link(world.node(codec.encode(value))) if draw(st.booleans()) else value
    header = {name: {"dtype": "F32", "shape": [2], "data_offsets": [8 * i, 8 * i + 8]}
              for i, name in enumerate(tensors)}
    raw = json.dumps(header).encode()
    raw = draw(st.one_of(st.just(raw + b" " * (-len(raw) % 8)), safetensors_files().map(lambda f: f[8:]),
                         leaves))
    blobs = draw(st.one_of(st.dictionaries(ST_PATHS, st.one_of(
        st.binary(max_size=40), hostile(world), st.builds(lambda h: Tagged(4, h), st.fixed_dictionaries(
            {"size": st.integers(-1, 5000) | leaves, "chunks": chunk_links(world)}))), max_size=2), leaves))
    layout = {"version": draw(st.sampled_from([1, 1, 1, 2, "1", None])),
              "prefix": draw(st.sampled_from(["model", "model", "other", 3, None])),
              "folder": draw(st.one_of(st.booleans(), leaves)),
              "files": draw(st.one_of(st.lists(st.fixed_dictionaries({"path": ST_PATHS,
                                                                      "header": st.just(raw)}),
                                               min_size=1, max_size=2), leaves)),
              "blobs": blobs}
    root = world.node(codec.encode({"model": tensors, "safetensors": layout}))
    return root, draw(st.sampled_from([None, None, "model", "model.w", "safetensors"]))


@settings(FUZZ, max_examples=EXAMPLES)
@given(st.data(), st.sampled_from(["out", "out.safetensors"]), st.sampled_from([None, 16]))
def test_safetensors_export_of_hostile_records(data: st.DataObject, name: str, shard: int | None) -> None:
    """Only cas_ckpt errors escape an export (never TypeError, ValueError or AttributeError from
    a record), and a failed export writes nothing: no file, no folder, no temp file."""
    _count("safetensors")
    world = World()
    root, path = data.draw(checkpoint_records(world))
    with tempfile.TemporaryDirectory() as tmp:
        result = only_ours(world.repo.export_safetensors, cidlib.to_cid(root), Path(tmp) / name,
                           path=path, max_shard_size=shard)
        if isinstance(result, cas_ckpt.CasCkptError):
            assert _nothing_in(Path(tmp)), (result, list(Path(tmp).rglob("*")))


# ----------------------------------------------------------------------------------------------
# CIDs and ref names
# ----------------------------------------------------------------------------------------------
@FUZZ
@given(
    st.one_of(
        st.text(max_size=70),
        st.builds(lambda s: "b" + s, st.text(alphabet="abcdefghijklmnopqrstuvwxyz234567=", max_size=70)),
        st.binary(max_size=40),
        st.builds(lambda d: b"\x01" + d, st.binary(max_size=40)),
        st.builds(lambda d: cidlib.to_str(HASHER.node(d))[: len(d) % 70], st.binary()),
        st.sampled_from([None, 1, 1.5, [], object()]),
    )
)
def test_cid_parser(value: Any) -> None:
    _count("cid")
    result = only_ours(cidlib.to_bytes, value)
    if isinstance(result, cas_ckpt.CasCkptError):
        assert isinstance(result, cas_ckpt.errors.InvalidCID)
        return
    assert cidlib.to_bytes(cidlib.to_str(result)) == result  # canonical round trip
    assert cidlib.check_binary(result) == result
    if isinstance(value, str) and value.startswith("b"):
        assert cidlib.to_str(result) == value  # one string per CID


@pytest.fixture(scope="module")
def ref_repo() -> Iterator[cas_ckpt.Repository]:
    with tempfile.TemporaryDirectory() as tmp, cas_ckpt.open(Path(tmp) / "repo") as repo:
        yield repo


@FUZZ
@given(
    st.one_of(
        st.text(max_size=40),
        st.text(alphabet="ab./-_~:\\ \x00é", max_size=12),
        st.lists(
            st.sampled_from(["a", "..", ".", "", "b.lock", "c.tmp", "x" * 251, "é" * 130]), max_size=4
        ).map("/".join),
        st.sampled_from([None, b"main", 3]),
    )
)
def test_ref_names(ref_repo: cas_ckpt.Repository, name: Any) -> None:
    _count("ref_names")
    result = only_ours(check_ref_name, name)
    if isinstance(result, cas_ckpt.CasCkptError):
        assert isinstance(result, cas_ckpt.errors.InvalidRefName)
        return
    assert not name.startswith("/") and ".." not in name.split("/")
    # Accepted names work on disk, or are refused as clearly (a clash with another ref, too long).
    cid = HASHER.node(b"\xc0")
    outcome = only_ours(ref_repo.refs_store.set_if_equals, name, None, cid)
    if isinstance(outcome, cas_ckpt.CasCkptError):
        assert isinstance(outcome, cas_ckpt.errors.InvalidRefName), outcome
        return
    assert ref_repo.refs_store.get(name) == cid and name in ref_repo.refs()
    assert ref_repo.refs_store.remove_if_equals(name, cid)
    root = os.path.realpath(ref_repo.location)
    for dirpath, _, _files in os.walk(root):
        assert os.path.realpath(dirpath).startswith(root)


# ----------------------------------------------------------------------------------------------
# CAR import
# ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def car_bytes() -> bytes:
    repo = cas_ckpt.open("memory://")
    repo.save({"w": np.arange(3000, dtype=np.float32), "b": b"x" * 20_000, "t": (1, [2, {"k": None}])})
    out = io.BytesIO()
    repo.export_car("main", out)
    return out.getvalue()


@FUZZ
@given(st.data())
def test_car_import(car_bytes: bytes, data: st.DataObject) -> None:
    _count("car")
    blob = bytearray(car_bytes)
    for _ in range(data.draw(st.integers(0, 3))):
        op = data.draw(st.integers(0, 3))
        pos = data.draw(st.integers(0, max(0, len(blob) - 1)))
        if op == 0 and blob:
            blob[pos] ^= 1 << data.draw(st.integers(0, 7))
        elif op == 1:
            del blob[pos:]
        elif op == 2:
            blob[pos:pos] = data.draw(st.binary(min_size=1, max_size=12))
        else:
            del blob[pos : pos + data.draw(st.integers(1, 40))]
    if data.draw(st.integers(0, 9)) == 0:
        blob = bytearray(data.draw(st.binary(max_size=200)))
    repo = cas_ckpt.open("memory://")
    result = only_ours(repo.import_car, io.BytesIO(bytes(blob)), ref="imported")
    if isinstance(result, cas_ckpt.CasCkptError):
        assert len(repo.blocks) == 0 and repo.refs() == {}, "a failed import stored something"
    else:
        assert repo.fsck().ok
        only_ours(repo.load, "imported")


# ----------------------------------------------------------------------------------------------
# Long mode: a seeded mutation fuzzer for volume (over a million inputs in all)
# ----------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.skipif(not LONG, reason="long mode only (CAS_CKPT_LONG=1)")
def test_mutation_fuzzer_volume(car_bytes: bytes) -> None:
    rng = random.Random(1234)
    seeds_nodes = [
        codec.encode(v)
        for v in (
            {"a": [1, 2.5, None, b"x"], "t": Tagged(1, [1, 2])},
            Tagged(3, {"dtype": "<f4", "shape": [2, 2], "data": b"\x00" * 16}),
            Tagged(4, {"size": 3, "chunks": [Link(HASHER.raw(b"abc"))]}),
            {"type": "cas_ckpt.commit", "version": 1, "tree": Link(HASHER.node(b"\xc0")), "parents": []},
        )
    ]
    seeds_cids = [cidlib.to_str(HASHER.node(bytes([i]))) for i in range(8)]
    counts = {"decode": 0, "cid": 0, "ref_names": 0, "car": 0}

    def mutate(data: bytes) -> bytes:
        out = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            op = rng.randrange(4)
            pos = rng.randrange(len(out) + 1)
            if op == 0 and out:
                out[min(pos, len(out) - 1)] ^= 1 << rng.randrange(8)
            elif op == 1:
                del out[pos : pos + rng.randint(1, 8)]
            elif op == 2:
                out[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
            else:
                out[pos:pos] = out[pos : pos + rng.randint(1, 16)]
        return bytes(out)

    deadline = time.monotonic() + 420
    while time.monotonic() < deadline and sum(counts.values()) < 1_200_000:
        for _ in range(2000):
            only_ours(codec.decode, mutate(rng.choice(seeds_nodes)))
            counts["decode"] += 1
            text = rng.choice(seeds_cids)
            only_ours(cidlib.to_bytes, mutate(text.encode()).decode("latin-1"))
            counts["cid"] += 1
            only_ours(check_ref_name, mutate(b"runs/exp-1/step").decode("latin-1"))
            counts["ref_names"] += 1
        for _ in range(20):
            repo = cas_ckpt.open("memory://")
            if isinstance(only_ours(repo.import_car, io.BytesIO(mutate(car_bytes))), cas_ckpt.CasCkptError):
                assert len(repo.blocks) == 0
            counts["car"] += 1
    for key, n in counts.items():
        _count(key, n)
    assert sum(counts.values()) >= 1_000_000
