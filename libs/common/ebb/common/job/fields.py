"""What the job spec's sections share: the names it accepts (input formats, runtimes, pools),
the patterns names must match, and the checks of a field's value that raise `SpecError` with
the field's path."""

from __future__ import annotations

import math
import re
from typing import Any, Literal

from ..errors import SpecError

MODELET_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


METRIC_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,63}$")


TIER_NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,18}[a-z0-9])?$")


"""A tier's name goes into its pods' names and labels: a short DNS label."""


InputFormat = Literal["parquet", "csv", "jsonl"]


Runtime = Literal["onnx", "torchscript"]


ModelDtype = Literal["float32", "float16", "bfloat16"]


Pool = Literal["auto", "offline", "any", "mixed", "online"]


MODEL_SUFFIXES: dict[str, Runtime] = {
    ".onnx": "onnx",
    ".pt": "torchscript",
    ".pth": "torchscript",
    ".ts": "torchscript",
    ".torchscript": "torchscript",
}


RUNTIME_MODULES: dict[Runtime, str] = {"onnx": "onnxruntime", "torchscript": "torch"}


"""The module each runtime imports: what a worker's stage processes can have imported for them,
once, before they start (see `JobSpec.runtime_modules`)."""


FORMAT_SUFFIXES: dict[str, InputFormat] = {
    ".parquet": "parquet",
    ".pq": "parquet",
    ".csv": "csv",
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
}


_TIMESTAMP_RE = re.compile(r"^timestamp\[(s|ms|us|ns)(?:, tz=([^\]]+))?\]$")


def arrow_type(name: str) -> Any:
    """The pyarrow DataType a type name stands for: an alias ("int64", "string", "date32") or
    the name pyarrow prints ("double", "timestamp[s, tz=UTC]"). ValueError if none."""
    import pyarrow as pa

    match = _TIMESTAMP_RE.match(name.strip())
    if match:
        return pa.timestamp(match.group(1), tz=match.group(2))
    try:
        return pa.type_for_alias(name.strip())  # type: ignore[call-overload]
    except (ValueError, KeyError):
        raise ValueError(
            f"{name!r} is not an Arrow type name (int64, double, string, ...)"
        ) from None


def bad(name: str, problem: str) -> SpecError:
    return SpecError(name, problem)


def positive(name: str, value: float) -> None:
    if not math.isfinite(value):
        raise bad(name, f"must be a finite number, got {value}")
    if value <= 0:
        raise bad(name, f"must be > 0, got {value}")
