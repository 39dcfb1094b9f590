"""Columnar chunks: how rows travel through the pipeline.

A chunk is a map of column name -> numpy array, every array holding one entry per row along
its first axis: `{"features": float32[n, 16], "id": int64[n]}`. A tensor column is one
contiguous array (a batch of images is uint8[n, H, W, C]), so a model stage feeds it to the
runtime as it is, and a stage hand-off pickles a few buffers, whatever the number of rows.
Values that are not numbers (strings, lists of uneven length, maps) live in object arrays.

Rows that are maps (the input's rows, or a modelet's dicts) are chunks of their keys. Rows
that are plain values (a model's output array, a label) are a chunk of one column named
`VALUE`; at the end of the pipeline that column becomes the job's prediction column.

The per-row forms of the modelet API meet chunks through `to_rows` and `from_rows`: the slow
path, a Python object per row, kept for modelets written one item at a time.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np
import pyarrow as pa

Columns = dict[str, np.ndarray]
"""A chunk of rows: column name -> an array with one entry per row (first axis)."""

VALUE = "__value__"
"""The one column of a chunk whose rows are plain values rather than maps."""


METRIC = "__metric__:"
"""The prefix of a column of a metric's per-row values (`StageSpec.metrics`): it travels with
the rows to the worker's front, which sums them up for the rows it writes; no modelet sees
it, nor does the output."""


ROW_ERROR = "__row_error__"
"""A column a modelet may return beside its output: per row, None, or why that row failed (a
prompt too long for the model, say). Those rows become error rows with that reason and the
others go on, without the bisection a raised exception costs."""
HIDDEN = "__hidden__:"
"""The prefix of a column a modelet returns for its stage's metrics alone
(`modelet_api.hidden_column`): dropped once they have read it."""


def split_metrics(chunk: Columns) -> tuple[Columns, Columns]:
    """The chunk's own columns, and its metric columns (keyed by the metric's name)."""
    if not any(name.startswith(METRIC) for name in chunk):
        return chunk, {}
    own = {k: v for k, v in chunk.items() if not k.startswith(METRIC)}
    metrics = {k.removeprefix(METRIC): v for k, v in chunk.items() if k.startswith(METRIC)}
    return own, metrics


class ChunkError(ValueError):
    """Columns that do not make a chunk (different lengths, not arrays)."""


def num_rows(chunk: Mapping[str, np.ndarray]) -> int:
    for column in chunk.values():
        return len(column)
    return 0


def is_plain(chunk: Mapping[str, np.ndarray]) -> bool:
    """Are the chunk's rows plain values (one VALUE column) rather than maps?"""
    return len(chunk) == 1 and VALUE in chunk


def checked(out: Any, rows: int, where: str) -> Columns:
    """A modelet's columnar output, checked: a map of arrays of `rows` entries each."""
    if isinstance(out, pa.RecordBatch | pa.Table):
        out = from_arrow(out)
    if not isinstance(out, Mapping) or not out:
        raise ChunkError(f"{where} returned {type(out).__name__}, not a map of columns")
    chunk: Columns = {}
    for name, column in out.items():
        array = column if isinstance(column, np.ndarray) else _as_column(column)
        if array.ndim == 0 or len(array) != rows:
            got = "a scalar" if array.ndim == 0 else f"{len(array)} rows"
            raise ChunkError(f"{where}: column {name!r} has {got}, the batch has {rows}")
        chunk[str(name)] = array
    return chunk


def _as_column(values: Any) -> np.ndarray:
    if isinstance(values, pa.Array | pa.ChunkedArray):
        return arrow_column(values)
    if hasattr(values, "__array__") and not isinstance(values, list | tuple):
        return np.asarray(values)  # a tensor of another library (torch on the CPU, say)
    if isinstance(values, list | tuple):
        return stack(list(values))
    raise ChunkError(f"a column must be an array or a list, not {type(values).__name__}")


# -- rows <-> columns ------------------------------------------------------------------------


_NUMBERS = (bool, int, float, np.number, np.bool_)
"""Types of per-row values that make a numeric column. (A tuple: `isinstance` against a union
of them is five times slower, and these checks run once per value.)"""


_SHAPE = operator.attrgetter("shape")
_DTYPE = operator.attrgetter("dtype")


