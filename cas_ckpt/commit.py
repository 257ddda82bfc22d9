"""The commit record: one checkpoint's tree, parents, step, time, metadata and message.

A commit is a node (see ``docs/format.md``, "Commit nodes")::

    {"type": "cas_ckpt.commit", "version": 1, "tree": <link>, "parents": [<history link>...],
     "step": int | None, "time": float, "metadata": {...}, "message": str | None}

Parents are history links (ext 43): GC follows them for lineage but frees the data of commits that
no ref, pin or live reflog entry holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from multiformats import CID

from cas_ckpt import cid as cidlib
from cas_ckpt import codec
from cas_ckpt.codec import HistoryLink, Link
from cas_ckpt.errors import DecodeError, RepositoryError

COMMIT_TYPE = "cas_ckpt.commit"
COMMIT_VERSION = 1


@dataclass(frozen=True)
class Commit:
    """One checkpoint as recorded in its commit node."""

    cid: CID
    tree: CID
    parents: tuple[CID, ...]
    step: int | None
    time: float
    metadata: dict[str, Any]
    message: str | None

    __repr__ = cidlib.readable_repr


def is_commit(node: Any) -> bool:
    """True if a decoded node is a commit record."""
    return isinstance(node, dict) and node.get("type") == COMMIT_TYPE


def encode_commit(
    tree: bytes, parents: list[bytes], *, step: int | None, time: float,
    metadata: dict[str, Any], message: str | None,
) -> bytes:
    """The commit node's bytes (its CID is the hash of these)."""
    return codec.encode(
        {
            "type": COMMIT_TYPE,
            "version": COMMIT_VERSION,
            "tree": Link(tree),
            "parents": [HistoryLink(parent) for parent in parents],
            "step": step,
            "time": time,
            "metadata": metadata,
            "message": message,
        }
    )


def parse_commit(cid: bytes, node: dict[str, Any]) -> Commit:
    """Check a decoded commit node field by field; :class:`DecodeError` naming ``cid`` if malformed."""
    name = cidlib.to_str(cid)
    version = node.get("version")
    if type(version) is not int or version > COMMIT_VERSION:
        raise RepositoryError(
            f"commit {name} has format version {version!r}; this cas_ckpt reads up to "
            f"{COMMIT_VERSION}: upgrade cas_ckpt"
        )
    tree, parents = node.get("tree"), node.get("parents", [])
    if not isinstance(tree, Link) or isinstance(tree, HistoryLink):
        raise DecodeError("commit has no tree link", cid=name)
    if not isinstance(parents, list) or not all(isinstance(p, Link) for p in parents):
        raise DecodeError("commit parents are malformed", cid=name)
    step, stamp = node.get("step"), node.get("time")
    metadata, message = node.get("metadata") or {}, node.get("message")
    if step is not None and type(step) is not int:
        raise DecodeError("commit step is not an int", cid=name)
    if not isinstance(stamp, (int, float)) or not isinstance(metadata, dict):
        raise DecodeError("commit time or metadata is malformed", cid=name)
    if message is not None and not isinstance(message, str):
        raise DecodeError("commit message is not a string", cid=name)
    return Commit(
        cid=cidlib.to_cid(cid),
        tree=cidlib.to_cid(tree.cid),
        parents=tuple(cidlib.to_cid(p.cid) for p in parents),
        step=step,
        time=float(stamp),
        metadata=metadata,
        message=message,
    )
