"""A Hypothesis fuzz of a real ``cas-ckpt serve`` process (issue #48, item 8).

Requests are built byte by byte and sent over a plain socket (odd but legal HTTP/1.1: any method,
percent-encoded text, long targets, ``..`` segments, repeated and contradictory query parameters,
random ``Accept``, ``Range``, ``If-None-Match``, ``Authorization``, ``Cookie`` and ``Content-Type``
headers, bodies with a matching ``Content-Length`` or chunked). The answers are parsed with
``http.client``. For every request:

* an answer arrives, completely, within :data:`ANSWER_WITHIN` seconds (never a hang);
* its status is never 500, nor a 5xx other than 501 (``/ipns``, a path inside a CAR root), 502 (a
  damaged block: the repository holds one, on purpose) and 503 with ``Retry-After`` (over the
  stream cap);
* every 4xx/5xx answer (but to HEAD) has a JSON body with a string ``"error"``;
* every 2xx answer is right for its route: a raw block hashes to its CID (a range is the slice of
  the block), a CAR parses and is byte for byte the export (or its root block alone), JSON routes
  parse, pages and assets are the packaged files;
* a connection kept alive after the answer serves a second request correctly (no desync from a
  body the server did not read);
* the server's stderr never holds a ``Traceback``.

The same fuzz runs against the server with ``--token``: a request that presents neither the token
(``Authorization: Bearer``) nor, on the browser's routes only, the session cookie that ``/?token=``
gives (or on a landing page the token itself as ``?token=``) is 401 with a JSON body; the session
cookie (or the token as a cookie) never unlocks ``/ipfs``, ``/refs`` or the other API routes.

Default run: 300 examples per server (about 20 s in all); ``CAS_CKPT_LONG=1``: 4000 each.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import socket
import string
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from http.cookies import SimpleCookie
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yarl
from helpers import flip_byte
from http_servers import ServerProcess
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cas_ckpt
from cas_ckpt import car
from cas_ckpt import cid as cidlib
from cas_ckpt.maintenance.walk import data_blocks
from cas_ckpt.web import routes as web_routes

LONG = os.environ.get("CAS_CKPT_LONG") == "1"
EXAMPLES = 4000 if LONG else 300
ANSWER_WITHIN = 10.0  # seconds for a whole answer
TOKEN = "fuzz-T0ken_4a7f"
RAW = "application/vnd.ipld.raw"
CAR = "application/vnd.ipld.car"
STATIC = Path(web_routes.__file__).parent / "static"
API_ENDPOINTS = sorted(web_routes._API)
PAGES = list(web_routes.PAGES)
ASSETS = list(web_routes.ASSETS)
MAX_LINE = 8190  # aiohttp's limit on a request line or header line: longer cannot be parsed


# --------------------------------------------------------------------------------------------
# The repository and its server
# --------------------------------------------------------------------------------------------
def _state(step: int) -> dict[str, Any]:
    rng = np.random.default_rng(step)
    return {"model": {"w": rng.random((2, 200_000), np.float32), "b": np.arange(10, dtype=np.int64)},
            "opt": {"m": rng.random(100_000)}, "step": step, "text": "é" * 100}


@dataclass(repr=False)
class Repo:
    path: Path
    roots: dict[str, bytes]  # name -> commit CID
    blocks: dict[bytes, bytes]  # every block, as it was before the damage
    reach: dict[bytes, list[bytes]]  # every block -> the blocks of its CAR (dag-scope=all), in order
    damaged: bytes  # a raw chunk whose stored bytes no longer match its CID
    refs: dict[str, str]

    def __repr__(self) -> str:
        return f"Repo({self.path})"

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:  # Hypothesis prints this
        printer.text(repr(self))

    def car_all(self, root: bytes) -> bytes:
        out = [car.car_header([root])]
        for cid in self.reach[root]:
            out += [car.section_prefix(cid, self.blocks[cid]), self.blocks[cid]]
        return b"".join(out)

    def car_block(self, root: bytes) -> bytes:
        return car.car_header([root]) + car.section_prefix(root, self.blocks[root]) + self.blocks[root]

    def car_before_damage(self, root: bytes) -> bytes | None:
        """The CAR's bytes before the damaged block's section, if the CAR holds it."""
        if self.damaged not in self.reach[root]:
            return None
        out = [car.car_header([root])]
        for cid in self.reach[root]:
            if cid == self.damaged:
                break
            out += [car.section_prefix(cid, self.blocks[cid]), self.blocks[cid]]
        return b"".join(out)


@pytest.fixture(scope="module")
def fuzz_repo(tmp_path_factory: pytest.TempPathFactory) -> Repo:
    return build_repo(tmp_path_factory.mktemp("fuzz") / "repo")


def build_repo(path: Path) -> Repo:
    """Two commits on main (one pinned), a ref with a slash, and a checkpoint on ref "damaged"
    one of whose chunks is damaged on disk."""
    with cas_ckpt.open(path) as repo:
        roots = {"c1": bytes(repo.save(_state(1), step=1, metadata={"loss": 0.5, "raw": b"\x00\x01"})),
                 "c2": bytes(repo.save(_state(2), step=2, message="second")),
                 "exp": bytes(repo.save({"x": np.arange(5)}, ref="runs/exp-7")),
                 "bad": bytes(repo.save({"w": np.random.default_rng(99).random(300_000, np.float32)},
                                        ref="damaged", step=7))}
        repo.pin(roots["c1"])
        blocks: dict[bytes, bytes] = {}
        for root in roots.values():
            for cid in data_blocks(repo.blocks, root):
                blocks[cid] = repo.blocks.get(cid, verify=True)
        reach = {cid: list(data_blocks(repo.blocks, cid)) for cid in blocks}
        damaged = next(c for c in reach[roots["bad"]] if not cidlib.is_node(c))
        assert all(damaged not in reach[r] for n, r in roots.items() if n != "bad")
        pack, offset, _ = repo.blocks.locate(damaged)
        refs = {name: str(cid) for name, cid in repo.refs().items()}
    flip_byte(path / "packs" / pack, offset + 100)
    with cas_ckpt.open(path, read_only=True) as repo, pytest.raises(cas_ckpt.errors.CorruptBlock):
        repo.blocks.get(damaged, verify=True)
    return Repo(path, roots, blocks, reach, damaged, refs)


@dataclass(repr=False)
class Target:
    """The server under fuzz: its port, token (or None) and a browser session's cookie."""

    served: ServerProcess
    repo: Repo
    token: str | None
    session: str = ""  # "name=value" of the session cookie a browser login gave

    def __repr__(self) -> str:
        return f"Target({self.served.url}, token={self.token!r})"

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:  # Hypothesis prints this
        printer.text(repr(self))


