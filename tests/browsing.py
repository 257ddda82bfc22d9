"""The browser view's test set-up: a real server process, headless Chromium, and repositories
made quickly with the facts the tests check.

``served(repo)``: a ``cas-ckpt serve`` process (the browser view is part of the server).
``chromium()``: Debian's chromium
driven by its chromium-driver through selenium (skipped where chromium is missing, unless
CAS_CKPT_REQUIRE_BROWSER=1, as CI sets). ``visit(driver, url, page)``: open a page, wait until it
has drawn, fail on any console error.

``small_repository``: a few runs made by CheckpointManager (a base run with expired steps, a
fine-tune forked from it that changes known tensors, a run with a NaN planted at one step, a
merge, a long run to page through, and an Adam-like run whose state holds optimizer moments, a
step and RNG state beside the weights (one of them at a long path) and whose loss diverges to
Inf and NaN). ``large_repository``: 2,000 commits of 10,000 tensors
each (and a fork), written through one transaction: each commit re-encodes only the layer it
changes and links the others, so it takes seconds, not the hours 2,000 full saves would.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from http_servers import serve_process

import cas_ckpt
from cas_ckpt.codec import Link

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
# Flags that work in containers and CI: no sandbox (root), no GPU, nothing fetched in the background.
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--window-size=1280,900"]


@contextlib.contextmanager
def served(repo: Path, token: str | None = None) -> Iterator[str]:
    """``cas-ckpt serve REPO`` on 127.0.0.1 (a port the kernel picks); yields its base URL."""
    with serve_process(repo, *(["--token", token] if token else [])) as server:
        yield server.url


@contextlib.contextmanager
def chromium() -> Iterator[Any]:
    """A headless Chromium under selenium, with a fresh profile and the console log kept."""
    present = all(os.access(p, os.X_OK) for p in (CHROMIUM, CHROMEDRIVER))
    if not present:
        message = "needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)"
        if os.environ.get("CAS_CKPT_REQUIRE_BROWSER") == "1":
            pytest.fail(message)
        pytest.skip(message)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    with tempfile.TemporaryDirectory(prefix="cas-ckpt-chromium-", ignore_cleanup_errors=True) as profile:
        options = webdriver.ChromeOptions()
        options.binary_location = CHROMIUM
        for flag in [*CHROMIUM_FLAGS, f"--user-data-dir={profile}"]:
            options.add_argument(flag)
        options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
        # The driver's path given: selenium's manager downloads nothing.
        driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
        try:
            yield driver
        finally:
            driver.quit()


def visit(driver: Any, url: str, page: str, *, timeout: float = 60) -> int:
    """Open ``url``, wait until page ``page`` has drawn; fail on an error shown or logged.
    Returns the milliseconds from the start of the navigation to the page drawn."""
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get(url)
    WebDriverWait(driver, timeout).until(lambda d: d.execute_script("return document.body.dataset.ready"))
    drawn = driver.execute_script("return document.body.dataset.ready")
    if drawn == "error":
        raise AssertionError(driver.find_element("id", "error").text)
    assert drawn == page, (drawn, page)
    no_console_errors(driver)
    return int(driver.execute_script("return Number(document.body.dataset.readyMs)"))


def no_console_errors(driver: Any) -> None:
    """Fail on any error the page logged since the last look (a failed request, an exception)."""
    errors = [entry for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]
    assert not errors, errors


def wait_for(driver: Any, script: str, timeout: float = 60) -> Any:
    """Wait until ``script`` (a JavaScript expression) is truthy; return its value."""
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout).until(lambda d: d.execute_script(f"return {script}"))


FINE_TUNED = ["model.layers.2.weight", "model.layers.2.bias", "head.weight"]  # what the fine-tune moves
NAN_STEP = 7  # the step at which runs/unstable first holds a NaN
LONG_COMMITS = 230  # more than one page of the history graph (200 rows)
LAYERS = 75  # 2 tensors each: 150 values plus head and step, two pages of the tree (100 rows)
ADAM_STEPS = 6  # runs/adam: loss finite up to step 4, Inf at 5, NaN at 6; lr 0 at step 1
ADAM_INF_STEP, ADAM_NAN_STEP = 5, 6
# a weight at a long path (the checkpoint page must still fit 1,400 px)
LONG_KEY = ("transformer_encoder_stack_with_a_rather_long_descriptive_name.layer_000."
            "multi_head_self_attention_projection.query_key_value_weight_matrix_parameters")
ADAM_MODEL = ["model.embed.weight", "model.proj.weight", f"model.{LONG_KEY}"]
ADAM_OPTIMIZER = [f"optim.state.{i}.{m}" for i in range(3) for m in ("exp_avg", "exp_avg_sq")]


@dataclass
class Facts:
    """What the small repository holds, worked out while it was made."""

    path: Path
    base_steps: list[int] = field(default_factory=list)
    ft_steps: list[int] = field(default_factory=list)
    fork_step: int = 8
    long_commits: int = LONG_COMMITS
    values: int = 0


def model_state(rng: np.random.Generator, step: int) -> dict[str, object]:
    layers = {}
    for i in range(LAYERS):
        layers[f"layers.{i}.weight"] = rng.standard_normal((16, 16)).astype(np.float32)
        layers[f"layers.{i}.bias"] = rng.standard_normal(16).astype(np.float32)
    # 64 KiB: a chunk of its own, so the tree shows bytes stored, new and shared
    return {"model": layers, "head.weight": rng.standard_normal((64, 256)).astype(np.float32), "step": step}


def small_repository(path: Path) -> Facts:
    facts = Facts(path)
    rng = np.random.default_rng(0)
    with cas_ckpt.open(path) as repo:
        state = model_state(rng, 0)
        facts.values = LAYERS * 2 + 2
        with cas_ckpt.CheckpointManager(repo, "runs/base", keep_last=3, keep_every=4) as base:
            for step in range(1, 13):
                layer = f"layers.{step % LAYERS}.weight"
                state["model"][layer] = state["model"][layer] + np.float32(0.01)  # type: ignore[index]
                state["step"] = step
                base.save(step, state, metrics={"loss": 1.0 / step, "lr": 1e-3 * 0.9**step})
                facts.base_steps.append(step)
        with cas_ckpt.CheckpointManager(repo, "runs/ft", fork_from="runs/base.steps/000000000008") as ft:
            tuned = repo.load("runs/ft")
            for step in (9, 10, 11):
                for key in ("layers.2.weight", "layers.2.bias"):
                    tuned["model"][key] = tuned["model"][key] * np.float32(1.01)
                tuned["head.weight"] = tuned["head.weight"] + np.float32(0.001)
                tuned["step"] = step
                ft.save(step, tuned, metrics={"loss": 0.5 / step})
                facts.ft_steps.append(step)
        with cas_ckpt.CheckpointManager(repo, "runs/unstable") as unstable:
            weights = {"w": rng.standard_normal(4096).astype(np.float32), "b": np.zeros(8, np.float32)}
            for step in range(1, 11):
                weights = {"w": weights["w"] * np.float32(1.5), "b": weights["b"] + np.float32(1)}
                if step == NAN_STEP:
                    weights["w"][123] = np.nan
                unstable.save(step, weights, metrics={"loss": float(step)})
        with repo.transaction() as txn:  # a merge of the two runs' heads
            tree = txn.tree.write({"merged": True})
            parents = [bytes(repo.resolve("runs/base")), bytes(repo.resolve("runs/ft"))]
            merge = txn.put_commit(tree, parents, step=13, metadata={}, message="merge ft into base")
            txn.move_ref("runs/merged", None, merge, "merge")
        with repo.transaction() as txn:  # a long run, in one batch (230 saves would fsync 230 times)
            parent: bytes | None = None
            for step in range(1, LONG_COMMITS + 1):
                tree = txn.tree.write({"x": step})
                parent = txn.put_commit(tree, [parent] if parent else [], step=step,
                                        metadata={"metrics": {"loss": 1.0 / step}}, message=None)
            assert parent is not None
            txn.move_ref("runs/long", None, parent, "generated")
        adam_run(repo, rng)
    return facts


def adam_run(repo: cas_ckpt.Repository, rng: np.random.Generator) -> None:
    """runs/adam: weights that move a little each step, optimizer moments and RNG state that
    change wholly (relative change near 1 or more), a step counter; the loss goes to Inf, then NaN."""
    def nested(path: str, value: object) -> dict[str, object]:
        for key in reversed(path.split(".")):
            value = {key: value}
        return value  # type: ignore[return-value]

    weights = {"embed": {"weight": rng.standard_normal((32, 8)).astype(np.float32)},
               "proj": {"weight": rng.standard_normal((8, 8)).astype(np.float32)},
               **nested(LONG_KEY, rng.standard_normal((4, 4)).astype(np.float32))}
    with cas_ckpt.CheckpointManager(repo, "runs/adam", keep_last=ADAM_STEPS) as adam:
        for step in range(1, ADAM_STEPS + 1):
            weights = {k: _scaled(v, 1.001) for k, v in weights.items()}
            moments = {str(i): {"exp_avg": rng.standard_normal(64).astype(np.float32),
                                "exp_avg_sq": rng.random(64).astype(np.float32)} for i in range(3)}
            state = {"model": weights, "optim": {"state": moments, "param_groups": [{"lr": 1e-3}]},
                     "step": step, "rng": rng.integers(0, 2**32, 16, dtype=np.uint32)}
            loss = {ADAM_INF_STEP: float("inf"), ADAM_NAN_STEP: float("nan")}.get(step, 2.0 / step)
            adam.save(step, state, metrics={"loss": loss, "lr": 0.0 if step == 1 else 1e-3})


def _scaled(value: object, factor: float) -> object:
    if isinstance(value, dict):
        return {k: _scaled(v, factor) for k, v in value.items()}
    return value * np.float32(factor)  # type: ignore[operator]


def large_repository(path: Path, *, commits: int = 2000, tensors: int = 10_000, fork_commits: int = 300,
                     per_layer: int = 100) -> None:
    """``commits`` commits on runs/big, each of ``tensors`` small tensors (and a 1 MiB head), one
    layer changed per commit; runs/big-ft forks at the middle for ``fork_commits`` more. Every
    100th step and the last three are retained (step refs); GC then expires the rest."""
    rng = np.random.default_rng(1)
    layers = tensors // per_layer
    with cas_ckpt.open(path) as repo:
        with repo.transaction() as txn:
            values = [{f"w{j}": rng.standard_normal(16).astype(np.float32) for j in range(per_layer)}
                      for _ in range(layers)]
            nodes = [txn.tree.write(layer) for layer in values]
            head = Link(txn.tree.write({"weight": rng.standard_normal(1 << 18).astype(np.float32)}))

            def commit(step: int, parent: bytes | None, layer: int, loss: float) -> bytes:
                changed = dict(values[layer])
                changed["w0"] = changed["w0"] + np.float32(step * 1e-3)
                nodes[layer] = txn.tree.write(changed)
                state = {"model": {f"layers.{i}": Link(nodes[i]) for i in range(layers)}, "head": head,
                         "step": step}
                return txn.put_commit(txn.tree.write(state), [parent] if parent else [], step=step,
                                      metadata={"step": step, "metrics": {"loss": loss, "lr": 1e-3}},
                                      message=None)

            parent: bytes | None = None
            kept: dict[str, bytes] = {}
            fork_at = commits // 2
            fork_parent, fork_nodes = b"", list(nodes)
            for step in range(1, commits + 1):
                parent = commit(step, parent, step % layers, 1.0 / step)
                if step % 100 == 0 or step > commits - 3:
                    kept[f"runs/big.steps/{step:012d}"] = parent
                if step == fork_at:
                    fork_parent, fork_nodes = parent, list(nodes)
            txn.move_ref("runs/big", None, parent, "generated")
            nodes[:] = fork_nodes
            ft_parent = fork_parent
            for step in range(fork_at + 1, fork_at + fork_commits + 1):
                ft_parent = commit(step, ft_parent, (step * 7) % layers, 0.5 / step)
            txn.move_ref("runs/big-ft", None, ft_parent, "generated")
            for name, cid in kept.items():
                txn.move_ref(name, None, cid, "generated")
        repo.gc(reflog_expiry=0)
