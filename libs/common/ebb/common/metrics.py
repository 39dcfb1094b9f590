"""Prometheus metrics: every name starts with `ebb_`; each service serves its own `/metrics`."""

from __future__ import annotations

import logging
import os
from typing import Any

from prometheus_client import start_http_server

from . import envvars

log = logging.getLogger(__name__)


def serve(port: int | None, *, addr: str = "0.0.0.0") -> int | None:  # noqa: S104
    """Serve /metrics on `port` (0: any free port). None disables it. Returns the bound port."""
    if port is None:
        return None
    server, _thread = start_http_server(port, addr=addr)
    bound = int(server.server_address[1])
    log.info("metrics on http://%s:%d/metrics", addr, bound)
    return bound


def add_metrics_argument(parser: Any) -> None:
    """`--metrics-port`, defaulting to EBB_METRICS_PORT (unset: no metrics endpoint)."""
    default = os.environ.get(envvars.METRICS_PORT)
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=int(default) if default else None,
        help="serve /metrics on this port (default: EBB_METRICS_PORT, else none)",
    )
