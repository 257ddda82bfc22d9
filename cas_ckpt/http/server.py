"""The HTTP server: a repository, read-only, as an IPFS trustless gateway plus a JSON API for refs.

Routes (the protocol is specified in ``docs/format.md``, "HTTP"):

* ``GET``/``HEAD /ipfs/{cid}`` with ``?format=raw`` or ``Accept: application/vnd.ipld.raw``: the
  block's bytes, verified against the CID before they are sent (a damaged block is a 502 and a
  log line, never sent), with Range, ETag and the immutable caching headers;
* the same with ``?format=car`` or ``Accept: application/vnd.ipld.car``: a CAR v1 stream, depth
  first without duplicates (``order=dfs; dups=n``), of ``dag-scope`` ``all`` (the bytes
  ``cas-ckpt export`` writes), ``entity`` or ``block``; memory stays a few blocks whatever its size;
* ``/refs``, ``/refs/{name}``, ``/resolve/{target}``, ``/log/{target}``, ``/reflog/{name}``,
  ``/pins``, ``/config``: JSON;
* ``/ipns/...``: 501;
* ``/`` and ``/ui/...``: the browser view (:mod:`cas_ckpt.web`): pages, assets and its JSON API.

aiohttp serves it: one asyncio loop holds any number of slow clients without a thread each, and
``StreamResponse.write`` waits for the socket to drain, so a stream never runs ahead of its
reader. Repository reads block (disk, hashing), so they run on a bounded pool of threads.
:func:`make_app` is the one place the application is built; other modules add routes to it.

Hostile peers are bounded (``docs/cli.md``, "serve"): a body is written in slices of
:data:`SEND_SLICE` bytes, each waiting for the socket, so a stream holds at most one block beyond
what the kernel accepted; at most ``max_streams`` block and CAR bodies are in flight (a request
over the cap waits :data:`STREAM_WAIT` seconds, then gets 503 with ``Retry-After``); a reader
that takes nothing for :data:`SEND_STALL` seconds is cut off. Every error answer is JSON
(``{"error": ...}``); a client's disconnect or bad request is one rate-limited log line, never a
traceback.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import hmac
import logging
import math
import os
import signal
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from aiohttp import web

from cas_ckpt import _memory, car
from cas_ckpt import cid as cidlib
from cas_ckpt.codec import Link
from cas_ckpt.commit import Commit
from cas_ckpt.errors import (
    AmbiguousCID,
    BlockNotFound,
    CasCkptError,
    CheckpointExpired,
    CorruptBlock,
    DecodeError,
    InvalidCID,
    InvalidRefName,
    RefNotFound,
)
from cas_ckpt.http import MAX_STREAMS, STREAM_WAIT
from cas_ckpt.http.push import MAX_UPLOAD, add_push_routes, is_write_route
from cas_ckpt.http.sessions import (
    LANDINGS,
    SESSIONS,
    Sessions,
    bearer_token,
    is_browser_route,
    raw_bytes,
    session_cookie,
)
from cas_ckpt.maintenance.walk import data_blocks
from cas_ckpt.repository import Repository
from cas_ckpt.repository import open as open_repository
from cas_ckpt.web import add_browser_routes

_log = logging.getLogger("cas_ckpt.http")

RAW = "application/vnd.ipld.raw"
CAR = "application/vnd.ipld.car"
CAR_TYPE = f"{CAR}; version=1; order=dfs; dups=n"
IMMUTABLE = "public, max-age=29030400, immutable"
READ_THREADS = 16  # repository reads (disk and hashing) in flight at once
STREAM_PIECE = 1024 * 1024  # CAR bytes gathered on a read thread at once: about one block
SEND_SLICE = 64 * 1024  # bytes handed to the socket at a time, each write waiting for it to drain
SEND_STALL = 60.0  # seconds a reader may take nothing before its stream is cut off
IDLE_CLOSE = 75.0  # seconds a connection may go without a whole request (a drip of headers too)
RETRY_AFTER = 2  # the 503's Retry-After, in seconds
# Formats the path gateway names that this trustless server cannot give (406); others are 400.
_OTHER_FORMATS = {"tar", "dag-json", "dag-cbor", "json", "cbor", "ipns-record"}
_FORMATS = {"raw": RAW, "car": CAR}
IDENTITY_EMPTY = "bafkqaaa"  # the spec's probe: the identity CID of no bytes

CHALLENGE = 'Bearer realm="cas_ckpt"'  # WWW-Authenticate of a 401
REPO = web.AppKey("repo", Repository)
READS = web.AppKey("reads", ThreadPoolExecutor)
STREAMS = web.AppKey("streams", "Streams")
T = TypeVar("T")


def make_app(
    repo: Repository, *, token: str | None = None, max_streams: int = MAX_STREAMS,
    write_token: str | None = None, max_upload: int = MAX_UPLOAD,
) -> web.Application:
    """The server's application for ``repo``: the gateway, the JSON API, the browser view and,
    with ``write_token``, pushes (:mod:`cas_ckpt.http.push`: only requests presenting the write
    token reach them; without it they answer 403, the server read-only).
    With ``token`` every other route (added here or later by other modules) answers 401 unless
    the request presents it or the write token (see :func:`_require_token`). ``max_streams``:
    block and CAR bodies in flight at once. ``max_upload``: bytes of one push's blocks."""
    if max_streams < 1:
        raise ValueError(f"max_streams must be at least 1, not {max_streams}")
    if write_token is not None and write_token == token:
        raise ValueError("the write token must differ from the read token")
    middlewares = [_json_errors, _require_token(token, write_token)]
    app = web.Application(middlewares=middlewares)
    app[REPO] = repo
    app[READS] = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="cas_ckpt-serve")
    app[LANDINGS] = set()
    app[SESSIONS] = Sessions(token)
    app[STREAMS] = Streams(max_streams)
    app.on_cleanup.append(_stop_reads)
    app.router.add_get(r"/ipfs/{cid}", ipfs)
    app.router.add_get(r"/ipfs/{cid}/{path:.*}", ipfs)
    app.router.add_get(r"/ipns/{name:.*}", ipns)
    app.router.add_get("/refs", list_refs)
    app.router.add_get(r"/refs/{name:.+}", get_ref)
    app.router.add_get(r"/resolve/{target:.+}", resolve)
    app.router.add_get(r"/log/{target:.+}", log)
    app.router.add_get(r"/reflog/{name:.+}", reflog)
    app.router.add_get("/pins", pins)
    app.router.add_get("/config", config)
    add_push_routes(app, repo, max_upload=max_upload)
    add_browser_routes(app, repo)
    return app


