"""Differences between two checkpoints, computed from their trees: unchanged chunks are never read."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from cas_ckpt import cid as cidlib
from cas_ckpt.blocks.base import BlockStore
from cas_ckpt.codec import Link, Tagged
from cas_ckpt.errors import PathNotFound
from cas_ckpt.maintenance.tensors import change_norms
from cas_ckpt.maintenance.walk import walk
from cas_ckpt.tree import NDARRAY, TUPLE, TreeReader, join_path


@dataclass
class Change:
    """A value present in both checkpoints whose content differs.

    For two arrays of one shape: ``max_abs`` (the largest ``|a-b|``), ``l2`` (``‖a-b‖``),
    ``a_norm`` (``‖a‖``) and ``relative`` (``‖a-b‖ / ‖a‖``), streamed from both sides' chunks.
    """

    path: str
    detail: str
    max_abs: float | None = None
    l2: float | None = None
    a_norm: float | None = None
    relative: float | None = None


@dataclass
class DiffReport:
    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    changed: list[Change] = field(default_factory=list)
    unchanged: int = 0
    shared_bytes: int = 0
    a_bytes: int = 0
    b_bytes: int = 0

    @property
    def identical(self) -> bool:
        return not (self.added or self.removed or self.changed)

    def by_tensor(self) -> list[Change]:
        """The changed arrays that carry norms, largest relative change first (NaN before all)."""
        arrays = [c for c in self.changed if c.relative is not None]
        return sorted(arrays, key=lambda c: (not math.isnan(c.relative or 0.0), -(c.relative or 0.0)))


def leaves(reader: TreeReader, value: Any, path: str = "") -> dict[str, Any]:
    """Flatten a tree into ``{path: leaf}`` in the state's order, leaves left undecoded."""
    out: dict[str, Any] = {}
    stack = [(value, path)]
    while stack:
        item, where = stack.pop()
        item = reader.resolve(item)
        if isinstance(item, Tagged) and item.code == TUPLE and isinstance(item.value, list):
            item = item.value
        if isinstance(item, dict):
            children = [(v, join_path(where, k)) for k, v in item.items()]
        elif isinstance(item, list):
            children = [(v, join_path(where, i)) for i, v in enumerate(item)]
        else:
            out[where] = item
            continue
        stack.extend(reversed(children))  # a stack: reversed, the first child comes out first
    return out


def compare(
    reader: TreeReader, store: BlockStore, tree_a: bytes, tree_b: bytes, path: str | None = None
) -> DiffReport:
    """Values of ``tree_b`` against ``tree_a`` (below the dotted ``path`` only, if given)."""
    report = DiffReport()
    a = _leaves_below(reader, tree_a, path)
    b = _leaves_below(reader, tree_b, path)
    if path and not a and not b:
        raise PathNotFound(path, cidlib.to_str(tree_a))
    report.removed = [p for p in a if p not in b]
    report.added = [p for p in b if p not in a]
    for where in [p for p in a if p in b]:
        if a[where] == b[where]:
            report.unchanged += 1
        else:
            report.changed.append(_change(reader, where, a[where], b[where]))
    reach_a = walk(store, {tree_a: "a"}).data
    reach_b = walk(store, {tree_b: "b"}).data
    report.a_bytes = sum(store.size(c) for c in reach_a)
    report.b_bytes = sum(store.size(c) for c in reach_b)
    report.shared_bytes = sum(store.size(c) for c in reach_a & reach_b)
    return report


def _leaves_below(reader: TreeReader, tree: bytes, path: str | None) -> dict[str, Any]:
    if not path:
        return leaves(reader, Link(tree))
    try:
        start = reader.select(Link(tree), path.split("."), cidlib.to_str(tree))
    except PathNotFound:  # present on one side only: all added, or all removed
        return {}
    return leaves(reader, start, path)


def _change(reader: TreeReader, path: str, old: Any, new: Any) -> Change:
    if _is_array(old) and _is_array(new):
        ha, hb = old.value, new.value
        detail = "array values changed"
        if ha.get("dtype") != hb.get("dtype") or ha.get("shape") != hb.get("shape"):
            detail = f"array {ha.get('dtype')}{ha.get('shape')} -> {hb.get('dtype')}{hb.get('shape')}"
            if ha.get("shape") != hb.get("shape"):
                return Change(path, detail)
        norms = change_norms(reader, old, new)
        return Change(path, detail, max_abs=norms.max_abs, l2=norms.l2, a_norm=norms.a_norm,
                      relative=norms.relative)
    return Change(path, f"{_short(reader, old)} -> {_short(reader, new)}")


def _is_array(value: Any) -> bool:
    return isinstance(value, Tagged) and value.code == NDARRAY and isinstance(value.value, dict)


def _short(reader: TreeReader, value: Any) -> str:
    if isinstance(value, Tagged):
        value = reader.load(value)
    if isinstance(value, (bytes, str)) and len(value) > 60:  # an RNG state, a blob: its size only
        return f"{type(value).__name__} of {len(value)}"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
