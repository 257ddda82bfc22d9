"""Refs: name validation, compare-and-swap semantics, reflog, lock recovery, racing processes."""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import cas_ckpt
from cas_ckpt import cid as cidlib
from cas_ckpt.refs import ListedName, check_ref_name
from cas_ckpt.refs.base import describe_holder

HASHER = cidlib.Hasher()
A, B, C = (HASHER.node(bytes([i])) for i in range(3))
# Bidi controls: a name holding one displays as another (U+202E: "runs/\u202eevil" shows "runs/live").
DISPLAY_CONTROLS = "\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069"

# -- names ---------------------------------------------------------------------------------------
INVALID_NAMES = [
    "",
    "a\ud800b",
    "/a",
    "a/",
    "a//b",
    "..",
    ".",
    "a/../b",
    "a/./b",
    "../a",
    ".hidden",
    "a/.hidden",
    "x.lock",
    "a/x.lock/b",
    "a\x00b",
    "a\nb",
    "a\tb",
    "a\x7fb",
    "a b",
    " main",
    "main ",
    "a\u00a0b",
    "a\u2028b",
    "a\\b",
    "a:b",
    "a*",
    "a?",
    "a[0]",
    "a~1",
    "a^",
    'a"b',
    "a<b>",
    "a|b",
    "x" * 1025,
]
VALID_NAMES = ["main", "runs/exp-7", "runs/exp_7/seed.3", "a", "UPPER/lower", "ünïcode", "v1.0", "x" * 1024]


@pytest.mark.parametrize("name", INVALID_NAMES)
def test_invalid_names_are_rejected(name: str) -> None:
    with pytest.raises(cas_ckpt.errors.InvalidRefName) as info:
        check_ref_name(name)
    assert info.value.ref == name
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("name", [None, b"main", 1, ["main"]])
def test_non_string_names_are_rejected(name: Any) -> None:
    with pytest.raises(cas_ckpt.errors.InvalidRefName):
        check_ref_name(name)


@pytest.mark.parametrize("name", VALID_NAMES)
def test_valid_names_are_accepted(name: str) -> None:
    assert check_ref_name(name) == name


@pytest.mark.parametrize("name", ["../escape", "/etc/passwd", "a/../../b", "a b"])
def test_invalid_names_are_refused_before_saving(repo: cas_ckpt.Repository, name: str) -> None:
    with pytest.raises(cas_ckpt.errors.InvalidRefName):
        repo.save({"x": 1}, ref=name)
    assert list(repo.blocks) == []
    assert repo.refs() == {}


def _is_acceptable(name: str) -> bool:
    """An independent statement of the rules, for the fuzz test."""
    if not 1 <= len(name) <= 1024:
        return False
    if any(0xD800 <= ord(c) <= 0xDFFF for c in name):  # not encodable: no file name, no JSON
        return False
    if any(ord(c) < 32 or ord(c) == 127 or c.isspace() or c in '\\*?[]:~^"<>|' for c in name):
        return False
    if any(0x80 <= ord(c) <= 0x9F or c in DISPLAY_CONTROLS for c in name):  # C1 and bidi controls
        return False
    return all(
        seg and not seg.startswith(".") and not seg.endswith(".lock") for seg in name.split("/")
    )


name_text = st.text(
    alphabet=st.one_of(st.sampled_from("ab/.-_ \\:\x00\n~lock"), st.characters()), max_size=20
)


@given(name_text)
def test_fuzz_names_raise_only_invalid_ref_name(name: str) -> None:
    try:
        accepted = check_ref_name(name) == name
    except cas_ckpt.errors.InvalidRefName:
        accepted = False
    assert accepted == _is_acceptable(name)


@pytest.mark.parametrize("char", ["\x80", "\x85", "\x9b", "\x9f", *DISPLAY_CONTROLS])
def test_display_controls_are_refused_naming_the_code_point(char: str) -> None:
    name = f"runs/{char}evil"
    with pytest.raises(cas_ckpt.errors.InvalidRefName, match=f"contains U\\+{ord(char):04X}\\b"):
        check_ref_name(name)


def test_a_bidi_control_is_refused_with_its_name() -> None:
    with pytest.raises(cas_ckpt.errors.InvalidRefName) as info:
        check_ref_name("runs/\u202eevil")
    assert str(info.value) == ("invalid ref name 'runs/\\u202eevil': contains U+202E (RIGHT-TO-LEFT "
                               "OVERRIDE), a bidi control that makes a name display as another")


def test_a_control_character_is_named_by_code_point() -> None:
    with pytest.raises(cas_ckpt.errors.InvalidRefName, match=r"contains U\+0007, a control"):
        check_ref_name("a\x07b")


display_control = st.one_of(st.sampled_from(DISPLAY_CONTROLS),
                            st.characters(min_codepoint=0x80, max_codepoint=0x9F))


