"""PyTorch tensors in a state: every dtype bit for bit, layouts, views, tied weights, torch optional."""

from __future__ import annotations

import dataclasses
import itertools
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cas_ckpt
from cas_ckpt import cid as cidlib
from cas_ckpt.errors import MapLocationError

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch

FLOAT_LIKE = [
    "float16", "bfloat16", "float32", "float64", "complex64", "complex128",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
]
INTS = ["uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64"]
DTYPES = [getattr(torch, n) for n in ["bool", *INTS, *FLOAT_LIKE] if hasattr(torch, n)]


def bits(t: torch.Tensor) -> bytes:
    """The tensor's values as raw bytes, in logical (row-major) order."""
    t = t.detach().cpu().resolve_conj().resolve_neg().contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Arbitrary bit patterns (NaN payloads included) of ``dtype``."""
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    count = int(np.prod(shape, dtype=np.int64))
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (count * size,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape)


def roundtrip(repo: cas_ckpt.Repository, value: object, **kwargs: object) -> object:
    repo.save({"v": value}, ref="t")
    return repo.load("t", **kwargs)["v"]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (3, 5), (150, 120)], ids=str)
def test_every_dtype_roundtrips_bit_for_bit(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    repo = cas_ckpt.open("memory://")
    tensor = random_tensor(dtype, shape)
    out = roundtrip(repo, tensor)
    assert type(out) is torch.Tensor
    assert out.dtype == dtype and out.shape == tensor.shape and out.device.type == "cpu"
    assert bits(out) == bits(tensor)


LAYOUTS = {
    "transposed": lambda t: t.t(),
    "strided": lambda t: t[::2, 1::3],
    "offset": lambda t: t[3:, 2:7],
    "expanded": lambda t: t[:1].expand(40, -1),
    "permuted-3d": lambda t: t.reshape(4, 10, 30).permute(2, 0, 1),
    "column": lambda t: t[:, 5],
    "scalar-of-view": lambda t: t[2, 3],
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e5m2, torch.int64])
def test_non_contiguous_views_store_what_they_show(layout: str, dtype: torch.dtype) -> None:
    repo = cas_ckpt.open("memory://")
    view = LAYOUTS[layout](random_tensor(dtype, (40, 30), seed=1))
    out = roundtrip(repo, view)
    assert out.shape == view.shape and out.dtype == dtype
    assert bits(out) == bits(view)


def test_conj_and_neg_views_are_resolved() -> None:
    repo = cas_ckpt.open("memory://")
    z = torch.complex(torch.arange(6.0), torch.arange(6.0) + 10).reshape(2, 3)
    conj = z.conj()
    neg = conj.imag
    assert conj.is_conj() and neg.is_neg()
    out_conj, out_neg = roundtrip(repo, [conj, neg])
    assert not out_conj.is_conj() and not out_neg.is_neg()
    assert torch.equal(out_conj, z.conj().resolve_conj())
    assert out_neg.tolist() == (-z.imag).tolist()


def test_parameters_and_grad_tensors_come_back_as_plain_tensors() -> None:
    repo = cas_ckpt.open("memory://")
    param = torch.nn.Parameter(torch.randn(4, 3))
    (param * 2).sum().backward()
    out = roundtrip(repo, {"p": param, "g": param.grad, "live": param * 3})
    assert type(out["p"]) is torch.Tensor and not out["p"].requires_grad
    assert torch.equal(out["p"], param.detach())
    assert torch.equal(out["g"], torch.full((4, 3), 2.0))
    assert torch.equal(out["live"], param.detach() * 3)


def test_inference_mode_tensors_save() -> None:
    repo = cas_ckpt.open("memory://")
    with torch.inference_mode():
        t = torch.arange(10.0) * 2
    assert torch.equal(roundtrip(repo, t), torch.arange(10.0) * 2)


def test_tied_weights_are_stored_once_and_load_into_a_tied_model() -> None:
    repo = cas_ckpt.open("memory://")

    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(1024, 512)
            self.out = torch.nn.Linear(512, 1024, bias=False)
            self.out.weight = self.embed.weight

    model = Tied()
    state = model.state_dict()
    assert state["embed.weight"].data_ptr() == state["out.weight"].data_ptr()
    nbytes = 1024 * 512 * 4
    repo.save(state, ref="tied")
    report = repo.last_save
    assert report is not None
    assert report.logical_bytes == 2 * nbytes
    assert report.bytes_written < 1.1 * nbytes  # the second copy is the same chunks
    assert report.bytes_reused >= nbytes
    fresh = Tied()
    fresh.load_state_dict(repo.load("tied"))
    assert torch.equal(fresh.embed.weight, model.embed.weight)
    assert fresh.out.weight is fresh.embed.weight  # still tied: load_state_dict copied in place


def test_views_of_one_storage_each_keep_their_values() -> None:
    repo = cas_ckpt.open("memory://")
    base = random_tensor(torch.float32, (64, 64), seed=3)
    state = {"base": base, "rows": base[10:20], "diag": base.diagonal(), "same": base.view(-1)}
    out = roundtrip(repo, state)
    for key, value in state.items():
        assert bits(out[key]) == bits(value), key
    out["rows"][0, 0] = 123.0  # loaded tensors are independent of one another
    assert out["base"][10, 0] != 123.0


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda: torch.zeros(3, dtype=torch.complex32), "complex32"),
        (lambda: torch.zeros(3, dtype=torch.uint8).view(torch.float4_e2m1fn_x2), "two values"),
        (lambda: torch.eye(3).to_sparse(), "sparse"),
        (lambda: torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8), "quantized"),
        (lambda: torch.empty(3, device="meta"), "meta"),
        (lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), "convert it"),
        (lambda: torch.nn.parameter.UninitializedParameter(), "subclass"),
    ],
    ids=["complex32", "float4x2", "sparse", "quantized", "meta", "nested", "uninitialized"],
)
def test_unsavable_tensors_raise_state_type_error_naming_the_path(make: object, words: str) -> None:
    repo = cas_ckpt.open("memory://")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # complex32 and quantized creation warn: experimental
        tensor = make()  # type: ignore[operator]
    with pytest.raises(cas_ckpt.errors.StateTypeError, match=words) as info:
        repo.save({"layer": {"w": tensor}}, ref="bad")
    assert info.value.path == "layer.w"
    assert "bad" not in repo.refs()


def test_tensor_subclasses_are_refused() -> None:
    class Tagged(torch.Tensor):
        pass

    repo = cas_ckpt.open("memory://")
    with pytest.raises(cas_ckpt.errors.StateTypeError, match="cannot save"):
        repo.save({"x": torch.ones(2).as_subclass(Tagged)}, ref="bad")


def test_map_location_and_kinds() -> None:
    repo = cas_ckpt.open("memory://")
    repo.save({"t": torch.arange(3), "n": np.arange(3), "b": torch.ones(2, dtype=torch.bfloat16)})
    plain = repo.load()
    assert type(plain["t"]) is torch.Tensor and type(plain["n"]) is np.ndarray
    for where in ("cpu", torch.device("cpu")):
        moved = repo.load(map_location=where)
        assert moved["t"].device.type == "cpu" and type(moved["n"]) is np.ndarray
        assert moved["b"].dtype == torch.bfloat16
    assert repo.load(path="t", map_location="cpu").tolist() == [0, 1, 2]


def test_map_location_dict_and_callable_work_as_in_torch_load(repo: cas_ckpt.Repository) -> None:
    # cas_ckpt does not record a tensor's device: every tensor loads as if saved on "cpu".
    state = {"model": {"w": torch.arange(6.0).reshape(2, 3).t(), "b": torch.ones(2, dtype=torch.bfloat16)}}
    mgr = cas_ckpt.CheckpointManager(repo, "run")
    mgr.save(1, {**state, "n": np.arange(3)})
    for where in ({"cuda:0": "cpu"}, {"cpu": "cpu"}, {"cpu": torch.device("cpu")}, {}):
        out = mgr.restore(map_location=where)
        assert type(out["n"]) is np.ndarray and out["model"]["b"].dtype == torch.bfloat16
        for key, value in state["model"].items():
            assert out["model"][key].device.type == "cpu" and bits(out["model"][key]) == bits(value)
    locations: list[str] = []

    def keep(storage: torch.UntypedStorage, location: str) -> torch.UntypedStorage:
        locations.append(location)
        return storage

    def copy(storage: torch.UntypedStorage, location: str) -> torch.UntypedStorage:
        return storage.clone()

    for where in (keep, copy, lambda storage, location: None):  # None: the default location
        out = mgr.restore(path="model", map_location=where)
        for key, value in state["model"].items():
            assert out[key].shape == value.shape and bits(out[key]) == bits(value), key
    assert locations == ["cpu", "cpu"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="for torch without a usable CUDA device")
@pytest.mark.parametrize(
    ("where", "match"),
    [
        ("cuda:0", r"model\.w: cannot load a tensor onto 'cuda:0'"),
        (torch.device("cuda", 0), r"model\.w: cannot load a tensor onto 'cuda:0'"),
        ({"cpu": "cuda:0"}, r"model\.w: cannot load a tensor onto 'cuda:0'"),
        ("gpu", r"model\.w: .*'gpu' is not a device"),
        ({"cpu": 3.5}, r"model\.w: .*3\.5 is not a device"),
        ({0: "cpu"}, r"model\.w: .*keys must be str"),
        (5, r"model\.w: map_location must be a str, torch\.device, dict or callable, not int"),
        (lambda storage, location: "cpu", r"model\.w: .*must return a storage or None, not str"),
        (lambda storage, location: storage.cuda(), r"model\.w: the map_location callable failed"),
    ],
    ids=["cuda-str", "cuda-device", "dict-to-cuda", "not-a-device", "dict-value", "dict-key", "int",
         "callable-returns-str", "callable-raises"],
)
def test_map_location_errors_name_the_device_and_the_path(where: object, match: str) -> None:
    repo = cas_ckpt.open("memory://")
    repo.save({"n": np.arange(2), "model": {"w": torch.arange(3.0)}})
    with pytest.raises(MapLocationError, match=match) as info:
        repo.load(map_location=where)
    assert isinstance(info.value, cas_ckpt.errors.CasCkptError) and info.value.path == "model.w"
    with pytest.raises(MapLocationError, match=r"^model\.w: ") as info:
        repo.load(path="model", map_location=where)  # the path is still the whole state's
    assert repo.load(path="model", map_location="cpu")["w"].tolist() == [0.0, 1.0, 2.0]


def test_loaded_tensors_are_writable_and_own_their_memory() -> None:
    repo = cas_ckpt.open("memory://")
    repo.save({"t": torch.arange(6.0).reshape(2, 3).t()})
    out = repo.load()["t"]
    out += 1  # would fail (or warn) on read-only memory
    assert out.tolist() == (torch.arange(6.0).reshape(2, 3).t() + 1).tolist()


def _run(code: str, cwd: Path) -> str:
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=cwd, capture_output=True, text=True, timeout=60, check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_import_does_not_import_torch(tmp_path: Path) -> None:
    out = _run(
        """
        import sys
        import numpy as np
        import cas_ckpt
        repo = cas_ckpt.open("memory://")
        repo.save({"w": np.arange(3.0)}, ref="m")
        assert repo.load("m")["w"].tolist() == [0.0, 1.0, 2.0]
        print("torch" in sys.modules)
        """,
        tmp_path,
    )
    assert out.strip() == "False"


def test_ml_dtypes_is_imported_only_for_a_state_that_needs_it(tmp_path: Path) -> None:
    # Its import takes a second or more: a float32 model's save, async save, load, cast and
    # training state pay nothing for it; the first bfloat16 tensor imports it, once.
    out = _run(
        """
        import sys
        import numpy as np
        import torch
        import cas_ckpt
        from cas_ckpt.integrations.training import training_state
        model = torch.nn.Linear(8, 4)
        optimizer = torch.optim.Adam(model.parameters())
        model(torch.ones(2, 8)).sum().backward()
        optimizer.step()
        repo = cas_ckpt.open("repo")
        state = training_state(model=model, optimizer=optimizer, extra={"w": np.arange(3.0)})
        repo.save(state, ref="plain", step=1)
        with cas_ckpt.CheckpointManager(repo, "run", async_save=True) as manager:
            manager.save(1, state)
        loaded = repo.load("plain", map_location="cpu")
        assert torch.equal(loaded["model"]["weight"], model.weight)
        repo.load("run", dtype=torch.float16)
        repo.load("run", dtype=np.float64)
        print("ml_dtypes" in sys.modules)
        repo.save({"b": torch.ones(3, dtype=torch.bfloat16)}, ref="bf16")
        print("ml_dtypes" in sys.modules, repo.load("bf16")["b"].dtype)
        """,
        tmp_path,
    )
    assert out.split("\n")[:2] == ["False", "True torch.bfloat16"]


def test_a_bfloat16_checkpoint_loads_in_a_fresh_process(tmp_path: Path) -> None:
    with cas_ckpt.open(tmp_path / "repo") as repo:
        repo.save({"b": torch.arange(4, dtype=torch.bfloat16), "f": torch.arange(2.0)})
    out = _run(
        """
        import sys
        import torch
        import cas_ckpt
        repo = cas_ckpt.open("repo")
        f = repo.load(path="f")
        print("ml_dtypes" in sys.modules, f.dtype)
        state = repo.load()
        print(state["b"].dtype, state["b"].tolist(), state["f"].tolist())
        """,
        tmp_path,
    )
    assert out.split("\n")[:2] == ["False torch.float32", "torch.bfloat16 [0.0, 1.0, 2.0, 3.0] [0.0, 1.0]"]


def test_tensors_of_numpys_dtypes_save_and_load_without_importing_ml_dtypes(tmp_path: Path) -> None:
    """ml_dtypes' import (0.5-1.4 s) is paid only by a state holding bfloat16 or float8."""
    out = _run(
        """
        import sys
        import torch
        import cas_ckpt
        repo = cas_ckpt.open("r")
        state = {"tiny": torch.ones(3), "small": {f"p{i}": torch.ones(300) for i in range(100)},
                 "big": torch.arange(100_000, dtype=torch.int64), "flag": torch.tensor(True)}
        repo.save(state)
        loaded = repo.load()
        assert all(type(v) is torch.Tensor for v in [*loaded["small"].values(), loaded["big"]])
        print("ml_dtypes" in sys.modules)
        repo.save({"b": torch.ones(3, dtype=torch.bfloat16)})
        print(repo.load()["b"].dtype, "ml_dtypes" in sys.modules)
        """,
        tmp_path,
    )
    assert out.split() == ["False", "torch.bfloat16", "True"]


