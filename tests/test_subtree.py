"""Sub-tree loads: path syntax, PathNotFound, and proof that only the sub-tree's blocks are read."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from helpers import assert_state_equal

import cas_ckpt
from cas_ckpt import cid as cidlib
from cas_ckpt.blocks.base import BlockStore, BlockWriter

CHUNK = 4096


class CountingStore(BlockStore):
    """Delegates to a real store and records every block read (and size lookup) by CID."""

    def __init__(self, inner: BlockStore) -> None:
        super().__init__(verify=inner.verify)
        self.inner = inner
        self.reads: list[bytes] = []
        self.sized: list[bytes] = []

    def _read(self, cid: bytes) -> bytes | None:
        self.reads.append(cid)
        return self.inner._read(cid)

    def _read_into(self, cid: bytes, out: memoryview) -> bool:
        self.reads.append(cid)
        return self.inner._read_into(cid, out)

    def _size(self, cid: bytes) -> int:
        self.sized.append(cid)
        return self.inner.size(cid)

    def _has(self, cid: bytes) -> bool:
        return self.inner.has(cid)

    def keys(self) -> Iterator[bytes]:
        return self.inner.keys()

    def writer(self, *, verify_existing: bool = False, compression: str = "none") -> BlockWriter:
        return self.inner.writer(verify_existing=verify_existing, compression=compression)

    def delete(
        self, cids: set[bytes], *, min_age: float = 0.0, before_unlink: Callable[[], None] | None = None
    ) -> tuple[int, int]:
        return self.inner.delete(cids, min_age=min_age, before_unlink=before_unlink)

    def refresh(self, *, full: bool = False, learn: bool = True) -> None:
        self.inner.refresh(full=full, learn=learn)

    def close(self) -> None:
        self.inner.close()

    def reset(self) -> None:
        self.reads.clear()
        self.sized.clear()

    def bytes_read(self) -> int:
        return sum(self.inner.size(c) for c in self.reads)


@pytest.fixture(params=["local", "memory"])
def counted(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[cas_ckpt.Repository]:
    if request.param == "local":
        store: BlockStore = cas_ckpt.blocks.LocalStore(tmp_path)
        refs: cas_ckpt.refs.RefStore = cas_ckpt.refs.LocalRefStore(tmp_path)
    else:
        store, refs = cas_ckpt.blocks.MemoryStore(), cas_ckpt.refs.MemoryRefStore()
    with cas_ckpt.Repository(CountingStore(store), refs, chunk_size=CHUNK) as repository:
        yield repository


def chunk_cids(array: np.ndarray[Any, Any]) -> set[bytes]:
    data = np.ascontiguousarray(array).tobytes()
    hasher = cidlib.Hasher()
    return {hasher.raw(data[i : i + CHUNK]) for i in range(0, len(data), CHUNK)}


def make_state() -> dict[str, Any]:
    rng = np.random.default_rng(11)

    def arr(*shape: int) -> np.ndarray[Any, Any]:
        return rng.standard_normal(shape).astype(np.float32)

    return {
        "model": {
            "layer.0.weight": arr(64, 128),
            "layer.0.bias": arr(64),
            "layer.1.weight": arr(40, 128),
        },
        "optimizer": {
            "state": {
                0: {"step": 5, "exp_avg": arr(64, 128), "exp_avg_sq": arr(64, 128)},
                3: {"step": 5, "exp_avg": arr(48, 96), "exp_avg_sq": arr(48, 96)},
            },
            "param_groups": [{"lr": 1e-3, "params": [0, 1, 2, 3]}],
            "history": list(range(40_000)),  # over 64 KiB encoded: a node of its own
        },
        "rng": (np.uint32(7), b"\x00" * 50),
    }


def arrays_in(value: Any) -> list[np.ndarray[Any, Any]]:
    if isinstance(value, np.ndarray):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [a for v in value for a in arrays_in(v)]
    return []


def chunks_of(value: Any) -> set[bytes]:
    return {c for a in arrays_in(value) if a.nbytes > 16 * 1024 for c in chunk_cids(a)}


# -- only the sub-tree's blocks are read ---------------------------------------------------------
@pytest.mark.parametrize(
    ("path", "select"),
    [
        ("model", lambda s: s["model"]),
        ("optimizer.state.3", lambda s: s["optimizer"]["state"][3]),
        ("optimizer.state.0.exp_avg", lambda s: s["optimizer"]["state"][0]["exp_avg"]),
        ("model.layer.0.weight", lambda s: s["model"]["layer.0.weight"]),
    ],
)
def test_only_the_subtree_is_read(counted: cas_ckpt.Repository, path: str, select: Any) -> None:
    store = counted.blocks
    assert isinstance(store, CountingStore)
    state = make_state()
    root = counted.save(state)
    wanted = select(state)
    wanted_chunks = chunks_of(wanted)
    other_chunks = chunks_of(state) - wanted_chunks
    assert wanted_chunks and other_chunks
    store.reset()

    loaded = counted.load(root, path=path)

    assert_state_equal(wanted, loaded)
    read = set(store.reads)
    assert wanted_chunks <= read
    assert not read & other_chunks, "read chunks of another sub-tree"
    assert not set(store.sized) & other_chunks, "looked up chunks of another sub-tree"
    assert len(store.reads) == len(read), "a block was read twice"
    # Apart from the chunks only a few small nodes (commit, root, path) were read.
    wanted_bytes = sum(a.nbytes for a in arrays_in(wanted))
    assert wanted_bytes <= store.bytes_read() <= wanted_bytes + 8 * 1024
    nodes = [c for c in read if cidlib.is_node(c)]
    assert len(nodes) <= 3


def test_full_load_reads_every_block(counted: cas_ckpt.Repository) -> None:
    store = counted.blocks
    assert isinstance(store, CountingStore)
    state = make_state()
    root = counted.save(state)
    store.reset()
    assert_state_equal(state, counted.load(root))
    # The baseline the sub-tree test compares with: a full load reads all stored blocks.
    assert set(store.reads) == set(store.keys())


def test_subtree_in_its_own_node_is_read_alone(counted: cas_ckpt.Repository) -> None:
    store = counted.blocks
    assert isinstance(store, CountingStore)
    state = make_state()
    root = counted.save(state)
    store.reset()
    assert counted.load(root, path="optimizer.history") == state["optimizer"]["history"]
    assert not set(store.reads) & chunks_of(state)
    assert store.bytes_read() < 200 * 1024  # the list's node (~120 kB) and two small nodes
    store.reset()
    assert counted.load(root, path="optimizer.param_groups") == state["optimizer"]["param_groups"]
    assert store.bytes_read() < 8 * 1024  # the history node is not read


# -- path syntax ---------------------------------------------------------------------------------
SYNTAX_STATE: dict[str, Any] = {
    "model": {"layer.0.weight": np.arange(6.0).reshape(2, 3), "layer": {"0": {"bias": 1}}},
    "optimizer": {"state": {3: {"exp_avg": np.ones(2)}, "3x": "str key"}},
    "t": (10, [20, (30, 40)]),
    "a.b": "dotted",
}


@pytest.fixture
def syntax_repo(repo: cas_ckpt.Repository) -> cas_ckpt.Repository:
    repo.save(SYNTAX_STATE, ref="main")
    return repo


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("model", SYNTAX_STATE["model"]),
        ("optimizer.state.3", SYNTAX_STATE["optimizer"]["state"][3]),
        ("optimizer.state.3x", "str key"),
        ("model.layer.0.weight", SYNTAX_STATE["model"]["layer.0.weight"]),
        ("model.layer.0.bias", 1),
        ("t.1.1.0", 30),
        ("t.1", [20, (30, 40)]),
        ("t.1.1", (30, 40)),
        ("a.b", "dotted"),
        (["model", "layer.0.weight"], SYNTAX_STATE["model"]["layer.0.weight"]),
        (("optimizer", "state", 3, "exp_avg"), np.ones(2)),
        (["t", 1, 1, 1], 40),
        (["t", "1"], [20, (30, 40)]),
        (["model", "layer", "0", "bias"], 1),
    ],
)
def test_paths(syntax_repo: cas_ckpt.Repository, path: Any, expected: Any) -> None:
    assert_state_equal(expected, syntax_repo.load("main", path=path))


def test_sequence_path_segments_are_exact_keys() -> None:
    with cas_ckpt.open("memory://") as repo:
        repo.save({"a": {"b": "nested"}, "a.b": "dotted"})
        assert repo.load(path=["a", "b"]) == "nested"
        assert repo.load(path=["a.b"]) == "dotted"
        with pytest.raises(cas_ckpt.errors.PathNotFound):
            repo.load(path=["a", "c"])


@pytest.mark.parametrize(
    ("path", "named"),
    [
        ("nope", "nope"),
        ("model.nope", "model.nope"),
        ("optimizer.state.7", "optimizer.state.7"),
        ("optimizer.state.3.exp_avg.0", "optimizer.state.3.exp_avg.0"),
        ("t.5", "t.5"),
        ("t.x", "t.x"),
        ("t.0.0", "t.0.0"),
        (["optimizer", "state", 4], "optimizer.state.4"),
        (["model", "layer.0"], "model.layer.0"),
    ],
)
def test_missing_paths(syntax_repo: cas_ckpt.Repository, path: Any, named: str) -> None:
    root = syntax_repo.resolve("main")
    with pytest.raises(cas_ckpt.errors.PathNotFound) as info:
        syntax_repo.load("main", path=path)
    assert info.value.path == named
    assert named in str(info.value) and str(root) in str(info.value)
    assert isinstance(info.value, KeyError)


def test_subtree_of_an_older_checkpoint(repo: cas_ckpt.Repository) -> None:
    first = repo.save({"model": {"w": np.zeros(3)}}, step=1)
    repo.save({"model": {"w": np.ones(3)}}, step=2)
    assert_state_equal(np.zeros(3), repo.load(first, path="model.w"))
    assert_state_equal(np.ones(3), repo.load("main", path="model.w"))
    assert_state_equal(np.zeros(3), repo.load(str(first), path=["model", "w"]))


def test_counting_store_on_disk_sees_real_files(tmp_path: Any) -> None:
    # Guard for the wrapper itself: it reads through to the packed files.
    store = CountingStore(cas_ckpt.blocks.LocalStore(tmp_path))
    with cas_ckpt.Repository(store, cas_ckpt.refs.LocalRefStore(tmp_path)) as repo:
        repo.save({"x": np.arange(10_000)})
        assert os.listdir(tmp_path / "packs")
        store.reset()
        repo.load()
        assert store.reads


@pytest.mark.parametrize(
    ("path", "found", "detail", "suggestions"),
    [
        ("model.0.weigth", "model", "'model' has no key '0' or '0.weigth'",
         ["model.0.weight", "model.2.weight"]),
        ("modle.0.weight", "", "the root has no key 'modle'", ["model"]),
        ("model.0.weight.x", "model.0.weight", "holds a value, not a dict or list", []),
        ("steps.7", "steps", "'steps' is a list of 2 items", []),
        ("optimizer.state.5", "optimizer.state", "has no key '5'", []),
    ],
)
def test_missing_paths_name_the_deepest_prefix_and_close_keys(
    path: str, found: str, detail: str, suggestions: list[str]
) -> None:
    state = {
        "model": {"0.weight": np.zeros(2), "0.bias": np.zeros(2), "2.weight": np.zeros(2)},
        "optimizer": {"state": {3: {"step": 1}}},
        "steps": [1, 2],
    }
    with cas_ckpt.open("memory://") as repo:
        repo.save(state)
        with pytest.raises(cas_ckpt.errors.PathNotFound) as info:
            repo.load(path=path)
    assert info.value.found == found and info.value.suggestions == suggestions
    assert detail in str(info.value)
    if suggestions:
        assert f"did you mean {suggestions[0]!r}" in str(info.value)
    else:
        assert "did you mean" not in str(info.value)
