"""The repository: creating and opening, config, hashes, history, refs, targets and metadata."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import assert_state_equal
from multiformats import CID

import cas_ckpt
from cas_ckpt import cid as cidlib


# -- creating and opening ------------------------------------------------------------------------
def test_open_creates_a_repository(tmp_path: Path) -> None:
    path = tmp_path / "new" / "repo"
    with cas_ckpt.open(path) as repo:
        assert repo.refs() == {}
    assert (path / "config.json").is_file()
    for sub in ("refs", "logs", "packs", "tmp"):
        assert (path / sub).is_dir(), sub
    config = json.loads((path / "config.json").read_text())
    assert config["format"] == "cas_ckpt"
    assert config["version"] == 1
    assert config["hash"] == "sha2-256"
    assert config["chunk_size"] == 1024 * 1024


def test_an_existing_empty_directory_becomes_a_repository(tmp_path: Path) -> None:
    with cas_ckpt.open(tmp_path) as repo:
        repo.save({"a": 1})
    assert (tmp_path / "config.json").is_file()


def test_reopen_sees_everything(tmp_path: Path) -> None:
    state = {"w": np.arange(30_000, dtype=np.float32), "step": 4}
    with cas_ckpt.open(tmp_path / "repo") as repo:
        root = repo.save(state, ref="runs/a", step=4, message="first")
    with cas_ckpt.open(tmp_path / "repo", create=False) as repo:
        assert repo.resolve("runs/a") == root
        assert_state_equal(state, repo.load("runs/a"))
        commit = repo.commit("runs/a")
        assert (commit.step, commit.message) == (4, "first")


def test_create_false_on_a_missing_repository(tmp_path: Path) -> None:
    with pytest.raises(cas_ckpt.errors.RepositoryError, match="no cas_ckpt repository"):
        cas_ckpt.open(tmp_path / "missing", create=False)
    assert not (tmp_path / "missing").exists()


def test_read_only_open(tmp_path: Path) -> None:
    with pytest.raises(cas_ckpt.errors.RepositoryError):
        cas_ckpt.open(tmp_path / "missing", read_only=True)
    with cas_ckpt.open(tmp_path / "repo") as repo:
        root = repo.save({"a": 1})
    with cas_ckpt.open(tmp_path / "repo", read_only=True) as repo:
        assert repo.load(root) == {"a": 1}
        with pytest.raises(cas_ckpt.errors.RepositoryError, match="read-only"):
            repo.save({"a": 2})
        assert repo.resolve() == root


def test_newer_format_version_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "repo"
    cas_ckpt.open(path).close()
    config = json.loads((path / "config.json").read_text())
    config["version"] = 99
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(cas_ckpt.errors.RepositoryError, match="99") as info:
        cas_ckpt.open(path)
    assert "upgrade" in str(info.value)
    with pytest.raises(cas_ckpt.errors.RepositoryError):
        cas_ckpt.open(path, read_only=True)


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({"format": "something-else"}, cas_ckpt.errors.RepositoryError),
        ({"version": "1"}, cas_ckpt.errors.RepositoryError),
        ({"hash": "md5"}, cas_ckpt.errors.RepositoryError),
        ({"chunk_size": 10}, cas_ckpt.errors.RepositoryError),
        ({"chunk_size": 2 * 1024 * 1024}, cas_ckpt.errors.RepositoryError),
        ({"chunk_size": 8192.0}, cas_ckpt.errors.RepositoryError),
        ({"chunk_size": "8192"}, cas_ckpt.errors.RepositoryError),
        ({"version": 2, "compression": "lz4"}, cas_ckpt.errors.RepositoryError),
        ({"version": 0}, cas_ckpt.errors.RepositoryError),
        ({"version": -3}, cas_ckpt.errors.RepositoryError),
    ],
    ids=["format", "version type", "hash", "tiny chunks", "chunks over 1 MiB", "float chunks",
         "text chunks", "unknown compression", "version 0", "negative version"],
)
def test_bad_config_is_refused(tmp_path: Path, change: dict[str, Any], error: type) -> None:
    path = tmp_path / "repo"
    cas_ckpt.open(path).close()
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(error):
        cas_ckpt.open(path)


def test_a_config_that_is_not_utf8_is_a_corrupt_store(tmp_path: Path) -> None:
    path = tmp_path / "repo"
    cas_ckpt.open(path).close()
    (path / "config.json").write_bytes(b'{"format": "\xff"}')
    with pytest.raises(cas_ckpt.errors.CorruptStore, match=r"config\.json: not UTF-8 text") as info:
        cas_ckpt.open(path)
    assert info.value.path == str(path / "config.json")


def test_unreadable_config_is_a_corrupt_store(tmp_path: Path) -> None:
    path = tmp_path / "repo"
    cas_ckpt.open(path).close()
    (path / "config.json").write_text("{not json")
    with pytest.raises(cas_ckpt.errors.CorruptStore, match=r"config\.json"):
        cas_ckpt.open(path)


def test_a_non_empty_directory_is_not_taken_over(tmp_path: Path) -> None:
    (tmp_path / "data.txt").write_text("precious")
    with pytest.raises(cas_ckpt.errors.RepositoryError, match="not an empty directory"):
        cas_ckpt.open(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.txt"]
    assert (tmp_path / "data.txt").read_text() == "precious"


def test_a_file_is_not_taken_over(tmp_path: Path) -> None:
    path = tmp_path / "file"
    path.write_text("x")
    with pytest.raises(cas_ckpt.errors.RepositoryError):
        cas_ckpt.open(path)
    assert path.read_text() == "x"


def test_unknown_hash_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="md5"):
        cas_ckpt.open(tmp_path / "repo", hash="md5")
    assert not (tmp_path / "repo" / "config.json").exists()
    # (memory:// says RepositoryError, a directory ValueError: either way it names the hash)
    with pytest.raises((ValueError, cas_ckpt.errors.RepositoryError), match="md5"):
        cas_ckpt.open("memory://", hash="md5")


# -- hashes and chunk sizes ----------------------------------------------------------------------
@pytest.mark.parametrize("location", ["local", "memory"])
def test_blake3_repository(tmp_path: Path, location: str) -> None:
    path = str(tmp_path / "repo") if location == "local" else "memory://"
    state = {"w": np.arange(300_000, dtype=np.float32), "b": b"x" * 100}
    with cas_ckpt.open(path, hash="blake3", chunk_size=256 * 1024) as repo:
        root = repo.save(state)
        assert root.hashfun.name == "blake3" and root.codec.name == "messagepack"
        assert repo.commit(root).tree.hashfun.name == "blake3"
        stored = list(repo.blocks)
        assert stored and all(c.hashfun.name == "blake3" for c in stored)
        raw = [c for c in stored if c.codec.name == "raw"]
        assert len(raw) == 5  # 1.2 MB in 256 KiB chunks
        for c in raw:  # each chunk CID is the multiformats CID of its bytes
            data = repo.blocks.get(c)
            assert cidlib.to_cid(cidlib.Hasher("blake3").raw(data)) == c
        assert_state_equal(state, repo.load(root))
    if location == "local":
        config = json.loads((tmp_path / "repo" / "config.json").read_text())
        assert config["hash"] == "blake3" and config["chunk_size"] == 256 * 1024
        # An existing repository keeps its own hash and chunk size, whatever open() is given.
        with cas_ckpt.open(path, hash="sha2-256", chunk_size=4096) as repo:
            again = repo.save(state)
            assert again.hashfun.name == "blake3"
            assert repo.commit(again).tree == repo.commit(root).tree


def test_sha256_repository_cids(repo: cas_ckpt.Repository) -> None:
    root = repo.save({"a": np.zeros(10_000)})
    assert root.hashfun.name == "sha2-256" and root.codec.name == "messagepack"
    assert str(root).startswith("bagaqiera")  # CIDv1, base32, messagepack, sha2-256, 32 bytes
    assert all(c.hashfun.name == "sha2-256" for c in repo.blocks)


# -- history -------------------------------------------------------------------------------------
def test_log_is_newest_first_with_parents(repo: cas_ckpt.Repository) -> None:
    before = time.time()
    roots = [repo.save({"step": i}, step=i, message=f"m{i}") for i in range(4)]
    other = repo.save({"x": 0}, ref="runs/b")
    log = list(repo.log("main"))
    assert [c.cid for c in log] == roots[::-1]
    assert [c.step for c in log] == [3, 2, 1, 0]
    assert [c.message for c in log] == ["m3", "m2", "m1", "m0"]
    assert [c.parents for c in log] == [(roots[2],), (roots[1],), (roots[0],), ()]
    assert all(before - 1 <= c.time <= time.time() + 1 for c in log)
    assert [c.time for c in log] == sorted((c.time for c in log), reverse=True)
    assert [c.cid for c in repo.log("main", limit=2)] == roots[:1:-1]
    assert [c.cid for c in repo.log(roots[1])] == [roots[1], roots[0]]
    assert [c.cid for c in repo.log(str(roots[1]))] == [roots[1], roots[0]]
    assert [c.cid for c in repo.log("runs/b")] == [other]
    assert all(isinstance(c.cid, CID) and isinstance(c.tree, CID) for c in log)
    assert all(repo.load(c.cid) == {"step": c.step} for c in log)


def test_commit_records_what_was_saved(repo: cas_ckpt.Repository) -> None:
    root = repo.save({"a": 1}, step=7, metadata={"loss": 0.5, "tags": ["x"]}, message="hello")
    commit = repo.commit(root)
    assert commit.cid == root
    assert commit.step == 7
    assert commit.metadata == {"loss": 0.5, "tags": ["x"]}
    assert commit.message == "hello"
    assert commit.parents == ()
    assert repo.load(commit.tree) == {"a": 1}  # a tree CID loads as a checkpoint too
    assert repo.commit() == commit


# -- refs and targets ----------------------------------------------------------------------------
def test_resolve_and_refs(repo: cas_ckpt.Repository) -> None:
    a = repo.save({"a": 1})
    b = repo.save({"b": 1}, ref="runs/exp-7")
    c = repo.save({"c": 1}, ref="runs/exp-8")
    assert repo.refs() == {"main": a, "runs/exp-7": b, "runs/exp-8": c}
    assert repo.refs("runs/") == {"runs/exp-7": b, "runs/exp-8": c}
    assert repo.refs("nothing") == {}
    assert repo.resolve() == a
    assert repo.resolve("runs/exp-7") == b
    assert repo.resolve(str(c)) == c
    assert repo.resolve(c) == c
    assert repo.resolve(bytes(c)) == c
    assert isinstance(repo.resolve(), CID)
    repo.delete_ref("runs/exp-8")
    assert repo.refs() == {"main": a, "runs/exp-7": b}
    assert repo.load(c) == {"c": 1}  # the checkpoint itself is still there


def test_load_by_cid_object_string_and_bytes(repo: cas_ckpt.Repository) -> None:
    first = repo.save({"v": 1})
    repo.save({"v": 2})
    assert repo.load(first) == {"v": 1}
    assert repo.load(str(first)) == {"v": 1}
    assert repo.load(bytes(first)) == {"v": 1}
    assert repo.load(first.set(base="base58btc")) == {"v": 1}
    assert repo.load() == {"v": 2}


def test_unknown_ref(repo: cas_ckpt.Repository) -> None:
    for call in (repo.load, repo.resolve, repo.commit, lambda t: list(repo.log(t))):
        with pytest.raises(cas_ckpt.errors.RefNotFound, match="nope") as info:
            call("nope")
        assert info.value.ref == "nope"
        assert isinstance(info.value, KeyError)
    with pytest.raises(cas_ckpt.errors.RefNotFound):
        repo.load()  # no "main" yet
    with pytest.raises(cas_ckpt.errors.RefNotFound):
        repo.delete_ref("nope")


def test_a_missing_ref_names_the_refs_there_are_nearest_first(repo: cas_ckpt.Repository) -> None:
    """issue #40: ``repo.load("runs/typo")`` said only "not found", and ``reflog`` of a misspelt
    name returned nothing; every entry point that takes a ref names those that exist."""
    with pytest.raises(cas_ckpt.errors.RefNotFound, match="the repository has no refs"):
        repo.load("runs/typo")
    for name in ["main", "runs/exp-b", *(f"runs/exp-a.steps/{i}" for i in range(30))]:
        repo.save({"a": 1}, ref=name)
    entry_points = {
        "load": repo.load, "resolve": repo.resolve, "tree": repo.tree, "commit": repo.commit,
        "log": lambda t: list(repo.log(t)), "diff": lambda t: repo.diff("main", t),
        "reflog": repo.reflog, "delete_ref": repo.delete_ref,
        "rename_ref": lambda t: repo.rename_ref(t, "renamed"), "fork": lambda t: repo.fork(t, "f"),
        "pin": repo.pin, "set_ref": lambda t: repo.set_ref("s", t),
        "export_car": lambda t: repo.export_car(t, io.BytesIO()),
        "push": lambda t: repo.push(cas_ckpt.open("memory://"), t),
    }
    for name, call in entry_points.items():
        with pytest.raises(cas_ckpt.errors.RefNotFound) as info:
            call("runs/exp-c")
        text = str(info.value)
        assert text.startswith("ref 'runs/exp-c' not found; did you mean 'runs/exp-b'? "
                               "(refs here: runs/exp-b, "), (name, text)
        assert text.endswith(" and 22 more)") and text.count("runs/exp-a.steps/") == 9, (name, text)
        assert info.value.existing is not None and len(info.value.existing) == 32
    with pytest.raises(cas_ckpt.errors.RefNotFound, match="refs here: main, "):
        repo.load("zzz")


def test_bad_targets(repo: cas_ckpt.Repository) -> None:
    repo.save({"a": np.zeros(100_000)})
    with pytest.raises(cas_ckpt.errors.InvalidRefName):
        repo.load("../etc")
    missing = cidlib.to_cid(cidlib.Hasher().node(b"never stored"))
    with pytest.raises(cas_ckpt.errors.BlockNotFound, match=str(missing)):
        repo.load(missing)
    chunk = next(c for c in repo.blocks if c.codec.name == "raw")
    with pytest.raises(cas_ckpt.errors.RepositoryError, match="raw chunk"):
        repo.load(chunk)
    with pytest.raises(cas_ckpt.errors.InvalidCID):
        repo.load(12)  # type: ignore[arg-type]


def test_set_ref_only_to_stored_blocks(repo: cas_ckpt.Repository) -> None:
    root = repo.save({"a": 1})
    assert repo.set_ref("copies/a", root) == root
    assert repo.resolve("copies/a") == root
    with pytest.raises(cas_ckpt.errors.BlockNotFound):
        repo.set_ref("copies/b", cidlib.to_cid(cidlib.Hasher().node(b"absent")))
    assert "copies/b" not in repo.refs()


# -- metadata ------------------------------------------------------------------------------------
def test_metadata_no_reader_could_decode_is_refused_before_anything_moves(repo: cas_ckpt.Repository) -> None:
    """A commit node over the node limit was stored and its ref moved, and then no load could
    decode it (docs/format.md, "Block sizes")."""
    repo.save({"a": 1}, metadata={"notes": "fits"})
    before = repo.resolve()
    with pytest.raises(cas_ckpt.errors.StateTypeError, match=r"metadata: .* over the 67108864"):
        repo.save({"a": 2}, metadata={"notes": "x" * (64 << 20)})
    assert repo.resolve() == before and repo.load() == {"a": 1}


def test_metadata_accepts_numpy_scalars(repo: cas_ckpt.Repository) -> None:
    metadata = {
        "loss": np.float32(0.25),
        "step": np.int64(12),
        "ok": np.bool_(True),
        "lr": np.array(1e-3),
        "nested": {"acc": np.float64(0.5), "hist": [np.int32(1), 2]},
    }
    commit = repo.commit(repo.save({}, metadata=metadata))
    assert commit.metadata == {
        "loss": 0.25,
        "step": 12,
        "ok": True,
        "lr": 1e-3,
        "nested": {"acc": 0.5, "hist": [1, 2]},
    }
    assert type(commit.metadata["step"]) is int and type(commit.metadata["ok"]) is bool


@pytest.mark.parametrize(
    ("metadata", "path"),
    [
        ({"x": object()}, "metadata.x"),
        ({"x": {1, 2}}, "metadata.x"),
        ({"x": {"y": b"ok", "z": object()}}, "metadata.x.z"),
        ({"x": [1, object()]}, "metadata.x.1"),
        ({1: "int key"}, "metadata.1"),
        ({"x": 2**70}, "metadata.x"),
    ],
)
def test_metadata_rejects_non_plain_values(
    repo: cas_ckpt.Repository, metadata: dict[Any, Any], path: str
) -> None:
    with pytest.raises(cas_ckpt.errors.StateTypeError) as info:
        repo.save({"a": 1}, metadata=metadata)
    assert info.value.path == path
    assert path in str(info.value)
    assert list(repo.blocks) == [] and repo.refs() == {}


def test_metadata_rejects_arrays() -> None:
    with cas_ckpt.open("memory://") as repo, pytest.raises(cas_ckpt.errors.StateTypeError) as info:
        repo.save({}, metadata={"x": np.array([1.0, 2.0])})
    assert info.value.path == "metadata.x"


@pytest.mark.parametrize(
    ("kwargs", "path"),
    [({"step": 1.5}, "step"), ({"step": "3"}, "step"), ({"message": 3}, "message")],
)
def test_step_and_message_types(repo: cas_ckpt.Repository, kwargs: dict[str, Any], path: str) -> None:
    with pytest.raises(cas_ckpt.errors.StateTypeError) as info:
        repo.save({"a": 1}, **kwargs)
    assert info.value.path == path
    assert repo.refs() == {}


def test_repository_on_any_store_pair() -> None:
    # Repository takes its stores as arguments: a memory repository built by hand works as open's.
    with cas_ckpt.Repository(cas_ckpt.blocks.MemoryStore(), cas_ckpt.refs.MemoryRefStore()) as repo:
        root = repo.save({"a": (1, 2)})
        assert repo.load(root) == {"a": (1, 2)}
        assert repo.config.hash == "sha2-256"


def test_save_expected_makes_read_modify_write_safe(repo: cas_ckpt.Repository) -> None:
    first = repo.save({"n": 1})
    second = repo.save({"n": 2})
    with pytest.raises(cas_ckpt.errors.RefConflict):
        repo.save({"n": 3}, expected=first)  # a writer that loaded `first` lost the race
    assert repo.resolve("main") == second
    third = repo.save({"n": 3}, expected=second)
    assert repo.commit(third).parents == (second,)


def test_numpy_integer_step_is_accepted(repo: cas_ckpt.Repository) -> None:
    cid = repo.save({"a": 1}, step=np.int64(7))
    assert repo.commit(cid).step == 7


def test_a_repository_created_by_another_process_between_two_looks_is_opened(tmp_path: Path) -> None:
    """Every rank of a job opens the same new repository at once: one that finds no config, then
    finds the directory filled by the rank that created it meanwhile, opens that repository
    (it failed with "exists and is not an empty directory", 1 time in 6 with 8 ranks)."""
    from cas_ckpt.refs import LocalRefStore
    from cas_ckpt.repository import _ensure_config, _local_occupied

    root = tmp_path / "repo"

    def meanwhile() -> str | None:
        cas_ckpt.open(root).close()  # the other rank, all the way
        return _local_occupied(root)

    config = _ensure_config(LocalRefStore(root), str(root), create=True, hash="sha2-256",
                            chunk_size=1 << 20, occupied=meanwhile)
    assert config.hash == "sha2-256"
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(cas_ckpt.errors.RepositoryError, match="not an empty directory"):
        cas_ckpt.open(tmp_path / "other")
