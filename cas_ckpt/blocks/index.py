"""The block index in memory: every copy of every block, in sorted tables of fixed-width rows.

A repository may hold millions of blocks; a Python object per block cost ~370 bytes each (a
million blocks: 358 MiB and seconds to build). Here a block's copy is one row of two columns,
as restic's ``indexmap`` and git's multi-pack-index keep theirs:

* its **key**, 33 bytes: the CID's 32-byte digest, then one byte naming the CID's codec and hash
  (:data:`KINDS`; a digest-first key spreads rows evenly, so a short prefix finds a bucket);
* its **location**, 21 bytes (:data:`LOCATION`): pack id (``uint32``), offset (``uint64``),
  stored length (``uint32``), codec (``uint8``), raw length (``uint32``), little endian.

Rows are sorted by key (copies of one block adjacent), so one lookup is a bucket from the key's
first bytes and a ``bytes.find`` inside it, and many lookups are one ``numpy.searchsorted``. The
index files (:mod:`cas_ckpt.blocks.index_file`) hold the same two columns: opening one is a read
and a checksum, no parsing per row. A pack's own index comes decoded as arrays
(:class:`~cas_ckpt.blocks.pack.Columns`) and is sorted in by :func:`table_of_columns`, in
buffers given back to the system when freed (:func:`~cas_ckpt._memory.pages`): an open after
big saves holds what it holds after upkeep.

:class:`BlockIndex` keeps a large ``base`` table and a small ``delta`` one that new packs merge
into, folded into the base when it grows past an eighth of it (so adding a pack costs in
proportion to the delta, not to the repository). A pack that leaves the store is marked dead and
its rows skipped until the next fold drops them. Copies known to be damaged, and a copy reads
should try first, are the rare exceptions kept in small sets beside the tables.
"""

from __future__ import annotations

import array
import struct
from collections.abc import Collection, Iterable, Iterator, Sequence

import numpy as np

from cas_ckpt import cid as cidlib
from cas_ckpt._memory import pages
from cas_ckpt.blocks.pack import CID_HEADS, Columns, Entry, EntryFields, Location

DIGEST = cidlib.DIGEST_SIZE
KEY_SIZE = DIGEST + 1
LOCATION = struct.Struct("<IQIBI")  # pack id, offset, stored length, codec, raw length
LOCATION_DTYPE = np.dtype(
    [("pack", "<u4"), ("offset", "<u8"), ("length", "<u4"), ("codec", "u1"), ("size", "<u4")]
)
assert LOCATION_DTYPE.itemsize == LOCATION.size == 21
KEY_DTYPE = np.dtype(f"S{KEY_SIZE}")
MAX_LENGTH = 2**32 - 1  # a block's stored and raw lengths fit a uint32
# The byte after the digest in a key: which codec and hash the CID has (docs/format.md).
KINDS = {
    cidlib.prefix(cidlib.RAW, cidlib.SHA2_256): 1,
    cidlib.prefix(cidlib.MSGPACK, cidlib.SHA2_256): 2,
    cidlib.prefix(cidlib.RAW, cidlib.BLAKE3): 3,
    cidlib.prefix(cidlib.MSGPACK, cidlib.BLAKE3): 4,
}
_KIND_BYTE = {prefix: bytes([kind]) for prefix, kind in KINDS.items()}
_PREFIX_OF = {kind: prefix for prefix, kind in KINDS.items()}
_MERGE_MIN = 65536  # the delta folds into the base past max(this, an eighth of the base)
_RECENT = 4096  # lookups remembered (BlockIndex.copies)
_FIND_MANY = 65536  # keys looked up at once by Table.find_many


def key_of(cid: bytes) -> bytes:
    """The 33-byte key of a binary CID (KeyError for a CID cas_ckpt does not write)."""
    return cid[-DIGEST:] + _KIND_BYTE[cid[:-DIGEST]]


def cid_of(key: bytes) -> bytes:
    """The binary CID a key stands for."""
    return _PREFIX_OF[key[DIGEST]] + key[:DIGEST]


