"""accelerate: what ``Accelerator.save_state`` gathers, saved into and restored from a repository.

::

    from cas_ckpt.integrations.accelerate import AcceleratorCheckpointer
    checkpointer = AcceleratorCheckpointer("checkpoints", ref="runs/exp-7", keep_last=3)
    ...
    checkpointer.save_state(accelerator, step)         # instead of accelerator.save_state(dir)
    step = checkpointer.load_state(accelerator)        # instead of accelerator.load_state(dir)

The state is what ``save_state`` writes as files, as one cas_ckpt checkpoint (by content, so
unchanged tensors are stored once): every prepared model's state dict (as
``accelerator.get_state_dict(model, unwrap=False)``), optimizer, scheduler, the grad scaler,
Python's, numpy's and torch's RNGs (CUDA too when in use), ``accelerator.step``, the state dict of
every object passed to ``register_for_checkpointing``, and each prepared data loader's position:
the epoch it counts (``save_state`` leaves that out, so a run that never calls ``set_epoch``
replays epoch 0's order after resuming from its folder), the epoch and seed of a seedable sampler
and, with ``use_stateful_dataloader``, its ``state_dict()``. Nothing is pickled; loading runs no code.

accelerate's ``register_save_state_pre_hook`` / ``register_load_state_pre_hook`` see the models and
their weights only, and ``save_state`` / ``load_state`` still write and read their files for the
rest: they cannot replace the folder, so this helper calls ``get_state_dict`` and the objects'
``state_dict()`` itself. Tested in one process on CPU (DeepSpeed, FSDP and multi-process RNG
states are not covered).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from multiformats import CID

from cas_ckpt.integrations._common import RepoOrPath, open_repo, plain
from cas_ckpt.integrations.training import capture_rng, restore_rng
from cas_ckpt.manager import CheckpointManager

__all__ = ["AcceleratorCheckpointer", "accelerator_state", "load_accelerator_state"]

FORMAT = "cas_ckpt/accelerate-state"


class AcceleratorCheckpointer:
    """Saves and restores an ``Accelerator``'s training state as checkpoints of ``ref``.

    Keyword options are those of :class:`~cas_ckpt.CheckpointManager` (``keep_last``,
    ``keep_best``, ``best_metric``, ``async_save``...), whose retention and GC apply after each save.
    """

    def __init__(self, repo_or_path: RepoOrPath, *, ref: str = "accelerate", **manager_options: Any) -> None:
        self.repo, self._owned = open_repo(repo_or_path)
        self.manager = CheckpointManager(self.repo, ref, **manager_options)

    def save_state(self, accelerator: Any, step: int, *, metrics: Mapping[str, Any] | None = None,
                   force: bool = False) -> CID | None:
        """Save what ``accelerator.save_state`` would, as checkpoint ``step``; its CID (None when
        ``save_every`` skips the step or the save is async). Only the main process writes."""
        if not accelerator.is_main_process:
            return None
        return self.manager.save(step, accelerator_state(accelerator), metrics=metrics, force=force)

    def load_state(self, accelerator: Any, step: int | None = None, *, strict: bool = True) -> int | None:
        """Restore checkpoint ``step`` (the latest when None) into the prepared objects, as
        ``accelerator.load_state`` would; return its step, or None if ``ref`` holds none yet."""
        if step is None and self.manager.latest_step() is None:
            return None
        state = self.manager.restore(step)
        load_accelerator_state(accelerator, state, strict=strict)
        return self.manager.commit(step).step

    def close(self) -> None:
        """Finish the save in flight, release the run's lease, close a repository opened here."""
        self.manager.close()
        if self._owned:
            self.repo.close()

    def __enter__(self) -> AcceleratorCheckpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def accelerator_state(accelerator: Any) -> dict[str, Any]:
    """What ``accelerator.save_state`` gathers, as one savable value (live tensors, no copies)."""
    scaler = getattr(accelerator, "scaler", None)
    return {
        "format": FORMAT,
        "models": [accelerator.get_state_dict(m, unwrap=False) for m in accelerator._models],
        "optimizers": [o.state_dict() for o in accelerator._optimizers],
        "schedulers": [s.state_dict() for s in accelerator._schedulers],
        "dataloaders": [_loader_state(d) for d in accelerator._dataloaders],
        "scaler": None if scaler is None else scaler.state_dict(),
        "rng": capture_rng(),
        "step": int(accelerator.step),
        "custom": [plain(obj.state_dict(), f"custom.{i}")
                   for i, obj in enumerate(accelerator._custom_objects)],
    }


def load_accelerator_state(accelerator: Any, state: Mapping[str, Any], *, strict: bool = True) -> None:
    """Put a state :func:`accelerator_state` gathered back into ``accelerator``'s prepared objects.

    The same objects must be prepared (and registered) in the same order as when it was saved.
    """
    if state.get("format") != FORMAT:
        raise ValueError("not a state saved by cas_ckpt.integrations.accelerate")
    for kind, live in (("models", accelerator._models), ("optimizers", accelerator._optimizers),
                       ("schedulers", accelerator._schedulers), ("dataloaders", accelerator._dataloaders),
                       ("custom", accelerator._custom_objects)):
        if len(state[kind]) != len(live):
            raise ValueError(f"the checkpoint holds {len(state[kind])} {kind}, and "
                             f"{len(live)} are prepared (or registered) now")
    for model, saved in zip(accelerator._models, state["models"], strict=True):
        model.load_state_dict(saved, strict=strict)
    for obj, saved in zip([*accelerator._optimizers, *accelerator._schedulers, *accelerator._custom_objects],
                          [*state["optimizers"], *state["schedulers"], *state["custom"]], strict=True):
        obj.load_state_dict(saved)
    for loader, saved in zip(accelerator._dataloaders, state["dataloaders"], strict=True):
        _load_loader_state(loader, saved)
    scaler = getattr(accelerator, "scaler", None)
    if scaler is not None and state["scaler"] is not None:
        scaler.load_state_dict(state["scaler"])
    accelerator.step = state["step"]
    restore_rng(state["rng"])


def _loader_state(loader: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if isinstance(getattr(loader, "iteration", None), int):  # the epoch a prepared loader counts
        out["iteration"] = loader.iteration
    sampler = loader.get_sampler() if hasattr(loader, "get_sampler") else None
    if sampler is not None and hasattr(sampler, "initial_seed") and hasattr(sampler, "epoch"):
        out["sampler"] = {"epoch": int(sampler.epoch), "initial_seed": int(sampler.initial_seed)}
    if getattr(loader, "use_stateful_dataloader", False):
        out["state"] = plain(loader.state_dict(), "dataloader")
    return out


def _load_loader_state(loader: Any, saved: Mapping[str, Any]) -> None:
    if "iteration" in saved:
        loader.set_epoch(saved["iteration"])  # also sets a seedable sampler's epoch
    if "sampler" in saved:
        sampler = loader.get_sampler()
        sampler.epoch = saved["sampler"]["epoch"]
        sampler.initial_seed = saved["sampler"]["initial_seed"]
    if "state" in saved:
        loader.load_state_dict(saved["state"])
