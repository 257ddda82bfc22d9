"""Refs, reflogs, pins, config and the save/GC lock in S3, moved only by conditional writes.

Layout below the repository's prefix (see ``docs/scale-out.md``)::

    config.json                 created once with If-None-Match: *
    refs/<name>                 "<cid>\\n<entry id>\\n": the commit and the reflog entry that set it;
                                "\\n<entry id>\\n" (55 bytes): a tombstone, the ref deleted by that entry
    logs/<name>/<entry id>.json one reflog entry: {"old", "new", "time", "message", "prev"}
    pins/<cid>                  empty
    locks/gc                    GC's exclusive lease (a holder, or released)
    locks/saves/<id>            one lease per save in progress
    locks/runs/<name>.lease     a checkpoint manager's lease on its ref (name %-quoted)

Only conditional PUTs decide anything (``If-None-Match: *`` to create, ``If-Match`` on the ETag
read to replace): servers that honour them often ignore conditions on DELETE (MinIO, LocalStack).
An update writes its reflog entry first (a new object), then moves the ref with ``If-Match`` on the
ETag it read (``If-None-Match: *`` to create): a lost race is a failed condition, and the loser
deletes its entry. A deletion is the same move, to a tombstone. Each entry names the entry before
it (``prev``), and the ref names the latest, so the reflog is the chain from the ref back: entries
of updates that lost or were cut short by a crash are never part of it. There are no lock files:
a lock on S3 is a *lease*, an object its holder rewrites every ``lease_timeout / 4`` seconds and
releases by writing a released state; one not rewritten for ``lease_timeout`` seconds (by the
server's clock) belongs to a dead process and is taken over with ``If-Match`` on the state read.
Objects are deleted unconditionally only where a race cannot undo anything (``docs/scale-out.md``,
"What is deleted, and why no race loses anything").
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from cas_ckpt import cid as cidlib
from cas_ckpt.backends.s3 import Meta, S3Bucket, backoff
from cas_ckpt.errors import CorruptStore, InvalidRefName, LeaseHeld, RepositoryError
from cas_ckpt.refs.base import (
    Lease,
    ReflogEntry,
    RefStore,
    check_ref_name,
    check_task_name,
    describe_holder,
    listed_name,
)

MAX_KEY = 1024  # S3's limit on a key, in UTF-8 bytes
_ENTRY_ID = 20 + 1 + 32  # "<seq:020d>-<uuid hex>"
LEASE_TIMEOUT = 60.0
MAX_TRIES = 100  # compare-and-swap attempts of one unconditional update under contention
REFLOG_TRIES = 3  # reads of a reflog whose ref keeps moving under the reader
FORMAT_VERSION = 4  # refs deleted by tombstones, locks released by a state: cas_ckpt 0.2 must not write
TOMBSTONE_SIZE = 1 + _ENTRY_ID + 1  # "\\n<entry id>\\n"; a live ref holds a CID: 60 bytes or more


@dataclass(frozen=True)
class _Head:
    """A ref object as read: its CID (None: a tombstone), the reflog entry that set it (or deleted
    it), and its ETag."""

    cid: bytes | None
    entry: str | None
    etag: str


def ref_body(cid: bytes | None, entry: str) -> bytes:
    """A ref object's body: the CID and the reflog entry that set it; for a tombstone (``cid``
    None) an empty line and the entry that deleted it (:data:`TOMBSTONE_SIZE` bytes)."""
    return f"{cidlib.to_str(cid) if cid is not None else ''}\n{entry}\n".encode("ascii")


def parse_ref(body: bytes, etag: str) -> _Head:
    """A ref object read (ValueError or UnicodeDecodeError if it is not one)."""
    first, *rest = body.decode("ascii").split("\n")
    entry = (rest or [""])[0].strip() or None
    if not first and len(body) == TOMBSTONE_SIZE and entry is not None:
        return _Head(None, entry, etag)
    return _Head(cidlib.to_bytes(first.strip()), entry, etag)


def _released() -> bytes:
    """A lock object's released state (unique, so its ETag is never one read before)."""
    return json.dumps({"released": time.time(), "nonce": uuid.uuid4().hex}).encode()


def _is_released(body: bytes) -> bool:
    try:
        state = json.loads(body)
    except (ValueError, RecursionError):
        return False  # damaged: taken for a holder's, which goes stale
    return isinstance(state, dict) and "released" in state


