"""Typed, validated conversion between plain data (msgpack / JSON / YAML maps) and dataclasses.

Every message on the wire and every job spec is a frozen dataclass. `load` checks a decoded
map against the dataclass's annotations, field by field, and reports the first problem with
its path (`pipeline.stages[0].batch_size: expected int, got str`). Semantic checks live in
each dataclass's `__post_init__` and raise `ValueError`; `load` re-raises those as
`SchemaError` with the path of the object that failed.

Wire messages carry a schema version under the key `v`. `encode` adds it, `decode` checks it.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import math
import types
import typing
from collections.abc import Mapping
from typing import Any, ClassVar, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

import msgpack

from .errors import SchemaError

SCHEMA_VERSION = 1
"""The version this build writes. It reads every version in `SUPPORTED_VERSIONS`."""
SUPPORTED_VERSIONS = frozenset({1})
VERSION_KEY = "v"

# Decoding limits: a message from a peer may be hostile or corrupt; never let it make us
# allocate without bound.
_MAX_MESSAGE_BYTES = 8 * 1024 * 1024

T = TypeVar("T")

_hints_cache: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    hints = _hints_cache.get(cls)
    if hints is None:
        hints = get_type_hints(cls)
        _hints_cache[cls] = hints
    return hints


def _type_name(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, Mapping):
        return "map"
    if isinstance(value, list | tuple):
        return "list"
    return type(value).__name__


def _describe(tp: Any) -> str:
    origin = get_origin(tp)
    if tp is Any:
        return "any value"
    if origin is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in get_args(tp))
    if origin is list:
        return f"list of {_describe(get_args(tp)[0])}"
    if origin is dict:
        return f"map of {_describe(get_args(tp)[1])}"
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):
        return "map"
    return getattr(tp, "__name__", str(tp))


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def load(cls: type[T], data: object, *, path: str = "", strict: bool = True) -> T:
    """Build a `cls` dataclass from plain data, validating every field.

    strict: reject unknown keys (job specs: a typo must not pass silently). Wire messages load
    with strict=False so that a newer peer may add fields.
    """
    value = _convert(cls, data, path, strict)
    return typing.cast(T, value)


def _convert(tp: Any, data: object, path: str, strict: bool) -> Any:
    if tp is Any or tp is object:
        return data
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        options = get_args(tp)
        if data is None and type(None) in options:
            return None
        problems: list[SchemaError] = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _convert(option, data, path, strict)
            except SchemaError as e:
                problems.append(e)
        # One non-null option: its own message is the most precise one.
        if len(problems) == 1:
            raise problems[0]
        raise SchemaError(path, f"expected {_describe(tp)}, got {_type_name(data)}")
    if origin is Literal:
        allowed = get_args(tp)
        if data not in allowed or isinstance(data, bool) != isinstance(allowed[0], bool):
            raise SchemaError(
                path, f"expected one of {', '.join(map(repr, allowed))}, got {data!r}"
            )
        return data
    if origin is list:
        if not isinstance(data, list | tuple):
            raise SchemaError(path, f"expected a list, got {_type_name(data)}")
        (item_tp,) = get_args(tp)
        return [_convert(item_tp, item, f"{path}[{i}]", strict) for i, item in enumerate(data)]
    if origin is dict:
        if not isinstance(data, Mapping):
            raise SchemaError(path, f"expected a map, got {_type_name(data)}")
        key_tp, value_tp = get_args(tp)
        out: dict[Any, Any] = {}
        for k, v in data.items():
            if key_tp is str and not isinstance(k, str):
                raise SchemaError(path, f"map keys must be strings, got {_type_name(k)}")
            out[k] = _convert(value_tp, v, _join(path, str(k)), strict)
        return out
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _load_dataclass(tp, data, path, strict)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(data)
        except ValueError:
            names = ", ".join(repr(m.value) for m in tp)
            raise SchemaError(path, f"expected one of {names}, got {data!r}") from None
    if tp is bool:
        if not isinstance(data, bool):
            raise SchemaError(path, f"expected bool, got {_type_name(data)}")
        return data
    if tp is int:
        if isinstance(data, bool) or not isinstance(data, int):
            raise SchemaError(path, f"expected int, got {_type_name(data)}")
        return data
    if tp is float:
        if isinstance(data, bool) or not isinstance(data, int | float):
            raise SchemaError(path, f"expected a number, got {_type_name(data)}")
        # NaN compares false with everything: one NaN deadline would break a heap's order.
        if not math.isfinite(data):
            raise SchemaError(path, f"expected a finite number, got {data!r}")
        return float(data)
    if tp is str:
        if not isinstance(data, str):
            raise SchemaError(path, f"expected str, got {_type_name(data)}")
        return data
    if tp is bytes:
        if not isinstance(data, bytes | bytearray):
            raise SchemaError(path, f"expected bytes, got {_type_name(data)}")
        return bytes(data)
    raise TypeError(f"schema: unsupported annotation {tp!r} at {path or '<root>'}")


def _load_dataclass(cls: type, data: object, path: str, strict: bool) -> Any:
    if not isinstance(data, Mapping):
        raise SchemaError(path, f"expected a map, got {_type_name(data)}")
    hints = _hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    if strict:
        for key in data:
            if key == VERSION_KEY and not path:
                continue
            if key not in fields:
                near = difflib.get_close_matches(str(key), list(fields), n=1)
                hint = f"; did you mean {near[0]!r}?" if near else ""
                raise SchemaError(_join(path, str(key)), f"unknown field{hint}")
    kwargs: dict[str, Any] = {}
    for name, field in fields.items():
        if name in data:
            kwargs[name] = _convert(hints[name], data[name], _join(path, name), strict)
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise SchemaError(_join(path, name), "required field is missing")
    try:
        return cls(**kwargs)
    except SchemaError as e:
        if path and not e.path.startswith(path):
            raise SchemaError(_join(path, e.path), e.problem) from None
        raise
    except (ValueError, TypeError) as e:
        raise SchemaError(path, str(e)) from None


def dump(value: Any) -> Any:
    """Turn a dataclass (recursively) into plain maps, lists and scalars."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: dump(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, list | tuple):
        return [dump(v) for v in value]
    if isinstance(value, dict):
        return {k: dump(v) for k, v in value.items()}
    return value


