"""The chunk grid of a tensor held in boxes by many ranks (cas_ckpt/grid.py), without torch.

Hypothesis draws shapes, item sizes, chunk sizes and shardings (uneven splits of any dimensions
over a mesh, empty boxes, boxes smaller than a chunk); the exchange is then played out between
simulated ranks exactly as cas_ckpt.dcp runs it over a process group: every grid chunk must come
out stored once, whole, equal to the whole tensor's bytes at its place. ``read_region`` is
checked against numpy slicing on a real store, reading only the chunks a box overlaps.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np
import pytest
from helpers import CountingStore
from hypothesis import given, settings
from hypothesis import strategies as st

import cas_ckpt
from cas_ckpt.codec import Link
from cas_ckpt.errors import DecodeError, RepositoryError
from cas_ckpt.grid import Exchange, Piece, box_runs, read_region
from cas_ckpt.tree import TreeReader, parse_dtype


@st.composite
def sharded(draw: Any) -> tuple[list[int], int, list[Piece]]:
    """A shape, an item size and one box per rank: each dimension split unevenly over a mesh."""
    dims = draw(st.integers(0, 4))
    shape = [draw(st.integers(1, 9)) for _ in range(dims)]
    itemsize = draw(st.sampled_from([1, 2, 4, 8]))
    cuts = []
    for size in shape:
        parts = draw(st.integers(1, 3))
        points = sorted(draw(st.lists(st.integers(0, size), min_size=parts - 1, max_size=parts - 1)))
        cuts.append(list(zip([0, *points], [*points, size], strict=True)))
    boxes = list(itertools.product(*cuts))
    ranks = draw(st.permutations(range(len(boxes))))
    pieces = [Piece(rank, tuple(a for a, _ in box), tuple(b - a for a, b in box))
              for rank, box in zip(ranks, boxes, strict=True)]
    return shape, itemsize, pieces


def box_bytes(whole: np.ndarray, piece: Piece) -> np.ndarray:
    """A rank's box of ``whole`` (shape + (itemsize,), uint8) in row-major order."""
    index = tuple(slice(o, o + s) for o, s in zip(piece.offsets, piece.sizes, strict=True))
    return np.ascontiguousarray(whole[index]).reshape(-1)


def play(grid: Exchange, data: list[dict[str, np.ndarray]]) -> dict[tuple[int, int], bytes]:
    """Run every round between the ranks as cas_ckpt.dcp does; return what each rank stored."""
    stored: dict[tuple[int, int], bytes] = {}
    for round_ in grid.rounds:
        sent = [grid.outgoing(rank, round_, data[rank]) for rank in range(grid.world)]
        for src in range(grid.world):
            assert [p.nbytes for p in sent[src]] == list(round_.send[src]), "sizes disagree with the plan"
        for rank in range(grid.world):
            received = grid.incoming(rank, round_, [sent[src][rank] for src in range(grid.world)])
            for t, ks, chunks, _views in grid.stored(rank, round_, data[rank], received):
                for k, chunk in zip(ks, chunks, strict=True):
                    assert (t, k) not in stored, f"chunk {k} of tensor {t} stored twice"
                    assert grid.tensors[t].owners[k] == rank
                    stored[(t, k)] = bytes(chunk)
    return stored


