"""Differences between two checkpoints, computed from their trees: unchanged chunks are never read."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from cas_ckpt import cid as cidlib
from cas_ckpt.blocks.base import BlockStore
from cas_ckpt.codec import Link, Tagged
from cas_ckpt.errors import DecodeError, OutOfMemory, PathNotFound
from cas_ckpt.maintenance.tensors import change_norms
from cas_ckpt.maintenance.walk import walk
from cas_ckpt.paths import select
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


GROUPS = ("model", "optimizer", "other")  # the parts of a training state, in the order shown
_OPTIMIZER_KEYS = frozenset({"optim", "optimizer", "opt", "optimizer_state", "optim_state"})
_OPTIMIZER_MARKERS = (".exp_avg", ".exp_avg_sq", ".momentum_buffer", ".state.")
_MODEL_KEYS = frozenset({"model", "module", "net", "params", "weights"})


def value_group(path: str, dtype: str | None = None) -> str:
    """Which part of a training state the value at dotted ``path`` is: ``"optimizer"``,
    ``"model"`` or ``"other"`` (``diff --by-tensor`` and the browser's diff group by it, in
    :data:`GROUPS` order).

    ``"optimizer"``: the first key is one of optim, optimizer, opt, optimizer_state,
    optim_state, or the path holds .exp_avg, .exp_avg_sq, .momentum_buffer or .state. below
    such a key. ``"model"``: the first key is model, module, net, params or weights, or a key
    of the path is state_dict, and the value is a float tensor. Anything else (step, RNG
    states, counters, scheduler values) is ``"other"``. ``dtype``: the value's dtype when it is
    an array (a non-float one is no weight), any other text (``""``) for a value that is no
    array; None (not known) counts as a float array, the path alone deciding.
    """
    keys = path.split(".")
    if keys[0] in _OPTIMIZER_KEYS:
        return "optimizer"
    for i, key in enumerate(keys[1:-1], 1):
        if key in _OPTIMIZER_KEYS:
            below = "." + ".".join(keys[i + 1:])
            if any(marker in below + "." for marker in _OPTIMIZER_MARKERS):
                return "optimizer"
    weight = dtype is None or _float_dtype(dtype)
    if weight and (keys[0] in _MODEL_KEYS or "state_dict" in keys[:-1]):
        return "model"
    return "other"


def _float_dtype(dtype: str) -> bool:
    name = dtype.lower()
    return name.startswith(("float", "bfloat", "half", "f2", "f4", "f8", "<f", ">f", "=f"))


FOLD_AT = 16  # listings show a list or tuple of more plain scalars than this as one value
_SCALARS = {int: "int", float: "float", bool: "bool", type(None): "none"}


@dataclass(frozen=True, eq=False)
class Folded:
    """A long list or tuple of plain scalars (an RNG state saved as 625 ints, a history of
    losses) that listings and diffs show as one value: ``… 625 ints``."""

    kind: str  # "list" or "tuple"
    items: tuple[Any, ...]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Folded) and self.kind == other.kind and len(self.items) == len(
            other.items) and all(map(_same, self.items, other.items))

    __hash__ = None  # type: ignore[assignment]

    @property
    def noun(self) -> str:
        """What the items are: ``int``, ``float``, ``bool``, ``none`` or (mixed) ``scalar``."""
        kinds = {_SCALARS[type(v)] for v in self.items}
        return kinds.pop() if len(kinds) == 1 else "scalar"

    def __str__(self) -> str:
        return f"… {len(self.items)} {self.noun}s"


def _same(x: Any, y: Any) -> bool:
    """Equal and of one type (``1`` is not ``True``); NaN is the same as NaN."""
    return type(x) is type(y) and (x == y or (x != x and y != y))


def fold(value: Any, kind: str) -> Folded | None:
    """``value`` (a decoded list) as one :class:`Folded` leaf if it is long and all plain scalars."""
    if len(value) > FOLD_AT and all(type(v) in _SCALARS for v in value):
        return Folded(kind, tuple(value))
    return None


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
        """The changed arrays that carry norms: model weights first, then optimizer state, then
        other values (:func:`value_group`), each largest relative change first (NaN before all)."""
        arrays = [c for c in self.changed if c.relative is not None]
        return sorted(arrays, key=lambda c: (GROUPS.index(value_group(c.path)),
                                             not math.isnan(c.relative or 0.0), -(c.relative or 0.0)))

    def model_only(self) -> DiffReport:
        """This report with only the values :func:`value_group` calls model weights."""
        def model(path: str) -> bool:
            return value_group(path) == "model"

        return dataclasses.replace(self, added=[p for p in self.added if model(p)],
                                   removed=[p for p in self.removed if model(p)],
                                   changed=[c for c in self.changed if model(c.path)])


def leaves(reader: TreeReader, value: Any, path: str = "") -> dict[str, Any]:
    """Flatten a tree into ``{path: leaf}`` in the state's order, leaves left undecoded; a long
    list or tuple of plain scalars is one :class:`Folded` leaf."""
    try:
        return _leaves(reader, value, path)
    except MemoryError as exc:
        if isinstance(exc, OutOfMemory):
            raise
        raise OutOfMemory(f"listing the values of {path or 'the state'} ran out of memory") from None


def _leaves(reader: TreeReader, value: Any, path: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    stack = [(value, path)]
    while stack:
        item, where = stack.pop()
        try:
            item = reader.resolve(item)
        except DecodeError as exc:  # the reader names the node; the path is known here
            if not exc.path:
                exc.path = where
            raise
        kind = "list"
        if isinstance(item, Tagged) and item.code == TUPLE and isinstance(item.value, list):
            item, kind = item.value, "tuple"
        if isinstance(item, dict):
            children = [(v, join_path(where, k)) for k, v in item.items()]
        elif isinstance(item, list):
            folded = fold(item, kind)
            if folded is not None:
                out[where] = folded
                continue
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
    union = list(reach_a | reach_b)
    size = dict(zip(union, store.sizes(union), strict=True))
    report.a_bytes = sum(size[c] for c in reach_a)
    report.b_bytes = sum(size[c] for c in reach_b)
    report.shared_bytes = sum(size[c] for c in reach_a & reach_b)
    return report


def _leaves_below(reader: TreeReader, tree: bytes, path: str | None) -> dict[str, Any]:
    if not path:
        return leaves(reader, Link(tree))
    try:
        selection = select(reader, Link(tree), path, cidlib.to_str(tree))
    except PathNotFound:  # present on one side only: all added, or all removed
        return {}
    return leaves(reader, selection.value, selection.path)


def _change(reader: TreeReader, path: str, old: Any, new: Any) -> Change:
    if isinstance(old, Folded) and isinstance(new, Folded) and len(old.items) == len(new.items):
        differ = [i for i, (x, y) in enumerate(zip(old.items, new.items, strict=True)) if not _same(x, y)]
        if differ:
            first = differ[0]
            return Change(path, f"{len(differ)} of {len(old.items)} {old.noun}s differ (first at "
                                f"{first}: {old.items[first]!r} -> {new.items[first]!r})")
        return Change(path, f"{old.kind} -> {new.kind}")
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
    if isinstance(value, Folded):
        return f"{value.kind} of {len(value.items)} {value.noun}s"
    if isinstance(value, Tagged):
        value = reader.load(value)
    if isinstance(value, (bytes, str)) and len(value) > 60:  # an RNG state, a blob: its size only
        return f"{type(value).__name__} of {len(value)}"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
