"""Real HTTP servers for the HTTP tests: ``cas-ckpt serve`` processes, the same server on a thread
of this process, and a fault-injecting proxy in front of either.

Every server listens on 127.0.0.1 with a port the kernel picks, and says when it listens (the
process prints its URL; the threads set an event): nothing waits on a sleep.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from aiohttp import ClientSession, web


class ServerProcess:
    """``python -m cas_ckpt serve REPO --port 0`` (and ``--token``), its URL read from its stdout;
    its stdout and stderr then read on threads as they come (a server that logs much never blocks
    on a full pipe), its stderr (the log) kept."""

    def __init__(self, repo: str | Path, *extra: str, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cas_ckpt", "serve", str(repo), "--port", "0", *extra],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})},
        )
        assert self.proc.stdout is not None and self.proc.stderr is not None
        line = self.proc.stdout.readline()  # printed once the server listens
        if not line:
            raise RuntimeError(f"cas-ckpt serve did not start: {self.proc.stderr.read()}")
        self.url = line.split(" at ")[1].split()[0]
        self.port = int(self.url.rsplit(":", 1)[1])
        self.pid = self.proc.pid
        self._err: list[str] = []
        self._lock = threading.Lock()
        self._readers = [threading.Thread(target=self._drain, args=(stream, keep), daemon=True)
                         for stream, keep in ((self.proc.stderr, True), (self.proc.stdout, False))]
        for reader in self._readers:
            reader.start()

    def _drain(self, stream: Any, keep: bool) -> None:
        for line in stream:
            if keep:
                with self._lock:
                    self._err.append(line)

    def stderr(self, start: int = 0) -> str:
        """The server's log so far, from line ``start``."""
        with self._lock:
            return "".join(self._err[start:])

    def stderr_lines(self) -> int:
        with self._lock:
            return len(self._err)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self._reap()

    def stop(self) -> str:
        """SIGTERM, wait (SIGKILL after 30 s); the server's stderr (its log)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        self._reap()
        return self.stderr()

    def _reap(self) -> None:
        """Wait for the process and its pipes' readers, and close the pipes."""
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)
        for reader in self._readers:
            reader.join(timeout=30)
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()

    def rss_anon(self) -> int:
        """The server's anonymous resident memory now, in bytes (its heap; file pages excluded)."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no RssAnon in /proc status")


@contextmanager
def serve_process(
    repo: str | Path, *extra: str, env: dict[str, str] | None = None
) -> Iterator[ServerProcess]:
    server = ServerProcess(repo, *extra, env=env)
    try:
        yield server
    finally:
        server.kill()


class _Loop:
    """An asyncio loop on a thread of its own, running aiohttp apps on 127.0.0.1."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=60)

    def start(self, app: web.Application) -> tuple[web.AppRunner, str]:
        async def start() -> tuple[web.AppRunner, str]:
            runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=5)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            host, port = runner.addresses[0][:2]
            return runner, f"http://{host}:{port}"

        result: tuple[web.AppRunner, str] = self.call(start())
        return result

    def close(self, runner: web.AppRunner) -> None:
        self.call(runner.cleanup())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)
        self.loop.close()




class FaultProxy:
    """Forwards every request to ``upstream`` and spoils the answers to ``GET /ipfs/`` requests
    as ``mode`` says (see :meth:`spoil`):

    * ``corrupt``: one byte of the body flipped (the length kept);
    * ``truncate``: the full Content-Length announced, half the body sent, the connection closed;
    * ``type``: the body as ``text/html``;
    * ``hang``: the request read and never answered;
    * ``reset``: the connection reset (RST) without an answer;
    * ``None``: passed through.

    ``hits`` counts the requests per path (query included).
    """

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.mode: str | None = None
        self.times: int | None = None
        self.spoiled = self.after = 0
        self.prefix = "/ipfs/"
        self.reached = threading.Event()
        self.hits: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._never = asyncio.Event()
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._forward)
        app.on_startup.append(self._open)
        app.on_cleanup.append(self._close)
        self._loop = _Loop()
        self._runner, self.url = self._loop.start(app)

    def spoil(self, mode: str | None, times: int | None = None, *, after: int = 0,
              prefix: str = "/ipfs/") -> None:
        """Spoil block requests (paths starting with ``prefix``) as ``mode`` says, ``times`` of
        them (None: all), once ``after`` of them have passed untouched."""
        with self._lock:
            self.mode, self.times, self.spoiled, self.after = mode, times, 0, after
            self.prefix = prefix
            self.reached = threading.Event()  # set when the first spoiled request arrives

    async def _open(self, app: web.Application) -> None:
        self._session = ClientSession(auto_decompress=False)
        self._never = asyncio.Event()

    async def _close(self, app: web.Application) -> None:
        self._never.set()
        await self._session.close()

    def _take(self, method: str, path: str) -> str | None:
        with self._lock:
            self.hits[path] += 1
            if self.mode is None or method != "GET" or not path.startswith(self.prefix):
                return None
            if self.after > 0:
                self.after -= 1
                return None
            if self.times is not None and self.spoiled >= self.times:
                return None
            self.spoiled += 1
            self.reached.set()
            return self.mode

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        mode = self._take(request.method, request.path_qs)
        if mode == "hang":
            await self._never.wait()
        if mode == "reset":
            sock = request.transport.get_extra_info("socket") if request.transport else None
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            request.transport.abort()  # type: ignore[union-attr]
            raise ConnectionResetError("reset by the test proxy")
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
        async with self._session.request(request.method, self.upstream + request.path_qs,
                                         headers=headers) as upstream:
            body = await upstream.read()
            out_headers = {k: v for k, v in upstream.headers.items()
                           if k.lower() not in ("content-length", "transfer-encoding", "connection")}
            if request.method == "HEAD":  # the length announced, no body
                response = web.StreamResponse(status=upstream.status, headers=out_headers)
                if "Content-Length" in upstream.headers:
                    response.content_length = int(upstream.headers["Content-Length"])
                await response.prepare(request)
                return response
            if mode == "corrupt" and body:
                body = body[:-1] + bytes([body[-1] ^ 0x40])
            if mode == "type":
                out_headers["Content-Type"] = "text/html"
            if mode == "truncate" and body:
                response = web.StreamResponse(status=upstream.status, headers=out_headers)
                response.content_length = len(body)
                await response.prepare(request)
                await response.write(body[: len(body) // 2])
                request.transport.close()  # type: ignore[union-attr]
                return response
            return web.Response(status=upstream.status, body=body, headers=out_headers)

    def close(self) -> None:
        self._loop.loop.call_soon_threadsafe(self._never.set)  # hung requests end first
        self._loop.close(self._runner)


@contextmanager
def fault_proxy(upstream: str) -> Iterator[FaultProxy]:
    proxy = FaultProxy(upstream)
    try:
        yield proxy
    finally:
        proxy.close()
