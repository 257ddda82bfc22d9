"""HTTP(S) servers: one base URL and the client every HTTP reader shares.

:class:`HttpRemote` talks to ``cas-ckpt serve`` or to any IPFS trustless gateway: keep-alive
connections from a bounded pool (urllib3), a timeout on connecting and on every read, a deadline
for each request (all its attempts and waits) and a minimum transfer rate for each body (a server
that hangs or trickles is given up on, never waited for), bounded retries with jittered backoff
for what may pass (a refused or reset connection, a timeout, 429 and 5xx answers, a body cut short
or too slow, a wrong content type, bytes the caller's check refuses), the bearer token, and errors
that name the URL.
It knows paths and bytes, never CIDs: the block store (:mod:`cas_ckpt.blocks.http`) passes a
check that hashes every block against its CID.

urllib3 is the one HTTP client here: thread-safe connection pooling, per-read timeouts and a
response that reads straight into a caller's buffer, without an event loop in the reading process.
A body is read one receive at a time, each bounded by what is left of the read timeout, the
deadline and the rate (a buffered read of n bytes waits for all n, however slowly they come); a
watchdog thread shuts the socket of an attempt still running at its deadline, for the reads that
cannot be bounded so (an answer's headers, a decoder waiting for input).
"""

from __future__ import annotations

import contextlib
import functools
import http.client
import ipaddress
import json
import math
import os
import random
import socket
import threading
import time
import urllib.parse
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

from cas_ckpt.errors import RemoteError, RepositoryError

ENV_TOKEN = "CAS_CKPT_TOKEN"  # the bearer token a client sends and a server requires
WORKERS = 16  # parallel requests (and pooled connections) per server
ATTEMPTS = 4  # tries of one request before its error is raised
CONNECT_TIMEOUT = 10.0
READ_TIMEOUT = 30.0  # seconds without a byte (the trustless gateway spec's suggested default)
TIMEOUT = 300.0  # seconds for one request, its attempts and the waits between them (docs/guide.md)
MIN_RATE = 1024.0  # bytes per second a body keeps over any RATE_WINDOW once it started (0: no check)
RATE_WINDOW = 5.0  # seconds; the body's first window is its grace
DRAIN_LIMIT = 64 * 1024  # an unread rest up to this is read, to keep the connection; more: closed
MAX_BODY = 8 * 1024 * 1024  # the largest body a caller takes without saying more (CAR sections)
_T = TypeVar("_T")
_RETRY_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})
_OK = frozenset({200})
_MAX_RETRY_AFTER = 5.0


class BadAnswer(Exception):
    """An answer that may be right next time (retried): a short body, bytes that fail a check."""


class OtherSize(Exception):
    """The body is whole, passes the caller's check, and is not the size the caller expected."""

    def __init__(self, size: int) -> None:
        super().__init__(f"{size} bytes")
        self.size = size


