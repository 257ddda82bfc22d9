"""cas_ckpt: content-addressed, crash-safe, deduplicating checkpoints for training state.

>>> import cas_ckpt, numpy as np
>>> repo = cas_ckpt.open("memory://")
>>> cid = repo.save({"step": 1, "w": np.arange(4.0)}, ref="main", step=1)
>>> repo.load("main")["w"].tolist()
[0.0, 1.0, 2.0, 3.0]

The top level holds what a training loop and a maintainer use. Errors live in
:mod:`cas_ckpt.errors` (all derive from :class:`CasCkptError`); block stores in
:mod:`cas_ckpt.blocks`, the media under them in :mod:`cas_ckpt.backends`, ref stores in
:mod:`cas_ckpt.refs`, for those who assemble their own repository.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

from multiformats import CID

from cas_ckpt import errors
from cas_ckpt.car import CarReport
from cas_ckpt.commit import Commit
from cas_ckpt.errors import CasCkptError
from cas_ckpt.http import serve
from cas_ckpt.integrations import torch as _torch_adapter  # noqa: F401 - registers the tensor hook
from cas_ckpt.maintenance.diff import DiffReport
from cas_ckpt.maintenance.fsck import FsckReport
from cas_ckpt.maintenance.gc import GCReport
from cas_ckpt.maintenance.usage import Usage
from cas_ckpt.manager import CheckpointManager
from cas_ckpt.records import ComputationGraph, GradientCheckpoint, GraphNode
from cas_ckpt.refs import ReflogEntry
from cas_ckpt.replication import TransferReport
from cas_ckpt.repository import Repository, SaveReport, Transaction, clone, open

__version__ = "0.3.0.dev0"

__all__ = [
    "CID",
    "CarReport",
    "CasCkptError",
    "CheckpointManager",
    "Commit",
    "ComputationGraph",
    "DiffReport",
    "FsckReport",
    "GCReport",
    "GradientCheckpoint",
    "GraphNode",
    "ReflogEntry",
    "Repository",
    "SaveReport",
    "Transaction",
    "TransferReport",
    "Usage",
    "clone",
    "errors",
    "open",
    "serve",
]

# Names 0.1 exported at the top level: they keep working for one release, with a warning.
_MOVED = {
    **{name: "cas_ckpt.errors" for name in errors.__all__ if name != "CasCkptError"},
    "BlockStore": "cas_ckpt.blocks",
    "LocalStore": "cas_ckpt.blocks",
    "MemoryStore": "cas_ckpt.blocks",
    "LocalRefStore": "cas_ckpt.refs",
    "MemoryRefStore": "cas_ckpt.refs",
    "RefStore": "cas_ckpt.refs",
}


def __getattr__(name: str) -> Any:
    home = _MOVED.get(name)
    if home is None:
        raise AttributeError(f"module 'cas_ckpt' has no attribute {name!r}")
    warnings.warn(
        f"cas_ckpt.{name} moved to {home}.{name}; the old name goes in the next release",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(importlib.import_module(home), name)
