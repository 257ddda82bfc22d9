"""Hugging Face model folders out of a sharded run (issue #49 item 4).

Two gloo ranks on 127.0.0.1 (``tests/scripts/dcp_worker.py``, scenarios ``hf`` and ``hfbig``)
save a DCP checkpoint through ``cas_ckpt.dcp.Writer``; ``cas-ckpt export REF --hf OUT`` (the
installed console script) and ``repo.export_safetensors`` write it as a model folder. Checked:
the files ``safetensors.torch.load_file`` reads equal the ranks' state bit for bit; the tensors'
names, dtypes, shapes and bytes equal what torch's own consolidation
(``HuggingFaceStorageWriter(save_distributed=True, enable_consolidation=True)``, which runs
``consolidate_safetensors_files``) writes for the same ranks and state, and every difference
``docs/cli.md`` lists is what torch writes; the export's peak memory stays within the largest
tensor + 64 MiB (256 MiB of state by default, 8 GiB with ``CAS_CKPT_LONG=1``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed.checkpoint")
safetensors_torch = pytest.importorskip("safetensors.torch")

import cas_ckpt  # noqa: E402
from cas_ckpt import hf  # noqa: E402
from cas_ckpt.cid import is_node  # noqa: E402
from cas_ckpt.cid import to_bytes as cid_bytes  # noqa: E402
from cas_ckpt.codec import Link, Tagged, decode  # noqa: E402
from cas_ckpt.errors import StateTypeError  # noqa: E402

pytestmark = [
    pytest.mark.torch,
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
]

WORKER = Path(__file__).parent / "scripts" / "dcp_worker.py"
CLI = Path(sys.executable).parent / "cas-ckpt"
MiB = 1024 * 1024


def _worker_module() -> Any:
    spec = importlib.util.spec_from_file_location("dcp_worker_hf", WORKER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


worker = _worker_module()


def run_ranks(scenario: str, repo: Path, out: Path, env: dict[str, str] | None = None,
              timeout: float = 120) -> None:
    """Run one scenario as 2 gloo processes; both must succeed."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    child_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    procs = [subprocess.Popen([sys.executable, str(WORKER), scenario, str(rank), "2", str(port),
                               str(repo), str(out)], env=child_env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT) for rank in range(2)]
    outputs = []
    for proc in procs:
        try:
            outputs.append(proc.communicate(timeout=timeout)[0].decode(errors="replace"))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
    codes = [p.returncode for p in procs]
    assert codes == [0, 0], (codes, outputs)


def cli(*args: str | Path, repo: Path) -> subprocess.CompletedProcess[str]:
    if not CLI.exists():
        pytest.skip("cas-ckpt console script not installed")
    return subprocess.run([str(CLI), "--repo", str(repo), *map(str, args)], capture_output=True,
                          text=True, timeout=300)


def header(path: Path) -> tuple[dict[str, Any], bytes, int]:
    """A safetensors file's header (parsed), its raw JSON bytes and where its data starts."""
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        raw = f.read(length)
    return json.loads(raw), raw, 8 + length


def tensor_bytes(path: Path) -> dict[str, tuple[str, list[int], bytes]]:
    """name -> (dtype, shape, raw bytes), straight from the file (no library in between)."""
    parsed, _, start = header(path)
    data = path.read_bytes()
    return {name: (info["dtype"], info["shape"],
                   data[start + info["data_offsets"][0]:start + info["data_offsets"][1]])
            for name, info in parsed.items() if name != "__metadata__"}


def load_folder(folder: Path) -> dict[str, Any]:
    """Every tensor of a model folder by ``load_file``, shards merged through the index."""
    index = folder / "model.safetensors.index.json"
    if not index.exists():
        return safetensors_torch.load_file(folder / "model.safetensors")
    merged: dict[str, Any] = {}
    weight_map = json.loads(index.read_text())["weight_map"]
    for name in sorted(set(weight_map.values())):
        part = safetensors_torch.load_file(folder / name)
        assert {k for k, v in weight_map.items() if v == name} == set(part)
        merged.update(part)
    return merged


def same_bits(a: Any, b: Any) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A repository 2 ranks saved ``hf_state`` into, and torch's consolidated folders of it."""
    base = tmp_path_factory.mktemp("hfdcp")
    repo, out = base / "repo", base / "out"
    out.mkdir()
    run_ranks("hf", repo, out)
    return repo, out


