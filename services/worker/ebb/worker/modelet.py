"""Modelets: the units of a pipeline. A user modelet is any class named `module:Class` with

    def __init__(self, **params)           # the stage's `params` from the job spec
    def setup(self) -> None                # optional: once per process, before any item
    def process_batch(self, items: list) -> list    # one output per input, same order
        or
    def process(self, item) -> object      # one item at a time

Subclassing `Modelet` is a convenience, not a requirement. A modelet runs in its own process;
an exception fails only the items of its batch, and bisection finds which ones.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from ebb.common.spec import StageSpec


class StageError(Exception):
    """A stage cannot be built: bad class name, import failure, constructor error."""


@runtime_checkable
class BatchModelet(Protocol):
    def process_batch(self, items: list[Any]) -> list[Any]: ...


class Modelet:
    """Optional base class. Override `process` (one item) or `process_batch` (a list)."""

    def setup(self) -> None:
        """Load models and open resources: runs once, in the stage's own process."""

    def process(self, item: Any) -> Any:
        raise TypeError(f"{type(self).__name__} overrides neither process nor process_batch")

    def process_batch(self, items: list[Any]) -> list[Any]:
        return [self.process(item) for item in items]


def resolve_class(name: str) -> type:
    module_name, _, qualname = name.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as e:
        raise StageError(f"cannot import {module_name!r}: {type(e).__name__}: {e}") from e
    for part in qualname.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise StageError(f"{module_name!r} has no attribute {qualname!r}") from None
    if not isinstance(target, type):
        raise StageError(f"{name} is not a class")
    return target


def batch_callable(obj: Any, name: str) -> Callable[[list[Any]], list[Any]]:
    """The batch function of a modelet instance, whichever of the two methods it defines."""
    if isinstance(obj, Modelet | BatchModelet):
        fn: Callable[[list[Any]], list[Any]] = obj.process_batch
        return fn
    single = getattr(obj, "process", None)
    if callable(single):
        return lambda items: [single(item) for item in items]
    raise StageError(f"{name} defines neither process_batch(items) nor process(item)")


def build_stage(spec: StageSpec, *, code_paths: list[str]) -> Any:
    """Instantiate a stage's modelet (user class or model runtime). Not yet set up."""
    for path in reversed(code_paths):
        if path not in sys.path:
            sys.path.insert(0, path)
    if spec.model is not None:
        from .runtimes import load_runtime

        return load_runtime(spec)
    assert spec.modelet is not None
    cls = resolve_class(spec.modelet)
    try:
        return cls(**spec.params)
    except Exception as e:
        raise StageError(f"{spec.modelet}(**params) failed: {type(e).__name__}: {e}") from e
