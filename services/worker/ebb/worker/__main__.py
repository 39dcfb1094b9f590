"""`python -m ebb.worker --job JOB`: work on one job's shards until it ends or SIGTERM.

The fork server that stage processes come from starts before anything else is imported, so
that its imports (numpy, pyarrow, the stage loop) overlap the worker's own (NATS, the metrics
server, ...) and its first exchanges with the master; its stage processes' BLAS and OpenMP
pools are sized first (ebb.worker.resources.cpus).
"""

if __name__ == "__main__":
    import os

    from ebb.worker.pipeline.stageserver import start_stage_server
    from ebb.worker.resources.cpus import blas_environment, pin

    # Before the fork server starts: it, and every stage process, inherits the pinning.
    pin(os.environ)
    # Before the fork server imports numpy: its BLAS sizes its pool once, at import.
    os.environ.update(blas_environment(os.environ))
    start_stage_server()

    from ebb.worker.entry import main

    raise SystemExit(main())
