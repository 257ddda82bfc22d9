"""Refs of a repository served over HTTP (``cas-ckpt serve``), from its JSON API.

``GET /refs`` lists them, ``/refs/{name}`` reads one, ``/reflog/{name}``, ``/pins`` and
``/config`` the rest (``docs/format.md``, "HTTP"). A ref only names a root: every block it leads
to is fetched and verified by the block store, so nothing here needs to be trusted beyond which
checkpoint a name points at.

Opened for writing, a ref moves by compare-and-swap on the server (``POST /api/v0/refs/{name}``,
the write token's): it moves only if it still holds the old value and every block the new one
needs is stored there. The save lock is the server's own, taken for each move; every other change
(a delete, a pin, the config, leases) is refused: those belong to whoever runs the server.
"""

from __future__ import annotations

import contextlib
import urllib.parse
from typing import Any, NoReturn

from cas_ckpt import cid as cidlib
from cas_ckpt.backends.http import HttpRemote
from cas_ckpt.errors import CheckpointExpired, InvalidCID, RemoteError, RepositoryError
from cas_ckpt.refs.base import Lease, ReflogEntry, RefStore, check_ref_name, listed_name


def _quoted(name: str) -> str:
    return urllib.parse.quote(name, safe="/")


class HttpRefStore(RefStore):
    """The refs, reflogs, pins and config of the repository served at ``remote``; refs move
    there unless ``read_only``."""

    def __init__(self, remote: HttpRemote, *, read_only: bool = True) -> None:
        self.remote = remote
        self.read_only = read_only

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

    # -- ref moves: pushes; every other change is refused -------------------------------------
    def _refuse(self, what: str = "refs cannot change") -> NoReturn:
        how = "was opened read-only" if self.read_only else "takes only ref moves (pushes)"
        raise RepositoryError(f"{self.remote.url} {how}: {what} over HTTP")

    def set_if_equals(self, name: str, old: bytes | None, new: bytes, *, message: str = "") -> bool:
        if old is None:
            self._refuse("a ref cannot be set without knowing what it held")
        return self._move(check_ref_name(name), old, new, message)

    def add_if_new(self, name: str, new: bytes, *, message: str = "") -> bool:
        return self._move(check_ref_name(name), None, new, message)

    def remove_if_equals(self, name: str, old: bytes | None, *, message: str = "") -> bool:
        if old is None:
            self._refuse("a ref cannot be deleted without knowing what it holds")
        return self._move(check_ref_name(name), old, None, message)

    def _move(self, name: str, old: bytes | None, new: bytes | None, message: str) -> bool:
        """POST the move (``new`` None: the delete): True once the ref holds ``new``, False if it
        held something else."""
        if self.read_only:
            self._refuse()
        path = f"/api/v0/refs/{_quoted(name)}"
        status, answer = self.remote.post_json(
            path, {"old": cidlib.to_str(old) if old else None, "new": cidlib.to_str(new) if new else None,
                   "message": message}, answers=frozenset({200, 409, 412}))
        if status == 404:
            raise RemoteError(self.remote.where(path), "this server takes no pushes")
        if status == 412:  # a block the server had when asked was collected before the move
            missing = answer.get("missing") if isinstance(answer, dict) else None
            raise CheckpointExpired(cidlib.to_str(new or b""), (missing or ["?"])[0])
        return status == 200

    def collect(self, expire_reflogs: list[str]) -> dict[str, Any]:
        """Run GC on the server (``POST /api/v0/gc``): its report's fields."""
        if self.read_only:
            self._refuse("GC cannot run")
        status, answer = self.remote.post_json("/api/v0/gc", {"expire_reflogs": expire_reflogs})
        if status == 404 or not isinstance(answer, dict):
            raise RemoteError(self.remote.where("/api/v0/gc"), "this server takes no pushes")
        return answer

    def _swap(self, name: str, check: Any, new: bytes | None, message: str) -> bool:
        self._refuse("a ref cannot change but by compare-and-swap")

    def lock(self, *, exclusive: bool) -> contextlib.AbstractContextManager[None]:
        if exclusive or self.read_only:
            self._refuse("the repository's lock cannot be taken")
        return contextlib.nullcontext()  # the server takes it for each move

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

    def lease(self, name: str, *, takeover: bool = False) -> Lease:
        self._refuse()

    def try_exclusive(self, name: str) -> contextlib.AbstractContextManager[bool]:
        self._refuse()
