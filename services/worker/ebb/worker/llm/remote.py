"""An OpenAI-compatible server as the engine: one the user runs (vLLM, SGLang, `transformers
serve`, llm-d), fed over HTTP.

Up to `max_in_flight` completions are asked at once, each from a thread of one pool the engine
keeps; as one is answered the next waiting row is sent, so the server's own continuous
batching stays full. The pool is shared by the batches the stage runs at once (two for a
server: `LLMStage.concurrent_batches`): a batch's rows queue behind the one before's, and the
next batch's rows are sent as the last of the one before finish, never after it drained. A
row is sent as the token ids the stage counted (`prompt_as: ids`, the default): the server runs
exactly the tokens the stage checked against the context, and never adds its special tokens a
second time (a server given text tokenizes it again, and a chat template that writes the BOS
gets a second one: vllm#9519). A server that takes text alone (`transformers serve`) is sent
text (`prompt_as: text`) that tokenizes to the same ids: the rendered chat less the special
tokens its tokenizer adds itself. A server that counts other prompt tokens than the stage is
warned of once.

A refusal of one row (HTTP 400 and the like: a prompt the server will not take) is that row's
error; a server that cannot be reached or fails (a connection refused or cut mid-answer, a 5xx,
a timeout, a request it aborted) is asked again with backoff for up to `UNREACHABLE_S`, and
then the engine has failed: the stage makes it again and, past that, fails the batch.
"""

from __future__ import annotations

import http.client
import json
import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, CancelledError, ThreadPoolExecutor, wait
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


class _AskAgain(Exception):
    """The server answered, but not with the row's generation (it aborted the request): the
    row is asked again, as after a connection fault."""


