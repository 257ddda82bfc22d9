"""training_state gathers and restores the generators and stateful objects a loop passes it."""

from __future__ import annotations

import importlib.util
import random
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import cas_ckpt
from cas_ckpt.codec import Link
from cas_ckpt.errors import StateTypeError
from cas_ckpt.integrations.training import capture_rng, restore_rng, restore_training_state, training_state
from cas_ckpt.maintenance.diff import leaves
from cas_ckpt.tree import TreeReader


class Ema:
    """A stateful helper with state_dict()/load_state_dict(), as EMAs and samplers have."""

    def __init__(self) -> None:
        self.value, self.count = np.zeros(3), 0

    def update(self, x: np.ndarray) -> None:
        self.value, self.count = 0.9 * self.value + 0.1 * x, self.count + 1

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value, "count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value, self.count = np.array(state["value"]), int(state["count"])


def draws(gen: np.random.Generator, legacy: np.random.RandomState, py: random.Random) -> list[float]:
    return [*gen.random(3), *legacy.random_sample(3), py.random(), py.gauss(0, 1)]


def test_numpy_and_python_generators_and_state_dict_objects_round_trip() -> None:
    gen, legacy, py, ema = np.random.default_rng(3), np.random.RandomState(4), random.Random(5), Ema()
    py.gauss(0, 1)  # leaves a cached gauss value in the state
    ema.update(np.ones(3))
    repo = cas_ckpt.open("memory://")
    repo.save(training_state(rng=False, data=gen, noise=legacy, aug=py, ema=ema), ref="run")
    expected = draws(gen, legacy, py)
    gen2, legacy2, py2, ema2 = np.random.default_rng(), np.random.RandomState(), random.Random(), Ema()
    restore_training_state(repo.load("run"), rng=False, data=gen2, noise=legacy2, aug=py2, ema=ema2)
    assert draws(gen2, legacy2, py2) == expected
    assert ema2.count == 1 and ema2.value.tolist() == [0.1, 0.1, 0.1]


def test_missing_parts_and_unsupported_objects_are_named() -> None:
    with pytest.raises(StateTypeError, match=r"sampler: builtins\.object is not a generator"):
        training_state(rng=False, sampler=object())
    with pytest.raises(KeyError, match="'ema'"):
        restore_training_state(training_state(rng=False), rng=False, ema=Ema())


@pytest.mark.torch
def test_torch_generators_round_trip() -> None:
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed")
    import torch

    gen = torch.Generator().manual_seed(11)
    torch.rand(5, generator=gen)
    repo = cas_ckpt.open("memory://")
    repo.save(training_state(rng=False, dropout=gen), ref="run")
    expected = torch.rand(5, generator=gen)
    fresh = torch.Generator()
    restore_training_state(repo.load("run"), rng=False, dropout=fresh)
    assert torch.equal(torch.rand(5, generator=fresh), expected)


@given(seed=st.integers(0, 2**64), draws_before=st.integers(0, 700), gauss=st.booleans())
def test_python_rng_state_is_one_uint32_array_restored_bit_for_bit(
    seed: int, draws_before: int, gauss: bool
) -> None:
    random.seed(seed)
    for _ in range(draws_before):  # any position in the Mersenne Twister's 624 words
        random.getrandbits(32)
    if gauss:
        random.gauss(0, 1)  # leaves gauss_next cached in the state
    before = random.getstate()
    repo = cas_ckpt.open("memory://")
    repo.save({"rng": capture_rng()})
    saved = repo.load(path="rng.python")
    assert isinstance(saved[1], np.ndarray) and saved[1].dtype == np.uint32 and saved[1].shape == (625,)
    random.seed(seed + 1)
    restore_rng(repo.load(path="rng"))
    assert random.getstate() == before


def test_a_python_rng_state_saved_as_625_ints_still_restores() -> None:
    random.seed(7)
    random.gauss(0, 1)
    before = random.getstate()
    repo = cas_ckpt.open("memory://")
    old = {"python": before, "numpy": np.random.get_state(legacy=False)}  # how earlier versions saved it
    repo.save({"rng": old, "aug": random.Random(3).getstate()})
    assert isinstance(repo.load(path="rng.python")[1], tuple)
    random.seed(8)
    restore_rng(repo.load(path="rng"))
    assert random.getstate() == before
    aug = random.Random()
    restore_training_state(repo.load(), rng=False, aug=aug)
    assert aug.getstate() == random.Random(3).getstate()


def test_a_training_state_lists_in_a_few_lines() -> None:
    from cas_ckpt.maintenance.describe import describe_leaf

    repo = cas_ckpt.open("memory://")
    repo.save(training_state(extra={"step": 1}, aug=random.Random(1)))
    reader = TreeReader(repo.blocks, repo.pool)
    rows = leaves(reader, Link(bytes(repo.tree())))
    assert len(rows) < 20, list(rows)
    assert describe_leaf("rng.python.1", rows["rng.python.1"])["shape"] == [625]