async def _stop_reads(app: web.Application) -> None:
    app[READS].shutdown(wait=False, cancel_futures=True)


# --------------------------------------------------------------------------------------------
# Who may ask: the API token, or on the browser's routes a session (cas_ckpt.http.sessions)
# --------------------------------------------------------------------------------------------
def _require_token(token: str | None, write_token: str | None) -> Any:
    """The one check, for every route. A write route (a push) needs the write token: 401 without
    a token, 403 with another (the read token may not write), 403 on a server without one. Any
    other route is open without ``token``; with it, it needs ``token`` or the write token in
    ``Authorization`` (constant-time compares), or on the browser's routes a live session; on a
    landing page the token in the query (a browser's first visit, exchanged there for a
    session)."""
    expected = token.encode() if token else None
    writes = write_token.encode() if write_token else None

    def matches(given: str | None, key: bytes | None) -> bool:
        return given is not None and key is not None and hmac.compare_digest(raw_bytes(given), key)

    @web.middleware
    async def check(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                    ) -> web.StreamResponse:
        given = bearer_token(request)
        if is_write_route(request):
            if writes is None:
                raise _error(web.HTTPForbidden, "this server is read-only: pushes need cas-ckpt serve "
                             "--write-token")
            if matches(given, writes):
                return await handler(request)
            if given is None:
                raise _error(web.HTTPUnauthorized, "a push needs the write token: Authorization: Bearer "
                             "<write token>", **{"WWW-Authenticate": CHALLENGE})
            raise _error(web.HTTPForbidden, "this token may not push: a push needs the write token")
        if expected is None or matches(given, expected) or matches(given, writes):
            return await handler(request)
        if is_browser_route(request):
            if request.path == "/" and "token" not in request.query:
                return await handler(request)  # only a redirect to /ui/: nothing to guard
            if request.app[SESSIONS].valid(request.cookies.get(session_cookie(request))):
                return await handler(request)
            landing = request.match_info.handler in request.app[LANDINGS]
            if landing and matches(request.query.get("token"), expected):
                return await handler(request)
        raise _error(web.HTTPUnauthorized, "this server needs a token: Authorization: Bearer <token> "
                     "(a browser: open /?token=<token> once)", **{"WWW-Authenticate": CHALLENGE})

    return check


