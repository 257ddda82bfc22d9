"""What the trainer integrations (Lightning, Hugging Face Trainer, accelerate) share.

* :func:`open_repo`: a repository given as an open :class:`Repository` or as a path (opened here);
* :func:`plain`: a trainer's checkpoint turned into values cas_ckpt saves, or a
  :class:`StateTypeError` naming the key of the first value that only pickle could store.
"""

from __future__ import annotations

import argparse
import enum
import pathlib
from collections.abc import Mapping
from typing import Any

import numpy as np
from multiformats import CID

from cas_ckpt.errors import StateTypeError
from cas_ckpt.repository import RepoOrPath
from cas_ckpt.repository import ensure_open as open_repo
from cas_ckpt.tree import MAX_DEPTH, is_tensor, join_path

__all__ = ["RepoOrPath", "open_repo", "plain"]


_SCALARS = (type(None), bool, int, float, str, bytes)


def plain(value: Any, path: str = "", depth: int = 0) -> Any:
    """``value`` as plain data: mappings (``OrderedDict``, Lightning's ``AttributeDict``) become
    dicts, ``argparse.Namespace`` its ``vars()``, tuple subclasses (``torch.Size``, named tuples)
    tuples, paths ``str``, enums their value; arrays, tensors and scalars stay as they are.

    Anything else (a class, a function, a module, a dataclass) raises :class:`StateTypeError`
    naming its key: storing it would need pickle, and loading it would run code.
    """
    if depth > MAX_DEPTH:
        raise StateTypeError(path, f"nesting deeper than {MAX_DEPTH} levels")
    kind = type(value)
    if kind in _SCALARS or isinstance(value, (np.ndarray, np.generic, CID)) or is_tensor(value):
        return value
    if isinstance(value, argparse.Namespace):
        value = vars(value)
    if isinstance(value, Mapping):
        out = {}
        for key, item in value.items():
            if type(key) not in (str, int):
                raise StateTypeError(join_path(path, key),
                                     f"dict keys must be str or int, not {type(key).__name__}")
            out[key] = plain(item, join_path(path, key), depth + 1)
        return out
    if isinstance(value, (list, tuple)):
        items = [plain(item, join_path(path, i), depth + 1) for i, item in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, enum.Enum):
        return plain(value.value, path, depth + 1)
    if isinstance(value, pathlib.PurePath):
        return str(value)
    if isinstance(value, (bool, int, float, str)):  # subclasses (IntEnum handled above)
        return _base_scalar(value)
    raise StateTypeError(
        path, f"a {kind.__module__}.{kind.__qualname__} can only be stored with pickle (and loading "
              "it would run code); store plain data (dicts, lists, numbers, str, tensors) instead"
    )


def _base_scalar(value: Any) -> Any:
    for base in (bool, int, float, str):
        if isinstance(value, base):
            return base(value)
    raise AssertionError(value)
