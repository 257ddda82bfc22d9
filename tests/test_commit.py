"""parse_commit checks a commit node field by field, naming the commit when one is malformed."""

from __future__ import annotations

from typing import Any

import pytest

import cas_ckpt
from cas_ckpt import cid as cidlib
from cas_ckpt.codec import HistoryLink, Link
from cas_ckpt.commit import COMMIT_TYPE, parse_commit

HASHER = cidlib.Hasher()
CID, TREE, PARENT = (HASHER.node(bytes([i])) for i in range(3))
VALID = {"type": COMMIT_TYPE, "version": 1, "tree": Link(TREE), "parents": [HistoryLink(PARENT)],
         "step": 7, "time": 1.5, "metadata": {"loss": 0.25}, "message": "m"}


def test_a_valid_commit_node_parses() -> None:
    commit = parse_commit(CID, VALID)
    assert (commit.tree, commit.parents, commit.step) == (cidlib.to_cid(TREE), (cidlib.to_cid(PARENT),), 7)
    assert (commit.time, commit.metadata, commit.message) == (1.5, {"loss": 0.25}, "m")


@pytest.mark.parametrize("version", ["1", 2])
def test_a_commit_of_an_unknown_version_is_refused_naming_it(version: Any) -> None:
    match = rf"commit {cidlib.to_str(CID)} has format version {version!r}"
    with pytest.raises(cas_ckpt.errors.RepositoryError, match=match):
        parse_commit(CID, {**VALID, "version": version})


MALFORMED = {
    "no tree": ({"tree": None}, "no tree link"),
    "a history link as tree": ({"tree": HistoryLink(TREE)}, "no tree link"),
    "parents that are a link": ({"parents": HistoryLink(PARENT)}, "parents are malformed"),
    "a parent that is bytes": ({"parents": [PARENT]}, "parents are malformed"),
    "a text step": ({"step": "7"}, "step is not an int"),
    "a text time": ({"time": "now"}, "time or metadata is malformed"),
    "metadata that is a list": ({"metadata": [1]}, "time or metadata is malformed"),
    "a message that is an int": ({"message": 5}, "message is not a string"),
}


@pytest.mark.parametrize("case", MALFORMED.values(), ids=MALFORMED.keys())
def test_a_malformed_commit_field_is_a_decode_error_naming_the_commit(
    case: tuple[dict[str, Any], str],
) -> None:
    change, match = case
    with pytest.raises(cas_ckpt.errors.DecodeError, match=match) as info:
        parse_commit(CID, {**VALID, **change})
    assert info.value.cid == cidlib.to_str(CID)
