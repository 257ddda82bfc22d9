"""Who the browser is: the sessions ``cas-ckpt serve`` gives for its token, and the keys the
server (:mod:`cas_ckpt.http.server`) and the browser view (:mod:`cas_ckpt.web`) share. Below both,
so that the browser is a layer on the server and neither imports the other's internals.

A browser opens ``/?token=T`` once; the page answers with a session cookie (:func:`session_cookie`)
that unlocks the browser's pages and their JSON only (:func:`is_browser_route`), never blocks,
refs or CARs, which want ``Authorization: Bearer`` (:func:`bearer_token`). See ``docs/format.md``,
"HTTP".
"""

from __future__ import annotations

import hmac
import time

from aiohttp import web

SESSION_TTL = 12 * 3600  # seconds a browser session lasts
SESSION_COOKIE = "cas_ckpt_session"  # the browser's session, named per port: "cas_ckpt_session_8080"
# Handlers of the pages a browser opens first, the only routes where a ``token`` query parameter
# counts: they answer by setting the session cookie and dropping the token from the address.
# Anywhere else a token in the URL would end up in logs, histories and shared links.
LANDINGS = web.AppKey("landings", set)
SESSIONS = web.AppKey("sessions", "Sessions")


class Sessions:
    """Browser sessions: a value given for the token once (``/?token=T``), which unlocks the
    browser's pages and their JSON only, and expires after :data:`SESSION_TTL` seconds.

    A session is ``<expiry>.<HMAC-SHA256 of the expiry>`` under a key derived from the token:
    nothing is kept per session (a flood of logins holds no memory), it cannot be turned back
    into the token, and a new token ends every session.
    """

    def __init__(self, token: str | None) -> None:
        self._key = hmac.new(token.encode(), b"cas_ckpt browser session", "sha256").digest() \
            if token else None

    @property
    def enabled(self) -> bool:
        """Whether the server has a token (without one, no session is needed)."""
        return self._key is not None

    def issue(self, now: float | None = None) -> str:
        expiry = str(int((time.time() if now is None else now) + SESSION_TTL))
        return f"{expiry}.{self._sign(expiry)}"

    def valid(self, value: str | None, now: float | None = None) -> bool:
        if not value or self._key is None:
            return False
        expiry, _, signature = value.partition(".")
        if not (expiry.isascii() and expiry.isdigit() and len(expiry) < 20):
            return False
        fresh = int(expiry) > (time.time() if now is None else now)
        return hmac.compare_digest(raw_bytes(signature), self._sign(expiry).encode()) and fresh

    def _sign(self, expiry: str) -> str:
        assert self._key is not None
        return hmac.new(self._key, expiry.encode(), "sha256").hexdigest()


def raw_bytes(header_text: str) -> bytes:
    """A header's text back as its bytes: aiohttp decodes them as UTF-8 with surrogate escapes,
    which a plain ``encode()`` refuses (a 500 for a client's stray byte)."""
    return header_text.encode("utf-8", "surrogateescape")


def session_cookie(request: web.Request) -> str:
    """The session cookie's name on the server that took ``request``: one per port, since a
    browser sends a host's cookies to every port of it."""
    sockname = request.transport.get_extra_info("sockname") if request.transport else None
    port = sockname[1] if isinstance(sockname, tuple) and len(sockname) > 1 else 0
    return f"{SESSION_COOKIE}_{port}"


def is_browser_route(request: web.Request) -> bool:
    """The browser's pages, assets and JSON (``/``, ``/ui...``): what a session unlocks."""
    return request.path == "/" or request.path == "/ui" or request.path.startswith("/ui/")


def bearer_token(request: web.Request) -> str | None:
    """The token of ``Authorization: Bearer T``, or None."""
    scheme, _, value = request.headers.get("Authorization", "").partition(" ")
    return (value.strip() or None) if scheme.lower() == "bearer" else None
