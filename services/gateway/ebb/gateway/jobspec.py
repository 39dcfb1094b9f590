"""A batch's Ebb job, from the catalogue model its requests name.

One llm stage over the job's input (the requests' prompts and sampling, as the gateway
wrote them: Parquet, a row group per shard), its output Parquet with each row's `custom_id`
and line; a request that fails is an error row, never a failed job
(`max_error_fraction: 1`)."""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from ebb.common import schema
from ebb.common.job import JobSpec

from .config import CatalogueModel, Window

RESPONSES = "/v1/responses"
DEFAULT_ROWS_PER_SHARD = 500
"""Requests per shard when the catalogue does not say: small enough that a fleet shares a
batch of thousands, big enough that a shard's set-up is a small part of it."""

_REQUEST_FIELDS: list[pa.Field[Any]] = [
    pa.field("custom_id", pa.string()),
    pa.field("line", pa.int64()),
    pa.field("max_tokens", pa.int64()),
    pa.field("temperature", pa.float64()),
    pa.field("top_p", pa.float64()),
    pa.field("top_k", pa.int64()),
    pa.field("seed", pa.int64()),
    pa.field("stop", pa.list_(pa.string())),
    pa.field("structured", pa.string()),
]
REQUEST_SCHEMA = pa.schema(_REQUEST_FIELDS)
CHAT = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))


_EMBEDDING_FIELDS: list[pa.Field[Any]] = [
    pa.field("custom_id", pa.string()),
    pa.field("line", pa.int64()),
    pa.field("input", pa.list_(pa.string())),
    pa.field("input_ids", pa.list_(pa.list_(pa.int64()))),
    pa.field("dimensions", pa.int64()),
    pa.field("encoding_format", pa.string()),
]
EMBEDDING_SCHEMA = pa.schema(_EMBEDDING_FIELDS)
"""An embeddings request's row: its texts or its token ids, its dimensions, and how its
vectors are written (carried to the output)."""


EXTRA_CARRIED = {"/v1/embeddings": ["encoding_format"], RESPONSES: ["echo"]}


def request_schema(endpoint: str) -> pa.Schema:
    """The job input's columns: a chat's messages, a completion's prompt text, or an
    embeddings request's inputs."""
    if endpoint == "/v1/embeddings":
        return EMBEDDING_SCHEMA
    prompt = pa.string() if endpoint == "/v1/completions" else CHAT
    schema = REQUEST_SCHEMA.insert(2, pa.field("prompt", prompt))
    if endpoint == RESPONSES:
        schema = schema.append(pa.field("echo", pa.string()))
    return schema


def rows_per_shard(model: CatalogueModel) -> int:
    return model.rows_per_shard or DEFAULT_ROWS_PER_SHARD


def batch_job(
    *,
    batch_id: str,
    owner: str,
    endpoint: str,
    model: CatalogueModel,
    window: Window,
    input_uri: str,
    output_uri: str,
) -> JobSpec:
    stage = schema.dump(model.stage_spec())
    # What the answers are written with, beside the model's columns: an embeddings request's
    # encoding, a response's echoed parameters.
    carryover = ["custom_id", "line", *EXTRA_CARRIED.get(endpoint, [])]
    body: dict[str, Any] = {
        "name": f"batch {batch_id} ({owner})",
        "id": batch_id,
        "input": {"uri": input_uri, "format": "parquet", "rows_per_shard": rows_per_shard(model)},
        "pipeline": {"stages": [stage]},
        "output": {"uri": output_uri, "format": "parquet", "carryover": carryover},
        "resources": {
            **schema.dump(model.resources),
            **({"pool": window.pool} if window.pool is not None else {}),
        },
        "fault": {**model.fault, "max_error_fraction": 1.0},
        "priority": window.priority,
        "node_selector": model.node_selector,
        "tolerations": model.tolerations,
    }
    return schema.load(JobSpec, body, strict=True)
