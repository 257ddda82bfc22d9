"""cas_ckpt: content-addressed, crash-safe, deduplicating checkpoints for training state.

>>> import cas_ckpt, numpy as np
>>> repo = cas_ckpt.open("memory://")
>>> cid = repo.save({"step": 1, "w": np.arange(4.0)}, ref="main", step=1)
>>> repo.load("main")["w"].tolist()
[0.0, 1.0, 2.0, 3.0]
"""

from multiformats import CID

from cas_ckpt.errors import (
    BlockNotFound,
    CarError,
    CasCkptError,
    CheckpointExists,
    CheckpointExpired,
    CorruptBlock,
    CorruptStore,
    DecodeError,
    GraphCycleError,
    InvalidCID,
    InvalidRefName,
    PathNotFound,
    RefConflict,
    RefError,
    RefLocked,
    RefNotFound,
    RepositoryError,
    SaveFailed,
    StateTypeError,
    StepNotFound,
)
from cas_ckpt.manager import CheckpointManager
from cas_ckpt.records import ComputationGraph, GradientCheckpoint, GraphNode
from cas_ckpt.refs import LocalRefStore, MemoryRefStore, ReflogEntry, RefStore
from cas_ckpt.repository import Commit, Repository, SaveReport, open
from cas_ckpt.stores import BlockStore, LocalStore, MemoryStore

__version__ = "0.1.0"

__all__ = [
    "CID",
    "BlockNotFound",
    "BlockStore",
    "CarError",
    "CasCkptError",
    "CheckpointExists",
    "CheckpointExpired",
    "CheckpointManager",
    "Commit",
    "ComputationGraph",
    "CorruptBlock",
    "CorruptStore",
    "DecodeError",
    "GradientCheckpoint",
    "GraphCycleError",
    "GraphNode",
    "InvalidCID",
    "InvalidRefName",
    "LocalRefStore",
    "LocalStore",
    "MemoryRefStore",
    "MemoryStore",
    "PathNotFound",
    "RefConflict",
    "RefError",
    "RefLocked",
    "RefNotFound",
    "RefStore",
    "ReflogEntry",
    "Repository",
    "RepositoryError",
    "SaveFailed",
    "SaveReport",
    "StateTypeError",
    "StepNotFound",
    "open",
]
