"""Blocks in S3 or any S3-compatible object store: the local pack format, one object per pack.

A writer spools blocks into a temp pack on local disk (exactly the local format, see
``docs/format.md``), seals it (index trailer, name = sha256 of the trailer) and uploads it as
``<prefix>packs/<id>.pack``, created only if absent (``If-None-Match: *`` on the PUT or on
CompleteMultipartUpload; an existing object of that name is an identical pack), in parallel parts.
Packs are never overwritten; GC removes or rewrites them (new pack first, then the old one deleted).
``refresh`` lists ``packs/`` and reads each new pack's index with one suffix-ranged GET. A block is
one ranged GET; blocks that lie back to back (an array's chunks) are fetched as one GET. An optional
``cache_dir`` keeps fetched blocks in sparse local copies of their packs, so repeated loads read
locally (blocks from it are hash-checked on read like any other, and fetched again on a mismatch).
Requests, retries and errors: :mod:`cas_ckpt.blocks.s3_bucket`. See ``docs/scale-out.md``.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import os
import shutil
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from pathlib import Path

from cas_ckpt import _fs
from cas_ckpt import cid as cidlib
from cas_ckpt.blocks.base import BlockStore, BlockWriter
from cas_ckpt.blocks.local import (
    FOOTER,
    PACK_MAGIC,
    Location,
    _PackWriter,
    encode_trailer,
    parse_trailer,
    plan_sweep,
    trailer_length,
)
from cas_ckpt.blocks.s3_bucket import PART_SIZE, Meta, S3Bucket
from cas_ckpt.errors import BlockNotFound, CorruptBlock, CorruptStore, RepositoryError

__all__ = ["S3Bucket", "S3Store"]

PACK_SIZE = 64 * 1024 * 1024  # a full pack uploads while the next one is written
READ_SIZE = 16 * 1024 * 1024  # the most one ranged GET of neighbouring blocks fetches
INDEX_READ = 64 * 1024  # first guess at a pack's trailer size (one suffix GET usually suffices)
DEFAULT_GRACE = 3600.0  # GC never removes a pack younger than this on S3


class _PackCache:
    """Blocks fetched from S3, kept in sparse local copies of their packs: ``<root>/<pack id>.pack``.

    ``<pack>.have`` lists the offsets held, one per line, appended after the bytes are written.
    Packs are named by their content, so one cache may serve several repositories and processes.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        _fs.makedirs(self.root)
        self._have: dict[str, set[int]] = {}
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()

    def _offsets(self, pack: str) -> set[int]:
        have = self._have.get(pack)
        if have is None:
            try:
                text = (self.root / f"{pack}.have").read_text("ascii")
            except (FileNotFoundError, UnicodeDecodeError):
                text = ""
            have = self._have[pack] = {int(x) for x in text.split() if x.isdigit()}
        return have

    def _fd(self, pack: str) -> int:
        fd = self._fds.get(pack)
        if fd is None:
            fd = self._fds[pack] = os.open(self.root / pack, os.O_RDWR | os.O_CREAT, 0o644)
        return fd

    def read(self, loc: Location) -> bytes | None:
        with self._lock:
            if loc.offset not in self._offsets(loc.pack):
                return None
            fd = self._fd(loc.pack)
        data = os.pread(fd, loc.length, loc.offset)
        return data if len(data) == loc.length else None

    def read_into(self, loc: Location, out: memoryview) -> bool:
        with self._lock:
            if loc.offset not in self._offsets(loc.pack):
                return False
            fd = self._fd(loc.pack)
        return _fs.pread_into(fd, out, loc.offset) == loc.length

    def write(self, pack: str, offset: int, data: memoryview, blocks: list[int]) -> None:
        """Keep ``data`` (from ``offset`` in ``pack``), holding the blocks starting at ``blocks``."""
        try:
            with self._lock:
                fd = self._fd(pack)
            view = data.cast("B") if data.format != "B" else data
            while view.nbytes:
                n = os.pwrite(fd, view, offset)
                view, offset = view[n:], offset + n
            with open(self.root / f"{pack}.have", "a", encoding="ascii") as f:
                f.write("".join(f"{o}\n" for o in blocks))
        except OSError:
            return  # the cache is only a shortcut: a full disk must not fail a load
        with self._lock:
            self._offsets(pack).update(blocks)

    def forget(self, loc: Location) -> bool:
        """Stop trusting one block (its copy failed its hash); True if it was held."""
        with self._lock:
            have = self._offsets(loc.pack)
            if loc.offset not in have:
                return False
            have.discard(loc.offset)
            return True

    def drop(self, pack: str) -> None:
        """Forget a pack that left the store."""
        with self._lock:
            self._have.pop(pack, None)
            fd = self._fds.pop(pack, None)
            if fd is not None:
                os.close(fd)
            for name in (pack, f"{pack}.have"):
                with contextlib.suppress(FileNotFoundError):
                    (self.root / name).unlink()

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


