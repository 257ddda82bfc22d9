"""``cas-ckpt serve`` and the HTTP clients, with real processes over loopback.

The server: every route, header, status code and the CAR stream of the trustless gateway spec
(docs/format.md, "HTTP"), the refs API, the token. The clients: ``cas_ckpt.open("http://...")``
(load, log, path, diff, safetensors, the cache), pull, clone and fetch. Faults: a proxy that
corrupts, truncates, mislabels, hangs and resets; a server killed mid-transfer; a damaged block.
"""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import urllib3
from helpers import assert_state_equal, flip_byte
from http_servers import ServerProcess, fault_proxy, serve_process

import cas_ckpt
from cas_ckpt import cid as cidlib
from cas_ckpt.errors import BlockNotFound, RemoteError, RepositoryError
from cas_ckpt.http.server import serving
from cas_ckpt.maintenance.walk import child_links, data_blocks

RAW = "application/vnd.ipld.raw"
CAR = "application/vnd.ipld.car"
FAST = {"attempts": 2, "read_timeout": 2.0, "connect_timeout": 2.0}  # failures tests wait for


def state(step: int) -> dict[str, Any]:
    rng = np.random.default_rng(step)
    return {"model": {"w": rng.random((3, 300_000), np.float32), "b": np.arange(10, dtype=np.int64)},
            "opt": {"m": rng.random(200_000)}, "text": "é" * 20_000, "step": step, "t": (1, None)}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, str, dict[str, Any]]]:
    """A repository with history on main (steps 1, 2), a ref with a slash, a pin; its server."""
    path = tmp_path_factory.mktemp("served") / "repo"
    with cas_ckpt.open(path) as repo:
        roots = {"c1": repo.save(state(1), step=1, metadata={"loss": 0.5, "raw": b"\x00\x01"}),
                 "c2": repo.save(state(2), step=2, message="second"),
                 "exp": repo.save({"x": np.arange(5)}, ref="runs/exp-7")}
        repo.pin(roots["c1"])
    with serve_process(path) as server:
        yield path, server.url, roots


@pytest.fixture
def http() -> Iterator[urllib3.PoolManager]:
    pool = urllib3.PoolManager(retries=False, timeout=urllib3.Timeout(connect=5, read=30))
    yield pool
    pool.clear()


def get(http: urllib3.PoolManager, url: str, **headers: str) -> Any:
    return http.request("GET", url, headers=headers, retries=False)


# --------------------------------------------------------------------------------------------
# The server: blocks
# --------------------------------------------------------------------------------------------
def test_a_raw_block_comes_with_the_spec_headers(served: Any, http: urllib3.PoolManager) -> None:
    path, url, roots = served
    with cas_ckpt.open(path, read_only=True) as repo:
        chunk = next(c for c in data_blocks(repo.blocks, bytes(roots["c2"])) if not cidlib.is_node(c))
        expected = repo.blocks.get(chunk)
    name = cidlib.to_str(chunk)
    r = get(http, f"{url}/ipfs/{name}?format=raw")
    assert r.status == 200 and r.data == expected and len(expected) == 1024 * 1024
    assert r.headers["Content-Type"] == RAW
    assert r.headers["X-Content-Type-Options"] == "nosniff"
    assert r.headers["Cache-Control"] == "public, max-age=29030400, immutable"
    assert r.headers["ETag"] == f'"{name}.raw"'  # strong: no W/
    assert r.headers["Content-Disposition"] == f'attachment; filename="{name}.bin"'
    assert "Content-Location" not in r.headers
    by_accept = get(http, f"{url}/ipfs/{name}", Accept=RAW)
    assert by_accept.data == expected and by_accept.headers["Content-Location"] == f"/ipfs/{name}?format=raw"
    head = http.request("HEAD", f"{url}/ipfs/{name}?format=raw")
    assert head.status == 200 and head.headers["Content-Length"] == str(len(expected)) and head.data == b""
    assert get(http, f"{url}/ipfs/{name}?format=raw", **{"If-None-Match": f'"{name}.raw"'}).status == 304


