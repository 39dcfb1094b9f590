"""`python -m ebb.shard_master`: run the shard master until SIGTERM."""

from __future__ import annotations

import argparse
import logging
import os
import socket

from ebb.common import envvars
from ebb.common import log as logsetup
from ebb.common import metrics as metricsserver
from ebb.common.messaging.natsconfig import add_nats_arguments, nats_config_from_args
from ebb.common.runner import EXIT_FAILED, EXIT_OK, run
from ebb.common.supervisor import AgentExited, install_stop_signals

from .errors import Deposed
from .service import MasterConfig, ShardMaster

log = logging.getLogger("ebb.shard_master")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    env = os.environ.get
    p = argparse.ArgumentParser(prog="python -m ebb.shard_master", description=__doc__)
    add_nats_arguments(p)
    p.add_argument("--id", default=env(envvars.MASTER_ID, socket.gethostname()))
    p.add_argument(
        "--data-root",
        action="append",
        default=[r for r in env(envvars.DATA_ROOTS, "").split(",") if r],
        help="a root under which job inputs, outputs and models may lie (repeatable)",
    )
    p.add_argument(
        "--leader-ttl",
        type=float,
        default=float(env(envvars.LEADER_TTL_S, str(MasterConfig.leader_ttl_s))),
    )
    p.add_argument(
        "--job-retention",
        type=float,
        default=float(env(envvars.JOB_RETENTION_S, str(MasterConfig.job_retention_s))),
        help="seconds a finished job is kept (its output stays): default 7 days",
    )
    p.add_argument(
        "--js-replicas",
        type=int,
        default=int(env(envvars.JS_REPLICAS, str(MasterConfig.js_replicas))),
        help="copies of the jobs stream and KV buckets (3 on a three-node NATS cluster)",
    )
    p.add_argument("--speculate-after", type=float, default=MasterConfig.speculate_after_s)
    p.add_argument(
        "--split-halves",
        type=int,
        choices=(0, 1),
        default=int(env(envvars.SPLIT_HALVES, "1")),
        help="1: cut a split's rest in two for an idle worker; 0: move it whole",
    )
    metricsserver.add_metrics_argument(p)
    p.add_argument("--log-level", default=env(envvars.LOG_LEVEL, "INFO"))
    return p.parse_args(argv)


async def amain(args: argparse.Namespace) -> int:
    config = MasterConfig(
        nats=nats_config_from_args(args),
        id=args.id,
        data_roots=args.data_root,
        leader_ttl_s=args.leader_ttl,
        js_replicas=args.js_replicas,
        job_retention_s=args.job_retention,
        speculate_after_s=args.speculate_after,
        split_halves=bool(args.split_halves),
        metrics_port=args.metrics_port,
    )
    master = ShardMaster(config)
    install_stop_signals(master.request_stop)
    try:
        await master.run()
    except (AgentExited, Deposed) as e:
        log.error("%s", e)
        return EXIT_FAILED
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logsetup.setup(args.log_level, service="shard master")
    metricsserver.serve(args.metrics_port)
    return run(amain(args))


if __name__ == "__main__":
    raise SystemExit(main())