async def _run(request: web.Request, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on the read threads."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(request.app[READS], functools.partial(fn, *args))


def _error(status: type[web.HTTPException], text: str, **headers: str) -> web.HTTPException:
    """An error answer: JSON ``{"error": text}``, as every error of this server."""
    return status(text=_dumps({"error": text.strip()}), content_type="application/json",
                  headers=headers or None)


@web.middleware
async def _json_errors(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                       ) -> web.StreamResponse:
    """Every error as JSON, aiohttp's own (404 no route, 405) too; a handler's bug is a logged
    traceback (the server's fault) and a 500 that says only that."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400 or exc.content_type == "application/json":
            raise
        text = exc.text if exc.text and not exc.text.startswith(f"{exc.status}:") else exc.reason
        exc.text = _dumps({"error": (text or exc.reason).strip()})
        exc.content_type = "application/json"
        raise
    except asyncio.CancelledError:
        raise
    except Exception:
        _log.exception("%s %s failed", request.method, request.path)
        raise _error(web.HTTPInternalServerError, "internal error: see the server's log") from None


class _ClientLog:
    """One log line per client error (a reset, a stalled reader, a bad request), at most
    ``burst`` lines each ``period`` seconds; the lines held back are counted on the next one."""

    def __init__(self, burst: int = 10, period: float = 10.0) -> None:
        self.burst, self.period = burst, period
        self._window, self._lines, self._held = 0.0, 0, 0

    def __call__(self, message: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self._window >= self.period:
            if self._held:
                _log.warning("%d more client errors not logged in the last %.0f s", self._held, self.period)
            self._window, self._lines, self._held = now, 0, 0
        if self._lines >= self.burst:
            self._held += 1
            return
        self._lines += 1
        _log.warning(message, *args)


client_error = _ClientLog()


class _ClientFaults(logging.Filter):
    """aiohttp's own log of a request its parser refused (a line over 8 KiB, bytes that are no
    HTTP) or of a client gone mid-answer: one rate-limited line, no traceback. Anything else
    (the server's own faults) passes with its traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        from aiohttp.http_exceptions import HttpProcessingError

        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, (HttpProcessingError, ConnectionError)):
            return True
        client_error("%s (%s: %s)", record.getMessage(), type(exc).__name__, str(exc)[:200])
        return False


def _quiet_client_faults() -> None:
    logger = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, _ClientFaults) for f in logger.filters):
        logger.addFilter(_ClientFaults())


