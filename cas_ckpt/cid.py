"""CIDs and hashing.

The public CID type is :class:`multiformats.CID`. Inside the library a CID travels as its binary form
(``bytes``): building a ``multiformats.CID`` costs ~100 us and its ``str()`` ~150 us, a large fraction of
hashing a 1 MiB chunk. The fast path here (a fixed prefix plus the digest, and base32 through the
standard library) is tested to give exactly what ``multiformats`` gives.

Many blocks are hashed together (:meth:`Hasher.raw_many`) on the threads of the compiled
``_hashpool`` (``setup.py``), which never take the GIL, so that hashing runs beside the Python
walk over the state instead of after each block: sha2-256 with OpenSSL's SHA-256, blake3 with
BLAKE3's official C code (vendored in ``vendor/blake3``, its SIMD code picked for the CPU at run
time). Where it was not built, hashlib and the ``blake3`` package give the same CIDs on the
thread that asks for them. The same threads fill a load's buffers from a pack's mapping and
check them (:func:`start_copies`), a piece at a time while it is in cache, with no Python call
per block. Where the CPU has AVX-512, the pool hashes 10-16 queued SHA-256 buffers of one length
(64 KiB or more: a save's chunks, a load's blocks) at once, one per vector lane
(``_sha256_x16.c``): the same digests, 1.55 times OpenSSL's throughput through the pool. BLAKE3
needs no such groups: it hashes the 1 KiB pieces of one buffer 16 (AVX-512) or 8 (AVX2) at once.

Only the CIDs cas_ckpt writes are accepted: version 1, codec ``raw`` (0x55) or ``messagepack``
(0x0201), multihash ``sha2-256`` (0x12) or ``blake3`` (0x1e), 32-byte digests, nothing trailing.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import os
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import blake3 as _blake3_module
from multiformats import CID

from cas_ckpt.errors import InvalidCID

try:
    from cas_ckpt import _hashpool
except ImportError:  # not built (no C compiler or OpenSSL headers where it was installed)
    _hashpool = None

RAW = 0x55
MSGPACK = 0x0201
SHA2_256 = 0x12
BLAKE3 = 0x1E
DIGEST_SIZE = 32

CODEC_NAMES = {RAW: "raw", MSGPACK: "messagepack"}
HASH_NAMES = {SHA2_256: "sha2-256", BLAKE3: "blake3"}
HASH_CODES = {name: code for code, name in HASH_NAMES.items()}

CIDLike = CID | str | bytes

# Varint encodings of the codec codes (0x0201 needs two bytes).
_CODEC_VARINT = {RAW: b"\x55", MSGPACK: b"\x81\x04"}
_VARINT_CODEC = {v: k for k, v in _CODEC_VARINT.items()}


def _sha256(data: object) -> bytes:
    return hashlib.sha256(data).digest()  # type: ignore[arg-type]


def _blake3(data: object) -> bytes:
    # One thread (the package's default): callers already hash chunks on several.
    return _blake3_module.blake3(data).digest()  # type: ignore[arg-type]


_DIGEST_FUNCTIONS: dict[int, Callable[[object], bytes]] = {SHA2_256: _sha256, BLAKE3: _blake3}


def _pool_threads() -> int:
    """Hashing threads beside the caller, which hashes too when it waits: one per other core."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min((cores or 1) - 1, 8))


POOL_THREADS = _pool_threads()


class Pending(Protocol):
    """CIDs being hashed; ``result()`` waits for them (once)."""

    def result(self) -> list[bytes]: ...


class _OnRequest:
    """Hashed with hashlib when asked for, on the thread asking: the fallback of ``raw_many``."""

    __slots__ = ("_buffers", "_hash")

    def __init__(self, hash_one: Callable[[object], bytes], buffers: Sequence[object]) -> None:
        self._hash = hash_one
        self._buffers = buffers

    def result(self) -> list[bytes]:
        # As bytes: blake3 refuses a buffer of another format (a float32 array's, say).
        return [self._hash(memoryview(buffer).cast("B")) for buffer in self._buffers]


def prefix(codec: int, hash_code: int) -> bytes:
    """The bytes a binary CID starts with, before the digest."""
    return b"\x01" + _CODEC_VARINT[codec] + bytes([hash_code, DIGEST_SIZE])