def keys_of(cids: Sequence[bytes]) -> np.ndarray:
    """The keys of many CIDs as an array (``S33``); CIDs of one kind (a load's chunks) without a
    Python call each."""
    joined = b"".join(cids)
    for width in (len(cids[0]),) if cids else ():
        if len(joined) != width * len(cids) or width <= DIGEST:
            break
        rows = np.frombuffer(joined, np.uint8).reshape(len(cids), width)
        head = bytes(rows[0, :-DIGEST])
        if head not in KINDS or not (rows[:, :-DIGEST] == rows[0, :-DIGEST]).all():
            break
        keys = np.empty((len(cids), KEY_SIZE), np.uint8)
        keys[:, :DIGEST] = rows[:, -DIGEST:]
        keys[:, DIGEST] = KINDS[head]
        return keys.view(KEY_DTYPE).ravel()
    return np.frombuffer(b"".join(map(key_of, cids)), KEY_DTYPE)


class Table:
    """Rows sorted by key: ``n`` keys (33 bytes each), then their ``n`` locations (21 bytes each),
    immutable, read in place from the buffers they came in (an index file's bytes as read: no
    copy of a million rows at open).

    ``_buckets[b]`` is the first row whose key's leading bits are ``b`` or more: a lookup searches
    only its bucket (a few rows) with ``bytes.find``.
    """

    __slots__ = ("_buckets", "_key_at", "_keys", "_location_at", "_locations", "_shift", "n")

    def __init__(self, keys: bytes | bytearray, locations: bytes | bytearray, n: int | None = None,
                 *, key_at: int = 0, location_at: int = 0) -> None:
        """Rows whose keys lie in ``keys`` from ``key_at`` and locations in ``locations`` from
        ``location_at`` (``n`` rows: by default, all of ``keys``)."""
        self._keys, self._key_at = keys, key_at
        self._locations, self._location_at = locations, location_at
        self.n = len(keys) // KEY_SIZE if n is None else n
        bits = max(0, min(24, self.n.bit_length() - 2))
        self._shift = 24 - bits
        # each key's first 4 bytes, big endian, read in place (a strided view: no copy)
        leading = np.ndarray((self.n,), ">u4", keys, key_at, (KEY_SIZE,)) if self.n else np.zeros(0, ">u4")
        top = leading >> np.uint32(self._shift + 8)
        starts = np.searchsorted(top, np.arange((1 << bits) + 1, dtype=np.uint32))
        self._buckets = array.array("I", starts.astype(np.uint32).tobytes())

    @classmethod
    def sorted(cls, keys: np.ndarray, locations: np.ndarray) -> Table:
        """A table of these rows in any order (sorted here; copies keep their order)."""
        return sorted_rows(keys, locations)

    @property
    def key_array(self) -> np.ndarray:
        return np.frombuffer(self._keys, KEY_DTYPE, self.n, self._key_at)

    @property
    def location_array(self) -> np.ndarray:
        return np.frombuffer(self._locations, LOCATION_DTYPE, self.n, self._location_at)

    @property
    def key_bytes(self) -> memoryview:
        """Every key, back to back (as an index file holds them)."""
        return memoryview(self._keys)[self._key_at : self._key_at + self.n * KEY_SIZE]

    @property
    def location_bytes(self) -> memoryview:
        """Every location, back to back."""
        return memoryview(self._locations)[self._location_at : self._location_at + self.n * LOCATION.size]

    def key(self, row: int) -> bytes:
        at = self._key_at + row * KEY_SIZE
        return bytes(self._keys[at : at + KEY_SIZE])  # the same object where the buffer is bytes

    def find(self, key: bytes) -> int:
        """The first row of ``key``, or -1."""
        bucket = int.from_bytes(key[:3], "big") >> self._shift
        buckets, keys, base = self._buckets, self._keys, self._key_at
        end = base + buckets[bucket + 1] * KEY_SIZE
        at = keys.find(key, base + buckets[bucket] * KEY_SIZE, end)
        while at > 0 and (at - base) % KEY_SIZE:  # matched across two rows: not a key
            at = keys.find(key, at + 1, end)
        return -1 if at < 0 else (at - base) // KEY_SIZE

    def rows(self, key: bytes) -> Iterator[int]:
        """Every row of ``key`` (its copies)."""
        row = self.find(key)
        if row < 0:
            return
        while row < self.n and self.key(row) == key:
            yield row
            row += 1

    def location(self, row: int) -> tuple[int, int, int, int, int]:
        return LOCATION.unpack_from(  # type: ignore[return-value]
            self._locations, self._location_at + row * LOCATION.size)

    def find_many(self, keys: np.ndarray) -> np.ndarray:
        """The first row of each key (``S33`` array), -1 where absent."""
        if not self.n:
            return np.full(len(keys), -1, np.int64)
        mine, out = self.key_array, np.empty(len(keys), np.int64)
        for start in range(0, len(keys), _FIND_MANY):  # in pieces: each copies what it compares
            part = keys[start : start + _FIND_MANY]
            rows = np.searchsorted(mine, part)
            found = rows < self.n
            found[found] = mine[rows[found]] == part[found]
            out[start : start + len(part)] = np.where(found, rows, -1)
        return out