class Streams:
    """At most ``limit`` block and CAR bodies in flight: each holds up to a block, so the cap
    bounds the server's memory whatever its clients do."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._free = asyncio.Semaphore(limit)

    @contextlib.asynccontextmanager
    async def slot(self, request: web.Request) -> AsyncIterator[None]:
        """A slot for ``request``'s body; after :data:`STREAM_WAIT` seconds of waiting, 503."""
        try:
            await asyncio.wait_for(self._free.acquire(), STREAM_WAIT)
        except asyncio.TimeoutError:
            client_error("503 for %s %s: %d streams in flight already (--max-streams)",
                         request.method, request.path, self.limit)
            raise _error(web.HTTPServiceUnavailable, f"this server has {self.limit} streams in flight "
                         "already: try again shortly", **{"Retry-After": str(RETRY_AFTER)}) from None
        try:
            yield
        finally:
            self._free.release()


class ClientGone(Exception):
    """The client reset the connection or took nothing for :data:`SEND_STALL` seconds."""


async def _send(response: web.StreamResponse, data: bytes | memoryview) -> None:
    """``data`` to the client, a slice at a time, each waiting until the socket has taken the
    one before: a slow reader holds ``data`` and one slice, never a copy of everything."""
    view = memoryview(data)
    for start in range(0, len(view), SEND_SLICE):
        try:
            await asyncio.wait_for(response.write(view[start:start + SEND_SLICE]), SEND_STALL)
        except (asyncio.TimeoutError, ConnectionError) as exc:
            failure = f"took nothing for {SEND_STALL:.0f} s" if isinstance(exc, asyncio.TimeoutError) \
                else f"disconnected ({type(exc).__name__})"
            _forget_frames(exc)
        else:
            continue
        raise ClientGone(failure)


def _forget_frames(exc: BaseException) -> None:
    """Drop the tracebacks of ``exc`` and what it chains: aiohttp keeps a lost connection's
    error in a future caught in a reference cycle, and through its traceback the frames that
    held the block being written; only the cyclic GC would free them, which an idle server may
    not run for hours."""
    seen: BaseException | None = exc
    for _ in range(16):  # a chain is short; the bound only guards against a cycle
        if seen is None:
            break
        seen.__traceback__ = None
        seen = seen.__context__


def _client_gone(request: web.Request, exc: Exception, what: str) -> None:
    """One line for a client that left (or stalled), and its connection ended."""
    why = exc if isinstance(exc, ClientGone) else f"disconnected ({type(exc).__name__})"
    _forget_frames(exc)
    client_error("%s to %s cut off: the client %s", what, _peer(request), why)
    _abort(request)


def _peer(request: web.Request) -> str:
    return str(request.remote or "a client")


# --------------------------------------------------------------------------------------------
# /ipfs: blocks and CAR streams
# --------------------------------------------------------------------------------------------
async def ipfs(request: web.Request) -> web.StreamResponse:
    fmt, params = _negotiate(request)
    text = request.match_info["cid"]
    path = request.match_info.get("path", "")
    if fmt == "raw" and path:
        raise _error(web.HTTPBadRequest, "a block request (format=raw) takes /ipfs/{cid} only, no path")
    if path:
        raise _error(web.HTTPNotImplemented, "paths inside messagepack nodes are not defined by IPFS: "
                     "request the CID of the sub-tree (cas-ckpt ls and show list them)")
    if text == IDENTITY_EMPTY:
        return await _probe(request, fmt)
    try:
        cid = cidlib.to_bytes(text)
    except InvalidCID as exc:
        raise _error(web.HTTPBadRequest, f"malformed CID {text!r}: {exc}") from None
    if fmt == "raw":
        return await _block(request, cid)
    return await _car(request, cid, params)