@pytest.fixture(scope="module", params=["open", "token"])
def target(request: pytest.FixtureRequest, fuzz_repo: Repo) -> Iterator[Target]:
    token = TOKEN if request.param == "token" else None
    served = ServerProcess(fuzz_repo.path, *(["--token", token] if token else []))
    try:
        found = Target(served, fuzz_repo, token)
        if token:
            found.session = _browser_login(served.port, token)
        yield found
    finally:
        served.stop()


def _browser_login(port: int, token: str) -> str:
    """Open ``/?token=T`` as a browser does, following redirects; the session cookie set."""
    cookies: dict[str, str] = {}
    location = f"/?token={token}"
    for _ in range(5):
        header = [("Cookie", "; ".join(f"{k}={v}" for k, v in cookies.items()))] if cookies else []
        answer = exchange(port, "GET", location, header)
        assert answer.status is not None, answer.problem
        for value in answer.headers.get_all("Set-Cookie") or []:
            for name, morsel in SimpleCookie(value).items():
                cookies[name] = morsel.value
        if answer.status not in (301, 302, 303, 307, 308):
            break
        location = answer.headers["Location"]
    assert answer.status == 200, f"the browser login ended with {answer.status}: {answer.body[:200]!r}"
    assert cookies, "the browser login /?token=T set no cookie"
    return "; ".join(f"{k}={v}" for k, v in cookies.items())


# --------------------------------------------------------------------------------------------
# A raw client
# --------------------------------------------------------------------------------------------
@dataclass
class Answer:
    status: int | None = None
    headers: Any = None
    body: bytes = b""
    complete: bool = False  # the whole body arrived as framed
    problem: str = ""  # why no (complete) answer
    elapsed: float = 0.0
    will_close: bool = True
    second: str = ""  # what the kept-alive connection's second request got, if one was sent


def _request_bytes(method: str, target: str, port: int, headers: list[tuple[str, str]], body: bytes | None,
                   chunked: bool, keep_alive: bool) -> bytes:
    lines = [f"{method} {target} HTTP/1.1", f"Host: 127.0.0.1:{port}"]
    lines += [f"{name}: {value}" for name, value in headers]
    if body is not None:
        lines.append("Transfer-Encoding: chunked" if chunked else f"Content-Length: {len(body)}")
    lines.append("Connection: " + ("keep-alive" if keep_alive else "close"))
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    if body is None:
        return head
    if not chunked:
        return head + body
    pieces = [body[i:i + 1000] for i in range(0, len(body), 1000)]
    return head + b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


def _read_answer(sock: socket.socket, method: str, deadline: float) -> Answer:
    answer = Answer()
    response = http.client.HTTPResponse(sock, method=method)
    try:
        response.begin()
        answer.status, answer.headers = response.status, response.headers
        answer.will_close = response.will_close
        parts = []
        while True:
            if time.monotonic() > deadline:
                answer.problem = f"the body took over {ANSWER_WITHIN} s"
                break
            piece = response.read(65536)
            if not piece:
                answer.complete = True
                break
            parts.append(piece)
        answer.body = b"".join(parts)
    except http.client.IncompleteRead as exc:
        answer.body = b"".join(parts) + exc.partial
        answer.problem = f"the body was cut short: {exc!r}"
    except TimeoutError:
        answer.problem = f"no complete answer within {ANSWER_WITHIN} s"
    except (http.client.HTTPException, OSError) as exc:
        answer.problem = f"no valid answer: {exc!r}"
    finally:
        response.close()
    return answer


