"""A tiny Lightning fit (dropout, AdamW, a StepLR scheduler) for kill-and-resume tests.

    python train_lightning.py WORK --io cas|default|async|lightning-async --max-steps N
        [--pause-at STEP] [--resume] [--package pytorch_lightning|lightning]

Checkpoints go to WORK/ckpts through ``ModelCheckpoint(every_n_train_steps=3, save_top_k=2,
save_last=True)``, with ``CasCheckpointIO(WORK/repo)`` (``cas``; ``async``: its own async saves;
``lightning-async``: wrapped in Lightning's ``AsyncCheckpointIO``) or Lightning's default
CheckpointIO (``default``). ``--pause-at``: once that step's batch is done, print ``REACHED <step>``
and block on stdin, for the parent to SIGKILL it. ``--resume``: ``fit(ckpt_path=WORK/ckpts/last.ckpt)``.
At the end the weights go to WORK/final.safetensors and ``FILES <names>`` lists the checkpoints.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import warnings

import torch
from safetensors.torch import save_file
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

warnings.filterwarnings("ignore")
torch.use_deterministic_algorithms(True)
torch.set_num_threads(1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("work")
    parser.add_argument("--io", choices=["cas", "default", "async", "lightning-async"], required=True)
    parser.add_argument("--max-steps", type=int, required=True)
    parser.add_argument("--pause-at", type=int, default=None)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--package", default="pytorch_lightning")
    args = parser.parse_args()
    pl = importlib.import_module(args.package if args.package == "pytorch_lightning" else "lightning.pytorch")

    class Tiny(pl.LightningModule):
        def __init__(self, hidden: int = 16, lr: float = 1e-2) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.net = nn.Sequential(nn.Linear(8, hidden), nn.ReLU(), nn.Dropout(0.25), nn.Linear(hidden, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 4, 0.5)}

    class Pause(pl.Callback):
        def on_train_batch_end(self, trainer, *_args) -> None:
            if trainer.global_step == args.pause_at:
                print(f"REACHED {trainer.global_step}", flush=True)
                sys.stdin.readline()  # the parent SIGKILLs us here

    pl.seed_everything(0, verbose=False)
    data = torch.Generator().manual_seed(123)
    x = torch.randn(64, 8, generator=data)
    y = x @ torch.randn(8, 1, generator=data)
    loader = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True, num_workers=0)
    plugins = []
    if args.io != "default":
        from cas_ckpt.integrations.lightning import CasCheckpointIO

        io = CasCheckpointIO(os.path.join(args.work, "repo"), ref="run", async_save=args.io == "async")
        if args.io == "lightning-async":
            from pytorch_lightning.plugins.io import AsyncCheckpointIO

            io = AsyncCheckpointIO(io)
        plugins.append(io)
    dirpath = os.path.join(args.work, "ckpts")
    checkpoint = pl.callbacks.ModelCheckpoint(dirpath=dirpath, every_n_train_steps=3, save_top_k=2,
                                              monitor="step", mode="max", save_last=True)
    trainer = pl.Trainer(
        max_steps=args.max_steps, plugins=plugins, callbacks=[checkpoint, Pause()], logger=False,
        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1,
        deterministic=True,
    )
    model = Tiny()
    trainer.fit(model, loader, ckpt_path=os.path.join(dirpath, "last.ckpt") if args.resume else None)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()},
              os.path.join(args.work, "final.safetensors"))
    print("FILES", " ".join(sorted(os.listdir(dirpath))), flush=True)
    print("BEST", " ".join(sorted(os.path.basename(p) for p in checkpoint.best_k_models)), flush=True)


if __name__ == "__main__":
    main()
