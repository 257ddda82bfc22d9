"""Shared fixtures and Hypothesis profiles.

Profiles: ``ci`` (the default: quick, no deadline, since save/load timings vary on shared CI machines)
and ``long`` (many more examples), selected with ``CAS_CKPT_LONG=1``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator

import pytest
import s3_server as moto_s3
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


# -- S3: every S3 test runs on two servers, moto and LocalStack ---------------------------------------
S3_SERVERS = ("moto", "localstack")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Run each test that uses ``s3_server`` (through ``s3_env`` or ``s3_url`` too) once per S3
    server: ``test_x[moto]``, ``test_x[localstack]``; unless the test parametrizes it itself."""
    if "s3_server" not in metafunc.fixturenames:
        return
    for mark in metafunc.definition.iter_markers("parametrize"):
        names = mark.args[0] if mark.args else mark.kwargs.get("argnames", ())
        if isinstance(names, str):
            names = [name.strip() for name in names.split(",")]
        if "s3_server" in names:
            return
    metafunc.parametrize("s3_server", S3_SERVERS, indirect=True)


@pytest.fixture(scope="session")
def moto_server() -> Iterator[str]:
    """A real S3-protocol server process (moto, its conditional requests made atomic as S3's are:
    ``tests/s3_server.py``) on 127.0.0.1 for the session; yields its endpoint."""
    with moto_s3.running() as endpoint:
        yield endpoint


@pytest.fixture(scope="session")
def localstack_server() -> Iterator[str]:
    """LocalStack's S3 (``tests/localstack_server.py``, from ``.venv-localstack``) on 127.0.0.1 for
    the session; yields its endpoint. Not installed: the test is skipped, or fails where
    CAS_CKPT_REQUIRE_LOCALSTACK=1 (CI). Installed but not starting: it fails."""
    import localstack_server

    why = localstack_server.missing()
    if why and localstack_server.required():
        pytest.fail(why + "; CAS_CKPT_REQUIRE_LOCALSTACK=1 requires it", pytrace=False)
    if why:
        pytest.skip(why)
    with contextlib.ExitStack() as stack:
        try:
            endpoint = stack.enter_context(localstack_server.running())
        except RuntimeError as exc:  # its log in the message
            failure = str(exc)
        else:
            failure = ""
        if failure:
            pytest.fail(failure, pytrace=False)
        yield endpoint


@pytest.fixture
def s3_server(request: pytest.FixtureRequest) -> tuple[str, str] | None:
    """The S3 server of this test, ``(kind, endpoint)``: parametrized over S3_SERVERS (see
    ``pytest_generate_tests``); moto where a test asks for it without a parameter
    (``request.getfixturevalue("s3_url")``). A test that parametrizes it itself (indirect) may
    pass None where it needs no S3 server (its local medium): then nothing is started."""
    kind = getattr(request, "param", "moto")
    if kind is None:
        return None
    assert kind in S3_SERVERS, kind
    return kind, request.getfixturevalue(f"{kind}_server")


@pytest.fixture
def s3_env(
    s3_server: tuple[str, str] | None, monkeypatch: pytest.MonkeyPatch, tmp_path: os.PathLike[str]
) -> str:
    """The AWS environment variables pointed at this test's S3 server (and nothing else); its endpoint."""
    assert s3_server is not None, "this test's s3_server parameter is None: it has no S3 server"
    moto_s3.point_aws_at(s3_server[1], monkeypatch, tmp_path)
    return s3_server[1]


@pytest.fixture
def s3_url(s3_env: str) -> str:
    """A fresh, empty bucket on this test's S3 server: ``s3://<bucket>/repo``."""
    return moto_s3.new_bucket(s3_env)


@pytest.fixture
def s3_url_on(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch,
              tmp_path: os.PathLike[str]) -> Callable[[str], str]:
    """``s3_url_on(kind)``: ``s3_url`` on the S3 server of that kind (``s3_env`` set up for it), for
    a fixture whose own parameter names the server (a test parametrizes ``s3_server`` instead)."""

    def on(kind: str) -> str:
        assert kind in S3_SERVERS, kind
        endpoint = request.getfixturevalue(f"{kind}_server")
        moto_s3.point_aws_at(endpoint, monkeypatch, tmp_path)
        return moto_s3.new_bucket(endpoint)

    return on
