"""Node encoding: msgpack with links.

A node is one msgpack value. Links to other blocks are msgpack extension values, like CBOR tag 42 in
DAG-CBOR:

* ext 42 ``Link``: a strong link, payload = the binary CID. Reachability (GC, export, fsck) follows it.
* ext 43 ``HistoryLink``: a weak link to a previous commit. ``log`` follows it, GC keeps the commit node
  but not what the commit points at, export does not follow it.

Other extension codes carry typed values (tuples, arrays, ...); the tree layer gives them meaning. Their
payload is itself a msgpack value, decoded here with the same limits, so links inside them are found.

Encoding is deterministic: msgpack's shortest forms, floats always as float64, dict insertion order.
Decoding never trusts the input: any malformed, over-deep or over-long input raises :class:`DecodeError`.
"""

from __future__ import annotations

from typing import Any

import msgpack

from cas_ckpt import cid as cidlib
from cas_ckpt.errors import DecodeError, InvalidCID, OutOfMemory

LINK = 42
HISTORY_LINK = 43
MAX_DEPTH = 512
MAX_NODE_SIZE = 64 * 1024 * 1024
_SHALLOW = 4  # ext payloads nested up to this deep are decoded by msgpack.unpackb (see ext_hook)


class Link:
    """A strong link to a block, by binary CID."""

    __slots__ = ("cid",)

    def __init__(self, cid: bytes) -> None:
        self.cid = cid

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.cid == self.cid  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((type(self).__name__, self.cid))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({cidlib.to_str(self.cid)})"


class HistoryLink(Link):
    """A weak link to a previous commit."""

    __slots__ = ()


class Tagged:
    """An extension value other than a link: ``code`` plus its decoded payload."""

    __slots__ = ("code", "value")

    def __init__(self, code: int, value: Any) -> None:
        self.code = code
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Tagged) and (other.code, other.value) == (self.code, self.value)

    def __hash__(self) -> int:
        return hash((self.code, repr(self.value)))

    def __repr__(self) -> str:
        return f"Tagged({self.code}, {self.value!r})"


def _default(obj: object) -> msgpack.ExtType:
    if isinstance(obj, Link):
        return msgpack.ExtType(HISTORY_LINK if isinstance(obj, HistoryLink) else LINK, obj.cid)
    if isinstance(obj, Tagged):
        return msgpack.ExtType(obj.code, encode(obj.value))
    raise TypeError(f"cannot encode {type(obj).__name__} in a node")


def packer() -> msgpack.Packer:
    """A packer with the node settings. Not re-entrant: ``encode`` makes its own each time."""
    return msgpack.Packer(use_bin_type=True, default=_default, datetime=False)


def encode(value: Any) -> bytes:
    """Encode a value made of msgpack types, :class:`Link` and :class:`Tagged`."""
    return msgpack.packb(value, use_bin_type=True, default=_default, datetime=False)


_FIXEXT = {1: 0xD4, 2: 0xD5, 4: 0xD6, 8: 0xD7, 16: 0xD8}


def ext(code: int, payload: bytes) -> bytes:
    """The msgpack encoding of an extension value with an already encoded payload.

    Written out here (the bytes ``msgpack.packb(ExtType(code, payload))`` gives): building an
    ``ExtType`` took most of the time of encoding a link, once per chunk and per small tensor.
    """
    if not 0 <= code <= 127:
        raise ValueError(f"extension code {code} is not in 0..127")
    n = len(payload)
    if n in _FIXEXT:
        head = bytes((_FIXEXT[n], code))
    elif n < 0x100:
        head = bytes((0xC7, n, code))
    elif n < 0x10000:
        head = b"\xc8" + n.to_bytes(2, "big") + bytes((code,))
    else:
        head = b"\xc9" + n.to_bytes(4, "big") + bytes((code,))
    return head + bytes(payload)


def link(cid: bytes) -> bytes:
    return ext(LINK, cid)


try:
    from cas_ckpt import _headers
except ImportError:  # not built (setup.py): msgpack decodes every payload
    _decode_map = None
