"""The shard master: the lease table on an in-memory store (transitions, splits, tiers, lost
answers, metrics), the planner, and the service over a real nats-server."""
