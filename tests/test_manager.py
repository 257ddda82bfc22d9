"""CheckpointManager: skipping, duplicate steps, retention that frees space, async saves, forks."""

from __future__ import annotations

import importlib.util
import math
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import assert_state_equal
from hypothesis import example, given
from strategies import colliding_states

import cas_ckpt
from cas_ckpt import CheckpointManager
from cas_ckpt.errors import UnknownMetric
from cas_ckpt.manager import snapshot

MIB = 1024 * 1024


def state_for(step: int, size: int = MIB) -> dict[str, object]:
    """A state whose array bytes are unique to ``step`` (no dedup between steps)."""
    rng = np.random.default_rng(step)
    return {"step": step, "w": rng.integers(0, 255, size, dtype=np.uint8), "tag": f"s{step}"}


def stored_bytes(repo: cas_ckpt.Repository) -> int:
    return sum(repo.blocks.size(c) for c in repo.blocks.keys())  # noqa: SIM118 - a store


def open_descriptors() -> int:
    return len(list(Path("/proc/self/fd").iterdir()))


# -- opening ------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", [str, Path])
def test_a_location_is_opened_by_the_manager_and_closed_by_close(tmp_path: Path, kind: type) -> None:
    location = kind(tmp_path / "checkpoints")
    before = open_descriptors()
    with CheckpointManager(location, "run", keep_last=1) as mgr:  # created if missing
        mgr.save(1, state_for(1))
        mgr.save(2, state_for(2))
        assert mgr.restore()["tag"] == "s2" and mgr.steps() == [2]
        assert mgr.repo.location == str(tmp_path / "checkpoints")
    assert open_descriptors() == before  # its packs closed with it
    with cas_ckpt.open(tmp_path / "checkpoints") as repo:
        assert repo.commit("run").step == 2
        mgr = CheckpointManager(repo, "run")  # an open Repository stays its caller's
        mgr.close()
        assert repo.load("run")["tag"] == "s2"


def test_a_manager_that_fails_to_start_closes_the_repository_it_opened(tmp_path: Path) -> None:
    with cas_ckpt.open(tmp_path / "checkpoints") as repo, CheckpointManager(repo, "run") as holder:
        holder.save(1, state_for(1))
        repo.load("run")
        before = open_descriptors()
        with pytest.raises(cas_ckpt.errors.LeaseHeld):
            CheckpointManager(tmp_path / "checkpoints", "run")
        assert open_descriptors() == before
    with pytest.raises(TypeError, match="a location"):
        CheckpointManager(42, "run")  # type: ignore[arg-type]


# -- save, skip, duplicates --------------------------------------------------------------------
def test_save_every_skips_unless_forced(repo: cas_ckpt.Repository) -> None:
    mgr = CheckpointManager(repo, "run", save_every=5)
    results = {step: mgr.save(step, {"step": step}) for step in range(1, 11)}
    assert [s for s, cid in results.items() if cid is not None] == [5, 10]
    assert isinstance(results[10], cas_ckpt.CID)
    assert mgr.save(13, {"step": 13}, force=True) is not None
    assert mgr.steps() == [5, 10, 13]
    assert mgr.latest_step() == 13
    assert repo.load("run") == {"step": 13}
    assert repo.commit(mgr.step_ref(10)).metadata == {"step": 10, "metrics": {}}


def test_same_step_twice_is_an_error_unless_overwrite(repo: cas_ckpt.Repository) -> None:
    mgr = CheckpointManager(repo, "run")
    first = mgr.save(3, {"v": 1})
    with pytest.raises(cas_ckpt.errors.CheckpointExists, match="step 3") as info:
        mgr.save(3, {"v": 2})
    assert info.value.step == 3 and repo.resolve("run") == first
    with pytest.raises(cas_ckpt.errors.CheckpointExists, match="not after"):
        mgr.save(2, {"v": 0})
    second = mgr.save(3, {"v": 2}, overwrite=True)
    assert second != first and mgr.restore(3) == {"v": 2} and mgr.steps() == [3]
    assert [c.cid for c in repo.log("run")] == [second, first]  # history keeps the replaced one


