"""Per-tensor statistics, change norms and the non-finite scan, streamed from the chunks: checked
against numpy on the whole array, for every kind of dtype, with chunk sizes that cut elements in
two, long tensors (precision), huge values (overflow), and a bounded memory peak."""

from __future__ import annotations

import math
import tracemalloc
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from helpers import flip_byte
from hypothesis import example, given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import cas_ckpt
from cas_ckpt import cid as cidlib
from cas_ckpt.errors import CheckpointExpired, PathNotFound
from cas_ckpt.maintenance.usage import Usage

# Chunk sizes: 4099 and 5001 cut every element wider than a byte across two chunks.
CHUNK_SIZES = [4096, 4099, 5001]
DTYPES = [np.float16, np.float32, np.float64, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, np.int8,
          np.int64, np.uint16, np.uint64, np.bool_, ">f4", np.complex64]


@np.errstate(all="ignore")
def reference(array: np.ndarray[Any, Any]) -> dict[str, Any]:
    """What the statistics must be, from the whole array at once."""
    flat = array.ravel()
    if flat.dtype.kind == "c":
        values = flat.astype(np.complex128)
        nan = np.isnan(values.real) | np.isnan(values.imag)
        inf = ~nan & (np.isinf(values.real) | np.isinf(values.imag))
        good = np.abs(values[~(nan | inf)])
        return {"nan": int(nan.sum()), "inf": int(inf.sum()), "min": None, "max": None, "mean": None,
                "std": None, "l2": float(np.sqrt(np.sum(good**2))) if good.size else
                (0.0 if not flat.size else None)}
    values = flat.astype(np.float64)
    nan, inf = np.isnan(values), np.isinf(values)
    good = values[~(nan | inf)]
    exact = flat[~(nan | inf)] if flat.dtype.kind in "iub" else None
    if not good.size:
        return {"nan": int(nan.sum()), "inf": int(inf.sum()), "min": None, "max": None, "mean": None,
                "std": None, "l2": 0.0 if not flat.size else None}
    return {"nan": int(nan.sum()), "inf": int(inf.sum()),
            "min": int(exact.min()) if exact is not None else float(good.min()),
            "max": int(exact.max()) if exact is not None else float(good.max()),
            "mean": float(good.mean()), "std": float(good.std()), "l2": float(np.sqrt(np.sum(good**2)))}


def assert_stats(found: Any, array: np.ndarray[Any, Any]) -> None:
    expected = reference(array)
    assert (found.nan, found.inf, found.count) == (expected["nan"], expected["inf"], array.size)
    assert found.min == expected["min"] and found.max == expected["max"]
    assert type(found.min) is type(expected["min"])  # exact ints for integer tensors
    for key in ("mean", "std", "l2"):
        value, wanted = getattr(found, key), expected[key]
        if wanted is None:
            assert value is None, key
        else:
            assert value == pytest.approx(wanted, rel=1e-9, abs=1e-12), key


@st.composite
def tensors(draw: st.DrawFn) -> np.ndarray[Any, Any]:
    dtype = np.dtype(draw(st.sampled_from(DTYPES)))
    count = draw(st.integers(0, 6000))
    if dtype.kind in "iub":
        return draw(hnp.arrays(dtype, count))
    values = draw(hnp.arrays(np.float32, count, elements=st.floats(-1e4, 1e4, width=32)))
    array = values.astype(dtype) if dtype.kind != "c" else (values + 1j * values[::-1]).astype(dtype)
    for special in draw(st.lists(st.sampled_from([np.nan, np.inf, -np.inf]), max_size=3)):
        if count:
            array[draw(st.integers(0, count - 1))] = special
    return array


@given(array=tensors(), chunk=st.sampled_from(CHUNK_SIZES), fortran=st.booleans())
@example(array=np.array([], np.complex64), chunk=4096, fortran=False)
@example(array=np.array([np.nan, np.inf], np.float32), chunk=4096, fortran=False)
def test_streamed_statistics_equal_numpy_on_the_whole_array(
    array: np.ndarray[Any, Any], chunk: int, fortran: bool
) -> None:
    if fortran and array.size % 3 == 0 and array.size:
        array = np.asfortranarray(array.reshape(3, -1))
    with cas_ckpt.open("memory://", chunk_size=chunk) as repo:
        repo.save({"t": array})
        [found] = repo.stats("main", "t")
    assert found.path == "t" and found.shape == list(array.shape)
    assert found.dtype == str(array.dtype)
    assert_stats(found, array)


