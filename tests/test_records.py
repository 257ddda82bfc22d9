"""CID values in states (ext 7), put_array, and gradient checkpoint records with their graph."""

from __future__ import annotations

import doctest

import numpy as np
import pytest
from multiformats import CID

import cas_ckpt
from cas_ckpt import ComputationGraph, GradientCheckpoint, GraphNode, codec, records
from cas_ckpt import cid as cidlib
from cas_ckpt.codec import Link, Tagged
from cas_ckpt.integrations import training
from cas_ckpt.records import put_array
from cas_ckpt.tree import CID_VALUE


def test_module_doctests() -> None:
    for module in (records, training):
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert result.attempted > 0 and result.failed == 0, module.__name__


# -- put_array and CID values ------------------------------------------------------------------
@pytest.mark.parametrize("size", [3, 100_000])
def test_put_array_returns_a_cid_that_loads(repo: cas_ckpt.Repository, size: int) -> None:
    array = np.arange(size, dtype=np.float32)
    cid = put_array(repo, array)
    assert isinstance(cid, CID) and cidlib.is_node(bytes(cid))
    assert np.array_equal(repo.load(cid), array)
    assert put_array(repo, array) == cid  # content addressed: same bytes, same CID


def test_put_array_of_a_tensor_loads_a_tensor(repo: cas_ckpt.Repository) -> None:
    torch = pytest.importorskip("torch")
    tensor = torch.linspace(0, 1, 50, dtype=torch.bfloat16)
    loaded = repo.load(put_array(repo, tensor))
    assert type(loaded) is torch.Tensor and torch.equal(loaded, tensor)


def test_cid_values_round_trip_as_links_that_gc_follows(repo: cas_ckpt.Repository) -> None:
    target = put_array(repo, np.arange(50_000, dtype=np.int64))  # a node plus chunk blocks
    lost = put_array(repo, np.arange(3))
    repo.save({"tensor": target, "list": [target], "n": 1}, ref="holder")
    loaded = repo.load("holder")
    assert loaded["tensor"] == target and isinstance(loaded["tensor"], CID)
    assert loaded["list"] == [target]
    tree = repo.commit("holder").tree
    node = codec.decode(repo.blocks.get(tree))
    assert node["tensor"] == Tagged(CID_VALUE, Link(bytes(target)))  # ext 7 around a strong link
    report = repo.gc()
    assert report.blocks_freed == 1  # only the unreferenced ``lost`` node
    assert np.array_equal(repo.load(target), np.arange(50_000))
    with pytest.raises(cas_ckpt.errors.BlockNotFound):
        repo.load(lost)
    assert repo.fsck().ok
    repo.delete_ref("holder")
    repo.gc(reflog_expiry=0)  # nor does the deleted ref's reflog
    with pytest.raises(cas_ckpt.errors.BlockNotFound):
        repo.load(target)


def test_cid_values_must_name_stored_blocks(repo: cas_ckpt.Repository) -> None:
    other = cas_ckpt.open("memory://")
    missing = put_array(other, np.arange(3))
    with pytest.raises(cas_ckpt.errors.StateTypeError, match="not in the store") as info:
        repo.save({"a": {"b": missing}}, ref="bad")
    assert info.value.path == "a.b" and "bad" not in repo.refs()
    dag_pb = CID.decode("bafybeigdyrzt5sfp7udm7hu76uh7y26nf3efuylqabf3oclgtqy55fbzdi")
    with pytest.raises(cas_ckpt.errors.StateTypeError, match="cannot store this CID"):
        repo.save({"c": dag_pb}, ref="bad")


def test_a_raw_chunk_cid_is_a_valid_value(repo: cas_ckpt.Repository) -> None:
    big = put_array(repo, np.arange(300_000, dtype=np.uint8))
    chunk = next(c for c in repo.blocks.keys() if not cidlib.is_node(c))  # noqa: SIM118
    repo.save({"chunk": cidlib.to_cid(chunk), "big": big}, ref="r")
    assert repo.load("r")["chunk"] == cidlib.to_cid(chunk)
    diff = repo.diff("r", "r")
    assert diff.identical


