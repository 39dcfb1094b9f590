"""The shard master's exceptions. Each maps to a stable error code in replies."""

from __future__ import annotations

from ebb.common.errors import EbbError


class MasterError(EbbError):
    code = "internal"


class BadRequest(MasterError):
    code = "bad_request"


class StaleToken(MasterError):
    """The token is not a current lease: expired, released, superseded or from a zombie."""

    code = "stale_token"


class JobNotFound(MasterError):
    code = "not_found"


class JobEnded(MasterError):
    """The job reached a terminal state; its leases are void."""

    code = "job_ended"


class NoCommitRecord(MasterError):
    """`commit` came before the shard's commit record exists in the output."""

    code = "no_commit_record"


class ForeignCommit(MasterError):
    """The shard's commit record belongs to another job (a straggler of a job that wrote into
    the same output root before). Records are never replaced, so no attempt of this job can
    commit the shard: it is quarantined."""

    code = "quarantined"


class PlanningError(MasterError):
    """The input cannot be split into shards (missing, unreadable, empty)."""

    code = "bad_request"


class OutputTaken(PlanningError):
    """The output root belongs to another job."""


class IllegalTransition(MasterError):
    """A shard was about to make a move section 4 of the design does not allow: a bug in the
    master, refused before anything is written."""


class Deposed(MasterError):
    """Another master wrote the state we hold: we are no longer the only writer. Stop now."""

    code = "not_leader"