def exchange(port: int, method: str, target: str, headers: list[tuple[str, str]], body: bytes | None = None,
             *, chunked: bool = False, keep_alive: bool = False, second: bytes | None = None) -> Answer:
    """Send one request on a new connection; its answer. With ``keep_alive`` and ``second``, and
    an answer that keeps the connection, ``second`` (a request) is sent on it too and the first
    line of its answer recorded (``second``)."""
    started = time.monotonic()
    deadline = started + ANSWER_WITHIN
    with socket.create_connection(("127.0.0.1", port), timeout=ANSWER_WITHIN) as sock:
        try:
            sock.sendall(_request_bytes(method, target, port, headers, body, chunked, keep_alive))
        except OSError as exc:  # the server may answer and close before reading everything
            sent_error = repr(exc)
        else:
            sent_error = ""
        answer = _read_answer(sock, method, deadline)
        answer.elapsed = time.monotonic() - started
        if answer.status is None and sent_error:
            answer.problem += f" (sending failed: {sent_error})"
        if second is not None and keep_alive and answer.complete and not answer.will_close:
            try:
                sock.sendall(second)
            except OSError:
                answer.second = "closed"
            else:
                follow = _read_answer(sock, "GET", time.monotonic() + ANSWER_WITHIN)
                if follow.status is None and "RemoteDisconnected" in follow.problem:
                    answer.second = "closed"  # an idle connection closed: a client tries again
                else:
                    answer.second = f"{follow.status} {follow.body[:200]!r} {follow.problem}"
    return answer


# --------------------------------------------------------------------------------------------
# Strategies
# --------------------------------------------------------------------------------------------
METHODS = ["GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "PATCH"]
TOKEN_CHARS = string.ascii_letters + string.digits + "!#$%&'*+-.^_`|~"
token_text = st.text(alphabet=TOKEN_CHARS, min_size=1, max_size=12)
# A header value: visible ASCII and spaces, sometimes obs-text (legal, if discouraged), no CR/LF.
header_text = st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=60) | \
    st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0xFF, exclude_characters="\x7f"),
            max_size=30)
any_text = st.text(max_size=40)  # any unicode, percent-encoded where it goes into a URL


def _quote(text: str, safe: str = "") -> str:
    return urllib.parse.quote(text, safe=safe, errors="surrogatepass")


@st.composite
def cid_text(draw: st.DrawFn, repo: Repo) -> str:
    known = sorted(repo.blocks)
    kind = draw(st.sampled_from(["known"] * 6 + ["damaged", "probe", "unknown", "other-base",
                                 "cidv0", "mangled", "random", "identity"]))
    if kind == "known":
        return cidlib.to_str(draw(st.sampled_from(known)))
    if kind == "damaged":
        return cidlib.to_str(repo.damaged)
    if kind == "probe":
        return "bafkqaaa"
    if kind == "unknown":  # well formed, not stored: a known CID's prefix with another digest
        base = draw(st.sampled_from(known))
        return cidlib.to_str(base[:-32] + draw(st.binary(min_size=32, max_size=32)))
    if kind == "other-base":
        from multiformats import CID

        base = CID.decode(draw(st.sampled_from(known)))
        bases = ["base58btc", "base36", "base32upper", "base64url", "base16"]
        return base.encode(draw(st.sampled_from(bases)))
    if kind == "cidv0":
        return "Qm" + draw(st.text(alphabet="123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz",
                                   min_size=44, max_size=44))
    if kind == "mangled":
        text = cidlib.to_str(draw(st.sampled_from(known)))
        cut = draw(st.integers(1, len(text)))
        return draw(st.sampled_from([text[:cut], text + draw(token_text), text.upper(),
                                     text[:cut] + "a" + text[cut + 1:], text[:cut] + "8" + text[cut + 1:]]))
    if kind == "identity":
        from multiformats import CID, multihash

        return str(CID("base32", 1, "raw", multihash.digest(draw(st.binary(max_size=40)), "identity")))
    return draw(any_text)


@st.composite
def segment(draw: st.DrawFn) -> str:
    """One path segment, percent-encoded (or a dot segment, or legal raw punctuation)."""
    return draw(st.one_of(
        any_text.map(_quote),
        st.sampled_from(["..", ".", "", "%2e%2e", "%2E", "%2F", "%25", "%00", "%FF%FE", "~", "main~1",
                         "!$&'()*+,;=:@", "%C3%A9", "%F0%9F%98%80"]),
        token_text,
    ))


@st.composite
def ref_name(draw: st.DrawFn, repo: Repo) -> str:
    name = draw(st.one_of(st.sampled_from([*repo.refs, "main~1", "main~2", "main~99", "main^", "nope",
                                           "runs", "runs/", "../main", "HEAD"]),
                          any_text, st.sampled_from(sorted(repo.blocks)).map(cidlib.to_str),
                          st.sampled_from(sorted(repo.blocks)).map(lambda c: cidlib.to_str(c)[:12])))
    return _quote(name, safe=draw(st.sampled_from(["/", "", "/~"])))


