"""Paths into a state: what ``repo.load(path=...)``, ``ls``, ``diff`` and ``export --path`` name.

A sequence path is exact keys and indices. A dotted string is read every way the keys allow, since
a state dict's keys hold dots (``docs/guide.md``, "Loading part of a checkpoint"): a run of
segments may be one key, a digit segment an index or an int key, and what is left of the path a
key prefix, selecting the keys of one map that start with it and a dot. Only nodes are read here
(a paged map's pages too); the chunks of what is selected are read by :meth:`TreeReader.load`.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cas_ckpt.codec import Link, Tagged
from cas_ckpt.errors import AmbiguousPath, DecodeError, PathNotFound
from cas_ckpt.tree import TUPLE, TreeReader


def select(reader: TreeReader, root: Any, path: str | Sequence[Any], root_cid: str) -> Selection:
    """The raw (unmaterialised) value ``path`` names below ``root`` (see :class:`Selection`).

    A sequence is exact keys and indices, one per level. A dotted string is read every way its
    keys allow (state-dict keys hold dots): at a map, each run of segments that joins to a key
    (``layer.0.weight``), and, for all that is left of the path, the keys starting with it and
    a dot (a key prefix: ``encoder.layer.5`` selects ``encoder.layer.5.attn.weight``...). A
    path ending in ``.`` is a key prefix only. One reading must find something:
    :class:`PathNotFound` if none does, :class:`AmbiguousPath` if several do.
    """
    if not isinstance(path, str):
        return _select_exact(reader, root, list(path), root_cid)
    prefix_only = path.endswith(".") and len(path) > 1
    search = _PathSearch(reader, (path[:-1] if prefix_only else path).split("."), prefix_only)
    search.walk(root, 0, [])
    if not search.found:
        raise search.not_found(root_cid)
    if len(search.found) > 1:
        raise AmbiguousPath(path, root_cid, [s.describe() for s in search.found])
    return search.found[0]


def _select_exact(reader: TreeReader, root: Any, path: list[Any], root_cid: str) -> Selection:
    value = reader.resolve(root)
    done: list[str] = []
    for i, key in enumerate(path):
        items = _items(value)
        if isinstance(value, dict):
            if key not in value:
                raise _not_found(done, path[i:], value, root_cid)
        elif items is not None:
            value, key = items, _index(key)
            if key is None or not -len(value) <= key < len(value):
                raise _not_found(done, path[i:], value, root_cid)
        else:
            raise _not_found(done, path[i:], value, root_cid)
        done.append(str(key))
        value = reader.resolve(value[key])
    return Selection(value, ".".join(done))


def _items(value: Any) -> list[Any] | None:
    """The items of a list or tuple value; None for anything else."""
    if isinstance(value, list):
        return value
    if isinstance(value, Tagged) and value.code == TUPLE:
        if not isinstance(value.value, list):
            raise DecodeError("malformed tuple: expected a list")
        return value.value
    return None


def _index(segment: Any) -> int | None:
    if type(segment) is int:
        return int(segment)
    if isinstance(segment, str) and re.fullmatch(r"-?\d+", segment):
        return int(segment)
    return None


def _not_found(
    done: list[str], rest: list[Any], where: Any, root_cid: str, *, prefix: bool = False
) -> PathNotFound:
    """The error for ``rest`` missing below ``done``: where the path stops, and close keys.

    The rest of the path is matched whole first (flat state-dict keys hold dots: ``0.weight``),
    then its first segment alone. ``prefix``: the path asked for the keys under a prefix only.
    """
    found = ".".join(done)
    missing = ".".join(map(str, [*done, rest[0]]))
    at = repr(found) if found else "the root"
    suggestions: list[str] = []
    joined = ".".join(map(str, rest))
    if isinstance(where, dict):
        keys = [str(k) for k in where]
        close = difflib.get_close_matches(joined, keys, n=3)
        close = close or difflib.get_close_matches(str(rest[0]), keys, n=3)
        suggestions = [".".join([*done, k]) for k in close]
        detail = f"{at} has no key {rest[0]!r}" + (f" or {joined!r}" if len(rest) > 1 else "")
        if prefix:
            detail = f"{at} has no key starting with {joined + '.'!r}"
    elif isinstance(where, list):
        detail = f"{at} is a list of {len(where)} items"
    else:
        detail = f"{at} holds a value, not a dict or list"
    return PathNotFound(missing, root_cid, found=found, detail=detail, suggestions=suggestions)


@dataclass
class Selection:
    """What a path names: ``value``, raw, at ``path`` (the keys that lead to it, joined by dots).

    A key-prefix selection's ``value`` is a map of the matching items, keyed as in the map
    holding them (what ``model.load_state_dict(..., strict=False)`` takes when that map is a
    state dict); ``path`` is then that map's, and ``prefix`` the prefix matched.
    """

    value: Any
    path: str
    prefix: str | None = None

    def describe(self) -> str:
        if self.prefix is None:
            return f"the value at {self.path!r}"
        at = repr(self.path) if self.path else "the root"
        keys = "the key" if len(self.value) == 1 else f"the {len(self.value)} keys"
        return f"{keys} of {at} starting with {self.prefix + '.'!r}"


class _PathSearch:
    """Every reading of a dotted path, stopping at the second that finds something."""

    def __init__(self, reader: TreeReader, segments: list[str], prefix_only: bool) -> None:
        self.reader, self.segments, self.prefix_only = reader, segments, prefix_only
        self.found: list[Selection] = []
        # The reading that got furthest: (segments used, keys matched, the value there).
        self.failure: tuple[int, list[str], Any] = (-1, [], None)
        self.seen: set[tuple[bytes, int]] = set()  # (node, segments used): read the same way twice

    def walk(self, raw: Any, used: int, done: list[str]) -> None:
        if len(self.found) > 1:
            return
        if type(raw) is Link:
            if (raw.cid, used) in self.seen:
                return
            self.seen.add((raw.cid, used))
        value = self.reader.resolve(raw)
        rest = self.segments[used:]
        if not rest:  # a prefix-only path never gets here: its last segments are a prefix
            self.found.append(Selection(value, ".".join(done)))
        elif isinstance(value, dict):
            self._walk_map(value, used, done)
        elif (items := _items(value)) is not None:
            index = _index(rest[0])
            last = self.prefix_only and len(rest) == 1  # an item is no prefix of keys
            if index is None or not -len(items) <= index < len(items) or last:
                self._fail(used, done, items)
            else:
                self.walk(items[index], used + 1, [*done, str(index)])
        else:
            self._fail(used, done, value)

    def _walk_map(self, mapping: dict[Any, Any], used: int, done: list[str]) -> None:
        rest = self.segments[used:]
        matched = False
        # The longest key first (the usual reading of a state dict); a prefix-only path leaves
        # its last segment to the prefix.
        for n in range(len(rest) - self.prefix_only, 0, -1):
            joined = ".".join(rest[:n])
            keys: list[Any] = [joined] if joined in mapping else []
            if n == 1 and (number := _index(joined)) is not None and number in mapping:
                keys.append(number)  # int keys (an optimizer's state) are written as digits
            for key in keys:
                matched = True
                self.walk(mapping[key], used + n, [*done, str(key)])
        start = ".".join(rest) + "."
        picked = {k: v for k, v in mapping.items() if type(k) is str and k.startswith(start)}
        if picked:
            matched = True
            self.found.append(Selection(picked, ".".join(done), start[:-1]))
        if not matched:
            self._fail(used, done, mapping)

    def _fail(self, used: int, done: list[str], where: Any) -> None:
        if used > self.failure[0]:
            self.failure = (used, done, where)

    def not_found(self, root_cid: str) -> PathNotFound:
        used, done, where = self.failure
        return _not_found(done, self.segments[used:], where, root_cid, prefix=self.prefix_only)
