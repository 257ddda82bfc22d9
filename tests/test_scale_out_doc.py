"""The torch.distributed.checkpoint section of docs/scale-out.md runs: its examples are doctests."""

from __future__ import annotations

import doctest
import tempfile
import warnings
from pathlib import Path

import pytest

DOC = Path(__file__).parent.parent / "docs" / "scale-out.md"
SECTION = "## Many ranks: torch.distributed.checkpoint"


def section(text: str, heading: str) -> str:
    """The text from ``heading`` to the next heading of the same level."""
    start = text.index(heading)
    end = text.find("\n## ", start + len(heading))
    return text[start : end if end >= 0 else len(text)]


def test_dcp_section_examples_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torch")
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the example's repository goes here
    monkeypatch.setattr(tempfile, "tempdir", None)
    text = section(DOC.read_text(), SECTION)
    test = doctest.DocTestParser().get_doctest(text, {}, "scale-out.md (DCP)", str(DOC), 0)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    with warnings.catch_warnings():  # DCP warns that it runs without a process group
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        result = runner.run(test)
    assert result.attempted >= 10 and result.failed == 0
