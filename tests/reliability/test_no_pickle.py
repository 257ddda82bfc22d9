"""No pickle, ever: loading a checkpoint never runs code chosen by whoever wrote the file.

Dynamic proof: a child process poisons every unpickling entry point before anything is imported
(``pickle``/``_pickle`` ``load``/``loads``/``Unpickler``, ``copyreg._reconstructor``, ``numpy.load``,
``torch.load``), then runs a full cycle: save (numpy, torch, ml_dtypes, bytes, str, tuples, big
ints, CIDs), load (copy and mmap, sub-trees), history, diff, stats, GC, fsck, CAR export and import
into a second repository. Every poisoned call is recorded, even if something caught the error.

Static proof: no module of cas_ckpt imports pickle, cPickle, _pickle, cloudpickle, dill, joblib,
shelve or marshal, or calls ``torch.load``, ``numpy.load`` or anything with ``allow_pickle=True``;
the one reviewed exception (``dcp.py``, the save path, ``weights_only=True`` on bytes made in memory
a moment before) is pinned down by name.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import cas_ckpt

from ._support import child_env, record

CHILD = r"""
import sys
CALLS = []

def poison(name):
    def call(*args, **kwargs):
        CALLS.append(name)
        raise AssertionError(f"{name} was called: cas_ckpt must never unpickle")
    return call

class PoisonUnpickler:
    def __init__(self, *args, **kwargs):
        CALLS.append("Unpickler")
        raise AssertionError("Unpickler was created")

import pickle, _pickle, copyreg
for module in (pickle, _pickle):
    module.load = poison(module.__name__ + ".load")
    module.loads = poison(module.__name__ + ".loads")
    module.Unpickler = PoisonUnpickler
pickle._load, pickle._loads = poison("pickle._load"), poison("pickle._loads")
pickle._Unpickler = PoisonUnpickler
copyreg._reconstructor = poison("copyreg._reconstructor")

import numpy as np
np.load = poison("numpy.load")
try:
    import torch
    torch.load = poison("torch.load")
except ImportError:
    torch = None
import ml_dtypes
import io, tempfile, pathlib
import cas_ckpt

tmp = pathlib.Path(tempfile.mkdtemp())
state = {
    "w": np.arange(300_000, dtype=np.float32).reshape(600, 500),
    "f": np.asfortranarray(np.ones((300, 40))),
    "bf16": np.arange(10_000).astype(ml_dtypes.bfloat16),
    "scalar": np.float16(1.5),
    "blob": bytes(range(256)) * 300,
    "text": "x" * 40_000,
    "nested": {"t": (1, 2.5, None, True), "big": 2**100, "neg": -(2**70), "l": list(range(50))},
}
if torch is not None:
    state["torch"] = {"p": torch.arange(70_000, dtype=torch.bfloat16), "i": torch.tensor([1, 2, 3])}

with cas_ckpt.open(tmp / "a") as repo:
    first = repo.save(state, ref="main", step=1, metadata={"loss": 0.5})
    state["cid"] = first
    repo.save(state, ref="main", step=2)
    loaded = repo.load("main")
    mapped = repo.load("main", mmap=True)
    assert np.array_equal(loaded["w"], state["w"]) and np.array_equal(mapped["w"], state["w"])
    assert loaded["nested"] == state["nested"] and loaded["text"] == state["text"]
    repo.load("main", path="nested.t")
    list(repo.log("main"))
    repo.diff(first, "main")
    repo.stats()
    repo.gc()
    assert repo.fsck().ok
    out = io.BytesIO()
    repo.export_car("main", out)
with cas_ckpt.open(tmp / "b") as other:
    other.import_car(io.BytesIO(out.getvalue()), ref="main")
    again = other.load("main")
    assert np.array_equal(again["w"], state["w"])
print("calls", CALLS)
sys.exit(1 if CALLS else 0)
"""


def test_full_cycle_with_pickle_poisoned() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, env=child_env(), timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "calls []" in proc.stdout
    record("no_pickle", poisoned_cycles=1)


FORBIDDEN_MODULES = {"pickle", "cPickle", "_pickle", "cloudpickle", "dill", "joblib", "shelve", "marshal"}
# The reviewed exceptions, each torch.load(weights_only=True), never reading from a repository:
# - on the save path, torch DCP hands non-tensor values over as bytes its planner pickled in memory
#   a moment before; without the planner's object they are read back;
# - the HF Trainer writes its optimizer, scheduler and RNG state as .pt files; the callback reads
#   them once, as the issue allows, to store them as msgpack.
# Nothing read from storage is ever unpickled.
ALLOWED = {("dcp.py", "_item_value", "torch.load"), ("transformers.py", "load_torch_state", "torch.load")}


def _functions(tree: ast.AST) -> dict[ast.AST, str]:
    owner: dict[ast.AST, str] = {}
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                owner.setdefault(node, fn.name)
    return owner


def _allowed(path: Path, owner: dict[ast.AST, str], node: ast.Call, func: str) -> bool:
    if (path.name, owner.get(node, ""), func) not in ALLOWED:
        return False
    flags = {k.arg: k.value for k in node.keywords}
    value = flags.get("weights_only")
    return isinstance(value, ast.Constant) and value.value is True


def _problems(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    owner = _functions(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [f"imports {a.name}" for a in node.names if a.name.split(".")[0] in FORBIDDEN_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in FORBIDDEN_MODULES:
            found.append(f"imports from {node.module}")
        elif isinstance(node, ast.Call):
            func = ast.unparse(node.func)
            if _allowed(path, owner, node, func):
                continue
            if func.endswith(("torch.load", "np.load", "numpy.load")) or func in ("load", "loads"):
                found.append(f"calls {func}")
            for keyword in node.keywords:
                if keyword.arg in ("allow_pickle", "weights_only") or (keyword.arg == "pickle_module"):
                    found.append(f"passes {keyword.arg}= to {func}")
        elif isinstance(node, ast.Name) and node.id in FORBIDDEN_MODULES:
            found.append(f"uses the name {node.id}")
    return [f"{path.name}:{p}" for p in found]


def test_no_module_can_unpickle() -> None:
    package = Path(cas_ckpt.__file__).parent
    modules = sorted(package.rglob("*.py"))
    assert len(modules) > 10
    problems = [p for module in modules for p in _problems(module)]
    assert not problems, problems
    record("no_pickle", modules_scanned=len(modules))


def test_the_static_check_bites(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import pickle\nfrom dill import loads\nimport numpy as np\n"
        "np.load('x', allow_pickle=True)\ntorch.load('y')\n"
        "def _item_value(x):\n    return torch.load(x, weights_only=False)\n"
    )
    assert len(_problems(bad)) >= 5