def test_works_with_torch_blocked_and_reads_torch_checkpoints_as_numpy(tmp_path: Path) -> None:
    with cas_ckpt.open(tmp_path / "repo") as repo:
        repo.save({"t": torch.arange(4, dtype=torch.bfloat16), "i": torch.arange(3)}, ref="torch")
    out = _run(
        """
        import sys
        sys.modules["torch"] = None  # any import of torch now raises ImportError
        import numpy as np
        import cas_ckpt
        from cas_ckpt.integrations.training import capture_rng
        repo = cas_ckpt.open("repo")
        assert "torch" not in capture_rng()
        with cas_ckpt.CheckpointManager(repo, "run", async_save=True, keep_last=1) as mgr:
            mgr.save(1, {"w": np.arange(3.0)})
            mgr.save(2, {"w": np.arange(4.0)})
        assert mgr.steps() == [2]
        repo.save({"w": np.arange(3.0)}, ref="m")
        assert repo.load("m")["w"].tolist() == [0.0, 1.0, 2.0]
        state = repo.load("torch")
        print(type(state["t"]).__name__, state["t"].dtype, state["t"].tolist(), state["i"].tolist())
        """,
        tmp_path,
    )
    assert out.strip() == "ndarray bfloat16 [0.0, 1.0, 2.0, 3.0] [0, 1, 2]"


