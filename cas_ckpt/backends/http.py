"""HTTP(S) servers: one base URL and the client every HTTP reader shares.

:class:`HttpRemote` talks to ``cas-ckpt serve`` or to any IPFS trustless gateway: keep-alive
connections from a bounded pool (urllib3), a timeout on connecting and on every read (a server
that hangs is given up on, never waited for), bounded retries with jittered backoff for what may
pass (a refused or reset connection, a timeout, 429 and 5xx answers, a body cut short, a wrong
content type, bytes the caller's check refuses), the bearer token, and errors that name the URL.
It knows paths and bytes, never CIDs: the block store (:mod:`cas_ckpt.blocks.http`) passes a
check that hashes every block against its CID.

urllib3 is the one HTTP client here: thread-safe connection pooling, per-read timeouts and a
response that reads straight into a caller's buffer, without an event loop in the reading process.
"""

from __future__ import annotations

import contextlib
import http.client
import ipaddress
import json
import os
import random
import threading
import time
import urllib.parse
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from cas_ckpt.errors import RemoteError, RepositoryError

ENV_TOKEN = "CAS_CKPT_TOKEN"  # the bearer token a client sends and a server requires
WORKERS = 16  # parallel requests (and pooled connections) per server
ATTEMPTS = 4  # tries of one request before its error is raised
CONNECT_TIMEOUT = 10.0
READ_TIMEOUT = 30.0  # seconds without a byte (the trustless gateway spec's suggested default)
MAX_BODY = 8 * 1024 * 1024  # the largest body a caller takes without saying more (CAR sections)
_RETRY_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})
_MAX_RETRY_AFTER = 5.0


class BadAnswer(Exception):
    """An answer that may be right next time (retried): a short body, bytes that fail a check."""


class OtherSize(Exception):
    """The body is whole, passes the caller's check, and is not the size the caller expected."""

    def __init__(self, size: int) -> None:
        super().__init__(f"{size} bytes")
        self.size = size


class _Retry(Exception):
    def __init__(self, detail: str, wait: float | None = None) -> None:
        super().__init__(detail)
        self.wait = wait


def backoff(attempt: int) -> float:
    """Seconds before attempt ``attempt + 1``: exponential, jittered, at most 2."""
    return min(2.0, 0.05 * 2 ** min(attempt, 6)) * (0.5 + random.random() / 2)


def is_http(location: str) -> bool:
    return location.startswith(("http://", "https://"))


def _loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class HttpRemote:
    """One HTTP(S) server at ``url`` (no query; a path prefix is kept).

    ``token``: sent as ``Authorization: Bearer`` on every request (default: ``$CAS_CKPT_TOKEN``).
    A token over plain http beyond the loopback interface is refused unless ``allow_http``.
    """

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        workers: int = WORKERS,
        attempts: int = ATTEMPTS,
        connect_timeout: float = CONNECT_TIMEOUT,
        read_timeout: float = READ_TIMEOUT,
        allow_http: bool = False,
    ) -> None:
        import urllib3

        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise RepositoryError(f"not an http(s) URL: {url!r}")
        if parts.query or parts.fragment:
            raise RepositoryError(f"{url}: a server's URL has no query or fragment")
        self.url = urllib.parse.urlunsplit((parts.scheme, parts.netloc, parts.path.rstrip("/"), "", ""))
        token = token if token is not None else os.environ.get(ENV_TOKEN) or None
        if token and parts.scheme == "http" and not allow_http and not _loopback(parts.hostname):
            raise RepositoryError(
                f"refusing to send a token over plain http to {self.url}: use https, or pass "
                "allow_http=True to accept sending it unencrypted"
            )
        self.headers = {"User-Agent": "cas_ckpt"}
        if token:
            self.headers["Authorization"] = f"Bearer {token}"
        self.workers = workers
        self.attempts = max(1, attempts)
        self.timeout = urllib3.Timeout(connect=connect_timeout, read=read_timeout)
        self.http = urllib3.PoolManager(num_pools=4, maxsize=workers, block=True, retries=False,
                                        timeout=self.timeout)
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    @property
    def pool(self) -> ThreadPoolExecutor:
        """Threads for parallel requests (one connection each, at most ``workers``)."""
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="cas_ckpt-http")
            return self._pool

    def where(self, path: str) -> str:
        """The full URL of ``path`` (which starts with ``/``)."""
        return self.url + path

    def close(self) -> None:
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        self.http.clear()

    def __repr__(self) -> str:
        return f"<HttpRemote {self.url}>"

    # -- requests --------------------------------------------------------------------------------
    def get(
        self,
        path: str,
        *,
        accept: str | None = None,
        expect_type: str | None = None,
        into: memoryview | None = None,
        limit: int = MAX_BODY,
        check: Callable[[Any], None] | None = None,
        cid: str | None = None,
    ) -> bytes | memoryview | None:
        """GET ``path``: the body (or ``into`` filled with it, exactly its size), None on 404.

        ``expect_type``: the Content-Type the answer must have (its media type). ``check`` runs
        on the body and raises :class:`BadAnswer` to refuse it (then the request is tried again).
        A whole body that passes ``check`` but does not fit ``into`` raises :class:`OtherSize`.
        ``cid`` only names the block in errors.
        """

        def read(response: Any) -> bytes | memoryview:
            _check_type(response, expect_type)
            length = response.headers.get("Content-Length")
            if into is not None and length is not None and length != str(into.nbytes):
                body = _read_body(response, None, limit)  # a length other than expected: is it
                if check is not None:                      # the right block all the same?
                    check(body)
                raise OtherSize(len(body))
            body = _read_body(response, into, limit)
            if check is not None:
                check(body)
            return body

        return self._request("GET", path, accept, read, cid)

    def head(self, path: str, *, accept: str | None = None, cid: str | None = None) -> dict[str, str] | None:
        """HEAD ``path``: the answer's headers (lower-case names), None on 404."""
        headers = self._request("HEAD", path, accept, lambda r: dict(r.headers.items()), cid)
        return None if headers is None else {k.lower(): v for k, v in headers.items()}

    def get_json(self, path: str) -> Any:
        """GET ``path`` as JSON; None on 404."""

        def parse(body: bytes | memoryview) -> Any:
            try:
                return json.loads(bytes(body))
            except ValueError as exc:
                raise BadAnswer(f"not JSON: {exc}") from None

        parsed: list[Any] = []
        data = self.get(path, accept="application/json", expect_type="application/json",
                        check=lambda body: parsed.append(parse(body)))
        return None if data is None else parsed[-1]

    def _request(
        self, method: str, path: str, accept: str | None, read: Callable[[Any], Any], cid: str | None
    ) -> Any:
        import urllib3

        url = self.where(path)
        headers = dict(self.headers)
        if accept:
            headers["Accept"] = accept
        last, last_wait = "", None
        for attempt in range(self.attempts):
            if attempt:
                time.sleep(_retry_wait(attempt - 1, last_wait))
            last_wait = None
            try:
                response = self.http.request(method, url, headers=headers, preload_content=False,
                                             redirect=False, retries=False, timeout=self.timeout)
            except urllib3.exceptions.HTTPError as exc:  # refused, reset, timed out, TLS...
                last = _describe(exc)
                continue
            try:
                status = response.status
                if status == 404:
                    return None
                if status in _RETRY_STATUS:
                    last_wait = _retry_after(response.headers.get("Retry-After"))
                    last = f"HTTP {status} {_text(response)}"
                    continue
                if status in (401, 403):
                    raise RemoteError(url, f"HTTP {status}: {_text(response) or 'refused'} (the server "
                                      f"needs a token: pass token= or set ${ENV_TOKEN})", cid=cid)
                if status != 200:
                    raise RemoteError(url, f"HTTP {status}: {_text(response)}", cid=cid)
                result = read(response)
                response.release_conn()
                return result
            except (BadAnswer, urllib3.exceptions.HTTPError, http.client.HTTPException, OSError) as exc:
                last = _describe(exc)
                response.close()  # never reuse a connection whose answer was not read whole
                continue
            finally:
                if response.connection is not None:  # back to the pool, whatever happened: a
                    if not response.closed:          # connection kept out would be lost for good
                        response.drain_conn()
                    response.release_conn()
        raise RemoteError(url, f"failed after {self.attempts} attempts: {last}", cid=cid)