# --------------------------------------------------------------------------------------------
# The command line and the API
# --------------------------------------------------------------------------------------------
def test_hf_export_of_the_model_equals_the_saved_state(saved: tuple[Path, Path], tmp_path: Path) -> None:
    repo, _ = saved
    done = cli("export", "main", "--hf", tmp_path / "hf", "--path", "model", repo=repo)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("wrote 1 file, 6 tensors") and not done.stderr
    assert sorted(os.listdir(tmp_path / "hf")) == ["model.safetensors"]
    loaded = load_folder(tmp_path / "hf")
    full = worker.hf_full()  # fp32, bf16, f16, int64; shards < 1 MiB, 651+650 and 4+3 rows, Shard(1)
    assert set(loaded) == set(full)
    assert all(same_bits(loaded[name], t) for name, t in full.items())
    assert header(tmp_path / "hf" / "model.safetensors")[0]["__metadata__"] == {"format": "pt"}
    # the Python API: export_safetensors(model=True) writes the same file; without model= the
    # same tensors, without __metadata__ (it writes the state's strings there, and this path holds none)
    with cas_ckpt.open(repo) as r:
        report = r.export_safetensors("main", tmp_path / "api.safetensors", path="model", model=True)
        assert report.files == [str(tmp_path / "api.safetensors" / "model.safetensors")]
        r.export_safetensors("main", tmp_path / "plain", path="model")
    ours = (tmp_path / "hf" / "model.safetensors")
    assert Path(report.files[0]).read_bytes() == ours.read_bytes()
    assert tensor_bytes(tmp_path / "plain" / "model.safetensors") == tensor_bytes(ours)
    assert "__metadata__" not in header(tmp_path / "plain" / "model.safetensors")[0]


def test_hf_export_in_shards_with_an_index(saved: tuple[Path, Path], tmp_path: Path) -> None:
    repo, _ = saved
    out = tmp_path / "shards"
    done = cli("export", "main", "--hf", out, "--path", "model", "--max-shard-size", "3MiB", repo=repo)
    assert done.returncode == 0, done.stderr
    assert sorted(os.listdir(out)) == ["model-00001-of-00002.safetensors",
                                       "model-00002-of-00002.safetensors", "model.safetensors.index.json"]
    full = worker.hf_full()
    loaded = load_folder(out)
    assert set(loaded) == set(full) and all(same_bits(loaded[n], t) for n, t in full.items())
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"] == {"total_parameters": sum(t.numel() for t in full.values()),
                                 "total_size": sum(t.numel() * t.element_size() for t in full.values())}
    assert all((out / f).stat().st_size <= 3 * MiB + 4096 for f in set(index["weight_map"].values()))


def test_hf_export_of_the_whole_state_leaves_out_values(saved: tuple[Path, Path], tmp_path: Path) -> None:
    """Without --path: every tensor of the state (the optimizer's too) by its dotted name; ints,
    floats, tuples, lists and strings are left out and named on stderr (and in --json)."""
    repo, _ = saved
    done = cli("export", "main", "--hf", tmp_path / "all", repo=repo)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ("cas-ckpt: note: left out 3 values holding no tensor: optim.param_groups, "
                           "step, run\n")
    loaded = load_folder(tmp_path / "all")
    full = worker.hf_full()
    assert set(loaded) == {f"model.{n}" for n in full} | {
        "optim.state.embed.weight.exp_avg", "optim.state.embed.weight.step"}
    assert same_bits(loaded["optim.state.embed.weight.exp_avg"], full["embed.weight"] * 0.5 + 3.0)
    assert same_bits(loaded["optim.state.embed.weight.step"], torch.tensor(7.0))
    done = cli("export", "main", "--hf", tmp_path / "opt", "--path", "optim", "--json", repo=repo)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["skipped"] == ["optim.param_groups"]
    # -o keeps refusing what safetensors cannot hold; so does the API without --path
    done = cli("export", "main", "-o", tmp_path / "x.safetensors", repo=repo)
    assert done.returncode == 5 and "optim.param_groups.0.lr: a value of type float" in done.stderr
    with cas_ckpt.open(repo) as r, pytest.raises(StateTypeError, match=r"optim\.param_groups\.0\.lr"):
        r.export_safetensors("main", tmp_path / "y")
    done = cli("export", "main", "--hf", tmp_path / "none", "--path", "step", repo=repo)
    assert done.returncode == 5 and "step: holds no tensor" in done.stderr
    assert not (tmp_path / "x.safetensors").exists() and not (tmp_path / "none").exists()


