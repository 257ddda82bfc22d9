"""The index folder: which index files exist, reading them, writing new ones, removing old ones.

A store keeps its index files (:mod:`cas_ckpt.blocks.index_file`) in a folder beside ``packs/``
(``index/``), through a backend of the same medium (:meth:`Backend.sibling`). Files are written
once, durably, under names no other file has, and deleted only once a newer snapshot covers
them: a reader that listed a file which is gone when it reads it lists again, and finds the
snapshot that replaced it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import NamedTuple

from cas_ckpt.backends.base import Backend, ObjectInfo
from cas_ckpt.blocks.index import Table
from cas_ckpt.blocks.index_file import (
    JOURNAL,
    SNAPSHOT,
    IndexFile,
    encode_parts,
    file_name,
    parse,
    parse_name,
)
from cas_ckpt.errors import CorruptStore


class Listed(NamedTuple):
    """An index file listed: what its name says, and its object's info."""

    kind: str
    sequence: int
    epoch: int
    info: ObjectInfo


FOLDER = "index"
SUFFIX = ".idx"


class Catalog:
    """The index files of one store, on ``backend`` (the store's sibling folder)."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.seen = 0  # the largest sequence listed or written: the next name sorts after it
        self.unreadable: set[str] = set()  # files the medium could not read (Backend.set_aside)

    def where(self, name: str) -> str:
        return self.backend.where(name)

    def listing(self, after: str | None = None) -> list[Listed]:
        """Index files, in name order: journals, then snapshots, each by sequence. ``after``:
        only names sorting after it (the snapshots always do)."""
        infos = self.backend.list() if after is None else self.backend.list_after(after)
        found = []
        for info in sorted(infos, key=lambda i: i.name):
            parsed = parse_name(info.name)
            if parsed is not None:
                found.append(Listed(*parsed, info))
                self.seen = max(self.seen, parsed.sequence)
        return found

    def read(self, info: ObjectInfo) -> IndexFile | None:
        """The file's content; None if it is gone. CorruptStore if it is damaged; if the medium
        could not read it at all (maybe no file: a directory, a FIFO), it is also :attr:`unreadable`."""
        try:
            data = self.backend.read(info.name, 0, info.size)
        except CorruptStore:
            self.unreadable.add(info.name)
            raise
        return None if data is None else parse(data, self.where(info.name))

    def write(
        self, kind: str, packs: list[tuple[str, int]], table: Table, folded: Iterable[str] = (),
        epoch: int | None = None,
    ) -> ObjectInfo:
        """Publish a new index file durably; its name sorts after every one seen. A snapshot's
        ``epoch``: that of the snapshot it follows, or None when blocks were removed (its own)."""
        parts = encode_parts(IndexFile(kind, packs, table, sorted(folded)))
        size = sum(len(part) for part in parts)
        while True:
            self.seen = max(self.seen + 1, time.time_ns() // 1000)
            name = file_name(kind, self.seen, self.seen if epoch is None else epoch)
            with self.backend.create() as sink:
                for part in parts:
                    sink.write(part)
                if sink.publish(name):
                    return ObjectInfo(name, size, 0.0)

    def delete(self, names: Iterable[str]) -> None:
        for name in names:
            self.backend.delete(name)
            self.unreadable.discard(name)

    def set_aside(self, name: str) -> str | None:
        """:meth:`Backend.set_aside` of an :attr:`unreadable` file: where it went, or None."""
        self.unreadable.discard(name)  # moved, or a readable file after all: not again
        return self.backend.set_aside(name)


__all__ = ["FOLDER", "JOURNAL", "SNAPSHOT", "SUFFIX", "Catalog"]