class Hasher:
    """Makes binary CIDs for one hash function; the per-block hot path."""

    __slots__ = ("_digest", "_node_prefix", "_raw_prefix", "hash_code", "name")

    def __init__(self, name: str = "sha2-256") -> None:
        if name not in HASH_CODES:
            raise ValueError(f"unsupported hash {name!r}; choose one of {sorted(HASH_CODES)}")
        self.name = name
        self.hash_code = HASH_CODES[name]
        self._digest = _DIGEST_FUNCTIONS[self.hash_code]
        self._raw_prefix = prefix(RAW, self.hash_code)
        self._node_prefix = prefix(MSGPACK, self.hash_code)

    def raw(self, data: object) -> bytes:
        """Binary CID of a raw chunk block (releases the GIL while hashing large buffers)."""
        return self._raw_prefix + self._digest(data)

    @property
    def pooled(self) -> bool:
        """Whether :meth:`raw_many` hashes on the compiled pool (else on the asking thread)."""
        return _hashpool is not None

    @property
    def grouped(self) -> bool:
        """Whether the pool hashes 16 SHA-256 buffers at once here (AVX-512): 10 or more queued
        of one length (64 KiB or more), or 8 or more shorter ones of one job, of any lengths
        (see ``_sha256_x16.c``)."""
        return self.pooled and self.hash_code == SHA2_256 and bool(_hashpool.GROUPING)  # type: ignore[union-attr]

    def raw_many(self, buffers: Sequence[object]) -> Pending:
        """Start the CIDs of many raw chunk blocks (C-contiguous buffers): hashed from now on
        by the compiled pool, else when asked for. The buffers must not change until
        ``result()`` returns."""
        if self.pooled:
            return _hashpool.submit(  # type: ignore[no-any-return,union-attr]
                buffers, self._raw_prefix, POOL_THREADS, hash=self.hash_code)
        return _OnRequest(self.raw, buffers)

    def node(self, data: object) -> bytes:
        """Binary CID of a msgpack node block."""
        return self._node_prefix + self._digest(data)


def digest_of(cid: bytes, data: object) -> bytes:
    """Hash ``data`` with the hash function ``cid`` names."""
    return _DIGEST_FUNCTIONS[cid[-DIGEST_SIZE - 2]](data)


def matches(cid: bytes, data: object) -> bool:
    """True when ``data`` hashes to ``cid``'s digest."""
    return digest_of(cid, data) == cid[-DIGEST_SIZE:]


def _pooled_hash(cids: Sequence[bytes]) -> int | None:
    """The hash the compiled pool checks ``cids`` with: that of their raw prefix, where they all
    have the same one and the pool is built; else None."""
    if _hashpool is None or not cids:
        return None
    head = cids[0][:-DIGEST_SIZE]
    code = _RAW_HASHES.get(head)
    if code is None or not all(cid[:-DIGEST_SIZE] == head for cid in cids):
        return None
    return code


def start_checks(cids: Sequence[bytes], buffers: Sequence[object]) -> Callable[[], list[int]]:
    """Start checking each buffer against its CID (as :meth:`Hasher.raw_many` hashes them);
    the function returned waits and gives the positions of those that do not match."""
    code = _pooled_hash(cids)
    if code is not None:
        pending = _HASHERS[code].raw_many(buffers)
        return lambda: [i for i, cid in enumerate(pending.result()) if cid != cids[i]]
    return lambda: [i for i, cid in enumerate(cids) if not matches(cid, buffers[i])]


def start_copies(
    cids: Sequence[bytes] | None, buffers: Sequence[Any], source: memoryview
) -> Callable[[], list[int]]:
    """Start filling ``buffers`` (contiguous and writable: byte views or arrays) from
    ``source`` (their bytes back to back), checking each
    against its CID unless ``cids`` is None; the function returned waits and gives the
    positions of those that do not match.

    On the compiled pool where it is built and the CIDs are raw blocks of one hash (or
    unchecked): its threads populate each buffer's pages, copy and hash it a piece at a time,
    without the GIL. Elsewhere the copy is made now on this thread and the check by
    :func:`start_checks`.
    """
    code = None if cids is None else _pooled_hash(cids)
    if _hashpool is not None and (cids is None or code is not None):
        head = None if code is None else prefix(RAW, code)  # None: copies, unchecked
        job = _hashpool.submit(buffers, head, POOL_THREADS, source, hash=code or SHA2_256)

        def wrong() -> list[int]:
            digests = job.result()
            return [] if cids is None else [i for i, cid in enumerate(digests) if cid != cids[i]]

        return wrong
    views = [memoryview(out).cast("B") for out in buffers]  # blake3 hashes byte views only
    if sum(view.nbytes for view in views) != source.nbytes:
        raise ValueError(f"the source holds {source.nbytes} bytes, not the buffers' sum")
    offset = 0
    for view in views:
        view[:] = source[offset : offset + view.nbytes]
        offset += view.nbytes
    return (lambda: []) if cids is None else start_checks(cids, views)


def codec_of(cid: bytes) -> int:
    """The content codec of a binary CID that passed :func:`check_binary`."""
    return _VARINT_CODEC[cid[1:-DIGEST_SIZE - 2]]


_HASHERS = {code: Hasher(name) for code, name in HASH_NAMES.items()}
_RAW_HASHES = {prefix(RAW, code): code for code in HASH_NAMES}  # raw blocks' prefixes -> hash
# The heads of every CID cas_ckpt writes (each codec with each hash), before the digest.
PREFIXES = frozenset(prefix(c, h) for c in CODEC_NAMES for h in HASH_NAMES)


def is_node(cid: bytes) -> bool:
    return cid[1:3] == b"\x81\x04"


