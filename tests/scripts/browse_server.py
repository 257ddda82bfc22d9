"""A server of the browser view for the tests (until ``cas-ckpt serve`` carries it).

    python browse_server.py REPO [--token T]

Opens REPO read-only, serves ``add_browser_routes`` on a free port of 127.0.0.1 and prints
``serving REPO at http://127.0.0.1:PORT/`` once it listens. With ``--token``, every request
must present it (``Authorization: Bearer T``, the cookie ``/?token=T`` sets, or ``?token=T``),
as the server's token rule asks; others get 401.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
from collections.abc import Awaitable, Callable

from aiohttp import web

import cas_ckpt
from cas_ckpt.web import add_browser_routes, presented_token

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def token_rule(token: str) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        given = presented_token(request) or ""
        if not hmac.compare_digest(given.encode(), token.encode()):
            return web.json_response({"error": "missing or wrong token"}, status=401)
        return await handler(request)

    return check


async def serve(repo_path: str, token: str | None) -> None:
    repo = cas_ckpt.open(repo_path, create=False, read_only=True)
    app = web.Application(middlewares=[token_rule(token)] if token else [])
    add_browser_routes(app, repo)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    print(f"serving {repo_path} at http://127.0.0.1:{port}/", flush=True)
    await asyncio.Event().wait()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("repo")
    parser.add_argument("--token")
    args = parser.parse_args()
    asyncio.run(serve(args.repo, args.token))


if __name__ == "__main__":
    main()
