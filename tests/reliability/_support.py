"""Shared pieces of the reliability suite: workloads, exact digests, repository checks, figures.

Imported by the test modules (as ``._support``) and by the child scripts run in subprocesses (as
``_support``, from this directory), so it imports nothing from the test tree.

Figures: when ``CAS_CKPT_FIGURES`` names a file, every test adds what it tried (kills, crash points,
faults, fuzz inputs...) to that JSON file, so ``docs/reliability.md`` quotes real runs.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import struct
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

import cas_ckpt

LONG = os.environ.get("CAS_CKPT_LONG") == "1"
HERE = Path(__file__).resolve().parent
PYTHON = sys.executable


def child_env(**extra: str) -> dict[str, str]:
    """Environment for child scripts: this directory importable, one BLAS thread."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH", "")]))
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra)
    return env


@contextlib.contextmanager
def scratch_dir(fallback: Path) -> Iterator[Path]:
    """A tmpfs directory when there is one (fsyncs and many small files cost nothing there)."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        with tempfile.TemporaryDirectory(dir=shm, prefix="cas-ckpt-rel-") as tmp:
            yield Path(tmp)
    else:
        yield fallback


def append_line(log: str | os.PathLike[str], line: str) -> None:
    """Append ``line`` to the log a parent reads after killing its child: fsynced, whole."""
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------------------------
# Figures
# ----------------------------------------------------------------------------------------------
def record(section: str, **counts: Any) -> None:
    """Merge ``counts`` into ``section`` of the figures file (numbers add up, others replace)."""
    path = os.environ.get("CAS_CKPT_FIGURES")
    if not path:
        return
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            with open(path) as f:
                data = json.load(f)
        except (FileNotFoundError, ValueError):
            data = {}
        data.setdefault("_mode", "long" if LONG else "ci")
        entry = data.setdefault(section, {})
        for key, value in counts.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                entry[key] = entry.get(key, 0) + value
            else:
                entry[key] = value
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(data, f, indent=2, sort_keys=True)
        os.replace(tmp, path)


# ----------------------------------------------------------------------------------------------
# Workloads and exact digests
# ----------------------------------------------------------------------------------------------
_FROZEN: dict[int, np.ndarray[Any, Any]] = {}


def make_state(seed: int, i: int, *, scale: float = 1.0) -> dict[str, Any]:
    """A deterministic training-like state, about ``3.5 * scale`` MB.

    ``frozen`` is identical in every state of a seed (dedup across saves), ``opt`` changes every
    third save, ``w`` every save; a byte blob goes through content-defined chunking, and some saves
    carry a list long enough to be cut into pages.
    """
    rng = np.random.default_rng([seed, i])
    if seed not in _FROZEN:
        _FROZEN[seed] = np.random.default_rng([seed, 10**9]).standard_normal(
            int(300_000 * scale), dtype=np.float32
        )
    opt_rng = np.random.default_rng([seed, i // 3, 7])
    state: dict[str, Any] = {
        "step": i,
        "frozen": _FROZEN[seed],
        "w": rng.standard_normal(int(250_000 * scale), dtype=np.float32),
        "opt": {
            "m": opt_rng.standard_normal((int(300 * scale) + 1, 128)).astype(np.float16),
            "v": np.asfortranarray(opt_rng.random((64, int(200 * scale) + 1))),
            "count": np.int64(i // 3),
        },
        "blob": bytes(rng.integers(0, 256, int(120_000 * scale), dtype=np.uint8)),
        "meta": {"name": f"run-{seed}", "lr": 0.1 / (i + 1), "pair": (i, -0.0, None), "ok": True},
        "small": rng.integers(-5, 5, 16).astype(np.int8),
    }
    if i % 4 == 1:
        data = rng.integers(0, 256, (int(2000 * scale) + 1, 600), dtype=np.uint8)
        state["pages"] = [row.tobytes() for row in data]
    return state


def small_state(tag: str, i: int = 0) -> dict[str, Any]:
    """A small state (one chunked array, one inline) for quick saves."""
    rng = np.random.default_rng([len(tag), i, 99])
    return {"tag": tag, "i": i, "x": rng.standard_normal(20_000), "y": np.arange(i % 7 + 1)}


def digest(value: Any) -> str:
    """A hash of a state that changes with any difference a bit-exact load must not have.

    Covers types (tuple vs list, numpy scalar vs float), dict key order, float bits, array dtype
    (byte order included), shape, memory order and bytes.
    """
    h = hashlib.sha256()
    _feed(h, value)
    return h.hexdigest()[:32]


def _feed(h: Any, value: Any) -> None:
    kind = type(value)
    h.update(f"<{kind.__module__}.{kind.__qualname__}>".encode())
    if isinstance(value, dict):
        h.update(str(len(value)).encode())
        for key, item in value.items():
            _feed(h, key)
            _feed(h, item)
    elif isinstance(value, (list, tuple)):
        h.update(str(len(value)).encode())
        for item in value:
            _feed(h, item)
    elif isinstance(value, float):
        h.update(struct.pack("<d", value))
    elif isinstance(value, np.ndarray):
        order = "F" if value.flags.f_contiguous and not value.flags.c_contiguous else "C"
        h.update(f"{value.dtype.str}{value.shape}{order}".encode())
        h.update(np.ascontiguousarray(value).tobytes())
    elif isinstance(value, np.generic):
        h.update(value.dtype.str.encode() + np.asarray(value).tobytes())
    elif isinstance(value, (bytes, str)):
        data = value.encode("utf-8", "surrogatepass") if isinstance(value, str) else value
        h.update(str(len(data)).encode() + b":" + data)
    elif value is None or isinstance(value, (bool, int)):
        h.update(repr(value).encode())
    else:
        h.update(repr(value).encode())


# ----------------------------------------------------------------------------------------------
# Looking at a repository directory
# ----------------------------------------------------------------------------------------------
def leftovers(root: str | os.PathLike[str]) -> dict[str, list[str]]:
    """Temp packs, ref locks and temp files lying in a repository directory."""
    root = Path(root)
    found: dict[str, list[str]] = {"temp_packs": [], "locks": [], "temp_files": []}
    for path in sorted(root.rglob("*")):
        if not path.is_file() or path.is_symlink():
            continue
        rel = path.relative_to(root).as_posix()
        if rel.endswith(".pack.tmp"):
            found["temp_packs"].append(rel)
        elif rel.endswith(".lock") and not rel.startswith("locks/"):
            found["locks"].append(rel)
        elif rel.endswith(".tmp"):
            found["temp_files"].append(rel)
    return found


def packs_sound(root: str | os.PathLike[str]) -> list[str]:
    """Problems a fresh store sees in the packs: damaged packs, blocks not matching their CID."""
    problems: list[str] = []
    store = cas_ckpt.blocks.LocalStore(root, read_only=True)
    try:
        problems.extend(f"damaged pack {n}: {why}" for n, why in store.corrupt_packs.items())
        for cid in list(store.keys()):
            try:
                store.get(cid, verify=True)
            except cas_ckpt.CasCkptError as exc:
                problems.append(f"block {cid.hex()}: {exc}")
    finally:
        store.close()
    return problems


def fsck_problems(repo: cas_ckpt.Repository) -> list[str]:
    report = repo.fsck()
    out = [
        f"{p.kind} {p.cid}: {p.detail} (needed by {', '.join(map(str, p.needed_by))})"
        for p in report.problems
    ]
    out.extend(report.store_problems)
    return out


def load_digest(repo: cas_ckpt.Repository, target: Any) -> str:
    return digest(repo.load(target))


def parents_of(repo: cas_ckpt.Repository, cid: Any) -> list[str]:
    return [str(p) for p in repo.commit(cid).parents]


class Timer:
    def __init__(self) -> None:
        self.start = time.perf_counter()

    @property
    def seconds(self) -> float:
        return round(time.perf_counter() - self.start, 2)


def lines(path: str | os.PathLike[str]) -> Iterable[list[str]]:
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return []
    return [line.split() for line in text.splitlines() if line.strip()]
