"""Block stores: immutable blocks named by their CIDs.

:class:`BlockStore` is the interface the repository uses. :class:`PackedBlockStore` implements it
once, over any :class:`~cas_ckpt.backends.Backend`; :class:`LocalStore`, :class:`MemoryStore` and
:class:`S3Store` are that store on each medium.
"""

from cas_ckpt.blocks.base import BlockStore, BlockWriter, WriteStats
from cas_ckpt.blocks.packed import LocalStore, MemoryStore, PackedBlockStore, PackWriter, S3Store

__all__ = [
    "BlockStore",
    "BlockWriter",
    "LocalStore",
    "MemoryStore",
    "PackWriter",
    "PackedBlockStore",
    "S3Store",
    "WriteStats",
]
