"""Refs of a repository served over HTTP (``cas-ckpt serve``), read-only, from its JSON API.

``GET /refs`` lists them, ``/refs/{name}`` reads one, ``/reflog/{name}``, ``/pins`` and
``/config`` the rest (``docs/format.md``, "HTTP"). A ref only names a root: every block it leads
to is fetched and verified by the block store, so nothing here needs to be trusted beyond which
checkpoint a name points at. Every change (a ref move, a pin, the save lock) is refused.
"""

from __future__ import annotations

import contextlib
import urllib.parse
from typing import Any, NoReturn

from cas_ckpt import cid as cidlib
from cas_ckpt.backends.http import HttpRemote
from cas_ckpt.errors import InvalidCID, RemoteError, RepositoryError
from cas_ckpt.refs.base import Lease, ReflogEntry, RefStore, check_ref_name, listed_name


def _quoted(name: str) -> str:
    return urllib.parse.quote(name, safe="/")


class HttpRefStore(RefStore):
    """The refs, reflogs, pins and config of the repository served at ``remote``; read-only."""

    def __init__(self, remote: HttpRemote) -> None:
        self.remote = remote

    def _cid(self, text: Any, what: str) -> bytes:
        try:
            return cidlib.to_bytes(text)
        except InvalidCID as exc:
            raise RemoteError(self.remote.where(what), f"answered with a malformed CID: {exc}") from None

    def get(self, name: str) -> bytes | None:
        check_ref_name(name)
        path = f"/refs/{_quoted(name)}"
        found = self.remote.get_json(path)
        if found is None:
            return None
        if not isinstance(found, dict) or found.get("name") != name:
            raise RemoteError(self.remote.where(path), f"answered {found!r} for ref {name!r}")
        return self._cid(found.get("cid"), path)

    def names(self, prefix: str = "") -> list[str]:
        return sorted(self.values(prefix))

    def values(self, prefix: str = "") -> dict[str, bytes]:
        """One request: ``/refs?prefix=`` answers every ref with its CID."""
        path = f"/refs?prefix={urllib.parse.quote(prefix, safe='')}" if prefix else "/refs"
        found = self.remote.get_json(path)
        if not isinstance(found, dict):
            raise RemoteError(self.remote.where(path), "did not answer with a map of refs")
        return {listed: self._cid(cid, path) for name, cid in sorted(found.items())
                if isinstance(name, str) and (listed := listed_name(name)) is not None
                and listed.startswith(prefix)}

    def reflog(self, name: str) -> list[ReflogEntry]:
        path = f"/reflog/{_quoted(check_ref_name(name))}"
        found = self.remote.get_json(path)
        if found is None:
            return []
        try:
            return [ReflogEntry(old=self._cid(e["old"], path) if e["old"] else None,
                                new=self._cid(e["new"], path) if e["new"] else None,
                                time=float(e["time"]), message=str(e["message"])) for e in found]
        except (TypeError, KeyError, ValueError) as exc:
            raise RemoteError(self.remote.where(path), f"answered a malformed reflog: {exc!r}") from None

    def reflog_names(self) -> list[str]:
        raise RepositoryError(f"{self.remote.url} does not serve the names of deleted refs' reflogs")

    def pins(self) -> set[bytes]:
        found = self.remote.get_json("/pins")
        if not isinstance(found, list):
            raise RemoteError(self.remote.where("/pins"), "did not answer with a list of CIDs")
        return {self._cid(text, "/pins") for text in found}

    def read_config(self) -> dict[str, Any] | None:
        found = self.remote.get_json("/config")
        if found is not None and not isinstance(found, dict):
            raise RemoteError(self.remote.where("/config"), "did not answer with a config map")
        return found

    # -- every change is refused ---------------------------------------------------------------
    def _refuse(self) -> NoReturn:
        raise RepositoryError(f"{self.remote.url} is read-only: refs cannot change over HTTP")

    def _swap(self, name: str, check: Any, new: bytes | None, message: str) -> bool:
        self._refuse()

    def drop_reflog(self, name: str, *, older_than: float | None = None) -> bool:
        self._refuse()

    def pin(self, cid: bytes) -> None:
        self._refuse()

    def unpin(self, cid: bytes) -> bool:
        self._refuse()

    def init_config(self, config: dict[str, Any]) -> dict[str, Any]:
        self._refuse()

    def update_config(self, old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
        self._refuse()

    def lock(self, *, exclusive: bool) -> contextlib.AbstractContextManager[None]:
        self._refuse()

    def lease(self, name: str, *, takeover: bool = False) -> Lease:
        self._refuse()

    def try_exclusive(self, name: str) -> contextlib.AbstractContextManager[bool]:
        self._refuse()