def test_a_raw_block_serves_ranges(served: Any, http: urllib3.PoolManager) -> None:
    path, url, roots = served
    with cas_ckpt.open(path, read_only=True) as repo:
        data = repo.blocks.get(roots["c2"])
    name = str(roots["c2"])
    r = get(http, f"{url}/ipfs/{name}?format=raw", Range="bytes=10-19")
    assert r.status == 206 and r.data == data[10:20]
    assert r.headers["Content-Range"] == f"bytes 10-19/{len(data)}"
    assert r.headers["ETag"] == f'"{name}.raw.10-19"'
    assert get(http, f"{url}/ipfs/{name}?format=raw", Range="bytes=-5").data == data[-5:]
    assert get(http, f"{url}/ipfs/{name}?format=raw", Range="bytes=7-").data == data[7:]
    out = get(http, f"{url}/ipfs/{name}?format=raw", Range=f"bytes={len(data)}-")
    assert out.status == 416 and out.headers["Content-Range"] == f"bytes */{len(data)}"


@pytest.mark.parametrize("request_path, headers, status, says", [
    ("/ipfs/bafynotacid?format=raw", {}, 400, "malformed CID"),
    ("/ipfs/QmYwAPJzv5CZsnA625s3Xf2nemtYgPpHdWEz79ojWnPbdG?format=raw", {}, 400, "CIDv0"),
    ("/ipfs/bafkreihdwdcefgh4dqkjv67uzcmw7ojee6xedzdetojuzjevtenxquvyku?format=raw", {}, 404, "not in this"),
    ("/ipfs/bafkreihdwdcefgh4dqkjv67uzcmw7ojee6xedzdetojuzjevtenxquvyku?format=car", {}, 404, "not in this"),
    ("/ipfs/{c2}?format=dag-json", {}, 406, "format=dag-json"),
    ("/ipfs/{c2}?format=tar", {}, 406, "trustless"),
    ("/ipfs/{c2}?format=html", {}, 400, "unknown format"),
    ("/ipfs/{c2}", {"Accept": "text/html"}, 406, "cannot give"),
    ("/ipfs/{c2}", {}, 400, "format=raw"),
    ("/ipfs/{c2}/model?format=raw", {}, 400, "no path"),
    ("/ipfs/{c2}/model?format=car", {}, 501, "sub-tree"),
    ("/ipfs/{c2}?format=car&dag-scope=files", {}, 400, "dag-scope"),
    ("/ipfs/{c2}?format=car&car-dups=y", {}, 400, "dups=n"),
    ("/ipfs/{c2}", {"Accept": f"{CAR}; dups=y"}, 406, "cannot give"),
    ("/ipfs/{c2}?format=car&entity-bytes=x", {}, 400, "entity-bytes"),
    ("/ipns/k51qzi5uqu5dlvj2baxnqndepeb86cbk3ng7n3i46uzyxzyqj2xjonzllnv0v8", {}, 501, "refs"),
])
def test_errors_have_the_spec_status_and_say_why(
    served: Any, http: urllib3.PoolManager, request_path: str, headers: dict[str, str], status: int, says: str
) -> None:
    _, url, roots = served
    r = get(http, url + request_path.format(c2=roots["c2"]), **headers)
    assert r.status == status, r.data
    assert says in r.data.decode()


def test_the_probe_paths_answer(served: Any, http: urllib3.PoolManager) -> None:
    _, url, _ = served
    raw = get(http, f"{url}/ipfs/bafkqaaa?format=raw")
    assert raw.status == 200 and raw.data == b""
    car = get(http, f"{url}/ipfs/bafkqaaa?format=car")
    assert car.status == 200 and car.data == cas_ckpt.car.car_header([b"\x01\x55\x00\x00"])