class _Retry(Exception):
    """One attempt failed in a way the next may not (``wait``: the server's Retry-After)."""

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
    ``timeout``: seconds for one request, all its attempts and the waits between them (None: no
    deadline). ``min_rate``: bytes per second a body must bring over any ``RATE_WINDOW`` seconds
    once it has started (0: no check); a slower one fails its attempt.
    """

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        workers: int = WORKERS,
        attempts: int = ATTEMPTS,
        connect_timeout: float | None = CONNECT_TIMEOUT,
        read_timeout: float | None = READ_TIMEOUT,
        timeout: float | None = TIMEOUT,
        min_rate: float | None = MIN_RATE,
        allow_http: bool = False,
    ) -> None:
        import urllib3

        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise RepositoryError(f"not an http(s) URL: {url!r}")
        if parts.query or parts.fragment:
            raise RepositoryError(f"{url}: a server's URL has no query or fragment")
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds or None, not {timeout!r}")
        if min_rate is not None and not min_rate >= 0:
            raise ValueError(f"min_rate must be a number of bytes per second >= 0, not {min_rate!r}")
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
        self.connect_timeout = math.inf if connect_timeout is None else float(connect_timeout)
        self.read_timeout = math.inf if read_timeout is None else float(read_timeout)
        self.timeout = math.inf if timeout is None else float(timeout)
        self.min_rate = float(min_rate or 0)
        self.http = urllib3.PoolManager(num_pools=4, maxsize=workers, block=True, retries=False)
        self.http.pool_classes_by_scheme = _watched_pools()
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

        def read(response: Any, body: _Body) -> bytes | memoryview:
            _check_type(response, expect_type)
            if into is not None and body.declared is not None and body.declared != into.nbytes:
                data = body.read_bytes(limit)  # a length other than expected: is it the right
                if check is not None:           # block all the same?
                    check(data)
                raise OtherSize(len(data))
            data = body.read_bytes(limit) if into is None else body.read_into(into)
            if check is not None:
                check(data)
            return data

        return self._request("GET", path, accept, read, cid)

    def head(self, path: str, *, accept: str | None = None, cid: str | None = None) -> dict[str, str] | None:
        """HEAD ``path``: the answer's headers (lower-case names), None on 404."""
        headers = self._request("HEAD", path, accept, lambda r, _: dict(r.headers.items()), cid)
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

    def post_json(self, path: str, payload: Any, *, answers: frozenset[int] = _OK) -> tuple[int, Any]:
        """POST ``payload`` as JSON: the answer's status (one of ``answers``) and its JSON; None
        and 404 where the server has no such route. Retried as a GET is: every write route of
        ``cas-ckpt serve`` gives the same answer to the same request made twice."""
        body = json.dumps(payload).encode()
        found = self._request("POST", path, "application/json", _json_answer, None, body=body,
                              content_type="application/json", answers=answers)
        return (404, None) if found is None else found

    def post_stream(self, path: str, chunks: Iterator[bytes], *, content_type: str,
                    answers: frozenset[int] = _OK) -> tuple[int, Any]:
        """POST a body streamed from ``chunks`` (chunked transfer coding), once: a stream cannot
        be sent again. The status (one of ``answers``) and the JSON answer; (404, None) where the
        server has no such route. No deadline for the whole request (an upload may take long):
        each send and receive is bounded by the read timeout."""
        found = self._request("POST", path, "application/json", _json_answer, None, body=chunks,
                              content_type=content_type, answers=answers, attempts=1, timeout=math.inf)
        return (404, None) if found is None else found

    def _request(
        self, method: str, path: str, accept: str | None, read: Callable[[Any, _Body], Any],
        cid: str | None, *, body: bytes | Iterator[bytes] | None = None, content_type: str | None = None,
        answers: frozenset[int] | None = None, attempts: int | None = None, timeout: float | None = None,
    ) -> Any:
        """Attempts of one request until one answers, within the deadline."""
        url = self.where(path)
        headers = dict(self.headers)
        if accept:
            headers["Accept"] = accept
        if content_type:
            headers["Content-Type"] = content_type
        deadline = _Deadline(self.timeout if timeout is None else timeout)
        last = _Retry("")
        attempts = self.attempts if attempts is None else attempts
        for attempt in range(attempts):
            if attempt:
                wait = _retry_wait(attempt - 1, last.wait)
                if wait >= deadline.left():  # a deadline failure is never retried past it
                    raise RemoteError(url, deadline.reached(attempt, f"{last} (the next attempt would "
                                                                    f"start {wait:.1f} s later)"), cid=cid)
                time.sleep(wait)
            try:
                return self._attempt(method, url, headers, read, cid, deadline, body, answers)
            except _Retry as exc:
                last = exc
            if deadline.left() <= 0:
                raise RemoteError(url, deadline.reached(attempt + 1, str(last)), cid=cid)
        if attempts == 1:
            raise RemoteError(url, str(last), cid=cid)
        raise RemoteError(url, f"failed after {attempts} attempts: {last}", cid=cid)

    def _attempt(
        self, method: str, url: str, headers: dict[str, str], read: Callable[[Any, _Body], Any],
        cid: str | None, deadline: _Deadline, body: bytes | Iterator[bytes] | None = None,
        answers: frozenset[int] | None = None,
    ) -> Any:
        """One try: the answer read by ``read``, None on 404; :class:`_Retry` if it may pass."""
        import urllib3

        with _WATCHDOG.watching(deadline.at) as watch:
            left = max(0.001, deadline.left())
            try:
                response = self.http.request(
                    method, url, headers=headers, preload_content=False, redirect=False, retries=False,
                    body=body, chunked=body is not None and not isinstance(body, bytes),
                    pool_timeout=_finite(left),
                    timeout=urllib3.Timeout(connect=_finite(min(self.connect_timeout, left)),
                                            read=_finite(min(self.read_timeout, left))))
            except urllib3.exceptions.HTTPError as exc:  # refused, reset, timed out, TLS...
                raise _Retry("no answer" if deadline.left() <= 0 else _describe(exc)) from None
            answer = _Body(response, method, deadline, self.read_timeout, self.min_rate)
            try:
                result = self._answer(response, answer, url, read, cid, answers)
                if watch.fired:  # the socket was shut under the read: nothing it gave is kept
                    raise BadAnswer(f"no whole answer ({answer.where()})")
                return result
            except (BadAnswer, urllib3.exceptions.HTTPError, http.client.HTTPException, OSError) as exc:
                response.close()  # never reuse a connection whose answer was not read whole
                if deadline.left() > 0:
                    raise _Retry(_describe(exc)) from None
                cut = watch.fired and not answer.pace.total  # the headers may have been cut short
                raise _Retry("no whole answer" if cut else answer.where()) from None
            finally:
                _finish(response, answer, watch.fired)

    def _answer(self, response: Any, body: _Body, url: str, read: Callable[[Any, _Body], Any],
                cid: str | None, answers: frozenset[int] | None = None) -> Any:
        """What an answer means: None (404), the body read by ``read`` (200; with ``answers``,
        a status among them and the body), or an error."""
        status = response.status
        if status == 404:
            return None
        if answers is not None and status in answers:
            return status, read(response, body)
        if status in _RETRY_STATUS:
            raise _Retry(f"HTTP {status} {_text(body)}", _retry_after(response.headers.get("Retry-After")))
        if status in (401, 403):
            raise RemoteError(url, f"HTTP {status}: {_text(body) or 'refused'} (the server "
                              f"needs a token: pass token= or set ${ENV_TOKEN})", cid=cid)
        if status == 413:
            raise RemoteError(url, f"HTTP 413: {_text(body) or 'too large'}", cid=cid)
        if status != 200:
            raise RemoteError(url, f"HTTP {status}: {_text(body)}", cid=cid)
        return read(response, body)


