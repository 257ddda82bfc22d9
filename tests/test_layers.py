"""The layering of docs/architecture.md, enforced: scripts/layers.py finds nothing in cas_ckpt."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "scripts" / "layers.py"


def layers(package: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(TOOL), str(package)], capture_output=True, text=True,
                          check=False)


def test_cas_ckpt_has_no_cycle_no_upward_import_and_every_module_placed() -> None:
    done = layers(ROOT / "cas_ckpt")
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")


def test_the_tool_reports_cycles_upward_imports_and_unplaced_modules(tmp_path: Path) -> None:
    package = tmp_path / "cas_ckpt"
    (package / "maintenance").mkdir(parents=True)
    files = {
        "__init__.py": "from cas_ckpt.repository import open\n",
        "errors.py": "",
        "_headers.c": "",  # a compiled module: importing it imports nothing of the package
        "codec.py": "from cas_ckpt import _headers, errors\n",
        "tree.py": "from cas_ckpt import _small\n",
        "_small.py": "from cas_ckpt.tree import TreeReader\n",
        "cid.py": "def lazy():\n    from cas_ckpt.maintenance import gc\n",
        "maintenance/__init__.py": "",
        "maintenance/gc.py": "import cas_ckpt.errors\n",
        "repository.py": "import cas_ckpt.maintenance.gc\n",
        "extra.py": "",
        "refs.py": "from cas_ckpt import open\n",
        "cli.py": "import cas_ckpt\n",
    }
    for name, text in files.items():
        (package / name).write_text(text)
    done = layers(package)
    assert done.returncode == 1
    assert done.stdout.splitlines() == [
        "cycle: cas_ckpt._small -> cas_ckpt.tree -> cas_ckpt._small",
        "upward: cas_ckpt.cid (foundation) imports cas_ckpt.maintenance.gc (repository)",
        "unplaced: cas_ckpt.extra is in no layer (add it to LAYERS in scripts/layers.py and to "
        "docs/architecture.md)",
        "upward: cas_ckpt.refs (refs) imports cas_ckpt (tools)",
    ]
