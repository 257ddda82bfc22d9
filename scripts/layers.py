#!/usr/bin/env python3
"""Check cas_ckpt's layering: print import cycles, upward imports and modules in no layer.

    python scripts/layers.py [PACKAGE_DIR]      (default: the cas_ckpt next to this script)

``LAYERS`` is the stack of docs/architecture.md, lowest first: a module may import from its own
layer and the layers below it, never from one above. Imports are read as written (module level,
``TYPE_CHECKING`` blocks and function bodies); nothing is run. A cycle is counted over the
imports made at module level; an upward import over all of them, lazy ones included (a lazy
import is still a dependency). The package's ``__init__``, the public facade, is in the top layer.
Exit status 1 when something is printed, 0 when the layers are clean (tests/test_layers.py runs
this on every test run).
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterator
from pathlib import Path

# Lowest first; each entry names modules or sub-packages of the package (docs/architecture.md).
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("foundation", ("errors", "cid", "codec", "carv1", "_fs", "_memory")),
    ("media", ("backends",)),
    ("blocks", ("blocks", "stores")),
    ("refs", ("refs",)),
    ("state", ("tree", "_small", "paths", "grid")),
    ("repository", ("commit", "commit_graph", "history", "maintenance", "car", "hf", "replication",
                    "repository")),
    ("training", ("records", "two_tier", "manager", "integrations", "dcp")),
    ("tools", ("testing", "http", "web", "cli", "demo", "__main__")),
)


def modules(package: Path) -> dict[str, Path]:
    """Every module of ``package`` by dotted name (a package by its own name)."""
    found = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> tuple[set[str], set[str]]:
    """The package's modules ``name`` imports: (at module level, anywhere)."""
    top: set[str] = set()
    every: set[str] = set()
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]

    def visit(node: ast.AST, lazy: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                for target in _targets(child, package, known):
                    if target != name:
                        every.add(target)
                        if not lazy:
                            top.add(target)
            visit(child, lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

    visit(ast.parse(path.read_text(), str(path)), False)
    return top, every


def _targets(node: ast.Import | ast.ImportFrom, package: list[str], known: dict[str, Path]) -> Iterator[str]:
    """The package's modules an import statement loads: ``from pkg import mod`` is ``pkg.mod``;
    ``from pkg import name`` is ``pkg``, whose ``__init__`` defines the name."""
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names if alias.name in known)
        return
    if node.level:
        base = package[: len(package) - (node.level - 1)]
        prefix = ".".join(base + ([node.module] if node.module else []))
    else:
        prefix = node.module or ""
    for alias in node.names:
        module = f"{prefix}.{alias.name}"
        if module in known:
            yield module
        elif prefix in known and not _compiled(known[prefix], alias.name):
            yield prefix


def _compiled(package_init: Path, name: str) -> bool:
    """True if ``name`` is a compiled module of that package (built from ``name.c``): it imports
    nothing of the package."""
    return package_init.name == "__init__.py" and (package_init.parent / f"{name}.c").exists()


def layer_of(module: str, package: str) -> int | None:
    """The index in LAYERS of ``module`` (the package's facade: the top one); None if unplaced."""
    if module == package:
        return len(LAYERS) - 1
    for index, (_, members) in enumerate(LAYERS):
        for member in members:
            full = f"{package}.{member}"
            if module == full or module.startswith(full + "."):
                return index
    return None


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Import cycles among module-level imports (a package importing its own modules excepted)."""
    found: list[list[str]] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for target in sorted(graph[node]):
            if target.startswith(node + "."):
                continue
            if state.get(target) == 1:
                found.append([*stack[stack.index(target) :], target])
            elif target not in state:
                visit(target)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return found


def check(package_dir: Path) -> list[str]:
    """The problems found in the package at ``package_dir``, one line each."""
    package = package_dir.name
    known = modules(package_dir)
    top: dict[str, set[str]] = {}
    problems = []
    for name, path in known.items():
        top[name], every = imports(name, path, known)
        level = layer_of(name, package)
        if level is None:
            problems.append(f"unplaced: {name} is in no layer (add it to LAYERS in scripts/layers.py "
                            "and to docs/architecture.md)")
            continue
        for target in sorted(every):
            above = layer_of(target, package)
            if above is not None and above > level and not target.startswith(name + "."):
                problems.append(f"upward: {name} ({LAYERS[level][0]}) imports {target} ({LAYERS[above][0]})")
    problems[:0] = ["cycle: " + " -> ".join(cycle) for cycle in cycles(top)]
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default = Path(__file__).resolve().parent.parent / "cas_ckpt"
    parser.add_argument("package", nargs="?", type=Path, default=default)
    args = parser.parse_args(argv)
    problems = check(args.package.resolve())
    for line in problems:
        print(line)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
