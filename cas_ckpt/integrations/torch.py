"""PyTorch tensors <-> numpy arrays, bit for bit, without copying bytes where the layout allows.

torch is imported lazily: ``import cas_ckpt`` never needs it. Dtypes numpy lacks (bfloat16 and the
float8 variants) travel as their ``ml_dtypes`` equivalents; ml_dtypes, whose import takes a second or
more, is imported only when a state holds one of them. What comes back:

* a plain ``torch.Tensor`` on the CPU (or ``map_location``), with the saved shape, dtype and values.
  ``map_location`` is read as ``torch.load`` reads it: a device (str or ``torch.device``), a dict
  of locations (``{"cuda:0": "cpu"}``), or a callable ``(storage, location) -> storage or None``.
  No device is recorded with a tensor (it is stored as a host copy), so every tensor's location
  is ``"cpu"``: a dict maps only ``"cpu"`` and a callable always gets ``"cpu"``;
  ``nn.Parameter`` comes back as a plain tensor (``requires_grad`` is not stored):
  ``model.load_state_dict`` copies it into the parameter, which is the usual way back;
* tensors that shared storage (tied weights, views) come back as separate tensors. Their bytes are
  stored once when identical (same chunks); views of different parts are stored as what they show;
* without torch installed, arrays saved from tensors load as numpy arrays.

Not savable (:class:`StateTypeError` naming the path): complex32, the bit-packed dtypes (uint1-7,
float4_e2m1fn_x2), quantized, sparse, nested and meta tensors, and tensor subclasses (DTensor...).
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import numpy as np

from cas_ckpt.errors import DecodeError, MapLocationError, StateTypeError
from cas_ckpt.tree import TensorAdapter, dtype_name, parse_dtype, register_tensor_adapter

# torch dtype name -> ml_dtypes name, for the dtypes numpy has no native type for.
_VIA_ML_DTYPES = {
    "bfloat16": "bfloat16",
    "float8_e4m3fn": "float8_e4m3fn",
    "float8_e5m2": "float8_e5m2",
    "float8_e4m3fnuz": "float8_e4m3fnuz",
    "float8_e5m2fnuz": "float8_e5m2fnuz",
    "float8_e8m0fnu": "float8_e8m0fnu",
}
_NATIVE = (
    "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
    "float16", "float32", "float64", "complex64", "complex128",
)
_HINTS = {
    "complex32": "complex32 (ComplexHalf) has no numpy equivalent; convert with .to(torch.complex64)",
    "float4_e2m1fn_x2": "packs two values per byte; save its .view(torch.uint8) instead",
}


def _torch() -> Any:
    import torch

    return torch


@functools.cache
def _native() -> dict[Any, np.dtype[Any]]:
    """The torch dtypes numpy has a native type for, and that type."""
    torch = _torch()
    return {getattr(torch, name): np.dtype(np.bool_ if name == "bool" else name)
            for name in _NATIVE if hasattr(torch, name)}


@functools.cache
def _via_names() -> dict[Any, str]:
    """The torch dtypes stored as an ml_dtypes dtype, and its name (no ml_dtypes import needed)."""
    torch = _torch()
    return {getattr(torch, name): ml_name for name, ml_name in _VIA_ML_DTYPES.items() if hasattr(torch, name)}


@functools.cache
def _torch_of() -> tuple[dict[np.dtype[Any], Any], dict[str, Any]]:
    """Native numpy dtypes, and ml_dtypes' dtypes by name, each to its torch dtype."""
    return ({dtype: torch_dtype for torch_dtype, dtype in _native().items()},
            {name: torch_dtype for torch_dtype, name in _via_names().items()})


def savable_dtypes() -> frozenset[Any]:
    """Every torch dtype cas_ckpt stores bit for bit (without importing ml_dtypes)."""
    return frozenset(_native()) | frozenset(_via_names())