class _S3PackWriter(_PackWriter):
    """Spools blocks into temp packs (the local format) and uploads each pack once it is sealed.

    A pack that fills up uploads in the background while the next one is written; ``commit``
    waits for every upload and only then makes the blocks visible to this store.
    """

    def __init__(self, store: S3Store) -> None:
        super().__init__(store)  # type: ignore[arg-type]  # uses tmp_dir, pack_size and _has only
        self._s3 = store
        self._uploads: list[Future[bool]] = []
        self._sealed: list[tuple[str, list[tuple[bytes, int, int]], int]] = []

    def _publish(self) -> None:
        assert self._fd is not None and self._tmp is not None
        trailer = encode_trailer(self._entries)
        self._buffer += trailer
        self._flush()
        os.close(self._fd)
        self._fd = None
        path, self._tmp = self._tmp, None
        name = f"{hashlib.sha256(trailer).hexdigest()}.pack"  # as on disk: an identical pack
        self._sealed.append((name, self._entries, self._offset + len(trailer)))
        self._uploads.append(self._s3._uploader.submit(self._s3._upload, path, name))
        self.published.append(name)
        self._entries = []

    def commit(self) -> None:
        try:
            super().commit()
        except BaseException:
            self._wait()
            raise
        error = self._wait()
        if error is not None:
            raise error
        self._s3._add_packs(self._sealed)

    def abort(self) -> None:
        super().abort()
        self._wait()  # packs already uploaded stay, unreferenced, for GC (as rolled packs on disk)

    def _wait(self) -> BaseException | None:
        first = None
        for future in self._uploads:
            try:
                future.result()
            except BaseException as exc:  # reported after every upload has ended
                first = first or exc
        self._uploads = []
        return first


def _runs(
    items: list[int], locs: list[Location], limit: int
) -> Iterator[list[int]]:
    """Group consecutive items whose blocks lie back to back in one pack (at most ``limit`` bytes)."""
    run: list[int] = []
    for i in items:
        if run:
            last = locs[run[-1]]
            start = locs[run[0]].offset
            loc = locs[i]
            if (
                i == run[-1] + 1 and loc.pack == last.pack and loc.offset == last.offset + last.length
                and loc.offset + loc.length - start <= limit
            ):
                run.append(i)
                continue
            yield run
        run = [i]
    if run:
        yield run


