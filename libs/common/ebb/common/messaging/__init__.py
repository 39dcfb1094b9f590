"""Everything that crosses NATS, and how Ebb reaches it.

`messages` (every message, versioned), `subjects` (every subject, stream and bucket name),
`bus` (connections, JetStream set-up, typed requests), `api` (the shard master's
request/reply API as a typed client), `natsconfig` (how to reach NATS), `auth` (one user per
role and its subjects), `identity` (one NATS identity per worker), `provision` (the jobs
stream and KV buckets), `embedded` (a nats-server for `ebb run`, `ebb up` and the tests).
May use `ebb.common.job` and the foundation modules of `ebb.common`; never `data`."""
