"""The browser view of a repository: runs, history graphs, metrics, checkpoints, diffs, storage.

``add_browser_routes(app, repo)`` adds its pages (``/`` and ``/ui/...``), its static assets (shipped
in the package: nothing is fetched from elsewhere) and its read-only JSON API (``/ui/api/...``) to
the ``aiohttp.web.Application`` that :func:`cas_ckpt.http.server.make_app` builds: ``cas-ckpt
serve`` serves it, under the server's token rule. Needs the ``http`` extra (aiohttp).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from aiohttp import web

    from cas_ckpt.repository import Repository

__all__ = ["add_browser_routes"]


def add_browser_routes(app: web.Application, repo: Repository, **options: Any) -> None:
    """Register ``/``, the pages and assets under ``/ui/`` and the JSON API under ``/ui/api/``."""
    from cas_ckpt.web.routes import add_routes  # aiohttp only when a server is built

    add_routes(app, repo, **options)