def test_every_tensor_below_a_path_in_the_state_order(repo: cas_ckpt.Repository) -> None:
    state = {"model": {"a": np.arange(10.0), "b": {"c": np.ones(3, np.int32)}}, "step": 3,
             "scalar": np.float32(2.5), "name": "run"}
    repo.save(state)
    assert [s.path for s in repo.stats("main")] == ["model.a", "model.b.c", "scalar"]
    assert [s.path for s in repo.stats("main", "model.b")] == ["model.b.c"]
    [scalar] = repo.stats("main", "scalar")
    assert (scalar.shape, scalar.count, scalar.min, scalar.l2) == ([], 1, 2.5, 2.5)
    with pytest.raises(PathNotFound):
        repo.stats("main", "model.nope")
    assert isinstance(repo.stats(), Usage)  # no target: the storage figures, as before
    with pytest.raises(TypeError):
        repo.stats(path="model")


def test_long_tensors_keep_their_precision() -> None:
    # 2^22 values near 1e4 with a spread of 1e-3: a one-pass sum of squares in float64 loses it all
    rng = np.random.default_rng(0)
    array = (1e4 + rng.standard_normal(1 << 22) * 1e-3).astype(np.float64)
    with cas_ckpt.open("memory://") as repo:
        repo.save({"t": array})
        [found] = repo.stats("main")
    assert found.std == pytest.approx(float(np.std(array)), rel=1e-9)
    assert found.mean == pytest.approx(float(np.mean(array)), rel=1e-15)


def test_huge_and_tiny_values_neither_overflow_nor_underflow() -> None:
    with cas_ckpt.open("memory://") as repo:
        repo.save({"huge": np.full(300_000, 1e200), "tiny": np.full(300_000, 1e-200)})
        huge, tiny = repo.stats("main")
    assert huge.l2 == pytest.approx(1e200 * math.sqrt(300_000), rel=1e-12)
    assert tiny.l2 == pytest.approx(1e-200 * math.sqrt(300_000), rel=1e-12)


def test_memory_stays_at_a_few_chunks(tmp_path: Path) -> None:
    array = np.random.default_rng(1).standard_normal(16 << 20).astype(np.float32)  # 64 MiB
    with cas_ckpt.open(tmp_path / "repo") as repo:
        repo.save({"big": array})
        del array
        tracemalloc.start()
        try:
            [found] = repo.stats("main", "big")
            a_b = repo.diff("main", "main")  # nothing read: the same CIDs
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert found.count == 16 << 20 and a_b.identical
    assert peak < 32 << 20, peak  # whole: the array's 64 MiB and its float64 copy's 128 MiB


# -- change norms --------------------------------------------------------------------------------
@given(array=tensors(), chunk=st.sampled_from(CHUNK_SIZES), data=st.data())
@np.errstate(all="ignore")
def test_change_norms_equal_numpy(array: np.ndarray[Any, Any], chunk: int, data: st.DataObject) -> None:
    if array.dtype.kind == "b" or not array.size:
        return
    changed = array.copy()
    for index in data.draw(st.lists(st.integers(0, array.size - 1), min_size=1, max_size=20)):
        changed[index] = changed[index] + changed.dtype.type(3) if changed.dtype.kind != "f" \
            else changed.dtype.type(float(changed[index]) * 0.5 + 1)
    with cas_ckpt.open("memory://", chunk_size=chunk) as repo:
        repo.save({"t": array}, ref="a")
        repo.save({"t": changed}, ref="b")
        report = repo.diff("a", "b")
    wide = np.complex128 if array.dtype.kind == "c" else np.float64
    delta = np.abs(array.astype(wide) - changed.astype(wide))
    if not report.changed:
        assert not np.any(array.view(np.uint8) != changed.view(np.uint8))
        return
    [change] = report.changed
    base = float(np.sqrt(np.sum(np.abs(array.astype(wide)) ** 2)))
    expected_l2 = float(np.sqrt(np.sum(delta**2)))
    if np.isnan(delta).any():
        assert math.isnan(change.l2) and math.isnan(change.relative)
        return
    if np.isinf(delta).any():
        assert math.isinf(change.l2)
        return
    assert change.l2 == pytest.approx(expected_l2, rel=1e-9, abs=1e-300)
    assert change.max_abs == pytest.approx(float(delta.max()), rel=1e-12)
    if math.isfinite(base):
        assert change.a_norm == pytest.approx(base, rel=1e-9, abs=1e-300)
        assert change.relative == pytest.approx(expected_l2 / base if base else math.inf, rel=1e-9)


def test_norms_across_dtypes_and_layouts() -> None:
    rng = np.random.default_rng(2)
    a = rng.standard_normal((60, 70)).astype(np.float32)
    with cas_ckpt.open("memory://", chunk_size=4099) as repo:
        repo.save({"cast": a, "layout": a, "same": a}, ref="a")
        repo.save({"cast": a.astype(ml_dtypes.bfloat16), "layout": np.asfortranarray(a * 2), "same": a},
                  ref="b")
        report = repo.diff("a", "b")
    changes = {c.path: c for c in report.changed}
    assert sorted(changes) == ["cast", "layout"] and report.unchanged == 1
    bf = a.astype(ml_dtypes.bfloat16).astype(np.float64)
    assert changes["cast"].l2 == pytest.approx(float(np.linalg.norm(a.astype(np.float64) - bf)), rel=1e-9)
    assert changes["cast"].detail == "array <f4[60, 70] -> bfloat16[60, 70]"
    assert changes["layout"].relative == pytest.approx(1.0, rel=1e-9)  # b = 2a, element by element
    assert [c.path for c in report.by_tensor()] == ["layout", "cast"]


