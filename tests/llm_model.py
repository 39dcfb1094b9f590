"""The tiny generative model the tests and the benchmark build: examples/llm/tiny_model.py,
the example's own builder (one builder, used wherever a model is needed without a download)."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

_BUILDER = Path(__file__).resolve().parent.parent / "examples" / "llm" / "tiny_model.py"
_spec = importlib.util.spec_from_file_location("ebb_example_tiny_model", _BUILDER)
assert _spec is not None and _spec.loader is not None
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)

build_tiny_llm: Callable[..., Path] = _module.build_tiny_llm
corpus: Callable[..., list[str]] = _module.corpus
