"""vLLM's engine in the stage's own process (`engine: vllm`): its offline `LLM`, fed
continuously by a step loop of the stage's.

Every batch's requests go into vLLM's queue as soon as the stage has them (`LLM.enqueue`), and
a thread of this engine steps vLLM (`LLMEngine.step`) while any is unfinished, handing each
finished request to its batch: vLLM's own scheduler (continuous batching, chunked prefill,
the prefix cache) runs every row of the stage's batches at once, never drained between them,
with no HTTP hop, no port and no process of its own. Measured on a CPU against the same vLLM
as a server fed by a plain client at its best concurrency (docs/benchmarks.md, section 21).

Rows are sent as the token ids the stage counted (no special token added again), with their
own sampling: the seed of a sampled row is its own, so a row retried generates the same text.
A structured row goes with the regex the stage's shape became (vLLM's structured outputs),
as to a server. vLLM needs to be installed in the worker's environment (`pip install vllm`,
or vLLM's CPU build); `engine_args` are given to `vllm.LLM` as they are.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from .engine import Call, EngineError, Generation, GenerationRequest, StepLoop
from .prompts import Prompt, PromptCodec

ABORTS = 3
"""Times one request vLLM aborted is sent again before the engine has failed."""


class VLLMEngine(StepLoop):
    loop_name = "ebb:vllm"

    def __init__(
        self,
        model_dir: str,
        *,
        dtype: str | None = None,
        max_in_flight: int = 256,
        engine_args: dict[str, Any] | None = None,
    ) -> None:
        # vLLM's engine core in this very process, not a process of its own (unless the
        # worker's environment says otherwise): on a CPU 1.3-1.5x the tokens/s of a core in
        # a process of its own, loaded in 2 s where vLLM's server takes 27 (docs/benchmarks.md
        # section 21), and no engine process is left behind when the stage is killed.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        try:
            from vllm import LLM
        except ImportError as e:
            raise EngineError(
                f"engine: vllm needs vLLM in the worker's environment (pip install vllm): {e}"
            ) from e
        self.codec = PromptCodec(model_dir)
        args: dict[str, Any] = {
            "model": model_dir,
            "dtype": dtype or "auto",
            "max_num_seqs": max_in_flight,
            **(engine_args or {}),
        }
        try:
            self.llm: Any = LLM(**args)
        except Exception as e:  # vLLM raises many kinds when it cannot start
            raise EngineError(
                f"vLLM could not start on {model_dir}: {type(e).__name__}: {e}"
            ) from e
        model_length = int(self.llm.llm_engine.model_config.max_model_len)
        self.max_context = min(self.codec.max_context, model_length)
        self.on_progress: Callable[[], None] | None = None
        self.in_flight = 0
        self.held_tokens = 0
        super().__init__()
        self._new: list[tuple[GenerationRequest, Call]] = []
        self._sending: list[Call] = []
        """The calls of the requests being handed to vLLM."""
        self._running: dict[str, tuple[GenerationRequest, Call, int]] = {}
        """By the request's id as vLLM's outputs name it: the request, its call, its aborts."""
        self._internal: dict[str, str] = {}
        """The id vLLM's engine keeps for each (what `abort_request` takes)."""
        self._per_call: dict[Call, int] = {}
        """Requests of each call in vLLM: a cancelled call is found among a few, each step."""

    def encode(self, prompt: Prompt) -> list[int]:
        return self.codec.encode(prompt)

    def render(self, prompt: Prompt) -> str:
        return self.codec.render(prompt)

    def generate(self, requests: Iterable[GenerationRequest]) -> Iterator[Generation]:
        """Every request's generation, as each finishes; the requests are in vLLM's queue
        from this call on. Calls from the stage's batches running at once share it."""
        call = Call()
        handed = [(r, call) for r in requests]
        call.left = len(handed)

        def queue_them() -> None:
            self._new.extend(handed)

        return self._hand_in(call, queue_them)

    def close(self) -> None:
        """Stop the step loop and vLLM's engine (its processes, its memory)."""
        self._stop_loop()
        core = getattr(self.llm.llm_engine, "engine_core", None)
        shutdown = getattr(core, "shutdown", None)
        if callable(shutdown):
            shutdown()

    def _abandon(self) -> list[Call]:
        calls = [c for _, c, _ in self._running.values()] + [c for _, c in self._new]
        calls += self._sending  # taken from the queue, not yet in vLLM's when it failed
        self._new.clear()
        self._running.clear()
        self._internal.clear()
        self._per_call.clear()
        return calls

    def _steps(self) -> None:
        engine = self.llm.llm_engine
        while True:
            with self._turn:
                while not self._new and not self._running and not self._closed:
                    self._turn.wait()
                if self._closed:
                    return
                new, self._new = self._new, []
            self._send([(r, c, 0) for r, c in new])
            finished = [o for o in engine.step() if o.finished]
            again: list[tuple[GenerationRequest, Call, int]] = []
            done: list[tuple[Call, Generation]] = []
            for output in finished:
                request, call, aborts = self._forget(output.request_id)
                if call.cancelled:
                    continue
                generation = self._generation(request, output)
                if generation is None:  # aborted: not a finished generation
                    if aborts + 1 >= ABORTS:
                        raise EngineError(f"vLLM aborted a request {ABORTS} times")
                    again.append((request, call, aborts + 1))
                else:
                    done.append((call, generation))
            self._send(again)
            if any(c.cancelled for c in self._per_call):
                cancelled = [i for i, (_, c, _) in self._running.items() if c.cancelled]
                engine.abort_request([self._internal[i] for i in cancelled], internal=True)
                for i in cancelled:
                    self._forget(i)
            # The gauges first: a caller that has its last row reads them as they are now.
            self.in_flight = len(self._running)
            for call, generation in done:
                call.results.put(generation)
            if self.on_progress is not None:
                self.on_progress()

    def _send(self, requests: list[tuple[GenerationRequest, Call, int]]) -> None:
        """The requests into vLLM's queue (its scheduler takes them as it has room)."""

        requests = [(r, c, a) for r, c, a in requests if not c.cancelled]
        if not requests:
            return
        refused = _refusals()
        self._sending = [c for _, c, _ in requests]
        try:
            self._enqueue(requests)
        except refused:
            # One request vLLM refuses (a row's structured output its grammar backend cannot
            # compile) refuses them all, none left queued: each again alone, the refused one
            # its row's error.
            for item in requests:
                try:
                    self._enqueue([item])
                except refused as e:
                    request, call, _ = item
                    call.results.put(Generation(key=request.key, error=f"vLLM refused it: {e}"))
        self._sending = []

    def _enqueue(self, requests: list[tuple[GenerationRequest, Call, int]]) -> None:
        from vllm.inputs import TokensPrompt

        ids = self.llm.enqueue(
            [TokensPrompt(prompt_token_ids=r.prompt_ids) for r, _, _ in requests],
            [self._params(r) for r, _, _ in requests],
            use_tqdm=False,
        )
        for internal, item in zip(ids, requests, strict=True):
            # vLLM keeps the id it was given with a random suffix (`-` and 8 characters,
            # unless VLLM_DISABLE_REQUEST_ID_RANDOMIZATION), and names its outputs by the id
            # given; `enqueue` answers with the one it keeps.
            given = internal.rsplit("-", 1)[0] if "-" in internal else internal
            request, call, _ = item
            self._running[given] = item
            self._internal[given] = internal
            self._per_call[call] = self._per_call.get(call, 0) + 1
            self.held_tokens += len(request.prompt_ids) + request.sampling.max_tokens

    def _forget(self, given: str) -> tuple[GenerationRequest, Call, int]:
        """A request no longer in vLLM: out of the books, its tokens off the gauge."""
        item = self._running.pop(given)
        del self._internal[given]
        request, call, _ = item
        self._per_call[call] -= 1
        if not self._per_call[call]:
            del self._per_call[call]
        self.held_tokens -= len(request.prompt_ids) + request.sampling.max_tokens
        return item

    @staticmethod
    def _params(request: GenerationRequest) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import StructuredOutputsParams

        s = request.sampling
        structured = None
        if request.structure is not None:
            fields = request.structure.request_fields()["structured_outputs"]
            structured = StructuredOutputsParams(**fields)
        return SamplingParams(
            max_tokens=s.max_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            seed=s.seed if s.temperature > 0 else None,
            stop=list(s.stop) or None,
            structured_outputs=structured,
        )

    @staticmethod
    def _generation(request: GenerationRequest, output: Any) -> Generation | None:
        """The request's generation; None where vLLM aborted it."""
        completion = output.outputs[0]
        finish = completion.finish_reason
        if finish not in ("stop", "length"):
            return None
        return Generation(
            key=request.key,
            token_ids=list(completion.token_ids),
            text=completion.text,
            finish_reason=finish,
            prompt_tokens=len(output.prompt_token_ids or request.prompt_ids),
            output_tokens=len(completion.token_ids),
        )


def _refusals() -> tuple[type[Exception], ...]:
    """What vLLM raises for a request it will not take (its own validation error, a client's
    fault: not a ValueError), as against the engine failing."""
    from vllm import exceptions

    client_error = getattr(exceptions, "VLLMClientError", None)
    return (ValueError, client_error) if client_error is not None else (ValueError,)
