"""CasCheckpointCallback with a real Hugging Face Trainer (a tiny BERT built from a config): folders
stored with dedup and read without pickle, retention instead of save_total_limit, and a SIGKILL
mid-run whose resume from the repository ends bit for bit where an uninterrupted run ends."""

from __future__ import annotations

import pickle
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from helpers import assert_bit_identical, run_training_script

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from safetensors.torch import load_file  # noqa: E402

import cas_ckpt  # noqa: E402
from cas_ckpt.errors import CheckpointFileError, UnknownMetric  # noqa: E402
from cas_ckpt.integrations.transformers import (  # noqa: E402
    CasCheckpointCallback,
    load_torch_state,
    read_checkpoint_folder,
    write_checkpoint_folder,
)

SCRIPT = Path(__file__).parent / "scripts" / "train_hf.py"
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning",
                                        "ignore::FutureWarning")


def run_script(work: Path, *args: str, pause_at: int | None = None) -> str:
    return run_training_script(SCRIPT, work, *args, pause_at=pause_at, timeout=300)


def test_sigkill_then_resume_from_the_repository_matches_an_uninterrupted_run(tmp_path: Path) -> None:
    (tmp_path / "plain").mkdir()
    (tmp_path / "cas").mkdir()

    def killed_and_resumed() -> str:
        run_script(tmp_path / "cas", "--mode", "cas", "--max-steps", "12", pause_at=7)
        return run_script(tmp_path / "cas", "--mode", "cas", "--max-steps", "12", "--resume")

    with ThreadPoolExecutor(2) as pool:
        uninterrupted = pool.submit(run_script, tmp_path / "plain", "--mode", "plain", "--max-steps", "12")
        resumed = pool.submit(killed_and_resumed)
        uninterrupted.result()
        out = resumed.result()
    assert f"RESUME {tmp_path / 'cas' / 'out' / 'checkpoint-6'}" in out  # the last save before the kill
    assert "LEFT []" in out  # every folder (the restored one included) is gone: the repository holds them
    expected = load_file(tmp_path / "plain" / "final.safetensors")
    got = load_file(tmp_path / "cas" / "final.safetensors")
    assert list(got) == list(expected)
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name
    repo = cas_ckpt.open(tmp_path / "cas" / "repo")
    assert sorted(repo.refs("run.steps/")) == ["run.steps/000000000009", "run.steps/000000000012"]
    assert [c.step for c in repo.log("run")] == [12, 9, 6, 3]  # keep_last=2: 3 and 6 expired


# -- in-process ------------------------------------------------------------------------------------
class Data(torch.utils.data.Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, 32, (16, 6), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i].sum() % 2}


def trainer(tmp_path: Path, callback: CasCheckpointCallback, *, freeze: bool = False,
            **overrides: object) -> transformers.Trainer:
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=128, hidden_size=96, num_hidden_layers=1,  # 36-72 KiB
                                     num_attention_heads=2, intermediate_size=192, max_position_embeddings=8)
    model = transformers.BertForSequenceClassification(config)
    if freeze:  # fine-tuning a head: the frozen encoder is stored once for every checkpoint
        for p in model.bert.parameters():
            p.requires_grad_(False)
    options = {"output_dir": str(tmp_path / "out"), "max_steps": 4, "per_device_train_batch_size": 4,
               "save_strategy": "steps", "save_steps": 2, "logging_steps": 1, "report_to": "none",
               "use_cpu": True, "disable_tqdm": True, "eval_strategy": "steps", "eval_steps": 2,
               **overrides}
    return transformers.Trainer(model=model, args=transformers.TrainingArguments(**options),
                                train_dataset=Data(), eval_dataset=Data(), callbacks=[callback])