def _seq(entry: str | None) -> int:
    """The sequence number of a reflog entry id (0 for none, -1 for a malformed one)."""
    try:
        return int(entry.split("-", 1)[0]) if entry else 0
    except ValueError:
        return -1


class _Lease:
    """A lock object kept alive by a heartbeat thread: rewritten with If-Match on its last ETag.

    If the rewrite's condition fails, someone judged this holder dead and removed the object: the
    lease is lost, and :meth:`beat` says so.
    """

    def __init__(self, bucket: S3Bucket, key: str, etag: str, body: Callable[[], bytes], interval: float,
                 *, own_key: bool = False):
        self.bucket, self.key, self.etag, self.body = bucket, key, etag, body
        self.own_key = own_key  # a key no one else ever writes a holder into (a save's registration)
        self.interval = interval
        self.lost = False
        self.renewed = time.monotonic()
        self._mutex = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval,), daemon=True,
                                        name=f"cas_ckpt-lease-{key}")
        self._thread.start()

    def _run(self, interval: float) -> None:
        while not self._stop.wait(interval):
            try:
                if not self.beat():
                    return
            except RepositoryError:
                continue  # a request failed even after retries: beat again next time

    def beat(self, *, unless_newer_than: float = 0.0) -> bool:
        """Rewrite the lease (unless it was rewritten that recently); False if it was lost.

        A lease rewritten less than ``lease_timeout`` ago cannot have been judged stale, so a check
        right after a heartbeat needs no request.
        """
        with self._mutex:
            if not self.lost and time.monotonic() - self.renewed >= unless_newer_than:
                started = time.monotonic()
                etag = self.bucket.put(self.key, self.body(), match=self.etag)
                if etag is None:
                    self.lost = True
                else:
                    self.etag, self.renewed = etag, started
            return not self.lost

    def release(self) -> None:
        self._stop.set()
        self._thread.join()
        with self._mutex:
            if not self.lost:
                with contextlib.suppress(RepositoryError):  # left behind, it goes stale
                    if self.own_key:
                        self.bucket.delete(self.key)  # no one else writes this key: nothing to undo
                    else:
                        self.bucket.put(self.key, _released(), match=self.etag)


