"""Differences between two checkpoints, computed from their trees: unchanged chunks are never read."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cas_ckpt.blocks.base import BlockStore
from cas_ckpt.codec import Link, Tagged
from cas_ckpt.maintenance.walk import walk
from cas_ckpt.tree import NDARRAY, TUPLE, TreeReader, join_path


@dataclass
class Change:
    """A value present in both checkpoints whose content differs."""

    path: str
    detail: str
    max_abs: float | None = None
    l2: float | None = None


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


def leaves(reader: TreeReader, value: Any, path: str = "") -> dict[str, Any]:
    """Flatten a tree into ``{path: leaf}``, leaves left undecoded (arrays stay descriptors)."""
    out: dict[str, Any] = {}
    stack = [(value, path)]
    while stack:
        item, where = stack.pop()
        item = reader.resolve(item)
        if isinstance(item, dict):
            stack.extend((v, join_path(where, k)) for k, v in item.items())
        elif isinstance(item, list):
            stack.extend((v, join_path(where, i)) for i, v in enumerate(item))
        elif isinstance(item, Tagged) and item.code == TUPLE and isinstance(item.value, list):
            stack.extend((v, join_path(where, i)) for i, v in enumerate(item.value))
        else:
            out[where] = item
    return out


def compare(reader: TreeReader, store: BlockStore, tree_a: bytes, tree_b: bytes) -> DiffReport:
    report = DiffReport()
    a = leaves(reader, Link(tree_a))
    b = leaves(reader, Link(tree_b))
    report.removed = sorted(set(a) - set(b))
    report.added = sorted(set(b) - set(a))
    for path in [p for p in a if p in b]:
        if a[path] == b[path]:
            report.unchanged += 1
        else:
            report.changed.append(_change(reader, path, a[path], b[path]))
    reach_a = walk(store, {tree_a: "a"}).data
    reach_b = walk(store, {tree_b: "b"}).data
    report.a_bytes = sum(store.size(c) for c in reach_a)
    report.b_bytes = sum(store.size(c) for c in reach_b)
    report.shared_bytes = sum(store.size(c) for c in reach_a & reach_b)
    return report


def _change(reader: TreeReader, path: str, old: Any, new: Any) -> Change:
    if _is_array(old) and _is_array(new):
        ha, hb = old.value, new.value
        if ha.get("dtype") != hb.get("dtype") or ha.get("shape") != hb.get("shape"):
            return Change(
                path, f"array {ha.get('dtype')}{ha.get('shape')} -> {hb.get('dtype')}{hb.get('shape')}"
            )
        x = np.asarray(reader.load(old))
        y = np.asarray(reader.load(new))
        delta = np.abs(x.astype(np.complex128 if x.dtype.kind == "c" else np.float64)
                       - y.astype(np.complex128 if y.dtype.kind == "c" else np.float64))
        return Change(
            path,
            "array values changed",
            max_abs=float(delta.max()) if delta.size else 0.0,
            l2=float(np.sqrt(np.sum(delta.astype(np.float64) ** 2))),
        )
    return Change(path, f"{_short(reader, old)} -> {_short(reader, new)}")


def _is_array(value: Any) -> bool:
    return isinstance(value, Tagged) and value.code == NDARRAY and isinstance(value.value, dict)


def _short(reader: TreeReader, value: Any) -> str:
    if isinstance(value, Tagged):
        value = reader.load(value)
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
