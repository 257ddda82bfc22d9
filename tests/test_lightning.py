"""CasCheckpointIO with a real Lightning Trainer: stubs ModelCheckpoint can list, top-k removal that
frees blocks, hyper-parameters as plain data, and a SIGKILL mid-fit whose resume ends bit for bit
where Lightning's own CheckpointIO ends."""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from helpers import assert_state_equal, run_training_script
from hypothesis import given, settings
from hypothesis import strategies as st

pl = pytest.importorskip("pytorch_lightning")
torch = pytest.importorskip("torch")

import cas_ckpt  # noqa: E402
from cas_ckpt.errors import BlockNotFound, CasCkptError, CheckpointFileError, StateTypeError  # noqa: E402
from cas_ckpt.integrations._common import plain  # noqa: E402
from cas_ckpt.integrations.lightning import CasCheckpointIO, read_stub  # noqa: E402

SCRIPT = Path(__file__).parent / "scripts" / "train_lightning.py"
pytestmark = pytest.mark.filterwarnings(  # Lightning's own deprecation and tips
    "ignore::DeprecationWarning", "ignore::UserWarning", "ignore::FutureWarning",
    "ignore::pytest.PytestUnraisableExceptionWarning")


def run_script(work: Path, *args: str, pause_at: int | None = None) -> str:
    return run_training_script(SCRIPT, work, *args, pause_at=pause_at, timeout=180)


def final_weights(work: Path) -> bytes:
    return (work / "final.safetensors").read_bytes()


def kill_and_resume(work: Path, io: str) -> str:
    run_script(work, "--io", io, "--max-steps", "14", pause_at=8)
    return run_script(work, "--io", io, "--max-steps", "14", "--resume")


def test_sigkill_mid_fit_then_resume_matches_lightning_default_io_bit_for_bit(tmp_path: Path) -> None:
    for io in ("default", "cas"):
        (tmp_path / io).mkdir()
    with ThreadPoolExecutor(2) as pool:  # the two runs are independent processes
        runs = ("default", "cas")
        outputs = dict(zip(runs, pool.map(lambda io: kill_and_resume(tmp_path / io, io), runs), strict=True))
    assert final_weights(tmp_path / "cas") == final_weights(tmp_path / "default")
    # ModelCheckpoint kept the same files (save_top_k=2 plus last) and ranked them alike.
    files = {io: [line for line in out.splitlines() if line.startswith(("FILES", "BEST"))]
             for io, out in outputs.items()}
    assert files["cas"] == files["default"]
    assert "last.ckpt" in files["cas"][0]
    # Every file is a stub naming a checkpoint whose ref holds it; nothing else is kept.
    repo = cas_ckpt.open(tmp_path / "cas" / "repo")
    io_plugin = CasCheckpointIO(repo, ref="run")
    stubs = sorted((tmp_path / "cas" / "ckpts").iterdir())
    held = {str(read_stub(p)["cid"]) for p in stubs}
    assert {str(c) for name, c in repo.refs("run.files/").items()} == held
    assert {io_plugin.file_ref(p) for p in stubs} == set(repo.refs("run.files/"))
    # The killed run's last stub resumed at step 6 (every 3 steps); steps 9 and 12 were saved after.
    steps = [c.step for c in repo.log("run")]
    assert 6 in steps and 12 in steps
    # A checkpoint save_top_k removed is gone from the repository, blocks included (a "last.ckpt"
    # saved right after a top-k file of the same step holds the same state: its tree lives on).
    kept = {repo.tree(cid) for cid in held | {str(repo.resolve("run"))}}
    removed = [c for c in repo.log("run") if repo.tree(c.cid) not in kept]
    assert {c.step for c in removed} == {3, 6}
    for commit in removed:
        with pytest.raises(CasCkptError):
            repo.load(commit.cid)


