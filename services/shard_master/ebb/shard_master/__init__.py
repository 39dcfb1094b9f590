"""The shard master: job intake, shard planning and the lease table, persisted in JetStream KV."""
