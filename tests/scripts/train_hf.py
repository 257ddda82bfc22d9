"""A tiny Hugging Face Trainer run (a BERT built from a config, no download) for kill-and-resume.

    python train_hf.py WORK --mode cas|plain --max-steps N [--pause-at STEP] [--resume]

``cas``: checkpoints every 3 steps go into WORK/repo through ``CasCheckpointCallback`` (keep_last=2,
folders removed); ``--resume`` resumes from the repository. ``plain``: no callback, no resume (the
uninterrupted reference). ``--pause-at``: once that step ends, print ``REACHED <step>`` and block on
stdin for the parent to SIGKILL it. At the end the weights go to WORK/final.safetensors.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

import torch
from safetensors.torch import save_file
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

warnings.filterwarnings("ignore")
torch.use_deterministic_algorithms(True)
torch.set_num_threads(1)


class Data(torch.utils.data.Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(7)
        self.ids = torch.randint(0, 64, (48, 12), generator=g)
        self.labels = (self.ids.sum(1) % 2).long()

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("work")
    parser.add_argument("--mode", choices=["cas", "plain"], required=True)
    parser.add_argument("--max-steps", type=int, required=True)
    parser.add_argument("--pause-at", type=int, default=None)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()

    class Pause(TrainerCallback):
        def on_step_end(self, targs, state, control, **kwargs):
            if state.global_step == args.pause_at:
                print(f"REACHED {state.global_step}", flush=True)
                sys.stdin.readline()  # the parent SIGKILLs us here

    torch.manual_seed(0)
    config = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=16, hidden_dropout_prob=0.2)
    model = BertForSequenceClassification(config)
    out = os.path.join(args.work, "out")
    targs = TrainingArguments(
        output_dir=out, max_steps=args.max_steps, per_device_train_batch_size=4, learning_rate=1e-3,
        lr_scheduler_type="linear", warmup_steps=2, save_strategy="steps" if args.mode == "cas" else "no",
        save_steps=3, eval_strategy="steps", eval_steps=3, per_device_eval_batch_size=8, logging_steps=1,
        report_to="none", use_cpu=True, seed=0, data_seed=0, dataloader_num_workers=0, disable_tqdm=True,
    )
    callbacks = [Pause()]
    resume = None
    if args.mode == "cas":
        from cas_ckpt.integrations.transformers import CasCheckpointCallback

        cas = CasCheckpointCallback(os.path.join(args.work, "repo"), ref="run", keep_last=2)
        callbacks.append(cas)
        resume = cas.resume_folder(out) if args.resume else None
        print("RESUME", resume, flush=True)
    trainer = Trainer(model=model, args=targs, train_dataset=Data(), eval_dataset=Data(), callbacks=callbacks)
    trainer.train(resume_from_checkpoint=resume)
    weights = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(weights, os.path.join(args.work, "final.safetensors"))
    print("LEFT", sorted(os.listdir(out)) if os.path.isdir(out) else [], flush=True)


if __name__ == "__main__":
    main()