@pytest.mark.slow
@pytest.mark.parametrize("io", ["cas", "async"])
def test_sigkill_at_any_moment_leaves_loadable_stubs_and_a_clean_repository(tmp_path: Path, io: str) -> None:
    """Kill at moments not chosen by the script (saves in flight, GC running): every stub left
    loads, fsck finds nothing wrong, and the run resumes from last.ckpt."""
    for attempt, delay in enumerate((0.0, 0.15, 0.3, 0.6)):
        work = tmp_path / str(attempt)
        work.mkdir()
        proc = subprocess.Popen([sys.executable, str(SCRIPT), str(work), "--io", io, "--max-steps", "400"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 120
            while not (work / "ckpts").is_dir() and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(delay)
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
        finally:
            proc.kill()
        repo = cas_ckpt.open(work / "repo")
        assert repo.fsck().ok
        plugin = CasCheckpointIO(repo, ref="run")
        for stub in (work / "ckpts").iterdir():
            if stub.suffix == ".tmp":
                continue  # a stub's temp file, killed before its rename: never a checkpoint
            assert "global_step" in plugin.load_checkpoint(stub), stub
        if (work / "ckpts" / "last.ckpt").exists():
            out = run_script(work, "--io", io, "--max-steps", "420", "--resume")
            assert "last.ckpt" in out


# -- in-process: a real Trainer, and the plugin's own calls ----------------------------------------
class Tiny(pl.LightningModule):
    def __init__(self, hidden: int = 4, extra: object = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(3, hidden), torch.nn.Dropout(0.1),
                                       torch.nn.Linear(hidden, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=0.01)
        return [opt], [torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.9 ** s)]


def loader() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(16, 3, generator=g), torch.randn(16, 1, generator=g))
    return torch.utils.data.DataLoader(data, batch_size=4)


def fit(tmp_path: Path, plugin: object, steps: int = 4, **checkpoint: object) -> pl.Trainer:
    pl.seed_everything(0, verbose=False)
    callback = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpts", **checkpoint)
    trainer = pl.Trainer(max_steps=steps, plugins=[plugin], callbacks=[callback], logger=False,
                         enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")
    trainer.fit(Tiny(extra=argparse.Namespace(depth=2, name="x")), loader())
    return trainer


def test_load_gives_back_what_lightning_saved(tmp_path: Path) -> None:
    plugin = CasCheckpointIO(tmp_path / "repo", ref="run")
    trainer = fit(tmp_path, plugin)
    checkpoint = trainer._checkpoint_connector.dump_checkpoint()
    plugin.save_checkpoint(checkpoint, tmp_path / "x.ckpt")
    loaded = plugin.load_checkpoint(tmp_path / "x.ckpt")
    expected = plain(checkpoint)
    assert list(loaded) == list(expected)
    assert loaded["hyper_parameters"] == {"hidden": 4, "extra": {"depth": 2, "name": "x"}}
    for key, value in expected["state_dict"].items():
        got = loaded["state_dict"][key]
        assert torch.equal(got, value) and got.dtype == value.dtype
    assert loaded["optimizer_states"][0]["param_groups"] == expected["optimizer_states"][0]["param_groups"]
    assert loaded["loops"] == expected["loops"]
    assert loaded["lr_schedulers"] == expected["lr_schedulers"]
    # A fresh Trainer resumes from it: optimizer, scheduler and loop counters come back.
    resumed = pl.Trainer(max_steps=6, plugins=[CasCheckpointIO(tmp_path / "repo", ref="run")], logger=False,
                         enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
                         enable_checkpointing=False)
    resumed.fit(Tiny(), loader(), ckpt_path=str(tmp_path / "x.ckpt"))
    assert resumed.global_step == 6


def test_save_last_link_and_top_k_removal_free_blocks(tmp_path: Path) -> None:
    plugin = CasCheckpointIO(tmp_path / "repo", ref="run")
    trainer = fit(tmp_path, plugin, steps=6, every_n_train_steps=2, save_top_k=1, monitor="step",
                  mode="max", save_last="link")
    last = tmp_path / "ckpts" / "last.ckpt"
    assert last.is_symlink()
    assert plugin.load_checkpoint(last)["global_step"] == 6
    names = sorted(p.name for p in (tmp_path / "ckpts").iterdir())
    assert names == ["epoch=1-step=6.ckpt", "last.ckpt"]
    repo = plugin.repo
    assert len(repo.refs("run.files/")) == 1
    for commit in repo.log("run"):
        if commit.step != 6:  # steps 2 and 4 were removed by save_top_k=1, and GC freed them
            with pytest.raises(CasCkptError):
                repo.load(commit.cid)
    # Removing the link leaves the checkpoint; removing the stub frees it.
    plugin.remove_checkpoint(last)
    assert not last.exists() and plugin.load_checkpoint(tmp_path / "ckpts" / "epoch=1-step=6.ckpt")
    cid = read_stub(tmp_path / "ckpts" / "epoch=1-step=6.ckpt")["cid"]
    plugin.remove_checkpoint(tmp_path / "ckpts" / "epoch=1-step=6.ckpt")
    assert repo.refs("run.files/") == {}
    assert trainer.global_step == 6 and repo.resolve("run") == cid  # the run's head still holds it


def test_overwriting_a_path_moves_its_ref_and_gc_frees_the_old_one(tmp_path: Path) -> None:
    plugin = CasCheckpointIO(tmp_path / "repo", ref="run")
    path = tmp_path / "ck" / "a.ckpt"
    plugin.save_checkpoint({"w": torch.arange(1000.0), "global_step": 1}, path)
    old = read_stub(path)["cid"]
    plugin.save_checkpoint({"w": torch.arange(1000.0) + 1, "global_step": 2}, path)
    plugin.save_checkpoint({"w": torch.zeros(3), "global_step": 3}, tmp_path / "ck" / "b.ckpt")
    plugin.repo.gc(expire_reflogs=("run", plugin.files_prefix))
    with pytest.raises(CasCkptError):
        plugin.repo.load(old)
    assert torch.equal(plugin.load_checkpoint(path)["w"], torch.arange(1000.0) + 1)


def test_hyper_parameters_that_need_pickle_name_their_key(tmp_path: Path) -> None:
    plugin = CasCheckpointIO(tmp_path / "repo", ref="run")
    with pytest.raises(StateTypeError, match=r"hyper_parameters\.act") as info:
        plugin.save_checkpoint({"hyper_parameters": pl.utilities.parsing.AttributeDict(act=torch.nn.ReLU)},
                               tmp_path / "x.ckpt")
    assert info.value.path == "hyper_parameters.act"
    assert not (tmp_path / "x.ckpt").exists() and plugin.repo.refs() == {}
    with pytest.raises(StateTypeError, match=r"callbacks\.cb\.fn"):
        plugin.save_checkpoint({"callbacks": {"cb": {"fn": lambda: 0}}}, tmp_path / "x.ckpt")


def test_files_that_are_not_stubs(tmp_path: Path) -> None:
    plugin = CasCheckpointIO(tmp_path / "repo", ref="run")
    torch.save({"a": 1}, tmp_path / "torch.ckpt")
    with pytest.raises(CheckpointFileError, match=r"torch\.ckpt.*not a cas_ckpt checkpoint stub.*torch"):
        plugin.load_checkpoint(tmp_path / "torch.ckpt")
    with pytest.raises(CheckpointFileError, match="no such checkpoint file"):
        plugin.load_checkpoint(tmp_path / "missing.ckpt")
    (tmp_path / "bad.ckpt").write_text(json.dumps({"format": "cas_ckpt/lightning-checkpoint", "version": 1,
                                                   "cid": "nope", "ref": "r"}))
    with pytest.raises(CheckpointFileError, match="no valid CID"):
        plugin.load_checkpoint(tmp_path / "bad.ckpt")
    plugin.remove_checkpoint(tmp_path / "torch.ckpt")  # removed as the default CheckpointIO would
    assert not (tmp_path / "torch.ckpt").exists()
    with pytest.raises(TypeError, match="storage_options"):
        plugin.save_checkpoint({}, tmp_path / "y.ckpt", storage_options={"x": 1})
    with pytest.raises(CheckpointFileError, match="local paths"):
        plugin.save_checkpoint({}, "s3://bucket/y.ckpt")


def test_a_stub_whose_blocks_are_gone_fails_clearly(tmp_path: Path) -> None:
    plugin = CasCheckpointIO(tmp_path / "repo", ref="run")
    plugin.save_checkpoint({"w": torch.ones(10), "global_step": 1}, tmp_path / "a.ckpt")
    (tmp_path / "copy.ckpt").write_bytes((tmp_path / "a.ckpt").read_bytes())
    plugin.save_checkpoint({"w": torch.zeros(10), "global_step": 2}, tmp_path / "b.ckpt")
    plugin.remove_checkpoint(tmp_path / "a.ckpt")  # the copy is only a reference, as documented
    with pytest.raises((BlockNotFound, CasCkptError)):
        plugin.load_checkpoint(tmp_path / "copy.ckpt")


def test_teardown_closes_and_the_plugin_reopens(tmp_path: Path) -> None:
    plugin = CasCheckpointIO(str(tmp_path / "repo"), ref="run", async_save=True)
    plugin.save_checkpoint({"w": torch.ones(4), "global_step": 3}, tmp_path / "a.ckpt")
    plugin.teardown()
    assert plugin.load_checkpoint(tmp_path / "a.ckpt")["global_step"] == 3


@pytest.mark.parametrize("mode", ["async_save", "AsyncCheckpointIO"])
def test_async_saves_store_what_sync_saves_store(tmp_path: Path, mode: str) -> None:
    checkpoint = {"every_n_train_steps": 2, "save_top_k": 2, "monitor": "step", "mode": "max",
                  "save_last": True}
    fit(tmp_path / "sync", CasCheckpointIO(tmp_path / "sync" / "repo", ref="run"), steps=8, **checkpoint)
    plugin = CasCheckpointIO(tmp_path / "async" / "repo", ref="run", async_save=mode == "async_save")
    outer = plugin if mode == "async_save" else pl.plugins.io.AsyncCheckpointIO(plugin)
    fit(tmp_path / "async", outer, steps=8, **checkpoint)
    stubs = sorted((tmp_path / "async" / "ckpts").iterdir())
    held = {str(c) for c in plugin.repo.refs("run.files/").values()}
    assert {str(read_stub(p)["cid"]) for p in stubs} == held
    last = plugin.load_checkpoint(tmp_path / "async" / "ckpts" / "last.ckpt")
    assert last["global_step"] == 8
    sync = CasCheckpointIO(tmp_path / "sync" / "repo", ref="run")
    expected = sync.load_checkpoint(tmp_path / "sync" / "ckpts" / "last.ckpt")
    for key, value in expected["state_dict"].items():
        assert torch.equal(last["state_dict"][key], value)
    if mode == "async_save":  # removals queue behind saves: save_top_k keeps exactly what sync keeps
        assert [p.name for p in stubs] == sorted(p.name for p in (tmp_path / "sync" / "ckpts").iterdir())


def test_lightning_package_trainer_accepts_the_plugin(tmp_path: Path) -> None:
    lpl = pytest.importorskip("lightning.pytorch")
    plugin = CasCheckpointIO(tmp_path / "repo", ref="run")
    assert isinstance(plugin, lpl.plugins.io.CheckpointIO)
    callback = lpl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpts", every_n_train_steps=2,
                                             save_last=True)
    trainer = lpl.Trainer(max_steps=4, plugins=[plugin], callbacks=[callback], logger=False,
                          enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")

    class Tiny2(lpl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(3, 1)

        def training_step(self, batch, batch_idx):
            return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=0.01)

    trainer.fit(Tiny2(), loader())
    assert sorted(p.name for p in (tmp_path / "ckpts").iterdir()) == ["epoch=0-step=4.ckpt", "last.ckpt"]
    assert read_stub(tmp_path / "ckpts" / "last.ckpt")["ref"].startswith("run.files/")
    assert plugin.load_checkpoint(tmp_path / "ckpts" / "last.ckpt")["global_step"] == 4


def test_importing_cas_ckpt_imports_no_trainer_framework() -> None:
    code = ("import sys, cas_ckpt, cas_ckpt.integrations; "
            "print(sorted(m for m in ('pytorch_lightning', 'lightning', 'lightning_fabric', 'transformers', "
            "'accelerate') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# -- plain data ----------------------------------------------------------------------------------
leaves = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False),
                   st.text(max_size=8), st.binary(max_size=8))
keys = st.one_of(st.text(max_size=6), st.integers(-5, 5))
trees = st.recursive(leaves, lambda kids: st.one_of(
    st.lists(kids, max_size=3), st.lists(kids, max_size=3).map(tuple),
    st.dictionaries(keys, kids, max_size=3),
    st.dictionaries(st.text(max_size=6), kids, max_size=3).map(pl.utilities.parsing.AttributeDict),
    st.dictionaries(keys, kids, max_size=3).map(collections.OrderedDict),
    st.dictionaries(st.from_regex(r"[a-z]{1,5}", fullmatch=True), kids, max_size=3).map(
        lambda d: argparse.Namespace(**d)),
), max_leaves=12)


def as_expected(value: object) -> object:
    if isinstance(value, argparse.Namespace):
        value = vars(value)
    if isinstance(value, dict):
        return {k: as_expected(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [as_expected(v) for v in value]
        return items if isinstance(value, list) else tuple(items)
    return value


@settings(max_examples=60, deadline=None)
@given(trees)
def test_plain_data_round_trips_through_a_stub(tmp_path_factory: pytest.TempPathFactory,
                                               tree: object) -> None:
    tmp = tmp_path_factory.mktemp("rt")
    plugin = CasCheckpointIO(cas_ckpt.open("memory://"), ref="run")
    plugin.save_checkpoint({"hyper_parameters": tree, "size": torch.Size([2, 3])}, tmp / "x.ckpt")
    loaded = plugin.load_checkpoint(tmp / "x.ckpt")
    assert_state_equal({"hyper_parameters": as_expected(tree), "size": (2, 3)}, loaded)
    assert os.path.getsize(tmp / "x.ckpt") < 1024


def test_integrations_doc_examples_run() -> None:
    import doctest

    doc = Path(__file__).parent.parent / "docs" / "integrations.md"
    result = doctest.testfile(str(doc), module_relative=False, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 5 and result.failed == 0


def test_plain_converts_enums_paths_and_scalar_subclasses_and_names_what_it_refuses() -> None:
    import enum

    class Mode(enum.Enum):
        FAST = "fast"

    class Level(enum.IntEnum):
        HIGH = 3

    out = plain({"mode": Mode.FAST, "level": Level.HIGH, "dir": Path("/a/b"), "flag": True, 1: [None]})
    assert_state_equal({"mode": "fast", "level": 3, "dir": "/a/b", "flag": True, 1: [None]}, out)
    with pytest.raises(StateTypeError, match=r"^opt\.dtype: a torch\.dtype can only be stored with pickle"):
        plain({"opt": {"dtype": torch.float16}})
    with pytest.raises(StateTypeError, match=r"^a\.\(1, 2\): dict keys must be str or int, not tuple"):
        plain({"a": {(1, 2): 0}})
