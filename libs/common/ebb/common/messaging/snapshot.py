"""A consistent read of a KV bucket's live keys: what the shard master loads its table from,
and the Batch API gateway its lists."""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import nats.errors
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.kv import KV_DEL, KV_OP, KV_PURGE


class KVEntry(NamedTuple):
    key: str
    value: bytes
    revision: int


async def kv_snapshot(
    js: JetStreamContext, bucket: str, pattern: str, *, timeout_s: float = 30.0
) -> list[KVEntry]:
    """(key, value, revision) of every live key of `bucket` matching `pattern`.

    Read through an ephemeral pull consumer that delivers the last message of each key. A pull
    consumer sends nothing until asked, so the count of messages it reports when created is
    exact, and we read exactly that many. (nats-py's KV watcher instead decides that the
    initial values are over from counters that race with messages already in flight, and can
    end a snapshot early: nats-io/nats.py#842. A job would then lose shards.)
    """
    stream = f"KV_{bucket}"
    info = await js.add_consumer(
        stream,
        ConsumerConfig(
            deliver_policy=DeliverPolicy.LAST_PER_SUBJECT,
            ack_policy=AckPolicy.NONE,
            filter_subject=f"$KV.{bucket}.{pattern}",
            inactive_threshold=timeout_s,  # the server removes it if we vanish mid-read
            mem_storage=True,
            num_replicas=1,
        ),
    )
    subscription = await js.pull_subscribe_bind(consumer=info.name, stream=stream)
    out: list[KVEntry] = []
    key_start = len(f"$KV.{bucket}.")
    remaining = info.num_pending or 0
    try:
        while remaining > 0:
            for msg in await subscription.fetch(min(remaining, 1_000), timeout=timeout_s):
                remaining -= 1
                if msg.headers and msg.headers.get(KV_OP) in (KV_DEL, KV_PURGE):
                    continue  # a deleted key
                out.append(KVEntry(msg.subject[key_start:], msg.data, msg.metadata.sequence.stream))
    finally:
        await subscription.unsubscribe()
        with contextlib.suppress(nats.errors.Error):
            await js.delete_consumer(stream, info.name)
    return out