def test_exactly_one_of_output_and_hf(saved: tuple[Path, Path], tmp_path: Path) -> None:
    repo, _ = saved
    done = cli("export", "main", "-o", tmp_path / "x.car", "--hf", tmp_path / "hf", repo=repo)
    assert done.returncode == 2 and "argument --hf: not allowed with argument -o/--output" in done.stderr
    done = cli("export", "main", repo=repo)
    assert done.returncode == 2 and "one of the arguments -o/--output --hf is required" in done.stderr
    assert not list(tmp_path.iterdir())


class RecordingStore:
    """A block store that records every CID it is asked about."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self.seen: set[bytes] = set()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            for arg in (*args, *kwargs.values()):
                if isinstance(arg, (bytes, bytearray)):
                    self.seen.add(bytes(arg))
                elif isinstance(arg, (list, tuple)):
                    self.seen.update(bytes(a) for a in arg if isinstance(a, (bytes, bytearray)))
            return attr(*args, **kwargs)

        return call


def _blocks_below(store: Any, value: Any, found: set[bytes]) -> set[bytes]:
    """Every block a decoded value links to, transitively."""
    if isinstance(value, Link):
        if value.cid not in found:
            found.add(value.cid)
            if is_node(value.cid):
                _blocks_below(store, decode(store.get(value.cid), cid=value.cid), found)
    elif isinstance(value, Tagged):
        _blocks_below(store, value.value, found)
    elif isinstance(value, dict):
        for item in value.values():
            _blocks_below(store, item, found)
    elif isinstance(value, list):
        for item in value:
            _blocks_below(store, item, found)
    return found


def test_path_model_reads_nothing_of_the_optimizer(saved: tuple[Path, Path], tmp_path: Path) -> None:
    repo_path, _ = saved
    with cas_ckpt.open(repo_path) as repo:
        tree = cid_bytes(repo.tree("main"))
        root = decode(repo.blocks.get(tree), cid=tree)
        optim = _blocks_below(repo.blocks, root["optim"], set())
        model = _blocks_below(repo.blocks, root["model"], set())
        assert len(optim) >= 3 and not optim & model  # exp_avg: 3 chunks of 1 MiB
        recording = RecordingStore(repo.blocks)
        hf.export(recording, repo.pool, tree, tmp_path / "hf", path="model", model=True)
        assert model - recording.seen == set()  # every chunk of the model read...
        assert not optim & recording.seen  # ...and no block of the optimizer's


def test_an_imported_file_comes_back_as_a_model_folder(tmp_path: Path) -> None:
    """A file imported alone is re-created byte for byte, as OUT/model.safetensors."""
    tensors = {"a": torch.arange(10.0), "b": torch.ones(3, 4, dtype=torch.bfloat16)}
    safetensors_torch.save_file(tensors, tmp_path / "weights.safetensors", metadata={"format": "pt"})
    repo = tmp_path / "repo"
    with cas_ckpt.open(repo) as r:
        r.import_safetensors(tmp_path / "weights.safetensors", ref="base")
    done = cli("export", "base", "--hf", tmp_path / "hf", repo=repo)
    assert done.returncode == 0 and done.stdout.startswith("re-created 1 file"), done.stderr
    assert os.listdir(tmp_path / "hf") == ["model.safetensors"]
    original = (tmp_path / "weights.safetensors").read_bytes()
    assert (tmp_path / "hf" / "model.safetensors").read_bytes() == original


# --------------------------------------------------------------------------------------------
# Against torch's own consolidation
# --------------------------------------------------------------------------------------------
def test_the_same_tensors_as_torchs_consolidation(saved: tuple[Path, Path], tmp_path: Path) -> None:
    """Names, dtypes, shapes and bytes equal torch's; the differences are those docs/cli.md lists."""
    repo, out = saved
    assert cli("export", "main", "--hf", tmp_path / "one", "--path", "model", repo=repo).returncode == 0
    ours = tensor_bytes(tmp_path / "one" / "model.safetensors")
    theirs = tensor_bytes(out / "torch-one" / "model-00001-of-00001.safetensors")
    # torch's consolidation takes float tensors only (it sizes elements with torch.finfo)
    assert set(ours) - set(theirs) == {"pos_ids"} and set(theirs) <= set(ours)
    for name, (dtype, shape, data) in theirs.items():
        assert ours[name] == (dtype, shape, data), name
    # the differences: file names and count, an index for one file, the header
    assert sorted(p.name for p in (out / "torch-one").iterdir()) == [
        "model-00001-of-00001.safetensors", "model.safetensors.index.json", "sharded"]
    assert sorted(p.name for p in (out / "torch-one" / "sharded").iterdir()) == [
        "shard-00001-model-00001-of-00001.safetensors", "shard-00002-model-00001-of-00001.safetensors"]
    ours_header, ours_raw, ours_start = header(tmp_path / "one" / "model.safetensors")
    theirs_header, theirs_raw, _ = header(out / "torch-one" / "model-00001-of-00001.safetensors")
    assert ours_header["__metadata__"] == {"format": "pt"} and "__metadata__" not in theirs_header
    assert ours_start % 8 == 0 and b": " not in ours_raw and b'"shape": ' in theirs_raw
    order = [n for n in ours_header if n != "__metadata__"]
    assert order == sorted(order, key=lambda n: (-hf.RANK[ours_header[n]["dtype"]], n))  # save_file's

    # In shards: the same split (huggingface_hub's, in state order), the same weight_map
    shards = tmp_path / "shards"
    done = cli("export", "main", "--hf", shards, "--path", "model", "--max-shard-size",
               str(worker.HF_SHARD_LIMIT), repo=repo)
    assert done.returncode == 0, done.stderr
    ours_index = json.loads((shards / "model.safetensors.index.json").read_text())
    theirs_index = json.loads((out / "torch-shards" / "model.safetensors.index.json").read_text())
    assert {k: v for k, v in ours_index["weight_map"].items() if k in theirs} == theirs_index["weight_map"]
    assert set(theirs_index["metadata"]) == {"total_size"}
    assert set(ours_index["metadata"]) == {"total_parameters", "total_size"}
    assert ours_index["metadata"]["total_size"] == theirs_index["metadata"]["total_size"] + 4096 * 8
    for name in sorted(set(theirs_index["weight_map"].values())):
        ours_file, theirs_file = tensor_bytes(shards / name), tensor_bytes(out / "torch-shards" / name)
        assert {k: v for k, v in ours_file.items() if k in theirs_file} == theirs_file, name


