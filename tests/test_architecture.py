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
    processes exchange pickles (frames.py), over pipes between processes it spawned, as does
    the llm stage with the child that maps a request's shape onto the vocabulary
    (structured.py)."""
    offenders = []
    for root in SOURCE_ROOTS:
        for path in (ROOT / root).rglob("*.py"):
            text = path.read_text()
            pickling = "import pickle" in text or "from pickle" in text or "ForkingPickler" in text
            if pickling and path.name not in ("frames.py", "structured.py"):
                offenders.append(str(path.relative_to(ROOT)))
    assert offenders == []


def _module_imports() -> dict[str, set[str]]:
    """Every ebb module and the ebb modules it imports, deferred imports inside functions
    included (a cycle hidden in a function body is still a cycle a reader must untangle)."""
    import ast

    graph: dict[str, set[str]] = {}
    paths = {
        path: path.relative_to(ROOT / root).with_suffix("").parts
        for root in SOURCE_ROOTS
        for path in (ROOT / root).rglob("*.py")
    }
    modules = {".".join(p[:-1] if p[-1] == "__init__" else p) for p in paths.values()}
    for path, parts in paths.items():
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        package = name if parts[-1] == "__init__" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, *([base] if base else [])])
                # `from . import x` imports the module x when there is one (the
                # package is only its way there), the package's name x otherwise.
                targets.update(
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                    for alias in node.names
                )
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


_DOTTED = re.compile(
    r"(?<![\w.])ebb\.(?:worker|shard_master|controller|common|client)(?:\.[A-Za-z_]\w*)+"
    r"(?::[A-Za-z_]\w*)?"
)
_BARE_FILE = re.compile(r"(?<![\w/.-])[a-z_]+\.py\b")
_REPO_PATH = re.compile(r"(?<![\w/.-])(?:libs|services|tests|bench|docs|k8s)/[\w/.-]+\.\w+")


def _resolves(reference: str) -> bool:
    """Whether `ebb.x.y[.Name...][:Name]` names a module, or a name in one."""
    import importlib

    dotted, _, attribute = reference.partition(":")
    parts = dotted.split(".")
    for cut in range(len(parts), 1, -1):
        try:
            target: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for name in [*parts[cut:], *([attribute] if attribute else [])]:
            if not hasattr(target, name):
                return False
            target = getattr(target, name)
        return True
    return False


def _prose(path: Path) -> str:
    """A module's docstrings and comments: where it names other modules for a reader."""
    import ast
    import io
    import tokenize

    text = path.read_text()
    # Every string statement: the docstrings of modules, classes and functions, and those of
    # attributes (a string after an assignment).
    pieces = [
        node.value.value
        for node in ast.walk(ast.parse(text))
        if isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    ]
    pieces += [
        token.string
        for token in tokenize.generate_tokens(io.StringIO(text).readline)
        if token.type == tokenize.COMMENT
    ]
    return "\n".join(pieces)


def test_prose_names_modules_by_dotted_paths_that_resolve() -> None:
    """A docstring or comment that points a reader at another module names it by its dotted
    path (`ebb.worker.pipeline.ledger`), never by a bare file name (`ledger.py`) that a move
    leaves pointing nowhere; and every such path, here and in the docs, still resolves."""
    bare: list[str] = []
    dangling: list[str] = []
    for root in SOURCE_ROOTS:
        for path in (ROOT / root).rglob("*.py"):
            prose = _prose(path)
            where = str(path.relative_to(ROOT))
            bare += [f"{where}: {m}" for m in _BARE_FILE.findall(prose)]
            dangling += [f"{where}: {m}" for m in _DOTTED.findall(prose) if not _resolves(m)]
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        text = page.read_text()
        where = str(page.relative_to(ROOT))
        dangling += [f"{where}: {m}" for m in _DOTTED.findall(text) if not _resolves(m)]
        dangling += [f"{where}: {m}" for m in _REPO_PATH.findall(text) if not (ROOT / m).exists()]
    assert bare == [], "\n".join(bare)
    assert dangling == [], "\n".join(dangling)