@st.composite
def request_path(draw: st.DrawFn, repo: Repo) -> str:
    kind = draw(st.sampled_from(["ipfs"] * 6 + ["ipfs-sub", "ipns", "refs", "ref", "resolve", "log", "reflog",
                                                "pins", "config", "root", "ui", "page", "static"] +
                                ["api"] * 3 + ["random", "long", "dots", "unicode"]))
    if kind in ("ipfs", "ipfs-sub"):
        path = "/ipfs/" + _quote(draw(cid_text(repo)))
        if kind == "ipfs-sub" or draw(st.integers(0, 9)) == 0:
            path += "/" + "/".join(draw(st.lists(segment(), min_size=1, max_size=4)))
        return path
    if kind == "ipns":
        return "/ipns/" + "/".join(draw(st.lists(segment(), max_size=3)))
    if kind == "refs":
        return "/refs"
    if kind in ("ref", "resolve", "log", "reflog"):
        return {"ref": "/refs/", "resolve": "/resolve/", "log": "/log/", "reflog": "/reflog/"}[kind] + \
            draw(ref_name(repo))
    if kind in ("pins", "config"):
        return "/" + kind
    if kind == "root":
        return "/"
    if kind == "ui":
        return draw(st.sampled_from(["/ui", "/ui/"]))
    if kind == "page":
        return "/ui/" + draw(st.one_of(st.sampled_from([*PAGES, "api", "static", "index.html"]), segment()))
    if kind == "static":
        return "/ui/static/" + draw(st.one_of(st.sampled_from([*ASSETS, "index.html", "../index.html",
                                                                       "..%2Findex.html", "%2e%2e"]),
                                               segment()))
    if kind == "api":
        return "/ui/api/" + draw(st.one_of(st.sampled_from(API_ENDPOINTS), segment()))
    if kind == "long":
        size = draw(st.sampled_from([1000, 4000, 8000, 8200, 12000]))
        return "/" + draw(st.sampled_from(["ipfs/", "refs/", "ui/api/tree?", "", "log/"])) + \
            "a" * size
    if kind == "dots":
        return "/" + "/".join(draw(st.lists(st.sampled_from(["..", ".", "ui", "static", "refs", "ipfs",
                                                             "%2e%2e", "app.js", "etc", "passwd"]),
                                             min_size=1, max_size=8)))
    if kind == "unicode":
        return "/" + _quote(draw(st.text(min_size=1, max_size=30)), safe="/")
    return "/" + "/".join(draw(st.lists(segment(), max_size=5)))


QUERY_KEYS = ["format", "dag-scope", "entity-bytes", "car-version", "car-order", "car-dups", "limit",
              "offset", "target", "ref", "refs", "step", "path", "q", "token", "prefix", "every",
              "changed", "a", "b"]


@st.composite
def query_value(draw: st.DrawFn, repo: Repo) -> str:
    cids = [cidlib.to_str(c) for c in sorted(repo.blocks)]
    return draw(st.one_of(
        st.sampled_from(["raw", "car", "RAW", "tar", "dag-json", "html", "", "block", "entity", "all",
                         "files", "1", "2", "0", "-1", "99999999999999999999", "1e3", "0:*", "0:10", "-5:*",
                         "x:y", "dfs", "unk", "n", "y", "main", "main~1", "runs/exp-7", "damaged", "nope",
                         "model", "model.w", "opt.m", "w", "x", "step", TOKEN, "wrong-token"]),
        st.sampled_from(cids),
        st.integers(-(2 ** 70), 2 ** 70).map(str),
        any_text,
    ))


@st.composite
def query_string(draw: st.DrawFn, repo: Repo) -> str:
    pairs = draw(st.lists(st.tuples(st.one_of(st.sampled_from(QUERY_KEYS), any_text), query_value(repo)),
                          max_size=5))
    how = draw(st.sampled_from(["quote", "plus", "raw-safe"]))
    if how == "plus":
        return urllib.parse.urlencode(pairs)
    safe = "" if how == "quote" else "/:@!$'()*,"
    return "&".join(f"{_quote(k, safe)}={_quote(v, safe)}" if draw(st.booleans()) or v else _quote(k, safe)
                    for k, v in pairs)


MEDIA = [RAW, CAR, f"{CAR}; version=1", f"{CAR}; version=2", f"{CAR}; order=dfs; dups=n", f"{CAR}; dups=y",
         f"{CAR}; order=unk", f"{CAR}; order=xyz", "text/html", "*/*", "application/*", "application/json",
         "application/cbor", "application/x-tar", "image/*", "application/vnd.ipfs.ipns-record", ""]


@st.composite
def accept(draw: st.DrawFn) -> str:
    items = []
    for _ in range(draw(st.integers(1, 4))):
        media = draw(st.one_of(st.sampled_from(MEDIA), st.tuples(token_text, token_text).map("/".join)))
        q = draw(st.one_of(st.none(), st.floats(0, 1).map(lambda f: f"{f:.3f}"),
                           st.sampled_from(["0", "1", "abc", "", "1.5", "-1", "nan", "inf"])))
        items.append(media if q is None else f"{media};q={q}")
    return draw(st.sampled_from([",", ", ", " , "])).join(items)


@st.composite
def range_header(draw: st.DrawFn) -> str:
    n = (st.integers(0, 2000) | st.integers(0, 1_200_000)).map(str)
    spec = st.one_of(st.tuples(n, n).map("-".join), n.map(lambda a: a + "-"), n.map(lambda a: "-" + a),
                     st.sampled_from(["", "-", "a-b", "5-2", "-0", "0-0", "1-1", "99999999999999999999-"]))
    unit = draw(st.sampled_from(["bytes=", "bytes=", "bytes=", "items=", "bytes =", "BYTES=", ""]))
    return unit + ",".join(draw(st.lists(spec, min_size=1, max_size=3)))


@st.composite
def if_none_match(draw: st.DrawFn, repo: Repo) -> str:
    cid = cidlib.to_str(draw(st.sampled_from(sorted(repo.blocks))))
    tags = draw(st.lists(st.sampled_from([f'"{cid}.raw"', f'W/"{cid}.raw"', f'"{cid}.car.dfs.n.all"',
                                          f'"{cid}.car.dfs.n.block"', "*", '"x"', "", cid]), min_size=1,
                         max_size=3))
    return ", ".join(tags)


