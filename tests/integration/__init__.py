"""Several parts together over a real nats-server and real processes: tiers, drains and splits,
resume, retention, bad data, object stores, a NATS cluster losing a server."""