def numpy_dtype_of(torch_dtype: Any) -> np.dtype[Any] | None:
    """The numpy dtype a torch dtype's bytes are stored as; None if it cannot be saved.

    ml_dtypes (an import of a second or more) is imported only for the dtypes that need it:
    bfloat16 and the float8 variants.
    """
    found = _native().get(torch_dtype)
    if found is not None:
        return found
    name = _via_names().get(torch_dtype)
    if name is None:
        return None
    try:
        return parse_dtype(name)
    except DecodeError:  # an ml_dtypes too old to have it
        return None


def torch_dtype_of(dtype: np.dtype[Any]) -> Any:
    """The torch dtype of a numpy dtype (None if torch has none); never imports ml_dtypes: an
    array of one of its dtypes exists only once it is imported."""
    native, by_name = _torch_of()
    found = native.get(dtype)
    return found if found is not None else by_name.get(dtype_name(dtype) or "")


def check_tensor(tensor: Any, path: str) -> None:
    """Raise :class:`StateTypeError` (naming ``path``) if ``tensor`` cannot be saved."""
    torch = _torch()
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter):
        raise StateTypeError(path, f"cannot save a tensor subclass {type(tensor).__name__}")
    if tensor.is_quantized:
        raise StateTypeError(path, "cannot save a quantized tensor; save its int_repr() and scales")
    if tensor.is_nested or tensor.layout != torch.strided:
        raise StateTypeError(path, f"cannot save a {tensor.layout} tensor; convert it to dense")
    if tensor.device.type == "meta":
        raise StateTypeError(path, "cannot save a meta tensor: it has no data")
    if tensor.dtype not in _native() and numpy_dtype_of(tensor.dtype) is None:
        name = str(tensor.dtype).removeprefix("torch.")
        raise StateTypeError(path, _HINTS.get(name, f"unsupported torch dtype {tensor.dtype}"))


def host_array(tensor: Any) -> np.ndarray[Any, Any] | None:
    """The numpy view of a plain tensor (``torch.Tensor`` or ``nn.Parameter``) on the CPU, without
    a conjugate or negative bit, in one call (bfloat16 and float8: a view of its integer view, as
    ml_dtypes' type); None for any other tensor, which :func:`tensor_to_numpy` checks (and
    converts, or says why it cannot).

    ``Tensor.numpy()`` refuses exactly those others (complex32, quantized, sparse, nested, meta,
    CUDA tensors, set bits): one call where the checks of :func:`check_tensor` and
    :func:`tensor_to_numpy` took eleven, for each of 10,000 small tensors.
    """
    try:
        if tensor.requires_grad:
            tensor = tensor.detach()
        if tensor.dtype not in _via_names():
            return tensor.numpy()  # type: ignore[no-any-return]
        viewed = _integer_view(tensor.dtype)
        if viewed is None:
            return None
        width, dtype = viewed
        return tensor.view(width).numpy().view(dtype)  # type: ignore[no-any-return]
    except (TypeError, RuntimeError):
        return None


@functools.cache
def _integer_view(torch_dtype: Any) -> tuple[Any, np.dtype[Any]] | None:
    """For a torch dtype numpy lacks and ml_dtypes has: the integer dtype of its width (a view of
    the same bytes that ``Tensor.numpy`` takes) and ml_dtypes' dtype; None if there is none.
    Imports ml_dtypes, as saving such a tensor does anyway."""
    dtype = numpy_dtype_of(torch_dtype)
    if dtype is None or dtype.itemsize not in (1, 2):
        return None
    return (_torch().uint8 if dtype.itemsize == 1 else _torch().int16), dtype


def host_arrays(values: list[Any]) -> list[np.ndarray[Any, Any] | None]:
    """:func:`host_array` of each plain tensor among ``values``, None for any other value, in
    one comprehension: a state dict's tensors pay no Python call each (most have no grad and a
    numpy dtype, and ``Tensor.numpy`` takes them all; the first it refuses sends the whole list
    through :func:`host_array`)."""
    plain = plain_types()
    try:
        return [value.numpy() if type(value) in plain else None for value in values]
    except (TypeError, RuntimeError):
        return [host_array(value) if type(value) in plain else None for value in values]


