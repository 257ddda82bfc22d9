"""The ``cas-ckpt`` command line: every command, its JSON, its exit codes, and its error messages.

Most cases call ``cas_ckpt.cli.main(argv)`` in-process (fast); a few run real subprocesses to cover
``python -m cas_ckpt``, the console script, pipes and a reader that goes away.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import assert_state_equal, flip_byte

import cas_ckpt
from cas_ckpt import cid as cidlib
from cas_ckpt import cli
from cas_ckpt.maintenance.walk import data_blocks

CHUNK = 4096


def state(step: int) -> dict[str, Any]:
    return {
        "model": {"w": np.full((50, 100), step, dtype=np.float32), "b": np.arange(3, dtype=np.float16)},
        "step": step,
        "name": "run-1",
        "blob": b"x" * 30_000,
        "pair": (1, None),
        "lr": np.float64(0.5),
    }


@pytest.fixture
def repo_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A repository made with the Python API: main at step 2 (parent step 1), ref other."""
    path = tmp_path / "repo"
    with cas_ckpt.open(path, chunk_size=CHUNK) as repo:
        repo.save(state(1), ref="main", step=1, message="first")
        repo.save(state(2), ref="main", step=2, metadata={"loss": 0.25})
        repo.save({"x": 1}, ref="other")
    monkeypatch.setenv(cli.ENV_REPO, str(path))
    monkeypatch.chdir(tmp_path)
    return path


class Run:
    """A finished in-process command."""

    def __init__(self, code: int, out: str, err: str) -> None:
        self.code, self.out, self.err = code, out, err

    def json(self) -> Any:
        return json.loads(self.out)


@pytest.fixture
def run(capsys: pytest.CaptureFixture[str]) -> Iterator[Any]:
    def call(*argv: str) -> Run:
        code = cli.main(list(argv))
        out, err = capsys.readouterr()
        assert "Traceback" not in err
        return Run(code, out, err)

    yield call


def api(path: Path) -> cas_ckpt.Repository:
    return cas_ckpt.open(path, create=False)


# --------------------------------------------------------------------------------------------
# Reading commands
# --------------------------------------------------------------------------------------------
def test_help_version_and_usage_errors(run: Any) -> None:
    assert run("--help").code == 0
    assert run("--version").code == 0
    for argv in [(), ("bogus",), ("log", "--limit", "0"), ("gc", "--grace", "-1"),
                 ("fsck", "--sample", "2"), ("export", "main")]:
        result = run(*argv)
        assert result.code == cli.EXIT_USAGE, argv
        assert "usage:" in result.err


def test_log(run: Any, repo_dir: Path) -> None:
    result = run("log", "--json")
    assert result.code == 0
    commits = result.json()
    assert [c["step"] for c in commits] == [2, 1]
    assert commits[0]["parents"] == [commits[1]["cid"]] and commits[0]["metadata"] == {"loss": 0.25}
    with api(repo_dir) as repo:
        assert commits[0]["cid"] == str(repo.resolve("main"))
    text = run("log").out.splitlines()
    assert len(text) == 2 and text[0].startswith(commits[0]["cid"]) and text[1].endswith("first")
    assert [c["step"] for c in run("log", "main", "-n", "1", "--json").json()] == [2]
    assert run("log", commits[1]["cid"], "--json").json()[0]["step"] == 1
    tree = run("show", "main", "--json").json()["tree"]["/"]
    assert run("log", tree).code == cli.EXIT_USAGE  # a tree is not a commit


def test_show(run: Any, repo_dir: Path) -> None:
    commit = run("show", "main").json()
    assert commit["type"] == "cas_ckpt.commit" and commit["step"] == 2
    assert commit["parents"][0]["history"] is True
    result = run("show", commit["tree"]["/"], "--json")
    assert result.code == 0 and result.out.count("\n") == 1  # --json: one line
    tree = result.json()
    w = tree["model"]["w"]["ndarray"]
    assert w == {"dtype": "float32", "shape": [50, 100], "nbytes": 20_000, "kind": "numpy",
                 "chunk_size": CHUNK, "chunks": 5}
    assert tree["model"]["b"]["ndarray"]["inline"] is True
    assert tree["blob"]["blob"]["size"] == 30_000 and tree["pair"] == {"tuple": [1, None]}
    assert tree["lr"] == {"scalar": {"dtype": "float64", "value": 0.5}}
    with api(repo_dir) as repo:
        chunk = next(c for c in data_blocks(repo.blocks, bytes(repo.resolve("main")))
                     if not cidlib.is_node(c))
    raw = run("show", cidlib.to_str(chunk)).json()
    assert raw["raw"]["size"] > 0