def test_a_car_stream_is_the_export_and_scopes_cut_it(served: Any, http: urllib3.PoolManager) -> None:
    path, url, roots = served
    with cas_ckpt.open(path, read_only=True) as repo:
        export = io.BytesIO()
        repo.export_car(roots["c2"], export)
        root_block = repo.blocks.get(roots["c2"])
    name = str(roots["c2"])
    r = get(http, f"{url}/ipfs/{name}?format=car")
    assert r.status == 200 and r.data == export.getvalue()
    assert r.headers["Content-Type"] == f"{CAR}; version=1; order=dfs; dups=n"
    assert r.headers["Content-Disposition"] == f'attachment; filename="{name}.car"'
    assert r.headers["ETag"] == f'"{name}.car.dfs.n.all"'
    assert r.headers["X-Content-Type-Options"] == "nosniff"
    by_accept = get(http, f"{url}/ipfs/{name}", Accept=f"text/html;q=0.9, {CAR}; version=1; order=dfs")
    assert by_accept.data == export.getvalue()
    header = cas_ckpt.car.car_header([bytes(roots["c2"])])
    one = header + cas_ckpt.car.section_prefix(bytes(roots["c2"]), root_block) + root_block
    for scope in ("block", "entity"):
        cut = get(http, f"{url}/ipfs/{name}?format=car&dag-scope={scope}")
        assert cut.data == one and cut.headers["ETag"] == f'"{name}.car.dfs.n.block"'
    assert get(http, f"{url}/ipfs/{name}?format=car&entity-bytes=0:*").data == one
    with cas_ckpt.open("memory://") as dest:  # our reader takes it whole
        dest.import_car(io.BytesIO(r.data), ref="x")
        assert_state_equal(state(2), dest.load("x"))


# --------------------------------------------------------------------------------------------
# The server: the refs API and the token
# --------------------------------------------------------------------------------------------
def test_the_json_api_resolves_refs_and_history(served: Any, http: urllib3.PoolManager) -> None:
    _, url, roots = served
    c1, c2, exp = (str(roots[k]) for k in ("c1", "c2", "exp"))
    assert json.loads(get(http, f"{url}/refs").data) == {"main": c2, "runs/exp-7": exp}
    assert json.loads(get(http, f"{url}/refs/runs/exp-7").data) == {"name": "runs/exp-7", "cid": exp}
    assert get(http, f"{url}/refs/nope").status == 404
    assert json.loads(get(http, f"{url}/resolve/main~1").data) == {"target": "main~1", "cid": c1}
    assert json.loads(get(http, f"{url}/resolve/{c2[:12]}").data)["cid"] == c2
    assert get(http, f"{url}/resolve/main~9").status == 404
    log = json.loads(get(http, f"{url}/log/main").data)
    assert [(c["cid"], c["step"], c["message"]) for c in log] == [(c2, 2, "second"), (c1, 1, None)]
    assert log[1]["metadata"] == {"loss": 0.5, "raw": {"/": {"bytes": "AAE"}}}
    assert len(json.loads(get(http, f"{url}/log/main?limit=1").data)) == 1
    assert get(http, f"{url}/log/main?limit=x").status == 400
    assert [e["new"] for e in json.loads(get(http, f"{url}/reflog/main").data)] == [c1, c2]
    assert json.loads(get(http, f"{url}/pins").data) == [c1]
    assert json.loads(get(http, f"{url}/config").data)["hash"] == "sha2-256"


def test_no_route_writes(served: Any, http: urllib3.PoolManager) -> None:
    _, url, roots = served
    for method in ("POST", "PUT", "DELETE", "PATCH"):
        for route in ("/refs/main", f"/ipfs/{roots['c2']}", "/pins", "/config"):
            assert http.request(method, url + route, body=b"x").status == 405, (method, route)