class RemoteEngine:
    def __init__(
        self,
        model_dir: str,
        *,
        endpoint: str,
        served_model: str,
        max_in_flight: int = 32,
        prompt_as: str = "ids",
        alive: Callable[[], bool] | None = None,
    ) -> None:
        self.codec = PromptCodec(model_dir)
        self.max_context = self.codec.max_context
        self.url = endpoint.rstrip("/") + "/completions"
        self.served_model = served_model
        self.max_in_flight = max_in_flight
        self.prompt_as = prompt_as
        self.miscounted = False
        """Whether the server was seen counting a prompt's tokens otherwise than the stage."""
        self.requests_sent = 0
        """Completions asked of the server, tries included."""
        self.on_progress: Callable[[], None] | None = None
        self.in_flight = 0
        self.held_tokens = 0
        self.alive = alive
        """For a server the stage runs: whether its process lives. One that died is not
        waited for: the engine has failed at once, and the stage starts the server again."""
        self.pool = ThreadPoolExecutor(max_in_flight, thread_name_prefix="ebb-llm")
        self._gauges = threading.Lock()

    def encode(self, prompt: Prompt) -> list[int]:
        return self.codec.encode(prompt)

    def render(self, prompt: Prompt) -> str:
        """The prompt as the server is sent it with `prompt_as: text`."""
        return self.codec.server_text(prompt)

    def generate(self, requests: Iterable[GenerationRequest]) -> Iterator[Generation]:
        # Rows that share a prompt's beginning sent together, so that the server's prefix
        # cache (vLLM's, SGLang's) holds it while they run: the pool takes them in order.
        ordered = sorted(requests, key=lambda r: r.prompt_ids)
        try:
            futures = {self.pool.submit(self._asked, r): r for r in ordered}
        except RuntimeError as e:  # closed: another batch's failure made the engine again
            raise EngineError("the engine was closed") from e
        pending = set(futures)
        try:
            while pending:
                done, pending = wait(pending, return_when=FIRST_COMPLETED)
                if self.on_progress is not None:
                    self.on_progress()
                for future in done:
                    try:
                        yield future.result()
                    except RowRefused as e:
                        yield Generation(key=futures[future].key, error=str(e))
                    except CancelledError as e:
                        raise EngineError("the engine was closed") from e
        finally:
            for future in pending:  # those not begun; a request begun ends by itself
                future.cancel()

    def close(self) -> None:
        """No more requests: those queued are cancelled (their batches' engine has failed)."""
        self.pool.shutdown(wait=False, cancel_futures=True)

    def _asked(self, request: GenerationRequest) -> Generation:
        held = len(request.prompt_ids) + request.sampling.max_tokens
        with self._gauges:
            self.in_flight += 1
            self.held_tokens += held
        try:
            return self._complete(request)
        finally:
            with self._gauges:
                self.in_flight -= 1
                self.held_tokens -= held

    def _complete(self, request: GenerationRequest) -> Generation:
        s = request.sampling
        body: dict[str, Any] = {
            "model": self.served_model,
            "max_tokens": s.max_tokens,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "seed": s.seed,
        }
        if self.prompt_as == "text" and request.prompt_text:
            body["prompt"] = request.prompt_text
        else:
            body["prompt"] = request.prompt_ids
        if s.top_k:
            body["top_k"] = s.top_k  # vLLM's and SGLang's extension of the API
        if s.stop:
            body["stop"] = list(s.stop)
        if request.structure is not None:
            body.update(request.structure.request_fields())
        data = json.dumps(body).encode()
        deadline = time.monotonic() + UNREACHABLE_S
        pause = 0.5
        while True:
            try:
                return self._generation(request, self._post(data))
            except _AskAgain as e:
                problem = str(e)
            except _Unreachable as e:
                problem = str(e)
            if self.alive is not None and not self.alive():
                raise EngineError(f"the model server died: {problem}")
            if time.monotonic() + pause > deadline:
                raise EngineError(f"{self.url} did not answer for {UNREACHABLE_S:.0f} s: {problem}")
            log.info("%s: %s; asking again in %.1f s", self.url, problem, pause)
            time.sleep(pause)
            pause = min(pause * 2, 5.0)

    def _generation(self, request: GenerationRequest, reply: dict[str, Any]) -> Generation:
        try:
            choice = reply["choices"][0]
            usage = reply.get("usage") or {}
            finish = choice.get("finish_reason")
            text = str(choice["text"])
            prompt_tokens = int(usage.get("prompt_tokens", len(request.prompt_ids)))
            output_tokens = int(usage.get("completion_tokens", 0))
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise EngineError(f"{self.url} answered with no completion: {reply!r:.300}") from e
        if finish not in ("stop", "length"):
            # vLLM's `abort` (the request was dropped: the engine restarting, the server
            # stopping) and anything unknown: not a finished generation.
            raise _AskAgain(f"the server ended the row with finish_reason {finish!r}")
        if prompt_tokens != len(request.prompt_ids) and not self.miscounted:
            self.miscounted = True
            log.warning(
                "%s counted %d prompt tokens where the model's tokenizer counts %d: it "
                "tokenizes the prompt otherwise (special tokens added again?); send token ids "
                "(prompt_as: ids) to a server that takes them",
                self.url,
                prompt_tokens,
                len(request.prompt_ids),
            )
        return Generation(
            key=request.key,
            text=text,
            finish_reason=finish,
            prompt_tokens=prompt_tokens,
            output_tokens=output_tokens,
        )

    def _post(self, data: bytes) -> dict[str, Any]:
        """The server's JSON answer; `RowRefused` for a refusal of the row, `_Unreachable`
        for a fault worth asking again."""
        self.requests_sent += 1
        asked = urllib.request.Request(  # noqa: S310 - the spec admits http(s) URLs alone
            self.url, data=data, headers={"Content-Type": "application/json"}, method="POST"
        )
        try:
            with urllib.request.urlopen(asked, timeout=REQUEST_TIMEOUT_S) as response:  # noqa: S310
                answer: dict[str, Any] = json.loads(response.read())
                return answer
        except urllib.error.HTTPError as e:
            detail = e.read()[:500].decode(errors="replace")
            if 400 <= e.code < 500 and e.code not in (408, 429):
                raise RowRefused(f"the server refused the row: HTTP {e.code}: {detail}") from e
            raise _Unreachable(f"HTTP {e.code}: {detail}") from e
        # Refused, reset, timed out, cut mid-answer (IncompleteRead is not an OSError), not
        # JSON.
        except (OSError, ValueError, http.client.HTTPException) as e:
            raise _Unreachable(f"{type(e).__name__}: {e}") from e


class _Unreachable(Exception):
    """The server could not be reached or failed (not the row's fault): asked again."""
