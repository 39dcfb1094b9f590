"""Modelets: the units of a pipeline. A user modelet is any class named `module:Class` with

    def __init__(self, **params)           # the stage's `params` from the job spec
    def setup(self) -> None                # optional: once per process, before any item
    def process_columns(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]
        or
    def process_batch(self, items: list) -> list    # one output per input, same order
        or
    def process(self, item) -> object      # one item at a time

`process_columns` is the fast path: the batch is a map of column -> array with one entry per
row (tensor columns as one contiguous array, see ebb.worker.chunks.columns), and it returns the
same, every column as long as the batch. The per-row forms are adapters over it: each batch is
turned into a Python object per row and back, which costs far more than a small model.

Subclassing `Modelet` is a convenience, not a requirement. A modelet runs in its own process;
an exception fails only the rows of its batch, and bisection finds which ones.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from ..chunks.columns import HIDDEN, Columns, checked, from_rows, num_rows, to_rows


def hidden_column(name: str) -> str:
    """The key under which a columnar modelet returns a column that only its stage's
    `metrics` read (as `name`): a value per row that is not an output (tokens generated,
    retries inside the modelet, time spent per row), counted for exactly the rows written,
    and neither passed on nor written out."""
    return HIDDEN + name


class StageError(Exception):
    """A stage cannot be built: bad class name, import failure, constructor error."""


@runtime_checkable
class BatchModelet(Protocol):
    def process_batch(self, items: list[Any]) -> list[Any]: ...


class Modelet:
    """Optional base class. Override `process_columns` (a columnar batch), `process_batch`
    (a list) or `process` (one item)."""

    def setup(self) -> None:
        """Load models and open resources: runs once, in the stage's own process."""

    def process(self, item: Any) -> Any:
        raise TypeError(f"{type(self).__name__} overrides neither process nor process_batch")

    def process_batch(self, items: list[Any]) -> list[Any]:
        return [self.process(item) for item in items]

    def process_columns(self, batch: Columns) -> Columns:
        return from_rows(self.process_batch(to_rows(batch)))


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


@runtime_checkable
class ColumnsModelet(Protocol):
    def process_columns(self, batch: Columns) -> Columns: ...


def _per_row(obj: Any, name: str) -> Callable[[list[Any]], list[Any]]:
    if isinstance(obj, Modelet | BatchModelet):
        fn: Callable[[list[Any]], list[Any]] = obj.process_batch
        return fn
    single = getattr(obj, "process", None)
    if callable(single):
        return lambda items: [single(item) for item in items]
    raise StageError(
        f"{name} defines none of process_columns(batch), process_batch(items), process(item)"
    )


def rows_callable(obj: Any, name: str) -> Callable[[list[Any]], list[Any]]:
    """A modelet's per-row batch function (a fan-out stage's: one list of parts per row)."""
    batch = _per_row(obj, name)

    def run(items: list[Any]) -> list[Any]:
        out = batch(items)
        if not isinstance(out, list) or len(out) != len(items):
            got = len(out) if isinstance(out, list) else type(out).__name__
            raise TypeError(f"returned {got} outputs for {len(items)} inputs")
        return out

    return run


def columns_callable(obj: Any, name: str) -> Callable[[Columns], Columns]:
    """The columnar batch function of a modelet instance: its own `process_columns`, or its
    per-row method behind the adapter (the slow path)."""
    if isinstance(obj, ColumnsModelet) and not _overrides_rows_only(obj):
        columnar = obj.process_columns

        def run_columns(batch: Columns) -> Columns:
            return checked(columnar(batch), num_rows(batch), f"{name}.process_columns")

        return run_columns
    per_row = rows_callable(obj, name)

    def adapter(batch: Columns) -> Columns:
        return from_rows(per_row(to_rows(batch)))

    return adapter


def _overrides_rows_only(obj: Any) -> bool:
    """A `Modelet` subclass that overrides only the per-row methods: the base class's
    process_columns adapter is not its own."""
    own = getattr(type(obj), "process_columns", None)
    return own is Modelet.process_columns
