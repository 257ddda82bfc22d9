"""Block stores: where immutable blocks live. Each knows keys and bytes, nothing more."""

from cas_ckpt.stores.base import BlockStore, BlockWriter, WriteStats
from cas_ckpt.stores.local import LocalStore
from cas_ckpt.stores.memory import MemoryStore

__all__ = ["BlockStore", "BlockWriter", "LocalStore", "MemoryStore", "WriteStats"]
