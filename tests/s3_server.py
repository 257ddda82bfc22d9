"""moto's S3 server, with its conditional requests made atomic as S3's are: the tests' S3 server.

moto checks ``If-Match`` / ``If-None-Match`` and then writes, in one of many request threads, with no
lock between the two: two racing PUTs conditional on the same ETag can both succeed, which S3
never allows. cas_ckpt's refs, leases and packs rely on that guarantee, so the tests run moto with
every conditional request serialised (one at a time, against each other). Unconditional requests
still run in parallel: cas_ckpt moves nothing that matters with them.

``python tests/s3_server.py -p PORT [-H HOST] [--switch-interval SECONDS] [--ignore WHAT]``.
``--ignore delete`` (or ``complete``, ``put``) makes it ignore the conditions of those requests,
as MinIO and LocalStack ignore ``If-Match`` on DELETE. The switch interval
(Python's, for the server process) is for ``tests/test_s3_server.py``: a tiny one interleaves the
request threads often enough to show moto's race in seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

CONDITIONS = ("HTTP_IF_MATCH", "HTTP_IF_NONE_MATCH")


class AtomicConditions:
    """WSGI middleware: requests that carry a condition run one at a time, response included."""

    def __init__(self, app: Callable[..., Iterable[bytes]]) -> None:
        self.app = app
        self.lock = threading.Lock()

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if not any(name in environ for name in CONDITIONS):
            return self.app(environ, start_response)
        with self.lock:  # the check and the write it guards happen inside the app call
            return list(self.app(environ, start_response))


# Conditions a server may ignore, each a request it is dropped from: DELETE (MinIO, LocalStack),
# CompleteMultipartUpload (a POST with ?uploadId=), PUT.
IGNORABLE = {
    "delete": lambda env: env["REQUEST_METHOD"] == "DELETE",
    "complete": lambda env: env["REQUEST_METHOD"] == "POST" and "uploadId=" in env.get("QUERY_STRING", ""),
    "put": lambda env: env["REQUEST_METHOD"] == "PUT",
}


class IgnoredConditions:
    """WSGI middleware: the server ignores the conditions of the requests ``ignored`` names."""

    def __init__(self, app: Callable[..., Iterable[bytes]], ignored: Iterable[str]) -> None:
        self.app = app
        self.tests = [IGNORABLE[name] for name in ignored]

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if any(test(environ) for test in self.tests):
            for name in CONDITIONS:
                environ.pop(name, None)
        return self.app(environ, start_response)


def point_aws_at(endpoint: str, monkeypatch: Any, tmp_path: os.PathLike[str]) -> None:
    """The AWS environment variables pointed at ``endpoint`` (and nothing else)."""
    for name in [n for n in os.environ if n.startswith("AWS_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path) + "/no-aws-config")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path) + "/no-aws-credentials")


def new_bucket(endpoint: str) -> str:
    """A fresh, empty bucket on the server at ``endpoint``: ``s3://<bucket>/repo``."""
    import boto3

    bucket = f"test-{uuid.uuid4().hex[:20]}"
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
    return f"s3://{bucket}/repo"


@contextlib.contextmanager
def running(*options: str, env: dict[str, str] | None = None) -> Iterator[str]:
    """This server in a process of its own on a free loopback port; yields its endpoint URL."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc = subprocess.Popen([sys.executable, str(Path(__file__)), "-p", str(port), *options],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the moto S3 server did not start") from None
                time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main(argv: list[str] | None = None) -> None:
    from moto.moto_server.werkzeug_app import (
        DomainDispatcherApplication,
        MotoRequestHandler,
        create_backend_app,
    )
    from werkzeug.serving import run_simple

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-H", "--host", default="127.0.0.1")
    parser.add_argument("-p", "--port", type=int, required=True)
    parser.add_argument("--switch-interval", type=float, default=None)
    parser.add_argument("--plain", action="store_true", help="moto as it is, without the lock")
    parser.add_argument("--ignore", action="append", default=[], choices=sorted(IGNORABLE),
                        help="ignore this condition, as some servers do (MinIO and LocalStack: delete)")
    args = parser.parse_args(argv)
    os.environ.setdefault("MOTO_PORT", str(args.port))  # as moto.server does: its own URLs use it
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    app = DomainDispatcherApplication(create_backend_app)
    served = app if args.plain else AtomicConditions(app)
    if args.ignore:
        served = IgnoredConditions(served, args.ignore)
    run_simple(args.host, args.port, served, threaded=True, request_handler=MotoRequestHandler)


if __name__ == "__main__":
    main()
