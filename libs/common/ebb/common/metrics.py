"""Prometheus metrics: every name starts with `ebb_`; each service serves its own `/metrics`."""

from __future__ import annotations

import logging

from prometheus_client import start_http_server

log = logging.getLogger(__name__)


def serve(port: int | None, *, addr: str = "0.0.0.0") -> int | None:  # noqa: S104
    """Serve /metrics on `port` (0: any free port). None disables it. Returns the bound port."""
    if port is None:
        return None
    server, _thread = start_http_server(port, addr=addr)
    bound = int(server.server_address[1])
    log.info("metrics on http://%s:%d/metrics", addr, bound)
    return bound
