"""The browser view's JSON API and pages over HTTP, from a real server process: it never writes
to the repository, answers errors with the right status and a message, ships every asset itself
and forbids pages to load anything from elsewhere."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest
from browsing import ADAM_INF_STEP, ADAM_MODEL, ADAM_NAN_STEP, ADAM_OPTIMIZER, Facts, served, small_repository

import cas_ckpt
from cas_ckpt.maintenance.describe import value_group
from cas_ckpt.web.routes import ASSETS, STATIC


@pytest.fixture(scope="module")
def facts(tmp_path_factory: pytest.TempPathFactory) -> Facts:
    return small_repository(tmp_path_factory.mktemp("api") / "repo")


@pytest.fixture(scope="module")
def server(facts: Facts) -> Iterator[str]:
    with served(facts.path) as base:
        yield base


def get(url: str) -> tuple[int, dict[str, str], bytes]:
    try:
        with urllib.request.urlopen(url, timeout=60) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def api(server: str, endpoint: str, **params: Any) -> tuple[int, Any]:
    status, _, body = get(f"{server}/ui/api/{endpoint}?{urlencode(params)}")
    return status, json.loads(body)


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every file and directory under ``root`` with its size and modification time."""
    found = {}
    for path in [root, *root.rglob("*")]:
        info = path.stat()
        found[str(path.relative_to(root))] = (info.st_size if path.is_file() else 0, info.st_mtime_ns)
    return found


def test_browsing_everything_writes_nothing(facts: Facts) -> None:
    before = snapshot(facts.path)
    with cas_ckpt.open(facts.path, read_only=True) as repo:
        fork = str(repo.resolve("runs/base.steps/000000000008"))
        expired = str(repo.resolve("runs/base~9"))
    with served(facts.path) as base:
        for page in ("/", "/ui/", "/ui/run?ref=runs/base", "/ui/checkpoint", "/ui/diff", "/ui/storage"):
            assert get(base + page)[0] == 200, page
        calls = [("repo", {}), ("runs", {}), ("runs", {"every": 1}), ("graph", {"ref": "runs/base"}),
                 ("graph", {}), ("metrics", {"refs": "runs/base,runs/ft"}),
                 ("checkpoint", {"target": fork}), ("checkpoint", {"ref": "runs/ft", "step": 10}),
                 ("tree", {"target": "runs/ft", "changed": 1}),
                 ("stats", {"target": "runs/ft", "path": "head.weight"}),
                 ("diff", {"a": fork, "b": "runs/ft"}), ("diff/norms", {"a": fork, "b": "runs/ft"}),
                 ("diff", {"a": "runs/ft", "b": fork, "order": "older"}),
                 ("nonfinite", {"ref": "runs/unstable"}), ("storage", {}),
                 ("checkpoint", {"target": expired})]
        for path, params in calls:
            assert api(base, path, **params)[0] == 200, (path, params)
    assert snapshot(facts.path) == before


def test_errors_have_a_status_and_a_message(server: str, facts: Facts) -> None:
    with cas_ckpt.open(facts.path, read_only=True) as repo:
        expired = str(repo.resolve("runs/base~9"))
    cases = [
        ("tree", {"target": "runs/nothing"}, 404, "ref 'runs/nothing' not found"),
        ("tree", {"target": expired}, 410, "garbage collected"),
        ("stats", {"target": "runs/ft", "path": "model.nope"}, 404, "model.nope"),
        ("stats", {"target": "runs/ft", "path": "step"}, 400, "not a tensor"),
        ("tree", {"target": "runs/ft", "limit": 0}, 400, "limit"),
        ("tree", {"target": "runs/ft", "offset": "x"}, 400, "integer"),
        ("tree", {}, 400, "target"),
        ("checkpoint", {"ref": "runs/ft", "step": 99}, 404, "step 99"),
        ("graph", {"ref": "runs/nothing"}, 404, "runs/nothing"),
        ("diff", {"a": "bafyxx", "b": "runs/ft"}, 400, "neither a ref nor a valid CID"),
        ("diff", {"a": "runs/ft", "b": "runs/base", "order": "newer"}, 400, "order must be"),
    ]
    for path, params, status, message in cases:
        got, body = api(server, path, **params)
        assert got == status and message in body["error"], (path, params, got, body)
    assert get(f"{server}/ui/nothing")[0] == 404
    assert get(f"{server}/ui/static/data.py")[0] == 404  # only the assets listed
    assert get(f"{server}/ui/static/..%2fdata.py")[0] == 404


def test_pages_load_nothing_from_elsewhere(server: str) -> None:
    status, headers, body = get(f"{server}/ui/")
    assert status == 200 and b'src="/ui/static/app.js"' in body
    policy = headers["Content-Security-Policy"]
    assert "default-src 'self'" in policy and "script-src 'self'" in policy and "connect-src 'self'" in policy
    for name, kind in ASSETS.items():
        status, headers, body = get(f"{server}/ui/static/{name}")
        assert status == 200 and headers["Content-Type"].startswith(kind)
        assert body == (STATIC / name).read_bytes()
    shipped = "".join((STATIC / name).read_text() for name in os.listdir(STATIC))
    assert "http://" not in shipped.replace("http://www.w3.org/2000/svg", "") and "https://" not in shipped


