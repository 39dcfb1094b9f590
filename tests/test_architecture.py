"""The layout rule of DESIGN.md section 1, checked: services never import each other."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent
SOURCE_ROOTS = [
    "libs/common",
    "libs/client",
    "services/shard_master",
    "services/controller",
    "services/worker",
]


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
    assert "2 kept, 0 broken" in result.stdout


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