else:
    # Link is the class links decode to; the CIDs it may make are those check_binary passes at once.
    _headers.configure(Link, tuple(cidlib.PREFIXES), cidlib.DIGEST_SIZE)
    _decode_map = _headers.decode_map


class _Decoder:
    __slots__ = ("cid", "depth")

    def __init__(self, cid: bytes | None) -> None:
        self.cid = cid  # binary: its text only for an error (a base32 encoding per node read)
        self.depth = 0

    def unpack(self, data: bytes) -> Any:
        # An Unpacker keeps its parse stack on the heap. ``unpackb`` puts ~40 KiB of it on the C
        # stack, and ext values nested inside ext payloads (ext_hook -> unpack -> ...) a couple of
        # hundred deep (e.g. a state of nested tuples) overflowed the thread's stack: a segfault.
        unpacker = msgpack.Unpacker(
            ext_hook=self.ext_hook,
            raw=False,
            strict_map_key=False,
            use_list=True,
            max_buffer_size=max(len(data), 1),  # the limits unpackb derives from the input size
        )
        unpacker.feed(data)
        value = unpacker.unpack()
        if unpacker.tell() != len(data):
            raise msgpack.ExtraData(value, data[unpacker.tell() :])
        return value

    def ext_hook(self, code: int, payload: bytes) -> Any:
        if code in (LINK, HISTORY_LINK):
            try:
                target = cidlib.check_binary(payload)
            except InvalidCID as exc:
                raise DecodeError(f"bad link: {exc}", cid=_name(self.cid)) from None
            return HistoryLink(target) if code == HISTORY_LINK else Link(target)
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise DecodeError(f"nesting deeper than {MAX_DEPTH}", cid=_name(self.cid))
        try:
            if self.depth <= _SHALLOW:
                return Tagged(code, self._unpack_shallow(payload))
            return Tagged(code, self.unpack(payload))
        finally:
            self.depth -= 1

    def _unpack_shallow(self, payload: bytes) -> Any:
        """``unpack`` for a payload near the top: ``unpackb`` costs half as much as an Unpacker
        (one small tensor holds two ext values) and, this shallow, its C stack is no danger.

        An array's or blob's header (a small map of strings, unsigned ints and lists of them or
        of links) is decoded by the compiled ``_headers`` where it was built, to the same value:
        msgpack would call back into Python for its link, and this hook for its header, once
        per small array of a node.
        """
        if _decode_map is not None:
            header = _decode_map(payload)
            if header is not None:
                return header
        return msgpack.unpackb(
            payload, ext_hook=self.ext_hook, raw=False, strict_map_key=False, use_list=True
        )


def decode(data: bytes, *, cid: bytes | None = None) -> Any:
    """Decode a node, raising :class:`DecodeError` (naming ``cid``) on anything malformed."""
    if len(data) > MAX_NODE_SIZE:
        raise DecodeError(f"node of {len(data)} bytes exceeds {MAX_NODE_SIZE}", cid=_name(cid))
    try:
        return _Decoder(cid).unpack(bytes(data))
    except DecodeError:
        raise
    except RecursionError:
        raise DecodeError("nesting too deep", cid=_name(cid)) from None
    except MemoryError:
        raise OutOfMemory(f"decoding node {_name(cid)} of {len(data)} bytes ran out of memory") from None
    except (ValueError, TypeError, msgpack.UnpackException, UnicodeDecodeError, OverflowError) as e:
        raise DecodeError(f"malformed msgpack node: {type(e).__name__}: {e}", cid=_name(cid)) from None


def _name(cid: bytes | None) -> str | None:
    return cidlib.to_str(cid) if cid is not None else None


def links(value: Any) -> list[Link]:
    """All links (strong and history) inside a decoded value, in encounter order."""
    found: list[Link] = []
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, Link):
            found.append(item)
        elif isinstance(item, dict):
            stack.extend(reversed(list(item.values())))
        elif isinstance(item, list):
            stack.extend(reversed(item))
        elif isinstance(item, Tagged):
            stack.append(item.value)
    return found
