"""The tests' S3 servers honour conditional writes atomically, as S3 does.

Every S3 test of refs, leases and racing savers means something only if two requests conditional
on the same state cannot both succeed. moto alone lets them (its check and its write are not one
step): ``tests/s3_server.py`` serialises its conditional requests. LocalStack's S3
(``tests/localstack_server.py``) has nothing in front of it: its PUT checks the condition and
writes under one lock per key, though it makes a new key's lock without one (two first PUTs of a
key could both create it: a few keys in 300 here), which ``localstack_server.py`` fixes in the
server. These tests race real requests at each server as the tests run it, its thread switch
interval made tiny so that they interleave often, and count the winners.

What else of LocalStack's conditional requests cas_ckpt meets is pinned below: it ignores
``If-Match`` on DELETE (cas_ckpt sends no conditional DELETE), and honours ``If-None-Match: *``
and ``If-Match`` on CompleteMultipartUpload one request at a time (not atomically: it checks
outside any lock, and racing completions of one key can both win; cas_ckpt's multipart objects
are packs, named by their content, so two winners wrote the same bytes).
"""

from __future__ import annotations

import collections
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import localstack_server
import pytest
import s3_server

boto3 = pytest.importorskip("boto3")
botocore = pytest.importorskip("botocore")

CLIENT = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing", "region_name": "us-east-1"}
BUCKET = "conditional-race"
THREADS = 8


def _localstack(**options: Any) -> Any:
    """``localstack_server.running(**options)``; skipped (failed where CAS_CKPT_REQUIRE_LOCALSTACK=1)
    where LocalStack is not installed."""
    why = localstack_server.missing()
    if why and localstack_server.required():
        pytest.fail(why + "; CAS_CKPT_REQUIRE_LOCALSTACK=1 requires it", pytrace=False)
    if why:
        pytest.skip(why)
    return localstack_server.running(**options)


@pytest.fixture(scope="module", params=["moto", "localstack"])
def interleaving_server(request: pytest.FixtureRequest) -> Iterator[str]:
    """Each S3 server as the tests run it (moto: its conditional requests serialised; LocalStack:
    its creates fixed), its request threads switching every microsecond."""
    if request.param == "moto":
        server = s3_server.running("--switch-interval", "1e-6")
    else:
        server = _localstack(switch_interval=1e-6)
    with server as endpoint:
        boto3.client("s3", endpoint_url=endpoint, **CLIENT).create_bucket(Bucket=BUCKET)
        yield endpoint


@pytest.fixture(scope="module")
def localstack(request: pytest.FixtureRequest) -> Any:
    """A client of the session's LocalStack S3 server (conftest.py), with a bucket of this module."""
    endpoint = request.getfixturevalue("localstack_server")
    client = boto3.client("s3", endpoint_url=endpoint, **CLIENT)
    client.create_bucket(Bucket=BUCKET)
    return client


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


# -- LocalStack's other conditional requests, one at a time -------------------------------------------
WRONG_ETAG = '"0123456789abcdef0123456789abcdef"'


def _code(call: Callable[[], Any]) -> str:
    """The error code of ``call()``, or "ok"."""
    try:
        call()
    except botocore.exceptions.ClientError as exc:
        return str(exc.response["Error"]["Code"])
    return "ok"


def _exists(client: Any, key: str) -> bool:
    return _code(lambda: client.head_object(Bucket=BUCKET, Key=key)) == "ok"


def _complete(client: Any, key: str, body: bytes, **condition: str) -> str:
    """A one-part multipart upload of ``body`` to ``key``, completed with ``condition``."""
    upload = client.create_multipart_upload(Bucket=BUCKET, Key=key)["UploadId"]
    part = client.upload_part(Bucket=BUCKET, Key=key, UploadId=upload, PartNumber=1, Body=body)
    parts = {"Parts": [{"PartNumber": 1, "ETag": part["ETag"]}]}
    code = _code(lambda: client.complete_multipart_upload(Bucket=BUCKET, Key=key, UploadId=upload,
                                                          MultipartUpload=parts, **condition))
    if code != "ok":
        client.abort_multipart_upload(Bucket=BUCKET, Key=key, UploadId=upload)
    return code


def test_localstack_ignores_if_match_on_delete(localstack: Any) -> None:
    """Why cas_ckpt sends no conditional DELETE: a DELETE whose If-Match names another ETag
    still deletes on LocalStack (S3 would answer 412 and keep the object)."""
    localstack.put_object(Bucket=BUCKET, Key="delete-me", Body=b"1")
    assert _code(lambda: localstack.delete_object(Bucket=BUCKET, Key="delete-me", IfMatch=WRONG_ETAG)) == "ok"
    assert not _exists(localstack, "delete-me")


def test_localstack_honours_conditions_on_complete_multipart_upload(localstack: Any) -> None:
    """If-None-Match: * (a large pack's create) and If-Match on CompleteMultipartUpload."""
    key = f"mpu-{uuid.uuid4().hex}"
    assert _complete(localstack, key, b"first", IfNoneMatch="*") == "ok"
    assert _complete(localstack, key, b"second", IfNoneMatch="*") == "PreconditionFailed"
    assert _complete(localstack, key, b"third", IfMatch=WRONG_ETAG) == "PreconditionFailed"
    assert localstack.get_object(Bucket=BUCKET, Key=key)["Body"].read() == b"first"
    etag = localstack.head_object(Bucket=BUCKET, Key=key)["ETag"]
    assert _complete(localstack, key, b"fourth", IfMatch=etag) == "ok"
    assert localstack.get_object(Bucket=BUCKET, Key=key)["Body"].read() == b"fourth"