class S3RefStore(RefStore):
    """Refs and the rest of a repository's small mutable state in an S3 bucket.

    ``lease_timeout``: seconds without a heartbeat after which a save's or GC's lease is taken for
    dead. ``lock_timeout``: how long to wait for a lock (None: as long as it takes, like a flock).
    """

    def __init__(
        self,
        bucket: S3Bucket | str,
        *,
        lease_timeout: float = LEASE_TIMEOUT,
        lock_timeout: float | None = None,
        poll: float = 0.5,
        read_only: bool = False,
    ) -> None:
        self.bucket = bucket if isinstance(bucket, S3Bucket) else S3Bucket(bucket)
        if not read_only:
            self.bucket.check_conditional_writes()
        self.lease_timeout = lease_timeout
        self.lock_timeout = lock_timeout
        self.poll = poll
        self._local = threading.local()
        self._gc_leases: list[_Lease] = []
        self._shared: _Lease | None = None  # one save registration, shared by the whole process
        self._shared_users = 0
        self._mutex = threading.Lock()  # held only briefly, never across a request that waits
        self._joining = threading.Lock()
        self._beats = 0

    # -- keys ----------------------------------------------------------------------------------
    def _name(self, name: str) -> str:
        check_ref_name(name)
        longest = f"{self.bucket.prefix}logs/{name}/{'0' * _ENTRY_ID}.json"
        if len(longest.encode("utf-8")) > MAX_KEY:
            raise InvalidRefName(name, f"too long for an S3 key under {self.bucket.url}")
        return name

    def _where(self, key: str) -> str:
        return self.bucket.where(key)

    # -- refs ----------------------------------------------------------------------------------
    @property
    def format_version(self) -> int:
        return FORMAT_VERSION

    def get(self, name: str) -> bytes | None:
        head = self._head(self._name(name))
        return head.cid if head else None

    def _head(self, name: str) -> _Head | None:
        """The ref object: a live ref, a tombstone (``cid`` None), or None if there is none."""
        key = f"refs/{name}"
        got = self.bucket.get(key)
        if got is None:
            return None
        try:
            return parse_ref(*got)
        except (UnicodeDecodeError, ValueError) as exc:
            raise CorruptStore(self._where(key), f"ref object does not hold a valid CID: {exc}") from None

    def _swap(self, name: str, check: Any, new: bytes | None, message: str) -> bool:
        self._name(name)
        self.check_lease()  # a save whose lease was taken over must not move a ref
        for attempt in range(MAX_TRIES):
            head = self._head(name)
            if not check(head.cid if head else None):
                return False
            if new is None:
                moved = self._delete(name, head, message)
            else:
                moved = self._update(name, head, new, message)
            if moved:
                return True
            time.sleep(backoff(attempt) / 10)  # lost a race: read again, the check decides
        raise RepositoryError(f"ref {name!r} changed under each of {MAX_TRIES} attempts to update it")

    def _write_entry(self, name: str, prev: str | None, entry: ReflogEntry) -> str:
        """Write a reflog entry after ``prev``; return its id."""
        seq = max(_seq(prev) + 1, time.time_ns() // 1000)
        entry_id = f"{seq:020d}-{uuid.uuid4().hex}"
        record = json.loads(entry.to_json())
        record["prev"] = prev
        self.bucket.put(f"logs/{name}/{entry_id}.json", json.dumps(record).encode("ascii"), create=True)
        return entry_id

    def _update(self, name: str, head: _Head | None, new: bytes, message: str) -> bool:
        if head is not None and head.cid is None:
            # Over a tombstone: under the shared lock, so GC (which removes old tombstones, under
            # its exclusive lock) cannot delete the ref this PUT makes live.
            with self._hold(False):
                self._check_clash(name)
                return self._write_update(name, head, head.entry, new, message)
        if head is None:
            self._check_clash(name)
            deleted = self._deletion(name)  # a ref created again continues its reflog (0.2's layout)
            return self._write_update(name, None, deleted[1] if deleted else None, new, message)
        return self._write_update(name, head, head.entry, new, message)

    def _write_update(self, name: str, head: _Head | None, prev: str | None, new: bytes, message: str
                      ) -> bool:
        """The reflog entry after ``prev``, then the ref moved from ``head`` (created if None)."""
        entry = ReflogEntry(head.cid if head else None, new, time.time(), message)
        entry_id = self._write_entry(name, prev, entry)
        log_key = f"logs/{name}/{entry_id}.json"
        value = ref_body(new, entry_id)
        key = f"refs/{name}"
        if head is None:
            etag = self.bucket.put(key, value, create=True)
        else:
            etag = self.bucket.put(key, value, match=head.etag)
        if etag is not None:
            return True
        if self._landed(name, entry_id):
            return True  # a retried request failed its condition on our own first attempt
        self.bucket.delete(log_key)  # lost the race: the entry records nothing
        return False

    def _landed(self, name: str, entry_id: str) -> bool:
        """True if the update that wrote ``entry_id`` moved the ref after all.

        A PUT whose response was lost is retried; the retry fails its condition on the first
        attempt's own success, and other writers may have moved the ref on since. The update
        landed if its entry is on the chain from the head: walk back while entries are newer.
        """
        head = self._head(name)
        current = head.entry if head is not None else None
        for _ in range(MAX_TRIES * 100):  # each entry's prev is older: a bound only against damage
            if current is None or _seq(current) < _seq(entry_id):
                return False
            if current == entry_id:
                return True
            found = self._record(f"logs/{name}/{current}.json")
            if not isinstance(found, tuple):
                return False  # gone or damaged: not provably ours, so report the conflict
            current = found[1]
        return False

    def _delete(self, name: str, head: _Head | None, message: str) -> bool:
        """The deletion entry first, then the ref replaced by a tombstone naming it (If-Match):
        the reflog stays, its chain starting at the tombstone's entry."""
        assert head is not None and head.cid is not None  # check() refuses an absent ref
        entry_id = self._write_entry(name, head.entry, ReflogEntry(head.cid, None, time.time(), message))
        if self.bucket.put(f"refs/{name}", ref_body(None, entry_id), match=head.etag) is not None:
            return True
        if self._landed(name, entry_id):
            return True  # a retried request failed its condition on our own first attempt
        self.bucket.delete(f"logs/{name}/{entry_id}.json")  # lost the race: it records nothing
        return False

    def _deletion(self, name: str) -> tuple[ReflogEntry, str] | None:
        """The newest deletion entry of ``name`` (what a deleted ref's reflog chain starts at)
        and its id; None if it has none."""
        keys = sorted((m.key for m in self._entries(name)), key=lambda k: _seq(_entry_id(k)), reverse=True)
        for key in keys:
            found = self._record(key)
            if isinstance(found, CorruptStore):
                raise found
            if found is not None and found[0].new is None:
                return found[0], _entry_id(key)
        return None

    def drop_reflog(self, name: str, *, older_than: float | None = None) -> bool:
        """Delete every entry of an absent ref (entries of a ref created meanwhile, newer than the
        deletion, are left: a creation's link into a dropped history is not followed)."""
        self._name(name)
        head = self._head(name)
        if head is not None and head.cid is not None:
            return False
        deleted = (None, head.entry) if head is not None else self._deletion(name)
        last = _seq(deleted[1]) if deleted else None
        keys = [m.key for m in self._entries(name) if last is None or _seq(_entry_id(m.key)) <= last]
        # The chain; without a deletion, entries no chain reaches (updates a crash cut short).
        entries = self.reflog(name) if deleted else [
            found[0] for found in self.bucket.pool.map(self._record, keys) if isinstance(found, tuple)]
        if not keys or (older_than is not None and max((e.time for e in entries), default=0) >= older_than):
            return False
        self.bucket.delete_many(keys)
        if head is not None and self._holds_gc_lock():
            self.bucket.delete(f"refs/{name}")  # the tombstone: see prune_deleted
        return True

    def prune_deleted(self) -> int:
        """Remove the tombstones of deleted refs whose reflog is gone; under GC's exclusive lock
        only, which keeps out the one writer that could bring one back to life (a ref created
        over a tombstone holds the shared lock). Returns how many were removed."""
        if not self._holds_gc_lock():
            return 0
        removed = 0
        for meta in self.bucket.list("refs/"):
            name = meta.key[len("refs/"):]
            if meta.size == TOMBSTONE_SIZE and not self.bucket.any(f"logs/{name}/"):
                head = self._head(name)
                if head is not None and head.cid is None:
                    self.bucket.delete(meta.key)
                    removed += 1
        return removed

    def _holds_gc_lock(self) -> bool:
        with self._mutex:
            return any(not lease.lost for lease in self._gc_leases)

    def _check_clash(self, name: str) -> None:
        """A ref cannot sit above or below another ref (``runs`` and ``runs/exp``); tombstones
        are no refs."""
        if any(m.size != TOMBSTONE_SIZE for m in self.bucket.list(f"refs/{name}/")):
            raise InvalidRefName(name, "refs exist below this name")
        parts = name.split("/")
        for i in range(1, len(parts)):
            parent = "/".join(parts[:i])
            meta = self.bucket.head(f"refs/{parent}")
            if meta is not None and meta.size != TOMBSTONE_SIZE:
                raise InvalidRefName(name, f"clashes with the existing ref {parent!r}")

    def names(self, prefix: str = "") -> list[str]:
        """The live refs: a listing, tombstones told apart by their size (no live ref has it)."""
        listed = self.bucket.list(f"refs/{prefix}")
        names = (m.key[len("refs/") :] for m in listed if m.size != TOMBSTONE_SIZE)
        return sorted(found for n in names if (found := listed_name(n)) is not None)

    def values(self, prefix: str = "") -> dict[str, bytes]:
        """One listing, then the refs read in parallel (a GET each)."""
        names = self.names(prefix)
        heads = self.bucket.pool.map(self._head, names) if len(names) > 1 else map(self._head, names)
        return {name: head.cid for name, head in zip(names, heads, strict=True)
                if head is not None and head.cid is not None}

    # -- reflogs -------------------------------------------------------------------------------
    def _entries(self, name: str) -> list[Meta]:
        return [m for m in self.bucket.list(f"logs/{name}/", delimiter="/") if m.key.endswith(".json")]

    def reflog(self, name: str) -> list[ReflogEntry]:
        """The chain of entries from the one the ref names back (for a deleted ref: from its
        newest deletion entry), oldest first.

        Entries are listed, then read: meanwhile a writer that lost a race may delete its entry
        (never part of the chain), and GC may drop a deleted ref's reflog. So an entry that
        vanished is damage only if the chain needs it and the ref did not change meanwhile.
        """
        self._name(name)
        for _ in range(REFLOG_TRIES):
            head, start = self._start(name)
            if start is None:
                return []
            chain, missing = self._chain(name, start)
            if missing is None:
                return chain
            if head is not None and head.cid is None and missing.endswith(f"/{start}.json"):
                return []  # a tombstone whose reflog was dropped (its deletion entry first)
            if self._start(name) == (head, start):
                why = f"reflog entry missing from the chain of refs/{name}"
                raise CorruptStore(self._where(missing), why)
            # the ref changed while we read: read the chain of its new value
        raise RepositoryError(f"ref {name!r} changed under each of {REFLOG_TRIES} reads of its reflog")

    def _start(self, name: str) -> tuple[_Head | None, str | None]:
        """The ref as read (a tombstone too), and the entry its reflog chain starts at."""
        head = self._head(name)
        if head is not None:
            return head, head.entry
        deleted = self._deletion(name)  # deleted by cas_ckpt 0.2: no tombstone
        return None, deleted[1] if deleted else None

    def _chain(self, name: str, start: str) -> tuple[list[ReflogEntry], str | None]:
        """The chain from entry ``start`` back (oldest first), or the key of the first entry it
        lacks."""
        keys = [m.key for m in self._entries(name) if _seq(_entry_id(m.key)) <= _seq(start)]
        records = dict(zip(map(_entry_id, keys), self.bucket.pool.map(self._record, keys), strict=True))
        chain: list[ReflogEntry] = []
        current = start
        while current is not None:
            record = records.get(current)
            if record is None:
                if chain and chain[-1].old is None:
                    break  # a creation's link into the history of a deleted ref, since dropped
                return [], f"logs/{name}/{current}.json"
            if isinstance(record, CorruptStore):
                raise record  # a damaged entry is reported only when the chain needs it
            if len(chain) == len(records):
                raise CorruptStore(self._where(f"logs/{name}/"), "reflog entries link in a loop")
            entry, current = record
            chain.append(entry)
        return chain[::-1], None

    def _record(self, key: str) -> tuple[ReflogEntry, str | None] | CorruptStore | None:
        """An entry and the id of the one before it; None if it is gone; the error if damaged."""
        got = self.bucket.get(key)
        if got is None:
            return None
        try:
            text = got[0].decode("ascii")
            prev = json.loads(text).get("prev")
            return ReflogEntry.from_json(text), prev if isinstance(prev, str) else None
        except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError, RecursionError) as exc:
            why = "nested too deeply" if isinstance(exc, RecursionError) else exc
            return CorruptStore(self._where(key), f"bad reflog entry: {why}")

    def reflog_names(self) -> list[str]:
        names = {m.key[len("logs/") : m.key.rindex("/")] for m in self.bucket.list("logs/")}
        return sorted(found for n in names if (found := listed_name(n)) is not None)

    # -- pins and config -----------------------------------------------------------------------
    def pins(self) -> set[bytes]:
        found = set()
        for meta in self.bucket.list("pins/"):
            try:
                found.add(cidlib.to_bytes(meta.key[len("pins/") :]))
            except ValueError:
                raise CorruptStore(self._where(meta.key), "pin object name is not a CID") from None
        return found

    def pin(self, cid: bytes) -> None:
        self.bucket.put(f"pins/{cidlib.to_str(cid)}", b"")

    def unpin(self, cid: bytes) -> bool:
        key = f"pins/{cidlib.to_str(cid)}"
        if self.bucket.head(key) is None:
            return False
        self.bucket.delete(key)
        return True

    def read_config(self) -> dict[str, Any] | None:
        got = self.bucket.get("config.json")
        if got is None:
            return None
        try:
            config = json.loads(got[0].decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise CorruptStore(self._where("config.json"), f"not valid JSON: {exc}") from None
        except RecursionError:
            raise CorruptStore(self._where("config.json"), "not valid JSON: nested too deeply") from None
        if not isinstance(config, dict):
            raise CorruptStore(self._where("config.json"), "not a JSON object")
        return config

    def init_config(self, config: dict[str, Any]) -> dict[str, Any]:
        data = (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()
        if self.bucket.put("config.json", data, create=True) is not None:
            return config  # ours: no read back
        return self.read_config() or config  # another process's came first: that one holds

    def update_config(self, old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
        got = self.bucket.get("config.json")
        if got is not None and json.loads(got[0].decode("utf-8")) == old:
            data = (json.dumps(new, indent=2, sort_keys=True) + "\n").encode()
            self.bucket.put("config.json", data, match=got[1])  # If-Match: a racing update wins alone
        return self.read_config() or {}

    # -- the save/GC lock: leases --------------------------------------------------------------
    def lock(self, *, exclusive: bool) -> contextlib.AbstractContextManager[None]:
        return self._hold(exclusive)

    @contextlib.contextmanager
    def _hold(self, exclusive: bool) -> Iterator[None]:
        lease = self._take_gc_lock() if exclusive else self._join_saves()
        mine = self._local.__dict__.setdefault("leases", [])
        mine.append(lease)
        try:
            yield
        finally:  # possibly in another thread (a lock held across a DCP save): remove, not pop
            mine.remove(lease)
            if exclusive:
                with self._mutex:
                    self._gc_leases.remove(lease)
                lease.release()
            else:
                self._leave_saves()

    def _join_saves(self) -> _Lease:
        """Shared: every holder in this process shares one registration, so nested and overlapping
        holders never wait for a GC that is waiting for them (as flocks of one process do not)."""
        with self._joining:  # one registration at a time (it may wait for a GC)
            with self._mutex:
                if self._shared is not None and not self._shared.lost:
                    self._shared_users += 1
                    return self._shared
            lease = self._register_save()  # without _mutex: a GC in this process can finish
            with self._mutex:
                self._shared = lease
                self._shared_users += 1
                return lease

    def _leave_saves(self) -> None:
        with self._mutex:
            self._shared_users -= 1
            lease = self._shared if self._shared_users == 0 else None
            if lease is not None:
                self._shared = None
        if lease is not None:
            lease.release()

    def check_lease(self) -> None:
        """Renew the leases this thread holds (or, holding none, every lease of this store) if
        they were not renewed lately; :class:`RepositoryError` if one was lost."""
        leases = list(getattr(self._local, "leases", []))
        if not leases:
            with self._mutex:
                leases = [*self._gc_leases, *([self._shared] if self._shared else [])]
        for lease in leases:
            if not lease.beat(unless_newer_than=lease.interval):
                raise RepositoryError(
                    f"lost the repository lease {self._where(lease.key)}: another process judged "
                    f"this one dead (no heartbeat for {self.lease_timeout:g} s) and may have run "
                    "GC; nothing was changed, retry"
                )

    # -- one writer per run --------------------------------------------------------------------
    def lease(self, name: str, *, takeover: bool = False) -> Lease:
        """A heartbeat lease object ``locks/runs/<name>.lease``; one not rewritten for
        ``lease_timeout`` seconds is stale (its holder died) and is removed; a takeover rewrites
        it with If-Match, so the old holder's next heartbeat fails."""
        key = _run_lease_key(check_ref_name(name))
        body = _holder_body()
        while True:
            etag, holder = self._claim(key, body())
            if etag is not None:
                break
            if holder is None:
                continue  # lost a race for a free lease: look again
            if not takeover:
                raise LeaseHeld(name, describe_holder(holder[0]))
            etag = self.bucket.put(key, body(), match=holder[1].etag)
            if etag is not None:
                break
        return _RunLease(_Lease(self.bucket, key, etag, body, self.lease_timeout / 4))

    def _claim(self, key: str, body: bytes) -> tuple[str | None, tuple[bytes, Meta] | None]:
        """One try to hold the lock object ``key``: created if absent, else taken with ``If-Match``
        on the state read if that is released or stale (its holder died). Returns (the ETag, None)
        when held; (None, the live holder's body and meta) when another holds it; (None, None)
        when a race was lost (try again)."""
        etag = self.bucket.put(key, body, create=True)
        if etag is not None:
            return etag, None
        found = self.bucket.get_meta(key)
        if found is None:
            return None, None  # removed meanwhile (by cas_ckpt 0.2, which deletes to release)
        state, meta = found
        if _is_released(state) or meta.age > self.lease_timeout:
            return self.bucket.put(key, body, match=meta.etag), None
        return None, found

    @contextlib.contextmanager
    def try_exclusive(self, name: str) -> Iterator[bool]:
        """A heartbeat lease object ``locks/<name>``, created only if absent; one not rewritten
        for ``lease_timeout`` seconds belongs to a dead holder and is removed first."""
        key = f"locks/{check_task_name(name)}"
        for _ in range(2):
            etag, holder = self._claim(key, self._body())
            if etag is not None or holder is not None:
                break
        if etag is None:
            yield False
            return
        lease = self._lease(key, etag)
        try:
            yield True
        finally:
            lease.release()

    def _body(self) -> bytes:
        self._beats += 1
        holder = {"host": socket.gethostname(), "pid": os.getpid(), "time": time.time(), "beat": self._beats}
        return json.dumps(holder).encode()

    def _lease(self, key: str, etag: str, *, own_key: bool = False) -> _Lease:
        return _Lease(self.bucket, key, etag, self._body, self.lease_timeout / 4, own_key=own_key)

    def _waiter(self, what: str) -> Callable[[], None]:
        """Sleep a little between polls; RepositoryError once ``lock_timeout`` has passed."""
        deadline = None if self.lock_timeout is None else time.monotonic() + self.lock_timeout
        attempts = itertools.count()

        def wait() -> None:
            if deadline is not None and time.monotonic() > deadline:
                raise RepositoryError(f"timed out after {self.lock_timeout:g} s waiting for {what}")
            time.sleep(min(self.poll, backoff(next(attempts))))

        return wait

    def _register_save(self) -> _Lease:
        """Shared: register under locks/saves/, unless a live GC holds locks/gc (then wait)."""
        key = f"locks/saves/{uuid.uuid4().hex}"
        wait = self._waiter(f"GC to finish ({self._where('locks/gc')})")
        while True:
            etag = self.bucket.put(key, self._body(), create=True)
            if etag is None:
                raise RepositoryError(f"could not register the save at {self._where(key)}")
            if not self._gc_running():  # GC writes its lock then lists saves: one of us sees the other
                return self._lease(key, etag, own_key=True)
            self.bucket.delete(key)  # a GC runs: let it finish first (a key only we write)
            key = f"locks/saves/{uuid.uuid4().hex}"
            while self._gc_running():
                wait()

    def _gc_running(self) -> bool:
        """True if a live GC holds locks/gc (not released, and not stale: its holder alive)."""
        found = self.bucket.get_meta("locks/gc")
        if found is None:
            return False
        state, meta = found
        return not _is_released(state) and meta.age <= self.lease_timeout

    def _take_gc_lock(self) -> _Lease:
        """Exclusive: hold locks/gc, then wait until no live save is registered."""
        wait = self._waiter(f"another GC ({self._where('locks/gc')})")
        while True:
            etag, holder = self._claim("locks/gc", self._body())
            if etag is not None:
                break
            if holder is not None:
                wait()
        lease = self._lease("locks/gc", etag)
        try:
            self._await_saves(lease)
        except BaseException:
            lease.release()
            raise
        with self._mutex:
            self._gc_leases.append(lease)
        return lease

    def _await_saves(self, lease: _Lease) -> None:
        wait = self._waiter("saves in progress to finish")
        while True:
            live = []
            for meta in self.bucket.list("locks/saves/"):
                if meta.age <= self.lease_timeout:
                    live.append(meta)
                elif self.bucket.put(meta.key, _released(), match=meta.etag) is not None:
                    # A dead save's registration, released first so that its holder, were it
                    # alive, finds its next heartbeat refused; then no one writes it again.
                    self.bucket.delete(meta.key)
            if not live:
                return
            if lease.lost:
                raise RepositoryError("lost the GC lease while waiting for saves")
            wait()


class _RunLease(Lease):
    """A run's lease: held while its heartbeat object is still this holder's."""

    def __init__(self, lease: _Lease) -> None:
        self._lease: _Lease | None = lease

    def held(self) -> bool:
        lease = self._lease
        if lease is None:
            return False
        try:  # a real rewrite, however recent the last: a takeover may have come since
            return lease.beat()
        except RepositoryError:
            return not lease.lost  # S3 unreachable now: the heartbeat thread keeps trying

    def release(self) -> None:
        lease, self._lease = self._lease, None
        if lease is not None:
            lease.release()


def _holder_body() -> Callable[[], bytes]:
    """The lease's body: who holds it and since when, and a count that changes every beat."""
    since, beats = time.time(), itertools.count()
    host, pid = socket.gethostname(), os.getpid()
    return lambda: json.dumps({"host": host, "pid": pid, "time": since, "beat": next(beats)}).encode()


def _run_lease_key(name: str) -> str:
    quoted = quote(name, safe="")
    if len(quoted) > MAX_KEY // 2:  # with the prefix, S3 keys are at most 1024 bytes
        quoted = hashlib.sha256(name.encode()).hexdigest()
    return f"locks/runs/{quoted}.lease"


def _entry_id(key: str) -> str:
    return key.rsplit("/", 1)[1][: -len(".json")]
