"""How a local worker's end reads: its exit code as a kind of failure and a reason, and the
evidence it left (its termination message, or the tail of its log).

The local backend's counterpart of ebb.controller.policy.failures, which reads a pod's status."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from ebb.common.runner import EXIT_CONFIG, EXIT_SETUP

from ..policy.failures import Kind

KILLED_FROM_OUTSIDE = frozenset({signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP})
"""Signals a process gets from someone else; one that crashes raises others (SIGSEGV...)."""
DRAINED = frozenset({0, -signal.SIGTERM})
"""How a worker told to go (SIGTERM) ends when it goes as told: it drained and exited 0, or
the signal ended it before it could take it as "drain" (while it was starting)."""


def failure_kind(code: int) -> Kind | None:
    """As on Kubernetes: the worker says its job's configuration cannot work, or that its
    pipeline cannot start here; a worker killed from outside (an operator, a machine short
    of memory, a spot reclaim) did nothing wrong itself. Any other end is a crash."""
    if code == EXIT_CONFIG:
        return "fatal"
    if code == EXIT_SETUP:
        return "setup"
    if -code in KILLED_FROM_OUTSIDE:
        return "capacity"
    return None


def describe(code: int) -> str:
    """An exit code (a returncode: negative for a signal) in words."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def reason(code: int, said: str) -> str:
    """Why a worker ended: its exit code in words, then what it said, if anything."""
    return describe(code) + (f": {said}" if said else "")


def evidence(code: int, *, termination_log: Path | None, log: Path | None) -> str:
    """What a worker that ended with `code` left to say why: its termination message; failing
    that, for one that exited with an error code (not killed by a signal), the last lines of
    its log. Empty: nothing."""
    said = _read_termination_message(termination_log)
    if not said and code > 0 and log is not None:
        said = _tail(log)
    return said


def _read_termination_message(path: Path | None) -> str:
    """What the worker wrote at `path` about why it gave up (as a pod's
    terminationMessagePath)."""
    if path is None:
        return ""
    try:
        return path.read_text(errors="replace").strip()
    except OSError:  # it had nothing to say
        return ""


def _tail(path: Path, *, lines: int = 5, limit: int = 800) -> str:
    """The last lines a worker wrote (the evidence of why it crashed), in one line."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 16 * 1024))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    last = [line.strip() for line in text.splitlines() if line.strip()][-lines:]
    return " | ".join(last)[-limit:]
