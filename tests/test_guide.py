"""docs/guide.md runs: its examples are doctests."""

from __future__ import annotations

import doctest
import tempfile
from pathlib import Path

import pytest

GUIDE = Path(__file__).parent.parent / "docs" / "guide.md"


def test_guide_examples_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torch")
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the guide's scratch repository goes here
    monkeypatch.setattr(tempfile, "tempdir", None)
    result = doctest.testfile(
        str(GUIDE), module_relative=False, optionflags=doctest.ELLIPSIS, verbose=False
    )
    assert result.attempted > 40 and result.failed == 0
