"""Issue #48: a deadline for every HTTP client call, against real hostile servers on 127.0.0.1.

Each server here is a plain socket server on a thread of this process (a port the kernel picks):
one that declares a 1 MB body and sends a byte at a time, one that never answers, one whose
headers trickle in, one that is always busy (503 with Retry-After). Every call must fail with a
:class:`RemoteError` naming the URL within its ``timeout`` (plus a second of slack), or once
its body falls under ``min_rate``, however each read fares against ``read_timeout``. Before the
deadline, a byte every 0.5 s kept ``cas_ckpt.open(url)`` waiting past 100 s with
``read_timeout=2, attempts=1``. A drip server gives up after :data:`LIFETIME` seconds, so a
client without the deadline fails these tests instead of hanging them.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import assert_state_equal
from http_servers import serve_process

import cas_ckpt
from cas_ckpt.backends.http import MIN_RATE, RATE_WINDOW, TIMEOUT
from cas_ckpt.errors import RemoteError
from cas_ckpt.manager import CheckpointManager

LIFETIME = 30.0  # seconds a hostile connection lasts at most
SLACK = 1.5  # seconds a failure may come after the deadline (the promise is ~1 s)
CONFIG = {"format": "cas_ckpt", "version": 1, "hash": "sha2-256", "chunk_size": 1 << 20}

Answer = Callable[[socket.socket, str, threading.Event], None]


class Hostile:
    """A server on 127.0.0.1 answering each connection's first request with ``answer(conn,
    request_line, stop)`` on a thread of its own; ``requests`` lists the request lines seen."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.1)  # the accept loop looks at ``stop`` this often
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.stop = threading.Event()
        self.requests: list[str] = []
        self.conns: list[socket.socket] = []
        self.threads = [threading.Thread(target=self._accept, daemon=True)]
        self.threads[0].start()

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            conn.settimeout(LIFETIME)
            self.conns.append(conn)
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self.threads.append(thread)
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            while True:  # keep-alive: every request on the connection
                line = read_request(conn)
                if line is None:
                    return
                self.requests.append(line)
                self.answer(conn, line, self.stop)
        except OSError:
            pass  # the client gave up: what these servers are for
        finally:
            conn.close()

    def close(self) -> None:
        self.stop.set()
        for conn in list(self.conns):
            with suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        for thread in self.threads:
            thread.join(timeout=LIFETIME + 5)
        self.listener.close()


@contextmanager
def hostile(answer: Answer) -> Iterator[Hostile]:
    server = Hostile(answer)
    try:
        yield server
    finally:
        server.close()