def test_a_token_guards_every_route(tmp_path: Path, http: urllib3.PoolManager,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    with cas_ckpt.open(tmp_path / "repo") as repo:
        root = repo.save({"w": np.arange(3)})
    with serve_process(tmp_path / "repo", env={"CAS_CKPT_TOKEN": "s3cret"}) as server:
        for route in ("/refs", f"/ipfs/{root}?format=raw", "/config", "/nothing"):
            r = get(http, server.url + route)
            assert r.status == 401 and r.headers["WWW-Authenticate"].startswith("Bearer"), route
            assert get(http, server.url + route, Authorization="Bearer wrong").status == 401
        assert get(http, f"{server.url}/refs", Authorization="Bearer s3cret").status == 200
        # A token in the URL counts only on the pages a browser opens first (which exchange it for
        # a session): elsewhere it would end up in logs and shared links.
        for route in ("/refs?token=s3cret", "/ui/api/runs?token=s3cret",
                      f"/ipfs/{root}?format=raw&token=s3cret", "/ui/static/app.js?token=s3cret"):
            assert get(http, server.url + route).status == 401, route
        assert get(http, f"{server.url}/?token=s3cret").headers["Location"] == "/ui/?token=s3cret"
        assert get(http, f"{server.url}/").status == 302  # only a redirect to /ui/: nothing to guard
        for page in ("/ui/", "/ui/storage"):
            r = get(http, f"{server.url}{page}?token=s3cret")
            assert r.status == 302 and r.headers["Location"] == page, page
            assert "s3cret" not in r.headers["Set-Cookie"], page
        assert get(http, f"{server.url}/ui/?token=wrong").status == 401
        with pytest.raises(RemoteError, match="needs a token"):
            cas_ckpt.open(server.url)
        with cas_ckpt.open(server.url, storage_options={"token": "s3cret"}) as remote:
            assert remote.load("main")["w"].tolist() == [0, 1, 2]
        monkeypatch.setenv("CAS_CKPT_TOKEN", "s3cret")
        with cas_ckpt.open(server.url) as remote:
            assert remote.resolve("main") == root


def test_the_browser_session_is_not_the_token(tmp_path: Path, http: urllib3.PoolManager) -> None:
    """``?token=`` is exchanged for a session of this server's own (a cookie named by its port,
    HttpOnly, SameSite=Strict, Path=/ui, expiring) that unlocks the browser's pages and JSON only:
    a captured cookie reads no block, ref, CAR or config, and cannot be turned into the token."""
    from cas_ckpt.http.sessions import SESSION_TTL, Sessions

    with cas_ckpt.open(tmp_path / "repo") as repo:
        root = repo.save({"w": np.arange(3)}, ref="main")
    with serve_process(tmp_path / "repo", "--token", "s3cret") as server:
        port = server.url.rsplit(":", 1)[1]
        r = get(http, f"{server.url}/ui/?token=s3cret")
        name, _, rest = r.headers["Set-Cookie"].partition("=")
        value, *attributes = [part.strip() for part in rest.split(";")]
        assert name == f"cas_ckpt_session_{port}" and "s3cret" not in value
        assert {"HttpOnly", "Path=/ui", "SameSite=Strict", f"Max-Age={SESSION_TTL}"} <= set(attributes)
        cookie = f"{name}={value}"
        for page in ("/ui/", "/ui/storage", "/ui/api/runs", "/ui/api/repo", "/ui/static/app.js"):
            assert get(http, server.url + page, Cookie=cookie).status == 200, page
        for route in ("/refs", "/refs/main", f"/ipfs/{root}?format=raw", f"/ipfs/{root}?format=car",
                      "/config", "/log/main", "/pins", "/resolve/main"):
            r = get(http, server.url + route, Cookie=cookie)
            assert r.status == 401, route
            assert json.loads(r.data)["error"].startswith("this server needs a token"), route
            assert get(http, server.url + route, Authorization="Bearer s3cret").status == 200, route
        # Another port's name, a forged, a tampered and an expired value unlock nothing.
        expired = Sessions("s3cret").issue(now=time.time() - SESSION_TTL - 1)
        forged = Sessions("other token").issue()
        tampered = value[:-1] + ("1" if value.endswith("0") else "0")  # one hex digit other than it was
        for bad in (f"cas_ckpt_session_1={value}", f"{name}={forged}", f"{name}={expired}",
                    f"{name}={tampered}", f"{name}=s3cret", "cas_ckpt_token=s3cret"):
            assert get(http, f"{server.url}/ui/api/runs", Cookie=bad).status == 401, bad


def test_a_token_over_plain_http_beyond_this_machine_is_refused() -> None:
    with pytest.raises(RepositoryError, match="refusing to send a token over plain http"):
        cas_ckpt.open("http://192.0.2.1:8080", storage_options={"token": "x"})


def test_a_damaged_block_is_never_sent(tmp_path: Path, http: urllib3.PoolManager) -> None:
    with cas_ckpt.open(tmp_path / "repo") as repo:
        root = repo.save({"w": np.ones(300_000, np.float32)})
        chunk = next(c for c in data_blocks(repo.blocks, bytes(root)) if not cidlib.is_node(c))
        pack, offset, _ = repo.blocks.locate(chunk)
    flip_byte(tmp_path / "repo" / "packs" / pack, offset + 100)
    server = ServerProcess(tmp_path / "repo")
    try:
        r = get(http, f"{server.url}/ipfs/{cidlib.to_str(chunk)}?format=raw")
        assert r.status == 502 and b"failed verification" in r.data
        car = http.request("GET", f"{server.url}/ipfs/{root}?format=car", preload_content=False)
        got = bytearray()
        with pytest.raises(urllib3.exceptions.ProtocolError):  # cut short, never the bad bytes
            for piece in car.stream(65536):
                got += piece
        assert car.status == 200  # committed before the damage was met: the cut is the error
        assert cas_ckpt.car.car_header([bytes(root)]).startswith(got[:60])
        assert cas_ckpt.car.section_prefix(chunk, bytes(1024 * 1024)) not in got
    finally:
        log = server.stop()
    assert f"refusing to send {cidlib.to_str(chunk)}" in log or f"of {root} ended early" in log
    assert "corrupt block" in log


# --------------------------------------------------------------------------------------------
# The clients
# --------------------------------------------------------------------------------------------
def test_a_served_repository_opens_by_url(served: Any, tmp_path: Path) -> None:
    _, url, roots = served
    with cas_ckpt.open(url + "/", read_only=True) as remote:
        assert remote.read_only
        with pytest.raises(RepositoryError, match="read-only"):
            remote.save({"x": 1})  # refused here
    with cas_ckpt.open(url + "/") as remote:
        assert not remote.read_only and remote.location == url  # saves are pushes: the server decides
        assert_state_equal(state(2), remote.load("main"))
        assert_state_equal(state(1), remote.load("main~1"))
        assert [c.step for c in remote.log("main")] == [2, 1]
        assert remote.refs() == {"main": roots["c2"], "runs/exp-7": roots["exp"]}
        assert remote.pins() == [roots["c1"]]
        assert remote.load("main", path="model.b").tolist() == list(range(10))
        diff = remote.diff("main~1", "main")
        assert {c.path for c in diff.changed} == {"model.w", "opt.m", "step"}
        report = remote.export_safetensors("main", tmp_path / "m.safetensors", path="model")
        assert report.tensors == 2
        with pytest.raises(RepositoryError, match="this server is read-only"):
            remote.save({"x": 1})  # refused by a server without --write-token
        with pytest.raises(RepositoryError, match="cannot list"):
            remote.resolve(str(roots["c2"])[:12])
        with pytest.raises(cas_ckpt.errors.RefNotFound):
            remote.load("nope")
    from safetensors.numpy import load_file
    assert np.array_equal(load_file(tmp_path / "m.safetensors")["w"], state(2)["model"]["w"])


def test_a_path_load_fetches_only_that_subtree(served: Any) -> None:
    path, url, roots = served
    with cas_ckpt.open(path, read_only=True) as repo:
        tree = repo.tree("main")
        node = repo.blocks.get(tree)
        subtree = cas_ckpt.codec.decode(node, cid=bytes(tree))["opt"]  # inline: its chunks' links
        wanted = {cidlib.to_str(link.cid) for link, _ in child_links(subtree)}
        assert len(wanted) == 2  # 1.6 MB: two chunks
    with fault_proxy(url) as proxy, cas_ckpt.open(proxy.url) as remote:
        proxy.hits.clear()
        m = remote.load("main", path="opt.m")
        fetched = {p.split("/")[2].split("?")[0] for p in proxy.hits if p.startswith("/ipfs/")}
    assert np.array_equal(m, state(2)["opt"]["m"])
    assert wanted <= fetched
    assert fetched - wanted == {str(roots["c2"]), str(tree)}  # the commit and the tree's root node


def test_the_cache_serves_a_second_load_without_the_server(tmp_path: Path) -> None:
    with cas_ckpt.open(tmp_path / "repo") as repo:
        root = repo.save(state(3))
    cache = tmp_path / "cache"
    with serve_process(tmp_path / "repo") as server, \
            cas_ckpt.open(server.url, storage_options={"cache_dir": cache}) as remote:
        assert_state_equal(state(3), remote.load(root))
    # The server is gone: every block (the commit, nodes and chunks) comes from the cache.
    from cas_ckpt.backends.http import HttpRemote
    from cas_ckpt.blocks.http import HttpBlockStore
    from cas_ckpt.blocks.packed import LocalStore
    from cas_ckpt.repository import Repository

    cached = HttpBlockStore(HttpRemote(server.url, **FAST), cache=LocalStore(cache))
    refs = cas_ckpt.refs.MemoryRefStore()
    refs.init_config({"format": "cas_ckpt", "version": 1, "hash": "sha2-256", "chunk_size": 1 << 20})
    with Repository(cached, refs, create=False) as offline:
        assert_state_equal(state(3), offline.load(root))


def test_pull_and_clone_send_only_what_is_missing(served: Any, tmp_path: Path) -> None:
    _, url, roots = served
    with cas_ckpt.open(tmp_path / "mine") as mine:
        first = mine.pull(url, "main")
        assert first.refs == {"main": roots["c2"]} and first.commits_sent == 1
        again = mine.pull(url, "main")
        assert again.up_to_date and again.blocks_sent == 0
        assert_state_equal(state(2), mine.load("main"))
        assert [c.step for c in mine.log("main")] == [2, 1]
    clone = cas_ckpt.clone(url, tmp_path / "copy")
    with clone:
        assert clone.refs() == {"main": roots["c2"], "runs/exp-7": roots["exp"]}
        assert clone.pins() == [roots["c1"]]
        assert_state_equal(state(1), clone.load(roots["c1"]))
        assert clone.fsck().ok


def test_fetch_takes_a_cid_from_any_gateway(served: Any) -> None:
    _, url, roots = served
    with cas_ckpt.open("memory://") as mine:
        report = mine.fetch(str(roots["c1"]), gateway=url, ref="from-gateway")
        assert report.refs == {"from-gateway": roots["c1"]}
        assert_state_equal(state(1), mine.load("from-gateway"))
        mine.fetch(roots["exp"], gateway=url, pin=True)
        assert mine.pins() == [roots["exp"]] and not mine.refs().get("runs/exp-7")
        with pytest.raises(BlockNotFound):
            mine.fetch("bafkreihdwdcefgh4dqkjv67uzcmw7ojee6xedzdetojuzjevtenxquvyku", gateway=url, pin=True)


# --------------------------------------------------------------------------------------------
# Lying, slow and dying servers
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode, says", [
    ("corrupt", "do not hash to the CID"),
    ("truncate", "cut short"),
    ("type", "Content-Type 'text/html'"),
    ("hang", "ReadTimeoutError"),
    ("reset", "ProtocolError"),
])
def test_a_lying_or_dying_gateway_is_refused_naming_the_cid_and_url(
    served: Any, mode: str, says: str
) -> None:
    _, url, roots = served
    options = {**FAST, "read_timeout": 0.5}
    with fault_proxy(url) as proxy, cas_ckpt.open("memory://") as mine:
        proxy.spoil(mode)
        with pytest.raises(RemoteError) as caught:
            mine.fetch(roots["c2"], gateway=proxy.url, ref="x", storage_options=options)
        error = caught.value
        assert error.cid == str(roots["c2"]) and error.url.startswith(proxy.url + "/ipfs/")
        assert says in str(error) and "after 2 attempts" in str(error)
        assert proxy.hits[f"/ipfs/{roots['c2']}?format=raw"] == 2  # bounded retries
        assert len(mine.blocks) == 0 and mine.refs() == {}  # nothing unverified stored
        proxy.spoil(mode, times=1)  # one bad answer: the retry gets it right
        mine.fetch(roots["c2"], gateway=proxy.url, ref="x", storage_options=options)
        assert_state_equal(state(2), mine.load("x"))


