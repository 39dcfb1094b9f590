"""MkDocs hook: the job spec reference (`<!-- spec-reference -->` on a page) rendered by
`ebb.common.job.reference`, loaded by its path: the docs build needs none of Ebb's
dependencies. `ebb spec` prints the same reference."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

REFERENCE = (
    Path(__file__).resolve().parent.parent
    / "libs"
    / "common"
    / "ebb"
    / "common"
    / "job"
    / "reference.py"
)


def _load() -> Any:
    location = importlib.util.spec_from_file_location("ebb_docs_spec_reference", REFERENCE)
    assert location is not None and location.loader is not None
    module = importlib.util.module_from_spec(location)
    sys.modules[location.name] = module  # its dataclasses look their module up there
    location.loader.exec_module(module)
    return module


on_page_markdown = _load().on_page_markdown