EMPTY = Table(b"", b"")


def merge(a: Table, b: Table, keep: np.ndarray | None = None, renumber: np.ndarray | None = None) -> Table:
    """One table of both (sorted) tables' rows, ``a``'s copies of a key before ``b``'s: without
    the rows of the pack ids ``keep`` maps to False, and pack ids mapped through ``renumber``.

    Merged, not sorted again, straight into the new table's buffer: folding a few thousand rows
    into a million costs one pass and the new table's memory, where a sort took seconds and four
    copies of every row."""
    if keep is not None and keep.all():
        keep = None  # no pack left out: no row to drop
    if a.n < b.n:  # the large one compressed in place below, whichever it is (a's copies stay first)
        a, b, b_first = b, a, True
    else:
        b_first = False
    a_keys, a_locations = a.key_array, a.location_array
    a_alive = keep[a_locations["pack"]] if keep is not None and a.n else None  # rows of packs not gone
    b_keys, b_locations = b.key_array, b.location_array
    if keep is not None and b.n:
        b_alive = keep[b_locations["pack"]]
        b_keys, b_locations = b_keys[b_alive], b_locations[b_alive]
    n = (a.n if a_alive is None else int(np.count_nonzero(a_alive))) + len(b_keys)
    buffer = pages(n * (KEY_SIZE + LOCATION.size))
    keys = np.frombuffer(buffer, KEY_DTYPE, n)
    locations = np.frombuffer(buffer, LOCATION_DTYPE, n, n * KEY_SIZE)
    if not len(b_keys):  # one table, its rows of dead packs left out: written straight in
        if a_alive is None:
            keys[:], locations[:] = a_keys, a_locations
        else:
            np.compress(a_alive, a_keys, out=keys)
            np.compress(a_alive, a_locations, out=locations)
    else:
        if a_alive is not None:
            a_keys, a_locations = a_keys[a_alive], a_locations[a_alive]
        at = np.searchsorted(a_keys, b_keys, side="left" if b_first else "right")
        from_b = np.zeros(n, bool)
        from_b[at + np.arange(len(b_keys))] = True
        keys[from_b], locations[from_b] = b_keys, b_locations
        from_a = ~from_b
        keys[from_a], locations[from_a] = a_keys, a_locations
    if renumber is not None:
        locations["pack"] = renumber[locations["pack"]]
    return Table(buffer, buffer, n, location_at=n * KEY_SIZE)


def table_of(packs: Sequence[tuple[str, Sequence[EntryFields]]]) -> Table:
    """The rows of these packs' entries, their pack ids positions in ``packs``."""
    keys = b"".join(key_of(e[0]) for _, entries in packs for e in entries)
    columns = [(pack, e[1], e[2], e[3], e[4]) for pack, (_, entries) in enumerate(packs) for e in entries]
    rows = np.array(columns, dtype=LOCATION_DTYPE)
    if len(rows) and (int(rows["length"].max()) > MAX_LENGTH or int(rows["size"].max()) > MAX_LENGTH):
        raise ValueError("a block of 4 GiB or more cannot be indexed")
    return Table.sorted(np.frombuffer(keys, KEY_DTYPE), rows)


_HEAD_KIND = np.array([KINDS[head] for head in CID_HEADS], np.uint8)  # Columns.heads -> kind byte