def test_bfloat16_bits_match_ml_dtypes() -> None:
    from cas_ckpt.integrations.torch import tensor_to_numpy

    t = torch.tensor([1.5, -2.25, float("inf")], dtype=torch.bfloat16)
    array, kind = tensor_to_numpy(t, "x")
    assert kind == "torch" and array.dtype == np.dtype(ml_dtypes.bfloat16)
    assert array.tolist() == [1.5, -2.25, float("inf")]


def test_mmap_loads_give_writable_tensors(local_repo: cas_ckpt.Repository) -> None:
    state = {"t": random_tensor(torch.float32, (300, 100)), "b": random_tensor(torch.bfloat16, (5000,))}
    local_repo.save(state, ref="m")
    out = local_repo.load("m", mmap=True)  # numpy gets read-only views, tensors copy-on-write ones
    for key, value in state.items():
        assert type(out[key]) is torch.Tensor and bits(out[key]) == bits(value)
    out["t"] += 1.0


def file_mappings() -> list[tuple[int, int, str]]:
    """This process's mappings of files: (start, end, path), from /proc/self/maps."""
    found = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith("/"):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            found.append((start, end, fields[5]))
    return found


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc (Linux)")
def test_mmap_tensors_are_backed_by_the_pack_and_writes_stay_private(
    local_repo: cas_ckpt.Repository,
) -> None:
    state = {"t": random_tensor(torch.float32, (512, 256)), "b": random_tensor(torch.bfloat16, (9000,))}
    local_repo.save(state, ref="m")
    out = local_repo.load("m", mmap=True)
    packs = str(Path(str(local_repo.location)).resolve())
    for key in state:
        ptr = out[key].data_ptr()
        assert any(s <= ptr < e and path.startswith(packs) for s, e, path in file_mappings()), key
        assert bits(out[key]) == bits(state[key])
    out["t"] += 1.0  # copy-on-write: this page becomes private, the pack is untouched
    again = local_repo.load("m", mmap=True)
    assert bits(again["t"]) == bits(state["t"]) and local_repo.fsck().ok
    del out, again  # the mappings go with the tensors


