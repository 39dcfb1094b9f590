"""The source roots that together make the `ebb` namespace package, read from the one place
that lists them: pyproject.toml's `[tool.setuptools.packages.find] where`.

`python -m tests.source_roots` prints them joined with ':' (for PYTHONPATH, in the Makefile).
"""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).parent.parent


def source_roots() -> list[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    roots: list[str] = config["tool"]["setuptools"]["packages"]["find"]["where"]
    return roots


if __name__ == "__main__":
    print(":".join(source_roots()))