@given(st.sampled_from(VALID_NAMES[:-1]), display_control, st.integers(min_value=0))
def test_fuzz_display_controls_are_refused_by_set_add_and_get(valid: str, char: str, at: int) -> None:
    """A C1 or bidi control anywhere makes a valid name invalid, for every operation of every
    local ref store; the name without it stays valid."""
    at %= len(valid) + 1
    name = valid[:at] + char + valid[at:]
    assert check_ref_name(valid) == valid
    with tempfile.TemporaryDirectory() as tmp:
        local = cas_ckpt.refs.LocalRefStore(Path(tmp))
        local.ensure_dirs()
        for store in (cas_ckpt.refs.MemoryRefStore(), local):
            with pytest.raises(cas_ckpt.errors.InvalidRefName, match=f"U\\+{ord(char):04X}"):
                store.add_if_new(name, A)
            with pytest.raises(cas_ckpt.errors.InvalidRefName, match=f"U\\+{ord(char):04X}"):
                store.set_if_equals(name, None, A)
            with pytest.raises(cas_ckpt.errors.InvalidRefName, match=f"U\\+{ord(char):04X}"):
                store.get(name)
            assert store.names() == []
            assert store.add_if_new(valid, A) and store.get(valid) == A


def test_a_name_an_older_writer_stored_is_listed_not_hidden(refs: cas_ckpt.refs.RefStore) -> None:
    """A ref an older cas_ckpt stored with a bidi control (written here through a ListedName, as
    it did) is listed, readable by the name listed, a GC root; the same text typed is refused."""
    bad = "runs/\u202eevil"
    assert refs.add_if_new(ListedName(bad), A, message="an older writer")
    refs.add_if_new("runs/good", B)
    fresh = refs  # local and S3 list the medium again: the name comes back from its file or key
    names = fresh.names()
    assert names == ["runs/good", bad]
    listed = names[1]
    assert isinstance(listed, ListedName)
    assert fresh.values() == {"runs/good": B, bad: A}
    assert fresh.values("runs/") == {"runs/good": B, bad: A}
    assert fresh.get(listed) == A and [e.new for e in fresh.reflog(listed)] == [A]
    assert bad in fresh.reflog_names()
    with pytest.raises(cas_ckpt.errors.InvalidRefName, match="U\\+202E"):
        fresh.get(bad)
    assert fresh.remove_if_equals(listed, A)  # and it can be cleaned up
    assert fresh.names() == ["runs/good"]