def test_mmap_falls_back_to_copies_visibly(caplog: pytest.LogCaptureFixture) -> None:
    repo = cas_ckpt.open("memory://")  # nothing to map
    repo.save({"t": random_tensor(torch.float32, (1 << 14,)), "n": np.arange(1 << 14)}, ref="m")
    with caplog.at_level("WARNING", logger="cas_ckpt"):
        out = repo.load("m", mmap=True)
    assert out["t"].shape == (1 << 14,) and out["n"].sum() == np.arange(1 << 14).sum()
    assert "mmap=True: 2 of 2 arrays of" in caplog.text and "copied, not mapped" in caplog.text


def test_dtype_casts_floating_point_tensors_only() -> None:
    """``dtype=`` is the cast (``map_location`` only places): floats change, ints stay exact."""
    torch = pytest.importorskip("torch")
    state = {"w": torch.randn(4, 3), "steps": torch.arange(5), "mask": torch.tensor([True, False]),
             "np": np.linspace(0, 1, 7), "n": np.arange(3), "lr": 0.5}
    with cas_ckpt.open("memory://") as repo:
        repo.save(state)
        half = repo.load(dtype=torch.bfloat16)
        assert half["w"].dtype == torch.bfloat16 and torch.equal(half["w"], state["w"].to(torch.bfloat16))
        assert half["steps"].dtype == torch.int64 and torch.equal(half["steps"], state["steps"])
        assert half["mask"].dtype == torch.bool and half["lr"] == 0.5
        assert half["np"].dtype.name == "bfloat16" and half["n"].dtype == np.int64
        numpy_cast = repo.load(dtype=np.float16)
        assert numpy_cast["w"].dtype == torch.float16 and numpy_cast["np"].dtype == np.float16
        with pytest.raises(cas_ckpt.errors.MapLocationError, match="pass dtype="):
            repo.load(map_location=torch.float16)
        with pytest.raises(cas_ckpt.errors.StateTypeError, match="dtype"):
            repo.load(dtype="not-a-dtype")
        manager = cas_ckpt.CheckpointManager(repo, "run")
        manager.save(1, state)
        assert manager.restore(dtype=torch.float64)["w"].dtype == torch.float64
        manager.close()


