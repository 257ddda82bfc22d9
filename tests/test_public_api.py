"""The public surface: a small top level, old names that still work (with a warning), read-only
repositories that refuse every write, and errors of one hierarchy that name what they concern."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

import cas_ckpt
from cas_ckpt import errors


def test_the_top_level_is_small_and_typed() -> None:
    assert 15 <= len(cas_ckpt.__all__) <= 21
    for name in cas_ckpt.__all__:
        assert getattr(cas_ckpt, name) is not None
    for report in ("GCReport", "FsckReport", "Usage", "DiffReport", "CarReport", "SaveReport", "Commit",
                   "TransferReport", "clone"):
        assert report in cas_ckpt.__all__
    assert (Path(cas_ckpt.__file__).parent / "py.typed").exists()


@pytest.mark.parametrize("name, home", [
    ("RefConflict", errors), ("CorruptBlock", errors), ("LocalStore", cas_ckpt.blocks),
    ("MemoryStore", cas_ckpt.blocks), ("LocalRefStore", cas_ckpt.refs), ("RefStore", cas_ckpt.refs),
])
def test_names_moved_from_the_top_level_still_work_with_a_warning(name: str, home: object) -> None:
    with pytest.warns(DeprecationWarning, match=f"cas_ckpt.{name} moved"):
        value = getattr(cas_ckpt, name)
    assert value is getattr(home, name)


def test_the_old_stores_package_still_works_with_a_warning() -> None:
    import cas_ckpt.stores

    with pytest.warns(DeprecationWarning, match="cas_ckpt.blocks.LocalStore"):
        assert cas_ckpt.stores.LocalStore is cas_ckpt.blocks.LocalStore
    with pytest.raises(AttributeError):
        cas_ckpt.stores.NoSuchStore  # noqa: B018


def test_unknown_names_are_attribute_errors_without_warnings() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(AttributeError):
            cas_ckpt.not_a_thing  # noqa: B018


# -- read-only repositories ------------------------------------------------------------------------
@pytest.fixture
def read_only(tmp_path: Path) -> cas_ckpt.Repository:
    with cas_ckpt.open(tmp_path / "repo") as repo:
        repo.save({"w": np.arange(10)}, ref="main", step=1)
        repo.pin("main")
    return cas_ckpt.open(tmp_path / "repo", read_only=True)


WRITES = {
    "save": lambda r: r.save({"x": 1}),
    "set_ref": lambda r: r.set_ref("other", "main"),
    "delete_ref": lambda r: r.delete_ref("main"),
    "fork": lambda r: r.fork("main", "fork"),
    "pin": lambda r: r.pin("main"),
    "unpin": lambda r: r.unpin("main"),
    "gc": lambda r: r.gc(),
    "import_car": lambda r: r.import_car(Path(r.location).parent / "x.car", ref="main"),
    "manager.save": lambda r: cas_ckpt.CheckpointManager(r, "main").save(2, {"x": 1}),
}


@pytest.mark.parametrize("write", sorted(WRITES))
def test_a_read_only_repository_refuses_every_write(read_only: cas_ckpt.Repository, write: str) -> None:
    root = Path(read_only.location)
    read_only.export_car("main", root.parent / "x.car")  # reads are fine (the CAR goes elsewhere)
    before = sorted(str(p.relative_to(root)) for p in root.rglob("*"))
    with pytest.raises(errors.RepositoryError, match="read-only"):
        WRITES[write](read_only)
    assert sorted(str(p.relative_to(root)) for p in root.rglob("*")) == before
    assert read_only.load("main")["w"].tolist() == list(range(10))
    assert read_only.gc(dry_run=True).dry_run  # a dry run writes nothing and is allowed
    read_only.close()


# -- errors ------------------------------------------------------------------------------------------
def test_a_file_in_the_way_is_a_repository_error_naming_it(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("x")
    with pytest.raises(errors.RepositoryError, match="afile") as info:
        cas_ckpt.open(tmp_path / "afile" / "repo")
    assert isinstance(info.value, cas_ckpt.CasCkptError)


def test_an_unwritable_directory_is_a_medium_error_naming_it(tmp_path: Path) -> None:
    """As root the child runs without the capability to ignore file modes (root writes anywhere)."""
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    code = (
        "import cas_ckpt\n"
        "try:\n"
        f"    cas_ckpt.open({str(locked / 'repo')!r})\n"
        "except cas_ckpt.errors.MediumError as exc:\n"
        "    print(exc.errno, isinstance(exc, OSError), 'locked/repo' in str(exc))\n"
    )
    command = [sys.executable, "-c", code]
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("as root this needs setpriv (util-linux) to drop CAP_DAC_OVERRIDE")
        command = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", *command]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    assert done.stdout.split() == ["13", "True", "True"], done.stderr


def test_medium_errors_are_os_errors_too() -> None:
    exc = errors.MediumError("saving to /r", OSError(28, "No space left on device", "/r/tmp/x"))
    assert isinstance(exc, OSError) and isinstance(exc, cas_ckpt.CasCkptError)
    assert exc.errno == 28 and exc.filename == "/r/tmp/x"
    assert str(exc) == "saving to /r: No space left on device (/r/tmp/x)"


def test_open_expands_the_home_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    with cas_ckpt.open("~/repo") as repo:
        repo.save({"x": 1})
    assert (tmp_path / "repo" / "config.json").exists()


def test_ml_dtypes_is_imported_only_when_a_checkpoint_needs_it(tmp_path: Path) -> None:
    """``import cas_ckpt`` (and so every CLI command) does not pay for ml_dtypes' import; a process
    that never imported it still loads and lists a bfloat16 checkpoint, and saves one like it."""
    saver = (
        "import sys, ml_dtypes, numpy as np, cas_ckpt\n"
        "with cas_ckpt.open(sys.argv[1]) as repo:\n"
        "    repo.save({'w': np.arange(6, dtype=ml_dtypes.bfloat16), 'n': np.ones(3, np.float32)})\n"
    )
    loader = (
        "import sys, cas_ckpt\n"
        "assert 'ml_dtypes' not in sys.modules, 'imported with cas_ckpt'\n"
        "with cas_ckpt.open(sys.argv[1]) as repo:\n"
        "    repo.load(path='n')\n"
        "    assert 'ml_dtypes' not in sys.modules, 'imported for a float32 load'\n"
        "    state = repo.load()\n"
        "    print(state['w'].dtype, state['w'].astype('float32').tolist())\n"
        "    print(repo.save(state) == repo.resolve('main'))\n"
    )
    repo_dir = str(tmp_path / "repo")
    subprocess.run([sys.executable, "-c", saver, repo_dir], check=True)
    done = subprocess.run([sys.executable, "-c", loader, repo_dir], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["bfloat16 [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]", "True"]
