"""Pushes into ``cas-ckpt serve``: the write routes, open only to the write token.

A client pushes in three kinds of request (``docs/format.md``, "Pushing over HTTP"):

1. ``POST /api/v0/blocks/missing`` ``{"cids": [...]}`` answers ``{"missing": [...], "max_upload":
   bytes}``: which of up to :data:`MAX_QUERY` blocks the server lacks, and how much one upload may
   send (any token that may read may ask);
2. ``POST /api/v0/blocks``, a CAR v1 stream of those blocks (its roots informative only): each
   block is hashed against its CID as it arrives, and all of them are durable before the 200;
   a stream over ``max_upload`` bytes gets 413, a malformed, corrupt or cut one 400, and then
   nothing of it is published (what a full pack of it left is unreferenced: GC's);
3. ``POST /api/v0/refs/{name}`` ``{"old": cid | null, "new": cid | null, "message": str}`` moves
   one ref by compare-and-swap once every block ``new`` needs is stored, GC held off meanwhile:
   200 (also when the ref already holds ``new``: a retried request), 409 when it holds something
   other than ``old`` (``current`` says what), 412 when blocks are missing (a GC between the
   upload and the move; the client uploads again). ``new`` null deletes the ref if it holds
   ``old`` (a pusher's retention). The reflog entry names the push's peer.

``POST /api/v0/gc`` ``{"expire_reflogs": [ref or prefix, ...]}`` runs the repository's GC (a
pusher's retention: what its deleted step refs held) and answers its report.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from aiohttp import web

from cas_ckpt import car
from cas_ckpt import cid as cidlib
from cas_ckpt.errors import (
    BlockNotFound,
    CarError,
    CheckpointExpired,
    InvalidCID,
    InvalidRefName,
    RefConflict,
)
from cas_ckpt.http import MAX_UPLOAD
from cas_ckpt.refs import check_ref_name
from cas_ckpt.repository import Repository

_log = logging.getLogger("cas_ckpt.serve")

MAX_QUERY = 16384  # CIDs one "missing" request may ask about
MAX_JSON = 4 * 1024 * 1024  # bytes of a JSON request body
UPLOAD_THREADS = 4  # pushes ingested at once (each on a thread: hashing and disk)
READ_AHEAD = 1 << 20  # bytes of an upload taken from the socket at a time

WRITE_ROUTES = web.AppKey("write_routes", set)  # handlers only the write token opens
LIMIT = web.AppKey("max_upload", int)
WRITERS = web.AppKey("writers", ThreadPoolExecutor)
PUSH_REPO = web.AppKey("push_repo", Repository)


def add_push_routes(app: web.Application, repo: Repository, *, max_upload: int = MAX_UPLOAD) -> None:
    """The write routes on ``app`` (the server's token check decides who reaches them)."""
    if max_upload < 1:
        raise ValueError(f"max_upload must be at least 1 byte, not {max_upload}")
    app[PUSH_REPO] = repo
    app[LIMIT] = max_upload
    app[WRITERS] = ThreadPoolExecutor(UPLOAD_THREADS, thread_name_prefix="cas_ckpt-push")
    app[WRITE_ROUTES] = {upload, move_ref, collect}
    app.on_cleanup.append(_stop_writers)
    app.router.add_post("/api/v0/blocks/missing", missing)
    app.router.add_post("/api/v0/blocks", upload)
    app.router.add_post(r"/api/v0/refs/{name:.+}", move_ref)
    app.router.add_post("/api/v0/gc", collect)


async def _stop_writers(app: web.Application) -> None:
    app[WRITERS].shutdown(wait=False, cancel_futures=True)


def is_write_route(request: web.Request) -> bool:
    """True where only the write token may go."""
    routes = request.app.get(WRITE_ROUTES)
    return routes is not None and request.match_info.handler in routes


async def _on_writer(request: web.Request, fn: Callable[..., Any], *args: Any) -> Any:
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(request.app[WRITERS], functools.partial(fn, *args))


def _answer(value: Any, status: int = 200) -> web.Response:
    return web.json_response(value, status=status, dumps=lambda v: json.dumps(v, ensure_ascii=False))


async def _json_body(request: web.Request) -> Any:
    if request.content_length is not None and request.content_length > MAX_JSON:
        raise web.HTTPRequestEntityTooLarge(max_size=MAX_JSON, actual_size=request.content_length,
                                            text=json.dumps({"error": f"over {MAX_JSON} bytes of JSON"}),
                                            content_type="application/json")
    parts, size = [], 0
    while chunk := await request.content.read(READ_AHEAD):  # each read gives what has arrived
        size += len(chunk)
        if size > MAX_JSON:
            raise _bad(f"over {MAX_JSON} bytes of JSON", web.HTTPRequestEntityTooLarge)
        parts.append(chunk)
    data = b"".join(parts)
    try:
        return json.loads(data)
    except ValueError as exc:
        raise _bad(f"the body is not JSON: {exc}") from None


def _bad(text: str, status: type[web.HTTPException] = web.HTTPBadRequest) -> web.HTTPException:
    if status is web.HTTPRequestEntityTooLarge:
        return web.HTTPRequestEntityTooLarge(max_size=0, actual_size=0, text=json.dumps({"error": text}),
                                             content_type="application/json")
    return status(text=json.dumps({"error": text}), content_type="application/json")


def _cid(text: Any, what: str) -> bytes:
    try:
        return cidlib.to_bytes(text) if isinstance(text, str) else _raise(f"{what} is not a CID string")
    except InvalidCID as exc:
        raise _bad(f"{what}: {exc}") from None


def _raise(text: str) -> bytes:
    raise _bad(text)


# --------------------------------------------------------------------------------------------
# Which blocks are missing
# --------------------------------------------------------------------------------------------
async def missing(request: web.Request) -> web.Response:
    payload = await _json_body(request)
    cids = payload.get("cids") if isinstance(payload, dict) else None
    if not isinstance(cids, list):
        raise _bad('expected {"cids": [CID, ...]}')
    if len(cids) > MAX_QUERY:
        raise _bad(f"{len(cids)} CIDs: ask about at most {MAX_QUERY} at once", web.HTTPRequestEntityTooLarge)
    keys = [_cid(text, "cids") for text in cids]
    repo = request.app[PUSH_REPO]

    def lacking() -> list[str]:
        repo.blocks.refresh()
        return [text for text, key in zip(cids, keys, strict=True) if not repo.blocks.has(key)]

    return _answer({"missing": await _on_writer(request, lacking), "max_upload": request.app[LIMIT]})


# --------------------------------------------------------------------------------------------
# Blocks in
# --------------------------------------------------------------------------------------------
class _TooLarge(Exception):
    pass


class _Upload:
    """A request's body as a blocking file (``read``), for the CAR reader on a writer thread:
    each refill one receive from the event loop, the total bounded by ``limit``."""

    def __init__(self, request: web.Request, loop: asyncio.AbstractEventLoop, limit: int) -> None:
        self.content, self.loop, self.limit = request.content, loop, limit
        self.buffer, self.at, self.total = b"", 0, 0

    def read(self, n: int) -> bytes:
        if self.at >= len(self.buffer):
            future = asyncio.run_coroutine_threadsafe(self.content.read(READ_AHEAD), self.loop)
            self.buffer, self.at = future.result(), 0
            self.total += len(self.buffer)
            if self.total > self.limit:
                raise _TooLarge
        data = self.buffer[self.at : self.at + n]
        self.at += len(data)
        return data


async def upload(request: web.Request) -> web.Response:
    limit = request.app[LIMIT]
    if request.content_length is not None and request.content_length > limit:
        raise _too_large(limit)
    body = _Upload(request, asyncio.get_running_loop(), limit)
    repo = request.app[PUSH_REPO]
    try:
        stored = await _on_writer(request, _ingest, repo, body)
    except _TooLarge:
        raise _too_large(limit) from None
    except CarError as exc:
        raise _bad(f"not a stream of blocks: {exc}") from None
    return _answer(stored)


def _too_large(limit: int) -> web.HTTPException:
    return _bad(f"a push may send at most {limit} bytes (cas-ckpt serve --max-upload)",
                web.HTTPRequestEntityTooLarge)


def _ingest(repo: Repository, body: _Upload) -> dict[str, int]:
    """Every block of the CAR stream, hashed (as read) and durable before this returns; a stream
    that fails anywhere publishes nothing."""
    with repo.transaction(upkeep=False) as txn:
        _roots, blocks = car.sections(body)
        count = new = size = 0
        for cid, data, _offset in blocks:
            new += txn.blocks.put(cid, data)
            count += 1
            size += len(data)
    return {"blocks": count, "new_blocks": new, "bytes": size}


# --------------------------------------------------------------------------------------------
# Refs
# --------------------------------------------------------------------------------------------
async def move_ref(request: web.Request) -> web.Response:
    try:
        name = check_ref_name(request.match_info["name"])
    except InvalidRefName as exc:
        raise _bad(str(exc)) from None
    payload = await _json_body(request)
    if not isinstance(payload, dict):
        raise _bad('expected {"old": CID or null, "new": CID, "message": text}')
    old = None if payload.get("old") is None else _cid(payload.get("old"), "old")
    new = None if payload.get("new") is None else _cid(payload.get("new"), "new")
    if new is None and old is None:
        raise _bad("a delete names the value the ref must hold: old")
    message = payload.get("message") or "push"
    if not isinstance(message, str) or len(message) > 1000:
        raise _bad("message must be a string of at most 1000 characters")
    peer = request.remote or "?"
    repo = request.app[PUSH_REPO]
    try:
        moved = await _on_writer(request, _move, repo, name, old, new, f"{message} (pushed by {peer})")
    except RefConflict as exc:
        return _answer({"error": str(exc), "current": exc.actual}, 409)
    except (CheckpointExpired, BlockNotFound) as exc:
        gone = exc.missing if isinstance(exc, CheckpointExpired) else exc.cid
        text = (f"{cidlib.to_str(new)} is not complete here: block {gone} is missing (upload it, then "
                "move the ref again)")
        return _answer({"error": text, "missing": [gone]}, 412)
    return _answer({"name": name, "cid": cidlib.to_str(new) if new else None, "moved": moved})


def _move(repo: Repository, name: str, old: bytes | None, new: bytes | None, message: str) -> bool:
    """Move ``name`` from ``old`` to ``new`` (None: delete it) if it still holds ``old`` and
    ``new`` is complete here; False if it already held ``new``. GC waits meanwhile (the save
    lock, shared)."""
    with repo.refs_store.lock(exclusive=False):
        current = repo.refs_store.get(name)
        if current == new:
            return False
        if current != old:
            raise RefConflict(name, cidlib.to_str(old) if old else None,
                              cidlib.to_str(current) if current else None)
        if new is None:
            moved = repo.refs_store.remove_if_equals(name, old, message=message)
        else:
            repo.check_complete(new)
            moved = (repo.refs_store.add_if_new(name, new, message=message) if old is None
                     else repo.refs_store.set_if_equals(name, old, new, message=message))
        if not moved:
            current = repo.refs_store.get(name)
            raise RefConflict(name, cidlib.to_str(old) if old else None,
                              cidlib.to_str(current) if current else None)
    if new is not None:
        repo.history.saved([new], {})
    return True


async def collect(request: web.Request) -> web.Response:
    payload = await _json_body(request)
    expire = payload.get("expire_reflogs", []) if isinstance(payload, dict) else None
    if not isinstance(expire, list) or not all(isinstance(e, str) for e in expire):
        raise _bad('expected {"expire_reflogs": [ref or prefix, ...]}')
    repo = request.app[PUSH_REPO]
    report = await _on_writer(request, lambda: repo.gc(expire_reflogs=expire))
    return _answer({k: v for k, v in dataclasses.asdict(report).items() if k != "unreachable"})
