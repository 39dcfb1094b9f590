"""`python -m ebb.worker --job JOB`: work on one job's shards until it ends or SIGTERM.

The fork server that stage processes come from starts before anything else is imported, so
that its imports (numpy, pyarrow, the stage loop) overlap the worker's own (NATS, the metrics
server, ...) and its first exchanges with the master.
"""

if __name__ == "__main__":
    from ebb.worker.stageserver import start_stage_server

    start_stage_server()

    from ebb.worker.entry import main

    raise SystemExit(main())