def plain_types() -> tuple[type, ...]:
    """The tensor types :func:`host_array` takes: subclasses (DTensor...) are refused by
    :func:`check_tensor`."""
    torch = _torch()
    return torch.Tensor, torch.nn.Parameter


def tensor_maker() -> Any:
    """``torch.from_numpy`` where torch is imported (a load of torch tensors imports it anyway),
    else None: what makes a load's small tensors (CPU, sharing the arrays' memory; for a
    writable C-ordered array of a dtype numpy has, exactly what :func:`numpy_to_tensor` makes)."""
    torch = sys.modules.get("torch")
    return None if torch is None else torch.from_numpy


def tensor_to_numpy(tensor: Any, path: str) -> tuple[np.ndarray[Any, Any], str]:
    """A host numpy array with the tensor's values (a view of its memory when on the CPU)."""
    check_tensor(tensor, path)
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if t.dtype in _native():
        return t.numpy(), "torch"
    # bfloat16 / float8: reinterpret the bytes through an integer view of the same width.
    width = _torch().uint8 if t.element_size() == 1 else _torch().int16
    dtype = numpy_dtype_of(t.dtype)
    if t.dim() == 0:
        return t.reshape(1).view(width).numpy().view(dtype).reshape(()), "torch"
    return t.view(width).numpy().view(dtype), "torch"


def host_copy(tensor: Any, path: str, *, out: Any = None) -> Any:
    """A detached CPU copy of ``tensor`` that later in-place updates of the original cannot touch.

    ``out``: a CPU tensor from an earlier copy to refill when dtype and shape match (the copy then
    skips allocating and faulting in fresh memory); otherwise a new tensor is allocated.
    """
    check_tensor(tensor, path)
    torch = _torch()
    source = tensor.detach()
    fits = (
        type(out) is torch.Tensor and out.device.type == "cpu" and out.dtype == source.dtype
        and out.shape == source.shape and not out.is_conj() and not out.is_neg()
    )
    if source.device.type != "cpu":
        return out.copy_(source) if fits else source.to("cpu", copy=True)
    if not fits:
        out = torch.empty(source.shape, dtype=source.dtype)
    # numpy's copy of the bits beats Tensor.copy_ on the CPU (no thread pool hand-off)
    to, start = host_array(out), host_array(source)
    if to is None or start is None:  # bfloat16, float8, set bits: the general conversion
        to, start = tensor_to_numpy(out, path)[0], tensor_to_numpy(source, path)[0]
    np.copyto(to, start)
    return out


def numpy_to_tensor(
    array: np.ndarray[Any, Any], header: dict[str, Any], *, map_location: Any = None
) -> Any:
    """The torch tensor for a loaded array (sharing its memory on the CPU); numpy without torch.

    Raises :class:`MapLocationError` when ``map_location`` cannot place it (the tree reader adds
    the path of the value inside the state).
    """
    try:
        torch = _torch()
    except ImportError:
        return array
    target = torch_dtype_of(array.dtype)
    if target is None:
        raise DecodeError(f"array of dtype {array.dtype} cannot become a torch tensor")
    if not array.flags.writeable or not (array.flags.c_contiguous or array.flags.f_contiguous):
        array = np.array(array, order="K")  # from_numpy wants writable memory with simple strides
    scalar = not array.ndim
    if scalar:  # a 0-d array's view of another dtype is refused: made 1-d, then 0-d again
        array = array.reshape(1)
    if target not in _native():
        width = np.uint8 if array.dtype.itemsize == 1 else np.int16
        tensor = torch.from_numpy(array.view(width)).view(target)
    else:
        tensor = torch.from_numpy(array)
    if scalar:
        tensor = tensor.reshape(())  # only then: a torch reshape costs about 1 us a tensor
    if map_location is not None:
        tensor = _place(tensor, map_location)
    return tensor


# Where a loaded tensor "was saved", in torch.load's terms: tensors are stored as host copies and
# no device is recorded, so it is always the CPU.
SAVED_LOCATION = "cpu"


