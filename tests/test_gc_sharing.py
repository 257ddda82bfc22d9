"""GC in a shared repository: one run's retention never destroys another ref's history.

Alice saves with plain ``repo.save``; Bob runs a ``CheckpointManager`` with ``keep_last=1``, whose
GC after retention may expire only Bob's checkpoints. Reflog entries are weak roots: data an
earlier GC removed is an expired record, not damage, while a block missing under a ref still is.
"""

from __future__ import annotations

import doctest
from pathlib import Path

import numpy as np
import pytest

import cas_ckpt
from cas_ckpt import CheckpointManager
from cas_ckpt import cid as cidlib
from cas_ckpt.errors import CheckpointExpired, InvalidRefName, RepositoryError
from cas_ckpt.maintenance.walk import walk

MIB = 1024 * 1024
DOC = Path(__file__).parent.parent / "docs" / "gc.md"


def state_for(step: int, size: int = MIB) -> dict[str, object]:
    """A state whose array bytes are unique to ``step`` (no dedup between steps)."""
    rng = np.random.default_rng(step)
    return {"step": step, "w": rng.integers(0, 255, size, dtype=np.uint8), "tag": f"s{step}"}


def stored_bytes(repo: cas_ckpt.Repository) -> int:
    return sum(repo.blocks.size(c) for c in repo.blocks.keys())  # noqa: SIM118 - a store


def alice_saves(repo: cas_ckpt.Repository) -> list[cas_ckpt.CID]:
    return [repo.save(state_for(i), ref="alice/plain") for i in (1, 2, 3)]


def bob_saves(repo: cas_ckpt.Repository, *, gc_after_retention: bool = True) -> list[cas_ckpt.CID]:
    bob = CheckpointManager(repo, "bob/run", keep_last=1, gc_after_retention=gc_after_retention)
    cids = [bob.save(step, state_for(100 + step)) for step in (1, 2, 3)]
    return [cid for cid in cids if cid is not None]


def assert_loads(repo: cas_ckpt.Repository, cids: list[cas_ckpt.CID], tags: list[str]) -> None:
    assert [repo.load(cid)["tag"] for cid in cids] == tags


def test_a_managers_retention_keeps_another_refs_history(repo: cas_ckpt.Repository) -> None:
    alice = alice_saves(repo)
    bob = bob_saves(repo)
    assert_loads(repo, alice, ["s1", "s2", "s3"])
    for cid in bob[:2]:  # Bob's policy expired these, and his GC freed them
        with pytest.raises(CheckpointExpired):
            repo.load(cid)
    assert_loads(repo, bob[2:], ["s103"])
    assert 4 * MIB <= stored_bytes(repo) < 4.2 * MIB
    assert repo.fsck().ok


def test_a_plain_gc_keeps_what_recent_reflog_entries_name(repo: cas_ckpt.Repository) -> None:
    alice = alice_saves(repo)
    bob = bob_saves(repo, gc_after_retention=False)
    repo.gc()  # a maintainer's GC: no retention policy speaks for any ref
    assert_loads(repo, alice, ["s1", "s2", "s3"])
    assert_loads(repo, bob, ["s101", "s102", "s103"])
    repo.gc(reflog_expiry=0)  # reflogs keep nothing: only heads and retained steps survive
    for cid in alice[:2] + bob[:2]:
        with pytest.raises(CheckpointExpired):
            repo.load(cid)
    assert_loads(repo, [alice[2], bob[2]], ["s3", "s103"])
    assert repo.fsck().ok


def test_reflog_data_an_earlier_gc_removed_is_not_damage(repo: cas_ckpt.Repository) -> None:
    first = repo.save(state_for(1))
    repo.save(state_for(2))
    repo.gc(reflog_expiry=0)
    assert repo.fsck().ok
    repo.gc()  # main's reflog names the first checkpoint, whose data is gone: an expired record
    repo.gc(reflog_expiry=3600)
    with pytest.raises(CheckpointExpired):
        repo.load(first)
    assert repo.load("main")["tag"] == "s2" and repo.fsck().ok


def test_gc_keeps_what_a_reflog_entry_still_reaches(repo: cas_ckpt.Repository) -> None:
    rows = [bytes([i % 256]) * 600 + str(i).encode() for i in range(3000)]  # cut into pages
    old = repo.save({"rows": rows, "x": np.arange(300_000)})
    repo.save(state_for(2))
    pages = [c for c, w in walk(repo.blocks, {cidlib.to_bytes(old): "old"}).where.items()
             if w.path == "rows" and cidlib.is_node(c)]
    repo.blocks.delete({pages[0]})  # part of what only main's reflog still names is gone
    repo.gc(reflog_expiry=3600)
    assert np.array_equal(repo.load(old, path="x"), np.arange(300_000))
    assert repo.fsck().ok


def test_gc_refuses_when_a_ref_misses_a_block_its_reflog_also_names(
    repo: cas_ckpt.Repository,
) -> None:
    state = state_for(1)
    repo.save(state, metadata={"n": 1})
    head = repo.save(state, metadata={"n": 2})  # a new commit over the same tree node
    tree = cidlib.to_bytes(repo.commit(head).tree)
    repo.blocks.delete({tree})
    assert not repo.blocks.has(tree)
    for expiry in (0, 3600):
        with pytest.raises(RepositoryError, match=r"needed by main:<root>"):
            repo.gc(reflog_expiry=expiry)
    assert not repo.fsck().ok


def test_the_two_users_example_in_gc_md_runs() -> None:
    result = doctest.testfile(
        str(DOC), module_relative=False, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    )
    assert result.attempted >= 6 and result.failed == 0


def test_expire_reflogs_takes_ref_names(repo: cas_ckpt.Repository) -> None:
    with pytest.raises(InvalidRefName):
        repo.gc(expire_reflogs=["../elsewhere/"])
