"""`python -m ebb.gateway --config gateway.yaml`: serve the Batch API until SIGTERM."""

from __future__ import annotations

import argparse
import logging
import os

from ebb.common import envvars
from ebb.common import log as logsetup
from ebb.common import metrics as metricsserver
from ebb.common.errors import SpecError
from ebb.common.messaging.natsconfig import add_nats_arguments, nats_config_from_args
from ebb.common.runner import EXIT_CONFIG, EXIT_OK, run
from ebb.common.supervisor import install_stop_signals

from .config import load_config
from .service import Gateway, GatewaySettings

log = logging.getLogger("ebb.gateway")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    env = os.environ.get
    p = argparse.ArgumentParser(prog="python -m ebb.gateway", description=__doc__)
    add_nats_arguments(p)
    p.add_argument(
        "--config",
        default=env(envvars.GATEWAY_CONFIG),
        required=env(envvars.GATEWAY_CONFIG) is None,
        help="the catalogue, keys and limits (YAML); default EBB_GATEWAY_CONFIG",
    )
    p.add_argument("--host", default=env(envvars.GATEWAY_HOST, "127.0.0.1"))
    p.add_argument("--port", type=int, default=int(env(envvars.GATEWAY_PORT, "8080")))
    p.add_argument(
        "--poll", type=float, default=5.0, help="seconds between full passes over the batches"
    )
    p.add_argument(
        "--js-replicas",
        type=int,
        default=int(env(envvars.JS_REPLICAS, "1")),
        help="copies of the gateway's KV buckets (3 on a three-node NATS cluster)",
    )
    metricsserver.add_metrics_argument(p)
    p.add_argument("--log-level", default=env(envvars.LOG_LEVEL, "INFO"))
    return p.parse_args(argv)


async def amain(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config)
    except SpecError as e:
        log.error("bad gateway configuration: %s", e)
        return EXIT_CONFIG
    gateway = Gateway(
        GatewaySettings(
            nats=nats_config_from_args(args),
            config=config,
            host=args.host,
            port=args.port,
            poll_s=args.poll,
            js_replicas=args.js_replicas,
        )
    )
    install_stop_signals(gateway.request_stop)
    await gateway.run()
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logsetup.setup(args.log_level, service="gateway")
    metricsserver.serve(args.metrics_port)
    return run(amain(args))


if __name__ == "__main__":
    raise SystemExit(main())
