"""Logging for services: one line per record, key facts first, to stderr."""

from __future__ import annotations

import logging
import os
import sys

from . import envvars

FORMAT = "%(asctime)s %(levelname)-5s %(name)s[%(process)d] %(message)s"


def setup(level: str | None = None, *, service: str = "") -> None:
    """Configure the root logger once, at a service's entrypoint (never in library code)."""
    chosen = (level or os.environ.get(envvars.LOG_LEVEL) or "INFO").upper()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(chosen)
    # nats-py logs every reconnect attempt at ERROR; our callbacks say it once, better.
    logging.getLogger("nats").setLevel(logging.CRITICAL)
    if service:
        logging.getLogger("ebb").info("%s starting (log level %s)", service, chosen)
