"""The git-like commands and targets, run through the installed ``cas-ckpt`` console script."""

from __future__ import annotations

import json
import os
import pty
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import cas_ckpt
from cas_ckpt import cli
from cas_ckpt.errors import RefConflict, RefNotFound

SCRIPT = Path(sys.executable).parent / "cas-ckpt"
pytestmark = pytest.mark.skipif(not SCRIPT.exists(), reason="cas-ckpt console script not installed")


def cas(repo: Path, *argv: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """One run of the real console script; stderr never holds a traceback."""
    done = subprocess.run([str(SCRIPT), "--repo", str(repo), *argv], capture_output=True, text=True,
                          timeout=60, **kwargs)
    assert "Traceback" not in done.stderr
    return done


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """main: three commits with metrics and messages; exp forked at main~1 with one more."""
    path = tmp_path / "repo"
    with cas_ckpt.open(path, chunk_size=4096) as r:
        for step in (1, 2, 3):
            r.save({"w": np.full(3000, step, dtype=np.float32), "rng": os.urandom(2000)},
                   ref="main", step=step, metadata={"metrics": {"loss": 1.0 / step}},
                   message=f"epoch {step}")
        r.fork("main~1", "exp")
        r.save({"w": np.zeros(3000, dtype=np.float32)}, ref="exp", step=3, metadata={"lr": 0.1})
    return path


def test_ref_set_delete_rename_list_and_reflog(repo: Path) -> None:
    head = cas(repo, "show", "main", "--json")
    assert head.returncode == 0
    parent = json.loads(cas(repo, "log", "main~1", "-n", "1", "--json").stdout)[0]["cid"]
    assert cas(repo, "ref", "set", "best", "main~1").stdout.strip() == f"best -> {parent}"
    assert json.loads(cas(repo, "ref", "list", "be", "--json").stdout) == {"best": parent}
    assert json.loads(cas(repo, "refs", "be", "--json").stdout) == {"best": parent}  # the alias
    conflict = cas(repo, "ref", "set", "best", "main", "--expect", "main")
    assert conflict.returncode == cli.EXIT_ERROR and "changed concurrently" in conflict.stderr
    assert cas(repo, "ref", "set", "best", "main", "--expect", parent[:12]).returncode == 0
    taken = cas(repo, "ref", "rename", "best", "exp")
    assert taken.returncode == cli.EXIT_ERROR
    assert cas(repo, "ref", "rename", "best", "best2").returncode == 0
    refs = json.loads(cas(repo, "ref", "list", "--json").stdout)
    assert "best" not in refs and "best2" in refs
    assert cas(repo, "ref", "set", "best2", "main~2").returncode == 0
    log = json.loads(cas(repo, "reflog", "best2", "--json").stdout)  # newest first
    assert [e["message"] for e in log] == [f"set to {log[0]['new']}", "rename from best"]
    assert log[0]["old"] == log[1]["new"] and log[1]["old"] is None
    assert cas(repo, "reflog", "best2").stdout.splitlines()[1].endswith("rename from best  (was absent)")
    kept = json.loads(cas(repo, "reflog", "best", "--json").stdout)  # kept with its ref's deletion
    assert kept[0]["new"] is None and kept[0]["message"] == "rename to best2"
    assert cas(repo, "reflog", "best").stdout.startswith("best@{0}  (deleted)  ")
    assert cas(repo, "ref", "delete", "best2").stdout.startswith("deleted best2 (its reflog is kept")
    missing = cas(repo, "ref", "delete", "best2")
    assert missing.returncode == cli.EXIT_NOT_FOUND and "not found" in missing.stderr


def test_rename_api_is_two_compare_and_swaps(tmp_path: Path) -> None:
    with cas_ckpt.open(tmp_path / "r") as r:
        a = r.save({"x": 1}, ref="a")
        r.save({"x": 2}, ref="b")
        with pytest.raises(RefConflict):
            r.rename_ref("a", "b")
        assert r.resolve("a") == a  # nothing moved
        assert r.rename_ref("a", "c") == a and set(r.refs()) == {"b", "c"}
        with pytest.raises(RefNotFound):
            r.rename_ref("a", "d")


def test_log_metrics_messages_forks_and_expired(repo: Path) -> None:
    lines = cas(repo, "log").stdout.splitlines()
    assert len(lines) == 3 and lines[0].endswith("step 3  loss=0.333333  epoch 3")
    assert "[fork: exp]" in lines[1] and "[fork" not in lines[0]
    assert cas(repo, "log", "exp").stdout.splitlines()[0].endswith("lr=0.1")
    assert cas(repo, "gc", "--reflog-expiry", "0").returncode == 0
    rows = json.loads(cas(repo, "log", "--json").stdout)
    assert [r["expired"] for r in rows] == [False, True, True]  # exp holds only its own data
    assert rows[1]["forks"] == ["exp"]
    assert "[expired]" in cas(repo, "log").stdout.splitlines()[2]
    for argv in (("ls", "main~2"), ("diff", "main~2", "main"), ("export", "main~2", "-o", "x.car")):
        done = cas(repo, *argv)
        assert done.returncode == cli.EXIT_NOT_FOUND, argv
        assert "its data was garbage collected" in done.stderr and "damage" not in done.stderr


def test_log_without_main_lists_the_refs(repo: Path) -> None:
    assert cas(repo, "ref", "rename", "main", "trunk").returncode == 0
    done = cas(repo, "log")
    assert done.returncode == cli.EXIT_NOT_FOUND and "refs here: exp, trunk" in done.stderr


def test_targets_prefixes_and_ancestors(repo: Path) -> None:
    rows = json.loads(cas(repo, "log", "--json").stdout)
    assert json.loads(cas(repo, "log", rows[0]["cid"][:14] + "~2", "--json").stdout)[0]["cid"] == (
        rows[2]["cid"])
    assert json.loads(cas(repo, "show", "main~0").stdout)["step"] == 3
    ambiguous = cas(repo, "show", "bagaqier")
    assert ambiguous.returncode == cli.EXIT_USAGE and rows[0]["cid"] in ambiguous.stderr
    bad = cas(repo, "show", "bafyxx...")
    assert bad.returncode == cli.EXIT_USAGE and "invalid base32" in bad.stderr
    past = cas(repo, "ls", "main~3")
    assert past.returncode == cli.EXIT_NOT_FOUND and "stops after 2 ancestor" in past.stderr


def test_du_counts_a_checkpoint_once(tmp_path: Path) -> None:
    path = tmp_path / "r"
    with cas_ckpt.open(path) as r:
        for name in ("a", "b", "c"):  # three unrelated checkpoints, each also under .steps/1
            cid = r.save({"w": np.random.default_rng(len(name) + ord(name)).random(5000)}, ref=name)
            r.set_ref(f"{name}.steps/1", cid)
    usage = json.loads(cas(path, "du", "--json").stdout)
    assert usage["dedup_ratio"] == pytest.approx(1.0, abs=0.01)
    assert len(usage["refs"]) == 6


def test_fsck_summary_is_consistent(repo: Path) -> None:
    done = cas(repo, "fsck")
    assert done.returncode == 0
    report = json.loads(cas(repo, "fsck", "--json").stdout)
    assert (f"checked {report['blocks_checked']} of {report['blocks_total']} stored blocks; "
            f"{report['reachable_blocks']} blocks reachable from 2 refs, 0 of them missing: ok"
            ) in done.stdout


def test_cat_refuses_a_terminal(repo: Path) -> None:
    leader, follower = pty.openpty()
    try:
        done = subprocess.run([str(SCRIPT), "--repo", str(repo), "cat", "main"], stdout=follower,
                              stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(follower)
        os.close(leader)
    assert done.returncode == cli.EXIT_USAGE and "refusing to write binary" in done.stderr


def test_progress_lines_are_wiped_before_messages(repo: Path) -> None:
    """On a terminal, fsck shows a progress line on stderr; it is wiped (``\\r``, blanks, ``\\r``)
    before anything else is written to the terminal, so no message ends up glued to it."""
    leader, follower = pty.openpty()
    try:
        done = subprocess.run([str(SCRIPT), "--repo", str(repo), "fsck"], stdout=follower,
                              stderr=follower, timeout=60)
        os.close(follower)
        follower = -1
        screen = b""
        while True:
            try:
                piece = os.read(leader, 65536)
            except OSError:  # EIO: the child closed its side
                break
            if not piece:
                break
            screen += piece
    finally:
        if follower >= 0:
            os.close(follower)
        os.close(leader)
    text = screen.decode()
    assert done.returncode == 0 and "\rfsck: " in text, text  # a progress line was shown
    before, summary = text.rsplit("checked ", 1)
    last_progress = before.rindex("\rfsck: ")
    wipe = re.search(r"\r +\r", before[last_progress:])
    assert wipe is not None and before[last_progress:].endswith(wipe.group()), repr(before[-200:])
    assert summary.endswith(": ok\r\n") or summary.endswith(": ok\n"), summary


def test_diff_in_state_order_with_a_path_and_stat(repo: Path) -> None:
    done = cas(repo, "diff", "main~1", "main")
    assert done.returncode == cli.EXIT_CHECK
    lines = done.stdout.splitlines()
    assert [line.split(":")[0] for line in lines[:-1]] == ["~ w", "~ rng"]  # the state's order
    assert lines[1] == "~ rng: bytes of 2000 -> bytes of 2000"  # an RNG state: one short line
    only = json.loads(cas(repo, "diff", "main~1", "main", "rng", "--json").stdout)
    assert [c["path"] for c in only["changed"]] == ["rng"] and only["unchanged"] == 0
    stat = cas(repo, "diff", "main~1", "main", "--stat")
    assert stat.stdout == "2 changed, 0 added, 0 removed, 0 unchanged\n"
    missing = cas(repo, "diff", "main~1", "main", "nothing")
    assert missing.returncode == cli.EXIT_NOT_FOUND and "'nothing' not found" in missing.stderr
    with cas_ckpt.open(repo, create=False) as r:
        report = r.diff("main", "exp")
    assert report.removed == ["rng"] and [c.path for c in report.changed] == ["w"]


def test_ctrl_c_during_start_up_prints_no_traceback(repo: Path, tmp_path: Path) -> None:
    # A Ctrl-C that lands while the script imports its dependencies: raised by a meta-path hook, as
    # the SIGINT handler would raise it there.
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import sys\n"
        "class Interrupt:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'multiformats':\n"
        "            raise KeyboardInterrupt\n"
        "sys.meta_path.insert(0, Interrupt())\n"
    )
    env = {**os.environ, "PYTHONPATH": str(hook)}
    done = cas(repo, "log", env=env)
    assert done.returncode == cli.EXIT_INTERRUPTED
    assert done.stderr == "cas-ckpt: error: interrupted\n" and done.stdout == ""


def test_a_deleted_ref_is_listed_in_its_reflog_kept_by_gc_and_restored(repo: Path) -> None:
    held = json.loads(cas(repo, "log", "exp", "-n", "1", "--json").stdout)[0]["cid"]
    assert cas(repo, "ref", "delete", "exp").returncode == 0
    log = cas(repo, "reflog", "exp")
    assert log.returncode == 0 and log.stdout.startswith("exp@{0}  (deleted)  ")
    assert f"(was {held})" in log.stdout.splitlines()[0]
    assert cas(repo, "gc").returncode == 0  # the default GC keeps it: the deletion is a root
    assert cas(repo, "ref", "restore", "exp").stdout == f"restored exp -> {held}\n"
    assert cas(repo, "fsck").returncode == 0
    assert cas(repo, "ref", "delete", "exp").returncode == 0
    assert cas(repo, "ref", "set", "exp", "exp@{1}").stdout == f"exp -> {held}\n"
    again = cas(repo, "ref", "restore", "exp")
    assert again.returncode == cli.EXIT_ERROR and "exists" in again.stderr
    assert cas(repo, "reflog", "--drop", "exp").returncode == cli.EXIT_ERROR  # exists: kept
    assert cas(repo, "ref", "delete", "exp").returncode == 0
    assert cas(repo, "reflog", "--drop", "exp").stdout == "dropped the reflog of exp\n"
    gone = cas(repo, "reflog", "exp", "--json")  # neither the ref nor a reflog of it now
    assert gone.returncode == cli.EXIT_NOT_FOUND and gone.stdout == "" and "not found" in gone.stderr
    assert cas(repo, "ref", "restore", "exp").returncode == cli.EXIT_NOT_FOUND


@pytest.fixture
def run_repo(tmp_path: Path) -> Path:
    """runs/a (a manager's head and steps 1-3), runs/b, and runs/ab (a name that starts alike)."""
    path = tmp_path / "runs-repo"
    with cas_ckpt.open(path) as r:
        with cas_ckpt.CheckpointManager(r, "runs/a") as manager:
            for step in (1, 2, 3):
                manager.save(step, {"w": np.full(100, step)})
        r.save({"b": 1}, ref="runs/b")
        r.save({"ab": 1}, ref="runs/ab")
    return path


RUN_A = ["runs/a", "runs/a.steps/000000000001", "runs/a.steps/000000000002",
         "runs/a.steps/000000000003"]


def _refs(repo: Path) -> list[str]:
    return sorted(json.loads(cas(repo, "refs", "--json").stdout))


def test_ref_delete_recursive_needs_a_confirmation_and_keeps_the_reflogs(run_repo: Path) -> None:
    everything = _refs(run_repo)
    listed = cas(run_repo, "ref", "delete", "--recursive", "runs/a", "--dry-run")
    assert listed.returncode == 0 and [line.split()[-1] for line in listed.stdout.splitlines()[:-1]] == RUN_A
    assert "nothing deleted" in listed.stdout
    refused = cas(run_repo, "ref", "delete", "--recursive", "runs/a", stdin=subprocess.DEVNULL)
    assert refused.returncode == cli.EXIT_USAGE and "--yes" in refused.stderr  # no terminal to ask
    assert _refs(run_repo) == everything
    done = cas(run_repo, "ref", "delete", "-r", "runs/a", "--yes")
    assert done.returncode == 0 and "deleted 4 ref(s)" in done.stdout
    assert _refs(run_repo) == ["runs/ab", "runs/b"]
    for name in RUN_A:  # every reflog kept, ending in its deletion
        assert cas(run_repo, "reflog", name).stdout.startswith(f"{name}@{{0}}  (deleted)")
    assert cas(run_repo, "gc", "--json").returncode == 0
    assert cas(run_repo, "ref", "restore", "runs/a").returncode == 0
    assert cas(run_repo, "log", "runs/a", "-n", "1").returncode == 0
    missing = cas(run_repo, "ref", "delete", "-r", "runs/zzz", "--yes")
    assert missing.returncode == cli.EXIT_NOT_FOUND


@pytest.mark.parametrize(("answer", "deleted"), [(b"y\n", True), (b"n\n", False)])
def test_ref_delete_recursive_asks_on_a_terminal(run_repo: Path, answer: bytes, deleted: bool) -> None:
    leader, follower = pty.openpty()
    try:
        os.write(leader, answer)  # typed ahead: read once the question is asked
        done = subprocess.run([str(SCRIPT), "--repo", str(run_repo), "ref", "delete", "-r", "runs/a"],
                              stdin=follower, capture_output=True, text=True, timeout=60)
    finally:
        os.close(follower)
        os.close(leader)
    assert "delete these 4 ref(s)? [y/N]" in done.stderr
    if deleted:
        assert done.returncode == 0 and _refs(run_repo) == ["runs/ab", "runs/b"]
    else:
        assert done.returncode == cli.EXIT_USAGE and "nothing deleted" in done.stderr
        assert len(_refs(run_repo)) == 6
