"""Fuzzed input for every decoder: random, truncated, mutated, oversized and wrong-version
messages, and random job specs. Each gets a clear error (SchemaError, SpecError) or decodes to
a valid value; nothing else ever escapes."""

from __future__ import annotations

import dataclasses
import os
import random
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from ebb.client.sdk import EbbClient
from ebb.common import schema
from ebb.common.errors import SchemaError, SpecError
from ebb.common.job import JobSpec, parse_job
from ebb.common.messaging import messages
from ebb.common.messaging.api import MasterClient
from ebb.common.messaging.messages import (
    CancelRequest,
    CommitRequest,
    FailRequest,
    LeaseRequest,
    ReleaseRequest,
    RenewRequest,
    ResumeRequest,
    StatusRequest,
)
from ebb.common.messaging.subjects import WORKER_OPS, Subjects
from ebb.common.schema import Message

from ..shard_master import test_master as _master_tests
from ..shard_master.test_master import make_job

# The live master's fixtures, shared with test_master.py.
master = _master_tests.master
client = _master_tests.client
api = _master_tests.api
subjects = _master_tests.subjects

MESSAGES = sorted(
    (
        cls
        for cls in vars(messages).values()
        if isinstance(cls, type) and issubclass(cls, Message) and cls is not Message
    ),
    key=lambda cls: cls.__name__,
)

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.binary(max_size=20),
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=20,
)

