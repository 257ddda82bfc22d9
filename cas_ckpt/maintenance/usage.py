"""Space accounting: logical bytes (as if nothing were shared) against bytes really stored."""

from __future__ import annotations

from dataclasses import dataclass, field

from multiformats import CID

from cas_ckpt import cid as cidlib
from cas_ckpt import codec
from cas_ckpt.blocks.base import BlockStore
from cas_ckpt.codec import HistoryLink
from cas_ckpt.maintenance.upkeep import UpkeepStatus
from cas_ckpt.maintenance.walk import child_links, walk
from cas_ckpt.refs import RefStore


@dataclass
class RefUsage:
    """One ref's checkpoint: its size if stored alone, and what it really occupies."""

    ref: str
    cid: CID
    logical_bytes: int
    stored_bytes: int
    blocks: int

    __repr__ = cidlib.readable_repr


@dataclass
class Usage:
    """The whole repository; blocks shared between refs count once in ``stored_bytes``, and each
    distinct checkpoint once in ``logical_bytes``."""

    refs: list[RefUsage] = field(default_factory=list)
    logical_bytes: int = 0
    stored_bytes: int = 0
    total_blocks: int = 0
    total_bytes: int = 0
    upkeep: UpkeepStatus | None = None  # packs, index files, and what upkeep would do next

    @property
    def unreachable_bytes(self) -> int:
        return self.total_bytes - self.stored_bytes

    @property
    def dedup_ratio(self) -> float:
        return self.logical_bytes / self.stored_bytes if self.stored_bytes else 1.0


def logical_size(store: BlockStore, root: bytes, memo: dict[bytes, int] | None = None) -> int:
    """Bytes of every block below ``root``, counted once per reference (no dedup)."""
    memo = {} if memo is None else memo
    if root in memo:
        return memo[root]
    total = store.size(root)
    if cidlib.is_node(root):
        node = codec.decode(store.get(root), cid=root)
        for link, _ in child_links(node):
            if not isinstance(link, HistoryLink):
                total += logical_size(store, link.cid, memo)
    memo[root] = total
    return total


def usage(blocks: BlockStore, refs: RefStore) -> Usage:
    """Logical and stored bytes per ref and for the whole repository."""
    blocks.refresh()
    result = Usage()
    memo: dict[bytes, int] = {}
    everything: set[bytes] = set()
    for name in refs.names():
        root = refs.get(name)
        if root is None:
            continue
        reach = walk(blocks, {root: name})
        stored = sum(blocks.stored_size(c) for c in reach.data if blocks.has(c))
        result.refs.append(
            RefUsage(name, cidlib.to_cid(root), logical_size(blocks, root, memo), stored,
                     len(reach.data))
        )
        everything |= reach.data
    # A checkpoint two refs hold (a manager's head and its .steps/N ref) is one checkpoint.
    result.logical_bytes = sum({bytes(r.cid): r.logical_bytes for r in result.refs}.values())
    result.stored_bytes = sum(blocks.stored_size(c) for c in everything if blocks.has(c))
    keys = list(blocks.keys())
    result.total_blocks = len(keys)
    result.total_bytes = sum(blocks.stored_size(c) for c in keys)
    return result