def stack(values: Sequence[Any]) -> np.ndarray:
    """One column from per-row values: arrays of one shape and dtype become one array with a
    row axis, numbers a numeric array; anything else an object array."""
    n = len(values)
    if n == 0:
        return np.empty(0, dtype=object)
    first = values[0]
    # The types (then shapes and dtypes) seen, once each, in C loops: no Python code per row.
    kinds = set(map(type, values))
    if all(issubclass(kind, np.ndarray) for kind in kinds) and first.dtype != object:
        if len(set(map(_SHAPE, values))) == 1 and len(set(map(_DTYPE, values))) == 1:
            return np.array(values) if kinds == {np.ndarray} else np.stack(values)
    elif all(issubclass(kind, _NUMBERS) for kind in kinds):
        try:
            array = np.asarray(values)
        except OverflowError:  # an int beyond 64 bits
            array = np.empty(0)
        if array.dtype.kind in "biuf":
            return array
    column = np.empty(n, dtype=object)
    for i, v in enumerate(values):
        column[i] = v
    return column


def from_rows(rows: Sequence[Any]) -> Columns:
    """A chunk from per-row values: maps become columns of their keys, anything else one
    VALUE column. A key missing from some maps is None in those rows."""
    if rows and all(type(r) is dict for r in rows):
        first = rows[0].keys()
        if all(r.keys() == first for r in rows):  # the usual: every row has the same keys
            keys = list(first)
            if all(type(k) is str and k != VALUE for k in keys):
                if len(keys) == 1:
                    return {keys[0]: stack([r[keys[0]] for r in rows])}
                by_key = zip(*map(operator.itemgetter(*keys), rows), strict=True)
                return {k: stack(column) for k, column in zip(keys, by_key, strict=True)}
        keys = list(dict.fromkeys(k for r in rows for k in r))
        if all(type(k) is str and k != VALUE for k in keys):
            return {k: stack([r.get(k) for r in rows]) for k in keys}
    return {VALUE: stack(list(rows))}


def to_rows(chunk: Mapping[str, np.ndarray]) -> list[Any]:
    """Per-row values: maps of the chunk's columns, or the VALUE column's values. Numbers
    come out as Python numbers, tensor rows as views of the column."""
    if is_plain(chunk):
        return _entries(chunk[VALUE])
    names = tuple(chunk)
    if not names:
        return []
    return list(map(_row_maker(names), *(_entries(chunk[name]) for name in names)))


@functools.lru_cache(maxsize=64)
def _row_maker(names: tuple[str, ...]) -> Callable[..., dict[str, Any]]:
    """A function of a row's values, one per column, that returns the row's dict.

    It is a dict display (`{k0: v0, k1: v1}`) made for these columns: CPython builds one
    about four times as fast as `dict(zip(names, values))`, and the per-row adapter builds
    one per row. The names are bound as values, never written into the code."""
    keys = ", ".join(f"k{i}" for i in range(len(names)))
    values = ", ".join(f"v{i}" for i in range(len(names)))
    items = ", ".join(f"k{i}: v{i}" for i in range(len(names)))
    code = f"def bind({keys}):\n    return lambda {values}: {{{items}}}\n"
    scope: dict[str, Any] = {}
    exec(code, scope)  # noqa: S102 - only the generated names above go into the code
    maker: Callable[..., dict[str, Any]] = scope["bind"](*names)
    return maker


def _entries(column: np.ndarray) -> list[Any]:
    if column.ndim == 1:
        values: list[Any] = column.tolist()  # Python numbers (and the objects themselves)
        return values
    return list(column)


# -- slicing and joining -----------------------------------------------------------------------


def take(chunk: Mapping[str, np.ndarray], index: np.ndarray | slice) -> Columns:
    return {name: column[index] for name, column in chunk.items()}


def concat(chunks: Sequence[Mapping[str, np.ndarray]]) -> Columns:
    """One chunk of the rows of several, in order. Chunks of other columns, shapes or dtypes
    join too: a column that differs becomes an object array (a missing one is None)."""
    chunks = [c for c in chunks if num_rows(c)] or list(chunks[:1])
    if len(chunks) == 1:
        return dict(chunks[0])
    names = list(chunks[0])
    if any(list(c) != names for c in chunks[1:]):
        plain = [is_plain(c) for c in chunks]
        if any(plain) and not all(plain):
            return from_rows([r for c in chunks for r in to_rows(c)])
        names = list(dict.fromkeys(n for c in chunks for n in c))
    out: Columns = {}
    for name in names:
        parts = [c.get(name) for c in chunks]
        out[name] = _join(parts, [num_rows(c) for c in chunks])
    return out