def read_request(conn: socket.socket) -> str | None:
    """A request's head, read whole; its first line (None: the client closed)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return None
        data += chunk
    return data.split(b"\r\n", 1)[0].decode()


def head(status: str, length: int, *extra: str, content_type: str = "application/json") -> bytes:
    lines = [f"HTTP/1.1 {status}", f"Content-Type: {content_type}", f"Content-Length: {length}", *extra]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def drip(every: float, length: int = 1_000_000) -> Answer:
    """Headers declaring ``length`` bytes (of a raw block for a block's path, else of JSON), then
    one byte (a space) every ``every`` s."""

    def answer(conn: socket.socket, line: str, stop: threading.Event) -> None:
        kind = "application/vnd.ipld.raw" if " /ipfs/" in line else "application/json"
        conn.sendall(head("200 OK", length, content_type=kind))
        until = time.monotonic() + LIFETIME
        while not stop.wait(every) and time.monotonic() < until:
            conn.sendall(b" ")
        raise OSError("dripped long enough")

    return answer


def silent(conn: socket.socket, line: str, stop: threading.Event) -> None:
    """The request is read and never answered."""
    stop.wait(LIFETIME)
    raise OSError("held long enough")


def dripping_headers(conn: socket.socket, line: str, stop: threading.Event) -> None:
    """A status line, then a header one byte every 0.5 s, never ending."""
    conn.sendall(b"HTTP/1.1 200 OK\r\nX-Slow: ")
    until = time.monotonic() + LIFETIME
    while not stop.wait(0.5) and time.monotonic() < until:
        conn.sendall(b"a")
    raise OSError("dripped long enough")


def busy(conn: socket.socket, line: str, stop: threading.Event) -> None:
    """503 with Retry-After: 1, the way ``cas-ckpt serve`` answers over its stream cap."""
    body = b'{"error": "busy"}'
    conn.sendall(head("503 Service Unavailable", len(body), "Retry-After: 1") + body)


def steady(config_bytes: int, every: float, piece: int) -> Answer:
    """A real config padded with JSON whitespace to ``config_bytes``, ``piece`` bytes every ``every`` s."""
    body = json.dumps(CONFIG).encode().ljust(config_bytes)

    def answer(conn: socket.socket, line: str, stop: threading.Event) -> None:
        conn.sendall(head("200 OK", len(body)))
        for start in range(0, len(body), piece):
            if stop.wait(every):
                return
            conn.sendall(body[start : start + piece])

    return answer


def fails_in_time(call: Callable[[], Any], timeout: float) -> RemoteError:
    """``call``'s RemoteError, raised after ``timeout`` less a little and before it plus SLACK."""
    start = time.monotonic()
    with pytest.raises(RemoteError) as info:
        call()
    elapsed = time.monotonic() - start
    assert timeout - 0.2 <= elapsed <= timeout + SLACK, (elapsed, str(info.value))
    return info.value


# --------------------------------------------------------------------------------------------
# The deadline and the rate
# --------------------------------------------------------------------------------------------
def test_a_body_that_drips_fails_at_the_deadline() -> None:
    with hostile(drip(0.5)) as server:
        error = fails_in_time(lambda: cas_ckpt.open(server.url, storage_options={"timeout": 3}), 3)
    assert error.url == server.url + "/config"
    assert server.url + "/config" in str(error)
    assert "deadline of 3 s passed after 1 attempt: body at" in str(error)
    assert "of 1000000 bytes" in str(error)


def test_a_trickle_within_the_read_timeout_fails_the_minimum_rate() -> None:
    """A byte every 1.5 s: every read returns within read_timeout=2, the rate (the default) does
    not hold once the first window has passed."""
    options = {"read_timeout": 2, "attempts": 1}
    with hostile(drip(1.5)) as server:
        error = fails_in_time(lambda: cas_ckpt.open(server.url, storage_options=options), RATE_WINDOW)
    assert server.url + "/config" in str(error)
    assert f"transfer slower than {MIN_RATE:g} B/s" in str(error)


def test_a_steady_slow_body_passes_and_min_rate_sets_the_floor() -> None:
    """80 KiB/s for 6 s: far above the default floor, so it loads; under a floor of 200 KiB/s it
    fails once the first window has passed, though bytes keep coming."""
    answer = steady(480 * 1024, 0.1, 8 * 1024)
    with hostile(answer) as server, cas_ckpt.open(server.url) as repo:
        assert repo.config.chunk_size == CONFIG["chunk_size"]
    options = {"min_rate": 200 * 1024, "attempts": 1}
    with hostile(answer) as server:
        error = fails_in_time(lambda: cas_ckpt.open(server.url, storage_options=options), RATE_WINDOW)
    assert "transfer slower than 204800 B/s" in str(error)


def test_a_server_that_never_answers_fails_at_the_deadline() -> None:
    with hostile(silent) as server:
        error = fails_in_time(lambda: cas_ckpt.open(server.url, storage_options={"timeout": 2}), 2)
    assert server.url + "/config" in str(error)
    assert "deadline of 2 s passed after 1 attempt: no answer" in str(error)


def test_headers_that_trickle_in_fail_at_the_deadline() -> None:
    """Socket timeouts count from each byte: only the watchdog ends this read."""
    with hostile(dripping_headers) as server:
        error = fails_in_time(lambda: cas_ckpt.open(server.url, storage_options={"timeout": 2}), 2)
    assert server.url + "/config" in str(error)
    assert "deadline of 2 s passed" in str(error)


def test_the_deadline_spans_attempts_and_waits() -> None:
    """503 with Retry-After: 1, every time: attempts go on until the next would start past the
    deadline, then the call fails (at 2.5 s at most, never at attempts x waits)."""
    options = {"timeout": 2.5, "attempts": 10}
    with hostile(busy) as server:
        start = time.monotonic()
        with pytest.raises(RemoteError) as info:
            cas_ckpt.open(server.url, storage_options=options)
        elapsed = time.monotonic() - start
    assert elapsed <= 2.5 + SLACK, elapsed
    assert 2 <= len(server.requests) <= 3, server.requests
    assert "deadline of 2.5 s" in str(info.value) and "HTTP 503 busy" in str(info.value)


def test_an_error_answer_in_json_shows_its_message() -> None:
    body = b'{"error": "no such thing here"}'

    def answer(conn: socket.socket, line: str, stop: threading.Event) -> None:
        conn.sendall(head("400 Bad Request", len(body)) + body)

    with hostile(answer) as server, pytest.raises(RemoteError) as info:
        cas_ckpt.open(server.url)
    assert "HTTP 400: no such thing here" in str(info.value)
    assert '{"error"' not in str(info.value)


def test_options_are_checked() -> None:
    for options in ({"timeout": 0}, {"timeout": -1.0}, {"min_rate": -5}):
        with pytest.raises(ValueError):
            cas_ckpt.open("http://127.0.0.1:9", storage_options=options)


# --------------------------------------------------------------------------------------------
# A real server still works, with the defaults and with tight options
# --------------------------------------------------------------------------------------------
def test_loads_from_a_real_server_pass_with_the_defaults(tmp_path: Path) -> None:
    rng = np.random.default_rng(48)
    state = {"w": rng.random((3, 1_000_000), np.float32), "b": np.arange(10), "step": 7}
    with cas_ckpt.open(tmp_path / "repo") as repo:
        repo.save(state, ref="main")
    with serve_process(tmp_path / "repo") as server:
        with cas_ckpt.open(server.url) as remote:
            assert (remote.blocks.remote.timeout, remote.blocks.remote.min_rate) == (TIMEOUT, MIN_RATE)
            assert_state_equal(state, remote.load("main"))
            assert list(remote.refs()) == ["main"]
        tight = {"timeout": 60, "min_rate": 1 << 20}  # loopback is far faster than 1 MiB/s
        with cas_ckpt.open(server.url, storage_options=tight) as remote:
            assert_state_equal(state, remote.load("main"))
        with cas_ckpt.open(tmp_path / "mine") as mine:
            mine.pull(server.url, "main", storage_options=tight)
            assert_state_equal(state, mine.load("main"))


# --------------------------------------------------------------------------------------------
# Every public entry takes the options
# --------------------------------------------------------------------------------------------
ROOT = "bafkreigh2akiscaildcqabsyg3dfr6chu3fgpregiymsck7e7aqa4s52zy"


def _pull(url: str, mine: cas_ckpt.Repository, tmp_path: Path) -> None:
    mine.pull(url, "main", storage_options={"timeout": 2})


def _clone(url: str, mine: cas_ckpt.Repository, tmp_path: Path) -> None:
    cas_ckpt.clone(url, tmp_path / "copy", storage_options={"timeout": 2}).close()


def _fetch(url: str, mine: cas_ckpt.Repository, tmp_path: Path) -> None:
    mine.fetch(ROOT, gateway=url, pin=True, storage_options={"timeout": 2})


def _manager(url: str, mine: cas_ckpt.Repository, tmp_path: Path) -> None:
    CheckpointManager(url, storage_options={"timeout": 2}).close()


def _replicating_manager(url: str, mine: cas_ckpt.Repository, tmp_path: Path) -> None:
    """A manager on an empty disk resumes from its remote first: that is where it waits."""
    CheckpointManager(mine, replicate_to=url, remote_storage_options={"timeout": 2}).close()


@pytest.mark.parametrize("call", [_pull, _clone, _fetch, _manager, _replicating_manager],
                         ids=["pull", "clone", "fetch", "manager", "manager-remote"])
def test_every_entry_passes_the_deadline_on(
    call: Callable[[str, cas_ckpt.Repository, Path], None], tmp_path: Path
) -> None:
    with hostile(drip(0.5)) as server, cas_ckpt.open(tmp_path / "mine") as mine:
        error = fails_in_time(lambda: call(server.url, mine, tmp_path), 2)
    assert server.url in str(error) and "deadline of 2 s passed" in str(error)