def table_of_columns(packs: Sequence[Columns], ids: Sequence[int] | None = None,
                     tables: Sequence[Table] = ()) -> Table:
    """One table of the rows of ``tables`` and of these packs' entries
    (:class:`~cas_ckpt.blocks.pack.Columns`: each pack's index as arrays), their pack ids
    ``ids`` (by default positions in ``packs``); copies of a block in the order given, the
    tables' first. No object per row (:func:`sorted_rows`)."""
    ids = range(len(packs)) if ids is None else ids
    n = sum(t.n for t in tables) + sum(len(c.heads) for c in packs)
    buffer = pages(n * (KEY_SIZE + LOCATION.size))  # the rows as they come, then sorted
    keys = np.frombuffer(buffer, np.uint8, n * KEY_SIZE).reshape(n, KEY_SIZE)
    locations = np.frombuffer(buffer, LOCATION_DTYPE, n, n * KEY_SIZE)
    at = 0
    for table in tables:
        keys[at : at + table.n] = np.frombuffer(table.key_bytes, np.uint8).reshape(table.n, KEY_SIZE)
        locations[at : at + table.n] = table.location_array
        at += table.n
    for pack, columns in zip(ids, packs, strict=True):
        end = at + len(columns.heads)
        keys[at:end, :DIGEST] = columns.digests
        keys[at:end, DIGEST] = _HEAD_KIND[columns.heads]
        part = locations[at:end]
        part["pack"], part["offset"], part["length"] = pack, columns.offsets, columns.lengths
        part["codec"], part["size"] = columns.codecs, columns.sizes
        at = end
    return sorted_rows(keys.view(KEY_DTYPE).ravel(), locations)


def sorted_rows(keys: np.ndarray, locations: np.ndarray) -> Table:
    """A table of these rows (keys ``S33``, locations), in any order: sorted by key, copies of a
    block in the order given.

    Nothing in proportion to the rows comes from the allocator's heap (where an open's
    temporaries stayed the process's after they were freed): the rows' order and the table are
    buffers of :func:`~cas_ckpt._memory.pages`, sorted in place and written a piece at a time.
    The order holds each key's leading bits above the row's number (a digest spreads them: keys
    alike in those bits are rare, and put in order after)."""
    n = len(keys)
    if not n:
        return EMPTY
    keys, locations = np.ascontiguousarray(keys), np.ascontiguousarray(locations)
    bits = n.bit_length()
    low = np.uint64((1 << bits) - 1)
    order = np.frombuffer(pages(n * 8), np.uint64, n)
    leading = np.ndarray((n,), ">u8", keys, 0, (KEY_SIZE,))  # each key's first 8 bytes
    for at in range(0, n, _ROWS_AT_ONCE):
        part = leading[at : at + _ROWS_AT_ONCE].astype(np.uint64) >> np.uint64(bits) << np.uint64(bits)
        order[at : at + len(part)] = part | np.arange(at, at + len(part), dtype=np.uint64)
    order.sort()  # in place
    _order_ties(order, bits, keys)
    buffer = pages(n * (KEY_SIZE + LOCATION.size))
    out_keys = np.frombuffer(buffer, f"V{KEY_SIZE}", n)
    out_locations = np.frombuffer(buffer, f"V{LOCATION.size}", n, n * KEY_SIZE)
    keys, locations = keys.view(f"V{KEY_SIZE}"), locations.view(f"V{LOCATION.size}")
    for at in range(0, n, _ROWS_AT_ONCE):
        rows = (order[at : at + _ROWS_AT_ONCE] & low).astype(np.intp)
        np.take(keys, rows, out=out_keys[at : at + len(rows)], mode="clip")  # clip: no buffered copy
        np.take(locations, rows, out=out_locations[at : at + len(rows)], mode="clip")
    return Table(buffer, buffer, n, location_at=n * KEY_SIZE)


_ROWS_AT_ONCE = 16384  # rows a table is sorted a piece at a time (sorted_rows)


def _order_ties(order: np.ndarray, bits: int, keys: np.ndarray) -> None:
    """Put rows whose keys' leading bits are alike (in ``order``, sorted: by their numbers) in
    the order of their whole keys, then of their numbers: copies of one block, or digests alike
    in their first bytes."""
    tied = []
    for at in range(0, len(order), _ROWS_AT_ONCE):
        top = order[at : at + _ROWS_AT_ONCE + 1] >> np.uint64(bits)
        same = np.flatnonzero(top[1:] == top[:-1]) + at
        if len(same):
            tied += [same, same + 1]
    if not tied:
        return
    places = np.unique(np.concatenate(tied))
    low = np.uint64((1 << bits) - 1)
    rows = (order[places] & low).astype(np.intp)
    ranked = rows[np.lexsort((rows, keys[rows]))].astype(np.uint64)
    order[places] = (order[places] & ~low) | ranked