def test_state_lives_in_the_repository_not_the_manager(tmp_path: Path) -> None:
    with cas_ckpt.open(tmp_path / "repo") as repo:
        mgr = CheckpointManager(repo, "runs/a", keep_best=1, best_metric="loss")
        for step, loss in [(1, 0.5), (2, 0.2), (3, 0.9)]:
            mgr.save(step, {"step": step}, metrics={"loss": np.float32(loss)})
        mgr.close()  # a manager holds its run until closed (or its process ends)
    with cas_ckpt.open(tmp_path / "repo") as repo:
        again = CheckpointManager(repo, "runs/a", keep_best=1, best_metric="loss")
        assert again.steps() == [2, 3] and again.latest_step() == 3
        assert again.metrics(2) == {"loss": pytest.approx(0.2)}
        assert again.restore() == {"step": 3}
        with pytest.raises(cas_ckpt.errors.CheckpointExists):
            again.save(3, {"step": 3})
        again.save(4, {"step": 4}, metrics={"loss": 0.1})
        assert again.steps() == [4]  # 4 is both the best and the latest


def test_restore_errors_and_paths(repo: cas_ckpt.Repository) -> None:
    repo.save({"x": 1}, ref="other")
    mgr = CheckpointManager(repo, "run", keep_last=1)
    with pytest.raises(cas_ckpt.errors.StepNotFound, match=r"'run' has no checkpoints") as info:
        mgr.restore()
    assert info.value.refs == ["other"] and "the refs there are ['other']" in str(info.value)
    assert f"repository {repo.location or repo}" in str(info.value)
    assert mgr.latest_step() is None and mgr.steps() == []
    mgr.save(1, {"model": {"w": np.arange(3)}, "opt": {0: {"m": 1.5}}})
    mgr.save(2, {"model": {"w": np.arange(3) + 1}, "opt": {0: {"m": 2.5}}})
    assert mgr.restore(path="model.w").tolist() == [1, 2, 3]
    assert mgr.restore(2, path="opt.0.m") == 2.5
    with pytest.raises(cas_ckpt.errors.CheckpointExpired):
        mgr.restore(1)
    with pytest.raises(cas_ckpt.errors.StepNotFound):
        mgr.restore(7)
    with pytest.raises(ValueError):
        mgr.save(-1, {})


def test_bad_options_and_metrics(repo: cas_ckpt.Repository) -> None:
    for kwargs in ({"keep_last": 0}, {"save_every": 1.5}, {"keep_best": 2}, {"best_mode": "low"}):
        with pytest.raises(ValueError):
            CheckpointManager(repo, "run", **kwargs)  # type: ignore[arg-type]
    mgr = CheckpointManager(repo, "run")
    with pytest.raises(cas_ckpt.errors.StateTypeError, match=r"metrics\.name"):
        mgr.save(1, {}, metrics={"name": "abc"})
    assert mgr.steps() == []


def assert_metrics_refused(mgr: CheckpointManager, values: list[object]) -> None:
    for value in values:
        with pytest.raises(cas_ckpt.errors.StateTypeError, match=r"metrics\.val/loss: .*one number"):
            mgr.save(1, {}, metrics={"val/loss": value})
    assert mgr.steps() == []


def test_metrics_must_be_single_numbers(repo: cas_ckpt.Repository) -> None:
    mgr = CheckpointManager(repo, "run")
    assert_metrics_refused(mgr, [np.array([0.5, 0.25]), np.zeros((2, 2)), np.array([], "f4")])
    mgr.save(1, {}, metrics={"a": np.array([0.5]), "b": np.array(2), "c": np.float16(0.25)})
    assert mgr.metrics(1) == {"a": 0.5, "b": 2, "c": 0.25}


def test_vector_tensor_metrics_are_refused_naming_the_metric(repo: cas_ckpt.Repository) -> None:
    torch = pytest.importorskip("torch")
    mgr = CheckpointManager(repo, "run")
    meta = torch.tensor(1.0, device="meta")  # one element, but no value to read
    assert_metrics_refused(mgr, [torch.tensor([0.5, 0.25]), torch.zeros(0), meta])
    with pytest.raises(cas_ckpt.errors.StateTypeError, match=r"metadata\.loss"):
        repo.save({}, metadata={"loss": meta})
    mgr.save(1, {}, metrics={"t": torch.tensor([[1.5]], requires_grad=True), "i": torch.tensor(3)})
    assert mgr.metrics(1) == {"t": 1.5, "i": 3}


