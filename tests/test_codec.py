"""Node encoding: round trips with links, determinism, and hostile input."""

from __future__ import annotations

import struct
import subprocess
import sys
import textwrap
import time
from typing import Any

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

import cas_ckpt
from cas_ckpt import cid as cidlib
from cas_ckpt import codec
from cas_ckpt.codec import HistoryLink, Link, Tagged

HASHER = cidlib.Hasher()
BLAKE = cidlib.Hasher("blake3")

cids = st.one_of(
    st.binary(max_size=16).map(HASHER.raw),
    st.binary(max_size=16).map(HASHER.node),
    st.binary(max_size=16).map(BLAKE.raw),
    st.binary(max_size=16).map(BLAKE.node),
)
links = st.one_of(cids.map(Link), cids.map(HistoryLink))
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=False),  # NaN != NaN; bit-exact floats are checked below
    st.text(max_size=20),
    st.binary(max_size=40),
)


def node_values() -> st.SearchStrategy[Any]:
    return st.recursive(
        st.one_of(scalars, links),
        lambda children: st.one_of(
            st.lists(children, max_size=4),
            st.dictionaries(st.one_of(st.text(max_size=8), st.integers(0, 99)), children, max_size=4),
            st.builds(Tagged, st.integers(0, 41), children),
        ),
        max_leaves=20,
    )


@given(node_values())
def test_round_trip(value: Any) -> None:
    data = codec.encode(value)
    assert codec.decode(data) == value
    # Every link comes back with its kind (strong or history) and CID.
    assert codec.links(codec.decode(data)) == codec.links(value)


@given(node_values())
def test_same_value_same_bytes(value: Any) -> None:
    data = codec.encode(value)
    assert codec.encode(codec.decode(data)) == data
    assert HASHER.node(codec.encode(value)) == HASHER.node(data)


def test_links_are_ext_42_and_43_with_the_binary_cid() -> None:
    target = HASHER.raw(b"chunk")
    assert codec.encode(Link(target)) == msgpack.packb(msgpack.ExtType(42, target))
    assert codec.encode(HistoryLink(target)) == msgpack.packb(msgpack.ExtType(43, target))
    assert codec.link(target) == codec.encode(Link(target))
    decoded = codec.decode(codec.encode({"a": Link(target), "p": [HistoryLink(target)]}))
    assert type(decoded["a"]) is Link and decoded["a"].cid == target
    assert type(decoded["p"][0]) is HistoryLink and decoded["p"][0].cid == target


def test_links_found_inside_tagged_values_in_order() -> None:
    a, b, c = (HASHER.raw(bytes([i])) for i in range(3))
    value = {"x": Tagged(3, {"chunks": [Link(a), Link(b)]}), "y": [Tagged(1, [HistoryLink(c)])]}
    assert [link.cid for link in codec.links(codec.decode(codec.encode(value)))] == [a, b, c]


def test_floats_keep_their_bits_and_dict_order() -> None:
    nan = struct.unpack("<d", struct.pack("<Q", 0x7FF0_0000_0000_0ABC))[0]
    value = {"z": -0.0, "a": nan, 3: float("inf")}
    decoded = codec.decode(codec.encode(value))
    assert list(decoded) == ["z", "a", 3]
    assert [struct.pack("<d", v) for v in decoded.values()] == [
        struct.pack("<d", v) for v in value.values()
    ]


def test_insertion_order_changes_the_bytes() -> None:
    # Determinism is per value *and order*: users get their dict order back.
    assert codec.encode({"a": 1, "b": 2}) != codec.encode({"b": 2, "a": 1})


def test_unknown_objects_cannot_be_encoded() -> None:
    with pytest.raises(TypeError, match="set"):
        codec.encode({"a": {1, 2}})


def test_decode_error_names_the_block() -> None:
    block = HASHER.node(b"\xc1")
    with pytest.raises(cas_ckpt.errors.DecodeError, match=cidlib.to_str(block)) as info:
        codec.decode(b"\xc1", cid=block)
    assert info.value.cid == cidlib.to_str(block)


# -- hostile input -------------------------------------------------------------------------------
def _ext_bomb(depth: int, code: int = 7) -> bytes:
    inner = msgpack.packb(None)
    for _ in range(depth):
        inner = msgpack.packb(msgpack.ExtType(code, inner))
    return inner


