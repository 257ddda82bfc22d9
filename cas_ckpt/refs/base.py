"""The ref store interface: named, mutable pointers to root CIDs, moved only by compare-and-swap.

A ref store also keeps each ref's reflog, the pin set, the repository config and the save/GC lock:
the small mutable state of a repository, as opposed to the immutable blocks. This module holds
what every medium shares: the name rules, the above/below rule, :class:`ReflogEntry` and the ABC.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import threading
import time
import unicodedata
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from cas_ckpt import cid as cidlib
from cas_ckpt.errors import InvalidRefName

_FORBIDDEN = set(' \\*?[]:~^"<>|')
# Characters that make a name display as another: C1 controls (a terminal may act on them) and
# the bidi controls, which reorder what follows (``runs/\u202eevil`` shows as ``runs/live``).
# Refused by the releases after 0.2.0; a name an older writer stored is listed as a ListedName.
_DECEPTIVE = frozenset([*map(chr, range(0x80, 0xA0)), "\u061c", "\u200e", "\u200f",
                        *map(chr, range(0x202A, 0x202F)), *map(chr, range(0x2066, 0x206A))])
MAX_REF_LENGTH = 1024
STEP_DIGITS = 12  # a checkpoint manager's step refs: "<ref>.steps/<step, 12 digits>"
MAX_SEGMENT_BYTES = 250  # on disk: a file name is at most 255 bytes (cas_ckpt 0.1 added ".lock")


class ListedName(str):
    """A ref name as a listing returned it, breaking only the rule added last (no C1 or bidi
    control): an older cas_ckpt stored it. It stays visible, readable, renamable and a GC root;
    a plain ``str`` holding the same text is refused (nobody can type such a name by mistake)."""


def check_ref_name(name: object) -> str:
    """Return ``name`` if it is a valid ref name, else raise :class:`InvalidRefName`.

    Names are ``/``-separated segments; no empty, ``.`` or ``..`` segment, none starting with ``.``
    or ending in ``.lock`` or ``.tmp``, no control characters (C0, DEL, C1), bidi controls,
    whitespace or ``\\*?[]:~^"<>|``. On disk (:class:`LocalRefStore`) a segment is also at
    most 250 bytes of UTF-8. A :class:`ListedName` is exempt from the C1 and bidi rule.
    """
    if not isinstance(name, str):
        raise InvalidRefName(name, "must be a string")
    if not name or len(name) > MAX_REF_LENGTH:
        raise InvalidRefName(name, f"must be 1 to {MAX_REF_LENGTH} characters")
    if not name.isascii():
        try:
            name.encode("utf-8")  # ref names become file names and reflog JSON
        except UnicodeEncodeError:
            raise InvalidRefName(name, "is not valid Unicode text (lone surrogate)") from None
        if not isinstance(name, ListedName):
            _check_display(name)
    for ch in name:
        if ord(ch) < 32 or ord(ch) == 127 or ch.isspace():
            raise InvalidRefName(name, f"contains {describe_char(ch)}, a control or whitespace character")
        if ch in _FORBIDDEN:
            raise InvalidRefName(name, f"contains {ch!r}")
    for segment in name.split("/"):
        if not segment:
            raise InvalidRefName(name, "has an empty segment (leading, trailing or double '/')")
        if segment.startswith("."):
            raise InvalidRefName(name, "has a segment starting with '.' (including '..')")
        if segment.endswith((".lock", ".tmp")):
            # Lock and temp files: listings skip them, so GC would not see such a ref.
            raise InvalidRefName(name, "has a segment ending in '.lock' or '.tmp'")
    return name


def _check_display(name: str) -> None:
    """Refuse a C1 or bidi control: the name would display as another (or move the terminal)."""
    ch = next((c for c in name if c in _DECEPTIVE), None)
    if ch is None:
        return
    what = ("a C1 control character, which a terminal may act on" if ord(ch) < 0xA0
            else "a bidi control that makes a name display as another")
    raise InvalidRefName(name, f"contains {describe_char(ch)}, {what}")


def describe_char(ch: str) -> str:
    """``U+202E (RIGHT-TO-LEFT OVERRIDE)``; control characters have no Unicode name."""
    name = unicodedata.name(ch, "")
    return f"U+{ord(ch):04X}" + (f" ({name})" if name else "")


def shown_name(name: str) -> str:
    """``name`` for a terminal: each control, bidi control or whitespace character other than
    a space written as a Python escape (``runs/\\u202eevil``), the rest as is."""
    return "".join(c.encode("unicode_escape").decode("ascii")
                   if c in _DECEPTIVE or (ord(c) < 32 or ord(c) == 127) else c for c in name)


def listed_name(name: str) -> str | None:
    """A name found in a store, as listings return it: itself if valid, a :class:`ListedName`
    if only the C1 and bidi rule refuses it (an older cas_ckpt stored it), else None (skipped:
    no writer of any version made it)."""
    if is_ref_name(name):
        return name
    listed = ListedName(name)
    return listed if is_ref_name(listed) else None


def step_ref(ref: str, step: int) -> str:
    """The ref a checkpoint manager keeps for ``ref``'s checkpoint of ``step`` while retained."""
    return f"{ref}.steps/{step:0{STEP_DIGITS}d}"