def test_ls(run: Any, repo_dir: Path) -> None:
    rows = {r["path"]: r for r in run("ls", "--json").json()}
    assert set(rows) == {"model.w", "model.b", "step", "name", "blob", "pair.0", "pair.1", "lr"}
    assert rows["model.w"] | {"chunks": 5} == rows["model.w"]
    assert (rows["model.w"]["dtype"], rows["model.w"]["shape"], rows["model.w"]["nbytes"]) == (
        "float32", [50, 100], 20_000)
    assert rows["blob"]["type"] == "bytes" and rows["blob"]["nbytes"] == 30_000
    assert rows["step"] == {"path": "step", "type": "int", "value": 2}
    assert rows["lr"]["type"] == "scalar" and rows["lr"]["value"] == 0.5
    only = run("ls", "main", "model")
    assert only.code == 0
    assert [line.split("\t")[0] for line in only.out.splitlines()] == ["model.w", "model.b"]
    assert "float32 50x100 19.5 KiB" in only.out
    assert run("ls", "other", "--json").json() == [{"path": "x", "type": "int", "value": 1}]


def test_cat(capsysbinary: pytest.CaptureFixture[bytes], repo_dir: Path) -> None:
    with api(repo_dir) as repo:
        root = bytes(repo.resolve("main"))
        chunk = next(c for c in data_blocks(repo.blocks, root) if not cidlib.is_node(c))
        expected = {root: repo.blocks.get(root), chunk: repo.blocks.get(chunk)}
    for cid, data in expected.items():
        assert cli.main(["cat", cidlib.to_str(cid)]) == 0
        assert capsysbinary.readouterr().out == data
    assert cli.main(["cat", "main"]) == 0
    assert capsysbinary.readouterr().out == expected[root]


def test_refs_and_pins(run: Any, repo_dir: Path) -> None:
    with api(repo_dir) as repo:
        main, other = str(repo.resolve("main")), str(repo.resolve("other"))
    assert run("refs", "--json").json() == {"main": main, "other": other}
    assert run("refs", "ot").out == f"{other}  other\n"
    assert run("pin", "--json").json() == []
    assert run("pin", "main").out == f"pinned {main}\n"
    assert run("pin").out == f"{main}\n"
    with api(repo_dir) as repo:
        assert [str(c) for c in repo.pins()] == [main]
    assert run("unpin", "main").code == 0
    again = run("unpin", "main")
    assert again.code == cli.EXIT_NOT_FOUND and "was not pinned" in again.err


def test_du(run: Any, repo_dir: Path) -> None:
    usage = run("du", "--json").json()
    with api(repo_dir) as repo:
        stats = repo.stats()
    assert usage["logical_bytes"] == stats.logical_bytes and usage["stored_bytes"] == stats.stored_bytes
    assert usage["total_blocks"] == stats.total_blocks
    assert {r["ref"]: r["blocks"] for r in usage["refs"]} == {r.ref: r.blocks for r in stats.refs}
    assert usage["gc_would_free_bytes"] == 0  # main's reflog keeps step 1
    text = run("du", "--by-ref").out
    assert text.startswith("REF") and "\nmain " in text and "dedup" in text
    lines = run("du").out.splitlines()
    assert lines[0].split() == ["RUN", "REFS", "CHECKPOINTS", "LOGICAL", "STORED", "SHARED", "EXCLUSIVE"]
    assert [line.split()[0] for line in lines[1:]] == ["main", "other", "total:", "storage:"]
    with api(repo_dir) as repo:
        repo.delete_ref("other")
        assert repo.gc(dry_run=True).unreachable_bytes == 0  # its reflog keeps it for 30 days
        freeable = repo.gc(dry_run=True, reflog_expiry=0).unreachable_bytes
    assert run("du", "--json").json()["gc_would_free_bytes"] == 0
    expired = run("du", "--json", "--reflog-expiry", "0").json()
    assert freeable > 0 and expired["gc_would_free_bytes"] == freeable


