"""Checkpoint time and disk use of Lightning, the Hugging Face Trainer and accelerate, each with its
own checkpoint files and with cas_ckpt's integration.

    python benchmarks/trainers_bench.py [--steps 300] [--save-every 50] [--json FILE]
        [--frameworks lightning,hf,accelerate] [--scenarios full,frozen] [--workdir DIR]

Every run trains ``--steps`` steps on CPU and checkpoints every ``--save-every`` steps, keeping
every checkpoint (``save_top_k=-1``, no ``save_total_limit``, one ``save_state`` folder per save),
so disk use shows what each save adds. ``full``: every weight trains (nothing repeats between
saves but the configuration); ``frozen``: the backbone is frozen and only a small head trains, as
in fine-tuning. "checkpoint seconds" is the time the training loop spends in saves (for the HF
Trainer with cas_ckpt: writing its folder, then storing and removing it); "disk" is the bytes of
every file left (checkpoint folders or stubs, and the repository).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

warnings.filterwarnings("ignore")
torch.set_num_threads(1)


def disk_bytes(*paths: Path) -> int:
    total = 0
    for root in paths:
        for dirpath, _, files in os.walk(root):
            total += sum(os.lstat(os.path.join(dirpath, f)).st_size for f in files)
    return total


def mlp(frozen: bool) -> torch.nn.Module:
    """1.3 M parameters (5.2 MB float32); ``frozen``: all but the 1025-parameter head."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1))
    if frozen:
        for layer in model[:5]:
            layer.requires_grad_(False)
    return model


def mlp_data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1)
    inputs, targets = torch.randn(512, 256, generator=g), torch.randn(512, 1, generator=g)
    return torch.utils.data.TensorDataset(inputs, targets)


# -- Lightning -------------------------------------------------------------------------------------
def run_lightning(work: Path, cas: bool, frozen: bool, steps: int, every: int) -> dict[str, Any]:
    import pytorch_lightning as pl
    from lightning_fabric.plugins.io.torch_io import TorchCheckpointIO

    from cas_ckpt.integrations.lightning import CasCheckpointIO

    times: list[float] = []
    base = CasCheckpointIO if cas else TorchCheckpointIO

    class Timed(base):  # type: ignore[misc,valid-type]
        def save_checkpoint(self, *args: Any, **kwargs: Any) -> None:
            started = time.perf_counter()
            super().save_checkpoint(*args, **kwargs)
            times.append(time.perf_counter() - started)

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = mlp(frozen)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3)

    plugin = Timed(work / "repo", ref="run") if cas else Timed()
    callback = pl.callbacks.ModelCheckpoint(dirpath=work / "ckpts", every_n_train_steps=every, save_top_k=-1)
    trainer = pl.Trainer(max_steps=steps, plugins=[plugin], callbacks=[callback], logger=False,
                         enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")
    started = time.perf_counter()
    trainer.fit(Module(), torch.utils.data.DataLoader(mlp_data(), batch_size=16, shuffle=True))
    return {"train_seconds": time.perf_counter() - started, "save_seconds": times,
            "disk_bytes": disk_bytes(work)}


# -- Hugging Face Trainer --------------------------------------------------------------------------
class TokenData(torch.utils.data.Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(2)
        self.ids = torch.randint(0, 8000, (512, 32), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i, 0] % 2}


def run_hf(work: Path, cas: bool, frozen: bool, steps: int, every: int) -> dict[str, Any]:
    import transformers

    from cas_ckpt.integrations.transformers import CasCheckpointCallback

    times: list[float] = []

    class TimedTrainer(transformers.Trainer):
        def _save_checkpoint(self, *args: Any, **kwargs: Any) -> None:
            started = time.perf_counter()
            super()._save_checkpoint(*args, **kwargs)
            times.append(time.perf_counter() - started)

    class TimedCallback(CasCheckpointCallback):
        def on_save(self, *args: Any, **kwargs: Any) -> None:
            started = time.perf_counter()
            super().on_save(*args, **kwargs)
            times[-1] += time.perf_counter() - started  # the same save: HF's folder, then cas_ckpt

    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=8000, hidden_size=128, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=512, max_position_embeddings=32)
    model = transformers.BertForSequenceClassification(config)  # 1.4 M parameters
    if frozen:
        model.bert.requires_grad_(False)
    args = transformers.TrainingArguments(
        output_dir=str(work / "out"), max_steps=steps, per_device_train_batch_size=16, save_strategy="steps",
        save_steps=every, report_to="none", use_cpu=True, disable_tqdm=True, logging_steps=every,
    )
    callbacks = [TimedCallback(work / "repo", ref="run")] if cas else []
    trainer = TimedTrainer(model=model, args=args, train_dataset=TokenData(), callbacks=callbacks)
    started = time.perf_counter()
    trainer.train()
    return {"train_seconds": time.perf_counter() - started, "save_seconds": times,
            "disk_bytes": disk_bytes(work)}


# -- accelerate ------------------------------------------------------------------------------------
def run_accelerate(work: Path, cas: bool, frozen: bool, steps: int, every: int) -> dict[str, Any]:
    import accelerate

    from cas_ckpt.integrations.accelerate import AcceleratorCheckpointer

    acc = accelerate.Accelerator(cpu=True)
    model = mlp(frozen)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    sched = torch.optim.lr_scheduler.LinearLR(opt, total_iters=steps)
    loader = torch.utils.data.DataLoader(mlp_data(), batch_size=16, shuffle=True)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    checkpointer = AcceleratorCheckpointer(work / "repo", ref="run") if cas else None
    times: list[float] = []
    step = 0
    started = time.perf_counter()
    while step < steps:
        for x, y in loader:
            acc.backward(torch.nn.functional.mse_loss(model(x), y))
            opt.step()
            sched.step()
            opt.zero_grad()
            step += 1
            if step % every == 0:
                saved = time.perf_counter()
                if checkpointer is not None:
                    checkpointer.save_state(acc, step)
                else:
                    acc.save_state(str(work / "ckpts" / f"step-{step}"))
                times.append(time.perf_counter() - saved)
            if step == steps:
                break
    if checkpointer is not None:
        checkpointer.close()
    return {"train_seconds": time.perf_counter() - started, "save_seconds": times,
            "disk_bytes": disk_bytes(work)}


RUNNERS = {"lightning": run_lightning, "hf": run_hf, "accelerate": run_accelerate}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--save-every", type=int, default=50)
    parser.add_argument("--frameworks", default="lightning,hf,accelerate")
    parser.add_argument("--scenarios", default="full,frozen")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--workdir", type=Path)
    args = parser.parse_args()
    results: dict[str, Any] = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                                           "torch": torch.__version__, "platform": platform.platform()},
                               "steps": args.steps, "save_every": args.save_every, "runs": []}
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        for framework in args.frameworks.split(","):
            for scenario in args.scenarios.split(","):
                for mode in ("default", "cas_ckpt"):
                    work = Path(tmp) / f"{framework}-{scenario}-{mode}"
                    work.mkdir()
                    run = RUNNERS[framework](work, mode == "cas_ckpt", scenario == "frozen",
                                             args.steps, args.save_every)
                    run.update(framework=framework, scenario=scenario, mode=mode)
                    results["runs"].append(run)
                    saves = run["save_seconds"]
                    print(f"{framework:10} {scenario:6} {mode:8}  {len(saves)} saves  "
                          f"median {statistics.median(saves) * 1000:7.1f} ms  total {sum(saves):6.2f} s  "
                          f"disk {run['disk_bytes'] / 2**20:7.1f} MiB  train {run['train_seconds']:6.1f} s",
                          flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
