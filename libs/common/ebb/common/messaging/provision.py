"""What Ebb needs of JetStream, made or checked at a master's start: the jobs stream and the
key-value buckets."""

from __future__ import annotations

from dataclasses import replace

import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, KeyValueConfig, RetentionPolicy, StorageType, StreamConfig
from nats.js.kv import KeyValue

from .subjects import Subjects


async def ensure_jetstream(
    js: JetStreamContext, subjects: Subjects, *, leader_ttl_s: float, replicas: int = 1
) -> None:
    """Create the stream and buckets Ebb needs, or check they exist. Idempotent.

    `replicas`: copies of each on a NATS cluster (3 on a three-node cluster: any one server
    may go down, for an upgrade or for good, without losing or stopping anything)."""
    stream = StreamConfig(
        name=subjects.jobs_stream,
        # Jobs without an owner, and each owner's on a subject naming it.
        subjects=[subjects.submit, subjects.owners_submit],
        storage=StorageType.FILE,
        # A submitted job is work to do exactly once: acked messages are removed.
        retention=RetentionPolicy.WORK_QUEUE,
        # Bounded: past these, a submission is refused (the submitter hears it), never an
        # unplanned one dropped.
        discard=DiscardPolicy.NEW,
        max_msgs=JOBS_STREAM_MAX_MSGS,
        max_bytes=JOBS_STREAM_MAX_BYTES,
        duplicate_window=120.0,
        max_msg_size=1024 * 1024,
        num_replicas=replicas,
    )
    try:
        info = await js.stream_info(subjects.jobs_stream)
    except nats.js.errors.NotFoundError:
        await js.add_stream(stream)
    else:
        had = list(info.config.subjects or [])
        missing = [s for s in stream.subjects or [] if s not in had]
        if missing:
            # Made by a version before owners' subjects: it takes them from now on, its
            # messages kept (only the subjects change).
            await js.update_stream(replace(info.config, subjects=[*had, *missing]))
    for bucket, ttl in (
        (subjects.jobs_bucket, None),
        (subjects.shards_bucket, None),
        (subjects.leader_bucket, leader_ttl_s),
    ):
        await ensure_bucket(
            js, KeyValueConfig(bucket=bucket, history=1, ttl=ttl, replicas=replicas)
        )


JOBS_STREAM_MAX_MSGS = 100_000
"""Submissions waiting for the master at most (they leave the stream once planned)."""
JOBS_STREAM_MAX_BYTES = 1024**3


async def ensure_bucket(js: JetStreamContext, config: KeyValueConfig) -> KeyValue:
    try:
        return await js.key_value(config.bucket)
    except nats.js.errors.BucketNotFoundError:
        config.storage = StorageType.FILE
        return await js.create_key_value(config=config)