@pytest.mark.parametrize("mode, says", [
    ("corrupt", "do not hash"), ("truncate", "cut short"), ("type", "text/html"), ("reset", "Error"),
])
def test_spoiled_chunks_fail_a_load_or_are_fetched_again(served: Any, mode: str, says: str) -> None:
    _, url, roots = served
    with fault_proxy(url) as proxy, cas_ckpt.open(proxy.url, storage_options=FAST) as remote:
        proxy.spoil(mode, prefix="/ipfs/bafkrei")  # raw chunks only: they are read into arrays
        with pytest.raises(RemoteError, match=rf"block bafkrei\w+ from {proxy.url}/ipfs/.*{says}"):
            remote.load(roots["c2"])
        proxy.spoil(mode, times=3, prefix="/ipfs/bafkrei")  # three spoiled once: retried, right
        assert_state_equal(state(2), remote.load(roots["c2"]))


def test_wrong_bytes_fail_a_load_never_give_wrong_values(served: Any) -> None:
    _, url, _ = served
    with fault_proxy(url) as proxy, cas_ckpt.open(proxy.url, storage_options=FAST) as remote:
        proxy.spoil("corrupt")
        with pytest.raises(RemoteError, match=r"block ba\w+ from http.*do not hash"):
            remote.load("main")