class BlockIndex:
    """Where every known copy of every block lies: the store's index (see the module docstring).

    Changes are serialised by the caller's lock. Lookups take none: the tables and the pack names
    their ids refer to are swapped together, and a lookup reads the triple it found.
    """

    def __init__(self) -> None:
        self._state: tuple[Table, Table, list[str]] = (EMPTY, EMPTY, [])  # base, delta, pack names
        self.ids: dict[str, int] = {}  # name -> pack id, for the packs present
        self.pack_rows: dict[str, int] = {}  # name -> rows (block copies) it holds
        self._dead: set[int] = set()  # ids of packs gone whose rows are still in the tables
        self._dead_rows = 0
        self.bad: set[Location] = set()  # copies that failed their hash in this process
        self._first: dict[bytes, Location] = {}  # the copy to try first, where not the table's
        # The copies of the blocks read last (a walk or a load reads some nodes again and again),
        # emptied by every change.
        self._recent: dict[bytes, list[Location]] = {}

    # -- changes -------------------------------------------------------------------------------
    def __contains__(self, pack: object) -> bool:
        return pack in self.ids

    def add_packs(self, packs: Iterable[tuple[str, Sequence[EntryFields]]]) -> None:
        """Index the entries of these packs (those already indexed are skipped)."""
        fresh = [(name, entries) for name, entries in packs if name not in self.ids]
        if fresh:
            self.add_table(table_of(fresh), [name for name, _ in fresh])

    def add_columns(self, packs: Iterable[tuple[str, Columns]]) -> None:
        """Index these packs' entries, read as arrays (those already indexed are skipped)."""
        fresh = {name: columns for name, columns in packs if name not in self.ids}
        if not fresh:
            return
        ids = [self._new_id(name, len(columns.heads)) for name, columns in fresh.items()]
        columns = list(fresh.values())
        if self._dead:
            self._add(table_of_columns(columns, ids))
            return
        # Sorted in with the tables they would be merged into (every pack live, numbered as
        # they stand): no second copy of the rows, nor a merge's temporaries.
        base, delta, names = self._state
        if delta.n + sum(len(c.heads) for c in columns) > max(_MERGE_MIN, base.n // 8):
            self._state = (table_of_columns(columns, ids, (base, delta)), EMPTY, names)
        else:
            self._state = (base, table_of_columns(columns, ids, (delta,)), names)
        self._recent = {}

    def add_table(self, table: Table, names: Sequence[str], only: Collection[str] | None = None) -> list[str]:
        """Index a table whose pack ids are positions in ``names`` (an index file's): the packs
        not indexed yet, and only those in ``only`` if given; returns the names taken in."""
        mapping = np.zeros(max(len(names), 1), np.uint32)
        fresh = np.zeros(max(len(names), 1), bool)
        locations = table.location_array
        counts = np.bincount(locations["pack"], minlength=len(names)).tolist() if table.n else []
        taken = []
        for local, name in enumerate(names):
            if name not in self.ids and (only is None or name in only):
                mapping[local] = self._new_id(name, counts[local] if counts else 0)
                fresh[local] = True
                taken.append(name)
        if not table.n or not taken:
            return taken
        if len(taken) == len(names) and (mapping[: len(names)] == np.arange(len(names))).all():
            self._add(table)  # every pack new and numbered as in the file: the rows as they are
            return taken
        keys = table.key_array
        if len(taken) < len(names):
            keep = fresh[locations["pack"]]
            keys, locations = keys[keep], locations[keep]
        locations = locations.copy()
        locations["pack"] = mapping[locations["pack"]]
        self._add(Table(keys.tobytes(), locations.tobytes()))
        return taken

    def _new_id(self, name: str, rows: int) -> int:
        names = self._state[2]
        if len(names) >= 2**32 - 2:
            self._compact()
            names = self._state[2]
        pack = len(names)
        names.append(name)  # appended in place: a lookup holding the old triple still resolves
        self.ids[name] = pack
        self.pack_rows[name] = rows
        return pack

    def _add(self, table: Table) -> None:
        self._recent = {}
        base, delta, names = self._state
        delta = merge(delta, table) if delta.n else table
        if delta.n > max(_MERGE_MIN, base.n // 8):
            self._compact(base, delta)
        else:
            self._state = (base, delta, names)

    def drop(self, names: Iterable[str]) -> None:
        """Forget packs that left the medium; their blocks stay readable from other copies."""
        gone = set()
        for name in names:
            pack = self.ids.pop(name, None)
            if pack is not None:
                gone.add(name)
                self._dead.add(pack)
                self._dead_rows += self.pack_rows.pop(name, 0)
        if not gone:
            return
        self._recent = {}
        self.bad = {loc for loc in self.bad if loc.pack not in gone}
        self._first = {cid: loc for cid, loc in self._first.items() if loc.pack not in gone}
        if self._dead_rows > max(_MERGE_MIN, len(self) // 8):
            self._compact()

    def _compact(self, base: Table | None = None, delta: Table | None = None) -> None:
        """Fold everything into one table of the live packs, their ids renumbered from 0."""
        if base is None or delta is None:
            base, delta, _ = self._state
        names = self._state[2]
        if not self._dead and len(self.ids) == len(names) and not (base.n and delta.n):
            # One table of every pack, numbered from 0 (an index file just read): nothing to
            # fold, and sorting a million rows again would cost seconds and twice their memory.
            self._state = (base if base.n else delta, EMPTY, names)
            self._recent = {}
            return
        live = sorted(self.ids.values())
        renumber = np.zeros(len(names), np.uint32)
        renumber[live] = np.arange(len(live), dtype=np.uint32)
        table = merge(base, delta, self._alive(len(names)) if self._dead else None, renumber)
        fresh = [names[pack] for pack in live]
        self.ids = {name: pack for pack, name in enumerate(fresh)}
        self._state = (table, EMPTY, fresh)
        self._recent = {}
        self._dead.clear()
        self._dead_rows = 0

    def _alive(self, count: int) -> np.ndarray:
        keep = np.ones(count, bool)
        keep[list(self._dead)] = False
        return keep

    # -- lookups -------------------------------------------------------------------------------
    def copies(self, cid: bytes) -> list[Location]:
        """Every known copy of ``cid``: the one reads should try first, then the others, those
        known to be damaged last."""
        recent = self._recent.get(cid)
        if recent is not None:
            return list(recent)
        found = self._copies(cid)
        if found:
            if len(self._recent) >= _RECENT:
                self._recent.clear()
            self._recent[cid] = found
        return list(found)

    def _copies(self, cid: bytes) -> list[Location]:
        try:
            key = key_of(cid)
        except KeyError:
            return []
        base, delta, names = self._state
        dead = self._dead
        found: list[Location] = []
        for table in (base, delta):
            row = table.find(key) if table.n else -1
            while row >= 0:  # this row, and the copies after it
                pack, offset, length, codec, size = table.location(row)
                if not (dead and pack in dead):
                    loc = Location(names[pack], offset, length, codec, size)
                    if loc not in found:
                        found.append(loc)
                row += 1
                if row >= table.n or table.key(row) != key:
                    break
        if not self._first and not self.bad:
            return found
        first = self._first.get(cid)
        if first is not None and first in found:
            found.remove(first)
            found.insert(0, first)
        return sorted(found, key=lambda loc: loc in self.bad) if self.bad else found

    def first(self, cid: bytes) -> Location | None:
        """The copy reads try first, or None."""
        if self._first or self._dead or self.bad:
            copies = self.copies(cid)
            return copies[0] if copies else None
        try:
            key = key_of(cid)
        except KeyError:
            return None
        base, delta, names = self._state
        for table in (base, delta):
            row = table.find(key) if table.n else -1
            if row >= 0:
                pack, offset, length, codec, size = table.location(row)
                return Location(names[pack], offset, length, codec, size)
        return None

    def has(self, cid: bytes) -> bool:
        """True if a copy is known that is not known to be damaged."""
        if self.bad or self._dead:
            return any(loc not in self.bad for loc in self.copies(cid))
        try:
            key = key_of(cid)
        except KeyError:
            return False
        base, delta, _ = self._state
        return (base.n > 0 and base.find(key) >= 0) or (delta.n > 0 and delta.find(key) >= 0)

    def _first_rows(self, cids: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray, list[str]] | None:
        """The first copy's location of each CID (``LOCATION_DTYPE``) and whether it was found,
        with the names its pack ids refer to; None where copies need a look one by one."""
        if self.bad or self._first:
            return None
        try:
            keys = keys_of(cids)
        except KeyError:
            return None
        base, delta, names = self._state
        out = np.zeros(len(cids), LOCATION_DTYPE)
        found = np.zeros(len(cids), bool)
        for table in (base, delta):
            if not table.n:
                continue
            todo = np.flatnonzero(~found)
            rows = table.find_many(keys[todo])
            hit = rows >= 0
            out[todo[hit]] = table.location_array[rows[hit]]
            found[todo[hit]] = True
            if found.all():
                break
        if self._dead:
            dead = np.isin(out["pack"], np.fromiter(self._dead, np.uint32, len(self._dead)))
            if (dead & found).any():
                return None  # a first copy in a dropped pack: another may be alive
        return out, found, names

    def has_many(self, cids: Sequence[bytes]) -> list[bool]:
        """:meth:`has` of each, in a few array operations unless copies are damaged."""
        if not cids:
            return []
        rows = self._first_rows(cids)
        if rows is None:
            return [self.has(cid) for cid in cids]
        return rows[1].tolist()

    def locate_many(self, cids: Sequence[bytes]) -> tuple[np.ndarray, list[str]] | None:
        """The first copy of each (a ``LOCATION_DTYPE`` array; its pack ids index the names
        returned), or None if one is missing or copies need a look one by one."""
        rows = self._first_rows(cids) if cids else None
        if rows is None or not rows[1].all():
            return None
        return rows[0], rows[2]

    def prefer(self, cid: bytes, loc: Location) -> None:
        """Make ``loc`` the copy reads try first (a good copy found behind a damaged one)."""
        self._first[cid] = loc
        self._recent = {}

    def mark_bad(self, loc: Location) -> None:
        """Record a copy that failed its hash: reads try it last."""
        self.bad.add(loc)
        self._recent = {}

    def fold(self) -> tuple[Table, list[str]]:
        """Everything in one table of the live packs (``base``), and the names its ids refer to."""
        if self._dead or self._state[1].n:
            self._compact()
        base, _, names = self._state
        return base, names

    # -- whole-index views ---------------------------------------------------------------------
    def __len__(self) -> int:
        """Rows in the tables (copies, and dropped packs' rows not yet folded away)."""
        base, delta, _ = self._state
        return base.n + delta.n

    def live_rows(self) -> tuple[np.ndarray, np.ndarray, list[str]]:
        """Every row of a live pack: keys, locations and the names their pack ids refer to."""
        base, delta, names = self._state
        keys = np.concatenate([base.key_array, delta.key_array])
        locations = np.concatenate([base.location_array, delta.location_array])
        if self._dead:
            alive = self._alive(len(names))[locations["pack"]]
            keys, locations = keys[alive], locations[alive]
        return keys, locations, names

    def cids(self) -> list[bytes]:
        """Every block with a copy in a live pack, once."""
        keys, _, _ = self.live_rows()
        return [cid_of(key) for key in np.unique(keys).tolist()] if len(keys) else []

    def snapshot(self, excluding: Collection[str] = ()) -> tuple[Table, list[str]]:
        """Every live row in one table, and the packs its ids name in order (an index file's),
        without the packs ``excluding`` names."""
        base, delta, names = self._state
        used = sorted(pack for name, pack in self.ids.items() if name not in excluding)
        if not delta.n and used == list(range(len(names))):
            return base, list(names)  # every row live and numbered from 0: the table as it is
        keep = np.zeros(len(names), bool)
        keep[used] = True  # neither dead nor excluded
        renumber = np.zeros(len(names), np.uint32)
        renumber[used] = np.arange(len(used), dtype=np.uint32)
        return merge(base, delta, keep, renumber), [names[pack] for pack in used]

    def entries(self, packs: Collection[str] | None = None) -> dict[str, list[Entry]]:
        """Each live pack's entries (or those of ``packs`` only), in pack order (by offset)."""
        keys, locations, names = self.live_rows()
        wanted = self.ids.keys() if packs is None else [name for name in packs if name in self.ids]
        if packs is not None:
            chosen = np.zeros(len(names), bool)
            chosen[[self.ids[name] for name in wanted]] = True
            picked = chosen[locations["pack"]]
            keys, locations = keys[picked], locations[picked]
        order = np.lexsort((locations["offset"], locations["pack"]))
        found: dict[str, list[Entry]] = {name: [] for name in wanted}
        rows = zip(keys[order].tolist(), locations[order].tolist(), strict=True)
        for key, (pack, offset, length, codec, size) in rows:
            found[names[pack]].append(Entry(cid_of(key), offset, length, codec, size))
        return found