def test_a_module_or_optimizer_passed_as_state_says_to_save_its_state_dict() -> None:
    """issue #40: a model, an optimizer or a scheduler passed whole gave a StateTypeError with no
    hint; they are recognised by their classes' names (torch is never imported for it)."""

    class Net(torch.nn.Module):  # a user's model: its class lives in the user's module
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(2, 2)

    class Stateful:  # any object with a state_dict(), such as a data loader's sampler
        def state_dict(self) -> dict[str, int]:
            return {"epoch": 1}

    net = Net()
    optimizer = torch.optim.AdamW(net.parameters())
    cases = [(net, "<root>", "a torch.nn.Module", "model"),
             ({"model": net}, "model", "a torch.nn.Module", "model"),
             (torch.nn.Linear(2, 2), "<root>", "a torch.nn.Module", "model"),
             ({"opt": optimizer}, "opt", "a torch optimizer", "optimizer"),
             ([torch.optim.lr_scheduler.StepLR(optimizer, 1)], "0", "a learning-rate scheduler", "scheduler"),
             ({"sampler": Stateful()}, "sampler", "an object with a state_dict", "obj")]
    with cas_ckpt.open("memory://") as repo:
        for state, path, what, name in cases:
            with pytest.raises(cas_ckpt.errors.StateTypeError) as info:
                repo.save(state)
            assert str(info.value).startswith(f"{path}: cannot save a value of type "), info.value
            assert f"it is {what}" in str(info.value) and f"{name}.state_dict()" in str(info.value)
        with pytest.raises(cas_ckpt.errors.StateTypeError) as info:
            repo.save({"x": object()})
        assert "state_dict" not in str(info.value)
        assert repo.refs() == {}