def test_diff(run: Any, repo_dir: Path) -> None:
    with api(repo_dir) as repo:
        first = str(repo.commit("main").parents[0])
    same = run("diff", "main", "main", "--json")
    assert same.code == 0 and same.json()["identical"] is True
    changed = run("diff", first, "main", "--json")
    assert changed.code == cli.EXIT_CHECK
    report = changed.json()
    assert sorted(c["path"] for c in report["changed"]) == ["model.w", "step"]
    text = run("diff", first, "main")
    assert text.code == 1 and "~ model.w: array values changed (max |diff| 1" in text.out
    assert "- model.b" in run("diff", "main", "other").out


# --------------------------------------------------------------------------------------------
# Maintenance
# --------------------------------------------------------------------------------------------
def test_gc_dry_run_lists_and_frees_nothing(run: Any, repo_dir: Path) -> None:
    with api(repo_dir) as repo:
        repo.delete_ref("other")
        before = len(repo.blocks)
    dry = run("gc", "--dry-run", "--reflog-expiry", "0", "--json")
    assert dry.code == 0
    report = dry.json()
    assert report["dry_run"] is True and report["blocks_freed"] == 0
    assert len(report["unreachable"]) == report["unreachable_blocks"] >= 2
    assert "would remove" in run("gc", "--dry-run", "--reflog-expiry", "0").out
    with api(repo_dir) as repo:
        assert len(repo.blocks) == before
    kept = run("gc", "--json").json()  # by default reflogs keep main's step 1 and deleted "other"
    assert kept["blocks_freed"] == 0 and kept["reflogs_dropped"] == 0
    done = run("gc", "--reflog-expiry", "0")
    assert done.code == 0 and "removed" in done.out
    with api(repo_dir) as repo:
        assert len(repo.blocks) < before and repo.fsck().ok
        assert_state_equal(state(2), repo.load("main"))


def test_fsck_finds_a_flipped_byte(run: Any, repo_dir: Path) -> None:
    ok = run("fsck", "--json")
    assert ok.code == 0 and ok.json()["ok"] is True
    assert run("fsck", "--sample", "0.5").code == 0
    with api(repo_dir) as repo:
        chunk = next(c for c in data_blocks(repo.blocks, bytes(repo.resolve("main")))
                     if not cidlib.is_node(c))
        pack, offset, _ = repo.blocks.locate(chunk)
    flip_byte(pack, offset)
    bad = run("fsck", "--json")
    assert bad.code == cli.EXIT_CHECK
    report = bad.json()
    assert report["ok"] is False
    assert [(p["kind"], p["cid"]) for p in report["problems"]] == [("corrupt", cidlib.to_str(chunk))]
    assert report["problems"][0]["needed_by"][0]["root"] == "main"
    text = run("fsck")
    assert text.code == 1 and f"corrupt {cidlib.to_str(chunk)}" in text.out and "1 problem" in text.out
    broken = run("ls", "main", "model.w")  # listing reads no chunk; loading through export does
    assert broken.code == 0
    export = run("export", "main", "-o", "x.car")
    assert export.code == cli.EXIT_REPO and "corrupt block" in export.err
    assert not Path("x.car").exists()


def test_export_import_round_trip(run: Any, repo_dir: Path, tmp_path: Path) -> None:
    exported = run("export", "main", "-o", "ckpt.car", "--json")
    assert exported.code == 0
    report = exported.json()
    assert report["car_bytes"] == Path("ckpt.car").stat().st_size
    dest = tmp_path / "dest"
    assert run("init", str(dest), "--hash", "blake3").code == 0
    imported = run("import", "ckpt.car", "--ref", "restored", "--repo", str(dest))  # after: also fine
    assert imported.code == 0 and "as restored" in imported.out
    assert f"{report['blocks']} blocks ({report['blocks']} new" in imported.out
    with api(dest) as repo:
        assert repo.config.hash == "blake3"  # a CAR keeps its own CIDs: sha2-256 blocks imported
        assert str(repo.resolve("restored")) == report["roots"][0]
        assert_state_equal(state(2), repo.load("restored"))
    again = run("--repo", str(dest), "import", "ckpt.car", "--json")
    assert again.json()["blocks_new"] == 0 and "no ref points" in again.err
    Path("cut.car").write_bytes(Path("ckpt.car").read_bytes()[:-10])
    cut = run("--repo", str(dest), "import", "cut.car", "--ref", "cut")
    assert cut.code == cli.EXIT_ERROR and "truncated" in cut.err
    assert "cut" not in run("--repo", str(dest), "refs", "--json").json()


