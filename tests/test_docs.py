"""The examples in the README, docs/dedup.md and the package docstring run as written."""

from __future__ import annotations

import doctest
import re
from pathlib import Path

import pytest

import cas_ckpt

ROOT = Path(__file__).parent.parent


def test_dedup_doc_examples_run() -> None:
    result = doctest.testfile(
        str(ROOT / "docs" / "dedup.md"), module_relative=False, optionflags=doctest.ELLIPSIS
    )
    assert result.attempted >= 7 and result.failed == 0


def test_architecture_doc_examples_run() -> None:
    result = doctest.testfile(
        str(ROOT / "docs" / "architecture.md"), module_relative=False, optionflags=doctest.ELLIPSIS
    )
    assert result.attempted >= 3 and result.failed == 0


def test_package_docstring_example_runs() -> None:
    result = doctest.testmod(cas_ckpt, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 3 and result.failed == 0


def test_readme_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                             capsys: pytest.CaptureFixture[str]) -> None:
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert blocks, "the README lost its Python example"
    monkeypatch.chdir(tmp_path)
    for block in blocks:
        exec(compile(block, "README.md", "exec"), {})
    printed = capsys.readouterr().out
    assert "bagaqiera" in printed and "100" in printed
    assert (tmp_path / "checkpoints" / "config.json").exists()
