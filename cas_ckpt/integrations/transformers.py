"""Hugging Face Trainer: every ``checkpoint-N`` folder the Trainer writes goes into a cas_ckpt
repository, and a run resumes from the repository.

One line to store, one to resume::

    from cas_ckpt.integrations.transformers import CasCheckpointCallback
    callback = CasCheckpointCallback("checkpoints", ref="runs/exp-7", keep_last=2)
    trainer = Trainer(model, args, train_dataset=data, callbacks=[callback])
    trainer.train(resume_from_checkpoint=callback.resume_folder(args.output_dir))

After the Trainer saves ``checkpoint-N`` (``on_save``), the callback reads every file in it and
stores them as checkpoint ``N`` of ``ref`` through a :class:`~cas_ckpt.CheckpointManager`:

* ``*.safetensors`` (the weights) as tensors, so unchanged tensors are stored once across steps;
* ``optimizer.pt``, ``scheduler.pt``, ``scaler.pt`` and ``rng_state*.pth`` as the state they hold,
  read with ``torch.load(weights_only=True)`` (numpy's RNG arrays allowed, as the Trainer itself
  allows them): nothing is unpickled beyond tensors and plain data;
* every other file (``trainer_state.json``, ``config.json``, tokenizer files) as its bytes;
* ``training_args.bin`` (the pickled ``TrainingArguments``) is left out: only pickle could read it,
  and the Trainer never reads it back to resume.

Then the folder is removed (``remove_folders``): cas_ckpt's retention (``keep_last``,
``keep_best`` on a logged metric such as ``eval_loss``) replaces ``save_total_limit``.
:meth:`CasCheckpointCallback.resume_folder` (or :func:`write_checkpoint_folder`, from any ref or
CID) writes the folder back for ``resume_from_checkpoint``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from transformers import TrainerCallback

from cas_ckpt.errors import CheckpointFileError
from cas_ckpt.integrations._common import RepoOrPath, open_repo, plain
from cas_ckpt.manager import CheckpointManager
from cas_ckpt.repository import Repository, Target

__all__ = ["FOLDER_FORMAT", "CasCheckpointCallback", "read_checkpoint_folder", "write_checkpoint_folder"]

FOLDER_FORMAT = "cas_ckpt/hf-checkpoint-folder"
PREFIX = "checkpoint"  # the Trainer's PREFIX_CHECKPOINT_DIR
SKIPPED = ("training_args.bin",)  # pickled TrainingArguments: never read to resume
_TORCH_STATE = ("optimizer.pt", "scheduler.pt", "scaler.pt")


def _is_torch_state(name: str) -> bool:
    base = name.rsplit("/", 1)[-1]
    return base in _TORCH_STATE or (base.startswith("rng_state") and base.endswith(".pth"))


class CasCheckpointCallback(TrainerCallback):
    """A ``TrainerCallback`` that stores each checkpoint folder the Trainer saves in a repository.

    ``repo_or_path``: a :class:`~cas_ckpt.Repository` or a path. ``ref``: the run's ref (step refs
    below ``<ref>.steps/``, as for :class:`~cas_ckpt.CheckpointManager`). ``keep_last``,
    ``keep_best``, ``best_metric`` (a logged name such as ``"eval_loss"``), ``best_mode``: the
    manager's retention; each checkpoint records the latest value of every logged number at or
    before its step. ``async_save``: the manager's async saves. ``remove_folders``: delete the
    Trainer's folder once stored (it cannot then ``load_best_model_at_end``, which needs folders).
    Only the world's process zero stores; tested single-process.
    """

    def __init__(
        self,
        repo_or_path: RepoOrPath,
        *,
        ref: str = "hf-trainer",
        keep_last: int | None = None,
        keep_best: int | None = None,
        best_metric: str | None = None,
        best_mode: str = "min",
        async_save: bool = False,
        remove_folders: bool = True,
    ) -> None:
        self.repo, self._owned = open_repo(repo_or_path)
        self.manager_options = {"keep_last": keep_last, "keep_best": keep_best,
                                "best_metric": best_metric, "best_mode": best_mode,
                                "async_save": async_save}
        self.ref = ref
        self.remove_folders = remove_folders
        self._manager: CheckpointManager | None = None
        self._restored: list[Path] = []  # folders resume_folder wrote, removed once training runs
        self.manager  # noqa: B018 - checks the options and takes the run's lease now, not mid-run

    @property
    def manager(self) -> CheckpointManager:
        """The :class:`~cas_ckpt.CheckpointManager` of ``ref`` (retention, steps, restore)."""
        if self._manager is None:
            self._manager = CheckpointManager(self.repo, self.ref, **self.manager_options)
        return self._manager

    # -- resume --------------------------------------------------------------------------------
    def resume_folder(self, output_dir: str | os.PathLike[str], step: int | None = None) -> str | None:
        """Write checkpoint ``step`` (the latest when None) back as ``output_dir/checkpoint-N``
        and return its path for ``resume_from_checkpoint``; None when ``ref`` holds no checkpoint
        yet (a fresh run). The folder is removed again once training has taken its first step."""
        if step is None and self.manager.latest_step() is None:
            return None
        step = self.manager.latest_step() if step is None else step
        cid = self.manager.commit(step).cid
        folder = Path(output_dir) / f"{PREFIX}-{step}"
        write_checkpoint_folder(self.repo, cid, folder)
        if self.remove_folders:
            self._restored.append(folder)
        return str(folder)

    # -- TrainerCallback -----------------------------------------------------------------------
    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.remove_folders and getattr(args, "load_best_model_at_end", False):
            raise ValueError(
                "CasCheckpointCallback(remove_folders=True) removes the checkpoint folders that "
                "load_best_model_at_end needs; pass remove_folders=False, or, after training, write "
                "the best step's folder back with write_checkpoint_folder(callback.repo, "
                "callback.manager.step_ref(step), folder)"
            )

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        while self._restored:  # the Trainer has read model, optimizer, scheduler and RNG by now
            shutil.rmtree(self._restored.pop(), ignore_errors=True)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not state.is_world_process_zero:
            return
        folder = Path(args.output_dir) / f"{PREFIX}-{state.global_step}"
        checkpoint = read_checkpoint_folder(folder)
        self.manager.save(state.global_step, checkpoint, metrics=_metrics(state.log_history,
                                                                          state.global_step),
                          overwrite=True)  # a run resumed from an earlier step saves its steps again
        if self.remove_folders:
            shutil.rmtree(folder)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.manager.wait()  # an async save's failure surfaces here, not after the process ends

    def close(self) -> None:
        """Finish the save in flight, release the run's lease, close a repository opened here."""
        if self._manager is not None:
            self._manager.close()
            self._manager = None
        if self._owned:
            self.repo.close()


