"""The exceptions every part of Ebb shares.

Each service keeps a small tree of its own under `EbbError`; these are the ones that cross
the boundaries between the parts (a bad message, a bad spec, an error a peer answered with).
"""

from __future__ import annotations

from enum import Enum, StrEnum


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


class ErrorKind(Enum):
    """What an error reply tells its requester to do."""

    RETRY = "retry"
    """Not now: the master is restarting or failing over, its store timed out, or (on an
    eventually consistent object store) it cannot see a commit record yet. Ask again."""
    LEASE_LOST = "lease_lost"
    """Said of a lease (to a renew, commit or release): it is no longer the asker's. Let it go;
    asking again will not bring it back."""
    REFUSED = "refused"
    """The request itself is refused: asking again gets the same answer."""


ERROR_KINDS: dict[str, ErrorKind] = {
    ErrorCode.BAD_REQUEST: ErrorKind.REFUSED,
    ErrorCode.NOT_FOUND: ErrorKind.LEASE_LOST,
    ErrorCode.REJECTED: ErrorKind.REFUSED,
    ErrorCode.STALE_TOKEN: ErrorKind.LEASE_LOST,
    ErrorCode.NOT_HOLDER: ErrorKind.LEASE_LOST,
    ErrorCode.JOB_ENDED: ErrorKind.LEASE_LOST,
    ErrorCode.NO_COMMIT_RECORD: ErrorKind.RETRY,
    ErrorCode.QUARANTINED: ErrorKind.LEASE_LOST,
    ErrorCode.NOT_RESUMABLE: ErrorKind.REFUSED,
    ErrorCode.NOT_LEADER: ErrorKind.RETRY,
    ErrorCode.UNAVAILABLE: ErrorKind.RETRY,
    ErrorCode.TOO_LARGE: ErrorKind.REFUSED,
    ErrorCode.BAD_REPLY: ErrorKind.RETRY,
    ErrorCode.INTERNAL: ErrorKind.RETRY,
}
"""Every code's kind. A code this version does not know (a newer peer's) is REFUSED: nothing
says that asking again could help."""


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

    @property
    def kind(self) -> ErrorKind:
        return ERROR_KINDS.get(self.code, ErrorKind.REFUSED)

    @property
    def retryable(self) -> bool:
        """The same request may succeed later (ErrorKind.RETRY)."""
        return self.kind is ErrorKind.RETRY

    @property
    def lease_lost(self) -> bool:
        """The lease the request named is no longer the asker's (ErrorKind.LEASE_LOST)."""
        return self.kind is ErrorKind.LEASE_LOST


class BusError(EbbError):
    """NATS could not be reached, or did not answer in time, after the retries allowed."""