# -- many small tensors at the cost of numpy arrays (issue #41) ------------------------------
def _small_tensor(kind: str, n: int, seed: int) -> object:
    """A value of a state dict: a plain small tensor (1-16 KiB, taken by its host array), one
    the general path converts (bfloat16, strided, a Parameter needing grad), a tiny or a large
    tensor, a numpy array beside them, or an int."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "plain":
        return torch.randn(256 + n % 3800, generator=gen)
    if kind == "int64":
        return torch.randint(0, 1 << 40, (130 + n % 1900,), generator=gen)
    if kind == "param":
        return torch.nn.Parameter(torch.randn(300 + n % 3000, generator=gen))
    if kind == "2d":
        return torch.randn(4, 100 + n % 900, generator=gen)
    if kind == "bf16":
        return torch.randn(600 + n % 7000, generator=gen).to(torch.bfloat16)
    if kind == "strided":
        return torch.randn(2 * (300 + n % 1500), generator=gen)[::2]
    if kind == "tiny":
        return torch.randn(1 + n % 250, generator=gen)
    if kind == "large":
        return torch.randn(5000 + n % 20_000, generator=gen)
    if kind == "numpy":
        return np.random.default_rng(seed).standard_normal(300 + n % 3700).astype(np.float32)
    return n


def _same_value(got: object, want: object) -> bool:
    if isinstance(want, torch.Tensor):
        return (type(got) is torch.Tensor and got.dtype == want.dtype and got.shape == want.shape
                and not got.requires_grad and bits(got) == bits(want))
    if isinstance(want, np.ndarray):
        return type(got) is np.ndarray and got.dtype == want.dtype and got.tobytes() == want.tobytes()
    return got == want


KINDS = ["plain", "plain", "plain", "int64", "param", "2d", "bf16", "strided", "tiny", "large", "numpy",
         "int"]


@settings(max_examples=40, deadline=None)
@given(containers=st.lists(st.lists(st.tuples(st.sampled_from(KINDS), st.integers(0, 10_000)),
                                    min_size=1, max_size=40), min_size=1, max_size=4),
       compiled=st.booleans())
def test_small_tensors_store_the_tree_the_tensor_by_tensor_path_stores(
    containers: list[list[tuple[str, int]]], compiled: bool
) -> None:
    """Dicts of tensors taken by their host arrays (plain ones kept bare, a container's kind in
    their headers, encoded in one loop where the compiled encoding is built) store the very
    blocks a save that converts each tensor through the adapter stores; numpy arrays beside them
    keep their own kind. Each value loads back as itself."""
    from cas_ckpt import _small, tree

    state = {"c": [{f"k{i}": _small_tensor(kind, n, i) for i, (kind, n) in enumerate(items)}
                   for items in containers]}
    roots = []
    for fast in (True, False):
        with pytest.MonkeyPatch.context() as patched:
            if not compiled:
                patched.setattr(_small, "_headers", None)
            if not fast:  # every tensor through adapter_for and _prepare_array, one at a time
                patched.setattr(tree, "_plain_adapter", lambda kind: None)
            with cas_ckpt.open("memory://") as repo:
                repo.save(state, ref="main")
                roots.append(next(iter(repo.log("main"))).tree)
                loaded = repo.load("main")
        for got, want in zip(loaded["c"], state["c"], strict=True):
            assert got.keys() == want.keys()
            assert all(_same_value(got[k], want[k]) for k in want)
    assert roots[0] == roots[1]


@pytest.mark.parametrize("compiled", [True, False])
def test_whole_containers_of_either_kind_in_one_save_keep_their_own_kinds(compiled: bool) -> None:
    """A dict of small numpy arrays and a dict of small tensors of the same dtype, both encoded
    in one loop in one save: each container's headers say its own kind."""
    from cas_ckpt import _small, tree

    state = {"numpy": {f"p{i}": np.full(300 + i, i, np.float32) for i in range(80)},
             "torch": {f"p{i}": torch.full((300 + i,), float(i)) for i in range(80)}}
    roots = []
    for fast in (True, False):
        with pytest.MonkeyPatch.context() as patched:
            if not compiled:
                patched.setattr(_small, "_headers", None)
            if not fast:
                patched.setattr(tree, "_plain_adapter", lambda kind: None)
            with cas_ckpt.open("memory://") as repo:
                repo.save(state, ref="main")
                roots.append(next(iter(repo.log("main"))).tree)
                loaded = repo.load("main")
        for name, container in state.items():
            assert all(_same_value(loaded[name][k], v) for k, v in container.items()), name
    assert roots[0] == roots[1]