HOSTILE = {
    "empty": b"",
    "never used byte": b"\xc1",
    "trailing data": b"\x01\x02",
    "deep arrays": b"\x91" * 100_000,
    "deep maps": b"\x81\x00" * 100_000,
    "huge bin32": b"\xc6\xff\xff\xff\xff",
    "huge str32": b"\xdb\xff\xff\xff\xff",
    "huge array32": b"\xdd\xff\xff\xff\xff",
    "huge map32": b"\xdf\xff\xff\xff\xff",
    "huge ext32": b"\xc9\xff\xff\xff\xff\x07",
    "array32 of nils, short": b"\xdd\x00\x10\x00\x00" + b"\xc0" * 100,
    "truncated float64": b"\xcb\x00\x00",
    "invalid utf-8 str": b"\xa2\xff\xfe",
    "invalid utf-8 key": b"\x81\xa1\xff\x01",
    "unhashable map key": b"\x81\x90\x01",
    "bad link: empty": msgpack.packb(msgpack.ExtType(42, b"")),
    "bad link: cidv0": msgpack.packb(msgpack.ExtType(42, b"\x12\x20" + b"\x00" * 32)),
    "bad link: short digest": msgpack.packb(msgpack.ExtType(42, HASHER.raw(b"")[:-1])),
    "bad link: trailing": msgpack.packb(msgpack.ExtType(42, HASHER.raw(b"") + b"\x00")),
    "bad link: unknown codec": msgpack.packb(msgpack.ExtType(42, b"\x01\x71\x12\x20" + b"\0" * 32)),
    "bad history link": msgpack.packb(msgpack.ExtType(43, b"\x01\x55\x13\x20" + b"\0" * 32)),
    "bad link deep in ext": _ext_bomb(3).replace(
        msgpack.packb(None), msgpack.packb(msgpack.ExtType(42, b"junk"))
    ),
    "malformed ext payload": msgpack.packb(msgpack.ExtType(5, b"\xc1")),
    "ext payload with trailing data": msgpack.packb(msgpack.ExtType(5, b"\x01\x02")),
    "invalid timestamp ext": b"\xc7\x0c\xff" + b"\xff" * 12,
    "timestamp ext of bad size": b"\xc7\x05\xff" + b"\x00" * 5,
}


@pytest.mark.parametrize("data", HOSTILE.values(), ids=HOSTILE.keys())
def test_hostile_input_raises_decode_error(data: bytes) -> None:
    started = time.perf_counter()
    with pytest.raises(cas_ckpt.errors.DecodeError):
        codec.decode(data)
    assert time.perf_counter() - started < 2.0


def test_oversized_node_is_refused_before_parsing() -> None:
    with pytest.raises(cas_ckpt.errors.DecodeError, match="exceeds"):
        codec.decode(b"\xc0" * (codec.MAX_NODE_SIZE + 1))


DEEP_NESTING = textwrap.dedent(
    """
    import threading
    import msgpack
    import cas_ckpt
    from cas_ckpt import codec
    from cas_ckpt.codec import Tagged

    def bomb(depth, code=7, core=b"\\xc0"):
        inner = core
        for _ in range(depth):
            inner = msgpack.packb(msgpack.ExtType(code, inner))
        return inner

    # Hostile: ext values nested in ext payloads, far past any limit.
    for data in (bomb(600), bomb(5000), bomb(400, 1, b"\\x91" * 2000 + b"\\xc0")):
        try:
            codec.decode(data)
        except cas_ckpt.errors.DecodeError:
            pass
        else:
            raise SystemExit("decoded a bomb")

    # Legitimate: 300 nested tagged values (a state of nested tuples encodes like this).
    value = None
    for _ in range(300):
        value = Tagged(1, [value])
    decoded, depth = codec.decode(codec.encode(value)), 0
    while decoded is not None:
        assert type(decoded) is Tagged and decoded.code == 1 and len(decoded.value) == 1
        decoded, depth = decoded.value[0], depth + 1
    assert depth == 300

    # The same bomb in a thread with a 1 MiB stack: an error, not a crash.
    results = []
    def run():
        try:
            codec.decode(bomb(5000))
        except Exception as exc:
            results.append(type(exc).__name__)
    threading.stack_size(1024 * 1024)
    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert results == ["DecodeError"], results
    print("ok")
    """
)


