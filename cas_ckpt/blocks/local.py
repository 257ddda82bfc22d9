"""The local-filesystem block store: blocks packed into few large files.

Creating a file costs far more than writing a megabyte, so blocks are appended to pack files (as git,
restic and Xet do) and a pack holds its own index in a trailer. A pack is written under ``tmp/``,
fsynced, linked into ``packs/`` (never replacing an existing file), and the directory fsynced; only
then are its blocks visible. The format is specified in ``docs/format.md``.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import mmap
import os
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import msgpack

from cas_ckpt import _fs
from cas_ckpt import cid as cidlib
from cas_ckpt.blocks.base import BlockStore, BlockWriter
from cas_ckpt.errors import BlockNotFound, CorruptBlock, CorruptStore

PACK_MAGIC = b"CASPACK1"
FOOTER_MAGIC = b"CASPKEND"
FOOTER = struct.Struct("<Q32s8s")  # trailer length, sha256(trailer), magic
DEFAULT_PACK_SIZE = 256 * 1024 * 1024
SMALL_PACK = 32 * 1024 * 1024  # GC merges packs smaller than this
WRITEBACK_STEP = 32 * 1024 * 1024  # start disk writeback every this many bytes of a pack
SMALL_BLOCK = 256 * 1024  # blocks below this are buffered before the write syscall


class Location(NamedTuple):
    pack: str
    offset: int
    length: int


def encode_trailer(entries: list[tuple[bytes, int, int]]) -> bytes:
    trailer = msgpack.packb(entries, use_bin_type=True)
    return trailer + FOOTER.pack(len(trailer), hashlib.sha256(trailer).digest(), FOOTER_MAGIC)


def read_trailer(fd: int, path: Path) -> list[tuple[bytes, int, int]]:
    """Read and check a pack's index; :class:`CorruptStore` naming the file if damaged."""
    size = os.fstat(fd).st_size
    if size < len(PACK_MAGIC) + FOOTER.size or os.pread(fd, 8, 0) != PACK_MAGIC:
        raise CorruptStore(path, "not a cas_ckpt pack (bad header or too short)")
    need = trailer_length(os.pread(fd, FOOTER.size, size - FOOTER.size), size, path)
    return parse_trailer(os.pread(fd, need, size - need), size, path)


def trailer_length(footer: bytes, size: int, path: object) -> int:
    """Bytes the index and footer take at the end of a pack of ``size`` bytes, from its last 48."""
    length, _, magic = FOOTER.unpack(footer)
    if magic != FOOTER_MAGIC or size - FOOTER.size - length < len(PACK_MAGIC):
        raise CorruptStore(path, "bad pack footer")
    return length + FOOTER.size


def parse_trailer(tail: bytes, size: int, path: object) -> list[tuple[bytes, int, int]]:
    """Check and decode the index of a pack of ``size`` bytes from its last bytes (``tail``).

    ``tail`` holds at least the index and footer; :class:`CorruptStore` naming ``path`` if damaged.
    """
    need = trailer_length(tail[-FOOTER.size :], size, path)
    if len(tail) < need:
        raise CorruptStore(path, "pack is truncated")
    _, digest, _ = FOOTER.unpack(tail[-FOOTER.size :])
    start = size - need
    trailer = tail[len(tail) - need : len(tail) - FOOTER.size]
    if hashlib.sha256(trailer).digest() != digest:
        raise CorruptStore(path, "pack index checksum mismatch")
    try:
        entries = msgpack.unpackb(trailer, raw=False, use_list=False)
        result = [_entry(e) for e in entries]
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise CorruptStore(path, f"unreadable pack index: {exc}") from None
    for _, offset, n in result:
        if offset < len(PACK_MAGIC) or n < 0 or offset + n > start:
            raise CorruptStore(path, "pack index points outside the pack")
    return result


def _entry(entry: object) -> tuple[bytes, int, int]:
    if not (isinstance(entry, tuple) and len(entry) == 3):
        raise ValueError("index entry is not a (cid, offset, length) triple")
    cid, offset, length = entry
    if not (isinstance(cid, bytes) and type(offset) is int and type(length) is int):
        raise ValueError("index entry has the wrong types")
    return cidlib.check_binary(cid), offset, length