def test_init(run: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(cli.ENV_REPO, raising=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    assert run("init", "--chunk-size", "65536").code == 0
    assert run("refs").code == 0  # the current directory is now a repository
    assert "existing repository" in run("init").out
    with api(tmp_path / "here") as repo:
        assert repo.config.chunk_size == 65536
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "file").write_text("x")
    busy = run("init", str(tmp_path / "busy"))
    assert busy.code == cli.EXIT_REPO and "not an empty directory" in busy.err
    assert run("init", str(tmp_path / "tiny"), "--chunk-size", "10").code == cli.EXIT_USAGE


# --------------------------------------------------------------------------------------------
# Errors: one line, the documented code, nothing created
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("argv", "code", "message"),
    [
        (("log", "nope"), cli.EXIT_NOT_FOUND, "ref 'nope' not found"),
        (("log", "mian"), cli.EXIT_NOT_FOUND, "ref 'mian' not found; did you mean 'main'? (refs here: main"),
        (("reflog", "mian"), cli.EXIT_NOT_FOUND, "ref 'mian' not found; did you mean 'main'?"),
        (("show", "b" + "a" * 58), cli.EXIT_USAGE, "neither a ref nor a valid CID"),
        (("cat", "QmYwAPJzv5CZsnA625s3Xf2nemtYgPpHdWEz79ojWnPbdG"), cli.EXIT_USAGE, "CIDv0"),
        (("cat", "bafkreihdwdcefgh4dqkjv67uzcmw7ojee6xedzdetojuzjevtenxquvyku"), cli.EXIT_NOT_FOUND,
         "block bafkreihdwdcefgh4dqkjv67uzcmw7ojee6xedzdetojuzjevtenxquvyku not found"),
        (("ls", "main", "model.nothing"), cli.EXIT_NOT_FOUND, "path 'model.nothing' not found"),
        (("diff", "main", "main~9"), cli.EXIT_NOT_FOUND, "'main~9' not found"),
        (("show", "bafyxx..."), cli.EXIT_USAGE, "neither a ref nor a valid CID: invalid base32"),
        (("show", "bagaqier"), cli.EXIT_USAGE, "is ambiguous"),
        (("import", "missing.car"), cli.EXIT_ERROR, "No such file or directory: missing.car"),
        (("import", "x.car", "--ref", "bad ref"), cli.EXIT_USAGE, "invalid ref name"),
        (("pin", "nope"), cli.EXIT_NOT_FOUND, "not found"),
    ],
)
def test_errors_are_one_line(
    run: Any, repo_dir: Path, argv: tuple[str, ...], code: int, message: str
) -> None:
    Path("x.car").write_bytes(b"")
    result = run(*argv)
    assert result.code == code
    assert result.err.startswith("cas-ckpt: error: ") and message in result.err
    assert result.err.count("\n") == 1 and result.out == ""


@pytest.mark.parametrize("command", [["log"], ["refs"], ["du"], ["fsck"], ["ls"], ["pin", "main"],
                                     ["gc"], ["import", "x.car"], ["export", "main", "-o", "y.car"]])
