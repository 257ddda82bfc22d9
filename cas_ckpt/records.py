"""Gradient checkpoint records: a computation graph whose values are named by CID.

Every tensor a record mentions (a node's inputs, output and gradient, the loss) is stored first as a
block set of its own with :func:`put_array`, which returns the CID ``repo.load(cid)`` reads back.
The record holds those CIDs as CID values (strong links), so GC keeps every tensor a saved record
names, and edges need no ids: a node consumes what another produced when the CIDs match.

>>> import cas_ckpt, numpy as np
>>> repo = cas_ckpt.open("memory://")
>>> x = put_array(repo, np.ones(3))
>>> y = put_array(repo, np.full(3, 2.0))
>>> loss = put_array(repo, np.float64(6.0))
>>> graph = ComputationGraph([GraphNode("scale", "mul", inputs=(x,), output=y),
...                           GraphNode("sum", "sum", inputs=(y,), output=loss)])
>>> graph.edges()
[('scale', 'sum')]
>>> cid = GradientCheckpoint(graph, step=1, loss_cid=loss, optimizer_state={}).save(repo)
>>> record = GradientCheckpoint.load(repo)
>>> [n.id for n in record.graph.provenance(record.loss_cid)]
['scale', 'sum']
>>> float(repo.load(record.loss_cid))
6.0

A tensor stored with :func:`put_array` is unreachable until a saved record links it: a GC running
in between removes it (saving the record then fails with a :class:`StateTypeError` naming it). When
GC may run concurrently, give it a grace period (``repo.gc(grace=...)``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from multiformats import CID

from cas_ckpt import cid as cidlib
from cas_ckpt.errors import DecodeError, GraphCycleError, InvalidCID
from cas_ckpt.repository import Repository, Target

__all__ = ["ComputationGraph", "GradientCheckpoint", "GraphNode", "put_array"]

RECORD_TYPE = "cas_ckpt.gradient_checkpoint"
RECORD_VERSION = 1


def put_array(repo: Repository, value: Any) -> CID:
    """Store an array or tensor (any state value works) on its own; return the CID that loads it."""
    with repo.transaction() as txn:
        root = txn.tree.write(value)
    return cidlib.to_cid(root)


def _cid(value: Any, what: str) -> CID:
    try:
        return cidlib.to_cid(value)
    except InvalidCID as exc:
        raise InvalidCID(f"{what}: {exc}") from None


def _opt_cid(value: Any, what: str) -> CID | None:
    return None if value is None else _cid(value, what)


@dataclass(frozen=True)
class GraphNode:
    """One operation: what it read (``inputs``), produced (``output``) and its ``gradient``."""

    id: str
    op: str
    inputs: tuple[CID, ...] = ()
    output: CID | None = None
    gradient: CID | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not isinstance(self.op, str):
            raise TypeError("GraphNode id and op must be str")
        set_ = object.__setattr__
        set_(self, "inputs", tuple(_cid(c, f"node {self.id} input") for c in self.inputs))
        set_(self, "output", _opt_cid(self.output, f"node {self.id} output"))
        set_(self, "gradient", _opt_cid(self.gradient, f"node {self.id} gradient"))
        set_(self, "metadata", dict(self.metadata))

    def to_state(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "op": self.op,
            "inputs": list(self.inputs),
            "output": self.output,
            "gradient": self.gradient,
            "metadata": dict(self.metadata),
        }

    @classmethod
    def from_state(cls, state: Any) -> GraphNode:
        if not isinstance(state, dict) or not isinstance(state.get("inputs"), list):
            raise DecodeError("malformed graph node")
        try:
            return cls(state["id"], state["op"], tuple(state["inputs"]), state.get("output"),
                       state.get("gradient"), state.get("metadata") or {})
        except (KeyError, TypeError, ValueError) as exc:
            raise DecodeError(f"malformed graph node: {exc}") from None


class ComputationGraph:
    """Nodes by id; edges run from the node that produced a CID to every node that read it."""

    def __init__(self, nodes: Iterable[GraphNode] = ()) -> None:
        self.nodes: dict[str, GraphNode] = {}
        for node in nodes:
            self.add_node(node)

    def add_node(self, node: GraphNode) -> GraphNode:
        """Add ``node``; ValueError if its id is taken."""
        if node.id in self.nodes:
            raise ValueError(f"graph already has a node {node.id!r}")
        self.nodes[node.id] = node
        return node

    def __len__(self) -> int:
        return len(self.nodes)

    def __iter__(self) -> Iterator[GraphNode]:
        return iter(self.nodes.values())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ComputationGraph) and list(self) == list(other)

    def producers(self, cid: Any) -> list[GraphNode]:
        """The nodes whose output is ``cid`` (equal content is the same value)."""
        key = _cid(cid, "cid")
        return [n for n in self.nodes.values() if n.output == key]

    def edges(self) -> list[tuple[str, str]]:
        """(producer id, consumer id) pairs, each once, in node order; no self-loops."""
        made: dict[CID, list[str]] = {}
        for node in self.nodes.values():
            if node.output is not None:
                made.setdefault(node.output, []).append(node.id)
        found: dict[tuple[str, str], None] = {}
        for node in self.nodes.values():
            for cid in node.inputs:
                for source in made.get(cid, []):
                    if source != node.id:
                        found[(source, node.id)] = None
        return list(found)

    def topological_order(self, among: Iterable[str] | None = None) -> list[GraphNode]:
        """Nodes with every producer before its consumers (ties in insertion order).

        ``among``: order only these node ids. Raises :class:`GraphCycleError` on a cycle.
        """
        wanted = set(self.nodes if among is None else among)
        parents: dict[str, set[str]] = {n: set() for n in self.nodes if n in wanted}
        children: dict[str, list[str]] = {n: [] for n in parents}
        for source, target in self.edges():
            if source in parents and target in parents:
                parents[target].add(source)
                children[source].append(target)
        ready = [n for n in parents if not parents[n]]
        order: list[str] = []
        while ready:
            current = ready.pop(0)
            order.append(current)
            for child in children[current]:
                parents[child].discard(current)
                if not parents[child]:
                    ready.append(child)
        if len(order) != len(parents):
            raise GraphCycleError(sorted(n for n in parents if n not in order))
        return [self.nodes[n] for n in order]

    def provenance(self, cid: Any) -> list[GraphNode]:
        """Every node that contributed to ``cid``, walking back to the sources; sources first."""
        seen: set[str] = set()
        stack = [n.id for n in self.producers(cid)]
        while stack:
            current = stack.pop()
            if current in seen:
                continue
            seen.add(current)
            for source in self.nodes[current].inputs:
                stack.extend(n.id for n in self.producers(source))
        return self.topological_order(seen)

    def to_state(self) -> dict[str, Any]:
        return {"nodes": [n.to_state() for n in self.nodes.values()]}

    @classmethod
    def from_state(cls, state: Any) -> ComputationGraph:
        if not isinstance(state, dict) or not isinstance(state.get("nodes"), list):
            raise DecodeError("malformed computation graph")
        try:
            return cls(GraphNode.from_state(n) for n in state["nodes"])
        except ValueError as exc:
            raise DecodeError(f"malformed computation graph: {exc}") from None


@dataclass
class GradientCheckpoint:
    """A training step's record: its graph, loss (by CID) and per-parameter optimizer blobs."""

    graph: ComputationGraph
    step: int
    loss_cid: CID
    optimizer_state: dict[str, bytes]
    timestamp: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        if type(self.step) is not int:
            raise TypeError(f"step must be an int, not {type(self.step).__name__}")
        self.loss_cid = _cid(self.loss_cid, "loss_cid")
        if not all(isinstance(k, str) and isinstance(v, bytes)
                   for k, v in self.optimizer_state.items()):
            raise TypeError("optimizer_state maps parameter names (str) to bytes")
        self.timestamp = float(self.timestamp)

    def cids(self) -> set[CID]:
        """Every CID the record names (the blocks GC keeps for it)."""
        found = {self.loss_cid}
        for node in self.graph:
            found.update(node.inputs)
            found.update(c for c in (node.output, node.gradient) if c is not None)
        return found

    def to_state(self) -> dict[str, Any]:
        return {
            "type": RECORD_TYPE,
            "version": RECORD_VERSION,
            "step": self.step,
            "loss": self.loss_cid,
            "timestamp": self.timestamp,
            "optimizer_state": dict(self.optimizer_state),
            "graph": self.graph.to_state(),
        }

    @classmethod
    def from_state(cls, state: Any) -> GradientCheckpoint:
        if not isinstance(state, dict) or state.get("type") != RECORD_TYPE:
            raise DecodeError("not a gradient checkpoint record")
        version = state.get("version")
        if type(version) is not int or version > RECORD_VERSION:
            raise DecodeError(f"gradient checkpoint version {version!r} is newer than this cas_ckpt")
        try:
            return cls(ComputationGraph.from_state(state.get("graph")), state["step"],
                       state["loss"], state["optimizer_state"], state["timestamp"])
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise DecodeError(f"malformed gradient checkpoint: {exc}") from None

    def save(self, repo: Repository, *, ref: str = "gradients", message: str | None = None) -> CID:
        """Save the record as a checkpoint of ``ref``; every CID it names must be stored."""
        return repo.save(self.to_state(), ref=ref, step=self.step,
                         metadata={"record": RECORD_TYPE}, message=message)

    @classmethod
    def load(cls, repo: Repository, target: Target = "gradients") -> GradientCheckpoint:
        """The record saved at ``target`` (a ref or a commit CID)."""
        return cls.from_state(repo.load(target))