@given(name_text)
def test_fuzz_accepted_names_stay_inside_the_repository(name: str) -> None:
    """Whatever name is accepted, the files it makes are below refs/ and logs/."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "repo"
        store = cas_ckpt.refs.LocalRefStore(root)
        store.ensure_dirs()
        try:
            store.add_if_new(name, A)
        except cas_ckpt.errors.InvalidRefName:
            assert not _is_acceptable(name)
            assert sorted(p.name for p in Path(tmp).iterdir()) == ["repo"]
            assert not any(p.is_file() for p in root.rglob("*"))
            return
        files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
        assert files == ["locks/refs.lock", f"logs/{name}", f"refs/{name}"]
        assert store.names() == [name]
        assert store.get(name) == A


# -- compare-and-swap semantics (shared by both ref stores) --------------------------------------
@pytest.fixture(params=["local", "memory", "s3-moto", "s3-localstack"])
def refs(request: pytest.FixtureRequest, tmp_path: Path) -> cas_ckpt.refs.RefStore:
    if request.param == "memory":
        return cas_ckpt.refs.MemoryRefStore()
    if request.param.startswith("s3-"):  # conditional writes on real S3-protocol servers (test_s3.py)
        from cas_ckpt.refs.s3 import S3RefStore

        return S3RefStore(request.getfixturevalue("s3_url_on")(request.param[len("s3-"):]))
    store = cas_ckpt.refs.LocalRefStore(tmp_path / "repo")
    store.ensure_dirs()
    return store


def _log(refs: cas_ckpt.refs.RefStore, name: str) -> list[tuple[Any, Any, str]]:
    return [(e.old, e.new, e.message) for e in refs.reflog(name)]


def test_missing_ref_reads_as_none(refs: cas_ckpt.refs.RefStore) -> None:
    assert refs.get("main") is None
    assert refs.names() == []
    assert refs.reflog("main") == []


def test_add_if_new(refs: cas_ckpt.refs.RefStore) -> None:
    assert refs.add_if_new("runs/exp-7", A, message="create") is True
    assert refs.get("runs/exp-7") == A
    assert refs.add_if_new("runs/exp-7", B, message="again") is False
    assert refs.get("runs/exp-7") == A
    assert _log(refs, "runs/exp-7") == [(None, A, "create")]


def test_set_if_equals(refs: cas_ckpt.refs.RefStore) -> None:
    assert refs.set_if_equals("main", A, B) is False  # absent is not A
    assert refs.get("main") is None
    refs.add_if_new("main", A)
    assert refs.set_if_equals("main", B, C, message="stale") is False
    assert refs.get("main") == A
    assert refs.set_if_equals("main", A, B, message="move") is True
    assert refs.get("main") == B
    assert refs.set_if_equals("main", A, C) is False
    assert refs.get("main") == B
    assert _log(refs, "main") == [(None, A, ""), (A, B, "move")]


def test_set_if_equals_none_sets_unconditionally(refs: cas_ckpt.refs.RefStore) -> None:
    assert refs.set_if_equals("main", None, A, message="force create") is True
    assert refs.set_if_equals("main", None, B, message="force") is True
    assert refs.get("main") == B
    assert _log(refs, "main") == [(None, A, "force create"), (A, B, "force")]


def test_remove_if_equals(refs: cas_ckpt.refs.RefStore) -> None:
    assert refs.remove_if_equals("main", A) is False  # absent
    assert refs.remove_if_equals("main", None) is False
    refs.add_if_new("main", A)
    assert refs.remove_if_equals("main", B) is False
    assert refs.get("main") == A
    assert refs.remove_if_equals("main", A, message="delete") is True
    assert refs.get("main") is None
    assert refs.names() == []
    refs.add_if_new("main", B)
    assert refs.remove_if_equals("main", None, message="delete any") is True
    assert refs.get("main") is None
    # Unlike git, the reflog stays, ending in the deletion; a ref made again continues it.
    assert _log(refs, "main") == [(None, A, ""), (A, None, "delete"), (None, B, ""),
                                  (B, None, "delete any")]
    assert refs.reflog_names() == ["main"] and refs.names() == []


def test_a_deleted_refs_reflog_is_dropped_only_when_the_ref_is_absent_and_old_enough(
    refs: cas_ckpt.refs.RefStore,
) -> None:
    refs.add_if_new("runs/a", A, message="create")
    assert refs.drop_reflog("runs/a") is False  # the ref exists
    assert refs.drop_reflog("runs/none") is False  # nothing to drop
    refs.remove_if_equals("runs/a", A, message="delete")
    assert refs.drop_reflog("runs/a", older_than=time.time() - 3600) is False  # younger than that
    assert _log(refs, "runs/a") == [(None, A, "create"), (A, None, "delete")]
    assert refs.drop_reflog("runs/a", older_than=time.time() + 1) is True
    assert refs.reflog("runs/a") == [] and refs.reflog_names() == []
    assert refs.add_if_new("runs/a", B) and _log(refs, "runs/a") == [(None, B, "")]


def test_names_are_sorted_and_hierarchical(refs: cas_ckpt.refs.RefStore) -> None:
    for name in ["runs/exp-8", "main", "runs/exp-7", "zeta/a/b"]:
        assert refs.add_if_new(name, A)
    assert refs.names() == ["main", "runs/exp-7", "runs/exp-8", "zeta/a/b"]
    refs.remove_if_equals("runs/exp-7", A)
    assert refs.names() == ["main", "runs/exp-8", "zeta/a/b"]
    assert refs.reflog_names() == ["main", "runs/exp-7", "runs/exp-8", "zeta/a/b"]


@pytest.mark.parametrize("prefix", ["", "r", "run", "run.steps/", "run.steps/0000", "run.steps/x",
                                    "runs/", "runs/a/", "run.steps/00000002", "zz", "a/b/c/"])
def test_names_and_values_below_a_prefix(refs: cas_ckpt.refs.RefStore, prefix: str) -> None:
    """``names(prefix)``/``values(prefix)`` are ``names()``/the refs' values filtered by the
    prefix as a string (not a path), whichever directory or key the prefix ends in."""
    names = ["run", "run.steps/000000000001", "run.steps/000000000002", "run.stepsX",
             "runs/a/b", "runs/ab", "zeta"]
    for i, name in enumerate(names):
        assert refs.add_if_new(name, B if i % 2 else A)
    expected = [n for n in names if n.startswith(prefix)]
    assert refs.names(prefix) == expected
    assert refs.values(prefix) == {n: refs.get(n) for n in expected}
    assert refs.values() == {n: (B if i % 2 else A) for i, n in enumerate(names)}


@pytest.mark.parametrize("method", ["get", "add", "set", "remove", "reflog"])
def test_store_methods_validate_names(refs: cas_ckpt.refs.RefStore, method: str) -> None:
    call = {
        "get": lambda n: refs.get(n),
        "add": lambda n: refs.add_if_new(n, A),
        "set": lambda n: refs.set_if_equals(n, None, A),
        "remove": lambda n: refs.remove_if_equals(n, None),
        "reflog": lambda n: refs.reflog(n),
    }[method]
    with pytest.raises(cas_ckpt.errors.InvalidRefName):
        call("../outside")


def test_a_ref_and_a_ref_below_it_conflict_cleanly(refs: cas_ckpt.refs.RefStore) -> None:
    refs.add_if_new("runs/exp", A)
    with pytest.raises(cas_ckpt.errors.RefError):
        refs.add_if_new("runs", B)
    with pytest.raises(cas_ckpt.errors.RefError):
        refs.add_if_new("runs/exp/sub", B)
    assert refs.names() == ["runs/exp"]
    assert refs.remove_if_equals("runs/exp", A)
    assert [e.new for e in refs.reflog("runs/exp")] == [A, None]  # kept
    if isinstance(refs, cas_ckpt.refs.LocalRefStore):
        # On disk the kept reflog lies in logs/runs/, where the reflog file of "runs" would go:
        # refused, naming the deleted ref and what frees the name, until that reflog is dropped.
        with pytest.raises(cas_ckpt.errors.InvalidRefName, match="kept reflog of the deleted ref 'runs/exp'"):
            refs.add_if_new("runs", B)
        assert refs.drop_reflog("runs/exp")
    assert refs.add_if_new("runs", B)
    assert refs.get("runs") == B


def test_s3_a_ref_made_again_while_gc_drops_its_old_reflog_reads_cleanly(s3_url: str) -> None:
    """A re-created ref's first entry links to the deletion before it; a GC dropping that old
    history meanwhile must not make the new chain look damaged."""
    from cas_ckpt.refs.s3 import S3RefStore

    refs = S3RefStore(s3_url)
    refs.add_if_new("runs/a", A, message="create")
    refs.remove_if_equals("runs/a", A, message="delete")
    old = [m.key for m in refs._entries("runs/a")]  # what a racing drop_reflog deletes
    refs.add_if_new("runs/a", B, message="again")
    assert _log(refs, "runs/a") == [(None, A, "create"), (A, None, "delete"), (None, B, "again")]
    refs.bucket.delete_many(old)
    assert _log(refs, "runs/a") == [(None, B, "again")]
    refs.set_if_equals("runs/a", B, C, message="move")
    assert _log(refs, "runs/a") == [(None, B, "again"), (B, C, "move")]


def test_on_disk_a_kept_reflog_above_a_new_name_is_refused_naming_it(tmp_path: Path) -> None:
    refs = cas_ckpt.refs.LocalRefStore(tmp_path / "repo")
    refs.ensure_dirs()
    refs.add_if_new("runs", A)
    refs.remove_if_equals("runs", A)
    with pytest.raises(cas_ckpt.errors.InvalidRefName, match=r"deleted ref 'runs'.*ref restore runs"):
        refs.add_if_new("runs/exp", B)
    assert refs.names() == [] and [e.new for e in refs.reflog("runs")] == [A, None]
    assert refs.add_if_new("runs", B)  # the name itself is free: its reflog goes on
    assert [e.new for e in refs.reflog("runs")] == [A, None, B]


def test_a_huge_reflog_message_is_cut_to_fit_a_line(tmp_path: Path) -> None:
    """Readers refuse reflog lines over 64 KiB (no real one is): a long message is cut instead."""
    store = cas_ckpt.refs.LocalRefStore(tmp_path / "repo")
    store.ensure_dirs()
    assert store.add_if_new("main", A, message="\U0001f600" * 100_000)  # 12 bytes each, escaped
    assert store.set_if_equals("main", A, B, message="short")
    assert [(e.message, e.new) for e in store.reflog("main")] == [("\U0001f600" * 4096, A), ("short", B)]


def _store_with_a_reflog(tmp_path: Path) -> tuple[cas_ckpt.refs.LocalRefStore, Path]:
    store = cas_ckpt.refs.LocalRefStore(tmp_path / "repo")
    store.ensure_dirs()
    assert store.add_if_new("main", A)
    return store, tmp_path / "repo" / "logs" / "main"


WRONG_SHAPES = {
    "a missing field": b'{"new": null, "time": 0, "message": ""}\n',
    "an array": b"[1]\n",
    "a null time": b'{"old": null, "new": null, "time": null, "message": ""}\n',
}


@pytest.mark.parametrize("line", WRONG_SHAPES.values(), ids=WRONG_SHAPES.keys())
def test_a_reflog_line_of_the_wrong_shape_is_corrupt_naming_the_file_and_line(
    tmp_path: Path, line: bytes
) -> None:
    store, log = _store_with_a_reflog(tmp_path)
    log.write_bytes(log.read_bytes() + line)
    with pytest.raises(cas_ckpt.errors.CorruptStore, match=r"logs/main: line 2: ") as info:
        store.reflog("main")
    assert info.value.path == str(log)


def test_blank_reflog_lines_are_skipped(tmp_path: Path) -> None:
    store, log = _store_with_a_reflog(tmp_path)
    log.write_bytes(b"\n" + log.read_bytes() + b"  \n" + log.read_bytes())
    assert [e.new for e in store.reflog("main")] == [A, A]


def test_a_torn_first_reflog_line_is_dropped_by_the_next_update(tmp_path: Path) -> None:
    store, log = _store_with_a_reflog(tmp_path)
    log.write_bytes(b'{"old": null, "new": "bag')  # the first append, cut short
    assert store.reflog("main") == []
    assert store.set_if_equals("main", A, B)
    assert [(e.old, e.new) for e in store.reflog("main")] == [(A, B)]


@pytest.mark.parametrize("data", [None, b"", b"junk", b"[1]", b"{}", b'{"time": 0, "pid": "x", "host": "h"}',
                                  b'{"time": 1e300, "pid": 1, "host": "h"}'])
def test_a_lease_holder_that_does_not_parse_is_another_writer(data: bytes | None) -> None:
    assert describe_holder(data) == "another writer (its lease does not say who)"
    valid = b'{"time": 0, "pid": 12, "host": "h"}'
    assert describe_holder(valid) == "pid 12 on host h since 1970-01-01T00:00:00Z"


def test_every_update_is_in_the_reflog(repo: cas_ckpt.Repository) -> None:
    saved = [repo.save({"step": i}, step=i) for i in range(5)]
    other = repo.save({"x": 1}, ref="runs/exp-7")
    repo.set_ref("main", saved[1], expected=saved[-1])
    repo.delete_ref("runs/exp-7")
    log = repo.reflog("main")
    assert [e.new for e in log] == [cidlib.to_bytes(c) for c in [*saved, saved[1]]]
    assert [e.old for e in log] == [None, *(cidlib.to_bytes(c) for c in saved)]
    assert [e.message for e in log[:5]] == [f"save step={i}" for i in range(5)]
    assert all(a.time <= b.time for a, b in itertools.pairwise(log))
    assert all(abs(e.time - time.time()) < 60 for e in log)
    kept = [(None, cidlib.to_bytes(other)), (cidlib.to_bytes(other), None)]
    assert [(e.old, e.new) for e in repo.reflog("runs/exp-7")] == kept  # kept, with its deletion
    again = repo.save({"x": 2}, ref="runs/exp-7")
    assert [(e.old, e.new) for e in repo.reflog("runs/exp-7")] == [*kept, (None, cidlib.to_bytes(again))]
    assert other != again


# -- a deleted ref's safety net ------------------------------------------------------------------
def test_a_deleted_ref_keeps_its_checkpoint_through_gc_and_comes_back(repo: cas_ckpt.Repository) -> None:
    """`ref delete runs/important` then any default GC (a plain one, or another run's retention)
    freed the data at once: the reflog went with the ref. Now the deletion is a reflog entry,
    a GC root for the expiry, and the ref can be restored from it."""
    first = repo.save({"w": np.arange(5000.0)}, ref="runs/important", step=1)
    held = repo.save({"w": np.arange(5000.0) + 1}, ref="runs/important", step=2)
    repo.delete_ref("runs/important")
    log = repo.reflog("runs/important")
    assert [(e.old, e.new, e.message) for e in log][-1] == (cidlib.to_bytes(held), None, "delete")
    assert repo.gc().blocks_freed == 0  # a plain GC keeps what the reflog names
    other = cas_ckpt.CheckpointManager(repo, "runs/other", keep_last=1)
    for step in range(3):  # another run's retention GC (its own reflogs expired only)
        other.save(step, {"v": np.full(5000, step)})
    other.close()
    assert repo.load(held)["w"][0] == 1 and repo.load(first)["w"][0] == 0
    assert repo.restore_ref("runs/important") == held
    assert repo.load("runs/important")["w"][0] == 1
    assert repo.reflog("runs/important")[-1].message.startswith("restore ")
    with pytest.raises(cas_ckpt.errors.RefError, match="exists"):
        repo.restore_ref("runs/important")
    repo.delete_ref("runs/important")
    assert repo.set_ref("runs/important", "runs/important@{1}") == held  # as git's REF@{N}
    with pytest.raises(cas_ckpt.errors.ReflogEntryNotFound, match="deleted 'runs/important'"):
        repo.resolve("runs/important@{1}")  # that entry is the deletion
    with pytest.raises(cas_ckpt.errors.ReflogEntryNotFound, match="has 6 entries"):
        repo.resolve("runs/important@{6}")
    assert repo.resolve("runs/important@{5}") == first
    repo.delete_ref("runs/important")
    report = repo.gc(reflog_expiry=0)  # only now: what refs and pins reach, deleted reflogs dropped
    assert report.blocks_freed > 0 and report.reflogs_dropped == 1
    assert repo.refs_store.reflog("runs/important") == [] and not repo.blocks.has(cidlib.to_bytes(held))
    with pytest.raises(cas_ckpt.errors.RefNotFound):  # neither the ref nor a reflog of it now
        repo.reflog("runs/important")
    with pytest.raises(cas_ckpt.errors.RefNotFound):
        repo.restore_ref("runs/important")


def test_a_deletion_keeps_what_the_ref_held_however_long_ago_it_was_set(tmp_path: Path) -> None:
    """GC roots both sides of a young reflog entry: the value a ref was set to 40 days ago and
    deleted today is kept for the expiry from today."""
    with cas_ckpt.open(tmp_path / "repo") as repo:
        held = repo.save({"w": np.arange(5000.0)}, ref="old")
        log = tmp_path / "repo" / "logs" / "old"
        entry = json.loads(log.read_text())
        log.write_text(json.dumps({**entry, "time": time.time() - 40 * 86400}) + "\n")
        assert repo.gc().blocks_freed == 0  # the ref itself holds it
        repo.delete_ref("old")
        assert repo.gc().blocks_freed == 0
        assert repo.load(held)["w"][0] == 0
        assert repo.gc(reflog_expiry=0).blocks_freed > 0


def test_gc_drops_a_deleted_refs_reflog_once_it_roots_nothing(repo: cas_ckpt.Repository) -> None:
    repo.save({"v": 1}, ref="gone")
    repo.save({"v": 2}, ref="kept")
    repo.delete_ref("gone")
    assert repo.gc().reflogs_dropped == 0  # young: still a root
    assert repo.gc(dry_run=True, reflog_expiry=0).reflogs_dropped == 0  # a dry run drops nothing
    assert "gone" in repo.refs_store.reflog_names()
    assert repo.gc(reflog_expiry=0).reflogs_dropped == 1
    assert repo.refs_store.reflog_names() == ["kept"]  # a live ref's reflog is never dropped
    mgr = cas_ckpt.CheckpointManager(repo, "run", keep_last=1)
    for step in range(5):  # retention deletes step refs: its own GC drops their reflogs at once
        mgr.save(step, {"v": step})
    mgr.close()
    assert repo.refs_store.reflog_names() == ["kept", "run", "run.steps/000000000004"]


def test_stale_expected_value_is_a_conflict(repo: cas_ckpt.Repository) -> None:
    first = repo.save({"a": 1})
    second = repo.save({"a": 2})
    with pytest.raises(cas_ckpt.errors.RefConflict) as info:
        repo.set_ref("main", first, expected=first)
    assert info.value.ref == "main"
    assert str(first) in str(info.value) and str(second) in str(info.value)
    assert repo.resolve("main") == second
    with pytest.raises(cas_ckpt.errors.RefConflict):
        repo.delete_ref("main", expected=first)
    assert repo.resolve("main") == second
    assert len(repo.reflog("main")) == 2  # failed swaps are not logged


# -- the ref lock: a kernel lock on locks/refs.lock, gone when its holder is ----------------------
HOLDER = textwrap.dedent(
    """
    import fcntl, os, sys, time
    fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)  # what docs/format.md tells another implementation to do
    print("held", flush=True)
    time.sleep(float(sys.argv[2]))
    """
)


@pytest.fixture
def local_refs(tmp_path: Path) -> cas_ckpt.refs.LocalRefStore:
    store = cas_ckpt.refs.LocalRefStore(tmp_path / "repo", lock_timeout=0.3)
    store.ensure_dirs()
    store.add_if_new("main", A)
    return store


@contextlib.contextmanager
def _holder(store: cas_ckpt.refs.LocalRefStore, seconds: float) -> Iterator[subprocess.Popen[str]]:
    """Another process holding the repository's ref lock for ``seconds``."""
    lock = store.locks_dir / "refs.lock"
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(lock), str(seconds)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        yield proc
    finally:
        proc.kill()
        proc.communicate()