def test_no_repository_and_nothing_created(
    run: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: list[str]
) -> None:
    monkeypatch.delenv(cli.ENV_REPO, raising=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.car").write_bytes(b"")
    result = run(*command)
    assert result.code == cli.EXIT_REPO and "no repository given" in result.err
    missing = tmp_path / "missing"
    result = run("--repo", str(missing), *command)
    assert result.code == cli.EXIT_REPO and f"no cas_ckpt repository at {missing}" in result.err
    assert not missing.exists()
    assert sorted(os.listdir(tmp_path)) == ["x.car"]


def test_exit_codes_by_error_type() -> None:
    cases = {
        cas_ckpt.errors.InvalidCID("x"): cli.EXIT_USAGE,
        cas_ckpt.errors.InvalidRefName("x", "y"): cli.EXIT_USAGE,
        cas_ckpt.errors.RefNotFound("x"): cli.EXIT_NOT_FOUND,
        cas_ckpt.errors.BlockNotFound("x"): cli.EXIT_NOT_FOUND,
        cas_ckpt.errors.PathNotFound("x", "y"): cli.EXIT_NOT_FOUND,
        cas_ckpt.errors.CheckpointExpired("x", "y"): cli.EXIT_NOT_FOUND,
        cas_ckpt.errors.RepositoryError("x"): cli.EXIT_REPO,
        cas_ckpt.errors.CorruptStore("x", "y"): cli.EXIT_REPO,
        cas_ckpt.errors.CorruptBlock("x"): cli.EXIT_REPO,
        cas_ckpt.errors.CarError("x"): cli.EXIT_ERROR,
        cas_ckpt.errors.RefConflict("x", None, None): cli.EXIT_ERROR,
    }
    for error, code in cases.items():
        assert cli.exit_code(error) == code, error


def test_progress_only_on_a_terminal() -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    tty, pipe = Terminal(), io.StringIO()
    for stream in (tty, pipe):
        with cli.Progress("fsck", stream, interval=0) as bar:
            bar.update("1/4 blocks")
            bar.update("2/4")
    assert pipe.getvalue() == ""
    assert tty.getvalue().startswith("\rfsck: 1/4 blocks\rfsck: 2/4       ")
    assert tty.getvalue().endswith("\r")  # the line is wiped when done


def test_docs_cover_every_command_and_option() -> None:
    docs = (Path(__file__).parent.parent / "docs" / "cli.md").read_text()
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, command in sub.choices.items():
        assert f"`{name} " in docs.split("## Commands")[1], name
        for action in command._actions:
            for option in action.option_strings:
                if option not in ("-h", "--help"):
                    assert f"{option}" in docs, (name, option)
    for code in range(6):
        assert f"| {code} |" in docs


def test_human_sizes() -> None:
    assert [cli.human(n) for n in (0, 1023, 1536, 3 * 2**20, 5 * 2**40)] == [
        "0 B", "1023 B", "1.5 KiB", "3.0 MiB", "5.0 TiB"]


# --------------------------------------------------------------------------------------------
# Real processes
# --------------------------------------------------------------------------------------------
def spawn(*argv: str, **kwargs: Any) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([sys.executable, "-m", "cas_ckpt", *argv], capture_output=True,
                          timeout=60, **kwargs)


def test_subprocess_module_entry_json_and_errors(repo_dir: Path) -> None:
    listing = spawn("--repo", str(repo_dir), "ls", "--json")
    assert listing.returncode == 0 and len(json.loads(listing.stdout)) == 8
    failure = spawn("--repo", str(repo_dir / "nope"), "log")
    assert failure.returncode == cli.EXIT_REPO
    assert failure.stderr.decode() == f"cas-ckpt: error: no cas_ckpt repository at {repo_dir / 'nope'}\n"
    script = Path(sys.executable).parent / "cas-ckpt"
    if script.exists():  # the console script of an installed checkout
        result = subprocess.run([str(script), "refs", "--json"], capture_output=True, timeout=60)
        assert result.returncode == 0 and set(json.loads(result.stdout)) == {"main", "other"}


def test_subprocess_export_pipe_import(repo_dir: Path, tmp_path: Path) -> None:
    dest = tmp_path / "piped"
    assert spawn("init", str(dest)).returncode == 0
    exported = spawn("--repo", str(repo_dir), "export", "main", "-o", "-")
    assert exported.returncode == 0 and exported.stderr == b""
    imported = spawn("--repo", str(dest), "import", "-", "--ref", "main", input=exported.stdout)
    assert imported.returncode == 0, imported.stderr
    with api(dest) as repo:
        assert_state_equal(state(2), repo.load("main"))


def test_subprocess_reader_that_goes_away(repo_dir: Path) -> None:
    with api(repo_dir) as repo:
        big = np.random.default_rng(0).standard_normal(2**18)  # 2 MiB: more than a pipe holds
        repo.save({"big": big}, ref="big")
    proc = subprocess.Popen(
        [sys.executable, "-m", "cas_ckpt", "--repo", str(repo_dir), "export", "big", "-o", "-"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    assert len(proc.stdout.read(100)) == 100
    proc.stdout.close()
    err = proc.stderr.read()
    proc.stderr.close()
    assert proc.wait(timeout=60) == cli.EXIT_ERROR
    assert err == b""  # no traceback, no "Exception ignored" at exit
