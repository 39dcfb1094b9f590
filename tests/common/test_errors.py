"""What an error reply tells its requester: one table, read where the reply comes in."""

from __future__ import annotations

import pytest

from ebb.common.errors import ERROR_KINDS, ErrorCode, ErrorKind, RemoteError
from ebb.common.messaging import bus
from ebb.common.messaging.messages import RenewReply


def test_every_code_has_a_kind() -> None:
    assert set(ERROR_KINDS) == set(ErrorCode)


@pytest.mark.parametrize(
    ("code", "retryable", "lease_lost"),
    [
        (ErrorCode.UNAVAILABLE, True, False),
        (ErrorCode.NOT_LEADER, True, False),
        (ErrorCode.INTERNAL, True, False),
        (ErrorCode.BAD_REPLY, True, False),
        (ErrorCode.NO_COMMIT_RECORD, True, False),
        (ErrorCode.STALE_TOKEN, False, True),
        (ErrorCode.NOT_HOLDER, False, True),
        (ErrorCode.JOB_ENDED, False, True),
        (ErrorCode.NOT_FOUND, False, True),
        (ErrorCode.QUARANTINED, False, True),
        (ErrorCode.BAD_REQUEST, False, False),
        (ErrorCode.REJECTED, False, False),
        (ErrorCode.NOT_RESUMABLE, False, False),
        (ErrorCode.TOO_LARGE, False, False),
        ("a_code_from_a_newer_peer", False, False),
    ],
)
def test_the_kind_of_each_code(code: str, retryable: bool, lease_lost: bool) -> None:
    error = RemoteError(code, "why")
    assert (error.retryable, error.lease_lost) == (retryable, lease_lost)


def test_a_reply_is_classified_as_it_is_parsed() -> None:
    with pytest.raises(RemoteError) as e:
        bus.parse_reply(bus.error_reply(ErrorCode.STALE_TOKEN, "superseded"), RenewReply)
    assert e.value.lease_lost and e.value.kind is ErrorKind.LEASE_LOST
    with pytest.raises(RemoteError) as e:
        bus.parse_reply(b"not json", RenewReply)
    assert e.value.code == ErrorCode.BAD_REPLY and e.value.retryable