def check_clash(name: str, existing: Iterable[str]) -> None:
    """Raise :class:`InvalidRefName` if ``name`` would sit above or below an existing ref.

    ``runs`` and ``runs/exp`` cannot both exist: on a filesystem one would have to be a file and a
    directory at once, and every medium keeps the same rule so repositories move between them.
    """
    for other in existing:
        if other.startswith(name + "/"):
            raise InvalidRefName(name, "refs exist below this name")
        if name.startswith(other + "/"):
            raise InvalidRefName(name, f"clashes with the existing ref {other!r}")


STEPS = ".steps/"  # a CheckpointManager's step refs: <run>.steps/<step, 12 digits>


def run_of(name: str) -> str:
    """The run a ref belongs to: ``<run>`` for a manager's step ref ``<run>.steps/<digits>``,
    else the ref itself (a run is its head ref and its step refs)."""
    head, steps, step = name.rpartition(STEPS)
    return head if steps and head and step.isdigit() else name


def is_ref_name(name: str) -> bool:
    """True if ``name`` passes :func:`check_ref_name` (listings skip what does not)."""
    try:
        check_ref_name(name)
    except InvalidRefName:
        return False
    return True


@dataclass(frozen=True)
class ReflogEntry:
    """One ref update: old and new binary CIDs (None = absent), unix time, message."""

    old: bytes | None
    new: bytes | None
    time: float
    message: str

    def to_json(self) -> str:
        return json.dumps(
            {
                "old": cidlib.to_str(self.old) if self.old else None,
                "new": cidlib.to_str(self.new) if self.new else None,
                "time": self.time,
                "message": self.message,
            },
            ensure_ascii=True,
        )

    @classmethod
    def from_json(cls, line: str) -> ReflogEntry:
        obj = json.loads(line)
        return cls(
            old=cidlib.to_bytes(obj["old"]) if obj["old"] else None,
            new=cidlib.to_bytes(obj["new"]) if obj["new"] else None,
            time=float(obj["time"]),
            message=str(obj["message"]),
        )


class Lease(ABC):
    """One writer's claim on a ref, from :meth:`RefStore.lease` until :meth:`release`."""

    @abstractmethod
    def held(self) -> bool:
        """False once released, or taken over by another writer (``takeover=True``)."""

    @abstractmethod
    def release(self) -> None:
        """Give the lease up (idempotent)."""


_THREAD_LOCKS_GUARD = threading.Lock()


@contextlib.contextmanager
def _try_thread_lock(owner: object, name: str) -> Iterator[bool]:
    with _THREAD_LOCKS_GUARD:
        locks = owner.__dict__.setdefault("_maintenance_locks", {})
        lock = locks.setdefault(name, threading.Lock())
    if not lock.acquire(blocking=False):
        yield False
        return
    try:
        yield True
    finally:
        lock.release()


def check_task_name(name: str) -> str:
    """A maintenance lock's name: lower-case letters and dashes (it names a file or an object)."""
    if not name or not all(c.islower() or c == "-" for c in name):
        raise ValueError(f"not a maintenance lock name: {name!r}")
    return name


def holder_info() -> bytes:
    """Who holds a lease, as stored with it: host, pid and time, JSON."""
    return json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "time": time.time()}).encode()


def describe_holder(data: bytes | None) -> str:
    """A holder as the error names it: "pid 12 on host h since 2026-01-01T10:00:00Z"."""
    try:
        info = json.loads(data or b"")
        since = datetime.datetime.fromtimestamp(float(info["time"]), datetime.timezone.utc)
        return f"pid {int(info['pid'])} on host {info['host']!s} since {since:%Y-%m-%dT%H:%M:%SZ}"
    except (ValueError, TypeError, KeyError, OverflowError):
        return "another writer (its lease does not say who)"


