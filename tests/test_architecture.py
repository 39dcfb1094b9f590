"""The layout rule of DESIGN.md section 1, checked: services never import each other."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

from tests.source_roots import ROOT, source_roots

SOURCE_ROOTS = source_roots()


def test_import_contracts_hold() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(ROOT / r) for r in SOURCE_ROOTS)}
    lint_imports = Path(sys.executable).parent / "lint-imports"
    result = subprocess.run(
        [str(lint_imports), "--config", str(ROOT / "pyproject.toml")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    assert f"{len(contracts['contracts'])} kept, 0 broken" in result.stdout


def test_no_pickle_on_the_wire() -> None:
    """DESIGN section 9: nothing that crosses NATS is pickled. Only the worker's own stage
    processes exchange pickles (frames.py), over pipes between processes it spawned."""
    offenders = []
    for root in SOURCE_ROOTS:
        for path in (ROOT / root).rglob("*.py"):
            text = path.read_text()
            pickling = "import pickle" in text or "from pickle" in text or "ForkingPickler" in text
            if pickling and path.name != "frames.py":
                offenders.append(str(path.relative_to(ROOT)))
    assert offenders == []


def _module_imports() -> dict[str, set[str]]:
    """Every ebb module and the ebb modules it imports, deferred imports inside functions
    included (a cycle hidden in a function body is still a cycle a reader must untangle)."""
    import ast

    graph: dict[str, set[str]] = {}
    for root in SOURCE_ROOTS:
        for path in (ROOT / root).rglob("*.py"):
            parts = path.relative_to(ROOT / root).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            package = name if parts[-1] == "__init__" else name.rpartition(".")[0]
            targets: set[str] = set()
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom):
                    base = node.module or ""
                    if node.level:
                        anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                        base = ".".join([*anchor, *([base] if base else [])])
                    targets.add(base)
                    targets.update(f"{base}.{alias.name}" for alias in node.names)
                elif isinstance(node, ast.Import):
                    targets.update(alias.name for alias in node.names)
            graph[name] = {t for t in targets if t.startswith("ebb.")}
    return {
        name: {t for t in targets if t in graph and t != name} for name, targets in graph.items()
    }


def test_no_module_imports_itself_round_a_circle() -> None:
    graph = _module_imports()
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for target in sorted(graph[name]):
            if state.get(target) == 1:
                cycles.append([*path[path.index(target) :], target])
            elif target not in state:
                visit(target, [*path, target])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert cycles == []


def test_environment_variables_are_named_in_one_place() -> None:
    """Every EBB_* name is spelled in ebb.common.envvars, and used from there."""
    spelled = re.compile(r"""["']EBB_[A-Z_]+["']""")
    offenders = []
    for root in SOURCE_ROOTS:
        for path in (ROOT / root).rglob("*.py"):
            if path.name != "envvars.py" and spelled.search(path.read_text()):
                offenders.append(str(path.relative_to(ROOT)))
    assert offenders == []


def test_mypy_searches_the_source_roots_pyproject_lists() -> None:
    """mypy cannot read the roots from setuptools' table: its own copy must stay equal."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert config["tool"]["mypy"]["mypy_path"].split(":") == SOURCE_ROOTS
