"""The worker's entry point (`python -m ebb.worker --job JOB`): work on one job's shards until it
ends or SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os

from ebb.common import envvars
from ebb.common import log as logsetup
from ebb.common import metrics as metricsserver
from ebb.common.messaging.natsconfig import add_nats_arguments, nats_config_from_args
from ebb.common.messaging.subjects import check_worker_id
from ebb.common.runner import EXIT_FAILED, run
from ebb.common.supervisor import AgentExited, install_stop_signals

from .service import Worker, WorkerConfig, default_worker_id

log = logging.getLogger("ebb.worker")


def _worker_id(text: str) -> str:
    try:
        return check_worker_id(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    env = os.environ.get
    p = argparse.ArgumentParser(prog="python -m ebb.worker", description=__doc__)
    p.add_argument("--job", default=env(envvars.JOB), required=env(envvars.JOB) is None)
    p.add_argument("--id", type=_worker_id, default=env(envvars.WORKER_ID) or default_worker_id())
    p.add_argument(
        "--tier",
        default=env(envvars.TIER, ""),
        help="the tier of the job to run (a job in tiers); none for a job without tiers",
    )
    add_nats_arguments(p)
    p.add_argument(
        "--shards-in-flight",
        type=int,
        default=int(env(envvars.SHARDS_IN_FLIGHT, str(WorkerConfig.shards_in_flight))),
        help="shards held at once: 2 reads the next while one computes (prefetch); 1 does not",
    )
    p.add_argument(
        "--chunk-rows",
        type=int,
        default=int(env(envvars.CHUNK_ROWS, str(WorkerConfig.chunk_rows))),
        help="rows of a shard read and in the pipeline at once (a shard of any size goes "
        "through in chunks: its memory bounded)",
    )
    p.add_argument(
        "--start-jitter",
        type=float,
        default=float(env(envvars.START_JITTER_S, str(WorkerConfig.start_jitter_s))),
        help="wait a random 0..this many seconds before the first lease (a fleet starting "
        "at once spreads its first reads of the store)",
    )
    p.add_argument(
        "--grace",
        type=float,
        default=float(env(envvars.SHUTDOWN_GRACE_S, str(WorkerConfig.shutdown_grace_s))),
    )
    metricsserver.add_metrics_argument(p)
    p.add_argument("--log-level", default=env(envvars.LOG_LEVEL, "INFO"))
    return p.parse_args(argv)


async def amain(args: argparse.Namespace) -> int:
    worker = Worker(
        WorkerConfig(
            nats=nats_config_from_args(args),
            job=args.job,
            id=args.id,
            tier=args.tier,
            shards_in_flight=args.shards_in_flight,
            chunk_rows=args.chunk_rows,
            start_jitter_s=args.start_jitter,
            shutdown_grace_s=args.grace,
        )
    )
    install_stop_signals(worker.request_drain)
    parent = os.environ.get(envvars.PARENT_PID)
    watch = None
    if parent:
        watch = asyncio.create_task(drain_when_orphaned(worker, int(parent)), name="orphan-watch")
    try:
        code = await worker.run()
    except AgentExited as e:
        log.error("%s", e)
        return EXIT_FAILED
    finally:
        if watch is not None:
            watch.cancel()
            await asyncio.wait([watch])
    if worker.fatal_reason:
        write_termination_message(worker.fatal_reason)
    return code


async def drain_when_orphaned(worker: Worker, parent_pid: int, *, interval_s: float = 0.5) -> None:
    """Drain once the controller that started us is gone (killed, say). We run in a session
    of our own (so that a Ctrl-C reaches the controller first), so nothing else would ever
    stop us: left alone we would hold a slot the next controller wants for its own workers
    (it can only wait for us to leave), and outlive the stack."""
    while True:
        if os.getppid() != parent_pid:
            log.warning("the controller that started us (pid %d) is gone: draining", parent_pid)
            worker.request_drain()
            return
        await asyncio.sleep(interval_s)


def write_termination_message(reason: str) -> None:
    """On Kubernetes the pod's status then says why (terminationMessagePath), so that the
    controller can fail the job with the reason rather than with an exit code."""
    path = os.environ.get(envvars.TERMINATION_LOG, "/dev/termination-log")
    with contextlib.suppress(OSError), open(path, "w") as f:  # OSError: not on Kubernetes
        f.write(reason[:4000])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logsetup.setup(args.log_level, service=f"worker {args.id}")
    metricsserver.serve(args.metrics_port)
    return run(amain(args))