def test_live_holder_is_waited_for_up_to_lock_timeout(local_refs: cas_ckpt.refs.LocalRefStore) -> None:
    with _holder(local_refs, 60):
        started = time.monotonic()
        with pytest.raises(cas_ckpt.errors.RefLocked) as info:
            local_refs.set_if_equals("main", A, B)
        waited = time.monotonic() - started
    assert 0.3 <= waited < 10.0
    assert info.value.ref == "main" and "'main'" in str(info.value)
    assert info.value.lock_path == str(local_refs.locks_dir / "refs.lock")
    assert info.value.lock_path in str(info.value)
    assert local_refs.get("main") == A
    assert [e.new for e in local_refs.reflog("main")] == [A]


def test_holder_that_lets_go_in_time_is_waited_for(local_refs: cas_ckpt.refs.LocalRefStore) -> None:
    patient = cas_ckpt.refs.LocalRefStore(local_refs.root, lock_timeout=30.0)
    with _holder(local_refs, 0.4) as holder:
        started = time.monotonic()
        assert patient.set_if_equals("main", A, B) is True
        assert time.monotonic() - started > 0.3  # it waited for the holder to exit
        assert holder.wait(timeout=30) == 0
    assert patient.get("main") == B


def test_lock_of_a_killed_holder_is_gone_at_once(local_refs: cas_ckpt.refs.LocalRefStore) -> None:
    with _holder(local_refs, 60) as holder:
        holder.kill()  # SIGKILL: no cleanup code runs; the kernel drops the lock with the process
        holder.wait()
        assert local_refs.set_if_equals("main", A, B) is True  # lock_timeout is 0.3 s
    assert local_refs.get("main") == B