# -- retention ---------------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["memory", "local"])
def test_keep_last_frees_space_and_keeps_history(where: str, tmp_path: Path) -> None:
    repo = cas_ckpt.open("memory://" if where == "memory" else tmp_path / "repo")
    mgr = CheckpointManager(repo, "run", keep_last=2)
    cids = [mgr.save(step, state_for(step)) for step in range(1, 7)]
    assert mgr.steps() == [5, 6]
    assert 2 * MIB <= stored_bytes(repo) < 2.2 * MIB  # only two checkpoints' chunks remain
    assert [c.step for c in repo.log("run")] == [6, 5, 4, 3, 2, 1]
    with pytest.raises(cas_ckpt.errors.CheckpointExpired):
        repo.load(cids[0])
    with pytest.raises(cas_ckpt.errors.CheckpointExpired):
        mgr.restore(3)
    assert mgr.restore(5)["tag"] == "s5"
    assert repo.fsck().ok
    repo.close()


def test_keep_every_and_keep_last_combine(repo: cas_ckpt.Repository) -> None:
    mgr = CheckpointManager(repo, "run", keep_last=2, keep_every=4)
    for step in range(1, 11):
        mgr.save(step, {"step": step})
    assert mgr.steps() == [4, 8, 9, 10]


@pytest.mark.parametrize(("mode", "best"), [("min", [2, 5]), ("max", [1, 4])])
def test_keep_best_ranks_by_metric_and_keeps_the_latest(
    repo: cas_ckpt.Repository, mode: str, best: list[int]
) -> None:
    mgr = CheckpointManager(repo, "run", keep_best=2, best_metric="loss", best_mode=mode)
    losses = {1: 0.9, 2: 0.1, 3: math.nan, 4: 0.8, 5: 0.2, 6: None, 7: 0.5}
    for step, loss in losses.items():
        metrics = {} if loss is None else {"loss": loss}
        mgr.save(step, {"step": step}, metrics=metrics)
    # NaN and missing metrics never rank; 7 stays as the latest
    assert mgr.steps() == sorted({*best, 7})


@pytest.mark.parametrize("async_save", [False, True])
def test_keep_best_on_a_metric_no_save_reported_raises_before_anything_expires(
    repo: cas_ckpt.Repository, async_save: bool
) -> None:
    plain = CheckpointManager(repo, "run")
    for step, loss in [(1, 0.3), (2, 0.1), (3, 0.2)]:
        plain.save(step, {"step": step}, metrics={"val/loss": loss, "lr": 0.1})
    plain.close()
    # "val_loss" is misspelt: ranking nothing, keep_best=1 would expire steps 1 and 2, the best.
    mgr = CheckpointManager(repo, "run", keep_best=1, best_metric="val_loss", async_save=async_save)
    with pytest.raises(UnknownMetric, match=r"'val_loss'.*\['lr', 'val/loss'\]") as info:
        mgr.save(4, {"step": 4}, metrics={"val/loss": 0.05, "lr": 0.1})
    assert isinstance(info.value, ValueError) and info.value.metric == "val_loss"
    assert info.value.reported == ["lr", "val/loss"]
    assert mgr.steps() == [1, 2, 3] and mgr.latest_step() == 3  # nothing saved, nothing expired
    fresh = CheckpointManager(repo, "fresh", keep_best=1, best_metric="val_loss")
    with pytest.raises(UnknownMetric, match=r"no metrics were reported"):
        fresh.save(1, {"step": 1})
    assert fresh.steps() == []


