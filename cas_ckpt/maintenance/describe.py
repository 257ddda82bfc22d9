"""Decoded nodes and checkpoint leaves as JSON values: what ``cas-ckpt show``/``ls`` print and
the HTTP browser serves. Links become ``{"/": cid}``, arrays their descriptor's summary (no data
read), numpy scalars their value."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
from multiformats import CID

from cas_ckpt import cid as cidlib
from cas_ckpt.codec import HistoryLink, Link, Tagged
from cas_ckpt.errors import DecodeError
from cas_ckpt.maintenance.diff import Folded, value_group  # noqa: F401 - the browser's import
from cas_ckpt.tree import BIGINT, BLOB, NDARRAY, PAGES, SCALAR, TUPLE, parse_dtype


def jsonable(value: Any) -> Any:
    """A decoded node (or report) as JSON values: links as {"/": cid}, tensors summarised."""
    if isinstance(value, Link):
        out: dict[str, Any] = {"/": cidlib.to_str(value.cid)}
        if isinstance(value, HistoryLink):
            out["history"] = True
        return out
    if isinstance(value, Tagged):
        return _tagged(value)
    if isinstance(value, CID):
        return str(value)
    if isinstance(value, (bytes, bytearray, memoryview)):
        data = bytes(value)
        return {"bytes": len(data), "hex": data[:32].hex() + ("..." if len(data) > 32 else "")}
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)  # 'nan', 'inf', '-inf': JSON has no such numbers
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [jsonable(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return value


def _tagged(value: Tagged) -> Any:
    body = value.value
    if value.code == NDARRAY and isinstance(body, dict):
        return {"ndarray": array_summary(body)}
    if value.code == BLOB and isinstance(body, dict):
        return {"blob": {"size": body.get("size"), "str": bool(body.get("str")),
                         **_chunk_summary(body)}}
    if value.code == TUPLE:
        return {"tuple": jsonable(body)}
    if value.code == BIGINT and isinstance(body, bytes):
        return {"bigint": str(int.from_bytes(body, "big", signed=True))}
    if value.code == SCALAR and isinstance(body, dict):
        return {"scalar": scalar_summary(body)}
    if value.code == PAGES and isinstance(body, dict):
        return {"pages": jsonable(body)}
    return {"ext": value.code, "value": jsonable(body)}


def _chunk_summary(header: dict[str, Any]) -> dict[str, Any]:
    if "chunk_pages" in header:
        return {"chunk_pages": jsonable(header["chunk_pages"])}
    chunks = header.get("chunks")
    return {"chunks": len(chunks) if isinstance(chunks, list) else 0}


def _dtype_text(name: Any) -> str:
    try:
        return str(parse_dtype(name))
    except DecodeError:
        return repr(name)


def array_summary(header: dict[str, Any]) -> dict[str, Any]:
    """dtype, shape, byte size, layout and chunk count of an array descriptor (no data read)."""
    shape = header.get("shape")
    try:
        nbytes = math.prod(shape) * parse_dtype(header.get("dtype")).itemsize  # type: ignore[arg-type]
    except (DecodeError, TypeError):
        nbytes = None
    out = {"dtype": _dtype_text(header.get("dtype")), "shape": shape, "nbytes": nbytes,
           "kind": header.get("kind", "numpy")}
    if header.get("order") == "F":
        out["order"] = "F"
    if "data" in header:
        return {**out, "chunks": 0, "inline": True}
    return {**out, "chunk_size": header.get("chunk_size"), **_chunk_summary(header)}


def scalar_summary(body: dict[str, Any]) -> dict[str, Any]:
    """A numpy scalar's dtype and value."""
    try:
        dtype = parse_dtype(body.get("dtype"))
        data = body.get("data")
        if not isinstance(data, bytes) or len(data) != dtype.itemsize:
            raise DecodeError("malformed numpy scalar")
        value = jsonable(np.frombuffer(data, dtype=dtype)[0].item())
    except (DecodeError, ValueError, TypeError):
        return {"dtype": _dtype_text(body.get("dtype")), "value": None}
    return {"dtype": str(dtype), "value": value if isinstance(value, (int, float, bool, str)) else str(value)}


def describe_leaf(path: str, leaf: Any) -> dict[str, Any]:
    """One row of ``ls``: path, type, and dtype/shape/size or the value itself (a long list of
    scalars: how many, of what)."""
    if isinstance(leaf, Folded):
        return {"path": path, "type": leaf.kind, "items": len(leaf.items), "of": leaf.noun}
    if isinstance(leaf, Tagged) and leaf.code == NDARRAY and isinstance(leaf.value, dict):
        summary = array_summary(leaf.value)
        return {"path": path, "type": "array", **summary}
    if isinstance(leaf, Tagged) and leaf.code == BLOB and isinstance(leaf.value, dict):
        kind = "str" if leaf.value.get("str") else "bytes"
        return {"path": path, "type": kind, "nbytes": leaf.value.get("size"),
                **_chunk_summary(leaf.value)}
    if isinstance(leaf, Tagged) and leaf.code == SCALAR and isinstance(leaf.value, dict):
        return {"path": path, "type": "scalar", **scalar_summary(leaf.value)}
    if isinstance(leaf, Tagged) and leaf.code == BIGINT:
        return {"path": path, "type": "int", "value": _tagged(leaf)["bigint"]}
    if isinstance(leaf, bytes):
        return {"path": path, "type": "bytes", "nbytes": len(leaf)}
    if isinstance(leaf, str):
        return {"path": path, "type": "str", "nbytes": len(leaf.encode()), "value": _clip(leaf)}
    return {"path": path, "type": type(leaf).__name__.replace("NoneType", "none"),
            "value": jsonable(leaf)}


def _clip(text: str, width: int = 60) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."