def plan_sweep(
    packs: dict[str, tuple[list[tuple[bytes, int, int]], int, float]], cids: set[bytes], min_age: float
) -> tuple[dict[str, list[tuple[bytes, int, int]]], int]:
    """Which packs a sweep rewrites (pack -> its surviving entries), and how many blocks go.

    ``packs`` maps each pack to (entries, size in bytes, age in seconds). Packs younger than
    ``min_age`` are left alone. A pack losing blocks is rewritten with its survivors (or removed,
    when none survive); small packs (under ``SMALL_PACK``) are merged along when at least two packs
    would be written anyway.
    """
    doomed: dict[str, list[tuple[bytes, int, int]]] = {}
    small: dict[str, list[tuple[bytes, int, int]]] = {}
    removed = 0
    for name, (entries, size, age) in packs.items():
        if age < min_age:
            continue
        live = [e for e in entries if e[0] not in cids]
        if len(live) < len(entries):
            doomed[name] = live
            removed += len(entries) - len(live)
        elif size < SMALL_PACK:
            small[name] = live
    if len(small) + sum(1 for live in doomed.values() if live) >= 2:
        doomed.update(small)  # worth merging: fewer files for every later open and read
    return doomed, removed


class _PackWriter(BlockWriter):
    """Appends blocks to a temp pack; rolls to a new pack past the store's pack size."""

    def __init__(self, store: LocalStore) -> None:
        super().__init__(store)
        self._local = store
        self._fd: int | None = None
        self._tmp: Path | None = None
        self._entries: list[tuple[bytes, int, int]] = []
        self._offset = 0
        self._written_back = 0
        self._buffer = bytearray()
        self.published: list[str] = []

    def _open(self) -> int:
        self._tmp = _fs.temp_name(self._local.tmp_dir, ".pack.tmp")
        fd = os.open(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        # Held until the pack is published: GC removes only temp packs whose writer is gone.
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self._fd = fd
        self._buffer[:] = PACK_MAGIC
        self._offset = len(PACK_MAGIC)
        self._written_back = 0
        self._entries = []
        return fd

    def _flush(self) -> None:
        if self._buffer and self._fd is not None:
            with _fs.naming(self._tmp):
                _fs.write_all(self._fd, self._buffer)
            self._buffer.clear()

    def _append(self, cid: bytes, data: bytes | memoryview) -> None:
        size = memoryview(data).nbytes
        if self._fd is not None and self._offset + size > self._local.pack_size and self._entries:
            self._publish()
        fd = self._fd if self._fd is not None else self._open()
        if size < SMALL_BLOCK:
            self._buffer += data
            if len(self._buffer) >= SMALL_BLOCK:
                self._flush()
        else:
            self._flush()
            with _fs.naming(self._tmp):
                _fs.write_all(fd, data)
        self._entries.append((cid, self._offset, size))
        self._offset += size
        if self._offset - self._written_back >= WRITEBACK_STEP:
            _fs.start_writeback(fd, self._written_back, self._offset - self._written_back)
            self._written_back = self._offset

    def _publish(self) -> None:
        """Seal the current pack: trailer, fsync, link into packs/, fsync dir, index it."""
        assert self._fd is not None and self._tmp is not None
        trailer = encode_trailer(self._entries)
        self._buffer += trailer
        self._flush()
        with _fs.naming(self._tmp):
            os.fsync(self._fd)
        os.close(self._fd)
        self._fd = None
        name = f"{hashlib.sha256(trailer).hexdigest()}.pack"
        # An existing file of that name is an identical pack (same blocks, same offsets).
        with contextlib.suppress(FileExistsError):
            os.link(self._tmp, self._local.pack_dir / name)
        self._tmp.unlink()
        self._tmp = None
        _fs.fsync_dir(self._local.pack_dir)
        self._local._add_pack(name, self._entries)
        self.published.append(name)
        self._entries = []

    def commit(self) -> None:
        with self._lock:
            try:
                if self._fd is not None:
                    self._publish()
            except BaseException:
                self._discard()  # a failed publish must not leave its temp pack behind
                raise
            finally:
                self.closed = True

    def abort(self) -> None:
        with self._lock:
            self._discard()
            self.closed = True

    def _discard(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._tmp is not None:
            self._tmp.unlink(missing_ok=True)
            self._tmp = None


class LocalStore(BlockStore):
    """Packed block storage in a directory (``packs/`` and ``tmp/`` below ``root``)."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        verify: bool = True,
        read_only: bool = False,
        pack_size: int = DEFAULT_PACK_SIZE,
    ) -> None:
        super().__init__(verify=verify, read_only=read_only)
        self.root = Path(root)
        self.pack_dir = self.root / "packs"
        self.tmp_dir = self.root / "tmp"
        self.pack_size = pack_size
        if not read_only:
            _fs.makedirs(_fs.refuse_links(self.root, self.pack_dir))
            _fs.makedirs(_fs.refuse_links(self.root, self.tmp_dir))
        self._lock = threading.RLock()
        self._index: dict[bytes, Location] = {}
        self._packs: dict[str, list[tuple[bytes, int, int]]] = {}
        self._fds: dict[str, int] = {}
        self._readers = 0  # reads in flight (see _reading)
        self._retired: list[int] = []  # descriptors of dropped packs, closed when no read is
        self._maps: dict[str, mmap.mmap] = {}
        self.corrupt_packs: dict[str, str] = {}
        self.refresh()

    # -- index ---------------------------------------------------------------------------------
    def refresh(self) -> None:
        with self._lock:
            try:
                listing = os.listdir(_fs.refuse_links(self.root, self.pack_dir))
                names = {n for n in listing if n.endswith(".pack")}
            except FileNotFoundError:
                names = set()
            for gone in set(self._packs) - names:
                self._drop_pack(gone)
            for name in sorted(names - set(self._packs) - set(self.corrupt_packs)):
                self._load_pack(name)

    def _load_pack(self, name: str) -> None:
        path = self.pack_dir / name
        try:
            fd = _fs.open_nofollow(path, os.O_RDONLY)
        except FileNotFoundError:
            return
        except CorruptStore as exc:  # a planted link: never read what it points at
            self.corrupt_packs[name] = str(exc)
            return
        try:
            entries = read_trailer(fd, path)
        except CorruptStore as exc:
            os.close(fd)
            self.corrupt_packs[name] = str(exc)
            return
        self._fds[name] = fd
        self._add_pack(name, entries)

    def _add_pack(self, name: str, entries: list[tuple[bytes, int, int]]) -> None:
        with self._lock:
            self._packs[name] = list(entries)
            for cid, offset, length in entries:
                self._index.setdefault(cid, Location(name, offset, length))

    def _drop_pack(self, name: str) -> None:
        entries = self._packs.pop(name, [])
        self._maps.pop(name, None)  # arrays still viewing it keep the mapping alive
        fd = self._fds.pop(name, None)
        if fd is not None:
            # Another thread may be reading through it right now: closing it could hand its
            # number to a new file under that read. Closed once no read is in flight.
            self._retired.append(fd)
            self._close_retired()
        for cid, _, _ in entries:
            loc = self._index.get(cid)
            if loc is not None and loc.pack == name:
                del self._index[cid]
                self._relocate(cid)

    def _relocate(self, cid: bytes) -> None:
        for name, entries in self._packs.items():
            for other, offset, length in entries:
                if other == cid:
                    self._index[cid] = Location(name, offset, length)
                    return

    def _fd(self, pack: str) -> int:
        fd = self._fds.get(pack)
        if fd is None:
            with self._lock:
                fd = self._fds.get(pack)
                if fd is None:
                    fd = self._fds[pack] = _fs.open_nofollow(self.pack_dir / pack, os.O_RDONLY)
        return fd

    def _locate(self, cid: bytes) -> Location | None:
        loc = self._index.get(cid)
        if loc is None:
            self.refresh()  # another process may have published it
            loc = self._index.get(cid)
        return loc

    def map_blocks(self, cids: list[bytes]) -> memoryview | None:
        with self._reading():
            return self._map_blocks(cids)

    def _map_blocks(self, cids: list[bytes]) -> memoryview | None:
        locations = [self._locate(c) for c in cids]
        first = locations[0] if locations else None
        if first is None:
            return None
        end = first.offset
        for loc in locations:
            if loc is None or loc.pack != first.pack or loc.offset != end:
                return None
            end += loc.length
        try:
            mapped = self._mmap(first.pack)
        except (FileNotFoundError, ValueError):
            return None
        return memoryview(mapped)[first.offset : end]

    def _mmap(self, pack: str) -> mmap.mmap:
        mapped = self._maps.get(pack)
        if mapped is None:
            with self._lock:
                mapped = self._maps.get(pack)
                if mapped is None:
                    mapped = self._maps[pack] = mmap.mmap(self._fd(pack), 0, access=mmap.ACCESS_READ)
        return mapped

    def _missing_hint(self) -> str:
        if not self.corrupt_packs:
            return ""
        names = ", ".join(sorted(self.corrupt_packs)[:3])
        return f" (the repository has {len(self.corrupt_packs)} damaged pack(s) that may hold it: {names})"

    def locate(self, cid: bytes) -> tuple[Path, int, int]:
        """Pack file, offset and length of a block (for mmap-style readers and fsck)."""
        loc = self._locate(cid)
        if loc is None:
            raise BlockNotFound(cidlib.to_str(cid), self._missing_hint())
        return self.pack_dir / loc.pack, loc.offset, loc.length

    # -- reads ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _reading(self) -> Iterator[None]:
        """Mark a read in flight: pack descriptors dropped meanwhile stay open until it ends."""
        with self._lock:
            self._readers += 1
        try:
            yield
        finally:
            with self._lock:
                self._readers -= 1
                self._close_retired()

    def _close_retired(self) -> None:
        if not self._readers:
            for fd in self._retired:
                os.close(fd)
            self._retired.clear()

    def _moved(self, cid: bytes, old: Location) -> Location | None:
        """Where a block is after its pack vanished under a read (GC repacked it); None if gone."""
        self.refresh()
        loc = self._index.get(cid)
        return None if loc == old else loc

    def _read(self, cid: bytes) -> bytes | None:
        with self._reading():
            loc = self._locate(cid)
            while loc is not None:
                try:
                    data = os.pread(self._fd(loc.pack), loc.length, loc.offset)
                except FileNotFoundError:
                    loc = self._moved(cid, loc)  # GC may repack it again and again: follow it
                    continue
                if len(data) != loc.length:
                    raise CorruptBlock(cidlib.to_str(cid), f"pack {loc.pack} is truncated")
                return data
            return None

    def _read_into(self, cid: bytes, out: memoryview) -> bool:
        with self._reading():
            loc = self._locate(cid)
            while loc is not None:
                if loc.length != out.nbytes:
                    raise CorruptBlock(
                        cidlib.to_str(cid), f"stored size {loc.length} != expected {out.nbytes}"
                    )
                try:
                    n = _fs.pread_into(self._fd(loc.pack), out, loc.offset)
                except FileNotFoundError:
                    loc = self._moved(cid, loc)
                    continue
                if n != loc.length:
                    raise CorruptBlock(cidlib.to_str(cid), f"pack {loc.pack} is truncated")
                return True
            return False

    def _has(self, cid: bytes) -> bool:
        return cid in self._index

    def _size(self, cid: bytes) -> int:
        return self.locate(cid)[2]

    def keys(self) -> Iterator[bytes]:
        self.refresh()
        with self._lock:
            return iter(list(self._index))

    def packs(self) -> dict[str, list[tuple[bytes, int, int]]]:
        """Each pack's entries (binary CID, offset, length); for GC and fsck."""
        self.refresh()
        with self._lock:
            return {name: list(entries) for name, entries in self._packs.items()}

    # -- writes --------------------------------------------------------------------------------
    def writer(self) -> BlockWriter:
        self._check_writable()
        return _PackWriter(self)

    def delete(self, cids: set[bytes], *, min_age: float = 0.0) -> tuple[int, int]:
        """Remove blocks; packs younger than ``min_age`` seconds are left alone.

        Packs left with no live block are unlinked. Packs with some, and small packs (under
        ``SMALL_PACK``), are merged: their surviving blocks are written into new packs, published
        durably, and only then are the old packs unlinked. Returns (blocks removed, bytes freed).
        """
        self._check_writable()
        now = time.time()
        packs = {}
        for name, entries in self.packs().items():
            try:
                stat = (self.pack_dir / name).stat()
            except FileNotFoundError:
                continue
            packs[name] = (entries, stat.st_size, now - stat.st_mtime)
        doomed, removed = plan_sweep(packs, cids, min_age)
        before = sum(self._pack_size(name) for name in doomed)
        after = self._repack(doomed)
        return removed, before - after

    def _pack_size(self, name: str) -> int:
        try:
            return (self.pack_dir / name).stat().st_size
        except FileNotFoundError:
            return 0

    def _repack(self, packs: dict[str, list[tuple[bytes, int, int]]]) -> int:
        """Write the given entries of these packs into new packs, then unlink the old ones.

        Returns the size of the packs written.
        """
        writer = _PackWriter(self)
        written: list[str] = []
        try:
            with self._lock:
                for name, live in packs.items():
                    fd = self._fd(name)
                    for cid, offset, length in live:
                        if cid not in writer._pending:
                            writer._pending.add(cid)
                            writer._append(cid, os.pread(fd, length, offset))
                if writer._fd is not None:
                    writer._publish()
                written = writer.published
                writer.closed = True
        except BaseException:
            writer.abort()
            raise
        for name in packs:
            if name in written:
                continue  # rewritten byte for byte (same blocks, same offsets): it is a new pack
            (self.pack_dir / name).unlink(missing_ok=True)
            with self._lock:
                self._drop_pack(name)
        if packs:
            _fs.fsync_dir(self.pack_dir)
        return sum(self._pack_size(name) for name in written)

    def clean_temp(self) -> int:
        """Remove temp files whose writer is gone (its lock is free); return how many."""
        removed = 0
        for path in self.tmp_dir.glob("*.pack.tmp"):
            try:
                fd = _fs.open_nofollow(path, os.O_RDONLY)
            except (FileNotFoundError, CorruptStore):  # gone, or a planted link: not ours
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a live writer holds it
            finally:
                os.close(fd)
            path.unlink(missing_ok=True)
            removed += 1
        return removed

    def close(self) -> None:
        with self._lock:
            for fd in [*self._fds.values(), *self._retired]:
                os.close(fd)
            self._fds.clear()
            self._retired.clear()
            self._maps.clear()  # mappings close when the last array viewing them goes