def _negotiate(request: web.Request) -> tuple[str, dict[str, str]]:
    """("raw" or "car", the CAR parameters asked for), from ``format`` (first) or ``Accept``."""
    fmt = request.query.get("format")
    if fmt is not None:
        if fmt in _OTHER_FORMATS:
            raise _error(web.HTTPNotAcceptable, f"format={fmt} is not served here: this is a trustless "
                         "gateway (format=raw or format=car)")
        if fmt not in _FORMATS:
            raise _error(web.HTTPBadRequest, f"unknown format {fmt!r} (format=raw or format=car)")
        return fmt, _car_query(request)
    accept = request.headers.get("Accept", "")
    for media, params in _accepted(accept):
        if media == RAW:
            return "raw", {}
        if media == CAR and _car_ok(params):
            return "car", {**params, **_car_query(request)}
    if not accept:
        raise _error(web.HTTPBadRequest, "say which response you want: ?format=raw (a block) or "
                     "?format=car (a CAR stream), or an Accept header")
    raise _error(web.HTTPNotAcceptable, f"cannot give {accept!r}: this trustless gateway gives {RAW} "
                 f"and {CAR_TYPE}")


def _accepted(header: str) -> list[tuple[str, dict[str, str]]]:
    """The media types of an Accept header with their parameters, best first (q=0 dropped)."""
    found = []
    for position, item in enumerate(header.split(",")):
        media, *rest = [part.strip() for part in item.split(";")]
        params = {}
        for part in rest:
            key, _, value = part.partition("=")
            params[key.strip().lower()] = value.strip().strip('"').lower()
        try:
            q = float(params.pop("q", "1"))
        except ValueError:
            q = 0.0
        if q > 0 and media:
            found.append((-q, position, media.lower(), params))
    return [(media, params) for _, _, media, params in sorted(found)]


def _car_query(request: web.Request) -> dict[str, str]:
    given = {"version": request.query.get("car-version"), "order": request.query.get("car-order"),
             "dups": request.query.get("car-dups")}
    params = {k: v.lower() for k, v in given.items() if v is not None}
    if not _car_ok(params):
        raise _error(web.HTTPBadRequest, f"CAR {params} is not served: version=1, order=dfs (or unk), "
                     "dups=n")
    return params


def _car_ok(params: dict[str, str]) -> bool:
    return params.get("version", "1") == "1" and params.get("order", "dfs") in ("dfs", "unk") \
        and params.get("dups", "n") == "n"


def _headers(request: web.Request, cid: str, fmt: str, etag: str) -> dict[str, str]:
    headers = {
        "Content-Type": RAW if fmt == "raw" else CAR_TYPE,
        "X-Content-Type-Options": "nosniff",
        "Cache-Control": IMMUTABLE,
        "ETag": etag,
        "Content-Disposition": f'attachment; filename="{cid}.{"bin" if fmt == "raw" else "car"}"',
        "X-Ipfs-Path": f"/ipfs/{cid}",
        "X-Ipfs-Roots": cid,
        "Vary": "Accept",
    }
    if "format" not in request.query:
        headers["Content-Location"] = f"/ipfs/{cid}?format={fmt}"
    return headers


def _not_modified(request: web.Request, etag: str) -> bool:
    given = request.headers.get("If-None-Match", "")
    return given.strip() == "*" or etag in [tag.strip() for tag in given.split(",")]


async def _probe(request: web.Request, fmt: str) -> web.StreamResponse:
    """The spec's probe path: an empty block, or a CAR whose only root is the empty identity CID."""
    etag = f'"{IDENTITY_EMPTY}.{fmt}"'
    headers = _headers(request, IDENTITY_EMPTY, fmt, etag)
    body = b"" if fmt == "raw" else car.car_header([b"\x01\x55\x00\x00"])
    return web.Response(body=body, headers=headers)


def _read_verified(repo: Repository, cid: bytes) -> bytes:
    return repo.blocks.get(cid, verify=True)


async def _read_block(request: web.Request, cid: bytes) -> bytes:
    """The block, verified: 404 if absent, 502 (and a log line) if damaged."""
    try:
        return await _run(request, _read_verified, request.app[REPO], cid)
    except BlockNotFound:
        raise _error(web.HTTPNotFound, f"block {cidlib.to_str(cid)} is not in this repository") from None
    except CorruptBlock as exc:
        _log.error("refusing to send %s: %s (the repository is damaged: run cas-ckpt fsck)",
                   cidlib.to_str(cid), exc)
        raise _error(web.HTTPBadGateway, f"block {cidlib.to_str(cid)} is damaged on this server: "
                     "it failed verification and was not sent") from None


