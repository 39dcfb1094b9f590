"""The lease table: jobs and their shards in memory, every change written first to a
`RecordStore` (compare-and-set) and only then applied. No NATS here: the store raises Ebb's own
errors (`records`), and the edge above answers requests with what the table decides.

- `lease_table`: `LeaseTable`, the lease protocol (lease, renew, commit, release) and the rest;
- `records`: the durable records, the `RecordStore` protocol, `FencedStore`;
- `jobs`, `context`: a job and its shards in memory, with their indexes; what every part shares;
- `transitions`: the moves a shard and a job may make, checked in one place; `moves`: every
  change of a shard's record; `lifecycle`: every change of a job's state;
- `intake` (a job accepted and planned), `ownership` (whose an output root is), `expiry` and
  `reaper` (leases that run out), `tail` (speculation and splits at a job's tail), `status`,
  `finish` (the manifest), `jobmetrics`, `tracking` (the MLflow run).
"""