class Message:
    """Base of every wire message. Subclasses are frozen, keyword-only dataclasses."""

    KIND: ClassVar[str] = "message"


M = TypeVar("M", bound=Message)


def pack(value: Any) -> bytes:
    """msgpack bytes of a dataclass, stamped with this build's schema version."""
    body = dump(value)
    body[VERSION_KEY] = SCHEMA_VERSION
    data: bytes = msgpack.packb(body, use_bin_type=True)
    return data


def encode(message: Message) -> bytes:
    """msgpack bytes of a wire message, stamped with this build's schema version."""
    return pack(message)


def unpack(data: bytes) -> dict[str, Any]:
    """Decode msgpack bytes into a map, with size limits; reject anything that is not a map."""
    if len(data) > _MAX_MESSAGE_BYTES:
        raise SchemaError("", f"message of {len(data)} bytes exceeds {_MAX_MESSAGE_BYTES}")
    try:
        body = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as e:  # noqa: BLE001 - msgpack raises a zoo of types for corrupt input
        raise SchemaError("", f"not valid msgpack: {e}") from None
    if not isinstance(body, dict):
        raise SchemaError("", f"expected a map at the top level, got {_type_name(body)}")
    return body


def check_version(body: Mapping[str, Any]) -> None:
    version = body.get(VERSION_KEY)
    if version is None:
        raise SchemaError(VERSION_KEY, "schema version is missing")
    if type(version) is not int or version not in SUPPORTED_VERSIONS:
        known = ", ".join(map(str, sorted(SUPPORTED_VERSIONS)))
        raise SchemaError(VERSION_KEY, f"schema version {version!r} not supported (known: {known})")


def decode(cls: type[T], data: bytes) -> T:
    """Validate msgpack bytes as a `cls` dataclass. Unknown fields are ignored."""
    body = unpack(data)
    check_version(body)
    return load(cls, body, strict=False)