def _metrics(log_history: list[Mapping[str, Any]], step: int) -> dict[str, Any]:
    """The latest value of every logged number at or before ``step``."""
    metrics: dict[str, Any] = {}
    for entry in log_history:
        if entry.get("step", 0) <= step:
            metrics.update((k, v) for k, v in entry.items()
                           if isinstance(k, str) and type(v) in (int, float) and k != "step")
    return metrics


# -- folders <-> states ----------------------------------------------------------------------------
def read_checkpoint_folder(folder: str | os.PathLike[str]) -> dict[str, Any]:
    """The files of a Trainer checkpoint folder as a savable state (see the module's docstring).

    Raises :class:`CheckpointFileError` naming the file that is missing or cannot be read
    without running code.
    """
    root = Path(folder)
    if not root.is_dir():
        raise CheckpointFileError(root, "no such checkpoint folder")
    files: dict[str, Any] = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        name = path.relative_to(root).as_posix()
        if name in SKIPPED:
            continue
        files[name] = _read_file(path, name)
    return {"format": FOLDER_FORMAT, "version": 1, "files": files}


def _read_file(path: Path, name: str) -> dict[str, Any]:
    if name.endswith(".safetensors"):
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            tensors = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118 - not a dict
            metadata = f.metadata() or {}
        return {"kind": "safetensors", "tensors": tensors, "metadata": dict(metadata)}
    if _is_torch_state(name):
        return {"kind": "torch", "state": plain(load_torch_state(path), name)}
    return {"kind": "bytes", "data": path.read_bytes()}


def load_torch_state(path: str | os.PathLike[str]) -> Any:
    """``torch.load(path, weights_only=True)`` allowing the numpy types an RNG state holds, as
    the Trainer does: tensors and plain data only, no code runs."""
    import torch

    allowed = [np.dtype, np.ndarray, type(np.dtype(np.uint32)), _np_reconstruct()]
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, weights_only=True, map_location="cpu")
    except Exception as exc:  # the weights-only loader refused it (or the file is damaged)
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise CheckpointFileError(path, f"is not only tensors and plain data (only pickle could "
                                        f"read it, or it is damaged): {first}") from None


def _np_reconstruct() -> Any:
    core = getattr(np, "_core", None) or np.core
    return core.multiarray._reconstruct


def write_checkpoint_folder(repo_or_path: RepoOrPath | Repository, target: Target,
                            folder: str | os.PathLike[str]) -> Path:
    """Write the checkpoint folder stored at ``target`` (a ref, CID or step ref) to ``folder``.

    Files already in ``folder`` with the same names are replaced; the folder is complete only once
    this returns (it is written under a temporary name, then renamed).
    """
    import torch
    from safetensors.torch import save_file

    repo, owned = open_repo(repo_or_path)
    try:
        state = repo.load(target)
    finally:
        if owned:
            repo.close()
    if not isinstance(state, dict) or state.get("format") != FOLDER_FORMAT:
        raise CheckpointFileError(
            str(target), "is not a Trainer checkpoint folder stored by CasCheckpointCallback")
    final = Path(folder)
    tmp = final.with_name(f".{final.name}.cas_ckpt-tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    for name, entry in state["files"].items():
        path = tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if entry["kind"] == "safetensors":
            tensors = {k: v.contiguous() for k, v in entry["tensors"].items()}
            save_file(tensors, str(path), metadata=dict(entry["metadata"]) or None)
        elif entry["kind"] == "torch":
            torch.save(entry["state"], path)
        else:
            path.write_bytes(entry["data"])
    with contextlib.suppress(FileNotFoundError):
        shutil.rmtree(final)
    os.replace(tmp, final)
    return final

