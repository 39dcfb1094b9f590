"""The exceptions every part of Ebb shares.

Each service keeps a small tree of its own under `EbbError`; these are the ones that cross
the boundaries between the parts (a bad message, a bad spec, an error a peer answered with).
"""

from __future__ import annotations


class EbbError(Exception):
    """Root of every exception Ebb raises on purpose."""


class SchemaError(EbbError, ValueError):
    """A value does not match its schema. `path` says where, e.g. `pipeline.stages[1].workers`."""

    def __init__(self, path: str, problem: str) -> None:
        self.path = path
        self.problem = problem
        super().__init__(f"{path}: {problem}" if path else problem)


class SpecError(SchemaError):
    """A job spec is invalid: bad field, bad value, a URI outside the allowed roots."""


class RemoteError(EbbError):
    """A peer answered a request with an error. `code` is stable and machine-readable."""

    def __init__(self, code: str, message: str) -> None:
        self.code = code
        self.message = message
        super().__init__(f"{code}: {message}")


class BusError(EbbError):
    """NATS could not be reached, or did not answer in time, after the retries allowed."""