def test_keep_best_allows_saves_without_the_metric_once_one_reported_it(
    repo: cas_ckpt.Repository,
) -> None:
    mgr = CheckpointManager(repo, "run", keep_best=1, best_metric="val_loss")
    mgr.save(1, {"step": 1}, metrics={"val_loss": 0.5})
    mgr.save(2, {"step": 2}, metrics={"train_loss": 0.4})  # no evaluation at this step: never ranks
    mgr.save(3, {"step": 3})
    assert mgr.steps() == [1, 3]
    mgr.close()
    again = CheckpointManager(repo, "run", keep_best=1, best_metric="val_loss")  # a new process
    again.save(4, {"step": 4}, metrics={"train_loss": 0.3})
    assert again.steps() == [1, 4]


def test_expired_blocks_stay_until_gc_when_gc_after_retention_is_off(
    repo: cas_ckpt.Repository,
) -> None:
    mgr = CheckpointManager(repo, "run", keep_last=1, gc_after_retention=False)
    for step in (1, 2, 3):
        mgr.save(step, state_for(step))
    assert mgr.steps() == [3]
    assert stored_bytes(repo) >= 3 * MIB
    with pytest.raises(cas_ckpt.errors.CheckpointExpired, match="retention expired"):
        mgr.restore(1)
    repo.gc()  # a plain GC keeps what run's reflog named in the last 30 days
    assert stored_bytes(repo) >= 3 * MIB
    report = repo.gc(expire_reflogs=["run", "run.steps/"])  # what the manager's own GC does
    assert report.bytes_freed >= 2 * MIB and stored_bytes(repo) < 1.2 * MIB


def test_retention_keeps_other_runs_data(repo: cas_ckpt.Repository) -> None:
    a = CheckpointManager(repo, "runs/a", keep_last=1)
    b = CheckpointManager(repo, "runs/b", keep_last=1)
    b.save(1, state_for(100))
    for step in range(1, 4):
        a.save(step, state_for(step))
    assert b.restore()["tag"] == "s100" and a.restore()["tag"] == "s3"
    assert 2 * MIB <= stored_bytes(repo) < 2.2 * MIB


def test_a_crash_between_head_and_step_ref_is_repaired(repo: cas_ckpt.Repository) -> None:
    with CheckpointManager(repo, "run") as first:
        first.save(1, {"v": 1})
    repo.save({"v": 7}, ref="run", step=7)  # the head moved; the step ref was never written
    mgr = CheckpointManager(repo, "run", keep_last=1)
    assert mgr.steps() == [1, 7] and mgr.latest_step() == 7
    mgr.save(8, {"v": 8})
    assert mgr.steps() == [8]


# -- async -------------------------------------------------------------------------------------
def test_async_save_snapshots_before_returning(repo: cas_ckpt.Repository) -> None:
    torch = pytest.importorskip("torch")
    mgr = CheckpointManager(repo, "run", async_save=True)
    weights = torch.arange(1 << 20, dtype=torch.float32)
    moments = np.arange(1 << 18, dtype=np.float64)
    state = {"w": weights, "view": weights[::2], "m": moments, "scalars": [1, 2.5, "x"]}
    with repo.refs_store.lock(exclusive=True):  # the background write cannot start yet
        assert mgr.save(1, state) is None
        weights.add_(1.0)  # the optimizer keeps updating in place
        moments *= -1
        assert "run" not in repo.refs()  # not durable yet
    cid = mgr.wait()
    assert cid == repo.resolve("run") and mgr.steps() == [1]
    out = mgr.restore()
    assert torch.equal(out["w"], torch.arange(1 << 20, dtype=torch.float32))
    assert torch.equal(out["view"], torch.arange(0, 1 << 20, 2, dtype=torch.float32))
    assert np.array_equal(out["m"], np.arange(1 << 18, dtype=np.float64))
    assert out["scalars"] == [1, 2.5, "x"]
    assert mgr.last_report is not None and mgr.last_report.cid == cid


def test_async_saves_run_one_at_a_time_and_close_waits(repo: cas_ckpt.Repository) -> None:
    with CheckpointManager(repo, "run", async_save=True, keep_last=2) as mgr:
        for step in range(1, 5):
            assert mgr.save(step, state_for(step, 256 * 1024)) is None
            assert mgr.steps()[-1] == step  # a query waits for the save in flight
    assert mgr.steps() == [3, 4]
    with pytest.raises(cas_ckpt.errors.RepositoryError, match="closed"):
        mgr.save(9, {})