async def _block(request: web.Request, cid: bytes) -> web.StreamResponse:
    name = cidlib.to_str(cid)
    etag = f'"{name}.raw"'
    headers = {**_headers(request, name, "raw", etag), "Accept-Ranges": "bytes"}
    if _not_modified(request, etag):
        return web.Response(status=304, headers=headers)
    if request.method == "HEAD":
        try:
            size = await _run(request, request.app[REPO].blocks.size, cid)
        except BlockNotFound:
            raise _error(web.HTTPNotFound, f"block {name} is not in this repository") from None
        response = web.StreamResponse(headers=headers)
        response.content_length = size
        await response.prepare(request)
        return response
    async with request.app[STREAMS].slot(request):
        data = await _read_block(request, cid)
        status, body = 200, memoryview(data)
        try:
            wanted = request.http_range
        except ValueError:
            wanted = slice(None, None)  # a Range this server does not parse: the whole block (RFC 9110)
        if request.headers.get("Range") and wanted != slice(None, None):
            start, stop, _ = wanted.indices(len(data))
            if (wanted.start is not None and wanted.start >= len(data)) or start >= stop:
                raise _error(web.HTTPRequestRangeNotSatisfiable, "the range is outside the block",
                             **{"Content-Range": f"bytes */{len(data)}"})
            headers["Content-Range"] = f"bytes {start}-{stop - 1}/{len(data)}"
            headers["ETag"] = f'"{name}.raw.{start}-{stop - 1}"'
            status, body = 206, body[start:stop]
        response = web.StreamResponse(status=status, headers=headers)
        response.content_length = len(body)
        try:
            await response.prepare(request)
            await _send(response, body)
            await response.write_eof()
        except (ConnectionError, ClientGone) as exc:  # ConnectionError: from prepare or write_eof
            _client_gone(request, exc, f"block {name}")
        return response


async def _car(request: web.Request, root: bytes, params: dict[str, str]) -> web.StreamResponse:
    scope = request.query.get("dag-scope", "all")
    if scope not in ("block", "entity", "all"):
        raise _error(web.HTTPBadRequest, f"dag-scope must be block, entity or all, not {scope!r}")
    if "entity-bytes" in request.query:
        _check_entity_bytes(request.query["entity-bytes"])
        scope = "entity"  # implied; our blocks are not UnixFS files, so the range selects no fewer
    if scope == "entity":
        scope = "block"  # for non-UnixFS data the spec makes entity the block itself
    name = cidlib.to_str(root)
    etag = f'"{name}.car.dfs.n.{scope}"'
    headers = {**_headers(request, name, "car", etag), "Accept-Ranges": "none"}
    if _not_modified(request, etag):
        return web.Response(status=304, headers=headers)
    async with request.app[STREAMS].slot(request):
        first = await _read_block(request, root)  # 404 / 502 before the 200 is committed
        response = web.StreamResponse(headers=headers)
        if request.method == "HEAD":
            await response.prepare(request)
            return response
        pieces = _car_pieces(request.app[REPO], root, first, everything=scope == "all")
        try:
            await response.prepare(request)
            while batch := await _run(request, _gather, pieces):
                for piece in batch:
                    await _send(response, piece)
                del batch
            await response.write_eof()
        except (ConnectionError, ClientGone) as exc:  # ConnectionError: from prepare or write_eof
            _client_gone(request, exc, f"CAR of {name}")
        except CasCkptError as exc:  # a block GC removed meanwhile, or one found damaged
            _log.error("CAR stream of %s ended early: %s", name, exc)
            _abort(request)
        return response


def _abort(request: web.Request) -> None:
    """End the response without its last chunk: the client sees a cut-short transfer (an error),
    never a complete-looking CAR that misses blocks."""
    if request.transport is not None:
        request.transport.abort()


