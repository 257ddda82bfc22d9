"""Ref stores: the small mutable state of a repository (refs, reflogs, pins, config, the save lock).

:class:`RefStore` is the interface; :class:`MemoryRefStore` and :class:`LocalRefStore` implement it
here, :class:`cas_ckpt.refs.s3.S3RefStore` on S3 (imported on demand: it needs boto3).
"""

from cas_ckpt.refs.base import (
    ListedName,
    ReflogEntry,
    RefStore,
    check_clash,
    check_ref_name,
    is_ref_name,
    listed_name,
    shown_name,
)
from cas_ckpt.refs.local import LocalRefStore
from cas_ckpt.refs.memory import MemoryRefStore

__all__ = [
    "ListedName",
    "LocalRefStore",
    "MemoryRefStore",
    "RefStore",
    "ReflogEntry",
    "check_clash",
    "check_ref_name",
    "is_ref_name",
    "listed_name",
    "shown_name",
]
