"""Saving and loading states: exact round trips, determinism, dedup, and unsupported values."""

from __future__ import annotations

import datetime
import fractions
import tempfile
from typing import Any

import numpy as np
import pytest
from helpers import assert_state_equal
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import DTYPES, NUMPY_DTYPES, arrays, states

import cas_ckpt
from cas_ckpt import cid as cidlib
from cas_ckpt import codec
from cas_ckpt.codec import Tagged
from cas_ckpt.tree import MAX_DEPTH, NDARRAY

FEWER = settings(max_examples=max(10, settings().max_examples // 3))
MiB = 1024 * 1024


def _round_trip(repo: cas_ckpt.Repository, state: Any) -> Any:
    cid = repo.save(state)
    assert repo.resolve("main") == cid
    return repo.load(cid)


# -- arbitrary states ----------------------------------------------------------------------------
@given(state=states(), chunk_size=st.sampled_from([4096, 1024 * 1024]))
def test_round_trip_memory(state: Any, chunk_size: int) -> None:
    with cas_ckpt.open("memory://", chunk_size=chunk_size) as repo:
        assert_state_equal(state, _round_trip(repo, state))


@FEWER
@given(state=states())
def test_round_trip_local(state: Any) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        with cas_ckpt.open(tmp + "/r", chunk_size=4096) as repo:
            cid = repo.save(state, ref="runs/a")
            assert_state_equal(state, repo.load("runs/a"))
        # Reopened, everything comes from the files on disk.
        with cas_ckpt.open(tmp + "/r", create=False) as reopened:
            assert reopened.resolve("runs/a") == cid
            assert_state_equal(state, reopened.load(cid))


@given(array=arrays())
def test_arrays_of_every_dtype_and_layout(array: np.ndarray[Any, Any]) -> None:
    with cas_ckpt.open("memory://", chunk_size=4096) as repo:
        loaded = _round_trip(repo, {"a": array, "in_list": [array], "in_tuple": (array,)})
    assert_state_equal({"a": array, "in_list": [array], "in_tuple": (array,)}, loaded)
    assert loaded["a"].flags.writeable, "loaded arrays must be writable for training to resume"


@given(array=arrays(large=True))
def test_large_arrays_are_cut_into_chunks(array: np.ndarray[Any, Any]) -> None:
    with cas_ckpt.open("memory://", chunk_size=4096) as repo:
        loaded = _round_trip(repo, array)
        raw = [c for c in repo.blocks if c.codec.name == "raw"]
        assert raw, "an array over 16 KiB must be stored as raw chunk blocks"
        assert all(repo.blocks.size(cidlib.to_bytes(c)) <= 4096 for c in raw)
    assert_state_equal(array, loaded)


def _layouts(dtype: np.dtype[Any], count: int) -> dict[str, np.ndarray[Any, Any]]:
    """Every layout of one dtype, from random bits, with ``count`` elements or so."""
    rng = np.random.default_rng(count)
    cols = 4
    rows = count // cols + 1
    base = np.frombuffer(rng.bytes(rows * 2 * cols * dtype.itemsize), dtype=dtype)
    grid = base.reshape(rows * 2, cols)
    out = {
        "c": grid[:rows].copy(),
        "fortran": np.asfortranarray(grid[:rows]),
        "strided": grid[::2],
        "reversed": grid[::-1],
        "transposed view": grid[:rows].T,
        "column": grid[:, 1],
        "0-d": base[:1].reshape(()).copy(),
        "empty": base[:0].reshape(0, cols),
        "empty 3-d": base[:0].reshape(2, 0, 3),
        "read-only": base[: rows * cols],
    }
    if dtype.itemsize > 1 and dtype in NUMPY_DTYPES:
        swapped = dtype.newbyteorder(">")
        out["big-endian"] = np.frombuffer(rng.bytes(rows * cols * dtype.itemsize), dtype=swapped)
        out["big-endian fortran"] = np.asfortranarray(out["big-endian"].reshape(rows, cols))
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("count", [24, 9000], ids=["inline", "chunked"])
def test_every_dtype_in_every_layout(dtype: np.dtype[Any], count: int) -> None:
    arrays_by_layout = _layouts(dtype, count)
    if count > 24:
        assert max(a.nbytes for a in arrays_by_layout.values()) > 16 * 1024 or dtype.itemsize < 2
    with cas_ckpt.open("memory://", chunk_size=4096) as repo:
        loaded = repo.load(repo.save(arrays_by_layout))
    assert_state_equal(arrays_by_layout, loaded)
    assert loaded["fortran"].flags.f_contiguous and not loaded["fortran"].flags.c_contiguous
    assert loaded["0-d"].shape == () and loaded["empty 3-d"].shape == (2, 0, 3)


def test_numpy_scalars_keep_type_and_bits(repo: cas_ckpt.Repository) -> None:
    rng = np.random.default_rng(5)
    scalars = [np.frombuffer(rng.bytes(d.itemsize), dtype=d)[0] for d in DTYPES for _ in range(3)]
    loaded = repo.load(repo.save(scalars))
    assert_state_equal(scalars, loaded)
    assert [type(v) for v in loaded] == [type(v) for v in scalars]


# -- determinism ---------------------------------------------------------------------------------
@FEWER
@given(state=states())
def test_same_state_same_tree_in_two_repositories(state: Any) -> None:
    with (
        tempfile.TemporaryDirectory() as tmp,
        cas_ckpt.open(tmp + "/r", chunk_size=4096) as local,
        cas_ckpt.open("memory://", chunk_size=4096) as memory,
    ):
        first = local.save(state, step=1)
        second = memory.save(state, step=2, message="another commit")
        assert first != second  # different commits...
        assert local.commit(first).tree == memory.commit(second).tree  # ...of the same tree
        # Saving it again writes nothing but the new commit block.
        again = local.save(state, step=3)
        assert local.last_save is not None
        assert local.last_save.blocks_written == 1
        assert local.last_save.cid == again
        assert local.commit(again).tree == local.commit(first).tree
        assert local.commit(again).parents == (first,)


def test_same_state_same_tree_across_hashes_differs() -> None:
    state = {"w": np.arange(10_000, dtype=np.float32), "step": 3}
    with cas_ckpt.open("memory://") as a, cas_ckpt.open("memory://", hash="blake3") as b:
        tree_a, tree_b = a.commit(a.save(state)).tree, b.commit(b.save(state)).tree
    assert tree_a != tree_b
    assert tree_a.hashfun.name == "sha2-256" and tree_b.hashfun.name == "blake3"


def test_strided_view_saves_like_its_contiguous_copy() -> None:
    base = np.arange(60_000, dtype=np.float32).reshape(300, 200)
    with cas_ckpt.open("memory://", chunk_size=4096) as repo:
        view_tree = repo.commit(repo.save({"x": base[::2, ::3]})).tree
        copy_tree = repo.commit(repo.save({"x": np.ascontiguousarray(base[::2, ::3])})).tree
        assert repo.last_save is not None and repo.last_save.blocks_written == 1
    assert view_tree == copy_tree


def test_dict_order_is_part_of_the_tree() -> None:
    with cas_ckpt.open("memory://") as repo:
        ab = repo.commit(repo.save({"a": 1, "b": 2})).tree
        ba = repo.commit(repo.save({"b": 2, "a": 1})).tree
    assert ab != ba


# -- specific value kinds ------------------------------------------------------------------------
def test_tuples_lists_and_dict_order_come_back(repo: cas_ckpt.Repository) -> None:
    state = {
        "z": (1, (2, [3, (4,)]), ()),
        "a": [(), [], {}],
        3: {"y": 1, "x": 2, 0: 3, -5: 4},
        "b": None,
    }
    loaded = repo.load(repo.save(state))
    assert list(loaded) == ["z", "a", 3, "b"]
    assert list(loaded[3]) == ["y", "x", 0, -5]
    assert type(loaded["z"]) is tuple and type(loaded["z"][1]) is tuple
    assert type(loaded["z"][1][1]) is list and type(loaded["z"][1][1][1]) is tuple
    assert_state_equal(state, loaded)


def test_large_containers_keep_order_across_pages(repo: cas_ckpt.Repository) -> None:
    rng = np.random.default_rng(7)
    keys = [f"param.{i}" for i in rng.permutation(70_000)]
    state = {
        "big_dict": {k: i for i, k in enumerate(keys)},
        "big_list": list(range(150_000)),
        "big_tuple": tuple(f"s{i}" for i in range(90_000)),
    }
    loaded = repo.load(repo.save(state))
    assert list(loaded["big_dict"]) == keys
    assert_state_equal(state, loaded)
    # Containers of over 1 MiB are split over several node blocks, each at most 1 MiB.
    nodes = [c for c in repo.blocks if c.codec.name == "messagepack"]
    assert len(nodes) > 4
    assert max(repo.blocks.size(cidlib.to_bytes(c)) for c in nodes) <= MiB


def test_ints_beyond_64_bits_and_bools(repo: cas_ckpt.Repository) -> None:
    state = [True, False, 1, 0, 2**64 - 1, 2**64, -(2**63), -(2**63) - 1, 3**200, -(7**300)]
    loaded = repo.load(repo.save(state))
    assert_state_equal(state, loaded)
    assert [type(v) for v in loaded[:4]] == [bool, bool, int, int]


def test_large_str_and_bytes_use_chunks(repo: cas_ckpt.Repository) -> None:
    rng = np.random.default_rng(1)
    blob = rng.bytes(700_000)
    text = "grüße 😀 " * 40_000
    loaded = repo.load(repo.save({"blob": blob, "text": text}))
    assert loaded == {"blob": blob, "text": text}
    raw = [c for c in repo.blocks if c.codec.name == "raw"]
    assert len(raw) >= 3  # content-defined chunks of the 700 kB blob, plus the text's
    assert max(repo.blocks.size(cidlib.to_bytes(c)) for c in raw) <= MiB


def test_empty_state_and_scalar_roots(repo: cas_ckpt.Repository) -> None:
    for state in [{}, [], (), None, 0, "", b"", 1.5, np.float16(2.0), np.zeros((0, 3))]:
        assert_state_equal(state, repo.load(repo.save(state)))


# -- dedup ---------------------------------------------------------------------------------------
def test_identical_chunks_are_stored_once(repo: cas_ckpt.Repository) -> None:
    array = np.random.default_rng(0).random(3 * MiB // 8)  # 3 MiB of float64
    repo.save({"a": array, "b": array.copy()})
    report = repo.last_save
    assert report is not None
    assert report.logical_bytes == 6 * MiB
    raw = [c for c in repo.blocks if c.codec.name == "raw"]
    assert len(raw) == 3  # three 1 MiB chunks, shared by both arrays
    assert report.blocks_reused >= 3 and report.bytes_reused >= 3 * MiB
    assert 3 * MiB <= report.bytes_written < 3 * MiB + 64 * 1024
    # A later checkpoint that changes one chunk's worth of data writes only that chunk (and nodes).
    changed = array.copy()
    changed[:10] = -1.0
    repo.save({"a": changed, "b": array})
    report = repo.last_save
    assert report is not None
    assert report.bytes_written < MiB + 64 * 1024
    assert report.bytes_reused >= 5 * MiB
    assert len([c for c in repo.blocks if c.codec.name == "raw"]) == 4


# -- unsupported values --------------------------------------------------------------------------
class Custom:
    pass


UNSUPPORTED = {
    "object array": np.array([object(), 1], dtype=object),
    "set": {1, 2},
    "frozenset": frozenset(),
    "custom class": Custom(),
    "datetime64 array": np.array(["2024-01-01"], dtype="datetime64[D]"),
    "timedelta64 array": np.array([1], dtype="timedelta64[s]"),
    "str array": np.array(["a", "bc"]),
    "bytes array": np.array([b"a"]),
    "structured array": np.zeros(2, dtype=[("a", "<i4"), ("b", "<f8")]),
    "longdouble array": np.zeros(2, dtype=np.longdouble),
    "datetime": datetime.datetime(2024, 1, 1),
    "fraction": fractions.Fraction(1, 3),
    "bytearray": bytearray(b"x"),
    "memoryview": memoryview(b"x"),
    "complex": 1 + 2j,
    "function": len,
    "datetime64 scalar": np.datetime64("2024-01-01"),
    "str scalar": np.str_("x"),
    "huge int": 2 ** (8 * 70_000),
    "surrogate str": "\ud800",
}


@pytest.mark.parametrize("value", UNSUPPORTED.values(), ids=UNSUPPORTED.keys())
def test_unsupported_values_name_their_path(repo: cas_ckpt.Repository, value: Any) -> None:
    repo.save({"x": 1})
    before = set(repo.blocks)
    head = repo.resolve("main")
    state = {"model": {"w": np.zeros(3)}, "optimizer": {"state": {3: {"exp_avg": value}}}}
    with pytest.raises(cas_ckpt.errors.StateTypeError) as info:
        repo.save(state)
    assert info.value.path == "optimizer.state.3.exp_avg"
    assert "optimizer.state.3.exp_avg" in str(info.value)
    assert isinstance(info.value, TypeError)
    # Nothing was written and the ref did not move.
    assert set(repo.blocks) == before
    assert repo.resolve("main") == head


def test_unsupported_value_inside_lists_and_tuples() -> None:
    with cas_ckpt.open("memory://") as repo:
        state = {"optimizer": {"state": [{}, {}, {}, ({"exp_avg": {1}},)]}}
        with pytest.raises(cas_ckpt.errors.StateTypeError) as info:
            repo.save(state)
    assert info.value.path == "optimizer.state.3.0.exp_avg"


@pytest.mark.parametrize(
    ("key", "shown"),
    [
        ((1, 2), "(1, 2)"),
        (1.5, "1.5"),
        (True, "True"),
        (b"k", "b'k'"),
        (None, "None"),
        (2**64, str(2**64)),
        (frozenset(), "frozenset()"),
    ],
    ids=["tuple", "float", "bool", "bytes", "None", "int over 64 bits", "frozenset"],
)
def test_bad_dict_keys_are_rejected(key: Any, shown: str) -> None:
    with cas_ckpt.open("memory://") as repo, pytest.raises(cas_ckpt.errors.StateTypeError) as info:
        repo.save({"model": {"layer": {key: 1}}})
    assert info.value.path == f"model.layer.{shown}"
    assert len(list(repo.blocks)) == 0


def test_too_deep_state_is_a_state_type_error() -> None:
    state: Any = 0
    for _ in range(300):
        state = [state]
    with cas_ckpt.open("memory://") as repo, pytest.raises(cas_ckpt.errors.StateTypeError, match="deeper"):
        repo.save(state)


@pytest.mark.parametrize("container", [dict, list])
def test_the_depth_limit_holds_for_arrays_as_for_any_value(container: type) -> None:
    """An array is a value like any other: at the deepest level allowed it saves and loads, one
    level deeper it is refused, whether its parent is a dict or a list."""
    def nest(levels: int) -> Any:
        state: Any = np.arange(3, dtype=np.float32)
        for _ in range(levels):
            state = {"k": state} if container is dict else [state]
        return state

    with cas_ckpt.open("memory://") as repo:
        loaded = repo.load(repo.save(nest(MAX_DEPTH)))
        for _ in range(MAX_DEPTH):
            loaded = loaded["k"] if container is dict else loaded[0]
        assert loaded.tolist() == [0.0, 1.0, 2.0]
        with pytest.raises(cas_ckpt.errors.StateTypeError, match="deeper"):
            repo.save(nest(MAX_DEPTH + 1))


@pytest.mark.parametrize("container", [dict, list])
def test_a_node_nesting_an_array_too_deep_is_refused_on_load(container: type) -> None:
    """What no save writes, a hand-made node: the reader refuses it too, before the array."""
    state: Any = Tagged(NDARRAY, {"dtype": "<f4", "shape": [1], "data": b"\0\0\0\0"})
    for _ in range(MAX_DEPTH + 1):
        state = {"k": state} if container is dict else [state]
    node = codec.encode(state)
    with cas_ckpt.open("memory://") as repo:
        root = repo.hasher.node(node)
        with repo.blocks.writer() as writer:
            writer.put(root, node)
        with pytest.raises(cas_ckpt.errors.DecodeError, match="deeper"):
            repo.load(cidlib.to_cid(root))


def test_deeply_nested_tuples_within_the_limit_round_trip() -> None:
    # 250 nested tuples: each tuple is an ext value inside its parent's payload.
    state: Any = ("leaf",)
    for _ in range(249):
        state = (state,)
    with cas_ckpt.open("memory://") as repo:
        loaded = repo.load(repo.save(state))
    depth = 0
    while loaded != "leaf":
        assert type(loaded) is tuple and len(loaded) == 1
        loaded, depth = loaded[0], depth + 1
    assert depth == 250


# -- the record of the system this grew from ------------------------------------------------------
def test_original_record_maps_one_to_one(repo: cas_ckpt.Repository) -> None:
    """The old system saved graph, step, loss_cid, optimizer_state and timestamp: keep them 1:1."""
    hasher = cidlib.Hasher()
    rng = np.random.default_rng(3)
    weights = {f"layer.{i}.weight": rng.standard_normal((64, 64)).astype(np.float32) for i in range(3)}
    outputs = {name: cidlib.to_str(hasher.raw(w.tobytes())) for name, w in weights.items()}
    loss = np.float32(0.125)
    loss_cid = cidlib.to_str(hasher.raw(np.asarray(loss).tobytes()))
    record = {
        "graph": {
            "nodes": [
                {"id": 0, "op": "input", "inputs": [], "output": outputs["layer.0.weight"]},
                {"id": 1, "op": "matmul", "inputs": [outputs["layer.0.weight"]],
                 "output": outputs["layer.1.weight"]},
                {"id": 2, "op": "relu", "inputs": [outputs["layer.1.weight"],
                                                   outputs["layer.2.weight"]],
                 "output": outputs["layer.2.weight"]},
            ],
            "params": weights,
        },
        "step": 1200,
        "loss_cid": loss_cid,
        "optimizer_state": {name: rng.bytes(20_000) for name in weights},
        "timestamp": 1_717_171_717.25,
    }
    root = repo.save(record, step=record["step"], metadata={"loss": float(loss)})
    loaded = repo.load(str(root))
    assert_state_equal(record, loaded)
    assert list(loaded) == ["graph", "step", "loss_cid", "optimizer_state", "timestamp"]
    assert cidlib.to_cid(loaded["loss_cid"]).codec.name == "raw"
    assert repo.commit(root).step == 1200
    assert repo.load(root, path=["optimizer_state", "layer.1.weight"]) == (
        record["optimizer_state"]["layer.1.weight"]
    )
    assert repo.load(root, path="graph.nodes.1.op") == "matmul"


def test_many_small_saves_make_a_linear_history(repo: cas_ckpt.Repository) -> None:
    for step in range(20):
        repo.save({"step": step, "w": np.full(100, step)}, step=step)
    assert [c.step for c in repo.log()] == list(range(19, -1, -1))
    assert repo.load(path="w").tolist() == [19] * 100