def test_async_failure_is_raised_by_the_next_call_and_the_ref_does_not_move(
    tmp_path: Path,
) -> None:
    repo = cas_ckpt.open(tmp_path / "repo")
    mgr = CheckpointManager(repo, "run", async_save=True)
    mgr.save(1, state_for(1))
    first = mgr.wait()
    tmp_dir = repo.blocks.tmp_dir
    shutil.rmtree(tmp_dir)
    tmp_dir.write_bytes(b"")  # the store can no longer create pack files: a real I/O failure
    mgr.save(2, state_for(2))
    with pytest.raises(cas_ckpt.errors.SaveFailed, match="step 2") as info:
        mgr.save(3, state_for(3))
    assert isinstance(info.value.__cause__, OSError)
    assert repo.resolve("run") == first and mgr.steps() == [1]
    tmp_dir.unlink()
    tmp_dir.mkdir()
    mgr.save(2, state_for(2))
    assert mgr.wait() == repo.resolve("run") and mgr.steps() == [1, 2]
    repo.close()


def test_async_failure_inside_the_writer_surfaces_on_wait(repo: cas_ckpt.Repository) -> None:
    other = cas_ckpt.open("memory://")
    foreign = other.save({"x": 1}, ref="x")  # a CID whose block is not in ``repo``
    mgr = CheckpointManager(repo, "run", async_save=True)
    mgr.save(1, {"link": foreign})
    with pytest.raises(cas_ckpt.errors.SaveFailed) as info:
        mgr.wait()
    assert isinstance(info.value.__cause__, cas_ckpt.errors.StateTypeError)
    assert "run" not in repo.refs()
    assert mgr.wait() is None  # the failure is reported once


def test_async_save_refuses_bad_values_synchronously(repo: cas_ckpt.Repository) -> None:
    mgr = CheckpointManager(repo, "run", async_save=True)
    with pytest.raises(cas_ckpt.errors.StateTypeError, match=r"a\.b"):
        mgr.save(1, {"a": {"b": object()}})
    with pytest.raises(cas_ckpt.errors.StateTypeError, match="dict keys"):
        mgr.save(1, {"a": {1.5: 1}})
    with pytest.raises(cas_ckpt.errors.StateTypeError, match="dtype"):
        mgr.save(1, {"a": np.array([object()])})
    mgr.close()


def test_snapshot_copies_arrays_once_and_shares_immutables() -> None:
    a = np.arange(4)
    blob = b"x" * 100
    out = snapshot({"a": a, "tied": a, "t": (a, blob), "s": np.float32(2)})
    assert out["a"] is out["tied"] and out["a"] is not a and out["t"][1] is blob
    assert isinstance(out["t"], tuple)
    a[:] = 9
    assert out["a"].tolist() == [0, 1, 2, 3]


def test_snapshot_buffers_are_refilled_in_place_only_when_safe() -> None:
    buffers: dict[str, object] = {}
    a = np.arange(4.0)
    first = snapshot({"a": a, "b": a, "c": np.zeros(2)}, buffers)
    assert set(buffers) == {(("d", "a"),), (("d", "c"),)}  # "b" is the same object as "a": one copy
    a += 1
    second = snapshot({"a": a, "b": np.full(4, 7.0), "c": np.zeros(3)}, buffers)
    assert second["a"] is first["a"] and second["a"].tolist() == [1.0, 2.0, 3.0, 4.0]
    assert second["b"] is not second["a"]  # untied now: "b" gets its own memory
    assert second["b"].tolist() == [7.0] * 4 and second["a"].tolist() == [1.0, 2.0, 3.0, 4.0]
    assert second["c"].shape == (3,)  # the shape changed: fresh memory