def test_deep_ext_nesting_never_crashes_the_interpreter() -> None:
    # In a child process: each nested msgpack.unpackb used to put a ~40 KiB parse stack on the C
    # stack, so ~200 nested ext values (or ~25 in a 1 MiB thread) killed the process with SIGSEGV.
    proc = subprocess.run(
        [sys.executable, "-c", DEEP_NESTING], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", (proc.returncode, proc.stderr)


EXACT_DEPTH = textwrap.dedent(
    """
    import sys
    import msgpack
    import cas_ckpt
    from cas_ckpt import codec

    # An application may raise the recursion limit (the default stops a bomb a little before
    # MAX_DEPTH, as RecursionError): the limit itself must still hold, at exactly MAX_DEPTH.
    sys.setrecursionlimit(50_000)
    def bomb(depth):
        inner = b"\\xc0"
        for _ in range(depth):
            inner = msgpack.packb(msgpack.ExtType(7, inner))
        return inner

    codec.decode(bomb(codec.MAX_DEPTH))
    try:
        codec.decode(bomb(codec.MAX_DEPTH + 1))
    except cas_ckpt.errors.DecodeError as exc:
        assert f"nesting deeper than {codec.MAX_DEPTH}" in str(exc), exc
    else:
        raise SystemExit("decoded a node nested past MAX_DEPTH")
    print("ok")
    """
)


def test_the_ext_nesting_limit_is_exact_even_under_a_raised_recursion_limit() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", EXACT_DEPTH], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", (proc.returncode, proc.stderr)


def test_sibling_tagged_values_do_not_add_up_to_the_nesting_limit() -> None:
    value = [Tagged(1, [i]) for i in range(codec.MAX_DEPTH + 1)]
    assert codec.decode(codec.encode(value)) == value


def test_a_bad_link_is_a_decode_error_that_says_so_and_names_the_block() -> None:
    block = HASHER.node(b"x")
    data = msgpack.packb([msgpack.ExtType(42, b"\x01\x71\x12\x20" + bytes(32))])
    with pytest.raises(cas_ckpt.errors.DecodeError, match=rf"^bad link: .*\(block {cidlib.to_str(block)}\)$"):
        codec.decode(data, cid=block)


@given(st.binary(max_size=300))
def test_fuzz_random_bytes(data: bytes) -> None:
    _decode_or_decode_error(data)


@given(node_values(), st.integers(0, 10_000), st.integers(0, 255))
def test_fuzz_mutated_nodes(value: Any, position: int, byte: int) -> None:
    data = bytearray(codec.encode(value))
    data[position % len(data)] = byte
    _decode_or_decode_error(bytes(data))
    _decode_or_decode_error(bytes(data[: position % len(data)]))
    _decode_or_decode_error(bytes(data) + bytes([byte]))


@given(st.lists(st.tuples(st.sampled_from([1, 3, 5, 42, 43, 99]), st.binary(max_size=8)), max_size=8))
def test_fuzz_nested_ext_values(layers: list[tuple[int, bytes]]) -> None:
    inner = b"\xc0"
    for code, junk in layers:
        inner = msgpack.packb(msgpack.ExtType(code, inner + junk if junk else inner))
    _decode_or_decode_error(inner)


def _decode_or_decode_error(data: bytes) -> None:
    started = time.perf_counter()
    try:
        value = codec.decode(data)
    except cas_ckpt.errors.DecodeError:
        pass
    else:
        codec.links(value)  # whatever decodes is a well-formed value
    assert time.perf_counter() - started < 2.0


# -- the compiled header decoder (cas_ckpt/_headers.c) -------------------------------------------
def _exactly(a: Any, b: Any) -> bool:
    """Equal, with the same types all the way down and dict keys in the same order."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_exactly(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(map(_exactly, a, b))
    return bool(a == b)


def _by_msgpack(payload: bytes) -> Any:
    return msgpack.unpackb(payload, ext_hook=codec._Decoder(None).ext_hook, raw=False,
                           strict_map_key=False, use_list=True)


header_keys = st.sampled_from(["dtype", "shape", "chunk_size", "chunks", "order", "kind", "size",
                               "str", "é", ""]) | st.text(max_size=33)
header_values = st.one_of(
    st.text(max_size=40),
    st.integers(-3, 2**64 - 1),
    st.booleans(),
    st.none(),
    st.lists(st.integers(0, 2**64 - 1) | cids.map(Link) | st.booleans(), max_size=17),
    st.binary(max_size=4),
)
headers = st.dictionaries(header_keys, header_values, max_size=17)


@pytest.mark.skipif(codec._decode_map is None, reason="cas_ckpt._headers was not built")
@given(headers, st.data())
def test_the_compiled_header_decoder_gives_what_msgpack_gives(header: dict[str, Any], data: Any) -> None:
    """On any header (inside its subset or not) and on the same bytes mutated: what it returns
    is exactly what msgpack and the ext hook decode, and None is all it says otherwise."""
    payload = codec.encode(header)
    if data.draw(st.booleans()):
        cut = data.draw(st.integers(0, len(payload)))
        skip = data.draw(st.integers(0, 2))
        payload = payload[:cut] + data.draw(st.binary(max_size=3)) + payload[cut + skip :]
    fast = codec._decode_map(payload)
    if fast is None:
        return
    assert _exactly(fast, _by_msgpack(payload))


in_subset = st.dictionaries(
    st.text(max_size=7),  # at most 28 bytes of UTF-8 (4 a character): a fixstr, as the subset needs
    st.text(max_size=60) | st.integers(0, 2**64 - 1)
    | st.lists(st.integers(0, 2**64 - 1) | cids.map(Link), max_size=15),
    max_size=15,
)


@pytest.mark.skipif(codec._decode_map is None, reason="cas_ckpt._headers was not built")
@given(in_subset)
def test_the_compiled_header_decoder_takes_every_header_of_its_subset(header: dict[str, Any]) -> None:
    assert _exactly(codec._decode_map(codec.encode(header)), header)


@pytest.mark.skipif(codec._decode_map is None, reason="cas_ckpt._headers was not built")
def test_the_compiled_header_decoder_takes_the_headers_cas_ckpt_writes() -> None:
    chunk = HASHER.raw(b"chunk")
    header = {"dtype": "<f4", "shape": [3, 100], "chunk_size": 1 << 20, "chunks": [Link(chunk)]}
    assert _exactly(codec._decode_map(codec.encode(header)), header)
    blob = {"size": 5, "chunks": [Link(chunk), Link(BLAKE.raw(b"x"))], "str": "x" * 200}
    assert _exactly(codec._decode_map(codec.encode(blob)), blob)
    assert codec._decode_map(codec.encode({"history": [HistoryLink(chunk)]})) is None
    assert codec._decode_map(codec.encode({"dtype": "<f4", "data": b"\0" * 4})) is None
    for bad in (chunk[:-1], chunk + b"\0", b"\x01\x71" + chunk[2:], b"\x00" + chunk[1:]):
        # A digest cut short or too long, another codec, CIDv0's first byte: check_binary's to judge
        payload = b"\x81\xa1c\x91" + codec.ext(codec.LINK, bad)
        assert codec._decode_map(payload) is None, bad.hex()


@pytest.mark.slow
@pytest.mark.skipif(codec._decode_map is None, reason="cas_ckpt._headers was not built")
def test_valgrind_finds_nothing_in_the_header_decoder(tmp_path: Any) -> None:
    """memcheck over 20,000 payloads, whole, cut short and changed: no report about _headers.c."""
    import os
    import re
    import shutil
    from pathlib import Path

    if shutil.which("valgrind") is None:
        pytest.skip("valgrind is not installed")
    log = tmp_path / "valgrind.log"
    script = Path(__file__).parent / "scripts" / "headers_stress.py"
    done = subprocess.run(
        ["valgrind", "--tool=memcheck", f"--log-file={log}", sys.executable, str(script)],
        capture_output=True, text=True, timeout=900, env={**os.environ, "PYTHONMALLOC": "malloc"},
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
    ours = re.compile(r"^==\d+== +(at|by) 0x[0-9A-F]+: \w+ \(_headers\.c:\d+\)", re.M)
    reports = [r for r in log.read_text().split("-" * 64) if ours.search(r)]
    assert reports == [], "\n".join(reports[:2])
