"""The client: the ebb CLI and its runs, services starting while NATS is unreachable."""