FUZZ = settings(
    max_examples=int(os.environ.get("EBB_FUZZ_EXAMPLES", "150")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def _field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


@st.composite
def message_maps(draw: st.DrawFn, cls: type) -> dict[str, Any]:
    """Maps with the message's own field names (and some others), holding anything."""
    names = [*_field_names(cls), "extra", schema.VERSION_KEY]
    body = draw(st.dictionaries(st.sampled_from(names), values, max_size=len(names)))
    if draw(st.booleans()):
        body[schema.VERSION_KEY] = schema.SCHEMA_VERSION
    return body


def _decode_or_refuse(cls: type, data: bytes) -> None:
    try:
        decoded: Any = schema.decode(cls, data)
    except SchemaError:
        return
    assert isinstance(decoded, cls)


@pytest.mark.parametrize("cls", MESSAGES, ids=lambda cls: cls.__name__)
@FUZZ
@given(data=st.binary(max_size=256))
def test_random_bytes_are_refused_clearly(cls: type, data: bytes) -> None:
    _decode_or_refuse(cls, data)


@pytest.mark.parametrize("cls", MESSAGES, ids=lambda cls: cls.__name__)
@FUZZ
@given(st.data())
def test_maps_of_the_right_names_and_wrong_values_are_refused_clearly(
    cls: type, data: st.DataObject
) -> None:
    body = data.draw(message_maps(cls))
    try:
        packed = msgpack.packb(body, use_bin_type=True)
    except (OverflowError, ValueError, TypeError):
        assume(False)  # not representable in msgpack: nobody can send it
    _decode_or_refuse(cls, packed)
    cut = data.draw(st.integers(min_value=0, max_value=max(0, len(packed) - 1)))
    _decode_or_refuse(cls, packed[:cut])  # truncated on the way


def test_a_wrong_schema_version_and_an_oversized_message_are_refused() -> None:
    body = {"job": "j", "worker": "w", schema.VERSION_KEY: 999}
    with pytest.raises(SchemaError, match="not supported"):
        schema.decode(messages.LeaseRequest, msgpack.packb(body))
    huge = msgpack.packb({"job": "x" * (8 * 2**20), schema.VERSION_KEY: schema.SCHEMA_VERSION})
    with pytest.raises(SchemaError, match="exceeds"):
        schema.decode(messages.LeaseRequest, huge)


@st.composite
def job_specs(draw: st.DrawFn) -> Any:
    """Job maps: mostly well-formed skeletons with random values in random places."""
    spec: dict[str, Any] = {
        "input": {
            "uri": draw(st.text(max_size=12)),
            "format": draw(st.sampled_from(["parquet", "csv", "x"])),
        },
        "pipeline": {"stages": [{"modelet": draw(st.text(max_size=12))}]},
        "output": {"uri": draw(st.text(max_size=12))},
    }
    for _ in range(draw(st.integers(min_value=0, max_value=4))):
        section = draw(
            st.sampled_from(["input", "output", "resources", "fault", "pipeline", "top"])
        )
        key = draw(
            st.text(max_size=12)
            | st.sampled_from(["rows_per_shard", "lease_s", "batch_size", "columns"])
        )
        target = spec if section == "top" else spec.setdefault(section, {})
        if isinstance(target, dict):
            target[key] = draw(values)
    return draw(st.sampled_from([spec, draw(values)]))


@FUZZ
@given(job_specs())
def test_random_job_specs_are_refused_with_the_path_of_what_is_wrong(data: Any) -> None:
    try:
        spec = parse_job(data)
    except SpecError as e:
        assert str(e)  # says what and where
        return
    assert isinstance(spec, JobSpec)


def _garbage(rng: random.Random, valid: bytes) -> list[bytes]:
    """Bytes a broken or hostile client might send: random, truncated, bit-flipped, of another
    schema version, and the valid message's fields with forged values."""
    body = msgpack.unpackb(valid)
    out = [rng.randbytes(rng.randrange(0, 64)) for _ in range(4)]
    out += [valid[: rng.randrange(0, len(valid))] for _ in range(3)]
    for _ in range(3):
        flipped = bytearray(valid)
        flipped[rng.randrange(len(flipped))] ^= 1 << rng.randrange(8)
        out.append(bytes(flipped))
    for key in body:
        for forged in (None, -1, 99, "x" * 300, [1, 2], {"a": 1}, 2**63):
            out.append(msgpack.packb({**body, key: forged}))
    return out


REFUSALS = {"bad_request", "stale_token", "not_found", "job_ended", "not_holder", "not_resumable"}


async def test_the_master_answers_every_malformed_or_forged_request_and_keeps_its_state(
    tmp_path: Path, client: EbbClient, api: MasterClient, subjects: Subjects
) -> None:
    spec = make_job(tmp_path)
    await client.submit(spec)
    granted = await api.lease(spec.id, "w1")
    assert granted.status == "granted"
    before = await api.job(spec.id)
    token = "e1.s0.a1.forged"
    valid = {
        "lease": LeaseRequest(job=spec.id, worker="w2"),
        "renew": RenewRequest(token=token),
        "commit": CommitRequest(token=token, rows=1, error_rows=0),
        "release": ReleaseRequest(token=token, reason="x", retryable=False),
        "status": StatusRequest(),
        "cancel": CancelRequest(job="no-such-job"),
        "fail": FailRequest(job="no-such-job", reason="x"),
        "resume": ResumeRequest(job=spec.id),  # running: refused, and must stay as it is
    }
    rng = random.Random(7)
    for op, message in valid.items():
        for payload in _garbage(rng, schema.encode(message)):
            subject = subjects.worker_op(op, "w2") if op in WORKER_OPS else subjects.master(op)
            reply = await client.nc.request(subject, payload, timeout=5)
            body = msgpack.unpackb(reply.data)
            if op in ("lease", "status") and "code" not in body:
                continue  # a request that is still valid, answered as one
            # A clear refusal, never an internal error (an exception the master did not expect).
            assert body.get("code") in REFUSALS, (op, payload, body)
    after = await api.job(spec.id)
    # Only the lease op could take a shard (for "w2", when the forged map stayed valid).
    assert after.state == before.state == "RUNNING"
    assert after.shards["DONE"] == before.shards["DONE"] == 0
    assert after.shards["QUARANTINED"] == 0
    assert (await api.renew(granted.token, worker="w1")).lease_s > 0  # the real holder is untouched