def _tensor_blocks(n: int) -> dict[str, object]:
    gen = torch.Generator().manual_seed(n)
    blocks = [{f"p{j}": torch.randn(int(torch.randint(256, 4096, (1,), generator=gen)), generator=gen)
               for j in range(100)} for _ in range(n)]
    blocks[0]["n"] = np.arange(2000, dtype=np.float32)  # a numpy array among them stays one
    blocks[1]["w"] = torch.randn(6, 300, generator=gen)
    blocks[1]["i"] = torch.arange(1000, dtype=torch.int16)
    return {"blocks": blocks}


def _disjoint(tensors: list[torch.Tensor]) -> bool:
    spans = sorted((t.data_ptr(), t.data_ptr() + t.nbytes) for t in tensors)
    return all(end <= start for (_, end), (start, _) in itertools.pairwise(spans))


def test_a_loads_small_tensors_are_made_in_one_loop_like_the_general_paths(
        local_repo: cas_ckpt.Repository, monkeypatch: pytest.MonkeyPatch) -> None:
    """The small tensors of a dict come out of the compiled loop (one ``torch.from_numpy`` each,
    over buffers the load's small arrays share): the dtype, shape, strides and bits the general
    path gives, plain CPU tensors needing no grad, writable, none sharing memory with another."""
    from cas_ckpt import tree

    state = _tensor_blocks(3)
    local_repo.save(state, ref="main")
    made: list[object] = []
    maker = tree._ADAPTERS["torch"].tensor_maker

    def counted() -> object:
        make = maker()  # type: ignore[misc]
        return lambda array: made.append(array) or make(array)

    counting = dataclasses.replace(tree._ADAPTERS["torch"], tensor_maker=counted)
    monkeypatch.setitem(tree._ADAPTERS, "torch", counting)
    fast = local_repo.load("main")
    if tree._pick_small is not None:
        assert len(made) == 3 * 100 + 2  # every small tensor, not the numpy array
    monkeypatch.setattr(tree.TreeReader, "_tensor_maker", lambda self: ())
    general = local_repo.load("main")
    tensors = []
    for got, other, want in zip(fast["blocks"], general["blocks"], state["blocks"], strict=True):
        assert got.keys() == want.keys()
        for key, value in want.items():
            assert _same_value(got[key], value) and _same_value(other[key], value), key
            if isinstance(value, torch.Tensor):
                assert got[key].stride() == other[key].stride() == value.stride()
                assert got[key].device.type == "cpu" and got[key].is_contiguous()
                tensors.append(got[key])
    assert _disjoint(tensors)
    before = [bits(t) for t in tensors]
    for t in tensors[::7]:
        t += 1  # writable, without a warning (filterwarnings = error)
    changed = {i for i, t in enumerate(tensors) if bits(t) != before[i]}
    assert changed == set(range(0, len(tensors), 7))