def test_a_server_killed_mid_transfer_is_an_error_not_a_hang(tmp_path: Path) -> None:
    with cas_ckpt.open(tmp_path / "repo") as repo:
        big = {"w": np.random.default_rng(9).random(16 * 262_144, np.float32)}  # 16 MiB
        root = repo.save(big)
    with serve_process(tmp_path / "repo") as server, \
            cas_ckpt.open(server.url, storage_options={**FAST, "workers": 2}) as remote:
        started = threading.Event()
        original = remote.blocks.get_into

        def get_into(cid: bytes, out: memoryview, **kwargs: Any) -> None:
            if not cidlib.is_node(cid) and not started.is_set():
                started.set()
                server.kill()  # the first chunk's request finds the server gone
            original(cid, out, **kwargs)

        remote.blocks.get_into = get_into  # type: ignore[method-assign]
        with pytest.raises(RemoteError, match=r"block \w+ from http://127\.0\.0\.1:\d+/ipfs/.*2 attempts"):
            remote.load(root)
    assert started.is_set()


# --------------------------------------------------------------------------------------------
# Streams cut short: GC while a CAR is being sent
# --------------------------------------------------------------------------------------------
def test_gc_mid_stream_ends_the_car_with_an_error_never_wrong_bytes(caplog: pytest.LogCaptureFixture) -> None:
    repo = cas_ckpt.open("memory://")
    # 64 MiB, 64 chunks: more than the socket buffers between server and client can hold (here up
    # to 4 MiB sent and 32 MiB received): the server must still read blocks after the GC. With
    # 8 MiB, on a loaded machine, it had sent every block before the GC ran.
    root = repo.save({"w": np.random.default_rng(1).random(64 * 262_144, np.float32)})
    with serving(repo) as url, caplog.at_level(logging.ERROR, "cas_ckpt.http"):
        http = urllib3.PoolManager(retries=False)
        response = http.request("GET", f"{url}/ipfs/{root}?format=car", preload_content=False)
        assert response.status == 200
        head = response.read(64)  # the stream has started
        repo.delete_ref("main")
        repo.gc(reflog_expiry=0)  # the server's next block is gone
        with pytest.raises(urllib3.exceptions.ProtocolError):
            rest = response.read()
            assert not rest  # unreachable: the read fails
    assert head.startswith(cas_ckpt.car.car_header([bytes(root)]))
    assert any("ended early" in r.message for r in caplog.records)
    repo.close()


