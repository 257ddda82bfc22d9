"""Exact comparison of states (type, dtype, shape, layout and bits, recursively), running a
training script until a step to SIGKILL it there, damaging a byte of a file, a block store
that counts what is read, and a history as the commit blocks alone give it."""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

import cas_ckpt
from cas_ckpt import cid as cidlib
from cas_ckpt import codec
from cas_ckpt.blocks.base import BlockStore, BlockWriter
from cas_ckpt.commit import Commit, parse_commit
from cas_ckpt.errors import BlockNotFound


def assert_state_equal(expected: Any, actual: Any, path: str = "<root>") -> None:
    """Assert ``actual`` is ``expected`` as a checkpoint must give it back.

    Types must match exactly (a tuple is not a list, ``np.float32`` is not ``float``, ``True`` is not
    ``1``), dict keys must come in the same order, floats must have the same bits (NaN payloads,
    -0.0), arrays the same dtype (byte order included), shape and bytes, and a Fortran-ordered array
    must come back Fortran-ordered.
    """
    assert type(actual) is type(expected), (
        f"{path}: type {type(actual).__name__} != expected {type(expected).__name__}"
    )
    if isinstance(expected, dict):
        keys = [(type(k), k) for k in actual]
        assert keys == [(type(k), k) for k in expected], (
            f"{path}: keys {list(actual)} != {list(expected)} (order and types count)"
        )
        for key in expected:
            assert_state_equal(expected[key], actual[key], f"{path}.{key}")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), f"{path}: length {len(actual)} != {len(expected)}"
        for i, (e, a) in enumerate(zip(expected, actual, strict=True)):
            assert_state_equal(e, a, f"{path}.{i}")
    elif isinstance(expected, float):
        assert struct.pack("<d", actual) == struct.pack("<d", expected), (
            f"{path}: float bits {actual!r} != {expected!r}"
        )
    elif isinstance(expected, np.ndarray):
        _assert_array_equal(expected, actual, path)
    elif isinstance(expected, np.generic):
        assert actual.dtype == expected.dtype, f"{path}: dtype {actual.dtype} != {expected.dtype}"
        assert np.asarray(actual).tobytes() == np.asarray(expected).tobytes(), f"{path}: bits"
    else:
        assert actual == expected, f"{path}: {actual!r} != {expected!r}"


def _assert_array_equal(expected: np.ndarray[Any, Any], actual: np.ndarray[Any, Any], path: str) -> None:
    assert actual.dtype == expected.dtype and actual.dtype.str == expected.dtype.str, (
        f"{path}: dtype {actual.dtype.str} ({actual.dtype}) != {expected.dtype.str} ({expected.dtype})"
    )
    assert actual.shape == expected.shape, f"{path}: shape {actual.shape} != {expected.shape}"
    if expected.flags.f_contiguous and not expected.flags.c_contiguous:
        assert actual.flags.f_contiguous, f"{path}: Fortran order was lost"
    assert np.ascontiguousarray(actual).tobytes() == np.ascontiguousarray(expected).tobytes(), (
        f"{path}: array bytes differ"
    )


def run_training_script(
    script: Path, work: Path, *args: str, pause_at: int | None = None, timeout: float = 300
) -> str:
    """Run ``script work *args``; with ``pause_at``, SIGKILL it once it prints ``REACHED <step>``.

    Returns its output (up to the ``REACHED`` line when killed).
    """
    cmd = [sys.executable, str(script), str(work), *args]
    if pause_at is None:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout
    proc = subprocess.Popen([*cmd, "--pause-at", str(pause_at)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines: list[str] = []
        while not lines or not lines[-1].startswith("REACHED"):
            line = proc.stdout.readline()  # type: ignore[union-attr]
            assert line, "".join(lines) + proc.stderr.read()[-3000:]  # type: ignore[union-attr]
            lines.append(line)
        assert lines[-1].strip() == f"REACHED {pause_at}", lines[-1]
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        proc.kill()
        proc.communicate()
    return "".join(lines)


def assert_bit_identical(a: Any, b: Any, path: str = "") -> None:
    """Same structure, same types, same bytes (NaN payloads and -0.0 included)."""
    assert type(a) is type(b), path
    if isinstance(a, dict):
        assert list(a) == list(b), path
        for key in a:
            assert_bit_identical(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_bit_identical(x, y, f"{path}.{i}")
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), path
    elif type(a).__module__.startswith("torch"):
        import torch

        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), path
    elif isinstance(a, float):
        assert a.hex() == b.hex(), path
    else:
        assert a == b, path


def flip_byte(path: str | Path, position: int, mask: int = 0x01) -> None:
    """Damage a file in place: XOR the byte at ``position`` with ``mask``."""
    with open(path, "r+b") as f:
        f.seek(position)
        byte = f.read(1)
        f.seek(position)
        f.write(bytes([byte[0] ^ mask]))


class CountingStore(BlockStore):
    """Delegates to a real store and records every block read (and size lookup) by CID."""

    def __init__(self, inner: BlockStore) -> None:
        super().__init__(verify=inner.verify)
        self.inner = inner
        self.reads: list[bytes] = []
        self.sized: list[bytes] = []

    def _read(self, cid: bytes) -> bytes | None:
        self.reads.append(cid)
        return self.inner._read(cid)

    def _read_into(self, cid: bytes, out: memoryview) -> bool:
        self.reads.append(cid)
        return self.inner._read_into(cid, out)

    def _size(self, cid: bytes) -> int:
        self.sized.append(cid)
        return self.inner.size(cid)

    def _has(self, cid: bytes) -> bool:
        return self.inner.has(cid)

    def keys(self) -> Iterator[bytes]:
        return self.inner.keys()

    def writer(self, *, verify_existing: bool = False, verify_incoming: bool = False,
               compression: str = "none") -> BlockWriter:
        return self.inner.writer(verify_existing=verify_existing, verify_incoming=verify_incoming,
                                 compression=compression)

    def delete(
        self, cids: set[bytes], *, min_age: float = 0.0, before_unlink: Callable[[], None] | None = None
    ) -> tuple[int, int]:
        return self.inner.delete(cids, min_age=min_age, before_unlink=before_unlink)

    def refresh(self, *, full: bool = False, learn: bool = True) -> None:
        self.inner.refresh(full=full, learn=learn)

    def close(self) -> None:
        self.inner.close()

    def reset(self) -> None:
        self.reads.clear()
        self.sized.clear()

    def bytes_read(self) -> int:
        return sum(self.inner.size(c) for c in self.reads)


def plant(path: Path, kind: str) -> None:
    """Put a ``directory`` (holding a file), a ``fifo`` or a ``dangling-link`` at ``path``, where
    a regular file belongs."""
    if kind == "directory":
        path.mkdir()
        (path / "kept").write_text("not cas_ckpt's\n")
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to(path.parent / "nowhere")


def from_blocks(repo: cas_ckpt.Repository, head: Any) -> list[Commit]:
    """``repo.log(head)`` as the commit blocks alone give it (no commit graph involved)."""
    found: list[Commit] = []
    cid: bytes | None = cidlib.to_bytes(head)
    while cid is not None:
        try:
            data = repo.blocks.get(cid)
        except BlockNotFound:
            break
        commit = parse_commit(cid, codec.decode(data, cid=cid))
        found.append(commit)
        cid = bytes(commit.parents[0]) if commit.parents else None
    return found
