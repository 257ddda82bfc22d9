"""The browser view's routes on an aiohttp application: pages, assets and the JSON API.

Pages are one HTML shell (``static/index.html``) whose script (``static/app.js``) draws the page
the path names from the JSON API; every asset ships in the package, and the Content-Security-Policy
lets a page load nothing from elsewhere. Repository work runs on a small pool of threads of its
own, never on the event loop. Only GET (and HEAD): nothing here writes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import urllib.parse
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from aiohttp import web

from cas_ckpt import cid as cidlib
from cas_ckpt.errors import (
    AncestorNotFound,
    BlockNotFound,
    CasCkptError,
    CheckpointExpired,
    InvalidCID,
    InvalidRefName,
    PathNotFound,
    RefNotFound,
)
from cas_ckpt.http.sessions import LANDINGS, SESSION_TTL, SESSIONS, session_cookie
from cas_ckpt.repository import Repository
from cas_ckpt.web.data import PAGE, BadRequest, Browser

_log = logging.getLogger("cas_ckpt")

STATIC = Path(__file__).parent / "static"
ASSETS = {"app.js": "text/javascript", "style.css": "text/css", "favicon.svg": "image/svg+xml"}
PAGES = ("runs", "run", "checkpoint", "diff", "storage")
# Browser requests worked on at once, on threads of their own beside the gateway's READ_THREADS:
# a long statistics scan never holds the threads block reads need.
WORKERS = 4

BROWSER = web.AppKey("cas_ckpt.web.browser", Browser)
POOL = web.AppKey("cas_ckpt.web.pool", ThreadPoolExecutor)
FILES = web.AppKey("cas_ckpt.web.files", dict)  # the shell and assets, read once: no disk read on the loop

# Everything from this server, nothing from anywhere else; no inline script.
HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; style-src 'self'; "
                               "script-src 'self'; connect-src 'self'; frame-ancestors 'none'; "
                               "base-uri 'none'; form-action 'self'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}

Query = Mapping[str, str]
Work = Callable[[Browser, Query], Any]


def add_routes(app: web.Application, repo: Repository, *, workers: int = WORKERS) -> None:
    """See :func:`cas_ckpt.web.add_browser_routes`."""
    app[FILES] = {name: (STATIC / name).read_bytes() for name in [*ASSETS, "index.html"]}
    app[BROWSER] = Browser(repo)
    app[POOL] = ThreadPoolExecutor(workers, thread_name_prefix="cas_ckpt-web")
    app.on_cleanup.append(_close_pool)
    router = app.router
    router.add_get("/", _root)
    router.add_get("/ui", _page)
    router.add_get("/ui/", _page)
    router.add_get("/ui/static/{name}", _asset)
    for path, work in _API.items():
        router.add_get(f"/ui/api/{path}", _json(work))
    router.add_get("/ui/{page}", _page)
    app[LANDINGS].update((_root, _page))  # a first visit's ?token= counts here only


async def _close_pool(app: web.Application) -> None:
    app[POOL].shutdown(wait=False, cancel_futures=True)


async def _root(request: web.Request) -> web.StreamResponse:
    raw = request.rel_url.raw_query_string  # as sent: percent-encoded, nothing decoded into a header
    return web.Response(status=302, headers={"Location": f"/ui/?{raw}" if raw else "/ui/"})


async def _page(request: web.Request) -> web.StreamResponse:
    page = request.match_info.get("page", "runs")
    if page not in PAGES:
        raise web.HTTPNotFound(text=f"no page {page!r}; pages: {', '.join(PAGES)}")
    if "token" in request.query:
        return _start_session(request)
    return web.Response(body=request.app[FILES]["index.html"], content_type="text/html", charset="utf-8",
                        headers=HEADERS)


def _start_session(request: web.Request) -> web.StreamResponse:
    """The middleware let ``?token=`` through: exchange it for a session of the browser's pages
    only, in a cookie of this server's own, and drop it from the address (history, screenshots).
    The token itself is never stored in the browser: a captured cookie reads no block or ref."""
    rest = urllib.parse.urlencode([(k, v) for k, v in request.query.items() if k != "token"])
    response = web.Response(status=302, headers={"Location": request.rel_url.raw_path
                                                  + (f"?{rest}" if rest else "")})
    if request.app[SESSIONS].enabled:
        response.set_cookie(session_cookie(request), request.app[SESSIONS].issue(), max_age=SESSION_TTL,
                            httponly=True, samesite="Strict", path="/ui")
    return response


async def _asset(request: web.Request) -> web.StreamResponse:
    name = request.match_info["name"]
    if name not in ASSETS:
        raise web.HTTPNotFound()
    return web.Response(body=request.app[FILES][name], content_type=ASSETS[name], headers=HEADERS)


def _json(work: Work) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def handle(request: web.Request) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        query = dict(request.query)
        try:
            result = await loop.run_in_executor(request.app[POOL], work, request.app[BROWSER], query)
        except Exception as exc:  # every failure becomes a JSON error the page shows
            status, message = _status(exc)
            if status == 500:
                _log.exception("browser API %s failed", request.path)
            return _respond({"error": message}, status)
        return _respond(result, 200)

    return handle


def _respond(value: Any, status: int) -> web.Response:
    return web.Response(text=json.dumps(value, allow_nan=False, separators=(",", ":")), status=status,
                        content_type="application/json", headers=HEADERS)


def _status(exc: Exception) -> tuple[int, str]:
    if isinstance(exc, CheckpointExpired):
        return 410, str(exc)
    if isinstance(exc, (RefNotFound, BlockNotFound, PathNotFound, AncestorNotFound)):
        return 404, str(exc)
    if isinstance(exc, (BadRequest, InvalidCID, InvalidRefName)):
        return 400, str(exc)
    if isinstance(exc, CasCkptError):
        return 500, str(exc)
    return 500, f"internal error ({type(exc).__name__}); see the server's log"


def _int(query: Query, name: str, default: int) -> int:
    text = query.get(name)
    if text is None or text == "":
        return default
    try:
        return int(text)
    except ValueError:
        raise BadRequest(f"{name} must be an integer, not {text!r}") from None


def _required(query: Query, name: str) -> str:
    value = query.get(name)
    if not value:
        raise BadRequest(f"missing query parameter {name!r}")
    return value


def _names(query: Query, name: str) -> list[str] | None:
    text = query.get(name)
    return [n for n in text.split(",") if n] if text else None


def _page_of(query: Query) -> dict[str, int]:
    return {"offset": _int(query, "offset", 0), "limit": _int(query, "limit", PAGE)}


def _checkpoint_target(browser: Browser, query: Query) -> str:
    """``target``, else the commit of ``ref``'s history at ``step`` (a point of a chart)."""
    if query.get("target"):
        return query["target"]
    if query.get("ref") and query.get("step"):
        return cidlib.to_str(bytes(browser.at_step(query["ref"], _int(query, "step", 0))))
    raise BadRequest("give target, or ref and step")


