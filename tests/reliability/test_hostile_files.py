"""Hostile or odd files on the ref side of a local repository: FIFOs, directories, huge sparse
files and deeply nested JSON where refs, reflogs, pins, locks and the config live.

Each case plants one file in a fresh repository (refs ``main`` and ``other``), then a forked worker
(``_hostile_child.py``) opens it and runs every user operation; a hang is a failure after 10 s. Every
operation must either work or raise a cas_ckpt error, the ones touching the planted file
``CorruptStore`` naming it (never a bare ``OSError``, ``MemoryError`` or ``RecursionError``), and
fsck must report it. Local filesystem (pytest's ``tmp_path``); no root needed.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import cas_ckpt

from ._support import HERE, PYTHON, child_env, record

Plant = Callable[[Path], None]


def fifo(path: Path) -> None:
    path.unlink(missing_ok=True)
    os.mkfifo(path)


def directory(path: Path, *stray: str) -> None:
    path.unlink(missing_ok=True)
    path.mkdir()
    for name in stray:
        (path / name).write_text("not cas_ckpt's\n")


def instead_of_dir(make: Plant) -> Plant:
    """Replace the directory ``path`` (and everything in it) by what ``make`` creates."""

    def plant(path: Path) -> None:
        shutil.rmtree(path)
        make(path)

    return plant


def nested(depth: int) -> Plant:
    def plant(path: Path) -> None:
        for _ in range(depth):  # os.makedirs itself would recurse too deep
            path = path / "d"
            path.mkdir()

    return plant


def unnest(path: Path) -> None:
    """Remove what ``nested`` made, bottom up: shutil.rmtree (and so pytest's cleanup of old
    temporary directories, in this and later sessions) would recurse too deep on it."""
    chain = [path / "d"]
    while (chain[-1] / "d").is_dir():
        chain.append(chain[-1] / "d")
    for directory in reversed(chain):
        with contextlib.suppress(FileNotFoundError):
            directory.rmdir()


def sparse(path: Path) -> None:
    with open(path, "ab") as f:
        f.truncate(4 << 30)  # 4 GiB of zeros, no newline, nearly no disk


def deep(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def replace_with(data: bytes) -> Plant:
    return lambda path: path.write_bytes(data)


def append_line(data: bytes) -> Plant:
    def plant(path: Path) -> None:
        with open(path, "ab") as f:
            f.write(data + b"\n")

    return plant


# What a case expects of each operation: "bad" = CorruptStore naming the planted path,
# "ok" = works, an error class name = that cas_ckpt error. Operations not listed may do either,
# as long as any error is a cas_ckpt error. "fsck" expects a report naming the path.
BAD, OK = "bad", "ok"
REF = {"refs": BAD, "resolve": BAD, "fsck": BAD, "gc": BAD, "save": BAD, "pins": OK}
# GC reads every reflog (its entries younger than 30 days are roots): one it cannot read stops it.
REFLOG = {"refs": OK, "resolve": OK, "load": OK, "reflog": BAD, "fsck": BAD, "gc": BAD, "save": BAD}
CONFIG = {"open": BAD}
PIN = {"refs": OK, "load": OK, "pins": BAD, "fsck": BAD, "gc": BAD, "pin": BAD, "unpin": BAD}
LOCK = {"refs": OK, "load": OK, "save": BAD}
CASES: dict[str, tuple[str, Plant, dict[str, str]]] = {
    "fifo-ref": ("refs/main", fifo, REF),
    "fifo-reflog": ("logs/main", fifo, REFLOG),
    "fifo-config": ("config.json", fifo, CONFIG),
    "fifo-pin": ("pins/{other}", fifo, PIN),
    "fifo-ref-lock": ("locks/refs.lock", fifo, LOCK),
    "fifo-gc-lock": ("locks/gc.lock", fifo, {**LOCK, "gc": BAD}),
    "dir-ref-empty": ("refs/main", directory, {"resolve": "RefNotFound", "save": OK}),
    "dir-ref-stray": ("refs/main", lambda p: directory(p, ".stray"), {"save": BAD}),
    "dir-reflog": ("logs/main", lambda p: directory(p, ".stray"), {**REFLOG, "gc": OK}),  # no reflog name
    "dir-config": ("config.json", directory, CONFIG),
    "dir-pin": ("pins/{other}", directory, PIN),
    "dir-ref-lock": ("locks/refs.lock", directory, LOCK),
    "sparse-ref": ("refs/main", sparse, REF),
    "sparse-reflog": ("logs/main", sparse, REFLOG),
    "sparse-config": ("config.json", sparse, CONFIG),
    "deep-config": ("config.json", replace_with(deep(200_000)), CONFIG),
    # A listing that silently comes back empty would let GC delete every checkpoint.
    "file-refs-dir": ("refs", instead_of_dir(replace_with(b"main\n")), {"refs": BAD, "gc": BAD}),
    "fifo-refs-dir": ("refs", instead_of_dir(fifo), {"refs": BAD, "gc": BAD, "fsck": BAD}),
    "fifo-logs-dir": ("logs", instead_of_dir(fifo), {"refs": OK, "fsck": BAD}),
    "file-pins-dir": ("pins", instead_of_dir(replace_with(b"")), {"pins": BAD, "gc": BAD}),
    "fifo-locks-dir": ("locks", instead_of_dir(fifo), {**LOCK, "gc": BAD}),
    "deep-refs-tree": ("refs", nested(1500), {"refs": BAD, "gc": BAD, "fsck": BAD}),
    "deep-reflog-line": ("logs/main", append_line(deep(200_000)), {"reflog": BAD, "fsck": BAD}),
    "deep-short-reflog-line": ("logs/main", append_line(deep(20_000)), {"reflog": BAD, "fsck": BAD}),
}


@pytest.fixture(scope="module")
def zygote() -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen(
        [PYTHON, str(HERE / "_hostile_child.py")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=child_env(),
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    try:
        yield proc
    finally:
        proc.kill()
        proc.communicate()


def _run(zygote: subprocess.Popen[str], root: Path) -> tuple[str, dict[str, dict[str, Any]]]:
    assert zygote.stdin is not None and zygote.stdout is not None
    results = root.parent / "results.jsonl"
    zygote.stdin.write(f"{root} {results}\n")
    zygote.stdin.flush()
    status = zygote.stdout.readline().strip()
    lines = results.read_text().splitlines() if results.exists() else []
    return status, {(r := json.loads(line))["op"]: r for line in lines}


@pytest.mark.parametrize("case", sorted(CASES))
def test_hostile_file_is_reported_not_followed(
    tmp_path: Path, zygote: subprocess.Popen[str], case: str
) -> None:
    where, plant, expected = CASES[case]
    root = tmp_path / "repo"
    with cas_ckpt.open(root) as repo:
        repo.save({"a": 1})
        other = repo.save({"b": 2}, ref="other")
    path = root / where.format(other=other)
    plant(path)
    try:
        status, outcomes = _run(zygote, root)
    finally:
        if path.is_dir():
            unnest(path)
    done = list(outcomes)
    assert status == "done", f"hung after {done}: the next operation never returned"
    for op, result in outcomes.items():
        assert result["ok"] or result["cas"], f"{op}: bare {result['error']}: {result['message']}"
    for op, want in expected.items():
        result = outcomes.get(op)
        assert result is not None, f"{op} did not run (after {done})"
        if op == "fsck":
            named = [p for p in result["problems"] if str(path) in p]
            assert result["ok"] and named, f"fsck does not name {path}: {result}"
        elif want == OK:
            assert result["ok"], f"{op} failed: {result['error']}: {result['message']}"
        elif want == BAD:
            assert result.get("error") == "CorruptStore" and str(path) in result["message"], (
                f"{op}: wanted CorruptStore naming {path}, got {result}"
            )
        else:
            assert result.get("error") == want, f"{op}: wanted {want}, got {result}"
    record("hostile_files", cases=1)


def test_deeply_nested_json_on_s3_is_corrupt_store(s3_url: str) -> None:
    """The same for S3 objects: a reflog entry and config.json nested 200,000 deep (moto, LocalStack)."""
    import boto3

    with cas_ckpt.open(s3_url) as repo:
        repo.save({"a": 1})
    bucket, _, prefix = s3_url[len("s3://") :].partition("/")
    client = boto3.client("s3")
    ref = client.get_object(Bucket=bucket, Key=f"{prefix}/refs/main")["Body"].read().decode()
    entry = f"{prefix}/logs/main/{ref.split()[1]}.json"
    client.put_object(Bucket=bucket, Key=entry, Body=deep(200_000))
    with cas_ckpt.open(s3_url) as repo, pytest.raises(cas_ckpt.errors.CorruptStore) as info:
        repo.reflog("main")
    assert entry in str(info.value) and "nested too deeply" in str(info.value)
    client.put_object(Bucket=bucket, Key=f"{prefix}/config.json", Body=deep(200_000))
    with pytest.raises(cas_ckpt.errors.CorruptStore, match=r"config\.json: not valid JSON: nested"):
        cas_ckpt.open(s3_url)