def _join(parts: list[np.ndarray | None], lengths: list[int]) -> np.ndarray:
    present = [p for p in parts if p is not None]
    first = present[0]
    if len(present) == len(parts) and all(
        p.dtype == first.dtype and p.shape[1:] == first.shape[1:] for p in present
    ):
        return np.concatenate(present)
    column = np.empty(sum(lengths), dtype=object)
    at = 0
    for part, n in zip(parts, lengths, strict=True):
        if part is not None:
            for i, v in enumerate(_entries(part)):
                column[at + i] = v
        at += n
    return column


def scatter(
    pieces: Sequence[tuple[np.ndarray, Mapping[str, np.ndarray]]], n: int
) -> tuple[Columns, np.ndarray]:
    """The rows of several chunks put at their places among n rows. Returns the columns and
    a mask of the places that no chunk filled (their entries are zeros or None)."""
    filled = np.zeros(n, dtype=bool)
    if not pieces:
        return {}, ~filled
    # Results mostly come back in order, chunk after chunk: then joining them is all.
    pieces = sorted(pieces, key=lambda piece: int(piece[0][0]) if len(piece[0]) else -1)
    at = np.concatenate([where for where, _ in pieces])
    joined = concat([chunk for _, chunk in pieces])
    if len(at) == n and (at == np.arange(n)).all():
        return joined, filled | True
    filled[at] = True
    out: Columns = {}
    for name, column in joined.items():
        full = (
            np.full(n, None, dtype=object)
            if column.dtype == object
            else np.zeros((n, *column.shape[1:]), dtype=column.dtype)
        )
        full[at] = column
        out[name] = full
    return out, ~filled


# -- Arrow -----------------------------------------------------------------------------------


def take_rows(data: ArrowRows, index: np.ndarray) -> ArrowRows:
    """The rows of `data` at `index` (int64), in that order.

    Arrow (26) takes (and filters) a sliced column of nested fixed-size lists (a tensor of
    two axes or more a row) wrongly: it reads their values from the start of the buffer, not
    from the slice's. Such columns are rebuilt at offset 0 first."""
    if any(_nested_list(kind) for kind in data.schema.types):
        data = _unsliced(data)
    return data.take(pa.array(index, type=pa.int64()))


ArrowRows = TypeVar("ArrowRows", pa.Table, pa.RecordBatch)


def _nested_list(kind: pa.DataType) -> bool:
    return pa.types.is_fixed_size_list(kind) and pa.types.is_fixed_size_list(kind.value_type)


def _unsliced(data: ArrowRows) -> ArrowRows:
    columns: list[Any] = []
    for kind, column in zip(data.schema.types, data.columns, strict=True):
        if not _nested_list(kind):
            columns.append(column)
        elif isinstance(column, pa.ChunkedArray):
            chunks = [_rebuilt(c) for c in column.chunks]
            columns.append(pa.chunked_array(chunks) if chunks else column)
        else:
            columns.append(_rebuilt(column))
    return type(data).from_arrays(columns, schema=data.schema)


def _rebuilt(array: Any) -> pa.Array[Any]:
    """Nested fixed-size lists with the values of `array`'s slots, at offset 0 all down."""
    sizes: list[int] = []
    inner, start, length = array, 0, len(array)
    while pa.types.is_fixed_size_list(inner.type):
        # A slot's values are its child's (logical) entries from its own (physical) index.
        size = inner.type.list_size
        sizes.append(size)
        start, length = (inner.offset + start) * size, length * size
        inner = inner.values
    leaf: pa.Array[Any] = pa.concat_arrays([inner.slice(start, length)])
    for size in reversed(sizes[1:]):
        leaf = pa.FixedSizeListArray.from_arrays(leaf, size)
    mask = array.is_null() if array.null_count else None
    rebuilt: pa.Array[Any] = pa.FixedSizeListArray.from_arrays(leaf, sizes[0], mask=mask)
    return rebuilt


def from_arrow(data: pa.RecordBatch | pa.Table, columns: Iterable[str] | None = None) -> Columns:
    """A chunk from Arrow columns, without a copy where the layout allows: numbers as they
    are, fixed-size lists of numbers (tensors) as one array with a row axis."""
    names = list(columns) if columns is not None else data.schema.names
    return {name: arrow_column(data.column(name)) for name in names}