def _check_entity_bytes(value: str) -> None:
    start, sep, end = value.partition(":")
    try:
        int(start)
        if end != "*":
            int(end)
    except ValueError:
        raise _error(web.HTTPBadRequest, f"entity-bytes must be from:to (integers, to may be *): "
                     f"{value!r}") from None
    if not sep:
        raise _error(web.HTTPBadRequest, f"entity-bytes must be from:to, not {value!r}")


def _car_pieces(repo: Repository, root: bytes, first: bytes, *, everything: bool) -> Iterator[bytes]:
    """The CAR's bytes in pieces: the header, then each block's section (export's order)."""
    yield car.car_header([root])
    yield car.section_prefix(root, first) + first
    if not everything:
        return
    blocks = data_blocks(repo.blocks, root)
    next(blocks)  # the root, sent above
    for cid in blocks:
        data = repo.blocks.get(cid, verify=True)  # never send a damaged block
        yield car.section_prefix(cid, data)
        yield data


def _gather(pieces: Iterator[bytes]) -> list[bytes]:
    """The next pieces, up to about STREAM_PIECE bytes ([] at the end): one block, or many small."""
    out, size = [], 0
    for piece in pieces:
        out.append(piece)
        size += len(piece)
        if size >= STREAM_PIECE:
            break
    return out


async def ipns(request: web.Request) -> web.StreamResponse:
    raise _error(web.HTTPNotImplemented, "IPNS is not served: cas_ckpt's names are its refs "
                 "(/refs, /resolve/{ref})")


# --------------------------------------------------------------------------------------------
# The JSON API: refs, history, pins, config
# --------------------------------------------------------------------------------------------
def _json(value: Any, status: int = 200) -> web.Response:
    return web.json_response(value, status=status, headers={"Cache-Control": "no-cache"},
                             dumps=functools.partial(_dumps))


def _dumps(value: Any) -> str:
    import json

    return json.dumps(value, allow_nan=False, ensure_ascii=False)


async def _answer(request: web.Request, fn: Callable[..., Any], *args: Any) -> web.Response:
    """``fn(*args)`` on the read threads as JSON; a lookup that fails is 404, bad input 400."""
    try:
        return _json(await _run(request, fn, *args))
    except (RefNotFound, BlockNotFound, CheckpointExpired) as exc:
        return _json({"error": str(exc)}, 404)
    except (InvalidRefName, InvalidCID, AmbiguousCID, DecodeError) as exc:
        return _json({"error": str(exc)}, 400)
    except CorruptBlock as exc:
        _log.error("%s", exc)
        return _json({"error": str(exc)}, 502)


async def list_refs(request: web.Request) -> web.Response:
    prefix = request.query.get("prefix", "")
    return await _answer(request, lambda: {n: str(c) for n, c in request.app[REPO].refs(prefix).items()})


async def get_ref(request: web.Request) -> web.Response:
    name = request.match_info["name"]

    def read() -> dict[str, str]:
        repo = request.app[REPO]
        cid = repo.refs_store.get(name)
        if cid is None:
            raise RefNotFound(name)
        return {"name": name, "cid": cidlib.to_str(cid)}

    return await _answer(request, read)


async def resolve(request: web.Request) -> web.Response:
    target = request.match_info["target"]
    return await _answer(request, lambda: {"target": target,
                                           "cid": str(request.app[REPO].resolve(target))})


async def log(request: web.Request) -> web.Response:
    target = request.match_info["target"]
    limit_text = request.query.get("limit")
    if limit_text is not None and not (limit_text.isdigit() and int(limit_text) > 0):
        return _json({"error": f"limit must be a positive integer, not {limit_text!r}"}, 400)
    limit = int(limit_text) if limit_text else None
    return await _answer(request, lambda: [commit_json(c) for c in request.app[REPO].log(target,
                                                                                        limit=limit)])