def _place(tensor: Any, map_location: Any) -> Any:
    """``tensor`` (on the CPU) moved where ``map_location`` sends it, read as torch.load reads it."""
    torch = _torch()
    if isinstance(map_location, dict):
        keys = [k for k in map_location if not isinstance(k, str)]
        if keys:
            raise MapLocationError(
                f"map_location dict keys must be str locations such as 'cuda:0', not {keys[0]!r}"
            )
        return _to_device(tensor, map_location.get(SAVED_LOCATION, SAVED_LOCATION))
    if isinstance(map_location, (str, torch.device)):
        return _to_device(tensor, map_location)
    if callable(map_location):
        try:
            storage = map_location(tensor.untyped_storage(), SAVED_LOCATION)
        except (RuntimeError, AssertionError, ValueError, TypeError) as exc:  # no CUDA, say
            raise MapLocationError(f"the map_location callable failed: {exc!r}") from exc
        return _with_storage(tensor, storage)
    is_dtype = isinstance(map_location, torch.dtype)
    hint = "; to cast floating-point tensors, pass dtype= instead" if is_dtype else ""
    raise MapLocationError(
        "map_location must be a str, torch.device, dict or callable, "
        f"not {type(map_location).__name__}{hint}"
    )


def _to_device(tensor: Any, target: Any) -> Any:
    torch = _torch()
    if not isinstance(target, (str, torch.device)):
        raise MapLocationError(f"map_location {target!r} is not a device (a str or torch.device)")
    try:
        device = torch.device(target)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise MapLocationError(f"map_location {target!r} is not a device: {exc}") from exc
    try:
        return tensor.to(device)
    except (RuntimeError, AssertionError, ValueError, TypeError) as exc:  # torch without CUDA asserts
        name = str(device)
        raise MapLocationError(f"cannot load a tensor onto {name!r}: {exc}", device=name) from exc


def _with_storage(tensor: Any, storage: Any) -> Any:
    """``tensor``'s view of ``storage``, what a map_location callable returned (None: keep it)."""
    torch = _torch()
    if storage is None:  # as in torch.load: the default location, here the CPU copy as loaded
        return tensor
    if not isinstance(storage, torch.UntypedStorage):
        raise MapLocationError(
            "a map_location callable must return a storage or None, "
            f"not {type(storage).__name__}"
        )
    try:
        out = torch.empty(0, dtype=tensor.dtype, device=storage.device)
        return out.set_(storage, tensor.storage_offset(), tensor.shape, tensor.stride())
    except RuntimeError as exc:
        raise MapLocationError(
            f"the storage a map_location callable returned cannot hold this tensor: {exc}",
            device=str(storage.device),
        ) from exc


def _is_tensor(value: object) -> bool:
    return isinstance(value, _torch().Tensor)


def _to_numpy(tensor: Any, path: str) -> np.ndarray[Any, Any]:
    array = host_array(tensor) if type(tensor) in plain_types() else None
    return array if array is not None else tensor_to_numpy(tensor, path)[0]


def _from_numpy(array: np.ndarray[Any, Any], header: dict[str, Any], map_location: Any) -> Any:
    return numpy_to_tensor(array, header, map_location=map_location)


def _cast_floats(tensor: Any, dtype: Any) -> Any:
    if not tensor.is_floating_point():
        return tensor
    torch = _torch()
    if not isinstance(dtype, torch.dtype):
        found = torch_dtype_of(np.dtype(dtype))
        if found is None:
            raise StateTypeError("dtype", f"{dtype!r} has no torch equivalent")
        dtype = found
    return tensor.to(dtype)


def _numpy_dtype(dtype: Any) -> np.dtype[Any] | None:
    if type(dtype).__module__.partition(".")[0] != "torch":
        return None
    found = numpy_dtype_of(dtype)
    if found is None:
        raise StateTypeError("dtype", f"{dtype} has no numpy equivalent")
    return found


# The data model reaches torch only through this adapter (``import cas_ckpt`` registers it).
register_tensor_adapter(TensorAdapter("torch", "torch", _is_tensor, _to_numpy, _from_numpy,
                                      _cast_floats, _numpy_dtype, host_arrays, plain_types, tensor_maker))
