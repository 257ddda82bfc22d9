"""Hand-made nodes no save writes: the tree reader refuses each malformed field clearly.

Each case breaks one check of ``cas_ckpt.tree.TreeReader`` (its name says which); a reader without
that check would crash with a non-library error, or load the node as if it were valid.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import numpy as np
import pytest
from helpers import flip_byte

import cas_ckpt
from cas_ckpt import cid as cidlib
from cas_ckpt import codec, tree
from cas_ckpt.codec import Link, Tagged
from cas_ckpt.errors import DecodeError, ExpansionLimit
from cas_ckpt.tree import BIGINT, BLOB, CID_VALUE, MAX_DEPTH, NDARRAY, PAGES, SCALAR

HASHER = cidlib.Hasher()
CHUNK = b"\x01" * 8
NOT_UTF8 = b"\xff\xfe" * 4
CHUNK_LINK, NOT_UTF8_LINK = Link(HASHER.raw(CHUNK)), Link(HASHER.raw(NOT_UTF8))

Put = Callable[[Any], Link]  # stores a node, returns a link to it


@pytest.fixture
def repo() -> Iterator[cas_ckpt.Repository]:
    with cas_ckpt.open("memory://") as repository:
        with repository.blocks.writer() as writer:
            for data in (CHUNK, NOT_UTF8):
                writer.put(HASHER.raw(data), data)
        yield repository


def _put(repo: cas_ckpt.Repository) -> Put:
    def put(value: Any) -> Link:
        node = codec.encode(value)
        cid = repo.hasher.node(node)
        with repo.blocks.writer() as writer:
            writer.put(cid, node)
        return Link(cid)
    return put


def _array(**header: Any) -> Tagged:
    return Tagged(NDARRAY, {"dtype": "<f4", "shape": [1], **header})


def _pages(kind: str, put: Put, *pages: Any) -> Tagged:
    return Tagged(PAGES, {"kind": kind, "pages": [put(p) for p in pages]})


def _chain(put: Put, links: int) -> Link:
    link = put(1)
    for _ in range(links):
        link = put(link)  # a node that is only a link to the next
    return link


def _nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


CASES: dict[str, tuple[Callable[[Put], Any], str]] = {
    # _load_array and _valid_shape
    "a negative dimension": (lambda put: _array(shape=[-1], data=b""), "malformed array shape"),
    "a float dimension": (lambda put: _array(shape=[1.0], data=bytes(4)), "malformed array shape"),
    "negative dimensions": (lambda put: _array(shape=[-1, -1], data=bytes(4)), "malformed array shape"),
    "a boolean dimension": (lambda put: _array(shape=[2, True], data=bytes(8)), "malformed array shape"),
    "a shape that is a map": (lambda put: _array(shape={}, data=bytes(4)), "malformed array shape"),
    "an unknown order": (lambda put: _array(order="K", data=bytes(4)), "unknown array order 'K'"),
    "a shape past any buffer": (lambda put: _array(shape=[2**62, 4], chunks=[CHUNK_LINK]),
                                "larger than any buffer"),
    "inline data that is text": (lambda put: _array(data="abcd"), "inline array data does not match"),
    "inline data too short": (lambda put: _array(data=bytes(3)), "inline array data does not match"),
    "a zero-size shape that overflows": (lambda put: _array(shape=[0, 2**62, 2**62], data=b""),
                                         "impossible"),
    # the stored sizes are checked twice (here, and as the chunks are read): either one is enough
    "chunks longer than the shape": (lambda put: _array(dtype="|u1", shape=[4], chunks=[CHUNK_LINK] * 2),
                                     "chunks hold 16 bytes"),
    "chunks longer than the blob": (lambda put: Tagged(BLOB, {"size": 4, "chunks": [CHUNK_LINK] * 2}),
                                    "chunks hold 16 bytes"),
    "chunks that are not links": (lambda put: _array(shape=[2], chunks=[b"x"]), "expected a link"),
    "a header that is a list": (lambda put: Tagged(NDARRAY, ["<f4", [1]]), "malformed ndarray"),
    # parse_dtype
    "a dtype that is a list": (lambda put: _array(dtype=[], data=bytes(4)), r"unknown dtype \[\]"),
    "a unicode dtype": (lambda put: _array(dtype="<U1", data=bytes(4)), "unknown dtype '<U1'"),
    "a dtype with a suffix": (lambda put: _array(dtype="<f4x", data=bytes(4)), "unknown dtype '<f4x'"),
    # _load_blob
    "a float blob size": (lambda put: Tagged(BLOB, {"size": 8.0, "chunks": [CHUNK_LINK]}),
                          "malformed blob size"),
    "a negative blob size": (lambda put: Tagged(BLOB, {"size": -1, "chunks": [CHUNK_LINK]}),
                             "malformed blob size"),
    "a blob past any buffer": (lambda put: Tagged(BLOB, {"size": 2**64 - 1, "chunks": [CHUNK_LINK]}),
                               "larger than any buffer"),
    "text that is not UTF-8": (lambda put: Tagged(BLOB, {"size": 8, "str": True, "chunks": [NOT_UTF8_LINK]}),
                               "not UTF-8"),
    # _load_tagged and _load
    "a bigint that is an int": (lambda put: Tagged(BIGINT, 5), "malformed bigint"),
    "an empty bigint": (lambda put: Tagged(BIGINT, b""), "malformed bigint"),
    "scalar data that is text": (lambda put: Tagged(SCALAR, {"dtype": "<f4", "data": "abcd"}),
                                 "malformed numpy scalar"),
    "scalar data too short": (lambda put: Tagged(SCALAR, {"dtype": "<f4", "data": bytes(3)}),
                              "malformed numpy scalar"),
    "a CID value that is bytes": (lambda put: Tagged(CID_VALUE, CHUNK_LINK.cid), "expected a link"),
    "an unknown extension": (lambda put: Tagged(99, 1), "unknown extension type 99"),
    "a timestamp": (lambda put: msgpack.Timestamp(0), "unexpected Timestamp in a state node"),
    "lists nested too deep inline": (lambda put: _nested(MAX_DEPTH + 2),
                                     f"state nested deeper than {MAX_DEPTH}"),
    "a chain of links too long": (lambda put: _chain(put, MAX_DEPTH + 2),
                                  f"links nested deeper than {MAX_DEPTH}"),
    # _join_pages
    "a page set that is a list": (lambda put: Tagged(PAGES, [put([1])]), "malformed page set"),
    "a page set of an unknown kind": (lambda put: _pages("set", put, [1]), "malformed page set"),
    "pages that are not a list": (lambda put: Tagged(PAGES, {"kind": "list", "pages": None}),
                                  "malformed pages: expected a list"),
    "a page that is not a link": (lambda put: Tagged(PAGES, {"kind": "list", "pages": [b"x"]}),
                                  "expected a link"),
    "a map page that is a list": (lambda put: _pages("map", put, {"a": 1}, [1, 2]), "map page is not a map"),
    "a key in two map pages": (lambda put: _pages("map", put, {"a": 1}, {"a": 2}),
                               "'a' appears in two pages"),
    "a list page that is a map": (lambda put: _pages("list", put, [1], {"a": 1}), "list page is not a list"),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_a_malformed_node_is_a_decode_error_that_says_what_is_wrong(
    repo: cas_ckpt.Repository, case: tuple[Callable[[Put], Any], str]
) -> None:
    build, match = case
    put = _put(repo)
    value = build(put)
    root = put({"x": value})
    with pytest.raises(DecodeError, match=match) as info:
        repo.load(cidlib.to_cid(root.cid))
    # It names where: the path inside the state, and the node holding the malformed value.
    holder = value if isinstance(value, Link) else root
    assert info.value.path.partition(".")[0] == "x" and info.value.cid == cidlib.to_str(holder.cid)
    text = str(info.value)
    assert text.startswith(info.value.path + ": ") and text.endswith(f"(block {info.value.cid})")


def test_a_malformed_value_deep_in_a_state_names_its_path_from_the_root(repo: cas_ckpt.Repository) -> None:
    """Through a tuple, a list, a node of its own and a sub-tree load's own path."""
    put = _put(repo)
    inner = put({"w": _array(shape=[-1], data=b"")})
    root = put({"model": {"layers": [1, Tagged(1, [2, inner])]}})
    with pytest.raises(DecodeError, match="malformed array shape") as info:
        repo.load(cidlib.to_cid(root.cid))
    assert info.value.path == "model.layers.1.1.w" and info.value.cid == cidlib.to_str(inner.cid)
    with pytest.raises(DecodeError) as info:
        repo.load(cidlib.to_cid(root.cid), path="model.layers")
    assert info.value.path == "model.layers.1.1.w"


