"""Block stores: where immutable blocks live. Each knows CIDs and bytes, nothing more."""

from cas_ckpt.blocks.base import BlockStore, BlockWriter, WriteStats
from cas_ckpt.blocks.local import LocalStore
from cas_ckpt.blocks.memory import MemoryStore

__all__ = ["BlockStore", "BlockWriter", "LocalStore", "MemoryStore", "WriteStats"]