@settings(max_examples=300, deadline=None)
@given(sharded(), st.integers(1, 64), st.integers(1, 200))
def test_every_chunk_is_stored_once_whole_whatever_the_sharding(
    case: tuple[list[int], int, list[Piece]], chunk_size: int, window: int
) -> None:
    shape, itemsize, pieces = case
    nbytes = math.prod(shape) * itemsize
    whole = np.random.default_rng(nbytes).integers(0, 256, size=(*shape, itemsize), dtype=np.uint8)
    world = len(pieces)
    grid = Exchange([("t", shape, itemsize, pieces)], chunk_size, world, window=window)
    data: list[dict[str, np.ndarray]] = [{} for _ in range(world)]
    for piece in pieces:
        data[piece.rank]["t"] = box_bytes(whole, piece)
    stored = play(grid, data)
    flat = whole.reshape(-1).tobytes()
    count = -(-nbytes // chunk_size)
    assert sorted(stored) == [(0, k) for k in range(count)]
    for k in range(count):
        assert stored[(0, k)] == flat[k * chunk_size : (k + 1) * chunk_size]
    for round_ in grid.rounds[:-1]:  # a round is cut before it would pass the window
        assert round_.send.any()


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 5000), st.integers(1, 12), st.sampled_from([1, 2, 4]), st.integers(16, 512))
def test_dim0_shards_move_half_a_chunk_per_edge(rows: int, world: int, itemsize: int, chunk: int) -> None:
    """FSDP's dim-0 shards (torch.chunk's split, trailing ones empty): each shard edge moves at
    most half a chunk (the rank holding most of a chunk stores it), and a chunk inside a shard
    never moves."""
    cols = 3
    per = -(-rows // world)
    pieces = [Piece(r, (min(rows, r * per), 0), (max(0, min(rows, (r + 1) * per) - r * per), cols))
              for r in range(world)]
    grid = Exchange([("w", [rows, cols], itemsize, pieces)], chunk, world)
    moved = sum(int(r.send.sum()) for r in grid.rounds)
    edges = sum(1 for p in pieces[1:] if p.sizes[0])
    assert moved <= edges * (chunk // 2)
    inside = ~grid.tensors[0].assembled
    assert not any(len(r.segments[0]) and np.isin(r.segments[0][:, 0], np.flatnonzero(inside)).any()
                   for r in grid.rounds)


def test_rounds_keep_each_rank_under_the_window() -> None:
    pieces = [Piece(r, (r * 10,), (10,)) for r in range(8)]
    grid = Exchange([(f"t{i}", [80], 1, pieces) for i in range(50)], 16, 8, window=64)
    assert len(grid.rounds) > 1
    for round_ in grid.rounds:
        assert round_.send.sum(0).max() <= 64 and round_.send.sum(1).max() <= 64


def test_gaps_and_overlaps_are_refused_naming_the_tensor() -> None:
    with pytest.raises(RepositoryError, match=r"no rank wrote bytes 40-80 of 'model.w'"):
        Exchange([("model.w", [10, 2], 4, [Piece(0, (0, 0), (5, 2))])], 16, 1)
    with pytest.raises(RepositoryError, match="overlapping"):
        Exchange([("w", [10], 1, [Piece(0, (0,), (6,)), Piece(1, (4,), (6,))])], 4, 2)


@given(sharded())
def test_box_runs_cover_the_box_in_row_major_order(case: tuple[list[int], int, list[Piece]]) -> None:
    shape, itemsize, pieces = case
    whole = np.arange(math.prod(shape) * itemsize, dtype=np.int64).reshape(*shape, itemsize)
    for piece in pieces:
        starts, length = box_runs(shape, itemsize, piece.offsets, piece.sizes)
        expected = box_bytes(whole, piece)
        got = np.concatenate([np.arange(s, s + length) for s in starts]) if len(starts) else expected[:0]
        assert np.array_equal(got, expected)


# --------------------------------------------------------------------------------------------
# Reading a box of a stored array
# --------------------------------------------------------------------------------------------
CHUNK = 4096


@pytest.fixture(scope="module")
def counted() -> Any:
    store = CountingStore(cas_ckpt.blocks.MemoryStore())
    with cas_ckpt.Repository(store, cas_ckpt.refs.MemoryRefStore(), chunk_size=CHUNK) as repo:
        yield repo


@st.composite
def arrays_and_boxes(draw: Any) -> tuple[np.ndarray, tuple[int, ...], tuple[int, ...]]:
    dtype = draw(st.sampled_from(["<f4", "<i2", "|u1", "<f8", "bfloat16"]))
    shape = draw(st.lists(st.integers(1, 40), min_size=1, max_size=3))
    if draw(st.booleans()):
        shape[0] *= 60  # large enough to be chunked on the grid
    numpy_dtype = parse_dtype(dtype) if dtype == "bfloat16" else np.dtype(dtype)
    array = np.random.default_rng(len(shape)).integers(0, 100, size=shape).astype(numpy_dtype)
    offsets, sizes = [], []
    for n in shape:
        a = draw(st.integers(0, n))
        offsets.append(a)
        sizes.append(draw(st.integers(0, n - a)))
    return array, tuple(offsets), tuple(sizes)


@settings(max_examples=150, deadline=None)
@given(arrays_and_boxes(), st.booleans())
def test_read_region_is_numpy_slicing_reading_only_the_chunks_it_needs(
    counted: Any, case: tuple[np.ndarray, tuple[int, ...], tuple[int, ...]], fortran: bool
) -> None:
    array, offsets, sizes = case
    if fortran:
        array = np.asfortranarray(array)
    root = counted.save({"a": array})
    reader = TreeReader(counted.blocks, counted.pool)
    header = reader.resolve(Link(bytes(counted.tree(root))))["a"].value
    counted.blocks.reads.clear()
    got = read_region(reader, header, offsets, sizes)
    box = tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))
    assert got.dtype == array.dtype and got.shape == tuple(sizes)
    assert np.array_equal(got.view(np.uint8), np.ascontiguousarray(array[box]).view(np.uint8))
    if "chunks" in header and header.get("order") != "F" and got.nbytes:
        starts, length = box_runs(array.shape, array.itemsize, offsets, sizes)
        needed = {k for s in starts for k in range(int(s) // CHUNK, (int(s) + length - 1) // CHUNK + 1)}
        links = [link.cid for link in header["chunks"]]
        assert set(counted.blocks.reads) == {links[k] for k in needed}


def test_read_region_refuses_a_box_outside_the_array(counted: Any) -> None:
    root = counted.save({"a": np.zeros((4, 5000), np.float32)})
    reader = TreeReader(counted.blocks, counted.pool)
    header = reader.resolve(Link(bytes(counted.tree(root))))["a"].value
    with pytest.raises(DecodeError, match="not inside an array of shape"):
        read_region(reader, header, (3, 0), (2, 5000))
