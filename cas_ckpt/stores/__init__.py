"""Deprecated: block stores moved to :mod:`cas_ckpt.blocks` (this alias goes in the next release)."""

from __future__ import annotations

import warnings
from typing import Any

_NAMES = ("BlockStore", "BlockWriter", "LocalStore", "MemoryStore", "WriteStats")


def __getattr__(name: str) -> Any:
    if name not in _NAMES:
        raise AttributeError(f"module 'cas_ckpt.stores' has no attribute {name!r}")
    warnings.warn(
        f"cas_ckpt.stores.{name} moved to cas_ckpt.blocks.{name}; the old name goes in the next release",
        DeprecationWarning,
        stacklevel=2,
    )
    import cas_ckpt.blocks

    return getattr(cas_ckpt.blocks, name)