# --------------------------------------------------------------------------------------------
# Memory
# --------------------------------------------------------------------------------------------
PEAK = """
import json, sys
from cas_ckpt import cli

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak (VmHWM) starts again from the resident size now
before = status("VmRSS:")
code = cli.main(sys.argv[1:])
print(json.dumps({"code": code, "peak": status("VmHWM:") - before}))
"""


def export_peak(size_mib: int, tmp_path: Path) -> None:
    """2 ranks save ``size_mib`` MiB of fp32 (one tensor a quarter of it); ``export --hf`` in a
    process of its own must peak at most the largest tensor + 64 MiB above where it started, and
    write the ranks' bytes."""
    repo, out = tmp_path / "repo", tmp_path / "out"
    out.mkdir()
    run_ranks("hfbig", repo, out, env={"CAS_CKPT_HF_MIB": str(size_mib)}, timeout=1200)
    layout = worker.big_layout(size_mib)
    largest = max(rows * cols * 4 for rows, cols in layout.values())
    total = sum(rows * cols * 4 for rows, cols in layout.values())
    assert total == size_mib * MiB and largest == total // 4
    done = subprocess.run([sys.executable, "-c", PEAK, "--repo", str(repo), "export", "main",
                           "--hf", str(tmp_path / "hf"), "--path", "model"],
                          capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    print(f"export --hf of {size_mib} MiB (largest tensor {largest // MiB} MiB): peak "
          f"{result['peak'] / MiB:.1f} MiB above the start")
    assert result["code"] == 0
    assert result["peak"] <= largest + 64 * MiB, (result["peak"], largest)
    shutil.rmtree(repo)  # the long mode's 8 GiB: one copy on disk at a time
    with safetensors_torch.safe_open(tmp_path / "hf" / "model.safetensors", "pt") as f:
        assert set(f.keys()) == set(layout)
        for name, shape in layout.items():
            assert list(f.get_slice(name).get_shape()) == list(shape)
            start = 0
            for rank in range(2):
                part = worker.big_shard(name, shape, rank, 2)
                assert same_bits(f.get_slice(name)[start:start + part.shape[0]], part), (name, rank)
                start += part.shape[0]
            assert start == shape[0]


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_export_memory_stays_within_the_largest_tensor(tmp_path: Path) -> None:
    export_peak(256, tmp_path)


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_export_memory_of_8_gib_of_state(tmp_path: Path) -> None:
    """CAS_CKPT_LONG=1: 8 GiB saved by 2 ranks (largest tensor 2 GiB), 16 GiB of disk at most."""
    try:
        export_peak(8192, tmp_path)
    finally:
        shutil.rmtree(tmp_path, ignore_errors=True)

