"""The commit graph: its file format, its merges, and history read through it exactly as from blocks.

Every history answer is checked against the same history read from the commit blocks themselves
(:func:`from_blocks`): whatever state the graph is in (covering all, part or none of the history,
damaged, truncated, holding commits GC removed), the answers must be the blocks' answers.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
from helpers import from_blocks
from hypothesis import given
from hypothesis import strategies as st

import cas_ckpt
from cas_ckpt import cid as cidlib
from cas_ckpt import codec
from cas_ckpt.commit import encode_commit
from cas_ckpt.commit_graph import (
    FOOTER,
    MAGIC,
    CommitGraph,
    ForeignLayer,
    encode_layer,
    merge_set,
    parse_layer,
)
from cas_ckpt.errors import AncestorNotFound, BlockNotFound, CorruptStore
from cas_ckpt.history import GRAPH_EVERY, WALK_LIMIT

HASHER = cidlib.Hasher()
FIXTURE = Path(__file__).parent / "fixtures" / "v1-repo"


# -- helpers -------------------------------------------------------------------------------------
def save_many(repo: cas_ckpt.Repository, count: int, *, ref: str = "main", start: int = 0) -> None:
    for step in range(start, start + count):
        repo.save({"w": step}, ref=ref, step=step, metadata={"metrics": {"loss": 1 / (step + 1)}},
                  message=f"save {step:04d}")


def graph(repo: cas_ckpt.Repository) -> CommitGraph:
    assert repo.history.graph is not None
    repo.history.graph.refresh()
    return repo.history.graph


def layer_files(repo: cas_ckpt.Repository) -> dict[str, bytes]:
    """The layers as stored, name -> bytes."""
    backend = graph(repo).backend
    return {i.name: backend.read(i.name, 0, i.size) or b"" for i in backend.list()}


def rewrite(repo: cas_ckpt.Repository, name: str, data: bytes) -> None:
    """Put ``data`` in place of layer ``name`` (a damaged copy, as a bad disk would leave it)."""
    backend = graph(repo).backend
    sink = backend.create()
    sink.write(data)
    sink.replace(name)


def commit_nodes(count: int) -> dict[bytes, bytes]:
    """``count`` chained commit nodes (CID -> bytes), as saves would write them."""
    nodes: dict[bytes, bytes] = {}
    parent: list[bytes] = []
    tree = HASHER.node(codec.encode({"x": 1}))
    for step in range(count):
        node = encode_commit(tree, parent, step=step, time=1000.0 + step, metadata={"i": step},
                             message=f"m{step}")
        cid = HASHER.node(node)
        nodes[cid] = node
        parent = [cid]
    return nodes


# -- the layer format ----------------------------------------------------------------------------
@given(st.integers(0, 40), st.lists(st.binary(min_size=32, max_size=32), max_size=5))
def test_layers_round_trip(count: int, digests: list[bytes]) -> None:
    nodes = commit_nodes(count)
    frontier = [cidlib.prefix(cidlib.MSGPACK, cidlib.SHA2_256) + d for d in digests]
    data, name = encode_layer(nodes, frontier)
    layer = parse_layer(data, name, "layer")
    assert {cid: data[o : o + n] for cid, (o, n) in layer.entries.items()} == nodes
    assert layer.frontier == frozenset(frontier)
    index_length = FOOTER.unpack(data[-FOOTER.size :])[0]
    assert name == hashlib.sha256(data[-FOOTER.size - index_length :]).hexdigest() + ".graph"
    shuffled = dict(reversed(list(nodes.items())))
    assert encode_layer(shuffled, reversed(frontier)) == (data, name)  # the same commits, the same file


@given(st.data())
def test_no_damage_to_a_layer_gives_a_wrong_commit(data: st.DataObject) -> None:
    """Any truncation or flipped byte is refused when the layer is read, or caught when a copy is
    checked against its CID: never a commit the blocks would not give."""
    nodes = commit_nodes(6)
    good, name = encode_layer(nodes, [])
    if data.draw(st.booleans()):
        damaged = good[: data.draw(st.integers(0, len(good) - 1))]
    else:
        at = data.draw(st.integers(0, len(good) - 1))
        damaged = good[:at] + bytes([good[at] ^ data.draw(st.integers(1, 255))]) + good[at + 1 :]
    try:
        layer = parse_layer(damaged, name, "layer")
    except (CorruptStore, ForeignLayer):
        return
    for cid, (offset, length) in layer.entries.items():
        copy = damaged[offset : offset + length]
        assert copy == nodes.get(cid) or not cidlib.matches(cid, copy)


def test_layer_checks_name_what_is_wrong() -> None:
    data, name = encode_layer(commit_nodes(3), [])
    with pytest.raises(CorruptStore, match="too short"):
        parse_layer(data[:20], name, "L")
    with pytest.raises(CorruptStore, match="bad header"):
        parse_layer(b"XXXXXXXX" + data[8:], name, "L")
    with pytest.raises(ForeignLayer, match="later version"):
        parse_layer(MAGIC[:-1] + b"2" + data[8:], name, "L")
    with pytest.raises(CorruptStore, match="footer"):
        parse_layer(data[:-1] + b"X", name, "L")
    with pytest.raises(CorruptStore, match="checksum"):
        parse_layer(data[:-FOOTER.size - 1] + b"\x00" + data[-FOOTER.size :], name, "L")


@given(st.lists(st.integers(1, 64), min_size=1, max_size=300))
def test_merges_keep_a_logarithmic_number_of_layers(writes: list[int]) -> None:
    """Whatever the sizes of the layers written, there are about log2(commits) of them."""
    sizes: dict[str, int] = {}
    for i, new in enumerate(writes):
        merged = merge_set(new, sizes)
        sizes[f"layer{i}"] = new + sum(sizes.pop(name) for name in merged)
        assert len(sizes) <= math.log2(sum(sizes.values())) + 1 + 1e-9


# -- history through the graph -------------------------------------------------------------------
def test_saves_keep_the_graph_up_to_date_and_log_reads_it(repo: cas_ckpt.Repository) -> None:
    save_many(repo, 3 * GRAPH_EVERY + 5)
    g = graph(repo)
    assert len(g) == 3 * GRAPH_EVERY  # a layer every GRAPH_EVERY commits; the last 5 wait
    head = repo.resolve("main")
    assert list(repo.log("main")) == from_blocks(repo, head)
    assert list(repo.log("main", limit=7)) == from_blocks(repo, head)[:7]
    for depth in (0, 1, 5, 30, 3 * GRAPH_EVERY + 4):
        assert repo.resolve(f"main~{depth}") == from_blocks(repo, head)[depth].cid
    with pytest.raises(AncestorNotFound):
        repo.resolve(f"main~{3 * GRAPH_EVERY + 5}")
    commits = [c.cid for c in from_blocks(repo, head)]
    assert repo.history.commits(map(bytes, commits)) == {bytes(c): repo.commit(c) for c in commits}


def test_a_copy_that_does_not_match_its_cid_is_never_used(
    repo: cas_ckpt.Repository, caplog: pytest.LogCaptureFixture
) -> None:
    save_many(repo, GRAPH_EVERY)
    ((name, data),) = layer_files(repo).items()
    at = data.index(b"save 0003")
    rewrite(repo, name, data[:at] + b"save 9003" + data[at + 9 :])  # decodes, but is not the commit
    with cas_ckpt.open(repo.location) if repo.location != "memory://" else _same(repo) as again:
        with caplog.at_level(logging.WARNING, logger="cas_ckpt"):
            assert list(again.log("main")) == from_blocks(again, again.resolve("main"))
        assert [c.message for c in again.log("main")][-4] == "save 0003"
        assert "does not match its hash" in caplog.text
        assert list(graph(again).damaged) == [name]
        (problem,) = again.fsck().store_problems
        assert problem.startswith(f"damaged commit-graph layer {name}: corrupt")
        report = again.update_commit_graph()
        assert report.damaged and report.layers_dropped == 0 and report.layers_merged == 1
        # The same commits make the same layer: the repair replaced the damaged file by its name.
        assert not graph(again).damaged and layer_files(again) == {name: data}
        assert len(graph(again)) == GRAPH_EVERY and again.fsck().ok


def _same(repo: cas_ckpt.Repository) -> Any:
    """The memory repository itself, fresh from its stores (its graph's layers read anew)."""
    import contextlib

    return contextlib.nullcontext(cas_ckpt.Repository(repo.blocks, repo.refs_store, create=False,
                                                      location=repo.location))


@pytest.mark.parametrize("cut", [0, 8, 100, -49, -1])
def test_a_truncated_layer_is_ignored_then_rebuilt(repo: cas_ckpt.Repository, cut: int) -> None:
    save_many(repo, 2 * GRAPH_EVERY + 3)
    ((name, data),) = layer_files(repo).items()
    rewrite(repo, name, data[:cut])
    with cas_ckpt.open(repo.location) if repo.location != "memory://" else _same(repo) as again:
        head = again.resolve("main")
        assert list(again.log("main")) == from_blocks(again, head)
        assert name in graph(again).damaged and len(graph(again)) == 0
        assert not again.fsck().ok
        save_many(again, 1, start=100)  # a save rebuilds around the damage, a bounded walk at a time
        assert name not in layer_files(again) and not graph(again).damaged
        save_many(again, 5, start=101)
        assert len(graph(again)) + len(again.history._pending) == 2 * GRAPH_EVERY + 3 + 6
        assert list(again.log("main")) == from_blocks(again, again.resolve("main"))


def test_history_written_without_the_graph_is_taken_in_a_bounded_walk_per_save(
    local_repo: cas_ckpt.Repository,
) -> None:
    """A repository written by 0.2 (or by writers that never wrote a layer): each save reads at
    most WALK_LIMIT commits of the old history, and resumes where the last one stopped (upkeep,
    off here, would take the rest in at once: tests/test_upkeep.py)."""
    plain = cas_ckpt.open(local_repo.location)
    plain.history.graph = None  # a writer without a commit graph
    save_many(plain, 3 * WALK_LIMIT + 7)
    repo = cas_ckpt.open(local_repo.location, upkeep=False)
    covered = 0
    for i in range(5):
        save_many(repo, 1, start=1000 + i)
        now = len(graph(repo)) + len(repo.history._pending)
        assert now - covered <= WALK_LIMIT + 1
        assert repo.history.behind() == (i < 3)  # 3 walks of 32 leave 7 of the 103 for the 4th
        covered = now
    assert covered == 3 * WALK_LIMIT + 7 + 5
    assert graph(repo).frontier() <= set(repo.history._pending)  # nothing left behind
    assert list(repo.log("main")) == from_blocks(repo, repo.resolve("main"))
    repo.close()
    plain.close()


def test_update_takes_in_every_ref_and_pin_and_consolidates(repo: cas_ckpt.Repository) -> None:
    save_many(repo, 5, ref="a")
    save_many(repo, 40, ref="b")
    save_many(repo, 3, ref="c")
    repo.pin(repo.resolve("c"))
    repo.delete_ref("c")
    report = repo.update_commit_graph()
    assert report.commits == 48 and len(graph(repo)) == 48
    report = repo.update_commit_graph(consolidate=True)
    assert report.layers == 1 and report.commits == 48 and len(layer_files(repo)) == 1
    assert repo.update_commit_graph(consolidate=True).bytes_written == 0  # nothing to rewrite


def test_the_graph_keeps_nothing_alive_and_gc_frees_what_it_holds(repo: cas_ckpt.Repository) -> None:
    save_many(repo, GRAPH_EVERY + 2, ref="doomed")
    save_many(repo, 3, ref="kept")
    doomed = repo.resolve("doomed")
    oldest = from_blocks(repo, doomed)[-1].cid
    assert graph(repo).covers(bytes(oldest))
    repo.delete_ref("doomed")
    repo.gc(reflog_expiry=0)
    assert not repo.blocks.has(oldest) and graph(repo).covers(bytes(oldest))  # a copy, not a root
    with pytest.raises(BlockNotFound):
        repo.commit(oldest)  # read as the blocks say: gone
    for head in (doomed, oldest):  # a log never starts at a commit the blocks lack
        with pytest.raises(BlockNotFound):
            repo.log(head)
    assert list(repo.log("kept")) == from_blocks(repo, repo.resolve("kept"))
    repo.update_commit_graph(consolidate=True)
    assert not graph(repo).covers(bytes(oldest))  # consolidation leaves collected commits out


def test_gc_marks_the_same_through_the_graph_as_from_blocks(local_repo: cas_ckpt.Repository) -> None:
    save_many(local_repo, 40, ref="run")
    save_many(local_repo, 20, ref="gone")
    local_repo.set_ref("old", "run~25")
    local_repo.delete_ref("gone")
    local_repo.save({"x": "scratch"}, ref="scratch")
    local_repo.delete_ref("scratch")
    plain = cas_ckpt.open(local_repo.location)
    plain.history.graph = None
    for expiry in (0.0, 3600.0):
        with_graph = local_repo.gc(dry_run=True, reflog_expiry=expiry)
        assert with_graph == plain.gc(dry_run=True, reflog_expiry=expiry)
        if expiry:  # the deleted refs' reflogs keep what they held
            assert not with_graph.unreachable
        else:
            assert with_graph.unreachable and with_graph.lineage_blocks > 0


def test_a_read_only_repository_reads_the_graph_and_writes_none(local_repo: cas_ckpt.Repository) -> None:
    save_many(local_repo, GRAPH_EVERY + 1)
    before = layer_files(local_repo)
    with cas_ckpt.open(local_repo.location, read_only=True) as reader:
        assert list(reader.log()) == from_blocks(reader, reader.resolve("main"))
        assert len(graph(reader)) == GRAPH_EVERY
        with pytest.raises(cas_ckpt.errors.RepositoryError, match="read-only"):
            reader.update_commit_graph()
    assert layer_files(local_repo) == before


def test_a_repository_written_by_0_2_gets_a_graph(tmp_path: Path) -> None:
    root = tmp_path / "v1"
    shutil.copytree(FIXTURE, root)
    with cas_ckpt.open(root, create=False, read_only=True) as reader:
        before = {ref: list(reader.log(ref)) for ref in reader.refs()}
    assert not (root / "commit-graph").exists()  # reading creates nothing
    with cas_ckpt.open(root, create=False) as repo:
        report = repo.update_commit_graph()
        assert report.commits_added == report.commits > 0
        assert {ref: list(repo.log(ref)) for ref in repo.refs()} == before
        assert repo.fsck().ok


def test_the_manager_lists_steps_from_names_and_ranks_from_the_graph(repo: cas_ckpt.Repository) -> None:
    with cas_ckpt.CheckpointManager(repo, "run", keep_last=2, keep_best=2, best_metric="loss") as mgr:
        for step in range(30):
            mgr.save(step, {"w": step}, metrics={"loss": (step * 7) % 11})
        assert mgr.steps() == [11, 22, 28, 29]  # loss 0 at 0, 11 and 22: the newer two stay
        assert mgr.metrics(22) == {"loss": 0}
    assert len(graph(repo)) >= GRAPH_EVERY


# -- requests on S3 ------------------------------------------------------------------------------
def _requests(repo: cas_ckpt.Repository) -> collections.Counter[str]:
    """Every S3 request the repository makes from now on, by operation (its one client)."""
    counts: collections.Counter[str] = collections.Counter()
    client = repo.blocks.bucket.client  # type: ignore[attr-defined]
    client.meta.events.register("before-call.s3", lambda model, **_: counts.update([model.name]))
    return counts


def _run_history(repo: cas_ckpt.Repository, n: int) -> None:
    """A run of ``n`` commits (all but 5 written at once, as saves write them), step refs for the
    last 3: the shape of a CheckpointManager's run."""
    with repo.transaction() as txn:
        tree = txn.tree.write({"w": 0})
        parent: list[bytes] = []
        for step in range(n - 5):
            parent = [txn.put_commit(tree, parent, step=step, metadata={"metrics": {"loss": step}},
                                     message=None)]
        txn.move_ref("run", None, parent[0], "bulk")
    save_many(repo, 5, ref="run", start=n - 5)
    for back in range(3):
        repo.set_ref(f"run.steps/{n - 1 - back:012d}", f"run~{back}")


def test_history_requests_do_not_grow_with_history_on_s3(s3_url: str) -> None:
    """log, REF~N, steps() and GC's marking make as many requests for 200 commits as for 40;
    without the graph, one request per commit."""
    seen: dict[tuple[int, bool], dict[str, int]] = {}
    for n in (40, 200):
        url = f"{s3_url}-{n}"
        with cas_ckpt.open(url) as repo:
            _run_history(repo, n)
        for with_graph in (True, False):
            with cas_ckpt.open(url) as repo:
                if not with_graph:
                    repo.history.graph = None
                manager = cas_ckpt.CheckpointManager(repo, "run", keep_last=3, keep_best=1,
                                                     best_metric="loss")
                counts = _requests(repo)
                step = n + (not with_graph)
                ops = {
                    "log": lambda repo=repo, n=n: len(list(repo.log("run"))) >= n,
                    "ancestor": lambda repo=repo, n=n: repo.resolve(f"run~{n - 1}") is not None,
                    "steps": lambda manager=manager: len(manager.steps()) == 3,
                    "gc": lambda repo=repo: repo.gc(expire_reflogs=("run", "run.steps/")).lineage_blocks > 0,
                    # A save whose retention ranks the steps by their metrics and expires one
                    "retention": lambda m=manager, s=step: m.save(s, {"w": s}, metrics={"loss": 0}),
                }
                seen[n, with_graph] = {}
                for op, run in ops.items():
                    counts.clear()
                    assert run(), op
                    seen[n, with_graph][op] = sum(counts.values())
                manager.close()
    assert seen[40, True] == seen[200, True], seen
    for op in ("log", "ancestor", "gc", "retention"):  # the count stands for something: without
        assert seen[200, False][op] - seen[40, False][op] >= 160, (op, seen)  # the graph it grows


@pytest.mark.parametrize("planted", ["file", "link"])
def test_no_room_for_the_graph_leaves_history_to_the_blocks(
    tmp_path: Path, planted: str, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "repo"
    with cas_ckpt.open(root) as repo:
        save_many(repo, GRAPH_EVERY + 1)
    shutil.rmtree(root / "commit-graph")
    if planted == "file":
        (root / "commit-graph").write_bytes(b"not a directory")
    else:
        (tmp_path / "elsewhere").mkdir()
        (root / "commit-graph").symlink_to(tmp_path / "elsewhere")
    with caplog.at_level(logging.WARNING, logger="cas_ckpt"), cas_ckpt.open(root) as repo:
        save_many(repo, GRAPH_EVERY, start=100)
        assert list(repo.log()) == from_blocks(repo, repo.resolve("main"))
        assert "commit graph" in caplog.text  # a warning says why it is not used
        if planted == "link":  # never followed: no graph at all
            assert repo.history.graph is None and repo.update_commit_graph().commits == 0
            assert list((tmp_path / "elsewhere").iterdir()) == []
        else:
            with pytest.raises(cas_ckpt.CasCkptError, match="commit-graph"):
                repo.update_commit_graph()
