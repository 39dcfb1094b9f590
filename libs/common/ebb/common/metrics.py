"""Prometheus metrics and health: every metric name starts with `ebb_`; each service serves
its own `/metrics`, and beside it `/healthz` (the process answers: alive) and `/readyz` (the
service can do its work now: connected to NATS, its role known), for Kubernetes' probes."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import make_server

from prometheus_client import make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer, _SilentHandler

from . import envvars

log = logging.getLogger(__name__)


Readiness = Callable[[], tuple[bool, str]]
"""(ready?, in a few words why: "leading", "NATS not connected"...)."""

_readiness: list[Readiness] = [lambda: (False, "starting")]


def set_readiness(check: Readiness) -> None:
    """What /readyz asks from now on."""
    _readiness[0] = check


def _app(metrics: Any) -> Any:
    def app(environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/healthz":
            status, body = "200 OK", "alive"
        elif path == "/readyz":
            try:
                ready, body = _readiness[0]()
            except Exception as e:  # noqa: BLE001 - a probe that fails says not ready, and why
                ready, body = False, f"readiness check failed: {e!r}"
            status = "200 OK" if ready else "503 Service Unavailable"
        else:
            result: Iterable[bytes] = metrics(environ, start_response)
            return result
        start_response(status, [("Content-Type", "text/plain; charset=utf-8")])
        return [body.encode() + b"\n"]

    return app


def serve(port: int | None, *, addr: str = "0.0.0.0") -> int | None:  # noqa: S104
    """Serve /metrics, /healthz and /readyz on `port` (0: any free port), from a thread of
    its own. None disables it. Returns the bound port."""
    if port is None:
        return None
    server = make_server(
        addr, port, _app(make_wsgi_app()), ThreadingWSGIServer, handler_class=_SilentHandler
    )
    threading.Thread(target=server.serve_forever, name="ebb-metrics", daemon=True).start()
    bound = int(server.server_address[1])
    log.info("metrics on http://%s:%d/metrics (and /healthz, /readyz)", addr, bound)
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