def test_snapshot_refills_torch_buffers_bit_for_bit() -> None:
    torch = pytest.importorskip("torch")
    buffers: dict[str, object] = {}
    base = torch.randn(30, 20).to(torch.bfloat16)
    z = torch.complex(torch.randn(5), torch.randn(5))
    state = {"t": base.t(), "conj": z.conj(), "scalar": base[0, 0], "p": torch.nn.Parameter(base)}
    first = snapshot(state, buffers)
    base.mul_(2)
    z.mul_(3)
    second = snapshot(state, buffers)
    assert second["t"] is first["t"] and second["scalar"] is first["scalar"]
    for key, value in state.items():
        assert type(second[key]) is torch.Tensor and not second[key].requires_grad
        assert torch.equal(second[key].resolve_conj(), value.detach().resolve_conj()), key


def test_async_saves_reusing_buffers_store_each_steps_values(repo: cas_ckpt.Repository) -> None:
    torch = pytest.importorskip("torch")
    mgr = CheckpointManager(repo, "run", async_save=True)
    w, m = torch.zeros(300_000), np.zeros(70_000)
    for step in range(1, 5):
        w.add_(1.0)
        m += 1.0
        mgr.save(step, {"w": w, "m": m})
        w.add_(100.0)  # in-place updates while the write may still be running
        m += 100.0
        w.sub_(100.0)
        m -= 100.0
    mgr.wait()
    for step in range(1, 5):
        out = mgr.restore(step)
        assert bool((out["w"] == step).all()) and bool((out["m"] == step).all()), step


def refilled(template: object, rng: np.random.Generator) -> object:
    """``template`` with every array replaced by a new one of its shape and dtype, random bits."""
    if isinstance(template, dict):
        return {k: refilled(v, rng) for k, v in template.items()}
    if isinstance(template, list):
        return [refilled(v, rng) for v in template]
    assert isinstance(template, np.ndarray)
    if template.dtype == np.bool_:
        return rng.integers(0, 2, template.shape).astype(bool)
    raw = rng.bytes(template.size * template.dtype.itemsize)
    return np.frombuffer(raw, dtype=template.dtype).reshape(template.shape).copy()


@given(template=colliding_states())
@example(template={"a.b": np.zeros(1000, "f4"), "a": {"b": np.zeros(1000, "f4")}})
@example(template={0: np.zeros(3), "0": np.zeros(3), "": [np.zeros(3)], ".": np.zeros(3)})
def test_async_buffer_reuse_never_mixes_up_paths_that_join_alike(template: object) -> None:
    # {"a.b": x, "a": {"b": y}} and {0: x, "0": y} once shared one host buffer: y overwrote x.
    rng = np.random.default_rng(0)
    with cas_ckpt.open("memory://") as repo, CheckpointManager(repo, "run", async_save=True) as mgr:
        saved = {}
        for step in (1, 2, 3):
            saved[step] = refilled(template, rng)
            mgr.save(step, saved[step])
        mgr.wait()
        for step, state in saved.items():
            assert_state_equal(state, mgr.restore(step))


# -- forks and dedup across runs ---------------------------------------------------------------
def test_fork_starts_a_run_from_another_and_shares_blocks(repo: cas_ckpt.Repository) -> None:
    a = CheckpointManager(repo, "runs/a", keep_last=1)
    for step in (10, 20):
        a.save(step, {"frozen": state_for(0, 2 * MIB)["w"], "head": state_for(step)["w"]})
    b = CheckpointManager(repo, "runs/b", fork_from="runs/a", keep_last=2)
    assert b.steps() == [20] and b.latest_step() == 20
    assert repo.resolve("runs/b") == repo.resolve("runs/a")
    b.save(21, {"frozen": b.restore(path="frozen"), "head": state_for(21)["w"]})
    report = b.last_report
    assert report is not None
    assert report.bytes_reused >= 2 * MIB and report.bytes_written < 1.2 * MIB
    usage = repo.stats()
    assert usage.logical_bytes > usage.stored_bytes  # the frozen part is stored once
    assert [c.step for c in repo.log("runs/b")] == [21, 20, 10]
    a.save(30, {"frozen": a.restore(path="frozen"), "head": state_for(30)["w"]})
    assert b.restore(20)["head"].tolist() == state_for(20)["w"].tolist()  # b still holds 20
    b.close()
    again = CheckpointManager(repo, "runs/b", fork_from="runs/a")  # resuming b: fork ignored
    assert again.latest_step() == 21
    with pytest.raises(cas_ckpt.errors.RefConflict):
        repo.fork("runs/a", "runs/b")


