"""`python -m ebb.worker --job JOB`: work on one job's shards until it ends or SIGTERM.

Nothing else here, on purpose: stage processes are spawned, and a spawned process imports its
parent's main module first. Kept this small, that costs a stage nothing; the worker's own
imports (NATS, the metrics server, ...) happen in `entry`, which stages never load.
"""

if __name__ == "__main__":
    from ebb.worker.entry import main

    raise SystemExit(main())
