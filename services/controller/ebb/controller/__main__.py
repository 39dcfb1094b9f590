"""`python -m ebb.controller`: reconcile workers against running jobs until SIGTERM."""

from __future__ import annotations

import argparse
import logging
import os

from ebb.common import log as logsetup
from ebb.common import metrics as metricsserver
from ebb.common.bus import add_nats_arguments, nats_config_from_args
from ebb.common.runner import EXIT_FAILED, EXIT_OK, EXIT_USAGE, run
from ebb.common.supervisor import AgentExited, install_stop_signals

from .local import LocalBackend, LocalConfig
from .reconcile import ReconcilerConfig
from .service import Controller, ControllerConfig

log = logging.getLogger("ebb.controller")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    env = os.environ.get
    p = argparse.ArgumentParser(prog="python -m ebb.controller", description=__doc__)
    p.add_argument("--backend", choices=["local"], default=env("EBB_BACKEND", "local"))
    add_nats_arguments(p)
    p.add_argument("--max-workers", type=int, default=int(env("EBB_MAX_WORKERS", "0")) or None)
    p.add_argument("--log-dir", default=env("EBB_WORKER_LOG_DIR"))
    p.add_argument("--worker-grace", type=float, default=30.0)
    p.add_argument("--resync", type=float, default=2.0)
    p.add_argument("--metrics-port", type=int, default=None)
    p.add_argument("--log-level", default=env("EBB_LOG_LEVEL", "INFO"))
    return p.parse_args(argv)


async def amain(args: argparse.Namespace) -> int:
    nats = nats_config_from_args(args)
    if args.backend != "local":  # pragma: no cover - argparse restricts the choices
        return EXIT_USAGE
    local = LocalConfig(nats=nats, log_dir=args.log_dir)
    if args.max_workers:
        local = LocalConfig(nats=nats, log_dir=args.log_dir, max_workers=args.max_workers)
    controller = Controller(
        ControllerConfig(
            nats=nats,
            resync_s=args.resync,
            reconciler=ReconcilerConfig(worker_grace_s=args.worker_grace),
            shutdown_grace_s=args.worker_grace,
        ),
        LocalBackend(local),
    )
    install_stop_signals(controller.request_stop)
    try:
        await controller.run()
    except AgentExited as e:
        log.error("%s", e)
        return EXIT_FAILED
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logsetup.setup(args.log_level, service="controller")
    metricsserver.serve(args.metrics_port)
    return run(amain(args))


if __name__ == "__main__":
    raise SystemExit(main())