def test_several_ranges_get_the_whole_block(served: Any, http: urllib3.PoolManager) -> None:
    path, url, roots = served
    with cas_ckpt.open(path, read_only=True) as repo:
        data = repo.blocks.get(roots["c2"])
    r = get(http, f"{url}/ipfs/{roots['c2']}?format=raw", Range="bytes=0-1, 5-9")
    assert r.status == 200 and r.data == data


def test_a_chunk_of_another_size_than_its_node_says_is_refused(tmp_path: Path) -> None:
    """A hostile node: two 1 MiB chunks for an array of 1.5 MiB. Over HTTP the chunk sizes come
    from the node, so the second block's real size is found only when it arrives."""
    with cas_ckpt.open(tmp_path / "repo") as repo:
        root = repo.save({"w": np.ones(2 * 262_144, np.float32)})
        tree = cas_ckpt.codec.decode(repo.blocks.get(repo.tree(root)), cid=bytes(repo.tree(root)))
        header = dict(tree["w"].value, shape=[3 * 131_072])
        node = cas_ckpt.codec.encode({"w": cas_ckpt.codec.Tagged(3, header)})
        hostile = repo.hasher.node(node)
        with repo.transaction() as txn:
            txn.blocks.put(hostile, node)
        repo.pin(hostile)
    refused = pytest.raises(cas_ckpt.errors.CorruptBlock, match=r"size 1048576 != expected 524288")
    with serve_process(tmp_path / "repo") as server, cas_ckpt.open(server.url) as remote, refused:
        remote.load(cidlib.to_str(hostile))


