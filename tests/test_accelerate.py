"""AcceleratorCheckpointer on a real (CPU) Accelerator: a run restored from the repository into
fresh objects ends bit for bit where the uninterrupted run ends, as accelerate's own
save_state/load_state folder does."""

from __future__ import annotations

import pytest

accelerate = pytest.importorskip("accelerate")
torch = pytest.importorskip("torch")

from accelerate.utils import DataLoaderConfiguration, set_seed  # noqa: E402

import cas_ckpt  # noqa: E402
from cas_ckpt.integrations.accelerate import AcceleratorCheckpointer, accelerator_state  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning",
                                        "ignore::FutureWarning")
STEPS_PER_EPOCH = 4


class Counter:
    """A registered object: accelerate checkpoints it through state_dict()/load_state_dict()."""

    def __init__(self) -> None:
        self.seen = 0
        self.history: list[float] = []

    def state_dict(self) -> dict:
        return {"seen": self.seen, "history": list(self.history)}

    def load_state_dict(self, state: dict) -> None:
        self.seen, self.history = state["seen"], list(state["history"])


def build(seed: int, seedable: bool, frozen: int = 0) -> tuple:
    """A fresh Accelerator with everything prepared: model (dropout), AdamW, StepLR, a shuffling
    loader, a registered Counter. ``seed`` (the global RNGs) differs between runs: restoring must
    not depend on it."""
    set_seed(seed)
    acc = accelerate.Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(
        use_seedable_sampler=seedable, data_seed=0))  # the run's configuration: the same on resume
    model = torch.nn.Sequential(torch.nn.Linear(6, frozen or 16), torch.nn.ReLU(), torch.nn.Dropout(0.3),
                                torch.nn.Linear(frozen or 16, 1))
    if frozen:
        model[0].requires_grad_(False)
    g = torch.Generator().manual_seed(5)
    data = torch.utils.data.TensorDataset(torch.randn(32, 6, generator=g), torch.randn(32, 1, generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=True)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, 3, 0.5)
    counter = Counter()
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    acc.register_for_checkpointing(counter)
    return acc, model, opt, loader, sched, counter


def train_epoch(acc, model, opt, loader, sched, counter, epoch: int) -> None:
    model.train()  # no set_epoch(): a seedable sampler counts its epochs, and that count is restored
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(model(x), y)
        acc.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        counter.seen += 1
        counter.history.append(float(loss))


@pytest.mark.parametrize("seedable", [False, True], ids=["torch-sampler", "seedable-sampler"])
def test_restored_run_ends_bit_for_bit_where_the_uninterrupted_run_ends(tmp_path, seedable: bool) -> None:
    parts = build(0, seedable)
    checkpointer = AcceleratorCheckpointer(tmp_path / "repo", ref="run", keep_last=2)
    train_epoch(*parts, epoch=0)
    checkpointer.save_state(parts[0], STEPS_PER_EPOCH)
    parts[0].save_state(str(tmp_path / "accelerate-folder"))  # accelerate's own, for comparison
    for epoch in (1, 2):
        train_epoch(*parts, epoch=epoch)
    expected = {k: v.clone() for k, v in parts[1].state_dict().items()}
    checkpointer.close()

    # accelerate's folder lacks the epoch a seedable sampler's loader counts (no set_epoch here).
    for restore in ("cas_ckpt",) if seedable else ("cas_ckpt", "accelerate"):
        again = build(99, seedable)  # another seed: everything must come from the checkpoint
        if restore == "cas_ckpt":
            with AcceleratorCheckpointer(tmp_path / "repo", ref="run") as resumed:
                assert resumed.load_state(again[0]) == STEPS_PER_EPOCH
        else:
            again[0].load_state(str(tmp_path / "accelerate-folder"))
        assert again[5].seen == STEPS_PER_EPOCH and again[4].scheduler.last_epoch == STEPS_PER_EPOCH
        for epoch in (1, 2):
            train_epoch(*again, epoch=epoch)
        got = again[1].state_dict()
        for name, tensor in expected.items():
            assert torch.equal(got[name], tensor), (restore, name)
        assert again[5].seen == 3 * STEPS_PER_EPOCH


def test_state_holds_what_save_state_gathers_as_plain_data(tmp_path) -> None:
    acc, model, opt, loader, sched, counter = build(0, seedable=True)
    train_epoch(acc, model, opt, loader, sched, counter, epoch=0)
    state = accelerator_state(acc)
    assert list(state) == ["format", "models", "optimizers", "schedulers", "dataloaders", "scaler", "rng",
                           "step", "custom"]
    assert state["dataloaders"] == [{"iteration": 1, "sampler": {"epoch": 1, "initial_seed": 0}}]
    assert state["custom"][0]["seen"] == STEPS_PER_EPOCH
    repo = cas_ckpt.open(tmp_path / "repo")
    repo.save(state, ref="x")  # saves as it is: nothing needs pickle
    lr = opt.state_dict()["param_groups"][0]["lr"]
    assert repo.load("x")["optimizers"][0]["param_groups"][0]["lr"] == lr


def test_retention_and_dedup_of_frozen_layers(tmp_path) -> None:
    parts = build(0, seedable=False, frozen=2048)  # 48 KiB frozen: a block of its own
    with AcceleratorCheckpointer(tmp_path / "repo", ref="run", keep_last=2) as checkpointer:
        for epoch in range(3):
            train_epoch(*parts, epoch=epoch)
            checkpointer.save_state(parts[0], (epoch + 1) * STEPS_PER_EPOCH, metrics={"epoch": epoch})
        assert checkpointer.manager.steps() == [8, 12]
        report = checkpointer.manager.last_report
        assert report.bytes_reused >= 6 * 2048 * 4  # the frozen weight (its 8 KiB bias is inlined)


def test_a_different_set_of_prepared_objects_is_refused(tmp_path) -> None:
    parts = build(0, seedable=False)
    with AcceleratorCheckpointer(tmp_path / "repo", ref="run") as checkpointer:
        checkpointer.save_state(parts[0], 1)
        other = accelerate.Accelerator(cpu=True)
        other.prepare(torch.nn.Linear(6, 1))
        with pytest.raises(ValueError, match="holds 1 optimizers, and 0 are prepared"):
            checkpointer.load_state(other)
    with AcceleratorCheckpointer(tmp_path / "fresh", ref="run") as checkpointer:
        assert checkpointer.load_state(parts[0]) is None
