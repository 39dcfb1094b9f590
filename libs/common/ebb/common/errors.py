"""The exceptions every part of Ebb shares.

Each service keeps a small tree of its own under `EbbError`; these are the ones that cross
the boundaries between the parts (a bad message, a bad spec, an error a peer answered with).
"""

from __future__ import annotations

from enum import StrEnum


class ErrorCode(StrEnum):
    """The stable, machine-readable codes of error replies, one list for every part.

    On the wire a code is a plain string (a peer may know codes this one does not); every
    raiser and every reader names them from here."""

    BAD_REQUEST = "bad_request"
    """The request (or the job it names) is malformed or invalid: retrying will not help."""
    NOT_FOUND = "not_found"
    """No such job."""
    REJECTED = "rejected"
    """The job was refused at submission; the message says why."""
    STALE_TOKEN = "stale_token"  # noqa: S105 - a code, not a secret
    """The lease token is no longer current: expired, released, superseded, or a zombie's."""
    NOT_HOLDER = "not_holder"
    """The lease token was granted to another worker than the one asking: refused, nothing
    changed (a worker may renew, commit or release only its own leases)."""
    JOB_ENDED = "job_ended"
    """The job reached a terminal state; its leases are void."""
    NO_COMMIT_RECORD = "no_commit_record"
    """`commit` came before the shard's commit record could be read: try again."""
    QUARANTINED = "quarantined"
    """The shard can never be committed by this job (another job's commit record holds it)."""
    NOT_RESUMABLE = "not_resumable"
    """`resume` of a job that is not FAILED or CANCELLED (or never got as far as its shards)."""
    NOT_LEADER = "not_leader"
    """The master answering is not (or no longer) the leader."""
    UNAVAILABLE = "unavailable"
    """The master's state store cannot be reached right now."""
    TOO_LARGE = "too_large"
    """The reply would exceed the server's max payload: ask for less."""
    BAD_REPLY = "bad_reply"
    """Raised by the requester itself: the reply it got does not match its schema."""
    INTERNAL = "internal"
    """A bug in the peer."""


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
    """A peer answered a request with an error. `code` is stable and machine-readable: one
    of ErrorCode's, or one this version does not know yet."""

    def __init__(self, code: str, message: str) -> None:
        self.code = code
        self.message = message
        super().__init__(f"{code}: {message}")


class BusError(EbbError):
    """NATS could not be reached, or did not answer in time, after the retries allowed."""
