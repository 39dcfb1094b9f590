"""The shard master's exceptions. Each maps to a stable error code in replies."""

from __future__ import annotations

from typing import ClassVar

from ebb.common import lifecycle
from ebb.common.errors import EbbError, ErrorCode


class MasterError(EbbError):
    code: ClassVar[ErrorCode] = ErrorCode.INTERNAL


class BadRequest(MasterError):
    code = ErrorCode.BAD_REQUEST


class StaleToken(MasterError):
    """The token is not a current lease: expired, released, superseded or from a zombie."""

    code = ErrorCode.STALE_TOKEN


class NotHolder(MasterError):
    """A current lease token, used by a worker other than the one it was granted to."""

    code = ErrorCode.NOT_HOLDER


class JobNotFound(MasterError):
    code = ErrorCode.NOT_FOUND


class JobEnded(MasterError):
    """The job reached a terminal state; its leases are void."""

    code = ErrorCode.JOB_ENDED


class NotResumable(MasterError):
    """`resume` of a job that is running, succeeded, or never got as far as its shards."""

    code = ErrorCode.NOT_RESUMABLE


class NoCommitRecord(MasterError):
    """`commit` came before the shard's commit record exists in the output."""

    code = ErrorCode.NO_COMMIT_RECORD


class ForeignCommit(MasterError):
    """The shard's commit record belongs to another job (a straggler of a job that wrote into
    the same output root before). Records are never replaced, so no attempt of this job can
    commit the shard: it is quarantined."""

    code = ErrorCode.QUARANTINED


class PlanningError(MasterError):
    """The input cannot be split into shards (missing, unreadable, empty)."""

    code = ErrorCode.BAD_REQUEST


class MissingColumns(PlanningError):
    """A file of the input lacks columns the job reads."""

    def __init__(self, path: str, missing: list[str], names: list[str]) -> None:
        super().__init__(f"{path} has no column(s) {missing}; it has {names}")
        self.path = path
        self.missing = missing
        self.names = names


class OutputTaken(PlanningError):
    """The output root belongs to another job."""


class IllegalTransition(MasterError, lifecycle.IllegalTransition):
    """A shard or a job was about to make a move section 4 of the design does not allow: a bug
    in the master, refused before anything is written."""


class Deposed(MasterError):
    """Another master wrote the state we hold: we are no longer the only writer. Stop now."""

    code = ErrorCode.NOT_LEADER


class StoreUnavailable(MasterError):
    """The state store could not be read (NATS down, a stream electing its leader). Nothing
    was written: the request may be asked again."""

    code = ErrorCode.UNAVAILABLE


class StateUnsure(Deposed):
    """A write to the state store may or may not have landed (its answer was lost: a timeout,
    a connection dropped mid-request), or a transition was half written (a split's part is
    DONE in KV, its remainder's record could not be created): what this master holds in
    memory may no longer be what KV says. Carrying on from memory would hand out what KV has
    given away already (a shard's index, a lease), so, like a deposition, it ends this round;
    the master campaigns again and loads the table from KV, which completes the transition
    (`transitions.missing_successors`)."""


class TableCorrupt(MasterError):
    """A job's shard records contradict each other (a shard two records name as their
    successor, which a master before indexes came from a counter could write after a lost
    answer): finishing it would list rows twice and lose others. The job fails, saying so."""
