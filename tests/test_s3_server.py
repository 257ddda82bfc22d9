"""The tests' S3 server (``tests/s3_server.py``) honours conditional writes atomically, as S3 does.

Every S3 test of refs, leases and racing savers means something only if two requests conditional
on the same state cannot both succeed. moto alone lets them (its check and its write are not one
step); these tests race real requests at the server, its thread switch interval made tiny so that
they interleave often, and count the winners.
"""

from __future__ import annotations

import collections
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import s3_server

boto3 = pytest.importorskip("boto3")
botocore = pytest.importorskip("botocore")

CLIENT = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing", "region_name": "us-east-1"}
BUCKET = "conditional-race"
THREADS = 8


@pytest.fixture(scope="module")
def interleaving_server() -> Iterator[str]:
    with s3_server.running("--switch-interval", "1e-6") as endpoint:
        boto3.client("s3", endpoint_url=endpoint, **CLIENT).create_bucket(Bucket=BUCKET)
        yield endpoint


def _race(endpoint: str, seconds: float, attempt: Callable[[Any], None]) -> None:
    """Run ``attempt(client)`` in a loop on THREADS threads, each with its own client."""
    stop = time.monotonic() + seconds
    errors: list[BaseException] = []

    def loop() -> None:
        client = boto3.client("s3", endpoint_url=endpoint, **CLIENT)
        try:
            while time.monotonic() < stop:
                attempt(client)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=loop) for _ in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors[0]


def _failed_condition(exc: Exception) -> bool:
    return isinstance(exc, botocore.exceptions.ClientError) and \
        exc.response["Error"]["Code"] in ("PreconditionFailed", "412", "ConditionalRequestConflict")


def _race_puts(endpoint: str, seconds: float, put: Callable[[Any], str]) -> collections.Counter[str]:
    """How often each thing ``put(client)`` returns was won (a failed condition is a lost race)."""
    won: list[str] = []  # list.append is atomic: a counter's += could lose a double win
    lost: list[None] = []

    def attempt(client: Any) -> None:
        try:
            won.append(put(client))
        except botocore.exceptions.ClientError as exc:
            assert _failed_condition(exc), exc
            lost.append(None)

    _race(endpoint, seconds, attempt)
    assert lost, "no request lost a race: the test raced nothing"
    return collections.Counter(won)


def test_a_put_conditional_on_an_etag_succeeds_once(interleaving_server: str) -> None:
    """Threads read the ETag, then PUT with If-Match on it: each ETag is replaced at most once."""
    boto3.client("s3", endpoint_url=interleaving_server, **CLIENT).put_object(
        Bucket=BUCKET, Key="ref", Body=b"start")

    def replace(client: Any) -> str:
        etag = client.head_object(Bucket=BUCKET, Key="ref")["ETag"]
        client.put_object(Bucket=BUCKET, Key="ref", Body=uuid.uuid4().bytes, IfMatch=etag)
        return str(etag)

    won = _race_puts(interleaving_server, 8.0, replace)
    twice = {etag: n for etag, n in won.items() if n > 1}
    assert not twice, f"{len(twice)} of {len(won)} ETags were replaced by more than one conditional PUT"


def test_a_create_with_if_none_match_succeeds_once(interleaving_server: str) -> None:
    """Threads race to create the key of the current 20 ms window: each key is created once."""

    def create(client: Any) -> str:
        key = f"lease-{int(time.monotonic() * 50)}"
        client.put_object(Bucket=BUCKET, Key=key, Body=uuid.uuid4().bytes, IfNoneMatch="*")
        return key

    created = _race_puts(interleaving_server, 6.0, create)
    twice = [key for key, n in created.items() if n > 1]
    assert not twice, f"{len(twice)} of {len(created)} keys were created by two PUTs with If-None-Match: *"
