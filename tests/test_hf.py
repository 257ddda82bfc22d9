"""safetensors files and Hugging Face folders in and out (cas_ckpt.hf), against the real package.

The ``safetensors`` package (0.8) is the reference: it writes the inputs (``serialize`` for every
dtype, ``save_file`` for numpy and torch) and reads the outputs back; huggingface_hub's own split
decides the shards a sharded export must produce.
"""

from __future__ import annotations

import io
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import safetensors
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from safetensors import TensorSpec, deserialize, serialize
from safetensors.numpy import save_file

import cas_ckpt
from cas_ckpt import cli, hf
from cas_ckpt.errors import PathNotFound, SafetensorsError, StateTypeError

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
from real_model import model_folder

# safetensors dtype -> (the name serialize's TensorSpec takes, bytes per element of the buffer)
SPEC = {
    "BOOL": ("bool", 1), "U8": ("uint8", 1), "I8": ("int8", 1), "F8_E5M2": ("float8_e5m2", 1),
    "F8_E4M3": ("float8_e4m3fn", 1), "F8_E8M0": ("float8_e8m0fnu", 1),
    "F8_E4M3FNUZ": ("float8_e4m3fnuz", 1), "F8_E5M2FNUZ": ("float8_e5m2fnuz", 1),
    "I16": ("int16", 2), "U16": ("uint16", 2), "F16": ("float16", 2), "BF16": ("bfloat16", 2),
    "I32": ("int32", 4), "U32": ("uint32", 4), "F32": ("float32", 4), "C64": ("complex64", 8),
    "F64": ("float64", 8), "I64": ("int64", 8), "U64": ("uint64", 8),
    "F4": ("float4_e2m1fn_x2", 1),  # two elements per byte: the spec's shape halves the last axis
}
NUMPY_DTYPES = [np.dtype(x) for x in ("?", "u1", "i1", "<i2", "<u2", "<f2", "<i4", "<u4", "<f4",
                                      "<c8", "<f8", "<i8", "<u8")] + [
    np.dtype(getattr(ml_dtypes, n)) for n in ("bfloat16", "float8_e4m3fn", "float8_e5m2",
                                              "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")]

names = st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=12).filter(
    lambda s: s != "__metadata__")
shapes = st.lists(st.integers(0, 5), max_size=3)
metadata = st.none() | st.dictionaries(names, st.text(max_size=20), max_size=3)


def reference_file(path: Path, tensors: dict[str, tuple[str, list[int], bytes]],
                   meta: dict[str, str] | None) -> bytes:
    """Write a file with safetensors' own serializer: name -> (dtype, shape, raw bytes)."""
    keep, specs = [], {}
    for name, (dtype, shape, raw) in tensors.items():
        buffer = np.frombuffer(raw, dtype=np.uint8).copy() if raw else np.zeros(1, np.uint8)
        keep.append(buffer)
        spec_shape = [*shape[:-1], shape[-1] // 2] if dtype == "F4" else shape
        specs[name] = TensorSpec(dtype=SPEC[dtype][0], shape=spec_shape,
                                 data_ptr=buffer.ctypes.data, data_len=len(raw))
    data = bytes(serialize(specs, metadata=meta))
    path.write_bytes(data)
    return data


@st.composite
def st_tensors(draw: Any) -> dict[str, tuple[str, list[int], bytes]]:
    out = {}
    for name in draw(st.lists(names, max_size=6, unique=True)):
        dtype = draw(st.sampled_from(sorted(SPEC)))
        shape = draw(shapes)
        if dtype == "F4" and (not shape or shape[-1] % 2):
            shape = [*shape, 2] if not shape else [*shape[:-1], shape[-1] * 2]
        count = int(np.prod(shape))
        nbytes = count // 2 if dtype == "F4" else count * SPEC[dtype][1]
        out[name] = (dtype, shape, draw(st.binary(min_size=nbytes, max_size=nbytes)))
    return out


# -- round trips of files the package wrote ---------------------------------------------------
@given(tensors=st_tensors(), meta=metadata)
def test_files_written_by_safetensors_round_trip_byte_for_byte(
    tensors: dict[str, tuple[str, list[int], bytes]], meta: dict[str, str] | None, tmp_path_factory: Any
) -> None:
    # safetensors 0.8 writes an unreadable header for no tensors and an empty __metadata__
    # ('{},"__metadata__":{}}'), which it refuses to read itself: not a file to start from.
    assume(tensors or meta != {})
    tmp = tmp_path_factory.mktemp("rt")
    original = reference_file(tmp / "in.safetensors", tensors, meta)
    with cas_ckpt.open("memory://") as repo:
        repo.import_safetensors(tmp / "in.safetensors", ref="m")
        report = repo.export_safetensors("m", tmp / "out.safetensors")
        assert report.exact and report.tensors == len(tensors)
        assert (tmp / "out.safetensors").read_bytes() == original
        state = repo.load("m", path="model")
    assert set(state) == set(tensors)
    for name, (dtype, shape, raw) in tensors.items():
        array = state[name]
        assert array.tobytes() == raw
        assert list(array.shape) == ([len(raw)] if dtype == "F4" else shape)  # F4: its bytes


def test_f6_files_round_trip(tmp_path: Path) -> None:
    """F6 has no writer in the package: a file built by hand, which the package reads."""
    header = b'{"a":{"dtype":"F6_E2M3","shape":[2,4],"data_offsets":[0,6]},' \
             b'"b":{"dtype":"F6_E3M2","shape":[4],"data_offsets":[6,9]}}'
    data = len(header).to_bytes(8, "little") + header + bytes(range(9))
    assert sorted(n for n, _ in deserialize(data)) == ["a", "b"]
    (tmp_path / "f6.safetensors").write_bytes(data)
    with cas_ckpt.open("memory://") as repo:
        repo.import_safetensors(tmp_path / "f6.safetensors")
        repo.export_safetensors("main", tmp_path / "out.safetensors")
        assert repo.load("main", path="model.b").tolist() == [6, 7, 8]
    assert (tmp_path / "out.safetensors").read_bytes() == data


# -- exports of ordinary checkpoints equal save_file -------------------------------------------
@st.composite
def numpy_tensors(draw: Any) -> dict[str, np.ndarray]:
    out = {}
    for name in draw(st.lists(names.filter(lambda s: "." not in s), max_size=6, unique=True)):
        dtype = draw(st.sampled_from(NUMPY_DTYPES))
        shape = draw(shapes)
        raw = draw(st.binary(min_size=int(np.prod(shape)) * dtype.itemsize,
                             max_size=int(np.prod(shape)) * dtype.itemsize))
        out[name] = np.frombuffer(raw, dtype=dtype).reshape(shape)
    return out


@given(tensors=numpy_tensors(), meta=st.none() | st.dictionaries(names.filter(lambda s: "." not in s),
                                                             st.text(max_size=20), max_size=1))
def test_checkpoints_export_as_numpy_save_file_writes(
    tensors: dict[str, np.ndarray], meta: dict[str, str] | None, tmp_path_factory: Any
) -> None:
    tmp = tmp_path_factory.mktemp("sf")
    meta = {k: v for k, v in (meta or {}).items() if k not in tensors} or None
    save_file(tensors, tmp / "ref.safetensors", metadata=meta)
    with cas_ckpt.open("memory://") as repo:
        repo.save({"model": {**tensors, **(meta or {})}, "step": 3})
        repo.export_safetensors("main", tmp / "out.safetensors", path="model")
    assert (tmp / "out.safetensors").read_bytes() == (tmp / "ref.safetensors").read_bytes()


def test_metadata_with_several_keys_loads_back(tmp_path: Path) -> None:
    """safetensors' own key order for two or more __metadata__ keys is not stable: compare values."""
    state = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "format": "pt", "note": "x" * 20000}
    with cas_ckpt.open("memory://") as repo:
        repo.save(state)
        repo.export_safetensors("main", tmp_path / "m.safetensors")
    with safetensors.safe_open(tmp_path / "m.safetensors", framework="numpy") as f:
        assert f.metadata() == {"format": "pt", "note": "x" * 20000}
        assert f.get_tensor("w").tolist() == state["w"].tolist()


