"""Independent IPFS clients read ``cas-ckpt serve``: Helia's trustless-gateway block broker fetches
raw blocks of a saved checkpoint (the server its only gateway) and validates them by their
multihash, and @ipld/car reads the CAR responses, which are then walked (links decoded from the
messagepack nodes by @msgpack/msgpack) to check they hold exactly the DAG, depth first.

Needs node and ``npm ci --prefix tests/js`` (scripts/test.sh runs it); CI requires them.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from http_servers import fault_proxy, serve_process

import cas_ckpt
from cas_ckpt import cid as cidlib
from cas_ckpt.codec import Link, decode
from cas_ckpt.maintenance.walk import child_links, data_blocks

JS_DIR = Path(__file__).parent / "js"


def node_tool() -> list[str]:
    node = shutil.which("node")
    ready = node and (JS_DIR / "node_modules" / "@helia" / "trustless-gateway-client").is_dir()
    if not ready:
        message = "needs node and `npm ci --prefix tests/js` (Helia and @ipld/car)"
        if os.environ.get("CAS_CKPT_REQUIRE_NODE") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return [str(node), str(JS_DIR / "gateway_tool.mjs")]


def run_node(*args: str, ok: bool = True) -> Any:
    result = subprocess.run([*node_tool(), *args], capture_output=True, text=True, timeout=120)
    if not ok:
        return result
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def checkpoint(tmp_path: Path, hash_name: str) -> tuple[Path, bytes, list[bytes]]:
    path = tmp_path / "repo"
    with cas_ckpt.open(path, hash=hash_name) as repo:
        rng = np.random.default_rng(5)
        state = {"model": {"w": rng.random((2, 300_000), np.float32), "b": np.arange(7.0)},
                 "meta": {"name": "x" * 20_000, "zeros": np.zeros(600_000, np.float32)}, "step": 3}
        root = bytes(repo.save(state, step=3))
        blocks = list(data_blocks(repo.blocks, root))
    return path, root, blocks


@pytest.mark.parametrize("hash_name", ["sha2-256", "blake3"])
def test_helia_fetches_and_verifies_raw_blocks(tmp_path: Path, hash_name: str) -> None:
    node_tool()
    path, _, blocks = checkpoint(tmp_path, hash_name)
    with cas_ckpt.open(path, read_only=True) as repo:
        expected = {cidlib.to_str(c): repo.blocks.get(c) for c in blocks}
    assert len(expected) >= 6 and any(len(b) == 1 << 20 for b in expected.values())
    with serve_process(path) as server:
        fetched = run_node("blocks", server.url, *expected)
    assert [b["cid"] for b in fetched] == list(expected)
    for block in fetched:
        assert base64.b64decode(block["base64"]) == expected[block["cid"]], block["cid"]


def test_helia_refuses_a_gateway_that_sends_wrong_bytes(tmp_path: Path) -> None:
    node_tool()
    path, root, _ = checkpoint(tmp_path, "sha2-256")
    with serve_process(path) as server, fault_proxy(server.url) as proxy:
        proxy.spoil("corrupt")
        result = run_node("blocks", proxy.url, cidlib.to_str(root), ok=False)
    assert result.returncode == 1
    assert f"Unable to fetch raw block for CID {cidlib.to_str(root)}" in result.stderr


@pytest.mark.parametrize("hash_name", ["sha2-256", "blake3"])
def test_ipld_car_reads_and_walks_the_car_responses(tmp_path: Path, hash_name: str) -> None:
    node_tool()
    path, root, blocks = checkpoint(tmp_path, hash_name)
    with cas_ckpt.open(path, read_only=True) as repo:
        sizes = [repo.blocks.size(c) for c in blocks]
        node = decode(repo.blocks.get(root), cid=root)
        children = [cidlib.to_str(link.cid) for link, _ in child_links(node) if type(link) is Link]
    with serve_process(path) as server:
        whole = run_node("car", server.url, cidlib.to_str(root))
        one = run_node("car", server.url, cidlib.to_str(root), "block")
    assert whole["contentType"] == "application/vnd.ipld.car; version=1; order=dfs; dups=n"
    assert whole["roots"] == [cidlib.to_str(root)]
    assert [b["cid"] for b in whole["blocks"]] == [cidlib.to_str(c) for c in blocks]
    assert [b["size"] for b in whole["blocks"]] == sizes
    assert all(b["ok"] for b in whole["blocks"])
    assert whole["missing"] == [] and whole["stray"] == [] and whole["dfs"]
    assert [b["cid"] for b in one["blocks"]] == [cidlib.to_str(root)]
    assert one["missing"] == children  # dag-scope=block: the root alone, its links dangling