def test_a_decode_error_keeps_its_fields_across_processes() -> None:
    import pickle

    error = DecodeError("bad", cid="bafy", path="a.b")
    copy = pickle.loads(pickle.dumps(error))
    assert (type(copy), copy.message, copy.cid, copy.path, str(copy)) == (
        DecodeError, "bad", "bafy", "a.b", "a.b: bad (block bafy)")


def test_a_dag_that_multiplies_its_node_reads_is_refused(
    repo: cas_ckpt.Repository, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each node links twice to the one below: 2**12 reads from 12 nodes (a "billion laughs")."""
    monkeypatch.setattr(tree, "MAX_NODE_READS", 1000)
    put = _put(repo)
    link = put([1])
    for _ in range(12):
        link = put([link, link])
    with pytest.raises(DecodeError, match="over 1000 node reads") as info:
        repo.load(cidlib.to_cid(link.cid))
    assert info.value.cid is not None and info.value.cid.startswith("b")


def test_pages_linked_far_more_often_than_stored_are_refused_naming_cid_and_path(
    repo: cas_ckpt.Repository,
) -> None:
    """issue #40: a 4 MB node linking one 1,000-item page 100,000 times (every node within its
    limits) loaded 100 million items in 203 s and 1.6 GB; diff raised a bare MemoryError."""
    put = _put(repo)
    page = put([None] * 1000)
    pages = put(Tagged(PAGES, {"kind": "list", "pages": [page] * 100_000}))
    root = put({"run": {"history": pages, "step": 3}})
    for call in (lambda: repo.load(cidlib.to_cid(root.cid)),
                 lambda: repo.load(cidlib.to_cid(root.cid), path="run.history"),
                 lambda: repo.diff(cidlib.to_cid(root.cid), cidlib.to_cid(put({"run": {}}).cid))):
        with pytest.raises(ExpansionLimit, match=r"expands to over \d+ bytes .*MAX_EXPANSION") as info:
            call()
        assert info.value.cid == cidlib.to_str(page.cid) and info.value.path == "run.history"
        assert tree.EXPANSION_FLOOR < info.value.expanded <= tree.EXPANSION_FLOOR + 2000


def test_a_node_linked_far_more_often_than_stored_is_refused(repo: cas_ckpt.Repository) -> None:
    put = _put(repo)
    shared = put([f"{i:088d}" for i in range(1000)])  # 90 KB: a node of its own for a writer
    root = put({"a": [shared] * 20_000})
    with pytest.raises(ExpansionLimit) as info:
        repo.load(cidlib.to_cid(root.cid))
    assert info.value.cid == cidlib.to_str(shared.cid) and info.value.path.startswith("a.")


def test_what_writers_repeat_loads_and_the_floor_can_be_raised(
    repo: cas_ckpt.Repository, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A list of one repeated value is identical pages; a value stored twice is one node linked
    twice; a zero tensor is one chunk (and one link page) repeated. Each expands the tree beyond
    what is stored, within the floor; CAS_CKPT_MAX_EXPANSION sets the floor."""
    shared = {"vocab": [f"token{i}" for i in range(20_000)]}  # over 64 KiB: a node of its own
    state = {"same": ["x" * 30] * 300_000, "a": shared, "b": shared, "zeros": np.zeros(40 << 20, np.uint8)}
    repo.save(state)  # "same": 9.3 MB of pages, 1.8 MB of them stored (one repeated, the last)
    loaded = repo.load()
    assert loaded["same"] == state["same"] and loaded["a"] == loaded["b"] == shared
    assert not loaded["zeros"].any() and loaded["zeros"].nbytes == 40 << 20
    monkeypatch.setenv(tree.EXPANSION_ENV, str(4 << 20))
    with pytest.raises(ExpansionLimit, match="CAS_CKPT_MAX_EXPANSION") as info:
        repo.load()
    assert info.value.path == "same" and info.value.floor == 4 << 20
    monkeypatch.setenv(tree.EXPANSION_ENV, str(64 << 20))
    assert repo.load(path="same") == state["same"]