@st.composite
def authorization(draw: st.DrawFn) -> str:
    scheme = draw(st.sampled_from(["Bearer", "bearer", "Basic", "Digest", "Token", "", "Bearer  "]) |
                  token_text)
    value = draw(st.one_of(token_text, header_text,
                           st.sampled_from(["wrong", TOKEN + "x", TOKEN[:-1], "", "t\xf6k\xe9n"])))
    return f"{scheme} {value}".strip()


@st.composite
def cookie(draw: st.DrawFn) -> str:
    pairs = draw(st.lists(st.tuples(st.sampled_from(["cas_ckpt_token", "cas_ckpt_session", "session", "a"]) |
                                    token_text,
                                    st.sampled_from([TOKEN, "wrong", "", '"q"', "1.2", "9999999999.abc",
                                                     "\xe9t\xe9"]) |
                                    token_text), min_size=1, max_size=3))
    return "; ".join(f"{k}={v}" for k, v in pairs)


@dataclass
class Request:
    method: str
    path: str
    query: str
    headers: list[tuple[str, str]]
    body: bytes | None
    chunked: bool
    keep_alive: bool
    bearer: bool = False  # carries Authorization: Bearer <the token>
    session: bool = False  # carries the browser session's cookie
    token_cookie: bool = False  # carries the token itself as a cookie

    @property
    def target(self) -> str:
        return self.path + (f"?{self.query}" if self.query else "")

    @property
    def seen_path(self) -> str:
        """The path as aiohttp's parser takes it (measured): the target is split at its first
        ``?``; without one, a ``#`` starts the fragment, which is dropped (``/#`` is ``/``);
        with one, a ``#`` before it stays in the path (``/#?a=b`` is the path ``/#``)."""
        return self.path if self.query else self.path.split("#", 1)[0]

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:  # Hypothesis prints this
        printer.text(repr(self))

    def __repr__(self) -> str:  # what a failure prints: the request as sent
        chunked = "chunked " if self.chunked else ""
        body = "" if self.body is None else f" + {chunked}body {self.body[:40]!r}" \
            f"({len(self.body)} bytes)"
        heads = "".join(f"\n    {k}: {v}" for k, v in self.headers)
        return f"{self.method} {self.target[:300]}{'...' if len(self.target) > 300 else ''}{heads}{body}"


@st.composite
def requests(draw: st.DrawFn, repo: Repo, session: str) -> Request:
    method = draw(st.sampled_from(METHODS[:2] * 4 + METHODS))
    path = draw(request_path(repo))
    query = draw(st.one_of(st.just(""), query_string(repo)))
    headers: list[tuple[str, str]] = []
    optional = {
        "Accept": accept(), "Range": range_header(), "If-None-Match": if_none_match(repo),
        "Authorization": authorization(), "Cookie": cookie(),
        "Content-Type": st.sampled_from(["application/json", "text/plain", "application/octet-stream",
                                         "multipart/form-data; boundary=x", RAW, CAR]) | header_text,
        "X-Fuzz": header_text, "Accept-Encoding": st.sampled_from(["gzip", "br", "identity", "*;q=0"]),
        "If-Modified-Since": st.sampled_from(["Mon, 07 Dec 2026 20:14:15 GMT", "yesterday"]),
        "Origin": st.sampled_from(["http://evil.example", "null"]),
    }
    for name in draw(st.lists(st.sampled_from(sorted(optional)), unique=True, max_size=5)):
        headers.append((name, draw(optional[name])))
    if path.startswith("/ipfs/") and draw(st.integers(0, 4)) > 0:  # mostly a format the gateway serves
        ask = draw(st.sampled_from(["format=raw", "format=raw", RAW, "format=car",
                                    "format=car&dag-scope=block", "format=car&dag-scope=entity", RAW, CAR]))
        if draw(st.booleans()):  # a plain request, as a client sends it: GET, nothing else in the query
            method, query = "GET", ""
        if ask.startswith("format="):
            query = ask + (f"&{query}" if query else "")
        else:
            headers = [(k, v) for k, v in headers if k != "Accept"] + [("Accept", ask)]
        if draw(st.integers(0, 2)) > 0:
            extra = draw(st.sampled_from(["Range", "Range", "If-None-Match"]))
            headers = [(k, v) for k, v in headers if k != extra] + [(extra, draw(optional[extra]))]
    bearer = session_cookie = token_cookie = False
    if draw(st.integers(0, 3)) == 0:  # the real token
        headers = [(k, v) for k, v in headers if k != "Authorization"]
        headers.append(("Authorization", f"Bearer {TOKEN}"))
        bearer = True
    if session and draw(st.integers(0, 3)) == 0:  # the browser session's cookie
        headers = [(k, v) for k, v in headers if k != "Cookie"] + [("Cookie", session)]
        session_cookie = True
    elif session and draw(st.integers(0, 5)) == 0:  # the session cookie's name, a forged value
        forged = draw(st.sampled_from(["1.", "9999999999.", "x.", "", "1.\xe9"]) | header_text | token_text)
        headers = [(k, v) for k, v in headers if k != "Cookie"]
        headers.append(("Cookie", f"{session.split('=', 1)[0]}={forged}".replace(";", "")))
    elif draw(st.integers(0, 9)) == 0:  # the token itself as a cookie (the old way)
        headers = [(k, v) for k, v in headers if k != "Cookie"] + [("Cookie", f"cas_ckpt_token={TOKEN}")]
        token_cookie = True
    body = draw(st.one_of(st.none(), st.binary(max_size=4096)))
    return Request(method, path, query, headers, body, chunked=body is not None and draw(st.booleans()),
                   keep_alive=draw(st.booleans()), bearer=bearer, session=session_cookie,
                   token_cookie=token_cookie)