class S3Store(BlockStore):
    """Packed blocks in an S3 bucket: ``<prefix>packs/<id>.pack`` objects in the local pack format.

    ``bucket`` is an :class:`S3Bucket` or an ``s3://bucket/prefix`` URL. ``cache_dir`` keeps fetched
    blocks on local disk. GC never removes a pack younger than ``min_grace`` seconds, whatever grace
    it is given. ``lease_check`` (set by ``cas_ckpt.open``) is called before anything is deleted, so a
    GC whose lock was taken over stops.
    """

    def __init__(
        self,
        bucket: S3Bucket | str,
        *,
        verify: bool = True,
        read_only: bool = False,
        pack_size: int = PACK_SIZE,
        part_size: int = PART_SIZE,
        read_size: int = READ_SIZE,
        cache_dir: str | os.PathLike[str] | None = None,
        min_grace: float = DEFAULT_GRACE,
    ) -> None:
        super().__init__(verify=verify, read_only=read_only)
        self.bucket = bucket if isinstance(bucket, S3Bucket) else S3Bucket(bucket)
        if not read_only:
            self.bucket.check_conditional_writes()
        self.pack_size = pack_size
        self.part_size = part_size
        self.read_size = read_size
        self.min_grace = min_grace
        self.lease_check: Callable[[], None] | None = None
        self.cache = _PackCache(cache_dir) if cache_dir is not None else None
        self.tmp_dir = Path(tempfile.gettempdir()) / f"cas_ckpt-s3-{uuid.uuid4().hex}"  # temp packs
        self._uploader_pool: ThreadPoolExecutor | None = None
        self._lock = threading.RLock()
        self._refresh_lock = threading.Lock()
        self._index: dict[bytes, Location] = {}
        self._packs: dict[str, list[tuple[bytes, int, int]]] = {}
        self._meta: dict[str, Meta] = {}
        self.corrupt_packs: dict[str, str] = {}
        self.refresh()

    # -- index ---------------------------------------------------------------------------------
    def refresh(self) -> None:
        with self._refresh_lock:
            with self._lock:
                known = set(self._packs) | set(self.corrupt_packs)  # a pack added later stays
            listing = {m.key.rsplit("/", 1)[1]: m for m in self.bucket.list("packs/")}
            listing = {name: m for name, m in listing.items() if name.endswith(".pack")}
            with self._lock:
                for gone in known - set(listing):
                    self._drop_pack(gone)
                    self.corrupt_packs.pop(gone, None)
                self._meta.update(listing)
                new = sorted(set(listing) - set(self._packs) - set(self.corrupt_packs))
            sizes = [listing[name].size for name in new]
            indexes = self.bucket.pool.map(self._read_index, new, sizes)
            for name, result in zip(new, indexes, strict=True):
                if isinstance(result, str):
                    self.corrupt_packs[name] = result
                elif result is not None:
                    self._add_pack(name, result)

    def _read_index(self, name: str, size: int) -> list[tuple[bytes, int, int]] | str | None:
        """A pack's entries, read from its end; a reason string if damaged; None if it is gone."""
        key = f"packs/{name}"
        where = self.bucket.where(key)
        try:
            if size < len(PACK_MAGIC) + FOOTER.size:
                raise CorruptStore(where, "not a cas_ckpt pack (too short)")
            tail = self.bucket.get_range(key, size - min(size, INDEX_READ), min(size, INDEX_READ))
            if tail is None:
                return None
            need = trailer_length(tail[-FOOTER.size :], size, where)
            if need > len(tail):
                tail = self.bucket.get_range(key, size - need, need)
                if tail is None:
                    return None
            return parse_trailer(tail, size, where)
        except CorruptStore as exc:
            return str(exc)

    def _add_pack(self, name: str, entries: list[tuple[bytes, int, int]]) -> None:
        with self._lock:
            self._packs[name] = list(entries)
            for cid, offset, length in entries:
                self._index.setdefault(cid, Location(name, offset, length))

    def _add_packs(self, sealed: list[tuple[str, list[tuple[bytes, int, int]], int]]) -> None:
        with self._lock:
            for name, entries, size in sealed:
                self._meta.setdefault(name, Meta(f"packs/{name}", "", size, 0.0))
                self._add_pack(name, entries)

    def _drop_pack(self, name: str) -> None:
        with self._lock:
            entries = self._packs.pop(name, [])
            self._meta.pop(name, None)
            moved = {cid for cid, _, _ in entries if self._index.get(cid, Location("", 0, 0)).pack == name}
            for cid in moved:
                del self._index[cid]
            for other, others in self._packs.items():  # another copy of a block stays readable
                for cid, offset, length in others:
                    if cid in moved and cid not in self._index:
                        self._index[cid] = Location(other, offset, length)
        if self.cache is not None:
            self.cache.drop(name)

    def _locate(self, cid: bytes) -> Location | None:
        loc = self._index.get(cid)
        if loc is None:
            self.refresh()  # another process may have published it
            loc = self._index.get(cid)
        return loc

    def packs(self) -> dict[str, list[tuple[bytes, int, int]]]:
        """Each pack's entries (binary CID, offset, length); for GC and fsck."""
        self.refresh()
        with self._lock:
            return {name: list(entries) for name, entries in self._packs.items()}

    def _missing_hint(self) -> str:
        if not self.corrupt_packs:
            return ""
        names = ", ".join(sorted(self.corrupt_packs)[:3])
        return f" (the repository has {len(self.corrupt_packs)} damaged pack(s) that may hold it: {names})"

    # -- reads ---------------------------------------------------------------------------------
    def _read(self, cid: bytes) -> bytes | None:
        for _ in range(2):
            loc = self._locate(cid)
            if loc is None:
                return None
            data = self.cache.read(loc) if self.cache is not None else None
            if data is not None:
                return data
            with self._truncated(cid, loc):
                data = self.bucket.get_range(f"packs/{loc.pack}", loc.offset, loc.length)
            if data is None:
                self.refresh()  # the pack was compacted away under us
                continue
            self._keep(loc.pack, loc.offset, memoryview(data), [loc.offset])
            return data
        return None

    def _read_into(self, cid: bytes, out: memoryview) -> bool:
        for _ in range(2):
            loc = self._locate(cid)
            if loc is None:
                return False
            if loc.length != out.nbytes:
                raise CorruptBlock(
                    cidlib.to_str(cid), f"stored size {loc.length} != expected {out.nbytes}"
                )
            if self.cache is not None and self.cache.read_into(loc, out):
                return True
            with self._truncated(cid, loc):
                found = self.bucket.read_into(f"packs/{loc.pack}", loc.offset, out)
            if not found:
                self.refresh()
                continue
            self._keep(loc.pack, loc.offset, out, [loc.offset])
            return True
        return False

    @staticmethod
    @contextlib.contextmanager
    def _truncated(cid: bytes, loc: Location) -> Iterator[None]:
        try:
            yield
        except CorruptStore:  # the object is shorter than its own index says
            raise CorruptBlock(cidlib.to_str(cid), f"pack {loc.pack} is truncated") from None

    def _keep(self, pack: str, offset: int, data: memoryview, blocks: list[int]) -> None:
        if self.cache is not None:
            self.cache.write(pack, offset, data, blocks)

    def _evict(self, cid: bytes) -> bool:
        """Drop a cached copy that failed its hash, so the next read fetches it again."""
        loc = self._index.get(cid)
        return self.cache is not None and loc is not None and self.cache.forget(loc)

    def get(self, cid: cidlib.CIDLike, *, verify: bool | None = None) -> bytes:
        try:
            return super().get(cid, verify=verify)
        except CorruptBlock:
            if not self._evict(cidlib.to_bytes(cid)):
                raise
            return super().get(cid, verify=verify)

    def get_into(self, cid: bytes, out: memoryview, *, verify: bool | None = None) -> None:
        try:
            super().get_into(cid, out, verify=verify)
        except CorruptBlock:
            if not self._evict(cid):
                raise
            super().get_into(cid, out, verify=verify)

    def get_many_into(
        self, cids: list[bytes], sizes: list[int], out: memoryview, pool: Executor, *,
        verify: bool | None = None,
    ) -> None:
        """Fetch blocks that lie back to back in a pack with one ranged GET each run, in parallel."""
        offsets = [0, *itertools.accumulate(sizes)]
        locs: list[Location] = []
        for cid, size in zip(cids, sizes, strict=True):
            loc = self._locate(cid)
            if loc is None:
                raise BlockNotFound(cidlib.to_str(cid), self._missing_hint())
            if loc.length != size:
                raise CorruptBlock(cidlib.to_str(cid), f"stored size {loc.length} != expected {size}")
            locs.append(loc)
        cache = self.cache
        todo = [
            i for i in range(len(cids))
            if cache is None or not cache.read_into(locs[i], out[offsets[i] : offsets[i + 1]])
        ]
        runs = list(_runs(todo, locs, self.read_size))
        fetched = self.bucket.pool.map(lambda run: self._fetch_run(run, locs, offsets, out), runs)
        for run, ok in zip(runs, list(fetched), strict=True):
            if not ok:  # the pack went away (GC compacted it): find each block anew
                for i in run:
                    self.get_into(cids[i], out[offsets[i] : offsets[i + 1]], verify=False)
        if not (self.verify if verify is None else verify):
            return

        def check(i: int) -> None:
            view = out[offsets[i] : offsets[i + 1]]
            if not cidlib.matches(cids[i], view):
                if not (cache is not None and cache.forget(locs[i])):
                    raise CorruptBlock(cidlib.to_str(cids[i]))
                self.get_into(cids[i], view, verify=True)

        for future in [pool.submit(check, i) for i in range(len(cids))]:
            future.result()

    def _fetch_run(self, run: list[int], locs: list[Location], offsets: list[int], out: memoryview) -> bool:
        first = locs[run[0]]
        view = out[offsets[run[0]] : offsets[run[-1] + 1]]
        try:
            if not self.bucket.read_into(f"packs/{first.pack}", first.offset, view):
                return False
        except CorruptStore:
            return False  # read block by block: the damaged one is named
        self._keep(first.pack, first.offset, view, [locs[i].offset for i in run])
        return True

    def _has(self, cid: bytes) -> bool:
        return cid in self._index

    def _size(self, cid: bytes) -> int:
        loc = self._locate(cid)
        if loc is None:
            raise BlockNotFound(cidlib.to_str(cid), self._missing_hint())
        return loc.length

    def keys(self) -> Iterator[bytes]:
        self.refresh()
        with self._lock:
            return iter(list(self._index))

    # -- writes --------------------------------------------------------------------------------
    def writer(self) -> BlockWriter:
        return self._writer()

    def _writer(self) -> _S3PackWriter:
        self._check_writable()
        os.makedirs(self.tmp_dir, mode=0o700, exist_ok=True)  # private, like mkdtemp
        return _S3PackWriter(self)

    @property
    def _uploader(self) -> ThreadPoolExecutor:
        """Whole-pack uploads (their parts go to the bucket's pool, so these never starve it)."""
        with self._lock:
            if self._uploader_pool is None:
                self._uploader_pool = ThreadPoolExecutor(2, thread_name_prefix="cas_ckpt-s3-pack")
            return self._uploader_pool

    def _upload(self, path: Path, name: str) -> bool:
        """Create ``packs/<name>`` from a sealed temp pack, only if absent (an existing one is
        identical: same index, so the same blocks at the same offsets)."""
        try:
            return self.bucket.put_file(f"packs/{name}", path, part_size=self.part_size)
        finally:
            path.unlink(missing_ok=True)

    def delete(self, cids: set[bytes], *, min_age: float = 0.0) -> tuple[int, int]:
        """Remove blocks from packs older than ``max(min_age, min_grace)`` seconds (server clock).

        As on disk: a pack with nothing live is deleted; packs losing some blocks, and small ones,
        are rewritten, and the new pack is created before the old one is deleted.
        """
        self._check_writable()
        self.refresh()
        with self._lock:
            packs = {
                name: (list(entries), self._meta[name].size, self._meta[name].age)
                for name, entries in self._packs.items() if name in self._meta
            }
        doomed, removed = plan_sweep(packs, cids, max(min_age, self.min_grace))
        before = sum(packs[name][1] for name in doomed)
        written = self._repack(doomed)
        with self._lock:
            after = sum(self._meta[name].size for name in written if name in self._meta)
        return removed, before - after

    def _repack(self, packs: dict[str, list[tuple[bytes, int, int]]]) -> list[str]:
        """Copy these entries into new packs, then delete the old packs; return the new names."""
        if not packs:
            return []
        writer = self._writer()
        try:
            for name, live in packs.items():
                locs = [Location(name, offset, length) for _, offset, length in live]
                for run in _runs(list(range(len(live))), locs, self.read_size):
                    first, last = locs[run[0]], locs[run[-1]]
                    data = self.bucket.get_range(f"packs/{name}", first.offset,
                                                 last.offset + last.length - first.offset)
                    if data is None:
                        raise RepositoryError(f"pack {name} vanished while GC was rewriting it")
                    with writer._lock:
                        for i in run:
                            cid, offset, length = live[i]
                            if cid not in writer._pending:
                                writer._pending.add(cid)
                                start = offset - first.offset
                                writer._append(cid, memoryview(data)[start : start + length])
            writer.commit()
        except BaseException:
            writer.abort()
            raise
        old = [name for name in packs if name not in writer.published]
        if self.lease_check is not None:
            self.lease_check()  # a GC whose lock was taken over must not delete anything
        self.bucket.delete_many([f"packs/{name}" for name in old])
        for name in old:
            self._drop_pack(name)
        return writer.published

    def clean_temp(self) -> int:
        """Abort multipart uploads older than the grace period (left by writers that died)."""
        removed = 0
        for key, upload, age in self.bucket.uploads("packs/"):
            if age >= self.min_grace:
                self.bucket.abort_upload(key, upload)
                removed += 1
        return removed

    def close(self) -> None:
        with self._lock:
            pool, self._uploader_pool = self._uploader_pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        self.bucket.close()
        if self.cache is not None:
            self.cache.close()
        shutil.rmtree(self.tmp_dir, ignore_errors=True)
