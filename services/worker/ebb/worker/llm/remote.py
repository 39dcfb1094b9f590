"""An OpenAI-compatible server as the engine: one the user runs (vLLM, SGLang, `transformers
serve`, llm-d), fed over HTTP.

Up to `max_in_flight` completions are asked at once, each from a thread of its own; as one is
answered the next waiting row is sent, so the server's own continuous batching stays full. A
row is sent as text (a chat rendered with the model's template here: the server and the stage
count the same tokens). A refusal of one row (HTTP 400 and the like: a prompt the server will
not take) is that row's error; a server that cannot be reached or fails (a connection refused,
a 5xx, a timeout) is asked again with backoff for up to `UNREACHABLE_S`, and then the engine
has failed: the stage makes it again and, past that, fails the batch.
"""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

from .engine import EngineError, Generation, GenerationRequest
from .prompts import Prompt, PromptCodec

log = logging.getLogger(__name__)

UNREACHABLE_S = 60.0
"""How long one request keeps asking a server that does not answer before the engine fails."""
REQUEST_TIMEOUT_S = 600.0
"""The longest one completion may take once the server has it."""


class RowRefused(Exception):
    """The server refused this request alone (a 4xx): its row is an error row."""


class RemoteEngine:
    def __init__(
        self,
        model_dir: str,
        *,
        endpoint: str,
        served_model: str,
        max_in_flight: int = 32,
        alive: Callable[[], bool] | None = None,
    ) -> None:
        self.codec = PromptCodec(model_dir)
        self.max_context = self.codec.max_context
        self.url = endpoint.rstrip("/") + "/completions"
        self.served_model = served_model
        self.max_in_flight = max_in_flight
        self.requests_sent = 0
        """Completions asked of the server, tries included."""
        self.on_progress: Callable[[], None] | None = None
        self.in_flight = 0
        self.held_tokens = 0
        self.alive = alive
        """For a server the stage runs: whether its process lives. One that died is not
        waited for: the engine has failed at once, and the stage starts the server again."""

    def encode(self, prompt: Prompt) -> list[int]:
        return self.codec.encode(prompt)

    def render(self, prompt: Prompt) -> str:
        return self.codec.render(prompt)

    def generate(self, requests: Iterable[GenerationRequest]) -> Iterator[Generation]:
        # Rows that share a prompt's beginning sent together, so that the server's prefix
        # cache (vLLM's, SGLang's) holds it while they run; popped from the end.
        waiting = sorted(requests, key=lambda r: r.prompt_ids, reverse=True)
        with ThreadPoolExecutor(self.max_in_flight, thread_name_prefix="ebb-llm") as pool:
            running: dict[Future[Generation], GenerationRequest] = {}
            try:
                while waiting or running:
                    while waiting and len(running) < self.max_in_flight:
                        request = waiting.pop()
                        running[pool.submit(self._complete, request)] = request
                    self.in_flight = len(running)
                    self.held_tokens = sum(
                        len(r.prompt_ids) + r.sampling.max_tokens for r in running.values()
                    )
                    done, _ = wait(running, return_when=FIRST_COMPLETED)
                    if self.on_progress is not None:
                        self.on_progress()
                    for future in done:
                        request = running.pop(future)
                        try:
                            yield future.result()
                        except RowRefused as e:
                            yield Generation(key=request.key, error=str(e))
            finally:
                for future in running:
                    future.cancel()

    def _complete(self, request: GenerationRequest) -> Generation:
        s = request.sampling
        body: dict[str, Any] = {
            "model": self.served_model,
            # Token ids (a tokenize_only stage's) as they are: the API takes either.
            "prompt": request.prompt_text or request.prompt_ids,
            "max_tokens": s.max_tokens,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "seed": s.seed,
        }
        if s.top_k:
            body["top_k"] = s.top_k  # vLLM's and SGLang's extension of the API
        if s.stop:
            body["stop"] = list(s.stop)
        if request.structure is not None:
            body.update(request.structure.request_fields())
        reply = self._post(body)
        try:
            choice = reply["choices"][0]
            usage = reply.get("usage") or {}
            finish = choice.get("finish_reason")
            return Generation(
                key=request.key,
                text=str(choice["text"]),
                finish_reason="length" if finish == "length" else "stop",
                prompt_tokens=int(usage.get("prompt_tokens", len(request.prompt_ids))),
                output_tokens=int(usage.get("completion_tokens", 0)),
            )
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise EngineError(f"{self.url} answered with no completion: {reply!r:.300}") from e

    def _post(self, body: dict[str, Any]) -> dict[str, Any]:
        data = json.dumps(body).encode()
        deadline = time.monotonic() + UNREACHABLE_S
        pause = 0.5
        while True:
            self.requests_sent += 1
            http = urllib.request.Request(  # noqa: S310 - the spec admits http(s) URLs alone
                self.url, data=data, headers={"Content-Type": "application/json"}, method="POST"
            )
            try:
                with urllib.request.urlopen(http, timeout=REQUEST_TIMEOUT_S) as response:  # noqa: S310
                    answer: dict[str, Any] = json.loads(response.read())
                    return answer
            except urllib.error.HTTPError as e:
                detail = e.read()[:500].decode(errors="replace")
                if 400 <= e.code < 500 and e.code not in (408, 429):
                    raise RowRefused(f"the server refused the row: HTTP {e.code}: {detail}") from e
                problem = f"HTTP {e.code}: {detail}"
            except (OSError, ValueError) as e:  # refused, reset, timed out, not JSON
                problem = f"{type(e).__name__}: {e}"
            if self.alive is not None and not self.alive():
                raise EngineError(f"the model server died: {problem}")
            if time.monotonic() + pause > deadline:
                raise EngineError(f"{self.url} did not answer for {UNREACHABLE_S:.0f} s: {problem}")
            log.info("%s: %s; asking again in %.1f s", self.url, problem, pause)
            time.sleep(pause)
            pause = min(pause * 2, 5.0)