def test_large_strided_big_endian_and_fortran_arrays_export_as_save_file(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    tensors = {
        "big": rng.standard_normal((700, 1000)).astype(np.float32),  # 2.7 MiB: 3 chunks
        "be": rng.standard_normal((300, 100)).astype(">f8"),
        "fortran": np.asfortranarray(rng.standard_normal((200, 90))),
        "bf16": rng.standard_normal((1000, 700)).astype(ml_dtypes.bfloat16),
        "nested": np.arange(5, dtype=np.int64),
    }
    # save_file writes a Fortran array's memory as it lies (column-major bytes under a row-major
    # header); the export writes its values in C order, as a C-ordered copy gives them.
    save_file({**tensors, "fortran": np.ascontiguousarray(tensors["fortran"])}, tmp_path / "ref.safetensors")
    with cas_ckpt.open(tmp_path / "repo") as repo:
        repo.save({"a": {k: v for k, v in tensors.items() if k != "nested"}, "nested": tensors["nested"]})
        repo.export_safetensors("main", tmp_path / "out.safetensors")
        with pytest.raises(SafetensorsError, match="shards"):
            repo.export_safetensors("main", tmp_path / "x.safetensors", max_shard_size="1MB")
    ref = dict(deserialize((tmp_path / "ref.safetensors").read_bytes()))
    out = dict(deserialize((tmp_path / "out.safetensors").read_bytes()))
    assert {n.split(".")[-1]: v for n, v in out.items()} == ref  # names are dotted paths: a.big


def test_torch_state_dict_exports_as_torch_save_file(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file
    from safetensors.torch import save_file as torch_save

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.LayerNorm(300),
                                torch.nn.Linear(300, 5)).to(torch.bfloat16)
    sd = {**model.state_dict(), "mask": torch.rand(40) > 0.5}
    torch_save(sd, tmp_path / "ref.safetensors")
    with cas_ckpt.open("memory://") as repo:
        repo.save({"model": sd, "step": 7})
        repo.export_safetensors("main", tmp_path / "out.safetensors", path="model")
    assert (tmp_path / "out.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
    loaded = load_file(tmp_path / "out.safetensors")
    assert all(torch.equal(loaded[k], v) for k, v in sd.items())


def test_tied_weights_are_written_once_as_save_model_writes_them(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_model, save_model

    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(300, 64)
            self.norm = torch.nn.LayerNorm(64)
            self.head = torch.nn.Linear(64, 300, bias=False)
            self.head.weight = self.embed.weight  # tied, as language models tie them

    torch.manual_seed(0)
    model = Tied()
    save_model(model, str(tmp_path / "ref.safetensors"))
    with cas_ckpt.open("memory://") as repo:
        repo.save({"model": model.state_dict()})
        repo.export_safetensors("main", tmp_path / "out.safetensors", path="model", tied=True)
        repo.export_safetensors("main", tmp_path / "both.safetensors", path="model")
    assert (tmp_path / "out.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
    fresh = Tied()
    load_model(fresh, str(tmp_path / "out.safetensors"))
    assert torch.equal(fresh.head.weight, model.embed.weight)
    assert set(safetensors.numpy.load_file(tmp_path / "both.safetensors")) == set(model.state_dict())


def test_non_tensor_leaves_are_a_clear_error(tmp_path: Path) -> None:
    with cas_ckpt.open("memory://") as repo:
        repo.save({"model": {"w": np.ones(3)}, "step": 3})
        with pytest.raises(StateTypeError, match=r"step.*neither a tensor nor a str"):
            repo.export_safetensors("main", tmp_path / "x.safetensors")
        with pytest.raises(PathNotFound):
            repo.export_safetensors("main", tmp_path / "x.safetensors", path="modle")
        repo.save({"w": np.ones(3, dtype=ml_dtypes.int4)})
        with pytest.raises(StateTypeError, match="no safetensors dtype"):
            repo.export_safetensors("main", tmp_path / "x.safetensors")
        repo.save({"a": {"b": np.ones(2)}, "a.b": np.ones(2)})
        with pytest.raises(StateTypeError, match=r"two tensors are named 'a\.b'"):
            repo.export_safetensors("main", tmp_path / "x.safetensors")
    assert not list(tmp_path.iterdir())


# -- folders and shards --------------------------------------------------------------------------
def hf_sharded_folder(folder: Path, tensors: dict[str, np.ndarray], max_shard_size: int) -> None:
    """A folder as transformers' save_pretrained writes it, split by huggingface_hub itself."""
    from huggingface_hub.serialization import split_state_dict_into_shards_factory

    split = split_state_dict_into_shards_factory(
        tensors, get_storage_size=lambda a: a.nbytes, filename_pattern="model{suffix}.safetensors",
        max_shard_size=max_shard_size)
    folder.mkdir()
    for name, keys in split.filename_to_tensors.items():
        save_file({k: tensors[k] for k in keys}, folder / name, metadata={"format": "pt"})
    if split.is_sharded:
        index = {"metadata": {"total_parameters": sum(a.size for a in tensors.values()),
                              **split.metadata}, "weight_map": split.tensor_to_filename}
        (folder / hf.INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    (folder / "config.json").write_text('{"model_type": "bert"}\n')
    (folder / "sub").mkdir()
    (folder / "sub" / "tokenizer.json").write_bytes(bytes(range(256)) * 160)


def files_of(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}


def layer_tensors(seed: int = 0, layers: int = 6) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {"embed.weight": rng.standard_normal((500, 256)).astype(np.float32)}
    for i in range(layers):
        out[f"layer.{i}.weight"] = rng.standard_normal((256, 256)).astype(np.float32)
        out[f"layer.{i}.bias"] = np.zeros(256, np.float16)
    return out


def test_sharded_folder_round_trips_and_reshards_as_huggingface_hub(tmp_path: Path) -> None:
    tensors = layer_tensors()
    hf_sharded_folder(tmp_path / "src", tensors, 700_000)
    with cas_ckpt.open(tmp_path / "repo") as repo:
        repo.import_safetensors(tmp_path / "src", ref="m", prefix="weights")
        report = repo.export_safetensors("m", tmp_path / "out")
        assert report.exact
        assert files_of(tmp_path / "out") == files_of(tmp_path / "src")
        # Re-sharded by this library: the files huggingface_hub and save_file give for the tensors
        # in the order the import holds them (file by file, each in its data order).
        ordered = repo.load("m", path="weights")
        assert sorted(ordered) == sorted(tensors)
        hf_sharded_folder(tmp_path / "ref", ordered, 1_500_000)
        repo.export_safetensors("m", tmp_path / "resharded", max_shard_size=1_500_000)
        assert files_of(tmp_path / "resharded") == files_of(tmp_path / "ref")
        # ... and importing that stores next to nothing new: every tensor is already there.
        repo.import_safetensors(tmp_path / "resharded", ref="r")
        assert repo.last_save.bytes_written < 64 * 1024
        loaded = repo.load("r", path="model")
    assert all(np.array_equal(loaded[k], v) for k, v in tensors.items())


def test_sharded_export_of_a_checkpoint_loads_in_transformers_layout(tmp_path: Path) -> None:
    tensors = layer_tensors(1, layers=3)
    with cas_ckpt.open("memory://") as repo:
        repo.save({"model": tensors})
        repo.export_safetensors("main", tmp_path / "out", path="model", max_shard_size="400kB")
        with pytest.raises(ValueError, match="cannot read"):
            repo.export_safetensors("main", tmp_path / "x", max_shard_size="lots")
    index = json.loads((tmp_path / "out" / hf.INDEX).read_text())
    assert index["metadata"]["total_size"] == sum(a.nbytes for a in tensors.values())
    assert set(index["weight_map"]) == set(tensors)
    for name, file in index["weight_map"].items():
        with safetensors.safe_open(tmp_path / "out" / file, framework="numpy") as f:
            assert np.array_equal(f.get_tensor(name), tensors[name])


def test_real_model_folder_round_trips_and_a_fine_tune_stores_what_changed(tmp_path: Path) -> None:
    base = model_folder()
    with cas_ckpt.open(tmp_path / "repo") as repo:
        repo.import_safetensors(base, ref="base")
        report = repo.export_safetensors("base", tmp_path / "out")
        assert report.exact and files_of(tmp_path / "out") == files_of(base)
        # A fine-tune touching the last encoder layer, written by the real safetensors package.
        weights = dict(safetensors.numpy.load_file(base / "model.safetensors"))
        changed = [k for k in weights if k.startswith("encoder.layer.5.")]
        for key in changed:
            weights[key] = weights[key] + np.float32(1e-3)
        tuned = tmp_path / "tuned"
        tuned.mkdir()
        for p in base.rglob("*"):
            if p.is_file() and p.name != "model.safetensors":
                (tuned / p.relative_to(base)).parent.mkdir(parents=True, exist_ok=True)
                (tuned / p.relative_to(base)).write_bytes(p.read_bytes())
        with safetensors.safe_open(base / "model.safetensors", framework="numpy") as f:
            meta = f.metadata()
        save_file(weights, tuned / "model.safetensors", metadata=meta)
        repo.import_safetensors(tuned, ref="tuned")
        changed_bytes = sum(weights[k].nbytes for k in changed)
        new = repo.last_save.bytes_written
        assert changed_bytes <= new < changed_bytes + 256 * 1024
        repo.export_safetensors("tuned", tmp_path / "tuned-out")
        assert files_of(tmp_path / "tuned-out") == files_of(tuned)


def test_transformers_loads_a_resharded_export(tmp_path: Path) -> None:
    """The index and shards are what transformers' from_pretrained reads (transformers 5)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    with cas_ckpt.open(tmp_path / "repo") as repo:
        repo.import_safetensors(model_folder(), ref="base")
        report = repo.export_safetensors("base", tmp_path / "shards", max_shard_size="30MB")
    assert sum(f.endswith(".safetensors") for f in report.files) == 3
    resharded = transformers.AutoModel.from_pretrained(tmp_path / "shards").state_dict()
    original = transformers.AutoModel.from_pretrained(model_folder()).state_dict()
    assert resharded.keys() == original.keys()
    assert all(torch.equal(resharded[k], original[k]) for k in original)


def test_folder_with_sub_folders_keys_their_tensors_by_folder(tmp_path: Path) -> None:
    src = tmp_path / "pipe"
    (src / "unet").mkdir(parents=True)
    (src / "text").mkdir()
    save_file({"w": np.ones(3, np.float32)}, src / "unet" / "model.safetensors")
    save_file({"w": np.zeros(3, np.float32)}, src / "text" / "model.safetensors")
    (src / "model_index.json").write_text("{}")
    with cas_ckpt.open("memory://") as repo:
        repo.import_safetensors(src)
        assert sorted(repo.load("main", path=["model"])) == ["text/w", "unet/w"]
        repo.export_safetensors("main", tmp_path / "out")
        with pytest.raises(SafetensorsError, match="sub-folders"):
            repo.export_safetensors("main", tmp_path / "x", max_shard_size="1GB")
    assert files_of(tmp_path / "out") == files_of(src)


# -- streaming and memory ----------------------------------------------------------------------
def test_large_tensors_are_written_as_the_tree_writes_them(tmp_path: Path, monkeypatch: Any) -> None:
    """Tensors past hf.WINDOW are written a window at a time: the very node tree.write makes."""
    monkeypatch.setattr(hf, "WINDOW", 1 << 20)
    array = np.random.default_rng(3).standard_normal((1000, 700)).astype(np.float32)  # 2.7 MiB
    save_file({"x": array}, tmp_path / "x.safetensors")
    with cas_ckpt.open("memory://", chunk_size=65536) as repo:
        repo.import_safetensors(tmp_path / "x.safetensors")
        model = repo.blocks.get(repo.tree())
        node = cas_ckpt.codec.decode(model)["model"]["x"].cid
        repo.save(array, ref="plain")
        assert bytes(repo.tree("plain")) == node
        repo.export_safetensors("main", tmp_path / "y.safetensors")
    assert (tmp_path / "y.safetensors").read_bytes() == (tmp_path / "x.safetensors").read_bytes()


def test_tensors_of_more_than_16384_chunks_get_link_pages_as_the_tree_writes_them(
    tmp_path: Path, monkeypatch: Any
) -> None:
    monkeypatch.setattr(hf, "WINDOW", 8 << 20)  # the windowed writer, a window at a time
    array = np.arange((16384 * 4096 + 8192) // 8, dtype=np.int64)  # 64 MiB + 2 chunks of 4 KiB
    save_file({"x": array}, tmp_path / "x.safetensors")
    with cas_ckpt.open("memory://", chunk_size=4096) as repo:
        repo.import_safetensors(tmp_path / "x.safetensors")
        node = cas_ckpt.codec.decode(repo.blocks.get(repo.tree()))["model"]["x"].cid
        assert "chunk_pages" in cas_ckpt.codec.decode(repo.blocks.get(node)).value
        repo.save(array, ref="plain")
        assert bytes(repo.tree("plain")) == node
        repo.export_safetensors("main", tmp_path / "y.safetensors")
    assert (tmp_path / "y.safetensors").read_bytes() == (tmp_path / "x.safetensors").read_bytes()


PEAK = """
import sys, cas_ckpt

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

repo = cas_ckpt.open(sys.argv[2])
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak (VmHWM) starts again from the resident size now
before = status("VmRSS:")
if sys.argv[1] == "import":
    repo.import_safetensors(sys.argv[3], ref="m")
else:
    repo.export_safetensors("m", sys.argv[3])
print(status("VmHWM:") - before)
"""


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_import_and_export_memory_stays_well_under_the_file_size(tmp_path: Path) -> None:
    """Peak RSS growth of a separate process importing, then exporting, a 256 MiB file."""
    rng = np.random.default_rng(5)
    tensors = {f"t{i}": rng.integers(0, 255, 8 << 20, dtype=np.uint8).view(np.float32) for i in range(32)}
    save_file(tensors, tmp_path / "big.safetensors")
    del tensors
    size = (tmp_path / "big.safetensors").stat().st_size
    cas_ckpt.open(tmp_path / "repo").close()
    for verb, target in (("import", tmp_path / "big.safetensors"), ("export", tmp_path / "out.safetensors")):
        done = subprocess.run([sys.executable, "-c", PEAK, verb, str(tmp_path / "repo"), str(target)],
                              capture_output=True, text=True, check=True)
        assert int(done.stdout) < size / 4, (verb, int(done.stdout), size)
    assert (tmp_path / "out.safetensors").read_bytes() == (tmp_path / "big.safetensors").read_bytes()


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_a_folders_other_files_stream_in_and_out(tmp_path: Path) -> None:
    """issue #40: a 1 GiB optimizer.pt beside model.safetensors (a Trainer's checkpoint folder)
    peaked at 1.07 GB on import and 2.09 GB on export: the folder's other files were read
    whole. Peak RSS growth of a separate process importing, then exporting, a 200 MiB one."""
    folder = tmp_path / "checkpoint-500"
    folder.mkdir()
    save_file({"w": np.arange(1000, dtype=np.float32)}, folder / "model.safetensors")
    size = 200 << 20
    with open(folder / "optimizer.pt", "wb") as f:
        rng = np.random.default_rng(7)
        for _ in range(size >> 24):
            f.write(rng.bytes(1 << 24))
    (folder / "trainer_state.json").write_text('{"global_step": 500}')
    cas_ckpt.open(tmp_path / "repo").close()
    for verb, target in (("import", folder), ("export", tmp_path / "out")):
        done = subprocess.run([sys.executable, "-c", PEAK, verb, str(tmp_path / "repo"), str(target)],
                              capture_output=True, text=True, check=True)
        # Read whole, the file alone took 200 MiB (export: 400). Streamed: two 16 MiB windows.
        assert int(done.stdout) < size / 2, (verb, int(done.stdout), size)
    for name in ("model.safetensors", "optimizer.pt", "trainer_state.json"):
        assert (tmp_path / "out" / name).read_bytes() == (folder / name).read_bytes(), name


@settings(max_examples=25, deadline=None)
@given(size=st.sampled_from([0, 1, 16384, 16385, 70_000, 300_000, 1 << 20, 3_100_000]),
       window=st.sampled_from([1, 1 << 20, (1 << 20) + 12345, 8 << 20]), seed=st.integers(0, 3),
       repeats=st.booleans())
def test_a_streamed_file_is_stored_as_a_whole_one_is(
    size: int, window: int, seed: int, repeats: bool
) -> None:
    """``TreeWriter.write_blob`` reads a window at a time, yet stores what ``write`` stores for
    the whole bytes (the same chunks, so re-imports still share every block with old ones)."""
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 255, size, dtype=np.uint8).tobytes()
    if repeats:  # runs that repeat: FastCDC cuts them the same wherever they are
        data = (data[: size // 7 + 1] * 8)[:size]
    with cas_ckpt.open("memory://") as repo, repo.transaction() as txn:
        whole = txn.tree.write({"blobs": {"optimizer.pt": data}})
        blob = txn.tree.write_blob(io.BytesIO(data), window=window)
        streamed = txn.tree.write({"blobs": {"optimizer.pt": blob}})
    assert streamed == whole
    assert repo.load(cas_ckpt.CID.decode(streamed))["blobs"]["optimizer.pt"] == data


KILLED = """
import sys, cas_ckpt
repo = cas_ckpt.open(sys.argv[1])
print("importing", flush=True)
repo.import_safetensors(sys.argv[2], ref="m")
"""


def test_an_import_killed_midway_moves_no_ref_and_leaves_a_sound_repository(tmp_path: Path) -> None:
    rng = np.random.default_rng(9)
    tensors = {f"t{i}": rng.integers(0, 255, 4 << 20, dtype=np.uint8) for i in range(48)}  # 192 MiB
    save_file(tensors, tmp_path / "big.safetensors")
    with cas_ckpt.open(tmp_path / "repo") as repo:
        repo.save({"x": 1}, ref="m")
        before = repo.resolve("m")
    with subprocess.Popen([sys.executable, "-c", KILLED, str(tmp_path / "repo"),
                           str(tmp_path / "big.safetensors")], stdout=subprocess.PIPE, text=True) as proc:
        assert proc.stdout is not None and proc.stdout.readline() == "importing\n"
        deadline = time.monotonic() + 60
        while not list((tmp_path / "repo" / "tmp").glob("*.pack*")) and time.monotonic() < deadline:
            time.sleep(0.01)  # until a pack is being written: the kill lands mid-import
        proc.send_signal(signal.SIGKILL)
    assert proc.returncode == -signal.SIGKILL
    with cas_ckpt.open(tmp_path / "repo") as repo:
        assert repo.resolve("m") == before
        assert repo.fsck().ok
        repo.import_safetensors(tmp_path / "big.safetensors", ref="m")
        repo.export_safetensors("m", tmp_path / "out.safetensors")
    assert (tmp_path / "out.safetensors").read_bytes() == (tmp_path / "big.safetensors").read_bytes()


def test_processes_importing_at_once_each_get_their_ref(tmp_path: Path) -> None:
    """Fine-tunes of one base imported by four processes at once into one repository."""
    base = layer_tensors(6)
    for i in range(4):
        tuned = {**base, f"layer.{i}.weight": base[f"layer.{i}.weight"] + 1}
        hf_sharded_folder(tmp_path / f"ft{i}", tuned, 600_000)
    cas_ckpt.open(tmp_path / "repo").close()
    script = ("import sys, cas_ckpt\n"
              "cas_ckpt.open(sys.argv[1]).import_safetensors(sys.argv[2], ref=sys.argv[3])")
    procs = [subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "repo"),
                               str(tmp_path / f"ft{i}"), f"ft/{i}"]) for i in range(4)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0, 0, 0]
    with cas_ckpt.open(tmp_path / "repo") as repo:
        assert sorted(repo.refs()) == [f"ft/{i}" for i in range(4)]
        assert repo.fsck().ok
        for i in range(4):
            repo.export_safetensors(f"ft/{i}", tmp_path / f"out{i}")
            assert files_of(tmp_path / f"out{i}") == files_of(tmp_path / f"ft{i}")
        # the shared tensors are stored once: one model plus the four changed tensors, and nodes
        model = sum(a.nbytes for a in base.values())
        assert repo.stats().stored_bytes < model + 4 * base["layer.0.weight"].nbytes + (1 << 20)


def test_s3_repositories_import_and_export(s3_url: str, tmp_path: Path) -> None:
    tensors = layer_tensors(4, layers=2)
    hf_sharded_folder(tmp_path / "src", tensors, 500_000)
    with cas_ckpt.open(s3_url) as repo:
        repo.import_safetensors(tmp_path / "src", ref="m")
        repo.export_safetensors("m", tmp_path / "out")
    assert files_of(tmp_path / "out") == files_of(tmp_path / "src")


# -- validation ----------------------------------------------------------------------------------
T = '"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}'


def obj(*items: str) -> str:
    return "{" + ",".join(items) + "}"


CASES = {  # header text, data after it
    "plain": (obj(T), b"\0" * 4),
    "leading space": (" " + obj(T), b"\0" * 4),
    "trailing newline": (obj(T) + "\n", b"\0" * 4),
    "no tensors": ("{}", b""),
    "empty header": ("", b""),
    "data past the end": (obj(T), b"\0" * 5),
    "data missing": (obj(T), b"\0" * 3),
    "unknown field": ('{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":1}}', b"\0" * 4),
    "metadata int": (obj('"__metadata__":{"k":1}', T), b"\0" * 4),
    "metadata null": (obj('"__metadata__":null', T), b"\0" * 4),
    "empty tensor": ('{"a":{"dtype":"F32","shape":[0,3],"data_offsets":[0,0]}}', b""),
    "0-d": ('{"a":{"dtype":"F32","shape":[],"data_offsets":[0,4]}}', b"\0" * 4),
    "F4 odd": ('{"a":{"dtype":"F4","shape":[3],"data_offsets":[0,2]}}', b"\0" * 2),
    "gap": ('{"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}', b"\0" * 8),
    "overlap": ('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
                '"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}', b"\0" * 8),
    "wrong size": ('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}}', b"\0" * 4),
    "reversed": ('{"a":{"dtype":"F32","shape":[0],"data_offsets":[4,0]}}', b"\0" * 4),
    "out of order": (obj('"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}', T), b"\0" * 8),
    "array": ("[]", b""),
    "unknown dtype": ('{"a":{"dtype":"F99","shape":[1],"data_offsets":[0,4]}}', b"\0" * 4),
    "float shape": ('{"a":{"dtype":"F32","shape":[1.0],"data_offsets":[0,4]}}', b"\0" * 4),
    "bool shape": ('{"a":{"dtype":"F32","shape":[true],"data_offsets":[0,4]}}', b"\0" * 4),
    "negative": ('{"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}}', b"\0" * 4),
    "no offsets": ('{"a":{"dtype":"F32","shape":[1]}}', b"\0" * 4),
    "trailing NUL": (obj(T) + "\0", b"\0" * 4),
    "escaped name": ('{"\\u0061":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}', b"\0" * 4),
    "duplicate name": (obj(T, T), b"\0" * 4),
    "NaN in a field": ('{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":NaN}}', b"\0" * 4),
    "lone surrogate": ('{"\\ud800":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}', b"\0" * 4),
    "surrogate pair": ('{"\\ud83d\\ude00":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}', b"\0" * 4),
    "surrogate in metadata": (obj('"__metadata__":{"k":"\\udfff"}', T), b"\0" * 4),
    "not an object": ('{"a":[1]}', b""),
    "2 offsets expected": ('{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4,4]}}', b"\0" * 4),
    "float offset": ('{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4.0]}}', b"\0" * 4),
    "two negative dims": ('{"a":{"dtype":"F32","shape":[-1,-1],"data_offsets":[0,4]}}', b"\0" * 4),
    "F4 odd, size rounded down": ('{"a":{"dtype":"F4","shape":[3],"data_offsets":[0,1]}}', b"\0"),
    "metadata list": (obj('"__metadata__":[]', T), b"\0" * 4),
    "deeply nested": ("[" * 100_000 + "]" * 100_000, b""),
}


def safetensors_accepts(data: bytes) -> bool:
    try:
        deserialize(data)
    except Exception:  # the package raises SafetensorsError, and others
        return False
    return True


def ours_accepts(data: bytes) -> bool:
    try:
        hf.parse_header(data, len(data), "f")
    except SafetensorsError:
        return False
    return True


@pytest.mark.parametrize("case", sorted(CASES))
def test_validation_agrees_with_safetensors(case: str) -> None:
    text, tail = CASES[case]
    data = len(text.encode()).to_bytes(8, "little") + text.encode() + tail
    assert ours_accepts(data) == safetensors_accepts(data), case


@given(seed=st.binary(min_size=1, max_size=4), at=st.integers(0, 200), byte=st.integers(0, 255))
def test_validation_agrees_with_safetensors_on_damaged_headers(seed: bytes, at: int, byte: int) -> None:
    meta = {"k": seed.hex()}
    keep = [np.zeros(6, np.uint8), np.zeros(4, np.uint8)]
    specs = {"w": TensorSpec(dtype="float16", shape=[3], data_ptr=keep[0].ctypes.data, data_len=6),
             "b": TensorSpec(dtype="int32", shape=[1], data_ptr=keep[1].ctypes.data, data_len=4)}
    data = bytearray(serialize(specs, metadata=meta))
    data[at % len(data)] = byte
    assert ours_accepts(bytes(data)) == safetensors_accepts(bytes(data))


def test_header_limits(tmp_path: Path) -> None:
    with pytest.raises(SafetensorsError, match="over the 100000000 byte limit"):
        hf.parse_header((100_000_001).to_bytes(8, "little") + b"{}", 100_000_020, "f")
    with pytest.raises(SafetensorsError, match="too short"):
        hf.parse_header(b"\0\0", 2, "f")
    with pytest.raises(SafetensorsError, match="f: header length 1000 runs past the end of the file"):
        hf.parse_header((1000).to_bytes(8, "little") + b"{}", 10, "f")


def test_a_bad_file_names_file_and_tensor_and_commits_nothing(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    save_file({"good": np.ones(5000, np.float32)}, src / "a.safetensors")
    header = b'{"bad":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}'
    (src / "b.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 8)
    with cas_ckpt.open(tmp_path / "repo") as repo:
        with pytest.raises(SafetensorsError) as info:
            repo.import_safetensors(src, ref="m")
        assert info.value.file == str(src / "b.safetensors") and info.value.tensor == "bad"
        assert "b.safetensors: tensor 'bad': holds 8 bytes, but shape [3] of F32 needs 12" in str(info.value)
        assert repo.refs() == {} and len(repo.blocks) == 0
        with pytest.raises(StateTypeError, match="prefix"):
            repo.import_safetensors(src / "a.safetensors", prefix="safetensors")


@pytest.mark.parametrize(("info", "message"), [
    ({"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}, r"unknown dtype \['F32'\]"),
    ({"dtype": "F32", "shape": [1] * 100, "data_offsets": [0, 4]}, "shape of 100 dimensions: .* at most 64"),
    ({"dtype": "F32", "shape": [1] * 10_000, "data_offsets": [0, 4]}, "shape of 10000 dimensions"),
    ({"dtype": "F32", "shape": [2**63, 2**63, 0], "data_offsets": [0, 0]}, "overflows 64 bits"),
    ({"dtype": "U8", "shape": [2**62, 2, 0], "data_offsets": [0, 0]}, r"shape \[.*\] is larger than any"),
])
def test_an_import_of_a_hostile_header_names_file_and_tensor(
    tmp_path: Path, info: Any, message: str
) -> None:
    """issue #40: a dtype that is a list raised TypeError, and these shapes numpy's ValueError."""
    src = tmp_path / "src"
    src.mkdir()
    save_file({"good": np.ones(5, np.float32)}, src / "a.safetensors")
    header = json.dumps({"bad": info}).encode()
    size = info["data_offsets"][1]
    (src / "b.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + bytes(size))
    with cas_ckpt.open(tmp_path / "repo") as repo:
        with pytest.raises(SafetensorsError, match=message) as raised:
            repo.import_safetensors(src, ref="m")
        assert raised.value.file == str(src / "b.safetensors") and raised.value.tensor == "bad"
        assert repo.refs() == {} and len(repo.blocks) == 0


@pytest.mark.parametrize(("field", "value", "message"), [
    ("dtype", ["<f4"], r"stored dtype \['<f4'\] is not a name"),
    ("dtype", {"name": "<f4"}, "stored dtype .* is not a name"),
    ("shape", 2, "stored shape 2 is not a list"),
    ("shape", ["2"], r"stored shape \['2'\] is not a list"),
    ("shape", [1] * 65, "is not a list of at most 64 sizes"),
])
@pytest.mark.parametrize("path", [None, "model"])
def test_an_export_of_a_hostile_record_names_file_and_tensor_and_writes_nothing(
    tmp_path: Path, field: str, value: Any, message: str, path: str | None,
) -> None:
    """issue #40: a stored dtype that is a list or map, a shape that is an int or holds strings,
    raised TypeError (the record is data, not trusted)."""
    from cas_ckpt.codec import Link, Tagged

    save_file({"a": np.ones(3, np.float32), "w": np.ones(2, np.float32)}, tmp_path / "in.safetensors")
    with cas_ckpt.open("memory://") as repo:
        repo.import_safetensors(tmp_path / "in.safetensors")
        state = repo.load("main")
        array = {"dtype": "<f4", "shape": [2], "data": bytes(8), field: value}
        node = cas_ckpt.codec.encode(Tagged(hf.NDARRAY, array))
        with repo.blocks.writer() as writer:
            writer.put(repo.hasher.node(node), node)
        state["model"]["w"] = Link(repo.hasher.node(node))
        repo.save(state, ref="hostile")
        out = tmp_path / "out" / "x.safetensors"
        with pytest.raises(SafetensorsError, match=message) as raised:
            repo.export_safetensors("hostile", out, path=path)
    # The file named: the one re-created (an exact re-export), or the one being written.
    assert raised.value.tensor == "w"
    assert raised.value.file == ("in.safetensors" if path is None else str(out))
    assert not (tmp_path / "out").exists()


def test_an_export_of_a_file_name_holding_nul_writes_nothing(tmp_path: Path) -> None:
    """issue #40: a NUL byte in a stored file name raised ValueError, after the files before it
    were written; an export that fails now leaves nothing at all."""
    folder = tmp_path / "in"
    folder.mkdir()
    save_file({"w": np.ones(3, np.float32)}, folder / "model.safetensors")
    (folder / "config.json").write_text("{}")
    with cas_ckpt.open("memory://") as repo:
        repo.import_safetensors(folder)
        state = repo.load("main")
        state["safetensors"]["blobs"]["z\0.txt"] = b"x"
        repo.save(state, ref="evil")
        with pytest.raises(SafetensorsError, match="NUL byte"):
            repo.export_safetensors("evil", tmp_path / "out")
        assert not (tmp_path / "out").exists()
        (tmp_path / "existing").mkdir()
        with pytest.raises(SafetensorsError, match="NUL byte"):
            repo.export_safetensors("evil", tmp_path / "existing" / "deeper")
        assert list((tmp_path / "existing").iterdir()) == []


def test_a_name_in_two_files_of_a_folder_is_refused(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    save_file({"w": np.ones(5000, np.float32), "v": np.ones(3)}, tmp_path / "src" / "a.safetensors")
    save_file({"w": np.zeros(3, np.float32)}, tmp_path / "src" / "b.safetensors")
    with cas_ckpt.open(tmp_path / "repo") as repo:
        with pytest.raises(SafetensorsError, match=r"b\.safetensors: tensor 'w': a tensor of this name"):
            repo.import_safetensors(tmp_path / "src")
        assert repo.refs() == {}


def test_a_hostile_layout_cannot_write_outside_the_folder(tmp_path: Path) -> None:
    save_file({"w": np.ones(3, np.float32)}, tmp_path / "a.safetensors")
    with cas_ckpt.open("memory://") as repo:
        repo.import_safetensors(tmp_path / "a.safetensors")
        state = repo.load("main")
        state["safetensors"]["blobs"]["../escape.txt"] = b"x"
        repo.save(state, ref="evil")
        with pytest.raises(SafetensorsError, match="leaves the export folder"):
            repo.export_safetensors("evil", tmp_path / "out")
        state = repo.load("main")
        state["safetensors"]["files"][0]["header"] = "not bytes"
        repo.save(state, ref="malformed")
        with pytest.raises(SafetensorsError, match="layout record of this import is malformed"):
            repo.export_safetensors("malformed", tmp_path / "out")
        state = repo.load("main")
        state["model"]["w"] = np.ones(4, np.float32)  # a changed shape no longer fits the header
        repo.save(state, ref="changed")
        with pytest.raises(SafetensorsError, match="pass path="):
            repo.export_safetensors("changed", tmp_path / "c.safetensors")
        repo.export_safetensors("changed", tmp_path / "c.safetensors", path="model")
    assert not (tmp_path / "escape.txt").exists()
    assert safetensors.numpy.load_file(tmp_path / "c.safetensors")["w"].shape == (4,)


# -- the command line ----------------------------------------------------------------------------
def test_cli_imports_and_exports_files_folders_and_still_cars(tmp_path: Path, capsys: Any) -> None:
    def run(*argv: str) -> tuple[int, str, str]:
        code = cli.main(["--repo", str(tmp_path / "repo"), *argv])
        out, err = capsys.readouterr()
        return code, out, err

    assert cli.main(["init", str(tmp_path / "repo")]) == 0
    capsys.readouterr()
    tensors = layer_tensors(2, layers=2)
    hf_sharded_folder(tmp_path / "src", tensors, 400_000)
    code, out, _ = run("import", str(tmp_path / "src"), "--ref", "m", "--prefix", "w")
    assert code == 0 and out.startswith(f"imported {tmp_path / 'src'} as m:")
    code, out, _ = run("export", "m", "-o", str(tmp_path / "out"))
    assert code == 0 and out.startswith("re-created 6 files, 5 tensors")
    assert files_of(tmp_path / "out") == files_of(tmp_path / "src")
    code, out, _ = run("export", "m", "-o", str(tmp_path / "one.safetensors"), "--path", "w", "--json")
    assert code == 0 and json.loads(out)["tensors"] == 5
    code, _, err = run("export", "m", "-o", str(tmp_path / "x"), "--max-shard-size", "big")
    assert code == cli.EXIT_USAGE and "cannot read 'big'" in err
    code, _, err = run("import", str(tmp_path / "out" / "config.json"))
    assert code == cli.EXIT_ERROR and "CAR" in err  # not safetensors: read as a CAR, and refused
    assert run("export", "m", "-o", str(tmp_path / "m.car"))[0] == 0
    code, _, err = run("export", "m", "-o", str(tmp_path / "n.car"), "--path", "w")
    assert code == cli.EXIT_USAGE and "--path" in err
    code, out, _ = run("import", str(tmp_path / "m.car"), "--ref", "c")
    assert code == 0 and "CAR" in out
    code, _, err = run("import", str(tmp_path / "m.car"), "--prefix", "x")
    assert code == cli.EXIT_USAGE
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10" + b"\0" * 7 + b"{not json       ")
    code, _, err = run("import", str(bad))
    assert code == cli.EXIT_ERROR and f"{bad}: header is not JSON" in err


@pytest.mark.slow
def test_the_benchmark_runs_at_a_tiny_size(tmp_path: Path) -> None:
    """benchmarks/safetensors_bench.py end to end at 20 MiB: every operation, identical exports."""
    bench = Path(__file__).parent.parent / "benchmarks" / "safetensors_bench.py"
    done = subprocess.run([sys.executable, str(bench), "--gib", "0.02", "--reps", "1", "--json",
                           str(tmp_path / "r.json"), "--workdir", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads((tmp_path / "r.json").read_text())
    assert set(results["ops"]) == {"st_save", "st_load", "import", "import_again", "export",
                                   "export_path"}
    assert all(r["identical"] for op in ("export", "export_path") for r in results["ops"][op]["runs"])
    assert results["ops"]["import_again"]["runs"][0]["bytes_written"] < 64 * 1024
    real = results["real_model"]
    assert real["fine_tune_export_identical"]
    assert real["changed_bytes"] <= real["fine_tune"]["bytes_written"] < real["changed_bytes"] + (1 << 18)
