"""Shared fixtures and Hypothesis profiles.

Profiles: ``ci`` (the default: quick, no deadline, since save/load timings vary on shared CI machines)
and ``long`` (many more examples), selected with ``CAS_CKPT_LONG=1``.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest
import s3_server
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


@pytest.fixture(autouse=True)
def _close_leftover_managers() -> Iterator[None]:
    """Close the async or replicating managers a test left open, as its own teardown.

    Left for interpreter exit, a failure there (a save that cannot finish) would be reported after
    the run and change pytest's exit status; here it is an error of the test that left it.
    """
    from cas_ckpt import manager

    yield
    errors = []
    for leftover in list(manager._ASYNC_MANAGERS):
        if not leftover._closed:
            try:
                leftover.close()
            except cas_ckpt.CasCkptError as exc:
                errors.append(f"{leftover!r}: {exc}")
    if errors:
        pytest.fail("checkpoint managers left open failed to close: " + "; ".join(errors))


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


@pytest.fixture(scope="session")
def moto_server() -> Iterator[str]:
    """A real S3-protocol server process (moto, its conditional requests made atomic as S3's are:
    ``tests/s3_server.py``) on 127.0.0.1 for the session; yields its endpoint."""
    with s3_server.running() as endpoint:
        yield endpoint


@pytest.fixture
def s3_env(moto_server: str, monkeypatch: pytest.MonkeyPatch, tmp_path: os.PathLike[str]) -> str:
    """The AWS environment variables pointed at the moto server (and nothing else); its endpoint."""
    for name in [n for n in os.environ if n.startswith("AWS_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_server)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path) + "/no-aws-config")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path) + "/no-aws-credentials")
    return moto_server


@pytest.fixture
def s3_url(s3_env: str) -> str:
    """A fresh, empty bucket on the moto server: ``s3://<bucket>/repo``."""
    import boto3

    bucket = f"test-{uuid.uuid4().hex[:20]}"
    boto3.client("s3", endpoint_url=s3_env).create_bucket(Bucket=bucket)
    return f"s3://{bucket}/repo"