# -- the graph ---------------------------------------------------------------------------------
def make_graph(repo: cas_ckpt.Repository) -> tuple[ComputationGraph, dict[str, CID]]:
    """x, w -> matmul -> h -> relu -> a ; a, y -> mse -> loss (gradients stored too)."""
    names = ["x", "w", "h", "a", "y", "loss"]
    c = {name: put_array(repo, np.full(4, float(i))) for i, name in enumerate(names)}
    grads = {name: put_array(repo, np.full(4, -float(i))) for i, name in enumerate(["h", "a"])}
    graph = ComputationGraph()
    graph.add_node(GraphNode("mse", "mse_loss", inputs=(c["a"], c["y"]), output=c["loss"]))
    graph.add_node(GraphNode("matmul", "matmul", inputs=(c["x"], c["w"]), output=c["h"],
                             gradient=grads["h"], metadata={"shape": [4]}))
    graph.add_node(GraphNode("relu", "relu", inputs=(str(c["h"]),), output=c["a"],
                             gradient=grads["a"]))
    return graph, c


def test_edges_topological_order_and_provenance(repo: cas_ckpt.Repository) -> None:
    graph, c = make_graph(repo)
    assert sorted(graph.edges()) == [("matmul", "relu"), ("relu", "mse")]
    assert [n.id for n in graph.topological_order()] == ["matmul", "relu", "mse"]
    assert [n.id for n in graph.provenance(c["loss"])] == ["matmul", "relu", "mse"]
    assert [n.id for n in graph.provenance(c["a"])] == ["matmul", "relu"]
    assert graph.provenance(c["x"]) == []  # a source: nothing produced it
    assert graph.nodes["relu"].inputs == (c["h"],)  # strings are parsed into CIDs
    with pytest.raises(ValueError, match="already has"):
        graph.add_node(GraphNode("relu", "relu"))


def test_cycles_raise(repo: cas_ckpt.Repository) -> None:
    a, b = put_array(repo, np.zeros(1)), put_array(repo, np.ones(1))
    graph = ComputationGraph([GraphNode("f", "f", inputs=(a,), output=b),
                              GraphNode("g", "g", inputs=(b,), output=a),
                              GraphNode("src", "const", output=put_array(repo, np.zeros(2)))])
    with pytest.raises(cas_ckpt.errors.GraphCycleError) as info:
        graph.topological_order()
    assert info.value.nodes == ["f", "g"]
    with pytest.raises(cas_ckpt.errors.GraphCycleError):
        graph.provenance(a)


def test_bad_cids_are_refused(repo: cas_ckpt.Repository) -> None:
    with pytest.raises(cas_ckpt.errors.InvalidCID, match="node n input"):
        GraphNode("n", "op", inputs=("not a cid",))
    with pytest.raises(TypeError):
        GradientCheckpoint(ComputationGraph(), 1, put_array(repo, np.zeros(1)), {"w": "text"})


# -- the record --------------------------------------------------------------------------------
def test_gradient_checkpoint_round_trip_and_gc(repo: cas_ckpt.Repository) -> None:
    graph, c = make_graph(repo)
    record = GradientCheckpoint(graph, step=7, loss_cid=c["loss"],
                                optimizer_state={"w": b"\x00\x01moments", "b": b""},
                                timestamp=1700000000.5)
    commit = record.save(repo, ref="grads", message="step 7")
    loaded = GradientCheckpoint.load(repo, "grads")
    assert loaded == record
    assert loaded.graph.edges() == graph.edges()
    assert repo.commit(commit).step == 7
    assert float(repo.load(loaded.loss_cid)[0]) == 5.0
    assert len(record.cids()) == 8  # six values and two gradients
    repo.gc()
    for cid in record.cids():  # the record keeps every tensor it names
        assert repo.load(cid).shape == (4,)
    repo.delete_ref("grads")
    repo.gc(reflog_expiry=0)  # nor does the deleted ref's reflog
    assert not any(repo.blocks.has(bytes(cid)) for cid in record.cids())


def test_malformed_records_raise_decode_error(repo: cas_ckpt.Repository) -> None:
    repo.save({"type": "something else"}, ref="other")
    with pytest.raises(cas_ckpt.errors.DecodeError):
        GradientCheckpoint.load(repo, "other")
    graph, c = make_graph(repo)
    state = GradientCheckpoint(graph, 1, c["loss"], {}).to_state()
    state["graph"]["nodes"][0]["inputs"] = [5]
    repo.save(state, ref="broken")
    with pytest.raises(cas_ckpt.errors.DecodeError, match="graph node"):
        GradientCheckpoint.load(repo, "broken")
    state = GradientCheckpoint(graph, 1, c["loss"], {}).to_state()
    state["version"] = 99
    repo.save(state, ref="future")
    with pytest.raises(cas_ckpt.errors.DecodeError, match="newer"):
        GradientCheckpoint.load(repo, "future")