# --------------------------------------------------------------------------------------------
# What an answer must be
# --------------------------------------------------------------------------------------------
_ROUTES = [
    ("ipfs", r"/ipfs/(?P<cid>[^{}/]+)"), ("ipfs-sub", r"/ipfs/(?P<cid>[^{}/]+)/(?P<path>.*)"),
    ("ipns", r"/ipns/(?P<name>.*)"), ("refs", r"/refs"), ("ref", r"/refs/(?P<name>.+)"),
    ("resolve", r"/resolve/(?P<target>.+)"), ("log", r"/log/(?P<target>.+)"),
    ("reflog", r"/reflog/(?P<name>.+)"), ("pins", r"/pins"), ("config", r"/config"), ("root", r"/"),
    ("page", r"/ui/?"), ("asset", r"/ui/static/(?P<name>[^{}/]+)"),
    *[("api", "/ui/api/" + re.escape(p)) for p in API_ENDPOINTS], ("page", r"/ui/(?P<page>[^{}/]+)"),
]


def route_of(path: str) -> tuple[str, dict[str, str]]:
    """The route the server's router picks for ``path`` (as aiohttp decodes it: everything but
    %2F and %25 before matching, those two in the matched values), and its values."""
    try:
        safe = yarl.URL.build(path=path, encoded=True).path_safe
    except ValueError:
        return "none", {}
    for name, pattern in _ROUTES:
        found = re.fullmatch(pattern, safe)
        if found:
            values = {k: urllib.parse.unquote(v) for k, v in found.groupdict().items()}
            if name == "ipfs-sub" and values["path"] == "":
                name = "ipfs"  # /ipfs/{cid}/: no path below the CID
            return name, values
    return "none", {}


def _first(query: str, key: str) -> str | None:
    for k, v in urllib.parse.parse_qsl(query, keep_blank_values=True):
        if k == key:
            return v
    return None


def _too_long(request: Request) -> bool:
    """A request line or header line longer than the server can read (answered before routing)."""
    line = len(f"{request.method} {request.target} HTTP/1.1")
    return line > MAX_LINE or any(len(k) + 2 + len(v.encode("latin-1")) > MAX_LINE
                                  for k, v in request.headers)


def check_error_body(request: Request, answer: Answer) -> list[str]:
    if request.method == "HEAD":
        return []
    problems = []
    kind = answer.headers.get("Content-Type", "")
    if not kind.startswith("application/json"):
        problems.append(f"error answer's Content-Type is {kind!r}, not application/json")
    try:
        body = json.loads(answer.body)
    except ValueError:
        return [*problems, f"error answer's body is not JSON: {answer.body[:300]!r}"]
    if not (isinstance(body, dict) and isinstance(body.get("error"), str)):
        problems.append(f"error answer's JSON has no string 'error': {answer.body[:300]!r}")
    return problems


def check_ipfs(request: Request, answer: Answer, values: dict[str, str], repo: Repo, route: str) -> list[str]:
    try:
        cid = cidlib.to_bytes(values["cid"])
    except cas_ckpt.errors.InvalidCID:
        cid = None
    probe = values["cid"] == "bafkqaaa"
    kind = answer.headers.get("Content-Type", "")
    fmt = _first(request.query, "format")
    if route == "ipfs-sub":
        return [f"{answer.status} for a path below a CID"]
    if cid is None and not probe:
        return [f"{answer.status} for a CID that does not parse: {values['cid']!r}"]
    if kind == RAW:
        if fmt not in (None, "raw"):
            return [f"a raw block for format={fmt!r}"]
        if probe:
            return [] if answer.body == b"" else [f"the probe's raw block is {answer.body[:50]!r}"]
        if cid not in repo.blocks:
            return [f"{answer.status} for a block the repository does not hold"]
        if cid == repo.damaged and request.method == "GET":
            return ["the damaged block was sent"]
        block = repo.blocks[cid]
        if answer.status == 206:
            got = re.fullmatch(r"bytes (\d+)-(\d+)/(\d+)", answer.headers.get("Content-Range", ""))
            if not got or int(got[3]) != len(block) or int(got[1]) > int(got[2]):
                return [f"206 with Content-Range {answer.headers.get('Content-Range')!r}"]
            start, end = int(got[1]), int(got[2])
            if request.method == "HEAD":
                return []
            return [] if answer.body == block[start:end + 1] else ["a 206 body is not the block's slice"]
        if request.method == "HEAD":
            length = answer.headers.get("Content-Length")
            return [] if length == str(len(block)) else [f"HEAD's Content-Length {length} != {len(block)}"]
        if answer.body != block or not cidlib.matches(cid, answer.body):
            return ["a raw block's bytes do not hash to its CID"]
        return []
    if kind.startswith(CAR):
        if fmt not in (None, "car"):
            return [f"a CAR for format={fmt!r}"]
        if request.method == "HEAD":
            return [] if answer.body == b"" else ["HEAD with a body"]
        if probe:
            expected = car.car_header([b"\x01\x55\x00\x00"])
            return [] if answer.body == expected else [f"the probe's CAR is {answer.body[:80]!r}"]
        if cid not in repo.blocks:
            return [f"{answer.status} CAR for a root the repository does not hold"]
        if answer.body in (repo.car_all(cid), repo.car_block(cid)) and cid != repo.damaged:
            return []
        return _car_problems(answer.body, cid, repo)
    return [f"{answer.status} on /ipfs with Content-Type {kind!r}"]


