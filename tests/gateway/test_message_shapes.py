"""A Message Batch's shapes from the batch's record and lines (pure): each kind of result
line, and the request counts of a batch that ended each way."""

from __future__ import annotations

from ebb.gateway.messages import message_batch
from ebb.gateway.records import BatchRecord
from ebb.gateway.results import anthropic_result


def record(**changes: object) -> BatchRecord:
    fields: dict[str, object] = {
        "id": "msgbatch_1",
        "owner": "alice",
        "endpoint": "/v1/messages",
        "input_file_id": "file-1",
        "completion_window": "24h",
        "status": "completed",
        "created_at": 1_795_000_000,
        "expires_at": 1_795_086_400,
        "total": 10,
        "completed": 4,
        "failed": 6,
        "unrun": 5,
        "completed_at": 1_795_000_100,
    }
    return BatchRecord(**{**fields, **changes})  # type: ignore[arg-type]


def test_the_requests_a_batch_ended_before_are_counted_as_it_ended() -> None:
    def counts(**changes: object) -> dict[str, int]:
        found: dict[str, int] = message_batch(record(**changes), "http://gw")["request_counts"]
        return found

    assert counts(ending="cancelled", status="cancelled") == {
        "processing": 0,
        "succeeded": 4,
        "errored": 1,
        "canceled": 5,
        "expired": 0,
    }
    assert counts(ending="expired", status="expired")["expired"] == 5
    assert counts(status="failed")["errored"] == 6  # a failed job's: errored
    running = message_batch(record(status="in_progress", completed=3, failed=1, unrun=0), "x")
    assert running["processing_status"] == "in_progress" and running["results_url"] is None
    assert running["request_counts"]["processing"] == 6
    ended = message_batch(record(), "http://gw")
    assert ended["processing_status"] == "ended"
    assert ended["results_url"] == "http://gw/v1/messages/batches/msgbatch_1/results"
    assert ended["created_at"] == "2026-11-18T11:06:40Z"  # RFC 3339, UTC


def test_each_line_becomes_its_result() -> None:
    answered = {
        "custom_id": "a",
        "response": {
            "status_code": 200,
            "request_id": "req_abc",
            "body": {
                "model": "m",
                "choices": [{"message": {"content": "hi"}, "finish_reason": "length"}],
                "usage": {"prompt_tokens": 5, "completion_tokens": 2},
            },
        },
    }
    message = anthropic_result(answered)["result"]["message"]
    assert message["id"] == "msg_abc" and message["content"] == [{"type": "text", "text": "hi"}]
    assert message["stop_reason"] == "max_tokens" and message["usage"]["input_tokens"] == 5
    refused = {
        "custom_id": "b",
        "response": {"status_code": 404, "body": {"error": {"message": "no such model"}}},
    }
    assert anthropic_result(refused)["result"]["error"]["error"] == {
        "type": "not_found_error",
        "message": "no such model",
    }
    for code, kind in (("batch_cancelled", "canceled"), ("batch_expired", "expired")):
        unrun = {"custom_id": "c", "response": None, "error": {"code": code, "message": "x"}}
        assert anthropic_result(unrun) == {"custom_id": "c", "result": {"type": kind}}
    failed = {"custom_id": "d", "response": None, "error": {"code": "batch_failed", "message": "x"}}
    assert anthropic_result(failed)["result"]["error"]["error"]["type"] == "api_error"
