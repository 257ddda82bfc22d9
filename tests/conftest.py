"""Shared fixtures and Hypothesis profiles.

Profiles: ``ci`` (the default: quick, no deadline, since save/load timings vary on shared CI machines)
and ``long`` (many more examples), selected with ``CAS_CKPT_LONG=1``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings

import cas_ckpt

settings.register_profile(
    "ci",
    deadline=None,
    max_examples=50,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "long",
    deadline=None,
    max_examples=2000,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
LONG = os.environ.get("CAS_CKPT_LONG") == "1"
settings.load_profile("long" if LONG else "ci")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect tests marked ``slow`` unless CAS_CKPT_LONG=1 (as the marker's help says)."""
    if LONG:
        return
    slow = [item for item in items if item.get_closest_marker("slow")]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if not item.get_closest_marker("slow")]


@pytest.fixture(params=["local", "memory"])
def repo(request: pytest.FixtureRequest, tmp_path: os.PathLike[str]) -> Iterator[cas_ckpt.Repository]:
    """A fresh repository: on disk under tmp_path, or in memory."""
    location = str(tmp_path) + "/repo" if request.param == "local" else "memory://"
    with cas_ckpt.open(location) as repository:
        yield repository


@pytest.fixture
def local_repo(tmp_path: os.PathLike[str]) -> Iterator[cas_ckpt.Repository]:
    """A fresh repository on disk (``repo.location`` is its directory)."""
    with cas_ckpt.open(str(tmp_path) + "/repo") as repository:
        yield repository
