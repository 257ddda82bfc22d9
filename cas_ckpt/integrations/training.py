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

__all__ = ["capture_rng", "restore_rng", "restore_training_state", "training_state"]


def _loaded_torch() -> Any:
    """The torch module if the program imported it, else None (never imports it)."""
    return sys.modules.get("torch")


def capture_rng(generator: np.random.Generator | None = None) -> dict[str, Any]:
    """The state of Python's, numpy's and (if imported) torch's CPU and CUDA generators.

    ``generator``: also capture this numpy ``Generator`` (its ``bit_generator.state``).
    """
    state: dict[str, Any] = {
        "python": random.getstate(),
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
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
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
) -> dict[str, Any]:
    """Everything needed to resume: each given object's ``state_dict()``, the RNGs and ``extra``.

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
    return state


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
) -> Any:
    """Load a :func:`training_state` back into the given objects; return its ``extra``.

    Build model, optimizer, scheduler and scaler as for a fresh run, then call this. Each given
    object must have its part in ``state`` (KeyError otherwise).
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
    return state.get("extra")
