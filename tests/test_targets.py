"""Targets: refs, full CIDs, unique CID prefixes and ``REF~N``, through ``Repository.resolve``."""

from __future__ import annotations

import io

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import cas_ckpt
from cas_ckpt import cid as cidlib
from cas_ckpt.errors import AmbiguousCID, AncestorNotFound, BlockNotFound, InvalidCID, RefNotFound

STEPS = 5
REPO = cas_ckpt.open("memory://")
CHAIN = [REPO.save({"x": i}, ref="main", step=i) for i in range(STEPS)]  # oldest first
NODES = sorted(cidlib.to_str(k) for k in REPO.blocks.keys() if cidlib.is_node(k))  # noqa: SIM118


@given(st.integers(0, STEPS - 1), st.integers(0, STEPS - 1))
def test_ancestors_follow_first_parents(n: int, m: int) -> None:
    assert REPO.resolve(f"main~{n}") == CHAIN[-1 - n]
    if n + m < STEPS:
        assert REPO.resolve(f"main~{n}~{m}") == CHAIN[-1 - n - m]
    else:
        with pytest.raises(AncestorNotFound):
            REPO.resolve(f"main~{n}~{m}")
    assert REPO.resolve(f"{CHAIN[-1]}~{n}") == CHAIN[-1 - n]  # a CID takes ~N too


@given(st.integers(STEPS, 100))
def test_an_ancestor_past_the_root_is_not_found(n: int) -> None:
    with pytest.raises(AncestorNotFound, match=f"stops after {STEPS - 1} ancestor"):
        REPO.resolve(f"main~{n}")
    with pytest.raises(RefNotFound):  # AncestorNotFound is a RefNotFound
        REPO.resolve(f"main~{n}")


@given(st.sampled_from(NODES), st.integers(8, 62))
def test_a_prefix_names_the_one_node_it_starts(cid: str, length: int) -> None:
    prefix = cid[:length]
    candidates = [c for c in NODES if c.startswith(prefix)]
    if len(candidates) == 1:
        assert str(REPO.resolve(prefix)) == cid
    else:
        with pytest.raises(AmbiguousCID) as info:
            REPO.resolve(prefix)
        assert info.value.candidates == candidates and isinstance(info.value, InvalidCID)
        assert candidates[0] in str(info.value)


def test_prefix_rules() -> None:
    with pytest.raises(AmbiguousCID, match="ambiguous"):
        REPO.resolve("bagaqier")  # every sha2-256 node starts so
    with pytest.raises(InvalidCID, match="neither a ref nor a valid CID"):
        REPO.resolve(NODES[0][:7])  # under 8 characters: never a prefix
    with pytest.raises(BlockNotFound, match="no stored node CID starts so"):
        REPO.resolve("bagaqierzzzzzzzz")
    repo = cas_ckpt.open("memory://", chunk_size=4096)
    repo.save({"big": np.arange(5000.0)}, ref="main")
    raw = next(k for k in repo.blocks.keys() if not cidlib.is_node(k))  # noqa: SIM118
    with pytest.raises(BlockNotFound):  # raw chunks are never the target of a prefix
        repo.resolve(cidlib.to_str(raw)[:20])


def test_a_ref_wins_over_a_prefix_and_a_malformed_cid_says_why() -> None:
    repo = cas_ckpt.open("memory://")
    a = repo.save({"x": 1}, ref="main")
    b = repo.save({"x": 2}, ref="other")
    spelled = str(b)[:12]
    repo.set_ref(spelled, a)
    assert repo.resolve(spelled) == a and repo.resolve(str(b)[:13]) == b
    assert repo.resolve("main~0") == a
    with pytest.raises(InvalidCID, match="neither a ref nor a valid CID: invalid base32"):
        repo.resolve("bafyxx...")
    with pytest.raises(InvalidCID, match="CIDv0"):
        repo.resolve("QmYwAPJzv5CZsnA625s3Xf2nemtYgPpHdWEz79ojWnPbdG")
    assert repo.load(str(a)[:13]) == {"x": 1} and [c.step for c in repo.log(str(b)[:13])] == [None]


def test_reprs_show_cids_as_text() -> None:
    repo = cas_ckpt.open("memory://")
    cid = repo.save({"x": 1}, ref="main")
    shown = [repr(repo.last_save), repr(repo.commit("main")), repr(repo.stats().refs[0]),
             repr(repo.export_car("main", io.BytesIO()))]
    for text in shown:
        assert f"'{cid}'" in text and "CID(" not in text, text
    assert repr(repo.commit("main")).startswith(f"Commit(cid='{cid}', tree='b")
