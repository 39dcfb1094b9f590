"""The shard master: job intake, shard planning and the lease table, persisted in JetStream KV.

The folders are its layers, each importing only those below it (import-linter keeps the order,
pyproject.toml):

- here, the NATS edge, on the event loop: `service` (its loop: campaign for the leader key,
  load the table, serve, step down), `requests` (the lease protocol and job requests),
  `submissions` (the jobs stream), `election` (the leader key), `kv` (the records in JetStream
  KV: NATS's errors end there, as `StoreUnavailable` and `StateUnsure`);
- `table/`, the lease table: every decision about jobs and shards, state in memory over a
  `RecordStore`, no NATS in it;
- `planning/`, how an input is cut into shards (pure, blocking: run in a thread);
- `errors` and `metrics`, which every layer uses.
"""