def test_a_read_never_allocates_more_than_the_machine_holds(repo: cas_ckpt.Repository) -> None:
    """Linux overcommits: arrays declared in a tree each get an allocation, and the process is
    killed once the reads touch them. A read counts what it allocates against the memory and
    swap there are (a cgroup's limit where lower)."""
    with open("/proc/meminfo") as f:
        info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    assert tree.memory_limit() <= info["MemTotal"] + info["SwapTotal"]
    reader = tree.TreeReader(repo.blocks, repo.pool)
    reader.reserve(tree.memory_limit() - 100, "most of it")
    reader.reserve(100, "the rest")
    with pytest.raises(cas_ckpt.errors.OutOfMemory, match=r"1 bytes for an array of shape \[7\]: this"):
        reader.reserve(1, "an array of shape [7]")


@pytest.mark.parametrize("local", [False, True], ids=["memory", "local (mapped batches)"])
def test_a_zero_size_array_given_a_block_is_refused(tmp_path: Any, local: bool) -> None:
    """Saves keep empty arrays inline; a node giving one a block of 8 bytes fails its size check."""
    with cas_ckpt.open(tmp_path / "repo" if local else "memory://") as repo:
        with repo.blocks.writer() as writer:
            writer.put(CHUNK_LINK.cid, CHUNK)
        put = _put(repo)
        root = put({"x": _array(shape=[0, 3], chunk_size=4096, chunks=[CHUNK_LINK])})
        with pytest.raises(cas_ckpt.errors.CorruptBlock, match="stored size 8 != expected 0"):
            repo.load(cidlib.to_cid(root.cid))