FORKER = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from cas_ckpt import _fs

    with _fs.flocked(Path(sys.argv[1]), exclusive=True):
        child = os.fork()  # as a fork-started worker pool would, while a ref update is running
        if child == 0:
            time.sleep(60)
            os._exit(0)
    print(child, flush=True)  # the update is over; the child still has the descriptor
    time.sleep(60)
    """
)


def test_a_child_forked_during_an_update_does_not_keep_the_lock(
    local_refs: cas_ckpt.refs.LocalRefStore,
) -> None:
    lock = local_refs.locks_dir / "refs.lock"
    proc = subprocess.Popen([sys.executable, "-c", FORKER, str(lock)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        child = int(proc.stdout.readline())
        try:
            assert local_refs.set_if_equals("main", A, B) is True  # lock_timeout is 0.3 s
        finally:
            os.kill(child, signal.SIGKILL)
    finally:
        proc.kill()
        proc.communicate()


def _old_lock(pid: int, host: str | None = None) -> str:
    """A lock file as cas_ckpt 0.1 wrote it: "pid host time uuid"."""
    return f"{pid} {host or socket.gethostname()} {time.time():.3f} deadbeef\n"


@pytest.fixture
def live_pid() -> Iterator[int]:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize(
    "kind", ["pid 1 (a container's init)", "live pid, renamed host", "garbage", "empty"]
)
def test_old_lock_files_block_nothing(tmp_path: Path, live_pid: int, kind: str) -> None:
    """A trainer that ran as pid 1, or on a host since renamed, left its lock: it must not matter."""
    text = {
        "pid 1 (a container's init)": _old_lock(1),
        "live pid, renamed host": _old_lock(live_pid, "old-hostname"),
        "garbage": "garbage",
        "empty": "",
    }[kind]
    with cas_ckpt.open(tmp_path / "repo") as repo:
        first = repo.save({"a": 1})
        nested = repo.save({"n": 1}, ref="runs/x")
        (tmp_path / "repo" / "refs" / "main.lock").write_text(text)
        (tmp_path / "repo" / "refs" / "runs" / "x.lock").write_text(text)
        started = time.monotonic()
        second = repo.save({"a": 2})
        assert time.monotonic() - started < 5.0  # no waiting on a lock nobody holds
        assert repo.resolve() == second and repo.commit(second).parents == (first,)
        assert repo.save({"n": 2}, ref="runs/x") != nested
        repo.delete_ref("runs/x")  # the leftover does not keep the emptied directory either
    assert not (tmp_path / "repo" / "refs" / "runs").exists()


def test_lock_file_replaced_while_waiting_is_locked_again(
    local_refs: cas_ckpt.refs.LocalRefStore,
) -> None:
    """Locking a file that no longer has the lock's name locks nothing: take the new one."""
    lock = local_refs.locks_dir / "refs.lock"
    first = os.open(lock, os.O_RDWR | os.O_CREAT)
    fcntl.flock(first, fcntl.LOCK_EX)
    store = cas_ckpt.refs.LocalRefStore(local_refs.root, lock_timeout=1.5)
    outcome: list[object] = []

    def update() -> None:
        try:
            outcome.append(store.set_if_equals("main", A, B))
        except cas_ckpt.errors.RefLocked as exc:
            outcome.append(exc)

    waiter = threading.Thread(target=update)
    waiter.start()
    time.sleep(0.3)  # the waiter has opened the first file and polls its lock
    lock.unlink()
    second = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_EXCL)
    try:
        fcntl.flock(second, fcntl.LOCK_EX)  # another locker holds the file now named refs.lock
        os.close(first)  # frees the unlinked file's lock: the waiter must not take that as its own
        waiter.join()
        assert len(outcome) == 1 and isinstance(outcome[0], cas_ckpt.errors.RefLocked), outcome
        assert local_refs.get("main") == A
    finally:
        os.close(second)
    assert store.set_if_equals("main", A, B) is True