class _Deadline:
    """The end of one request, across its attempts and the waits between them."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.at = time.monotonic() + seconds

    def left(self, now: float | None = None) -> float:
        return self.at - (time.monotonic() if now is None else now)

    def reached(self, attempts: int, detail: str) -> str:
        plural = "s" * (attempts != 1)
        return f"deadline of {self.seconds:g} s passed after {attempts} attempt{plural}: {detail}"


class _Pace:
    """The bytes of one body over time: over any ``RATE_WINDOW`` seconds once it started, at
    least ``min_rate`` bytes per second on average (the first window is the grace)."""

    TICK = RATE_WINDOW / 10  # one mark per tick: a byte is counted at most a tick late

    def __init__(self, min_rate: float, now: float) -> None:
        self.min_rate = min_rate
        self.start = now
        self.total = 0
        self.marks: deque[tuple[float, int]] = deque([(now, 0)])  # (time, bytes by then)

    def add(self, n: int, now: float) -> None:
        self.total += n
        last = self.marks[-1][0]
        if len(self.marks) > 1 and (last - self.start) // self.TICK == (now - self.start) // self.TICK:
            self.marks[-1] = (now, self.total)
        else:
            self.marks.append((now, self.total))
        while len(self.marks) > 2 and self.marks[1][0] <= now - RATE_WINDOW:
            self.marks.popleft()  # only the last mark before the window counts

    def fails_at(self) -> float:
        """When the window's bytes fall under the rate if no more come (inf: no check)."""
        if not self.min_rate:
            return math.inf
        # The window must begin past the first mark whose count leaves too few bytes after it.
        most_before = self.total - self.min_rate * RATE_WINDOW
        i = len(self.marks) - 1
        while i > 0 and self.marks[i - 1][1] > most_before:
            i -= 1
        return self.marks[i][0] + RATE_WINDOW

    def describe(self, now: float) -> str:
        before = 0
        for t, count in self.marks:
            if t > now - RATE_WINDOW:
                break
            before = count
        recent = self.total - before
        return f"transfer slower than {self.min_rate:g} B/s: {recent} B in the last {RATE_WINDOW:g} s"