def arrow_column(column: pa.Array[Any] | pa.ChunkedArray[Any]) -> np.ndarray:
    array: Any = column
    if isinstance(column, pa.ChunkedArray):
        array = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    kind = array.type
    if isinstance(kind, pa.FixedShapeTensorType) and array.null_count == 0:
        return np.asarray(array.to_numpy_ndarray())
    if array.null_count == 0:
        shape = [len(array)]
        inner = array
        while pa.types.is_fixed_size_list(inner.type) and inner.null_count == 0:
            shape.append(inner.type.list_size)
            inner = inner.flatten()
        if len(shape) > 1 and _numeric(inner.type) and inner.null_count == 0:
            tensor: np.ndarray = inner.to_numpy(zero_copy_only=False).reshape(shape)
            return tensor
        if _numeric(kind):
            return np.asarray(array.to_numpy(zero_copy_only=False))
    if (pa.types.is_list(kind) or pa.types.is_large_list(kind)) and _numeric(kind.value_type):
        # Rows of varying length (token ids, say): an array per row.
        return stack([None if v is None else np.asarray(v) for v in array.to_pylist()])
    out = np.empty(len(array), dtype=object)
    for i, v in enumerate(array.to_pylist()):
        out[i] = v
    return out


def _numeric(kind: pa.DataType) -> bool:
    return bool(
        pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind)
    )


def to_arrow(
    column: np.ndarray, missing: np.ndarray | None = None, *, keep_half: bool = False
) -> pa.Array[Any]:
    """An Arrow column from a chunk's column; rows where `missing` is True are null. A tensor
    column becomes (nested) fixed-size lists. Half floats become single ones (Parquet stores
    none) unless `keep_half` (Arrow IPC does)."""
    if column.dtype == object:
        return _objects_to_arrow(column, missing)
    mask = missing if missing is not None and missing.any() else None
    if column.ndim == 1:
        if column.dtype.kind == "f" and column.dtype.itemsize == 2 and not keep_half:
            column = column.astype(np.float32)
        plain: pa.Array[Any] = pa.array(column, mask=mask)
        return plain
    flat: pa.Array[Any] = to_arrow(np.ascontiguousarray(column).reshape(-1), keep_half=keep_half)
    for size in reversed(column.shape[2:]):
        flat = pa.FixedSizeListArray.from_arrays(flat, size)
    tensors: pa.Array[Any] = pa.FixedSizeListArray.from_arrays(
        flat, column.shape[1], mask=pa.array(mask) if mask is not None else None
    )
    return tensors


def _strings_to_arrow(column: np.ndarray, missing: np.ndarray | None) -> pa.Array[Any] | None:
    """A column of strings in one conversion; None when it holds something else too."""
    mask = missing if missing is not None and missing.any() else None
    try:
        text: pa.Array[Any] = pa.array(column, type=pa.string(), mask=mask, from_pandas=True)
    except (pa.ArrowException, TypeError):
        return None
    return text


def _objects_to_arrow(column: np.ndarray, missing: np.ndarray | None) -> pa.Array[Any]:
    if len(column) and type(column[0]) is str:
        # Strings (labels, text): converted by Arrow itself, not value by value here.
        text = _strings_to_arrow(column, missing)
        if text is not None:
            return text
    values: list[Any] = list(column)
    if missing is not None:
        values = [None if m else v for v, m in zip(values, missing.tolist(), strict=True)]
    present = [v for v in values if v is not None]
    if not present:
        return pa.nulls(len(values))
    first = present[0]
    if isinstance(first, np.ndarray):
        shape, dtype = first.shape, first.dtype
        if dtype.kind != "O" and all(
            isinstance(v, np.ndarray) and v.shape == shape and v.dtype == dtype for v in present
        ):
            filler = np.zeros(shape, dtype=dtype)
            stacked = np.stack([filler if v is None else v for v in values])
            return to_arrow(stacked, np.array([v is None for v in values]))
        nested: pa.Array[Any] = pa.array(
            [None if v is None else np.asarray(v).tolist() for v in values]
        )
        return nested
    if isinstance(first, np.generic):
        values = [v.item() if isinstance(v, np.generic) else v for v in values]
    array: pa.Array[Any] = pa.array(values)
    return array