def _retry_wait(attempt: int, retry_after: float | None) -> float:
    return backoff(attempt) if retry_after is None else min(retry_after, _MAX_RETRY_AFTER)


def _retry_after(value: str | None) -> float | None:
    try:
        return max(0.0, float(value)) if value else None
    except ValueError:
        return None


def _describe(exc: BaseException) -> str:
    """What went wrong with one attempt, for the error raised after the last."""
    if isinstance(exc, BadAnswer):
        return str(exc)
    text = str(getattr(exc, "reason", None) or exc)
    if "IncompleteRead" in text:
        return f"body cut short ({type(exc).__name__}: {text})"
    return f"{type(exc).__name__}: {text}"


def _text(response: Any, limit: int = 300) -> str:
    """The start of an error answer's body, on one line."""
    with contextlib.suppress(Exception):
        data = response.read(limit, decode_content=True) or b""
        return " ".join(data.decode("utf-8", "replace").split())
    return ""


def _check_type(response: Any, expected: str | None) -> None:
    if expected is None:
        return
    got = response.headers.get("Content-Type", "")
    if got.split(";", 1)[0].strip().lower() != expected:
        raise BadAnswer(f"Content-Type {got or '(none)'!r}, expected {expected!r}")


def _read_body(response: Any, into: memoryview | None, limit: int) -> bytes | memoryview:
    """The whole body: into ``into`` (exactly its size) or as bytes (at most ``limit``)."""
    length = response.headers.get("Content-Length")
    declared = int(length) if length is not None and length.isdigit() else None
    if into is not None:
        if declared is not None and declared != into.nbytes:
            raise BadAnswer(f"{declared} bytes, expected {into.nbytes}")
        # urllib3's readinto reads into a fresh bytes object and copies that: a body without a
        # content coding is read by http.client's response, which urllib3 wraps, straight into
        # ``into`` (a load's 1 MiB blocks: a third less CPU on this side).
        raw = getattr(response, "_fp", None)
        direct = raw is not None and hasattr(raw, "readinto") and not response.headers.get("Content-Encoding")
        readinto = raw.readinto if direct else response.readinto
        done = 0
        while done < into.nbytes:
            n = readinto(into[done:])
            if not n:
                raise BadAnswer(f"body cut short: {done} of {into.nbytes} bytes")
            done += n
        if (raw.read(1) if direct else response.read(1)):
            raise BadAnswer(f"more than the {into.nbytes} bytes expected")
        return into
    if declared is not None and declared > limit:
        raise BadAnswer(f"{declared} bytes, more than the {limit} allowed")
    parts, size = [], 0
    while True:
        chunk = response.read(min(1 << 20, limit + 1 - size))
        if not chunk:
            break
        parts.append(chunk)
        size += len(chunk)
        if size > limit:
            raise BadAnswer(f"more than the {limit} bytes allowed")
    body = b"".join(parts)
    if declared is not None and len(body) != declared:
        raise BadAnswer(f"body cut short: {len(body)} of {declared} bytes")
    return body
