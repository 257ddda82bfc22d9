"""A repository over HTTP: ``cas-ckpt serve`` (:mod:`cas_ckpt.http.server`, needs the ``http`` extra).

The server speaks the IPFS trustless gateway protocol for blocks and CAR streams, plus a small
read-only JSON API for refs; the readers are :mod:`cas_ckpt.blocks.http` and
:mod:`cas_ckpt.refs.http` (``cas_ckpt.open("http://host:port")``). See ``docs/format.md``, "HTTP".
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from cas_ckpt.backends.http import ENV_TOKEN

if TYPE_CHECKING:
    from cas_ckpt.repository import Repository

DEFAULT_PORT = 8080  # the port IPFS gateways listen on by default
MAX_STREAMS = 32  # block and CAR bodies in flight at once: 2 clients at their 16 parallel reads
STREAM_WAIT = 5.0  # seconds a request over the cap waits before its 503
ENV_WRITE_TOKEN = "CAS_CKPT_WRITE_TOKEN"  # the token a server takes pushes from (serve --write-token)
MAX_UPLOAD = 64 * 1024**3  # bytes one push may send, unless serve --max-upload says
__all__ = ["DEFAULT_PORT", "ENV_TOKEN", "ENV_WRITE_TOKEN", "MAX_STREAMS", "MAX_UPLOAD", "STREAM_WAIT",
           "serve"]


def serve(
    repo: Repository | str | os.PathLike[str],
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    *,
    token: str | None = None,
    max_streams: int = MAX_STREAMS,
    ready: Callable[[str], None] | None = None,
    write_token: str | None = None,
    max_upload: int = MAX_UPLOAD,
) -> None:
    """Serve ``repo`` (an open repository or its location) over HTTP until interrupted (SIGINT
    or SIGTERM). Read-only unless ``write_token``: then requests carrying it may push (blocks in,
    verified and durable, then refs by compare-and-swap; ``max_upload`` bytes a push), and a
    location is opened for writing. No other route writes anything.

    Bound to 127.0.0.1 unless ``host`` says otherwise; with ``token`` every request needs
    ``Authorization: Bearer <token>`` (a browser's ``/?token=<token>`` is exchanged for a session
    that opens the browser's pages only). ``max_streams``: block and CAR bodies sent at once;
    a request over the cap waits briefly, then gets 503 with ``Retry-After``.
    Needs ``pip install 'cas_ckpt[http]'`` (aiohttp).
    ``ready``: called with the URL once the server listens (``port=0`` picks a free port).
    """
    try:
        from cas_ckpt.http import server
    except ImportError as exc:  # aiohttp is the http extra
        from cas_ckpt.errors import RepositoryError

        raise RepositoryError(
            f"serving needs aiohttp: pip install 'cas_ckpt[http]' ({exc})"
        ) from None
    server.run(repo, host, port, token=token, max_streams=max_streams, ready=ready,
               write_token=write_token, max_upload=max_upload)
