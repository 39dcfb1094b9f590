"""Wire schemas: versioned, validated, with errors that say where."""

from __future__ import annotations

import msgpack
import pytest

from ebb.common import schema
from ebb.common.errors import SchemaError
from ebb.common.messaging.messages import LeaseReply, LeaseRequest, ShardSpec, StatusReply


def test_round_trip_keeps_every_field() -> None:
    reply = LeaseReply(
        status="granted",
        shard=ShardSpec(index=3, path="/d/p.parquet", format="parquet", rows=10, row_groups=[1, 2]),
        attempt=2,
        token="1:j:3:2:ab",
        lease_s=30.0,
    )
    assert schema.decode(LeaseReply, schema.encode(reply)) == reply


def test_version_is_stamped_and_checked() -> None:
    body = msgpack.unpackb(schema.encode(LeaseRequest(job="j", worker="w")))
    assert body["v"] == schema.SCHEMA_VERSION
    body["v"] = 99
    with pytest.raises(SchemaError, match="schema version 99 not supported"):
        schema.decode(LeaseRequest, msgpack.packb(body))
    del body["v"]
    with pytest.raises(SchemaError, match="version is missing"):
        schema.decode(LeaseRequest, msgpack.packb(body))


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"\xc1\xff garbage", "not valid msgpack"),
        (msgpack.packb([1, 2, 3]), "expected a map"),
        (msgpack.packb({"v": 1, "worker": "w"}), "job: required field is missing"),
        (msgpack.packb({"v": 1, "job": 5, "worker": "w"}), "job: expected str, got int"),
    ],
)
def test_malformed_messages_are_refused_with_a_clear_reason(data: bytes, match: str) -> None:
    with pytest.raises(SchemaError, match=match):
        schema.decode(LeaseRequest, data)


def test_nested_errors_carry_their_path() -> None:
    body = {"v": 1, "jobs": [{"id": "a", "name": "n", "state": "RUNNING", "shards": {"TODO": "x"}}]}
    with pytest.raises(SchemaError) as e:
        schema.decode(StatusReply, msgpack.packb(body))
    assert e.value.path == "jobs[0].shards.TODO"


def test_unknown_fields_from_a_newer_peer_are_ignored() -> None:
    body = {"v": 1, "job": "j", "worker": "w", "added_in_v2": True}
    assert schema.decode(LeaseRequest, msgpack.packb(body)) == LeaseRequest(job="j", worker="w")


def test_literal_fields_accept_only_their_values() -> None:
    with pytest.raises(SchemaError, match="status: expected one of"):
        schema.decode(LeaseReply, msgpack.packb({"v": 1, "status": "maybe"}))


def test_bool_is_not_an_int() -> None:
    with pytest.raises(SchemaError, match="attempt: expected int, got bool"):
        schema.decode(LeaseReply, msgpack.packb({"v": 1, "status": "wait", "attempt": True}))