def test_the_cli_fetches_from_a_gateway_and_reads_a_served_repository(served: Any, tmp_path: Path) -> None:
    _, url, roots = served
    run = [sys.executable, "-m", "cas_ckpt"]
    subprocess.run([*run, "init", str(tmp_path / "mine")], check=True, capture_output=True)
    done = subprocess.run([*run, "--repo", str(tmp_path / "mine"), "fetch", str(roots["c1"]),
                           "--gateway", url, "--ref", "got"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"fetched {url} -> ") and f"got (new) -> {roots['c1']}" in done.stdout
    log = subprocess.run([*run, "--repo", url, "log", "--json"], capture_output=True, text=True, timeout=120)
    assert [c["step"] for c in json.loads(log.stdout)] == [2, 1]
    with fault_proxy(url) as proxy:
        proxy.spoil("corrupt")
        bad = subprocess.run([*run, "--repo", str(tmp_path / "mine"), "fetch", str(roots["c2"]),
                              "--gateway", proxy.url, "--pin"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 4
    assert bad.stderr.startswith(f"cas-ckpt: error: block {roots['c2']} from {proxy.url}/ipfs/")


def test_the_cli_token_flag(tmp_path: Path, http: urllib3.PoolManager) -> None:
    with cas_ckpt.open(tmp_path / "repo") as repo:
        repo.save({"x": 1})
    with serve_process(tmp_path / "repo", "--token", "t0ken") as server:
        assert get(http, f"{server.url}/refs").status == 401
        assert get(http, f"{server.url}/refs", Authorization="Bearer t0ken").status == 200