class _Body:
    """An answer's body, read one receive at a time: each bounded by what is left of the read
    timeout, the deadline and the rate, so a trickle fails even when every read returns."""

    def __init__(
        self, response: Any, method: str, deadline: _Deadline, read_timeout: float, min_rate: float
    ) -> None:
        self.response = response
        self.deadline = deadline
        self.read_timeout = read_timeout
        self.pace = _Pace(min_rate, time.monotonic())
        length = response.headers.get("Content-Length")
        self.declared = int(length) if length is not None and length.isdigit() else None
        if method == "HEAD":
            self.declared = 0  # its Content-Length is the GET's
        self.sock = getattr(response.connection, "sock", None)
        raw = getattr(response, "_fp", None)  # http.client's response, which urllib3 wraps
        # Bytes without a content coding or chunks go from the socket's buffer into the caller's
        # (urllib3 reads into a fresh object and copies: a load's 1 MiB blocks, a third less CPU).
        self.raw = raw if (isinstance(raw, http.client.HTTPResponse) and not raw.chunked
                           and not response.headers.get("Content-Encoding")
                           and hasattr(raw.fp, "readinto1")) else None

    def where(self) -> str:
        """How far the body got, for an error."""
        if self.pace.total == 0 and self.declared is None:
            return "no body yet"
        return f"body at {self.pace.total} of {'?' if self.declared is None else self.declared} bytes"

    def _arm(self) -> None:
        """Bound the next receive; fail at once if the deadline or the rate has passed."""
        now = time.monotonic()
        limit = min(self.read_timeout, self.deadline.left(now), self.pace.fails_at() - now)
        if limit <= 0:
            self._stalled(now)
        if self.sock is not None:
            self.sock.settimeout(_finite(limit))

    def _stalled(self, now: float) -> NoReturn:
        if self.deadline.left(now) <= 0:
            raise BadAnswer(self.where())
        raise BadAnswer(f"{self.pace.describe(now)}, {self.where()}")

    def _once(self, receive: Callable[[], _T]) -> _T:
        """One receive, its failure told as the deadline or the rate where either passed."""
        self._arm()
        try:
            got = receive()
        except Exception:  # a socket timeout arrives as urllib3's error or Python's
            now = time.monotonic() + 0.01  # the timer may wake a little early
            if self.deadline.left(now) <= 0 or now >= self.pace.fails_at():
                self._stalled(now)
            raise
        self.pace.add(got if isinstance(got, int) else len(got), time.monotonic())  # type: ignore[arg-type]
        return got

    def read1(self, size: int) -> bytes:
        """At most ``size`` bytes from one receive (decoded); b"" at the end."""
        raw = self.raw
        if raw is not None:
            return self._once(lambda: _read1(raw, size))
        return self._once(lambda: self.response.read1(size, decode_content=True) or b"")

    def _readinto1(self, view: memoryview) -> int:
        raw = self.raw
        if raw is None:
            data = self.read1(view.nbytes)
            view[: len(data)] = data
            return len(data)
        return self._once(lambda: _readinto1(raw, view))

    def read_into(self, into: memoryview) -> memoryview:
        """The whole body into ``into``, exactly its size."""
        done = 0
        while done < into.nbytes:
            n = self._readinto1(into[done:])
            if not n:
                raise BadAnswer(f"body cut short: {done} of {into.nbytes} bytes")
            done += n
        if self.read1(1):
            raise BadAnswer(f"more than the {into.nbytes} bytes expected")
        return into

    def read_bytes(self, limit: int) -> bytes:
        """The whole body, at most ``limit`` bytes."""
        if self.declared is not None and self.declared > limit:
            raise BadAnswer(f"{self.declared} bytes, more than the {limit} allowed")
        parts, size = [], 0
        while chunk := self.read1(min(1 << 20, limit + 1 - size)):
            parts.append(chunk)
            size += len(chunk)
            if size > limit:
                raise BadAnswer(f"more than the {limit} bytes allowed")
        if self.declared is not None and size != self.declared:
            raise BadAnswer(f"body cut short: {size} of {self.declared} bytes")
        return b"".join(parts)


def _read1(raw: http.client.HTTPResponse, size: int) -> bytes:
    """At most ``size`` bytes of ``raw``'s body from one receive."""
    data = raw.read1(size)
    if raw.length == 0:
        raw.close()  # http.client's read1 leaves a whole body open: the connection may serve another
    return data


def _readinto1(raw: http.client.HTTPResponse, view: memoryview) -> int:
    """One receive of ``raw``'s body into ``view``, kept in step with http.client's count."""
    if raw.fp is None:
        return 0
    if raw.length is not None:
        view = view[: raw.length]
    n = raw.fp.readinto1(view) if view.nbytes else 0
    if raw.length is not None:
        raw.length -= n
    if not n or raw.length == 0:
        raw.close()  # as http.client does at the body's end: the connection may serve another
    return n


def _finish(response: Any, body: _Body, fired: bool) -> None:
    """Back to the pool, whatever happened (a connection kept out would be lost for good): read
    whole first, or closed; a small unread rest is read within the deadline, to keep it."""
    if response.connection is None:
        return
    if fired:
        response.close()
    elif not response.closed:
        try:
            body.read_bytes(DRAIN_LIMIT)
        except Exception:  # too long, too slow, or broken: the connection goes
            response.close()
    response.release_conn()