def test_tensors_with_the_same_cids_are_never_read(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    big = rng.standard_normal(1 << 20).astype(np.float32)
    with cas_ckpt.open(tmp_path / "repo") as repo:
        repo.save({"frozen": big, "tuned": big[:5000].copy()}, ref="a")
        repo.save({"frozen": big, "tuned": big[:5000] * 2}, ref="b")
        frozen = next(c for c in _chunks_of(repo, "a", "frozen"))
        pack, offset, _ = repo.blocks.locate(frozen)
    flip_byte(pack, offset)  # a read of the frozen tensor would now fail its hash
    with cas_ckpt.open(tmp_path / "repo") as repo:
        report = repo.diff("a", "b")
    assert [c.path for c in report.changed] == ["tuned"]
    assert report.changed[0].relative == pytest.approx(1.0, rel=1e-6)


def _chunks_of(repo: cas_ckpt.Repository, ref: str, path: str) -> list[bytes]:
    from cas_ckpt.codec import Link
    from cas_ckpt.paths import select
    from cas_ckpt.tree import TreeReader

    reader = TreeReader(repo.blocks, repo.pool)
    leaf = select(reader, Link(bytes(repo.tree(ref))), [path], ref).value
    return reader.chunk_links(leaf.value)


# -- the first NaN or infinity of a run ------------------------------------------------------------
def test_the_first_nonfinite_step_and_its_tensors(tmp_path: Path) -> None:
    rng = np.random.default_rng(4)
    with cas_ckpt.open(tmp_path / "repo") as repo:
        weights = {"w": rng.standard_normal(300_000).astype(np.float32), "count": np.arange(5),
                   "h": rng.standard_normal(100).astype(ml_dtypes.bfloat16)}
        with cas_ckpt.CheckpointManager(repo, "run", keep_last=2, keep_every=3) as manager:
            for step in range(1, 9):
                weights = {**weights, "h": (weights["h"].astype(np.float32) * 1.1).astype(ml_dtypes.bfloat16)}
                if step == 6:
                    weights["h"][7] = np.inf
                    weights["w"] = weights["w"].copy()
                    weights["w"][[3, 200_000]] = np.nan
                manager.save(step, weights)
        report = repo.find_nonfinite("run")
        assert report.found and report.step == 6
        assert report.commit == next(c.cid for c in repo.log("run") if c.step == 6)
        assert {t.path: (t.nan, t.inf) for t in report.tensors} == {"w": (2, 0), "h": (0, 1)}
        # retained: 3, 6, 7, 8; expired before 6: 1, 2, 4, 5
        assert (report.checked, report.expired) == (2, 4)
        assert report.first_expired_step == 1 and report.metric is None
        assert report.message() == (f"step 6 ({report.commit}) is the first kept checkpoint of run with "
                                    "NaN or Inf, in 2 tensors; 4 expired checkpoints before it (from "
                                    "step 1) were not checked")
        only_h = repo.find_nonfinite("run", path="h")
        assert [t.path for t in only_h.tensors] == ["h"] and only_h.step == 6
        clean = repo.find_nonfinite("run", path="count")
        assert not clean.found and clean.commit is None
        with pytest.raises(PathNotFound):
            repo.find_nonfinite("run", path="nowhere")


def test_the_scan_reads_each_chunk_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(5)
    frozen = rng.standard_normal(1 << 19).astype(np.float32)  # 2 MiB: two chunks, in every step
    with cas_ckpt.open(tmp_path / "repo") as repo:
        for step in range(1, 6):
            repo.save({"frozen": frozen, "moving": np.full(5000, step, np.float32)}, ref="run", step=step)
        reads: list[bytes] = []
        get = repo.blocks.get

        def counted(cid: Any, **kwargs: Any) -> bytes:
            reads.append(cidlib.to_bytes(cid))
            return get(cid, **kwargs)

        monkeypatch.setattr(repo.blocks, "get", counted)
        assert not repo.find_nonfinite("run").found
    raw = [c for c in reads if not cidlib.is_node(c)]
    assert len(raw) == len(set(raw)) == 2 + 5  # frozen's two chunks once, each step's moving once


def test_expired_checkpoints_say_so(tmp_path: Path) -> None:
    with cas_ckpt.open(tmp_path / "repo") as repo:
        with cas_ckpt.CheckpointManager(repo, "run", keep_last=1) as manager:
            manager.save(1, {"w": np.arange(5000.0)})
            manager.save(2, {"w": np.arange(5000.0) + 1})
        with pytest.raises(CheckpointExpired):
            repo.stats("run~1")