async def reflog(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    return await _answer(request, lambda: [
        {"old": cidlib.to_str(e.old) if e.old else None, "new": cidlib.to_str(e.new) if e.new else None,
         "time": e.time, "message": e.message} for e in request.app[REPO].reflog(name)])


async def pins(request: web.Request) -> web.Response:
    return await _answer(request, lambda: [str(c) for c in request.app[REPO].pins()])


async def config(request: web.Request) -> web.Response:
    return await _answer(request, request.app[REPO].refs_store.read_config)


def commit_json(commit: Commit) -> dict[str, Any]:
    """A commit as JSON: CIDs as text, metadata as DAG-JSON (bytes as ``{"/": {"bytes": b64}}``)."""
    return {"cid": str(commit.cid), "tree": str(commit.tree), "parents": [str(p) for p in commit.parents],
            "step": commit.step, "time": commit.time, "metadata": dag_json(commit.metadata),
            "message": commit.message}


def dag_json(value: Any) -> Any:
    """Plain msgpack values as JSON, the DAG-JSON way for bytes and links."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return {"/": {"bytes": base64.b64encode(bytes(value)).decode().rstrip("=")}}
    if isinstance(value, Link):
        return {"/": cidlib.to_str(value.cid)}
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, dict):
        return {str(k): dag_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [dag_json(v) for v in value]
    return value


# --------------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------------
def run(
    repo: Repository | str | os.PathLike[str], host: str, port: int, *, token: str | None = None,
    max_streams: int = MAX_STREAMS, ready: Callable[[str], None] | None = None,
    write_token: str | None = None, max_upload: int = MAX_UPLOAD,
) -> None:
    """Serve until SIGINT or SIGTERM (see :func:`cas_ckpt.serve`). A location is opened
    read-only, unless ``write_token`` lets pushes in."""
    _memory.return_freed_buffers()
    options = {"token": token, "max_streams": max_streams, "write_token": write_token,
               "max_upload": max_upload}
    if isinstance(repo, Repository):
        asyncio.run(_serve(repo, host, port, options, ready))
        return
    with open_repository(repo, create=False, read_only=write_token is None) as opened:
        asyncio.run(_serve(opened, host, port, options, ready))


async def _start(
    repo: Repository, host: str, port: int, options: dict[str, Any]
) -> tuple[web.AppRunner, str]:
    """The server listening (``options``: :func:`make_app`'s); its runner and URL."""
    _quiet_client_faults()
    runner = web.AppRunner(make_app(repo, **options), access_log=None,
                           handle_signals=False, shutdown_timeout=5, keepalive_timeout=IDLE_CLOSE)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port, backlog=1024).start()
    except BaseException:
        await runner.cleanup()
        raise
    bound = runner.addresses[0]
    shown = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
    return runner, f"http://{shown}:{bound[1]}"


async def _serve(
    repo: Repository, host: str, port: int, options: dict[str, Any], ready: Callable[[str], None] | None,
) -> None:
    runner, url = await _start(repo, host, port, options)
    try:
        if ready is not None:
            ready(url)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, stop.set)
        await stop.wait()
    finally:
        await runner.cleanup()


@contextlib.contextmanager
def serving(
    repo: Repository, *, host: str = "127.0.0.1", port: int = 0, token: str | None = None,
    max_streams: int = MAX_STREAMS, write_token: str | None = None, max_upload: int = MAX_UPLOAD,
) -> Iterator[str]:
    """Serve ``repo`` on a thread of this process (a training job sharing what it saves, a peer
    taking pushes with ``write_token``) while the ``with`` block runs; yields the URL
    (``port=0``: a free port)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="cas_ckpt-serve", daemon=True)
    thread.start()
    try:
        options = {"token": token, "max_streams": max_streams, "write_token": write_token,
                   "max_upload": max_upload}
        runner, url = asyncio.run_coroutine_threadsafe(_start(repo, host, port, options), loop).result()
        try:
            yield url
        finally:
            asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result()
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()