def test_small_tensors_placed_by_map_location_take_the_general_path(local_repo: cas_ckpt.Repository) -> None:
    """A map_location moves each tensor at once, so the bytes must be there first: those loads
    do not take the loop whose reads finish later."""
    state = _tensor_blocks(2)
    local_repo.save(state, ref="main")
    for where in ("cpu", {"cpu": "cpu"}):
        loaded = local_repo.load("main", map_location=where)
        for got, want in zip(loaded["blocks"], state["blocks"], strict=True):
            assert all(_same_value(got[k], v) for k, v in want.items())


def test_the_loop_takes_only_small_arrays_of_its_kind_in_the_machines_byte_order() -> None:
    from cas_ckpt import _headers, tree
    from cas_ckpt.codec import Link, Tagged

    cid = cidlib.prefix(cidlib.RAW, cidlib.SHA2_256) + bytes(32)

    def header(dtype: str, kind: str | None) -> Tagged:
        fields = {"dtype": dtype, "shape": [400], **({"kind": kind} if kind else {}),
                  "chunk_size": 4096, "chunks": [Link(cid)]}
        return Tagged(tree.NDARRAY, fields)

    items = {"t": header("<f4", "torch"), "n": header("<f4", None), "other": header("<f4", "jax"),
             "swapped": header(">f4", "torch"), "numpy-swapped": header(">f4", None)}
    out, cids, arrays, rest = tree._pick_small(items, [None, 0, 0], "torch", torch.from_numpy)
    assert type(out["t"]) is torch.Tensor and type(out["n"]) is np.ndarray
    assert rest == ["other", "swapped"] and len(arrays) == len(cids) == 3
    assert tree._pick_small(items, [None, 0, 0])[3] == ["t", "other", "swapped"]
    with pytest.raises(TypeError, match="come together"):
        _headers.pick_small(items, Tagged, tree.NDARRAY, {}, 16384, [None, 0, 0], "torch")


def test_host_array_takes_only_what_tensor_to_numpy_gives_as_a_view() -> None:
    """One call for a plain CPU tensor of a numpy or ml_dtypes dtype (a view of it, bfloat16 and
    float8 through their integer view); None for every tensor the general conversion must look
    at."""
    from cas_ckpt.integrations import torch as adapter

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        others = [torch.ones(3, dtype=torch.complex32),
                  torch.ones(3, dtype=torch.complex64).conj(), torch.ones(2, device="meta"),
                  torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8), torch.eye(2).to_sparse()]
    assert all(adapter.host_arrays([t])[0] is None for t in others)
    plain = [torch.arange(5.0), torch.nn.Parameter(torch.ones(3)), torch.ones(4, 4)[:, ::2], torch.tensor(2),
             torch.arange(6.0, dtype=torch.bfloat16), torch.tensor(1.5, dtype=torch.bfloat16),
             torch.nn.Parameter(torch.ones(4, 4, dtype=torch.bfloat16))[:, 1::2],
             torch.ones(5).to(torch.float8_e4m3fn), torch.ones(2).to(torch.float8_e5m2)]
    for t in plain:
        array = adapter.host_arrays([t])[0]
        want = adapter.tensor_to_numpy(t, "x")[0]
        assert array is not None and array.dtype == want.dtype and array.shape == want.shape
        assert array.strides == want.strides and array.__array_interface__["data"][0] == t.data_ptr()
        assert np.array_equal(array.astype(np.float64), want.astype(np.float64))
    # One call for a container's values: aligned with them, whatever is mixed in (a tensor
    # Tensor.numpy refuses sends the whole list through the one-at-a-time path).
    grad = torch.nn.Parameter(torch.ones(2))
    for values in ([*plain, np.ones(2), "text", grad, *others], [*plain, np.ones(2), "text"]):
        got = adapter.host_arrays(values)
        assert len(got) == len(values)
        for value, array in zip(values, got, strict=True):
            if any(value is t for t in others) or type(value) not in (torch.Tensor, torch.nn.Parameter):
                assert array is None
            else:
                assert array is not None and array.__array_interface__["data"][0] == value.data_ptr()
