"""PyTorch tensors <-> numpy arrays without copying bytes where the layout allows.

torch is imported lazily: ``import cas_ckpt`` never needs it. Dtypes numpy lacks (bfloat16 and the
float8 variants) travel as their ``ml_dtypes`` equivalents, bit for bit.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from cas_ckpt.errors import DecodeError, StateTypeError


def _torch() -> Any:
    import torch

    return torch


def _dtype_table() -> dict[Any, np.dtype[Any]]:
    import ml_dtypes

    torch = _torch()
    table: dict[Any, np.dtype[Any]] = {
        torch.bool: np.dtype(np.bool_),
        torch.uint8: np.dtype(np.uint8),
        torch.int8: np.dtype(np.int8),
        torch.int16: np.dtype(np.int16),
        torch.int32: np.dtype(np.int32),
        torch.int64: np.dtype(np.int64),
        torch.float16: np.dtype(np.float16),
        torch.float32: np.dtype(np.float32),
        torch.float64: np.dtype(np.float64),
        torch.complex64: np.dtype(np.complex64),
        torch.complex128: np.dtype(np.complex128),
        torch.bfloat16: np.dtype(ml_dtypes.bfloat16),
    }
    for name in ("uint16", "uint32", "uint64"):
        if hasattr(torch, name):
            table[getattr(torch, name)] = np.dtype(name)
    for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"):
        if hasattr(torch, name) and hasattr(ml_dtypes, name):
            table[getattr(torch, name)] = np.dtype(getattr(ml_dtypes, name))
    return table


_TABLE: dict[Any, np.dtype[Any]] | None = None


def dtype_table() -> dict[Any, np.dtype[Any]]:
    global _TABLE
    if _TABLE is None:
        _TABLE = _dtype_table()
    return _TABLE


def tensor_to_numpy(tensor: Any, path: str) -> tuple[np.ndarray[Any, Any], str]:
    """A host numpy array with the tensor's bytes (a view when already on CPU and dense)."""
    torch = _torch()
    table = dtype_table()
    if tensor.dtype not in table:
        raise StateTypeError(path, f"unsupported torch dtype {tensor.dtype}")
    if tensor.is_sparse or tensor.layout != torch.strided:
        raise StateTypeError(path, f"cannot save a {tensor.layout} tensor; convert it to dense")
    if tensor.is_quantized:
        raise StateTypeError(path, "cannot save a quantized tensor")
    if hasattr(tensor, "_local_tensor") or type(tensor) not in (
        torch.Tensor, torch.nn.Parameter
    ):
        raise StateTypeError(path, f"cannot save a tensor subclass {type(tensor).__name__}")
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    target = table[t.dtype]
    if target.itemsize == 0 or t.dtype in (torch.bool,) or _native(t.dtype):
        array = t.numpy()
    else:
        # bfloat16 / float8: reinterpret the bytes through an integer view of the same width.
        width = {1: torch.uint8, 2: torch.int16}[t.element_size()]
        array = t.view(width).numpy().view(target) if t.dim() else (
            t.reshape(1).view(width).numpy().view(target).reshape(())
        )
    return array, "torch"


def _native(dtype: Any) -> bool:
    torch = _torch()
    return dtype not in {torch.bfloat16} and "float8" not in str(dtype)


def numpy_to_tensor(
    array: np.ndarray[Any, Any], header: dict[str, Any], *, map_location: Any = None
) -> Any:
    """The torch tensor for a loaded array (sharing its memory when on CPU)."""
    torch = _torch()
    reverse = {v: k for k, v in dtype_table().items()}
    target = reverse.get(array.dtype)
    if target is None:
        raise DecodeError(f"array of dtype {array.dtype} cannot become a torch tensor")
    if not array.flags.c_contiguous and not array.flags.f_contiguous:
        array = np.ascontiguousarray(array)
    if _native(target):
        tensor = torch.from_numpy(array) if array.ndim else torch.from_numpy(array.reshape(1))[0]
    else:
        width = {1: np.uint8, 2: np.int16}[array.dtype.itemsize]
        tensor = torch.from_numpy(array.view(width) if array.ndim else array.reshape(1).view(width))
        tensor = tensor.view(target)
        if not array.ndim:
            tensor = tensor[0]
    if map_location is not None:
        tensor = tensor.to(map_location)
    return tensor