def test_every_file_comes_back_and_nothing_is_unpickled(tmp_path: Path) -> None:
    callback = CasCheckpointCallback(tmp_path / "repo", ref="run", remove_folders=False)
    trainer(tmp_path, callback).train()
    original = tmp_path / "out" / "checkpoint-4"
    restored = write_checkpoint_folder(tmp_path / "repo", "run", tmp_path / "restored")
    names = sorted(p.name for p in original.iterdir())
    assert "training_args.bin" in names and "optimizer.pt" in names and "rng_state.pth" in names
    assert sorted(p.name for p in restored.iterdir()) == [n for n in names if n != "training_args.bin"]
    for name in ("trainer_state.json", "config.json"):
        assert (restored / name).read_bytes() == (original / name).read_bytes()
    weights, back = load_file(original / "model.safetensors"), load_file(restored / "model.safetensors")
    assert list(back) == list(weights) and all(torch.equal(back[k], weights[k]) for k in weights)
    for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth"):
        assert_bit_identical(load_torch_state(original / name), load_torch_state(restored / name), name)
    # The Trainer resumes from the restored folder (model, optimizer, scheduler, RNG, state).
    resumed = trainer(tmp_path / "again", CasCheckpointCallback(tmp_path / "repo2", ref="run"), max_steps=6)
    resumed.train(resume_from_checkpoint=str(restored))
    assert resumed.state.global_step == 6


def test_frozen_weights_are_stored_once_and_keep_best_ranks_by_eval_loss(tmp_path: Path) -> None:
    callback = CasCheckpointCallback(tmp_path / "repo", ref="run", keep_best=1, best_metric="eval_loss")
    run = trainer(tmp_path, callback, freeze=True, max_steps=6)
    run.train()
    report = callback.manager.last_report
    # Tensors above the inline limit (16 KiB) are blocks of their own; the frozen ones are reused.
    frozen = sum(p.nbytes for p in run.model.bert.parameters() if p.nbytes > 16 * 1024)
    assert report is not None and report.bytes_reused >= frozen > report.bytes_written
    steps = callback.manager.steps()
    losses = {s: callback.manager.metrics(s)["eval_loss"] for s in steps}
    assert 6 in steps and len(steps) <= 2  # the latest always, plus the best
    history = {c.step: c.metadata["metrics"]["eval_loss"] for c in callback.repo.log("run")}
    assert min(history.values()) == min(losses.values())
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").glob("checkpoint-*"))


def test_a_misspelt_best_metric_fails_before_anything_is_written(tmp_path: Path) -> None:
    callback = CasCheckpointCallback(tmp_path / "repo", ref="run", keep_best=1, best_metric="eval_los")
    with pytest.raises(UnknownMetric, match="eval_los"):
        trainer(tmp_path, callback).train()
    assert callback.repo.refs() == {}


def test_load_best_model_at_end_needs_the_folders(tmp_path: Path) -> None:
    callback = CasCheckpointCallback(tmp_path / "repo", ref="run")
    with pytest.raises(ValueError, match="load_best_model_at_end"):
        trainer(tmp_path, callback, load_best_model_at_end=True).train()


def test_a_state_file_that_needs_pickle_is_refused_naming_it(tmp_path: Path) -> None:
    folder = tmp_path / "checkpoint-1"
    folder.mkdir()
    torch.save({"fn": pickle.loads}, folder / "optimizer.pt")  # pickle would call it on load
    with pytest.raises(CheckpointFileError, match=r"optimizer\.pt.*only pickle"):
        read_checkpoint_folder(folder)
    with pytest.raises(CheckpointFileError, match="no such checkpoint folder"):
        read_checkpoint_folder(tmp_path / "missing")


def test_resume_folder_of_a_fresh_run_is_none(tmp_path: Path) -> None:
    callback = CasCheckpointCallback(tmp_path / "repo", ref="run")
    assert callback.resume_folder(tmp_path / "out") is None
    repo = cas_ckpt.open(tmp_path / "other")
    repo.save({"w": 1}, ref="x")
    with pytest.raises(CheckpointFileError, match="not a Trainer checkpoint folder"):
        write_checkpoint_folder(repo, "x", tmp_path / "f")


def test_async_saves_store_the_same_folders(tmp_path: Path) -> None:
    callback = CasCheckpointCallback(tmp_path / "repo", ref="run", async_save=True, keep_last=1)
    trainer(tmp_path, callback).train()
    assert callback.manager.steps() == [4]
    folder = callback.resume_folder(tmp_path / "again")
    assert folder == str(tmp_path / "again" / "checkpoint-4")
    assert sorted(p.name for p in Path(folder).iterdir()) == [
        "config.json", "model.safetensors", "optimizer.pt", "rng_state.pth", "scheduler.pt",
        "trainer_state.json"]
    callback.close()