def test_no_lock_files_are_left_behind(local_repo: cas_ckpt.Repository) -> None:
    for i in range(3):
        local_repo.save({"i": i}, ref=f"runs/r{i}")
        local_repo.save({"i": i})
    local_repo.delete_ref("runs/r1")
    root = Path(local_repo.location)
    assert not [p for p in (root / "refs").rglob("*.lock")]
    # kept (docs/format.md): upkeep's, as the first save wrote the first index snapshot
    assert sorted(p.name for p in (root / "locks").iterdir()) == ["gc.lock", "refs.lock", "upkeep.lock"]
    assert not [p for p in root.rglob("*.tmp")]


# -- two processes racing on one ref --------------------------------------------------------------
RACER = textwrap.dedent(
    """
    import os, sys, time
    import numpy as np
    import cas_ckpt

    path, go, name, count = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    rng = np.random.default_rng(abs(hash(name)) % 2**32)
    with cas_ckpt.open(path) as repo:
        while not os.path.exists(go):
            time.sleep(0.001)
        conflicts = 0
        for i in range(count):
            while True:
                try:
                    head = repo.resolve("main")
                    previous = repo.load(head, path="i")
                except cas_ckpt.errors.RefNotFound:
                    previous = -1
                state = {"writer": name, "i": previous + 1, "w": rng.random(40_000)}
                try:
                    cid = repo.save(state, ref="main", step=i)
                except cas_ckpt.errors.RefConflict:
                    conflicts += 1
                    continue
                print("saved", cid, flush=True)
                break
        print("conflicts", conflicts, flush=True)
    """
)