def _graph(browser: Browser, query: Query) -> Any:
    return browser.graph(browser.heads(_names(query, "refs"), query.get("ref")), **_page_of(query))


def _metrics(browser: Browser, query: Query) -> Any:
    return browser.metrics(browser.heads(_names(query, "refs"), query.get("ref")))


_API: dict[str, Work] = {
    "repo": lambda b, q: b.overview(),
    "runs": lambda b, q: b.runs(prefix=q.get("prefix", ""), every=q.get("every") == "1", **_page_of(q)),
    "graph": _graph,
    "metrics": _metrics,
    "checkpoint": lambda b, q: b.checkpoint(_checkpoint_target(b, q)),
    "tree": lambda b, q: b.tree(_required(q, "target"), ref=q.get("ref") or None, query=q.get("q", ""),
                                changed=q.get("changed") == "1", **_page_of(q)),
    "stats": lambda b, q: b.stats(_required(q, "target"), _required(q, "path")),
    "diff": lambda b, q: b.diff(_required(q, "a"), _required(q, "b"), path=q.get("path") or None,
                                order=q.get("order") or "given"),
    "diff/norms": lambda b, q: b.diff_norms(_required(q, "a"), _required(q, "b"),
                                            path=q.get("path") or None, **_page_of(q)),
    "nonfinite": lambda b, q: b.nonfinite(_required(q, "ref"), path=q.get("path") or None),
    "storage": lambda b, q: b.storage(),
}