def test_tree_bytes_and_pages(server: str, facts: Facts) -> None:
    status, first = api(server, "tree", target="runs/ft", ref="runs/ft", limit=100)
    assert status == 200 and first["total"] == facts.values and len(first["rows"]) == 100
    _, second = api(server, "tree", target="runs/ft", ref="runs/ft", offset=100, limit=100)
    paths = [r["path"] for r in first["rows"] + second["rows"]]
    with cas_ckpt.open(facts.path, read_only=True) as repo:
        expected = [row for row in repo.stats("runs/ft")]
    assert [p for p in paths if p not in ("step",)] == [s.path for s in expected]
    head = next(r for r in second["rows"] if r["path"] == "head.weight")
    assert (head["stored_bytes"], head["new_bytes"], head["parent_bytes"]) == (65536, 65536, 0)
    _, searched = api(server, "tree", target="runs/ft", q="LAYERS.7")  # case does not matter
    assert [r["path"] for r in searched["rows"]] == [f"model.layers.{i}.{k}" for i in (7, 70, 71, 72, 73, 74)
                                                     for k in ("weight", "bias")]


def test_graph_pages_draw_on_their_own(server: str, facts: Facts) -> None:
    _, whole = api(server, "graph", ref="runs/long", limit=1000)
    _, page = api(server, "graph", ref="runs/long", offset=100, limit=50)
    assert whole["total"] == facts.long_commits == page["total"]
    assert page["rows"] == whole["rows"][100:150]
    assert page["rows"][0]["above"] == whole["rows"][99]["edges"]
    for bad in ({"offset": -4}, {"limit": 0}, {"limit": 100_000}):  # found by tests/test_http_fuzz.py
        status, body = api(server, "graph", ref="runs/long", **bad)
        assert status == 400 and "offset must be >= 0" in body["error"], bad


def test_runs_name_their_parent_and_fork_step(server: str, facts: Facts) -> None:
    _, runs = api(server, "runs")
    with cas_ckpt.open(facts.path, read_only=True) as repo:
        fork = str(repo.resolve("runs/base.steps/000000000008"))
        base_head = str(repo.resolve("runs/base"))
    found = {r["run"]: (r["parent"], r["fork_step"], r["fork_cid"]) for r in runs["rows"]}
    assert found == {"runs/adam": (None, None, None), "runs/base": (None, None, None),
                     "runs/ft": ("runs/base", facts.fork_step, fork), "runs/long": (None, None, None),
                     "runs/merged": ("runs/base", 12, base_head), "runs/unstable": (None, None, None)}
    _, every = api(server, "runs", every=1, prefix="runs/ft")  # a step ref's row names none
    assert {r["ref"]: r["parent"] for r in every["rows"]}["runs/ft.steps/000000000011"] is None


def test_metrics_keep_nan_and_infinity(server: str) -> None:
    _, metrics = api(server, "metrics", ref="runs/adam")
    [series] = metrics["series"]
    loss = dict(zip(series["steps"], series["values"]["loss"], strict=True))
    assert (loss[ADAM_INF_STEP], loss[ADAM_NAN_STEP], loss[1]) == ("inf", "nan", 2.0)


def test_diff_orders_older_to_newer_names_sides_and_groups(server: str, facts: Facts) -> None:
    with cas_ckpt.open(facts.path, read_only=True) as repo:
        old, new = str(repo.resolve("runs/adam~4")), str(repo.resolve("runs/adam"))
    _, given = api(server, "diff", a=new, b=old)  # as given: newer to older
    _, ordered = api(server, "diff", a=new, b=old, order="older")
    assert (given["a"], given["swapped"]) == (new, False)
    assert (ordered["a"], ordered["b"], ordered["swapped"]) == (old, new, True)
    side_a = {k: ordered["side_a"][k] for k in ("cid", "run", "step")}
    assert side_a == {"cid": old, "run": "runs/adam", "step": 2}
    assert ordered["side_b"]["step"] == 6 and ordered["side_a"]["time"] < ordered["side_b"]["time"]
    groups = {c["path"]: c["group"] for c in ordered["changed"]}
    assert groups == {**dict.fromkeys(ADAM_MODEL, "model"), **dict.fromkeys(ADAM_OPTIMIZER, "optimizer"),
                      "rng": "other", "step": "other"}
    _, same = api(server, "diff", a=old, b=new, order="older")  # already older first
    assert (same["a"], same["swapped"]) == (old, False)
    # a fork's sides: the fork point is its parent run's checkpoint
    fork = facts.fork_step
    _, forked = api(server, "diff", a="runs/ft", b=f"runs/base.steps/{fork:012d}", order="older")
    assert (forked["side_a"]["run"], forked["side_a"]["step"]) == ("runs/base", fork)
    assert (forked["side_b"]["run"], forked["side_b"]["step"]) == ("runs/ft", facts.ft_steps[-1])


def test_value_group() -> None:
    cases = {
        ("optim.state.0.exp_avg", None): "optimizer", ("optimizer.param_groups.0.lr", ""): "optimizer",
        ("train.optimizer.state.3.momentum_buffer", "float32"): "optimizer",
        ("train.optimizer.param_groups.0.lr", ""): "other",
        ("model.layers.0.weight", "float32"): "model", ("module.w", "bfloat16"): "model",
        ("net.w", None): "model", ("params.w", "float16"): "model", ("weights.w", "float8_e4m3fn"): "model",
        ("ckpt.state_dict.fc.weight", "float32"): "model",
        ("model.bn.num_batches_tracked", "int64"): "other", ("model.config.name", ""): "other",
        ("step", ""): "other", ("rng.state", "uint32"): "other", ("scheduler.last_epoch", ""): "other",
        ("head.weight", "float32"): "other",
    }
    assert {case: value_group(*case) for case in cases} == cases
