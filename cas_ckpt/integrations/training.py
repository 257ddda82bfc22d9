"""The whole training state as one savable value: model, optimizer, scheduler, scaler and RNGs.

Resuming bit for bit needs every random number generator back where it was, not only the weights:

>>> import random, numpy as np
>>> from cas_ckpt.integrations.training import capture_rng, restore_rng
>>> gen = np.random.default_rng(0)
>>> rng = capture_rng(gen)
>>> first = (random.random(), np.random.rand(), gen.random())
>>> restore_rng(rng, gen)
>>> (random.random(), np.random.rand(), gen.random()) == first
True

torch is never imported here unless the program already did (or a saved state holds torch RNG).
Everything returned is made of values cas_ckpt saves: dicts (int keys too), lists, tuples, ints,
floats, strings, numpy arrays and tensors. Nothing is pickled.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Mapping
from typing import Any

import numpy as np

from cas_ckpt.errors import StateTypeError

__all__ = ["capture_rng", "restore_rng", "restore_training_state", "training_state"]


def _loaded_torch() -> Any:
    """The torch module if the program imported it, else None (never imports it)."""
    return sys.modules.get("torch")


def _python_state(state: tuple[Any, ...]) -> tuple[Any, ...]:
    """A ``random.getstate()`` as saved: ``(version, internal, gauss_next)`` with the Mersenne
    Twister's 624 words and its position as one uint32 array (one value in a checkpoint, not 625)."""
    version, internal, gauss = state
    return version, np.array(internal, dtype=np.uint32), gauss


def _python_setstate(saved: Any) -> tuple[Any, ...]:
    """The argument for ``random.setstate`` of a saved Python RNG state: :func:`_python_state`'s,
    or the plain one (a list of 625 ints) that states saved by earlier versions hold."""
    version, internal, gauss = saved
    return version, tuple(np.asarray(internal, dtype=np.int64).tolist()), gauss


def capture_rng(generator: np.random.Generator | None = None) -> dict[str, Any]:
    """The state of Python's (its 625 words as one uint32 array), numpy's and (if imported)
    torch's CPU and CUDA generators.

    ``generator``: also capture this numpy ``Generator`` (its ``bit_generator.state``).
    """
    state: dict[str, Any] = {
        "python": _python_state(random.getstate()),
        "numpy": np.random.get_state(legacy=False),
    }
    if generator is not None:
        state["generator"] = generator.bit_generator.state
    torch = _loaded_torch()
    if torch is not None:
        state["torch"] = torch.get_rng_state()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = list(torch.cuda.get_rng_state_all())
    return state


def restore_rng(state: Mapping[str, Any], generator: np.random.Generator | None = None) -> None:
    """Put every generator captured by :func:`capture_rng` back (CUDA only if available).

    ``generator``: restore the captured numpy ``Generator`` state into this one.
    """
    if "python" in state:
        random.setstate(_python_setstate(state["python"]))
    if "numpy" in state:
        np.random.set_state(state["numpy"])
    if generator is not None:
        if "generator" not in state:
            raise KeyError("the RNG state holds no numpy Generator state")
        generator.bit_generator.state = state["generator"]
    if "torch" in state or "cuda" in state:
        import torch

        if "torch" in state:
            torch.set_rng_state(state["torch"].to("cpu"))
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([s.to("cpu") for s in state["cuda"]])


def training_state(
    *,
    model: Any = None,
    optimizer: Any = None,
    scheduler: Any = None,
    scaler: Any = None,
    rng: bool = True,
    generator: np.random.Generator | None = None,
    extra: Any = None,
    **objects: Any,
) -> dict[str, Any]:
    """Everything needed to resume: each given object's ``state_dict()``, the RNGs and ``extra``.

    ``objects``: more stateful things by name, each saved under its name: a ``torch.Generator``,
    a numpy ``Generator`` or ``RandomState``, a ``random.Random``, or anything with
    ``state_dict()`` and ``load_state_dict()`` (an EMA, a sampler, a data loader that has them).
    The tensors are the live ones (no copy): save it right away, or use an async
    :class:`~cas_ckpt.CheckpointManager`, which snapshots before returning.
    """
    state: dict[str, Any] = {}
    for name, obj in (
        ("model", model), ("optimizer", optimizer), ("scheduler", scheduler), ("scaler", scaler)
    ):
        if obj is not None:
            state[name] = obj.state_dict()
    if rng:
        state["rng"] = capture_rng(generator)
    if extra is not None:
        state["extra"] = extra
    for name, obj in objects.items():
        if obj is not None:
            state[name] = _state_of(name, obj)
    return state


def _state_of(name: str, obj: Any) -> Any:
    """The savable state of one of ``training_state``'s ``objects``."""
    torch = _loaded_torch()
    if torch is not None and isinstance(obj, torch.Generator):
        return obj.get_state()
    if isinstance(obj, np.random.Generator):
        return obj.bit_generator.state
    if isinstance(obj, np.random.RandomState):
        return obj.get_state(legacy=False)
    if isinstance(obj, random.Random):
        return _python_state(obj.getstate())
    if callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None)):
        return obj.state_dict()
    kind = type(obj)
    raise StateTypeError(name, f"{kind.__module__}.{kind.__qualname__} is not a generator and has "
                               "no state_dict()/load_state_dict()")


def _load_into(name: str, obj: Any, saved: Any) -> None:
    """Put the state :func:`_state_of` captured back into ``obj``."""
    torch = _loaded_torch()
    if torch is not None and isinstance(obj, torch.Generator):
        obj.set_state(saved.to("cpu"))  # a generator's state is a CPU byte tensor, any device's
    elif isinstance(obj, np.random.Generator):
        obj.bit_generator.state = saved
    elif isinstance(obj, np.random.RandomState):
        obj.set_state(saved)
    elif isinstance(obj, random.Random):
        obj.setstate(_python_setstate(saved))
    else:
        _state_of(name, obj)  # the same check (and error) as when saving
        obj.load_state_dict(saved)


def restore_training_state(
    state: Mapping[str, Any],
    *,
    model: Any = None,
    optimizer: Any = None,
    scheduler: Any = None,
    scaler: Any = None,
    rng: bool = True,
    generator: np.random.Generator | None = None,
    strict: bool = True,
    **objects: Any,
) -> Any:
    """Load a :func:`training_state` back into the given objects; return its ``extra``.

    Build model, optimizer, scheduler and scaler (and the ``objects``, by the names they were
    saved under) as for a fresh run, then call this. Each given object must have its part in
    ``state`` (KeyError otherwise).
    """
    for name, obj in (("model", model), ("optimizer", optimizer), ("scheduler", scheduler),
                      ("scaler", scaler)):
        if obj is None:
            continue
        if name not in state:
            raise KeyError(f"the training state holds no {name!r}")
        if name == "model":
            obj.load_state_dict(state[name], strict=strict)
        else:
            obj.load_state_dict(state[name])
    if rng and "rng" in state:
        restore_rng(state["rng"], generator)
    for name, obj in objects.items():
        if obj is None:
            continue
        if name not in state:
            raise KeyError(f"the training state holds no {name!r}")
        _load_into(name, obj, state[name])
    return state.get("extra")
