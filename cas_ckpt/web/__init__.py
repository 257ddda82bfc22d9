"""The browser view of a repository: runs, history graphs, metrics, checkpoints, diffs, storage.

``add_browser_routes(app, repo)`` adds its pages (``/`` and ``/ui/...``), its static assets (shipped
in the package: nothing is fetched from elsewhere) and its read-only JSON API (``/ui/api/...``) to
an ``aiohttp.web.Application``: the one ``cas-ckpt serve`` runs. Needs the ``http`` extra (aiohttp).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from aiohttp import web

    from cas_ckpt.repository import Repository

__all__ = ["TOKEN_COOKIE", "add_browser_routes", "presented_token"]

TOKEN_COOKIE = "cas_ckpt_token"


def add_browser_routes(app: web.Application, repo: Repository, **options: Any) -> None:
    """Register ``/``, the pages and assets under ``/ui/`` and the JSON API under ``/ui/api/``."""
    from cas_ckpt.web.routes import add_routes  # aiohttp only when a server is built

    add_routes(app, repo, **options)


def presented_token(request: web.Request) -> str | None:
    """The token a request presents: ``Authorization: Bearer T``, else the browser's cookie
    (set once from ``/?token=T``), else a ``token`` query parameter; None if none."""
    header = request.headers.get("Authorization", "")
    scheme, _, value = header.partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    return request.cookies.get(TOKEN_COOKIE) or request.query.get("token") or None
