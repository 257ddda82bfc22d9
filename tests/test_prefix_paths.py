"""Partial loads by key prefix: ``path="model.encoder.layer.5"`` in load, restore, ls, diff and
export reads only that layer's blocks, equals the matching slice of a full load, and says when a
path reads two ways."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import CountingStore, assert_state_equal
from hypothesis import given, settings
from hypothesis import strategies as st

import cas_ckpt
from cas_ckpt import cid as cidlib
from cas_ckpt import cli, codec, tree
from cas_ckpt.codec import Tagged
from cas_ckpt.errors import AmbiguousPath, PathNotFound

CHUNK = 4096
LAYERS = 12  # layer.1 and layer.10, layer.11: a prefix ends at a dot


def state_dict(seed: int = 0) -> dict[str, np.ndarray[Any, Any]]:
    """A flat state dict as torch writes one: dotted keys in one map, arrays of a few chunks."""
    rng = np.random.default_rng(seed)
    out = {"embed.weight": rng.standard_normal((64, 128)).astype(np.float32)}
    for i in range(LAYERS):
        out[f"encoder.layer.{i}.attn.weight"] = rng.standard_normal((64, 128)).astype(np.float32)
        out[f"encoder.layer.{i}.attn.bias"] = rng.standard_normal(64).astype(np.float32)
        out[f"encoder.layer.{i}.mlp.weight"] = rng.standard_normal((128, 64)).astype(np.float32)
    return out


def under(mapping: dict[str, Any], prefix: str) -> dict[str, Any]:
    return {k: v for k, v in mapping.items() if k.startswith(prefix + ".")}


def chunk_cids(array: np.ndarray[Any, Any]) -> set[bytes]:
    data = np.ascontiguousarray(array).tobytes()
    hasher = cidlib.Hasher()
    return {hasher.raw(data[i : i + CHUNK]) for i in range(0, len(data), CHUNK)}


def chunks(arrays: dict[str, Any]) -> set[bytes]:
    return {c for a in arrays.values() if a.nbytes > 16 * 1024 for c in chunk_cids(a)}


@pytest.fixture(params=["local", "memory"])
def counted(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[cas_ckpt.Repository]:
    if request.param == "local":
        store: cas_ckpt.blocks.BlockStore = cas_ckpt.blocks.LocalStore(tmp_path)
        refs: cas_ckpt.refs.RefStore = cas_ckpt.refs.LocalRefStore(tmp_path)
    else:
        store, refs = cas_ckpt.blocks.MemoryStore(), cas_ckpt.refs.MemoryRefStore()
    with cas_ckpt.Repository(CountingStore(store), refs, chunk_size=CHUNK) as repository:
        yield repository


@pytest.mark.parametrize("paged", [False, True])
def test_a_layer_loads_by_key_prefix_reading_only_its_blocks(
    counted: cas_ckpt.Repository, paged: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if paged:  # the model's map cut into page nodes of at most 2 KiB
        monkeypatch.setattr(tree, "PAGE_LIMIT", 2048)
    store = counted.blocks
    assert isinstance(store, CountingStore)
    model = state_dict()
    counted.save({"model": model, "optimizer": {"step": 3}})
    root = codec.decode(store.get(bytes(counted.tree())))
    holder = root["model"]
    holder = codec.decode(store.get(holder.cid)) if isinstance(holder, codec.Link) else holder
    assert (isinstance(holder, Tagged) and holder.code == tree.PAGES) == paged
    store.reset()

    loaded = counted.load(path="model.encoder.layer.1")

    wanted = under(model, "encoder.layer.1")
    assert list(wanted) == ["encoder.layer.1.attn.weight", "encoder.layer.1.attn.bias",
                            "encoder.layer.1.mlp.weight"]  # not layer.10 or layer.11
    assert_state_equal(wanted, loaded)
    read = set(store.reads)
    assert chunks(wanted) <= read
    assert not read & (chunks(model) - chunks(wanted)), "read chunks of another layer"
    assert not set(store.sized) & (chunks(model) - chunks(wanted))
    assert len(store.reads) == len(read), "a block was read twice"
    node_bytes = sum(store.inner.size(c) for c in read if cidlib.is_node(c))
    assert node_bytes < 16 * 1024  # the commit, the root, the model's map (and its pages)


def test_a_prefix_of_a_state_dict_saved_as_the_root(repo: cas_ckpt.Repository) -> None:
    model = state_dict()
    repo.save(model)
    assert_state_equal(under(model, "encoder.layer.11"), repo.load(path="encoder.layer.11"))
    assert_state_equal(under(model, "encoder"), repo.load(path="encoder"))
    assert_state_equal(under(model, "encoder.layer.3.attn"), repo.load(path="encoder.layer.3.attn"))
    assert_state_equal(model["embed.weight"], repo.load(path="embed.weight"))


def test_existing_paths_keep_working_beside_prefixes(repo: cas_ckpt.Repository) -> None:
    state = {"model": {"0.weight": np.zeros(2), "0.bias": np.ones(2), "10.weight": np.full(2, 5.0)},
             "optimizer": {"state": {0: {"step": 1}, 1: {"step": 2}}, "param_groups": [{"lr": 0.1}]},
             "nested": {"a": {"b": [1, {"c.d": 2}]}}}
    repo.save(state)
    assert_state_equal(state["model"]["0.weight"], repo.load(path="model.0.weight"))
    assert_state_equal({"0.weight": np.zeros(2), "0.bias": np.ones(2)}, repo.load(path="model.0"))
    assert repo.load(path="optimizer.state.1") == {"step": 2}
    assert repo.load(path="optimizer.param_groups.0.lr") == 0.1
    assert repo.load(path="nested.a.b.1.c.d") == 2
    assert repo.load(path="nested.a.b.1.c") == {"c.d": 2}  # a prefix below a list item
    assert repo.load(path=["model", "0.weight"]).tolist() == [0.0, 0.0]


def test_a_path_read_two_ways_is_refused_naming_both(repo: cas_ckpt.Repository) -> None:
    root = repo.save({"model": {"layer": {"0": {"w": 1}}, "layer.1.w": 2, "layer.2": 3}})
    with pytest.raises(AmbiguousPath) as info:
        repo.load(path="model.layer")
    message = str(info.value)
    assert info.value.path == "model.layer" and str(root) in message
    assert info.value.readings == ["the value at 'model.layer'",
                                   "the 2 keys of 'model' starting with 'layer.'"]
    assert isinstance(info.value, cas_ckpt.CasCkptError)
    # Either reading, asked for plainly:
    assert repo.load(path=["model", "layer"]) == {"0": {"w": 1}}
    assert repo.load(path="model.layer.") == {"layer.1.w": 2, "layer.2": 3}
    assert repo.load(path="model.layer.0.w") == 1  # one reading only: no ambiguity
    assert repo.load(path="model.layer.2") == 3
    # Two keys that each read part of the path: {"a.b": ...} and {"a": {"b": ...}}.
    repo.save({"a": {"b": 1}, "a.b": 2}, ref="two")
    with pytest.raises(AmbiguousPath, match=r"'a\.b' is ambiguous"):
        repo.load("two", path="a.b")


def test_prefix_only_paths_and_missing_prefixes(repo: cas_ckpt.Repository) -> None:
    model = state_dict()
    repo.save({"model": model, "t": [1, 2]})
    assert_state_equal(under(model, "encoder.layer.5"), repo.load(path="model.encoder.layer.5."))
    with pytest.raises(PathNotFound) as info:  # a key, not a prefix of keys
        repo.load(path="model.embed.weight.")
    assert "'model' has no key starting with 'embed.weight.'" in str(info.value)
    with pytest.raises(PathNotFound) as info:
        repo.load(path="model.encoder.layer.99")
    assert info.value.found == "model" and "encoder.layer.99" in str(info.value)
    with pytest.raises(PathNotFound):
        repo.load(path="t.1.")
    with pytest.raises(PathNotFound):
        repo.load(path="model.encoder.lay")  # a prefix ends at a dot


@pytest.mark.torch
def test_one_layer_into_a_model_with_load_state_dict_strict_false(repo: cas_ckpt.Repository) -> None:
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    saved = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(3)])
    repo.save({"model": saved.state_dict()})
    fresh = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(3)])
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    part = repo.load(path="model.1")
    assert sorted(part) == ["1.bias", "1.weight"]
    missing, unexpected = fresh.load_state_dict(part, strict=False)
    assert unexpected == [] and sorted(missing) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert torch.equal(fresh[1].weight, saved[1].weight) and torch.equal(fresh[0].weight, before["0.weight"])


def test_restore_ls_diff_and_export_take_prefixes(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    model = state_dict()
    changed = {**model, "encoder.layer.5.attn.bias": model["encoder.layer.5.attn.bias"] + 1}
    with cas_ckpt.open(tmp_path / "repo") as repo, cas_ckpt.CheckpointManager(repo, "run") as manager:
        manager.save(1, {"model": model})
        manager.save(2, {"model": changed})
        assert_state_equal(under(model, "encoder.layer.5"), manager.restore(1, path="model.encoder.layer.5"))
        report = repo.export_safetensors("run", tmp_path / "layer5.safetensors", path="model.encoder.layer.5")
        assert report.tensors == 3
    from safetensors.numpy import load_file

    exported = load_file(tmp_path / "layer5.safetensors")
    assert sorted(exported) == sorted(under(model, "encoder.layer.5"))
    monkeypatch.setenv(cli.ENV_REPO, str(tmp_path / "repo"))
    assert cli.main(["ls", "run", "model.encoder.layer.5"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split("\t")[0] for line in lines] == [f"model.{k}" for k in under(model, "encoder.layer.5")]
    assert cli.main(["diff", "run~1", "run", "model.encoder.layer.5", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert [c["path"] for c in report["changed"]] == ["model.encoder.layer.5.attn.bias"]
    assert report["unchanged"] == 2
    assert cli.main(["ls", "run", "model.encoder"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 3 * LAYERS
    with cas_ckpt.open(tmp_path / "repo") as repo:
        repo.save({"a": {"b": 1}, "a.b": 2}, ref="two")
    assert cli.main(["ls", "two", "a.b"]) == cli.EXIT_USAGE
    assert "ambiguous" in capsys.readouterr().err


# -- a path load is the matching slice of a full load ----------------------------------------------
SEGMENTS = st.sampled_from(["a", "b", "w", "0", "1", "10"])


@st.composite
def flat_state_dicts(draw: st.DrawFn) -> dict[str, Any]:
    """Dotted keys, none a dotted prefix of another (as in a torch state dict), small values."""
    names = draw(st.lists(st.lists(SEGMENTS, min_size=1, max_size=4).map(tuple), min_size=1,
                          max_size=12, unique=True))
    leaves = [n for n in names if not any(o != n and o[: len(n)] == n for o in names)]
    values = st.one_of(st.integers(-5, 5), st.floats(allow_nan=False),
                       st.integers(0, 40).map(lambda n: np.arange(n, dtype=np.float32)),
                       st.integers(1, 3).map(lambda n: np.ones(3000 * n)))  # chunked arrays too
    return {".".join(n): draw(values) for n in leaves}


@settings(deadline=None)
@given(model=flat_state_dicts(), at_root=st.booleans(), data=st.data())
def test_a_path_load_equals_the_matching_slice_of_a_full_load(
    model: dict[str, Any], at_root: bool, data: st.DataObject
) -> None:
    with cas_ckpt.open("memory://", chunk_size=CHUNK) as repo:
        repo.save(model if at_root else {"model": model, "other": 1})
        full = repo.load()
        flat = full if at_root else full["model"]
        key = data.draw(st.sampled_from(sorted(model)))
        parts = key.split(".")
        cut = data.draw(st.integers(1, len(parts)))
        path = ".".join(parts[:cut])
        asked = path if at_root else f"model.{path}"
        expected = flat[key] if cut == len(parts) else under(flat, path)
        assert_state_equal(expected, repo.load(path=asked))
        if cut < len(parts):
            assert_state_equal(expected, repo.load(path=asked + "."))