@dataclass
class _Watch:
    deadline: float
    sock: Any = None
    fired: bool = False


class _Watchdog:
    """Shuts the socket of an attempt still running at its deadline (a thread of its own, started
    on first use): a read waiting for headers that trickle in, or for a decoder's input, cannot
    be bounded by socket timeouts, which count from each byte."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._watched: dict[int, _Watch] = {}
        self._wake = math.inf
        self._thread: threading.Thread | None = None
        self._local = threading.local()  # the attempt this thread is making

    @contextlib.contextmanager
    def watching(self, deadline: float) -> Iterator[_Watch]:
        """This thread's attempt, until ``deadline``; its socket is known once it is sent."""
        watch = _Watch(deadline)
        self._local.watch = watch
        try:
            yield watch
        finally:
            self._local.watch = None
            with self._cond:
                self._watched.pop(id(watch), None)

    def attach(self, sock: Any) -> None:
        """Watch ``sock``, the socket of this thread's attempt (a connection waiting for an answer)."""
        watch = getattr(self._local, "watch", None)
        if watch is None or sock is None or math.isinf(watch.deadline):
            return
        with self._cond:
            watch.sock = sock
            self._watched[id(watch)] = watch
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="cas_ckpt-http-deadline", daemon=True)
                self._thread.start()
            elif watch.deadline < self._wake:
                self._cond.notify()

    def _run(self) -> None:
        with self._cond:
            while True:
                now = time.monotonic()
                for key, watch in list(self._watched.items()):
                    if watch.deadline <= now:
                        del self._watched[key]
                        watch.fired = True
                        _shut(watch.sock)
                self._wake = min((w.deadline for w in self._watched.values()), default=math.inf)
                self._cond.wait(None if math.isinf(self._wake) else self._wake - now)

    def reset(self) -> None:
        """In a forked child: the parent's thread and lock are not this process's."""
        self.__init__()  # type: ignore[misc]


def _shut(sock: Any) -> None:
    """End every read of ``sock`` now: they see the end of the stream."""
    # socket.socket's own shutdown: an SSLSocket's would also drop its TLS state under a reader.
    if isinstance(sock, socket.socket):
        with contextlib.suppress(OSError):
            socket.socket.shutdown(sock, socket.SHUT_RDWR)


_WATCHDOG = _Watchdog()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_WATCHDOG.reset)


@functools.cache
def _watched_pools() -> dict[str, type]:
    """urllib3's pools, with connections that tell the watchdog their socket once a request is
    sent (urllib3 has no other way to reach it before the answer's headers are read)."""
    from urllib3 import connection, connectionpool

    class Watched:
        sock: Any

        def getresponse(self) -> Any:
            _WATCHDOG.attach(self.sock)
            return super().getresponse()  # type: ignore[misc]

    # urllib3's names: its errors show them
    class HTTPConnection(Watched, connection.HTTPConnection):
        pass

    class HTTPSConnection(Watched, connection.HTTPSConnection):
        pass

    class HTTPConnectionPool(connectionpool.HTTPConnectionPool):
        ConnectionCls = HTTPConnection

    class HTTPSConnectionPool(connectionpool.HTTPSConnectionPool):
        ConnectionCls = HTTPSConnection

    return {"http": HTTPConnectionPool, "https": HTTPSConnectionPool}


def _finite(seconds: float) -> float | None:
    """A timeout as sockets and urllib3 take it (None: none)."""
    return None if math.isinf(seconds) else seconds


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


def _json_answer(response: Any, body: _Body) -> Any:
    _check_type(response, "application/json")
    try:
        return json.loads(body.read_bytes(MAX_BODY))
    except ValueError as exc:
        raise BadAnswer(f"not JSON: {exc}") from None


def _text(body: _Body, limit: int = 300) -> str:
    """An error answer's message on one line: a JSON body's ``error``, else the body's start."""
    data = b""
    with contextlib.suppress(Exception):
        while len(data) < 4096 and (chunk := body.read1(4096 - len(data))):
            data += chunk
    with contextlib.suppress(ValueError, TypeError, KeyError):
        found = json.loads(data)
        if isinstance(found, dict) and "error" in found:
            data = str(found["error"]).encode()
    return " ".join(data[:limit * 4].decode("utf-8", "replace").split())[:limit]


def _check_type(response: Any, expected: str | None) -> None:
    if expected is None:
        return
    got = response.headers.get("Content-Type", "")
    if got.split(";", 1)[0].strip().lower() != expected:
        raise BadAnswer(f"Content-Type {got or '(none)'!r}, expected {expected!r}")
