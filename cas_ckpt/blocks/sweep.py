"""GC's marks and sweep plan over the index's table, without a Python object per block.

GC marks what it keeps while it walks, then decides per pack what to delete or rewrite. With a
set of CIDs and an entry object per block, a million-block repository took hundreds of MiB of
GC memory; here the marks are one byte per row of the index's table (:class:`RowMarks`), and the
plan (:func:`plan`) is a few array operations over its pack column.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from cas_ckpt.blocks.index import Table, cid_of, key_of


class RowMarks:
    """The blocks GC keeps: a flag per row of one frozen ``table`` (every copy of a kept CID
    flagged), and a small set of the kept CIDs the table does not hold."""

    def __init__(self, table: Table, *, everything: bool = False) -> None:
        self.table = table
        self.rows = np.full(table.n, everything, bool)
        self.outside: set[bytes] = set()

    def _rows(self, cid: bytes) -> list[int]:
        try:
            return list(self.table.rows(key_of(cid)))
        except KeyError:
            return []

    def add(self, cid: bytes) -> None:
        rows = self._rows(cid)
        if rows:
            self.rows[rows] = True
        else:
            self.outside.add(cid)

    def discard(self, cid: bytes) -> None:
        rows = self._rows(cid)
        if rows:
            self.rows[rows] = False
        self.outside.discard(cid)

    def __contains__(self, cid: object) -> bool:
        if not isinstance(cid, bytes):
            return False
        try:
            row = self.table.find(key_of(cid))
        except KeyError:
            return False
        return bool(self.rows[row]) if row >= 0 else cid in self.outside

    def __len__(self) -> int:
        return self.kept_blocks() + len(self.outside)

    def kept_blocks(self) -> int:
        """Distinct CIDs of the table that are kept."""
        return int(np.count_nonzero(self.rows & _first_of_key(self.table)))

    def unkept(self) -> tuple[int, int]:
        """(distinct CIDs of the table not kept, the bytes their copies take)."""
        first = _first_of_key(self.table)
        dropped = ~self.rows
        return int(np.count_nonzero(dropped & first)), int(self.table.location_array["length"][dropped].sum())

    def unkept_cids(self) -> Iterator[bytes]:
        rows = np.flatnonzero(~self.rows & _first_of_key(self.table))
        keys = self.table.key_array[rows]
        return (cid_of(key) for key in keys.tolist())

    def flags_for(self, other: Table) -> np.ndarray:
        """Whether each row of another table (the index folded again) holds a kept CID."""
        if other is self.table:  # nothing changed since the marks were made
            return self.rows.copy()
        rows = self.table.find_many(other.key_array)
        flags = np.zeros(other.n, bool)
        found = rows >= 0
        flags[found] = self.rows[rows[found]]
        if self.outside:
            for row in np.flatnonzero(~found).tolist():
                flags[row] = cid_of(other.key(row)) in self.outside
        return flags


def _first_of_key(table: Table) -> np.ndarray:
    """Which rows are the first of their key (copies of one block are adjacent)."""
    keys = table.key_array
    first = np.ones(table.n, bool)
    if table.n > 1:
        first[1:] = keys[1:] != keys[:-1]
    return first


@dataclass
class Plan:
    """What a sweep does: packs deleted whole, packs rewritten (their kept rows), by name."""

    dead: list[str]
    merge: list[str]
    live_bytes: dict[str, int]  # what each pack to rewrite keeps
    rows: dict[str, int]  # every row of each pack touched (block copies it holds)


def plan(
    table: Table, names: list[str], kept: np.ndarray, sizes: dict[str, int], ages: dict[str, float],
    min_age: float, small_size: int,
) -> Plan:
    """Which packs a sweep touches.

    Packs younger than ``min_age`` are left alone. A pack losing blocks is rewritten with its
    kept ones (or deleted, when none are kept); small packs (under ``small_size``) are merged
    along when at least two packs would be written anyway.
    """
    packs = table.location_array["pack"]
    count = len(names)
    total = np.bincount(packs, minlength=count)
    live = np.bincount(packs[kept], minlength=count)
    live_bytes = np.bincount(packs[kept], weights=table.location_array["length"][kept], minlength=count)
    dead, doomed, small = [], [], []
    for pack in np.flatnonzero(total).tolist():
        name = names[pack]
        if name not in sizes or ages.get(name, 0.0) < min_age:
            continue
        if live[pack] == 0:
            dead.append(name)
        elif live[pack] < total[pack]:
            doomed.append(name)
        elif sizes[name] < small_size:
            small.append(name)
    merge = doomed + small if len(small) + len(doomed) >= 2 else doomed
    ids = {name: pack for pack, name in enumerate(names)}
    return Plan(dead, merge, {name: int(live_bytes[ids[name]]) for name in merge},
                {name: int(total[ids[name]]) for name in dead + merge})


def rows_by_pack(table: Table, packs: Iterable[int]) -> dict[int, np.ndarray]:
    """The rows of each of these pack ids, in pack order (by offset)."""
    locations = table.location_array
    order = np.lexsort((locations["offset"], locations["pack"]))
    sorted_packs = locations["pack"][order]
    found = {}
    for pack in packs:
        start, end = np.searchsorted(sorted_packs, [pack, pack + 1])
        found[pack] = order[start:end]
    return found


__all__ = ["Plan", "RowMarks", "plan", "rows_by_pack"]