def all_written_here(cids: Sequence[bytes]) -> bool:
    """True if every one of these ``bytes`` is a CID of the kinds cas_ckpt writes (the fast path
    of :func:`check_binary`, for many at once); False says only that some need its checks."""
    return min(map(len, cids), default=DIGEST_SIZE + 1) > DIGEST_SIZE and \
        {c[:-DIGEST_SIZE] for c in cids} <= PREFIXES


def check_binary(data: bytes) -> bytes:
    """Validate a binary CID strictly and return it as ``bytes``."""
    data = bytes(data)
    if data[:-DIGEST_SIZE] in PREFIXES and len(data) > DIGEST_SIZE:
        return data  # the CIDs cas_ckpt writes; anything else gets the checks below and why
    if len(data) < 4 or data[0] != 1:
        raise InvalidCID(f"not a CIDv1: {data[:8].hex()}...")
    codec = _VARINT_CODEC.get(data[1:2]) or _VARINT_CODEC.get(data[1:3])
    if codec is None:
        raise InvalidCID(f"unsupported codec in CID {data.hex()}")
    rest = data[1 + len(_CODEC_VARINT[codec]) :]
    if len(rest) < 2 or rest[0] not in HASH_NAMES:
        raise InvalidCID(f"unsupported multihash in CID {data.hex()}")
    if rest[1] != DIGEST_SIZE or len(rest) != 2 + DIGEST_SIZE:
        raise InvalidCID(
            f"CID {data.hex()} must carry exactly a {DIGEST_SIZE}-byte digest and nothing after it"
        )
    return data


def to_bytes(cid: CIDLike) -> bytes:
    """Parse a CID given as ``multiformats.CID``, multibase string or binary, strictly."""
    if isinstance(cid, (bytes, bytearray, memoryview)):
        return check_binary(bytes(cid))
    if isinstance(cid, CID):
        return check_binary(bytes(cid))
    if isinstance(cid, str):
        return check_binary(_decode_string(cid))
    raise InvalidCID(f"expected a CID, got {type(cid).__name__}")


def _decode_string(text: str) -> bytes:
    if text.startswith("b") and text.isascii():
        body = text[1:].upper()
        try:
            data = base64.b32decode(body + "=" * (-len(body) % 8))
        except ValueError as exc:
            raise InvalidCID(f"invalid base32 CID {text!r}: {exc}") from None
        # b32decode ignores the unused low bits of the last character; a canonical string has
        # them zero (as multiformats requires), so two strings never name the same CID.
        if base64.b32encode(data).decode("ascii").rstrip("=") != body.rstrip("="):
            raise InvalidCID(f"invalid base32 CID {text!r}: non-zero pad bits")
        return data
    if text.startswith(("Qm", "1")):
        raise InvalidCID(f"{text!r} is a CIDv0; only CIDv1 is used here")
    try:
        return bytes(CID.decode(text))
    except Exception as exc:  # multiformats raises several unrelated types
        raise InvalidCID(f"invalid CID {text!r}: {exc}") from None


def to_str(cid: bytes) -> str:
    """Base32 multibase text of a binary CID, equal to ``str(multiformats.CID.decode(cid))``."""
    return "b" + base64.b32encode(cid).decode("ascii").lower().rstrip("=")


def to_cid(cid: CIDLike) -> CID:
    """A ``multiformats.CID`` (base32) for any accepted CID form.

    Equal to ``CID.decode(binary).set(base="base32")``, built without its runtime type checks
    (~180 us a CID, more than a small save's own work); the parts are looked up once each.
    """
    binary = to_bytes(cid)
    parts = _CID_PARTS.get(binary[:-DIGEST_SIZE])
    if parts is None:
        parts = _CID_PARTS[binary[:-DIGEST_SIZE]] = _cid_parts(binary)
    if parts is False:
        return CID.decode(binary).set(base="base32")
    base, codec, hashfun = parts
    return CID._new_instance(CID, base, 1, codec, hashfun, binary[-DIGEST_SIZE - 2 :])


_CID_PARTS: dict[bytes, Any] = {}


def _cid_parts(binary: bytes) -> Any:
    """The multibase, multicodec and multihash objects of a CID with this prefix (False when
    this ``multiformats`` has no ``CID._new_instance`` to build one from them)."""
    reference = CID.decode(binary).set(base="base32")
    if not callable(getattr(CID, "_new_instance", None)):
        return False
    return reference.base, reference.codec, reference.hashfun


# The kinds of CID a repository writes, looked up at import: the first lookup of each (where
# multiformats registers its hash function) took 6 ms of the first save in a process.
for _codec in (RAW, MSGPACK):
    for _hash in (SHA2_256, BLAKE3):
        to_cid(prefix(_codec, _hash) + bytes(DIGEST_SIZE))


def readable_repr(obj: Any) -> str:
    """A dataclass's repr with its CIDs as their base32 text (``bagaq...``), not ``CID(...)``."""
    fields = ", ".join(f"{f.name}={_readable(getattr(obj, f.name))!r}"
                       for f in dataclasses.fields(obj) if f.repr)
    return f"{type(obj).__name__}({fields})"


def _readable(value: Any) -> Any:
    if isinstance(value, CID):
        return str(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_readable(v) for v in value)
    return value