def _car_problems(body: bytes, root: bytes, repo: Repo) -> list[str]:
    import io

    try:
        roots, src = car._read_header(io.BytesIO(body))
        got = [cid for cid, _, _ in car._iter_blocks(src)]
    except cas_ckpt.errors.CarError as exc:
        return [f"the CAR does not parse or a block fails its hash: {exc}"]
    if roots != [root]:
        return [f"the CAR's roots are {roots}, not the requested CID"]
    return [f"the CAR's blocks ({len(got)}) are neither the root alone nor its whole DAG "
            f"({len(repo.reach[root])})"]


def check_ok(request: Request, answer: Answer, route: str, values: dict[str, str], repo: Repo) -> list[str]:
    """A 2xx answer right for its route."""
    kind = answer.headers.get("Content-Type", "")
    if request.method not in ("GET", "HEAD"):
        return [f"{answer.status} for {request.method}: no route writes (yet)"]
    head = request.method == "HEAD"
    if head and answer.body:
        return ["HEAD with a body"]
    if route in ("ipfs", "ipfs-sub"):
        return check_ipfs(request, answer, values, repo, route)
    if route in ("refs", "ref", "resolve", "log", "reflog", "pins", "config", "api"):
        if not kind.startswith("application/json"):
            return [f"{route}: 2xx with Content-Type {kind!r}"]
        if head:
            return []
        try:
            value = json.loads(answer.body)
        except ValueError:
            return [f"{route}: a 2xx body that is not JSON: {answer.body[:200]!r}"]
        if route == "refs" and _first(request.query, "prefix") in (None, "") and value != repo.refs:
            return [f"/refs gave {value}, not {repo.refs}"]
        name = values.get("target")
        if route == "resolve" and name in repo.refs and value.get("cid") != repo.refs[name]:
            return [f"/resolve/{values['target']} gave {value}"]
        return []
    if route == "page":
        if values.get("page", "runs") not in PAGES:
            return [f"{answer.status} for a page that does not exist: {values.get('page')!r}"]
        if not kind.startswith("text/html"):
            return [f"a page with Content-Type {kind!r}"]
        same = head or answer.body == (STATIC / "index.html").read_bytes()
        return [] if same else ["a page is not index.html"]
    if route == "asset":
        if values["name"] not in ASSETS:
            return [f"{answer.status} for an asset that does not exist: {values['name']!r}"]
        return [] if head or answer.body == (STATIC / values["name"]).read_bytes() else \
            [f"asset {values['name']} is not the packaged file"]
    return [f"{answer.status} ({kind}) for a path no route serves (route {route})"]


def _authorized(request: Request, route: str, values: dict[str, str]) -> str:
    """Whether a request to the server with the token may pass: "yes", "no" or "either"."""
    if request.bearer:
        return "yes"
    if route == "root" and _first(request.query, "token") is None:
        return "yes"  # a bare redirect to /ui/: nothing to guard (docs/format.md)
    browser = route in ("root", "page", "asset", "api") or request.seen_path.startswith("/ui/")
    landing = route in ("root", "page") and _first(request.query, "token") == TOKEN
    if browser and request.session:
        return "yes" if not any(k == "Authorization" for k, _ in request.headers) else "either"
    if browser and (landing or request.token_cookie):
        return "either"  # the token in a landing's query, or the token itself as the cookie
    return "no"


def _cid_of(text: str | None) -> bytes | None:
    """The binary CID ``text`` names in any multibase, or None."""
    try:
        return cidlib.to_bytes(text) if text else None
    except cas_ckpt.errors.InvalidCID:
        return None


def check(target: Target, request: Request, answer: Answer) -> list[str]:
    """Every property this request's answer breaks (an empty list: none)."""
    if answer.status is None or not answer.complete:
        route, values = route_of(request.seen_path)
        if answer.status == 200 and route == "ipfs" and request.method == "GET":
            try:
                root = cidlib.to_bytes(values["cid"])
            except cas_ckpt.errors.InvalidCID:
                root = b""
            before = target.repo.car_before_damage(root) if root in target.repo.reach else None
            if before is not None and before.startswith(answer.body) and "cut short" in answer.problem:
                return []  # a CAR through the damaged block: cut before it, never its bytes
        return [answer.problem or "no answer", *([f"status {answer.status}"] if answer.status else [])]
    problems = []
    if answer.elapsed > ANSWER_WITHIN:
        problems.append(f"the answer took {answer.elapsed:.1f} s")
    status = answer.status
    route, values = route_of(request.seen_path)
    if status >= 500 and not ((status == 501) or (status == 502) or
                              (status == 503 and answer.headers.get("Retry-After"))):
        problems.append(f"status {status}")
    if status == 502 and route in ("ipfs", "ipfs-sub") and _cid_of(values.get("cid")) != target.repo.damaged:
        problems.append(f"502 for /ipfs/{values.get('cid')!r}, not the damaged block")
    if status == 501 and route not in ("ipns", "ipfs-sub") and request.method in ("GET", "HEAD"):
        problems.append(f"501 on route {route}")
    if status >= 400 and not (_too_long(request) and status == 400):
        # What aiohttp's parser refuses before any route sees it is aiohttp's own plain 400
        # (docs/format.md, "HTTP"); everything the application answers is JSON.
        problems += check_error_body(request, answer)
    if target.token is not None and not _too_long(request):
        allowed = _authorized(request, route, values)
        if allowed == "no" and status != 401:
            problems.append(f"{status} without the token (expected 401)")
        if allowed == "yes" and status == 401:
            problems.append("401 though the request presents the token or a live session on a browser route")
        if status == 401 and "Bearer" not in answer.headers.get("WWW-Authenticate", ""):
            challenge = answer.headers.get("WWW-Authenticate")
            problems.append(f"401 without WWW-Authenticate: Bearer ({challenge!r})")
    if 200 <= status < 300:
        problems += check_ok(request, answer, route, values, target.repo)
    if status in (301, 302, 303, 307, 308):
        location = answer.headers.get("Location")
        if not location:
            problems.append(f"{status} without a Location")
        elif not all(0x21 <= ord(c) <= 0x7E for c in location):  # a URI: ASCII, anything else encoded
            problems.append(f"{status} with a Location that is not a URI: {location!r}")
    if status == 304 and answer.body:
        problems.append("304 with a body")
    if answer.second and answer.second != "closed" and not answer.second.startswith("200 b''"):
        problems.append(f"the kept-alive connection's next request (the probe block) got {answer.second}")
    return problems


