"""Which of a job spec's fields decide the rows of its output, and which may change between
runs of one job (how fast, where): the fields an output root keeps, and their digest."""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

STAGE_PERFORMANCE_FIELDS = frozenset(
    {
        "name",
        "batch_size",
        "adaptive_batch",
        "batch_wait_s",
        "batch_tokens",
        "length_column",
        "workers",
        "min_workers",
        "max_workers",
        "threads",
        "device",
    }
)


"""A stage's fields that decide how fast and where its rows are computed, not what they are
(a name is a label). Every other field of a stage, one added later included, counts."""


LATER_STAGE_FIELDS = frozenset({"models", "after", "metrics", "llm"})


"""Stage fields added after output roots began to keep the fields that decide their rows:
left out of those while unset, so that a spec which does not use one carries on in an output
root claimed before it came."""


OUTPUT_LAYOUT_FIELDS = frozenset({"uri", "max_rows_per_file"})


"""Where the output root is and how a shard's rows are cut into files: the manifest names
every file, so shards written either way read back as the same rows."""


def flatten(value: Any, path: str, into: dict[str, Any]) -> None:
    """Maps become `path.key` entries, lists of maps `path[i]` ones; other values are leaves."""
    if isinstance(value, dict):
        for key, item in value.items():
            flatten(item, f"{path}.{key}" if path else str(key), into)
    elif isinstance(value, list) and any(isinstance(item, dict) for item in value):
        for i, item in enumerate(value):
            flatten(item, f"{path}[{i}]", into)
    else:
        into[path] = value


def fields_digest(fields: dict[str, Any]) -> str:
    text = json.dumps(fields, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def differing_fields(before: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """The paths whose values differ between two `output_fields`, in order (a path one of them
    lacks differs too: a stage added, a parameter dropped)."""
    paths = sorted(set(before) | set(now), key=_path_order)
    return [p for p in paths if p not in before or p not in now or before[p] != now[p]]


def _path_order(path: str) -> list[tuple[int, str]]:
    """`stages[10]` after `stages[9]`: list indexes by number, the rest by name."""
    return [
        (int(part), "") if part.isdigit() else (-1, part) for part in re.split(r"\[(\d+)\]", path)
    ]