# -- benchmark smoke ---------------------------------------------------------------------------
def test_async_benchmark_runs(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch")
    path = Path(__file__).parent.parent / "benchmarks" / "async_save.py"
    spec = importlib.util.spec_from_file_location("async_save_bench", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(["--size-mib", "4", "--saves", "2"])
    out = capsys.readouterr().out
    assert "sync" in out and "async" in out and "blocked" in out


# -- the manager's contract --------------------------------------------------------------------
def test_a_skipped_step_does_not_wait_for_the_save_in_flight(repo: cas_ckpt.Repository) -> None:
    mgr = CheckpointManager(repo, "run", save_every=5, async_save=True)
    with repo.refs_store.lock(exclusive=True):  # the background write cannot start meanwhile
        mgr.save(5, {"step": 5})
        started = time.monotonic()
        assert mgr.save(6, {"step": 6}) is None  # would block until the lock is freed
        assert time.monotonic() - started < 1.0
    assert mgr.wait() == repo.resolve("run") and mgr.steps() == [5]
    mgr.close()


def test_steps_may_be_numpy_or_torch_integer_scalars(repo: cas_ckpt.Repository) -> None:
    mgr = CheckpointManager(repo, "run", save_every=5)
    assert mgr.save(np.int64(5), {"v": 5}) is not None and mgr.save(np.int32(6), {"v": 6}) is None
    assert mgr.steps() == [5] and type(mgr.latest_step()) is int
    assert mgr.restore(np.uint16(5)) == {"v": 5} and mgr.metrics(np.int64(5)) == {}
    if importlib.util.find_spec("torch") is not None:
        import torch

        assert mgr.save(torch.tensor(10), {"v": 10}) is not None and mgr.steps() == [5, 10]
        with pytest.raises(ValueError, match="integer"):
            mgr.save(torch.tensor(15.0), {})
        with pytest.raises(ValueError, match="integer"):
            mgr.save(torch.tensor(True), {})
    for bad in (True, np.bool_(True), 5.0, np.float64(5), "5", -5, np.int64(-5)):
        with pytest.raises(ValueError, match="non-negative integer"):
            mgr.save(bad, {}, force=True)  # type: ignore[arg-type]


def test_restore_passes_mmap_and_verify(local_repo: cas_ckpt.Repository) -> None:
    mgr = CheckpointManager(local_repo, "run")
    mgr.save(1, {"w": np.arange(1 << 16, dtype=np.float64)})
    mapped = mgr.restore(mmap=True, verify=False)["w"]
    assert not mapped.flags.writeable and mapped.sum() == np.arange(1 << 16).sum()
    assert mgr.restore(1, path="w", verify=True).flags.writeable
    mgr.close()


def test_rewind_drops_later_steps_and_the_next_save_is_its_child(repo: cas_ckpt.Repository) -> None:
    mgr = CheckpointManager(repo, "run")
    cids = {step: mgr.save(step, {"step": step}) for step in (10, 20, 30, 40)}
    assert mgr.rewind(np.int64(20)) == cids[20]
    assert mgr.steps() == [10, 20] and mgr.latest_step() == 20 and mgr.restore() == {"step": 20}
    with pytest.raises(cas_ckpt.errors.StepNotFound):
        mgr.restore(40)
    assert bytes(cids[40]) in {e.new for e in repo.reflog("run")}  # abandoned steps stay in the reflog
    assert repo.reflog("run")[-1].message == "rewind to step 20"
    new = mgr.save(30, {"step": 30, "again": True})  # no overwrite=True needed
    assert repo.commit(new).parents == (cids[20],) and mgr.steps() == [10, 20, 30]
    assert [c.step for c in repo.log("run")] == [30, 20, 10]
    with pytest.raises(cas_ckpt.errors.StepNotFound):
        mgr.rewind(25)
    mgr.close()


# -- deleting a run ------------------------------------------------------------------------------
def test_delete_drops_the_run_keeps_its_reflogs_and_closes(repo: cas_ckpt.Repository) -> None:
    mgr = CheckpointManager(repo, "runs/a", keep_last=2, async_save=True)
    for step in (1, 2, 3):
        mgr.save(step, state_for(step, 4096))
    repo.save({"other": 1}, ref="runs/ab")  # a name that starts alike is another run
    planned = mgr.delete(dry_run=True)  # waits for the save in flight; deletes nothing
    assert sorted(planned) == ["runs/a", mgr.step_ref(2), mgr.step_ref(3)]
    assert sorted(repo.refs()) == ["runs/a", "runs/a.steps/000000000002",
                                   "runs/a.steps/000000000003", "runs/ab"]
    head = repo.resolve("runs/a")
    assert mgr.delete() == planned and planned["runs/a"] == head
    assert sorted(repo.refs()) == ["runs/ab"]
    with pytest.raises(cas_ckpt.errors.RepositoryError, match="closed"):
        mgr.save(4, state_for(4, 4096))
    assert repo.gc().blocks_freed == 0  # the reflogs keep the run for their expiry
    assert repo.restore_ref(mgr.step_ref(2)) == planned[mgr.step_ref(2)]
    assert repo.load(mgr.step_ref(2))["tag"] == "s2"
    with CheckpointManager(repo, "runs/a") as fresh:  # the lease was given back; a new run starts
        assert fresh.latest_step() is None
        fresh.save(1, state_for(9, 4096))


# -- the best step -------------------------------------------------------------------------------
def test_best_step_and_best_metric_rank_the_retained_steps(repo: cas_ckpt.Repository) -> None:
    losses = {1: 0.9, 2: 0.4, 3: float("nan"), 4: 0.4, 5: 0.7, 6: 0.8}
    mgr = CheckpointManager(repo, "run", best_metric="loss", keep_best=2, keep_last=1)
    assert mgr.best_step() is None and mgr.best_metric() is None  # nothing saved yet
    for step, loss in losses.items():
        mgr.save(step, {"step": step}, metrics={"loss": loss, "acc": step / 10})
    mgr.save(7, {"step": 7}, metrics={"acc": 0.05})  # no loss reported: never ranks
    assert mgr.steps() == [2, 4, 7]  # keep_best kept the best two (a tie: both), keep_last 7
    assert (mgr.best_step(), mgr.best_metric()) == (4, 0.4)  # a tie: the later step
    assert (mgr.best_step("acc", mode="max"), mgr.best_metric("acc", mode="max")) == (4, 0.4)
    assert mgr.best_step("acc") == 7  # the manager's mode, min
    assert mgr.best_step("unknown") is None
    assert mgr.restore(mgr.best_step()) == {"step": 4}
    mgr.close()
    again = CheckpointManager(repo, "run", best_metric="loss")  # it lives in the repository
    assert again.best_step() == 4
    again.close()
    plain = CheckpointManager(repo, "run")
    with pytest.raises(ValueError, match="best_metric="):
        plain.best_step()
    with pytest.raises(ValueError, match="'min' or 'max'"):
        plain.best_step("loss", mode="lowest")
    assert plain.best_step("loss") == 4
    plain.close()


def test_best_step_of_a_two_tier_run_counts_the_steps_only_the_remote_keeps(tmp_path: Path) -> None:
    with cas_ckpt.open(tmp_path / "local") as local, cas_ckpt.open(tmp_path / "remote") as remote:
        mgr = CheckpointManager(local, "run", best_metric="loss", keep_last=1, replicate_to=remote,
                                remote_retention={"keep_best": 1})
        for step, loss in ((1, 0.5), (2, 0.1), (3, 0.3), (4, 0.6)):
            mgr.save(step, {"step": step}, metrics={"loss": loss})
        mgr.wait()
        assert mgr.steps() == [4] and sorted(remote.refs("run.steps/")) == [
            "run.steps/000000000002", "run.steps/000000000004"]
        assert (mgr.best_step(), mgr.best_metric()) == (2, 0.1)
        assert mgr.restore(mgr.best_step()) == {"step": 2}  # fetched from the remote
        mgr.close()