def probe_request(target: Target) -> bytes:
    auth = f"Authorization: Bearer {TOKEN}\r\n" if target.token else ""
    return (f"GET /ipfs/bafkqaaa?format=raw HTTP/1.1\r\nHost: 127.0.0.1:{target.served.port}\r\n{auth}"
            "Connection: close\r\n\r\n").encode()


def run_one(target: Target, request: Request) -> list[str]:
    """Send ``request``; the properties its answer breaks, with any traceback it left in stderr."""
    before = target.served.stderr_lines()
    answer = exchange(target.served.port, request.method, request.target, request.headers, request.body,
                      chunked=request.chunked, keep_alive=request.keep_alive, second=probe_request(target))
    problems = check(target, request, answer)
    time.sleep(0.005)  # the server's log lines of this request reach the pipe's reader
    log = target.served.stderr(before)
    if "Traceback" in log:
        problems.append("a Traceback in the server's stderr:\n" + log[-3000:])
    if problems:
        problems.append(f"(answer: {answer.status} {dict(answer.headers or {})} {answer.body[:300]!r})")
    return problems


# --------------------------------------------------------------------------------------------
# The tests
# --------------------------------------------------------------------------------------------
@settings(max_examples=EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                 HealthCheck.large_base_example])
@given(data=st.data())
def test_every_request_gets_a_bounded_valid_answer(target: Target, data: st.DataObject) -> None:
    request = data.draw(requests(target.repo, target.session), label="request")
    problems = run_one(target, request)
    assert not problems, "\n".join(problems)


def test_the_server_logged_no_traceback(target: Target) -> None:
    """After the fuzz (this runs after it, on the same server): no traceback in the whole log."""
    log = target.served.stderr()
    assert "Traceback" not in log, log[-5000:]


def test_a_session_cookie_unlocks_only_the_browser(fuzz_repo: Repo) -> None:
    served = ServerProcess(fuzz_repo.path, "--token", TOKEN)
    try:
        session = _browser_login(served.port, TOKEN)
        c2 = cidlib.to_str(fuzz_repo.roots["c2"])
        bearer = [("Authorization", f"Bearer {TOKEN}")]
        for path in ("/ui/api/repo", "/ui/api/runs", "/ui/runs", "/ui/static/app.js"):
            answer = exchange(served.port, "GET", path, [("Cookie", session)])
            assert answer.status == 200, (path, answer.status, answer.body[:200])
        failures = []
        for path in (f"/ipfs/{c2}?format=raw", f"/ipfs/{c2}?format=car", "/refs", "/refs/main",
                     "/resolve/main", "/log/main", "/reflog/main", "/pins", "/config", "/ipns/x"):
            assert exchange(served.port, "GET", path, bearer).status in (200, 501), path
            for cookie_value in (session, f"cas_ckpt_token={TOKEN}", f"{session}; cas_ckpt_token={TOKEN}"):
                for method in ("GET", "HEAD"):
                    answer = exchange(served.port, method, path, [("Cookie", cookie_value)])
                    if answer.status != 401:
                        failures.append(f"{method} {path} with Cookie {cookie_value!r}: {answer.status} "
                                        f"{answer.body[:100]!r}")
                    elif method == "GET":
                        failures += [f"{path}: {p}" for p in check_error_body(
                            Request("GET", path, "", [], None, False, False), answer)]
        assert not failures, "\n".join(failures)
        answer = exchange(served.port, "GET", "/?x=1", [])  # only a redirect, the query kept
        assert (answer.status, answer.headers.get("Location")) == (302, "/ui/?x=1")
        # without anything: 401 JSON everywhere, the browser's routes included
        for path in ("/ui", "/ui/", "/ui/runs", "/ui/static/app.js", "/ui/api/repo", "/refs", "/nope",
                     "/?token=wrong", "/ui/?token=wrong"):
            answer = exchange(served.port, "GET", path, [])
            assert answer.status == 401, (path, answer.status, answer.body[:200])
            assert not check_error_body(Request("GET", path, "", [], None, False, False), answer), path
    finally:
        log = served.stop()
    assert "Traceback" not in log, log[-3000:]