def test_two_processes_racing_on_one_ref_lose_nothing(tmp_path: Path) -> None:
    path, go = tmp_path / "repo", tmp_path / "go"
    cas_ckpt.open(path).close()
    script = tmp_path / "racer.py"
    script.write_text(RACER)
    count = 25
    env = {**os.environ, "PYTHONPATH": str(Path(cas_ckpt.__file__).parent.parent)}
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(path), str(go), name, str(count)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for name in ("alpha", "beta")
    ]
    time.sleep(0.5)  # both importing and waiting for the start signal
    go.touch()
    saved: list[str] = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        lines = out.split()
        saved += [lines[i + 1] for i, word in enumerate(lines) if word == "saved"]
    assert len(saved) == 2 * count
    assert len(set(saved)) == 2 * count

    with cas_ckpt.open(path) as repo:
        log = repo.reflog("main")
        # Every successful save is in the reflog, once, and the updates form one chain.
        assert sorted(cidlib.to_str(e.new) for e in log) == sorted(saved)
        assert log[0].old is None
        assert all(a.new == b.old for a, b in itertools.pairwise(log))
        # The ref holds the last successful save, and history from it reaches every save.
        assert cidlib.to_bytes(repo.resolve("main")) == log[-1].new
        history = [str(c.cid) for c in repo.log("main")]
        assert sorted(history) == sorted(saved)
        assert history == [cidlib.to_str(e.new) for e in reversed(log)]
        assert not list((path / "refs").glob("*.lock"))


