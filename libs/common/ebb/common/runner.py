"""Running a service's main coroutine: uvloop when available, exit codes that mean something."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_CONFIG = 3
"""The job or service configuration is wrong: relaunching will not help."""
EXIT_SETUP = 4
"""A worker could not start its job's pipeline here (a model that would not load, a device
that would not open): the node's fault until workers fail so on several nodes."""

GRACE_S = 30.0
"""Between a worker's SIGTERM and its SIGKILL, unless configured otherwise: Kubernetes' own
default (terminationGracePeriodSeconds), the one default of every part that stops workers or
is one (the controller, its local backend and reconciler, the embedded stack, the worker)."""


def run(main: Coroutine[Any, Any, int]) -> int:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency, but not on every platform
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)
