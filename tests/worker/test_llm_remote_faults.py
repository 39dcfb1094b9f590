"""Faults of a server's answers that a real server makes only by accident, from a server
scripted here (the in-process kind the standards keep for faults): an answer cut mid-body
(`http.client.IncompleteRead`, not an `OSError`) and a request the server aborted
(vLLM's `finish_reason: abort`) are asked again, never a crash and never a row `stop`ped."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from ebb.worker.llm.engine import GenerationRequest, Sampling
from ebb.worker.llm.remote import RemoteEngine

from ..llm_model import build_tiny_llm


def _completion(finish: str) -> bytes:
    return json.dumps(
        {
            "choices": [{"index": 0, "text": " the answer", "finish_reason": finish}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2},
        }
    ).encode()


class _Scripted(http.server.BaseHTTPRequestHandler):
    """Answers each POST with the next of `script`: `cut` (a body shorter than it says),
    or a finish reason."""

    script: list[str] = []
    asked: list[dict[str, object]] = []

    def do_POST(self) -> None:
        length = int(self.headers["Content-Length"])
        self.asked.append(json.loads(self.rfile.read(length)))
        step = self.script.pop(0) if self.script else "stop"
        body = _completion("stop" if step == "cut" else step)
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body[:10] if step == "cut" else body)
        self.wfile.flush()
        self.close_connection = True

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def scripted() -> Iterator[str]:
    _Scripted.asked = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Scripted)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llm(tmp_path_factory.mktemp("llm") / "tiny")


def test_a_cut_answer_and_an_aborted_request_are_asked_again(scripted: str, tiny_llm: Path) -> None:
    _Scripted.script = ["cut", "abort", "stop"]
    engine = RemoteEngine(str(tiny_llm), endpoint=scripted, served_model="m", max_in_flight=1)
    request = GenerationRequest(key=7, prompt_ids=[5, 6, 7], sampling=Sampling(max_tokens=4))
    [generation] = list(engine.generate([request]))
    assert generation.error is None
    assert (generation.key, generation.text, generation.finish_reason) == (7, " the answer", "stop")
    assert engine.requests_sent == 3
    # Sent as the token ids the stage counted, not as text the server tokenizes again.
    assert all(asked["prompt"] == [5, 6, 7] for asked in _Scripted.asked)
    engine.close()