def test_a_repository_holding_a_bidi_name_stays_usable(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A local repository an older cas_ckpt left a ``runs/\\u202eevil`` ref in: ``cas-ckpt refs``
    shows it escaped, GC keeps its checkpoint, fsck is clean, and it can be renamed."""
    from cas_ckpt import cli

    root = tmp_path / "repo"
    bad = "runs/\u202eevil"
    with cas_ckpt.open(root) as repo:
        kept = repo.save({"x": np.arange(4)}, ref="runs/was-evil")
        repo.save({"y": 1}, ref="runs/good")
    for folder in ("refs", "logs"):  # the files an older writer made under that name
        os.rename(root / folder / "runs" / "was-evil", root / folder / "runs" / "\u202eevil")
    assert cli.main(["refs", "--repo", str(root)]) == 0
    out = capsys.readouterr().out
    assert f"{kept}  runs/\\u202eevil\n" in out and "\u202e" not in out
    assert cli.main(["refs", "--repo", str(root), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[bad] == str(kept)
    with cas_ckpt.open(root) as repo:
        assert repo.refs()[bad] == kept
        assert repo.gc().blocks_freed == 0
        assert repo.fsck().ok
        with pytest.raises(cas_ckpt.errors.InvalidRefName, match="U\\+202E"):
            repo.load(bad)
        listed = next(name for name in repo.refs() if name == bad)
        assert repo.rename_ref(listed, "runs/evil") == kept
        assert sorted(repo.refs()) == ["runs/evil", "runs/good"]
        assert repo.load("runs/evil")["x"].tolist() == [0, 1, 2, 3]
