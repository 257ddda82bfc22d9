"""The browser view in a real browser: headless Chromium (Debian's, through its chromium-driver)
against a real server process, on repositories made by CheckpointManager.

Every page must load with no console error; the graph and the charts must draw the commits and
points the repository holds; a click on a commit opens its tree; the diff page lists exactly the
tensors a known fine-tune moved; the NaN planted at one step is found at that step (page and
CLI); the storage page gives the repository's figures; the token rule holds for every route.
Slow: 2,000 commits of 10,000 tensors each (every page draws; how fast is measured by
benchmarks/inspect_bench.py, not asserted here); screenshots.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from browsing import (
    ADAM_INF_STEP,
    ADAM_MODEL,
    ADAM_NAN_STEP,
    ADAM_OPTIMIZER,
    ADAM_STEPS,
    FINE_TUNED,
    LONG_KEY,
    NAN_STEP,
    Facts,
    chromium,
    large_repository,
    no_console_errors,
    served,
    small_repository,
    visit,
    wait_for,
)

import cas_ckpt
from cas_ckpt.cli import human

BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def facts(tmp_path_factory: pytest.TempPathFactory) -> Facts:
    return small_repository(tmp_path_factory.mktemp("browse") / "repo")


@pytest.fixture(scope="module")
def server(facts: Facts) -> Iterator[str]:
    with served(facts.path) as base:
        yield base


@pytest.fixture(scope="module")
def driver() -> Iterator[Any]:
    with chromium() as browser:
        yield browser


def rows(driver: Any, css: str) -> list[Any]:
    return driver.find_elements("css selector", css)


def erase(box: Any) -> None:
    """Empty a text box as typing would (selenium's clear() sends no input event)."""
    from selenium.webdriver.common.keys import Keys

    box.send_keys(Keys.CONTROL, "a")
    box.send_keys(Keys.BACKSPACE)


def attribute_values(driver: Any, css: str, name: str) -> list[str]:
    return [row.get_attribute(name) for row in rows(driver, css)]


def chart(driver: Any, metric: str) -> Any:
    return driver.find_element("css selector", f"svg.chart[data-metric={metric}]")


def series_colors(driver: Any, metric: str) -> dict[str, str]:
    return {g.get_attribute("data-ref"): g.get_attribute("data-color")
            for g in rows(driver, f"svg.chart[data-metric={metric}] g.series")}


def legend(driver: Any, metric: str) -> list[str]:
    box = chart(driver, metric).find_element("xpath", "..")
    return [span.get_attribute("data-ref") for span in box.find_elements("css selector", ".legend > span")]


def tick(driver: Any, step: int) -> None:
    driver.find_element("css selector", f"#graph tr[data-step='{step}'] input.pick").click()


def open_diff(driver: Any) -> None:
    driver.find_element("id", "diff-picked").click()
    wait_for(driver, "document.body.dataset.ready === 'diff'")
    wait_for(driver, "document.getElementById('changed').dataset.state === 'done'")
    no_console_errors(driver)


def side(driver: Any, which: str) -> dict[str, str]:
    found = driver.find_element("id", f"side-{which}")
    return {key: found.get_attribute(f"data-{key}") for key in ("run", "step", "cid")}


# -- runs ------------------------------------------------------------------------------------------
def test_runs_page_lists_every_run_filters_and_shows_storage(driver: Any, server: str, facts: Facts) -> None:
    visit(driver, f"{server}/", "runs")  # / leads to the runs page
    runs = attribute_values(driver, "#runs tbody tr", "data-ref")
    assert runs == ["runs/adam", "runs/base", "runs/ft", "runs/long", "runs/merged", "runs/unstable"]
    steps = [row.find_elements("css selector", "td")[2].text for row in rows(driver, "#runs tbody tr")]
    assert steps == [str(ADAM_STEPS), "12", "11", str(facts.long_commits), "13", "10"]
    # each run's parent and fork step: the fine-tune forked from base at step 8, the merge
    # continued base from its head (step 12); the others started on their own
    forks = {row.get_attribute("data-ref"): (row.find_element("css selector", ".parent").text,
                                             row.find_element("css selector", ".fork-step").text)
             for row in rows(driver, "#runs tbody tr")}
    alone = ("", "")
    assert forks == {"runs/adam": alone, "runs/base": alone, "runs/long": alone, "runs/unstable": alone,
                     "runs/ft": ("runs/base", str(facts.fork_step)), "runs/merged": ("runs/base", "12")}
    wait_for(driver, "document.getElementById('runs').dataset.storage === 'done'")
    with cas_ckpt.open(facts.path, read_only=True) as repo:
        report = {r.run: r for r in repo.stats().runs}
        every = len(repo.refs())
    stored = {row.get_attribute("data-ref"): row.find_element("css selector", ".stored").text
              for row in rows(driver, "#runs tbody tr")}
    assert stored == {run: human(r.stored_bytes) for run, r in report.items()}
    box = driver.find_element("id", "prefix")
    box.send_keys("runs/u")
    wait_for(driver, "document.querySelectorAll('#runs tbody tr').length === 1")
    assert attribute_values(driver, "#runs tbody tr", "data-ref") == ["runs/unstable"]
    erase(box)
    driver.find_element("id", "every").click()  # every ref: the retained steps' refs too
    wait_for(driver, f"document.getElementById('runs').dataset.total === '{every}'")
    no_console_errors(driver)


def test_runs_compared_on_one_chart(driver: Any, server: str) -> None:
    visit(driver, f"{server}/ui/runs", "runs")
    for row in rows(driver, "#runs tbody tr"):
        if row.get_attribute("data-ref") in ("runs/long", "runs/unstable"):
            row.find_element("css selector", "input.pick").click()
    driver.find_element("id", "compare").click()
    wait_for(driver, "document.body.dataset.ready === 'run'")
    no_console_errors(driver)
    assert legend(driver, "loss") == ["runs/long", "runs/unstable"]
    drawn = attribute_values(driver, "svg.chart[data-metric=loss] g.series", "data-ref")
    assert drawn == ["runs/unstable", "runs/long"]  # the first drawn last: on top


# -- a run's history ----------------------------------------------------------------------------
def test_run_page_draws_the_graph_and_the_charts(driver: Any, server: str, facts: Facts) -> None:
    visit(driver, f"{server}/ui/run?ref=runs/base", "run")
    # the history table holds runs/base's own history; the related runs behind a toggle
    steps = [int(s) for s in attribute_values(driver, "#graph tbody tr", "data-step")]
    assert steps == facts.base_steps[::-1]
    driver.find_element("id", "related").click()
    wait_for(driver, "document.getElementById('graph').dataset.related === '1'")
    # runs/base, and the runs that share history with it: the fine-tune forked from it, the merge
    expected_commits = len(facts.base_steps) + len(facts.ft_steps) + 1
    wait_for(driver, "!document.getElementById('more') || document.getElementById('more').hidden")
    assert len(rows(driver, "#graph circle.commit")) == expected_commits
    assert len(rows(driver, "#graph tbody tr")) == expected_commits
    with cas_ckpt.open(facts.path, read_only=True) as repo:
        history = list(repo.log("runs/base"))
        expired = {str(c.cid) for c in history if repo.expired(c)}
    assert len(expired) == 7  # keep_last=3, keep_every=4 of 12: steps 4, 8, 10, 11, 12 stay
    assert set(attribute_values(driver, "#graph tr.expired", "data-cid")) == expired
    assert len(rows(driver, "#graph .badge.fork")) == 1  # step 8: where runs/ft forked
    assert len(rows(driver, "#graph .badge.merge")) == 1
    # a fork drawn where it happened: into step 8's row come two lines, one from each run
    fork = driver.find_element("css selector", f"#graph tr[data-step='{facts.fork_step}'][class*=clickable]")
    assert len(fork.find_elements("css selector", "svg line")) >= 3
    # one chart per metric; a series per run with a point per commit of its first-parent line
    points = {(chart, s.get_attribute("data-ref")): len(s.find_elements("css selector", "circle.point"))
              for chart in ("loss", "lr")
              for s in rows(driver, f"svg.chart[data-metric={chart}] g.series")}
    lr_in_ft = facts.fork_step  # the fine-tune's own saves log no lr
    assert points == {("loss", "runs/base"): 12, ("loss", "runs/ft"): facts.fork_step + 3,
                      ("loss", "runs/merged"): 12, ("lr", "runs/base"): 12, ("lr", "runs/ft"): lr_in_ft,
                      ("lr", "runs/merged"): 12}


def test_the_viewed_run_is_on_top_first_and_keeps_its_colour(driver: Any, server: str, facts: Facts) -> None:
    with cas_ckpt.open(facts.path, read_only=True) as repo:
        own = [str(c.cid) for c in repo.log("runs/ft")]
    visit(driver, f"{server}/ui/run?ref=runs/ft", "run")
    colors = {}
    for metric in ("loss", "lr"):
        drawn = attribute_values(driver, f"svg.chart[data-metric={metric}] g.series", "data-ref")
        assert drawn[-1] == "runs/ft" and legend(driver, metric)[0] == "runs/ft", (metric, drawn)
        colors[metric] = series_colors(driver, metric)
    assert colors["loss"] == colors["lr"] and len(set(colors["loss"].values())) == 3
    ft = colors["loss"]["runs/ft"]
    # the history table: runs/ft's history, newest first; no other run's commit before it
    assert attribute_values(driver, "#graph tbody tr", "data-cid") == own
    lanes = {c.get_attribute("stroke") for c in rows(driver, "#graph tbody tr:first-child circle.commit")}
    assert lanes == {ft}
    visit(driver, f"{server}/ui/run?ref=runs/base", "run")  # the same colours on another run's page
    assert attribute_values(driver, "svg.chart[data-metric=loss] g.series", "data-ref")[-1] == "runs/base"
    assert series_colors(driver, "loss") == colors["loss"]
    visit(driver, f"{server}/ui/runs", "runs")
    assert driver.find_element("css selector", "#runs tr[data-ref='runs/ft'] .swatch").get_attribute(
        "data-color") == ft


def test_charts_mark_nonfinite_values_zoom_and_log_scale(driver: Any, server: str) -> None:
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.support.ui import Select

    visit(driver, f"{server}/ui/run?ref=runs/adam", "run")
    loss = chart(driver, "loss")
    # NaN and Inf are marked at the top edge, not dropped; the finite values are points
    marks = [(m.get_attribute("data-step"), m.get_attribute("data-value"))
             for m in loss.find_elements("css selector", "path.nonfinite")]
    assert marks == [(str(ADAM_INF_STEP), "Inf"), (str(ADAM_NAN_STEP), "NaN")]
    title = loss.find_element("css selector", f"path.nonfinite[data-step='{ADAM_NAN_STEP}'] title")
    assert title.get_attribute("textContent") == f"runs/adam: loss NaN at step {ADAM_NAN_STEP}"
    assert len(loss.find_elements("css selector", "circle.point")) == ADAM_STEPS - 2
    # drag across steps 1.5..4.5: the x range narrows; a double click puts it back, opening nothing
    full = (loss.get_attribute("data-x0"), loss.get_attribute("data-x1"))
    assert full == ("1", str(ADAM_STEPS))
    driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", loss)
    width = loss.size["width"]  # 560: the plot runs from x=56 to x=548
    ActionChains(driver).move_to_element_with_offset(loss, 56 + 492 * 0.1 - width / 2, 0).click_and_hold() \
        .move_by_offset(int(492 * 0.6), 0).release().perform()
    wait_for(driver, "document.querySelector('svg.chart[data-metric=loss]').dataset.zoomed === '1'")
    x0, x1 = float(loss.get_attribute("data-x0")), float(loss.get_attribute("data-x1"))
    assert 1.3 < x0 < 1.7 and 4.3 < x1 < 4.7, (x0, x1)
    assert len(loss.find_elements("css selector", "circle.point")) == 3  # steps 2, 3 and 4
    assert len(loss.find_elements("css selector", "path.nonfinite")) == 0
    page = driver.current_url
    ActionChains(driver).double_click(loss).perform()
    wait_for(driver, "document.querySelector('svg.chart[data-metric=loss]').dataset.zoomed === ''")
    assert (loss.get_attribute("data-x0"), loss.get_attribute("data-x1")) == full
    driver.execute_script("return new Promise((done) => setTimeout(done, 600))")
    assert driver.current_url == page and driver.execute_script("return document.body.dataset.ready") == "run"
    # log scale: every chart; a value <= 0 (lr 0 at step 1) is left out and the chart says so
    driver.find_element("id", "log-scale").click()
    assert loss.get_attribute("data-log") == "1" == chart(driver, "lr").get_attribute("data-log")
    lr_box = chart(driver, "lr").find_element("xpath", "..")
    note = lr_box.find_element("css selector", ".chart-note").text
    assert note == "1 value ≤ 0 not drawn on the log scale."
    assert len(chart(driver, "lr").find_elements("css selector", "circle.point")) == ADAM_STEPS - 1
    # smoothing (off by default): a smoothed line over the raw one
    assert not loss.find_elements("css selector", "polyline.smoothed")
    Select(driver.find_element("id", "smoothing")).select_by_visible_text("0.9")
    assert loss.get_attribute("data-smooth") == "0.9"
    assert len(loss.find_elements("css selector", "polyline.smoothed")) == 1
    no_console_errors(driver)


def test_history_pages_load_lazily(driver: Any, server: str, facts: Facts) -> None:
    visit(driver, f"{server}/ui/run?ref=runs/long", "run")
    assert len(rows(driver, "#graph circle.commit")) == 200  # the first page
    driver.find_element("id", "more").click()
    wait_for(driver, f"document.querySelectorAll('#graph circle.commit').length === {facts.long_commits}")
    assert not driver.find_element("id", "more").is_displayed()
    steps = [int(s) for s in attribute_values(driver, "#graph tbody tr", "data-step")]
    assert steps == list(range(facts.long_commits, 0, -1))
    no_console_errors(driver)


def test_clicking_a_commit_opens_its_tree(driver: Any, server: str, facts: Facts) -> None:
    visit(driver, f"{server}/ui/run?ref=runs/ft", "run")
    driver.find_element("css selector", "#graph tr[data-step='10']").click()
    wait_for(driver, "document.body.dataset.ready === 'checkpoint'")
    no_console_errors(driver)
    assert driver.find_element("tag name", "h1").text == "Checkpoint at step 10"
    with cas_ckpt.open(facts.path, read_only=True) as repo:
        step_10 = str(repo.resolve("runs/ft~1"))
    assert driver.find_element("id", "cid").text == step_10
    assert driver.find_element("id", "tree").get_attribute("data-total") == str(facts.values)
    assert attribute_values(driver, "#tree tbody tr[data-path]", "data-path")[:2] == ["model.layers.0.weight",
                                                                           "model.layers.0.bias"]


# -- one checkpoint ------------------------------------------------------------------------------
def test_tree_pages_searches_and_computes_statistics(driver: Any, server: str, facts: Facts) -> None:
    visit(driver, f"{server}/ui/checkpoint?target=runs/ft&ref=runs/ft", "checkpoint")
    assert driver.find_element("css selector", ".pager .range").text == f"1\u2013100 of {facts.values}"
    driver.find_element("css selector", ".pager .next").click()
    second = f"101\u2013{facts.values} of {facts.values}"
    wait_for(driver, f"document.querySelector('.pager .range').textContent === '{second}'")
    assert len(rows(driver, "#tree tbody tr[data-path]")) == facts.values - 100
    search = driver.find_element("id", "search")
    search.send_keys("layers.2.")
    wait_for(driver, "document.getElementById('tree').dataset.total === '2'")
    assert attribute_values(driver, "#tree tbody tr[data-path]", "data-path") == ["model.layers.2.weight",
                                                                       "model.layers.2.bias"]
    erase(search)
    driver.find_element("id", "changed").click()  # only what step 11 changed from step 10
    wait_for(driver, "document.getElementById('tree').dataset.total === '4'")
    changed = attribute_values(driver, "#tree tbody tr[data-path]", "data-path")
    assert changed == [*FINE_TUNED[:2], "head.weight", "step"]
    head = driver.find_element("css selector", "#tree tr[data-path='head.weight']")
    head.find_element("css selector", "button.stats").click()
    cell = wait_for(driver, "document.querySelector(\"#tree tr[data-path='head.weight'] .stats-cell\")"
                            ".dataset.l2 ? document.querySelector(\"#tree tr[data-path='head.weight'] "
                            ".stats-cell\").dataset : null")
    with cas_ckpt.open(facts.path, read_only=True) as repo:
        [expected] = repo.stats("runs/ft", "head.weight")
    for key in ("min", "max", "mean", "std", "l2"):
        assert float(cell[key]) == pytest.approx(getattr(expected, key), rel=1e-12), key
    assert (cell["nan"], cell["inf"]) == ("0", "0")
    no_console_errors(driver)


def test_tree_shows_bytes_new_and_shared(driver: Any, server: str, facts: Facts) -> None:
    with cas_ckpt.open(facts.path, read_only=True) as repo:
        step_11, step_8 = str(repo.resolve("runs/base~1")), str(repo.resolve("runs/base.steps/000000000008"))

    def head_cells(target: str, ref: str) -> list[str]:
        visit(driver, f"{server}/ui/checkpoint?target={target}&ref={ref}&q=head", "checkpoint")
        cells = driver.find_elements("css selector", "#tree tr[data-path='head.weight'] td")
        return [td.text for td in cells][4:9]  # logical, stored, new, shared with parent, with others

    # base's head.weight: one 64 KiB chunk never changed, so shared with the parent (step 10),
    # nothing new, and held by runs/ft too (forked at step 8): shared with other refs
    assert head_cells(step_11, "runs/base") == ["64.0 KiB", "64.0 KiB", "0 B", "64.0 KiB", "64.0 KiB"]
    # step 8's parent (step 7) expired: what is new there is not known
    assert head_cells(step_8, "runs/base") == ["64.0 KiB", "64.0 KiB", "\u2013", "\u2013", "64.0 KiB"]
    assert "collected" in driver.find_element("id", "tree-note").text
    # the fine-tune changed it at its last step: new there, in no other run
    assert head_cells("runs/ft", "runs/ft") == ["64.0 KiB", "64.0 KiB", "64.0 KiB", "0 B", "0 B"]


def test_an_expired_checkpoint_says_so(driver: Any, server: str, facts: Facts) -> None:
    with cas_ckpt.open(facts.path, read_only=True) as repo:
        step_3 = str(repo.resolve("runs/base~9"))
    visit(driver, f"{server}/ui/checkpoint?target={step_3}", "checkpoint")
    assert "Expired" in driver.find_element("id", "expired").text


# -- two checkpoints -----------------------------------------------------------------------------
def test_diff_page_lists_exactly_the_fine_tuned_tensors(driver: Any, server: str, facts: Facts) -> None:
    with cas_ckpt.open(facts.path, read_only=True) as repo:
        fork = str(repo.resolve("runs/base.steps/000000000008"))
        report = repo.diff(fork, "runs/ft")
    visit(driver, f"{server}/ui/run?ref=runs/ft", "run")
    for step in (facts.fork_step, facts.ft_steps[-1]):
        tick(driver, step)
    open_diff(driver)
    assert side(driver, "a") == {"run": "runs/base", "step": str(facts.fork_step), "cid": fork}
    assert side(driver, "b")["run"] == "runs/ft" and side(driver, "b")["step"] == str(facts.ft_steps[-1])
    listed = attribute_values(driver, "#changed tbody tr[data-path]", "data-path")
    assert sorted(listed) == sorted(FINE_TUNED)
    relative = {c.path: c.relative for c in report.changed if c.relative is not None}
    model = [p for p in FINE_TUNED if p.startswith("model.")]  # head.weight is no model.* path: other
    assert listed == [*sorted(model, key=lambda p: -relative[p]), "head.weight"]  # largest change first
    shown = {r.get_attribute("data-path"): float(r.get_attribute("data-relative"))
             for r in rows(driver, "#changed tbody tr[data-path]")}
    assert shown == pytest.approx(relative, rel=1e-12)
    assert [li.text for li in rows(driver, "#other-changes li")] == ["step: 8 -> 11"]
    layers = attribute_values(driver, "#layers rect.layer", "data-layer")
    assert sorted(layers) == ["head", "model.layers.2"]
    sides = driver.find_elements("css selector", "#changed tbody tr[data-path] a")[:2]
    assert [a.text for a in sides] == ["A", "B"]
    sides[1].click()
    wait_for(driver, "document.body.dataset.ready === 'checkpoint'")
    assert driver.find_element("id", "cid").text == str(report and cas_ckpt.open(facts.path, read_only=True)
                                                         .resolve("runs/ft"))


def test_diff_direction_sides_swap_and_groups(driver: Any, server: str, facts: Facts) -> None:
    with cas_ckpt.open(facts.path, read_only=True) as repo:
        cids = {c.step: str(c.cid) for c in repo.log("runs/adam")}
    for ticked in ((ADAM_STEPS, 2), (2, ADAM_STEPS)):  # either order: from the older to the newer
        visit(driver, f"{server}/ui/run?ref=runs/adam", "run")
        for step in ticked:
            tick(driver, step)
        open_diff(driver)
        assert side(driver, "a") == {"run": "runs/adam", "step": "2", "cid": cids[2]}, ticked
        assert side(driver, "b") == {"run": "runs/adam", "step": str(ADAM_STEPS), "cid": cids[ADAM_STEPS]}
        assert driver.find_element("id", "direction").text == "From A to B: older → newer"
        assert cids[2] in driver.find_element("id", "side-a").text  # the CID written out
    # model weights first (though the moments and the RNG state changed far more), then the
    # optimizer state, then the rest
    groups = {g: attribute_values(driver, f"#changed tbody[data-group={g}] tr[data-path]", "data-path")
              for g in ("model", "optimizer", "other")}
    assert sorted(groups["model"]) == sorted(ADAM_MODEL) and f"model.{LONG_KEY}" in groups["model"]
    assert sorted(groups["optimizer"]) == sorted(ADAM_OPTIMIZER) and groups["other"] == ["rng"]
    listed = attribute_values(driver, "#changed tbody tr[data-path]", "data-path")
    assert listed == groups["model"] + groups["optimizer"] + groups["other"]
    relative = {r.get_attribute("data-path"): float(r.get_attribute("data-relative"))
                for r in rows(driver, "#changed tbody tr[data-path]")}
    assert max(relative[p] for p in ADAM_MODEL) < min(relative[p] for p in ADAM_OPTIMIZER)
    for members in groups.values():
        assert [relative[p] for p in members] == sorted((relative[p] for p in members), reverse=True)
    # model only: the optimizer state and the other values (step: 2 -> 6) out of sight
    assert driver.find_element("id", "other-changes").is_displayed()
    driver.find_element("id", "model-only").click()
    shown = [r.get_attribute("data-path") for r in rows(driver, "#changed tbody tr[data-path]")
             if r.is_displayed()]
    assert sorted(shown) == sorted(ADAM_MODEL)
    assert not driver.find_element("id", "other-changes").is_displayed()
    layers = attribute_values(driver, "#layers rect.layer", "data-layer")
    assert layers and all(name.startswith("model.") for name in layers)
    assert "model=1" in driver.current_url
    # swap: newer -> older, said so
    driver.find_element("id", "swap").click()
    wait_for(driver, "document.body.dataset.ready === 'diff' && document.getElementById('side-a')"
                     f".dataset.step === '{ADAM_STEPS}'")
    assert side(driver, "b")["step"] == "2"
    assert driver.find_element("id", "direction").text == "From A to B: newer → older"
    assert driver.find_element("id", "model-only").is_selected()
    no_console_errors(driver)


# -- layout --------------------------------------------------------------------------------------
def test_pages_fit_1400_pixels(driver: Any, server: str) -> None:
    """The checkpoint page (a weight at a long path, CIDs written out) and the diff page fit a
    1,400 px window: long values wrap, nothing scrolls sideways."""
    driver.set_window_size(1400, 900)
    try:
        for path, page in (("/ui/checkpoint?target=runs/adam&ref=runs/adam", "checkpoint"),
                           ("/ui/diff?a=runs/adam~4&b=runs/adam", "diff"), ("/ui/runs", "runs")):
            visit(driver, server + path, page)
            width, visible = driver.execute_script(
                "return [document.documentElement.scrollWidth, document.documentElement.clientWidth]")
            assert width <= visible <= 1400, (path, width, visible)
        visit(driver, f"{server}/ui/checkpoint?target=runs/adam&ref=runs/adam", "checkpoint")
        cell = driver.find_element("css selector", f"#tree tr[data-path='model.{LONG_KEY}'] td.path")
        assert cell.size["height"] > 30  # wrapped onto a second line
    finally:
        driver.set_window_size(1280, 900)


# -- health ------------------------------------------------------------------------------------
def test_a_planted_nan_is_found_at_its_step(driver: Any, server: str, facts: Facts) -> None:
    visit(driver, f"{server}/ui/run?ref=runs/unstable", "run")
    driver.find_element("id", "find-nonfinite").click()
    found = wait_for(driver, "document.getElementById('nonfinite').dataset.state === 'done' && "
                             "document.getElementById('nonfinite').dataset")
    assert found["step"] == str(NAN_STEP)
    assert attribute_values(driver, "#nonfinite table.stats tbody tr", "data-path") == ["w"]
    assert attribute_values(driver, "#graph tr.marked", "data-step") == [str(NAN_STEP)]
    no_console_errors(driver)
    done = subprocess.run([str(BIN / "cas-ckpt"), "--repo", str(facts.path), "stats", "runs/unstable",
                           "--find-nonfinite", "--json"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    report = json.loads(done.stdout)
    assert report["step"] == NAN_STEP and [t["path"] for t in report["tensors"]] == ["w"]
    assert report["tensors"][0]["nan"] == 1


def test_storage_page_gives_the_repository_figures(driver: Any, server: str, facts: Facts) -> None:
    visit(driver, f"{server}/ui/storage", "storage")
    with cas_ckpt.open(facts.path, read_only=True) as repo:
        usage = repo.stats()
        freeable = repo.gc(dry_run=True).unreachable_bytes
    runs = {r.run: r for r in usage.runs}
    assert driver.find_element("id", "stored").text == human(usage.stored_bytes)
    assert driver.find_element("id", "gc-free").text.startswith(human(freeable))
    shown = {r.get_attribute("data-run"): (r.find_element("css selector", ".exclusive").text,
                                           r.find_element("css selector", ".shared").text)
             for r in rows(driver, "#run-storage tbody tr")}
    assert shown == {name: (human(r.exclusive_bytes), human(r.shared_bytes)) for name, r in runs.items()}
    assert len(rows(driver, "#run-bars rect.exclusive")) == len(runs)
    assert runs["runs/base"].shared_bytes > 0 and runs["runs/ft"].shared_bytes > 0  # the fork's weights


# -- the token rule ----------------------------------------------------------------------------
def status(url: str, headers: dict[str, str] | None = None) -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=30) as r:
            return int(r.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def test_the_token_rule_holds_for_the_browser_routes(driver: Any, facts: Facts) -> None:
    token = "s3cret-token"
    with served(facts.path, token=token) as base:
        for path in ("/ui/", "/ui/run?ref=runs/base", "/ui/static/app.js", "/ui/api/runs",
                     "/ui/api/graph?ref=runs/base", "/ui/api/storage"):
            assert status(base + path) == 401, path
            assert status(base + path, {"Authorization": "Bearer wrong"}) == 401, path
            assert status(base + path, {"Authorization": f"Bearer {token}"}) == 200, path
        visit(driver, f"{base}/?token={quote(token)}", "runs")  # the cookie carries it from here
        assert "token" not in driver.current_url
        port = base.rsplit(":", 1)[1]
        cookie = driver.get_cookie(f"cas_ckpt_session_{port}")  # a session of this server's pages
        assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and cookie["path"] == "/ui"
        assert token not in cookie["value"]
        visit(driver, f"{base}/ui/storage", "storage")
        driver.delete_all_cookies()
        driver.get(f"{base}/ui/storage")
        assert "needs a token" in driver.page_source
        driver.get_log("browser")  # the refused request's console line


# -- at scale ----------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_large_repository_stays_usable(driver: Any, tmp_path: Path) -> None:
    """2,000 commits (and a fork of 300) of 10,000 tensors each: every page draws, the graph and
    charts page, the tree paginates (the time each page takes is benchmarks/inspect_bench.py's)."""
    large_repository(tmp_path / "big")
    with cas_ckpt.open(tmp_path / "big", read_only=True) as repo:
        middle = str(repo.resolve("runs/big.steps/000000001000"))
    pages = [("/ui/", "runs"), ("/ui/run?ref=runs/big", "run"),
             ("/ui/checkpoint?target=runs/big&ref=runs/big", "checkpoint"),
             (f"/ui/diff?a={middle}&b=runs/big-ft", "diff"), ("/ui/storage", "storage")]
    with served(tmp_path / "big") as base:
        for path, page in pages:
            visit(driver, base + path, page)
        visit(driver, f"{base}/ui/run?ref=runs/big", "run")
        assert driver.find_element("id", "graph").get_attribute("data-total") == "2000"  # its own history
        assert len(rows(driver, "#graph circle.commit")) == 200
        driver.find_element("id", "related").click()  # and the fork's
        wait_for(driver, "document.getElementById('graph').dataset.total === '2300'")
        assert len(rows(driver, "#graph circle.commit")) == 200
        chart = "svg.chart[data-metric=loss] g.series[data-ref='runs/big']"
        line = driver.find_element("css selector", chart)
        assert line.get_attribute("data-points") == "2000"  # too many dots to tell apart: a line
        assert len(line.find_element("tag name", "polyline").get_attribute("points").split()) == 2000
        visit(driver, f"{base}/ui/checkpoint?target=runs/big", "checkpoint")
        assert driver.find_element("id", "tree").get_attribute("data-total") == "10002"


@pytest.mark.slow
def test_screenshots(driver: Any, tmp_path: Path) -> None:
    """A screenshot of each page, in $CAS_CKPT_SCREENSHOTS (scripts/screenshots.sh: docs/img)."""
    out = Path(os.environ.get("CAS_CKPT_SCREENSHOTS") or tmp_path)
    out.mkdir(parents=True, exist_ok=True)
    facts = small_repository(tmp_path / "checkpoints")
    with cas_ckpt.open(facts.path, read_only=True) as repo:
        fork = str(repo.resolve("runs/base.steps/000000000008"))
    pages = {"runs": "/ui/", "run": "/ui/run?ref=runs/base", "checkpoint":
             "/ui/checkpoint?target=runs/ft&ref=runs/ft&changed=1", "diff": f"/ui/diff?a={fork}&b=runs/ft",
             "storage": "/ui/storage"}
    with served(facts.path) as base:
        for page, path in pages.items():
            visit(driver, base + path, page)
            if page == "diff":
                wait_for(driver, "document.getElementById('changed').dataset.state === 'done'")
            if page == "checkpoint":
                driver.find_element("id", "page-stats").click()
                wait_for(driver, "!document.getElementById('page-stats').disabled && "
                                 "document.querySelector('.stats-cell').dataset.l2")
            if page == "runs":
                wait_for(driver, "document.getElementById('runs').dataset.storage === 'done'")
            driver.save_screenshot(str(out / f"{page}.png"))
    for page in pages:
        assert (out / f"{page}.png").stat().st_size > 10_000