class RefStore(ABC):
    """Refs, reflogs, pins, config and the save/GC lock of one repository."""

    @abstractmethod
    def get(self, name: str) -> bytes | None:
        """The ref's binary CID, or None if it does not exist."""

    @abstractmethod
    def _swap(self, name: str, check: Any, new: bytes | None, message: str) -> bool:
        """Atomically: if ``check(current)`` set the ref to ``new`` (None deletes) and log it."""

    def set_if_equals(
        self, name: str, old: bytes | None, new: bytes, *, message: str = ""
    ) -> bool:
        """Move ``name`` to ``new`` if it holds ``old``; ``old=None`` sets unconditionally.

        Returns False when another writer got there first.
        """
        check_ref_name(name)
        # Not ``old.__eq__``: bytes.__eq__(None) is NotImplemented, which is truthy, so an absent
        # ref would have passed the check.
        return self._swap(name, lambda cur: old is None or cur == old, new, message)

    def add_if_new(self, name: str, new: bytes, *, message: str = "") -> bool:
        """Create ``name`` pointing at ``new``; False if it already exists."""
        check_ref_name(name)
        return self._swap(name, lambda cur: cur is None, new, message)

    def remove_if_equals(self, name: str, old: bytes | None, *, message: str = "") -> bool:
        """Delete ``name`` if it holds ``old`` (``None``: whatever it holds); False otherwise.

        The reflog stays, ending in a deletion entry (``new`` None, ``old`` what the ref held):
        GC keeps what it names for the reflog expiry, and the ref can be restored from it. A ref
        created again under the name continues the same reflog.
        """
        check_ref_name(name)

        def check(cur: bytes | None) -> bool:
            return cur is not None and (old is None or cur == old)

        return self._swap(name, check, None, message)

    @abstractmethod
    def names(self, prefix: str = "") -> list[str]:
        """Every ref name (only those starting with ``prefix``), sorted."""

    def values(self, prefix: str = "") -> dict[str, bytes]:
        """Every ref (only those starting with ``prefix``) and its binary CID, read at once (a
        remote medium reads them in parallel)."""
        return {name: value for name in self.names(prefix) if (value := self.get(name)) is not None}

    @abstractmethod
    def reflog(self, name: str) -> list[ReflogEntry]:
        """Every recorded update of ``name``, oldest first (also after the ref was deleted)."""

    @abstractmethod
    def reflog_names(self) -> list[str]:
        """Names that have a reflog (including deleted refs)."""

    @abstractmethod
    def drop_reflog(self, name: str, *, older_than: float | None = None) -> bool:
        """Remove the reflog of ``name`` if no ref of that name exists, and (``older_than``, a
        Unix time) only if every entry is older; True if it was removed. Atomic with respect to
        updates of the ref: a ref created meanwhile keeps its reflog."""

    @abstractmethod
    def pins(self) -> set[bytes]: ...

    @abstractmethod
    def pin(self, cid: bytes) -> None: ...

    @abstractmethod
    def unpin(self, cid: bytes) -> bool: ...

    @abstractmethod
    def read_config(self) -> dict[str, Any] | None: ...

    @abstractmethod
    def init_config(self, config: dict[str, Any]) -> dict[str, Any]:
        """Store ``config`` unless one exists; return the one in force."""

    @abstractmethod
    def update_config(self, old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
        """Replace the config by ``new`` if it still equals ``old`` (compare-and-swap, durable);
        return the one in force."""

    @abstractmethod
    def lock(self, *, exclusive: bool) -> contextlib.AbstractContextManager[None]:
        """Saves hold this shared, GC exclusive, so GC never sweeps under a save in progress."""

    @abstractmethod
    def lease(self, name: str, *, takeover: bool = False) -> Lease:
        """Claim ``name`` for one writer (a checkpoint manager) until the lease is released.

        Raises :class:`LeaseHeld` naming the holder while another lease on ``name`` is held, in
        any process; ``takeover=True`` takes it anyway, and the old holder's :meth:`Lease.held`
        turns False. A holder that dies frees it (at once with a kernel lock). Plain ref updates
        ignore leases: they stay compare-and-swap.
        """

    def try_exclusive(self, name: str) -> contextlib.AbstractContextManager[bool]:
        """A named lock for one maintenance task at a time (``"upkeep"``), taken only if free:
        yields True while holding it, False (holding nothing) if another process holds it. A
        holder that dies frees it (at once with a kernel lock, after ``lease_timeout`` on S3).
        This default excludes the threads of one process only."""
        return _try_thread_lock(self, check_task_name(name))

    @property
    def format_version(self) -> int:
        """The repository format version this store's writes need (``docs/format.md``)."""
        return 1

    def prune_deleted(self) -> int:
        """Remove what deleted refs leave behind once their reflog is gone (S3's tombstones);
        GC calls it under its exclusive lock. Returns how many were removed (0: nothing is left)."""
        return 0

    def check_lease(self) -> None:  # noqa: B027 - a kernel lock cannot be lost: nothing to check
        """Raise :class:`RepositoryError` if a lock this process holds was taken over (a lease
        on a remote medium whose heartbeat lapsed); GC calls it before deleting anything."""