def test_a_load_runs_with_the_cyclic_collector_paused_and_restores_it(tmp_path: Any) -> None:
    """No collection starts while a load of many small arrays runs (each used to start several);
    afterwards the collector is as it was, also after a failed load and around two at once."""
    import gc
    import threading

    rng = np.random.default_rng(3)
    state = {f"c{j}": {f"t{i}": rng.standard_normal(500, np.float32) for i in range(100)}
             for j in range(50)}
    started: list[int] = []

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started.append(info["generation"])

    with cas_ckpt.open(tmp_path / "repo") as repo:
        repo.save(state)
        gc.collect()  # the count starts at 0: the few objects made before the load starts add none
        gc.callbacks.append(count)
        try:
            repo.load()
        finally:
            gc.callbacks.remove(count)
        assert started == [], f"{len(started)} collections started during the load"
        assert gc.isenabled()
        gc.disable()
        try:
            repo.load()
            assert not gc.isenabled()  # left as the caller had it
        finally:
            gc.enable()
        loads = [threading.Thread(target=repo.load) for _ in range(2)]
        for thread in loads:
            thread.start()
        for thread in loads:
            thread.join()
        assert gc.isenabled()
        raw = next(bytes(c) for c in repo.blocks if not cidlib.is_node(bytes(c)))
        path, offset, _ = repo.blocks.locate(raw)
        flip_byte(path, offset + 7)
        with pytest.raises(cas_ckpt.errors.CorruptBlock):
            repo.load(verify=True)  # fails inside the load, when the batch is checked
        assert gc.isenabled()


def test_opening_a_repository_of_many_blocks_starts_no_collection(tmp_path: Any) -> None:
    """Taking in a pack index of 5,000 entries makes objects by the thousand: the collector is
    paused meanwhile (it used to run several collections, 8-10 ms of a 13 ms open)."""
    import gc

    rng = np.random.default_rng(4)
    state = {f"c{j}": {f"t{i}": rng.standard_normal(400, np.float32) for i in range(100)}
             for j in range(50)}
    with cas_ckpt.open(tmp_path / "repo") as repo:
        repo.save(state)
    started: list[int] = []

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started.append(info["generation"])

    gc.collect()
    gc.callbacks.append(count)
    try:
        repo = cas_ckpt.open(tmp_path / "repo")
    finally:
        gc.callbacks.remove(count)
    with repo:
        assert len(repo.blocks) > 5000
    # The rest of opening makes a few hundred objects (one collection); unpaused, the index
    # reading started about 40 here.
    assert len(started) <= 1, f"{len(started)} collections started while the indexes were read"
    assert gc.isenabled()
