"""The Hugging Face `transformers` engine: a model in the stage's own process, on its CPU or
GPU, fed continuously by a step loop of its own.

Each turn of the loop admits waiting requests while there is room (`max_in_flight` sequences,
and `kv_tokens`: the slots the padded cache may come to hold, `padded_peak`), prefills them
together, joins their KV cache to the batch's (`batch.BatchCache`), decodes one token for every
sequence in flight, and retires those that finished: a finished sequence frees its place for
the next turn, so no request waits for the longest answer of a batch. Waiting requests are taken
longest first (prompt plus `max_tokens`): the long ones start early and the short ones fill
the places around them, so the last steps of a batch are not one long answer decoding alone
(on the spread workload, a third fewer steps than taking them as they come). This engine
keeps no prefix cache, so the order of shared prefixes gains it nothing.

transformers' own continuous batching (`generate_batch`, paged attention) is not used: on a
CPU its paged path is several times slower than plain decoding (docs/benchmarks.md); this
loop decodes with the model's ordinary forward pass and a left-padded cache.

Sliding-window models (Mistral, Gemma 2 and 3) run with a full cache: the model's mask keeps
each layer's window (by column, which left padding leaves equal to each sequence's own
distance), so the text is the model's own; the cache holds whole sequences where the model
would keep only its window.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from ebb.common import failpoints

from .batch import BatchCache, padded_peak
from .engine import Call, EngineError, FinishReason, Generation, GenerationRequest, StepLoop
from .prompts import Prompt, PromptCodec
from .sampling import RowSampler
from .structured import Guides

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


STATS_KEPT = 4096
"""Decoding steps, admissions and retirements `EngineStats` keeps (the latest): an engine
lives as long as its stage, through millions of steps."""


@dataclass(frozen=True)
class Step:
    """One decoding step."""

    step: int
    in_flight: int
    """The sequences it decoded."""
    waiting: int
    """The requests still waiting for a place."""
    held_tokens: int
    """The slots the padded cache of the sequences in flight may come to (`padded_peak`)."""
    cache_slots: int
    """The token slots the cache held at this step: rows x columns of its keys."""
    calls: int = 1
    """The `generate` calls whose sequences it decoded (the stage's batches running at once)."""


@dataclass
class EngineStats:
    """What the loop did, for metrics and for tests that check it admits as places free:
    counts since the engine started, and the latest `kept` steps, admissions, retirements."""

    kept: int = STATS_KEPT
    steps: int = 0
    """Decoding steps (one token for every sequence in flight)."""
    prompt_tokens: int = 0
    output_tokens: int = 0
    decoded_tokens: int = 0
    """Tokens turned into text: a sequence's stop strings are looked for in its newest text."""
    recent: deque[Step] = field(init=False)
    admitted: deque[tuple[int, int]] = field(init=False)
    """(step, key): when each request joined the sequences in flight."""
    retired: deque[tuple[int, int]] = field(init=False)
    """(step, key): when each finished."""

    def __post_init__(self) -> None:
        self.recent = deque(maxlen=self.kept)
        self.admitted = deque(maxlen=self.kept)
        self.retired = deque(maxlen=self.kept)


@dataclass(eq=False)
class _Sequence:
    request: GenerationRequest
    sampler: RowSampler
    call: Call
    tokens: list[int] = field(default_factory=list)
    finish: FinishReason | None = None
    guide: Any = None
    """Its structured output's walk (outlines-core's `Guide`): the tokens it may take next."""
    stop_chars: int = field(init=False)
    """The length of its longest stop string: how far back a stop string can begin."""

    def __post_init__(self) -> None:
        self.stop_chars = max((len(t) for t in self.request.sampling.stop), default=0)

    @property
    def position(self) -> int:
        """The position of its last token, the one the next step feeds."""
        return len(self.request.prompt_ids) + len(self.tokens) - 1

    @property
    def need(self) -> int:
        return len(self.request.prompt_ids) + self.request.sampling.max_tokens

    @property
    def rank(self) -> tuple[int, int, int]:
        """Its place among the waiting: its call's, then longest first (prompt plus
        `max_tokens`; the long ones start early and the short fill the places around them)."""
        return self.call.order, -self.need, self.request.key

    @property
    def extent(self) -> tuple[int, int]:
        """(its length now, its length at most): what `padded_peak` takes."""
        return len(self.request.prompt_ids) + len(self.tokens), self.need


class TransformersEngine(StepLoop):
    def __init__(
        self,
        model_dir: str,
        *,
        device: str = "cpu",
        dtype: str | None = None,
        max_in_flight: int = 32,
        kv_tokens: int | None = None,
    ) -> None:
        from transformers import AutoModelForCausalLM

        self.device = torch.device(device)
        model: Any
        try:
            self.codec = PromptCodec(model_dir)
            model = AutoModelForCausalLM.from_pretrained(
                model_dir, dtype=_DTYPES[dtype] if dtype else "auto"
            )
        except (OSError, ValueError) as e:
            raise EngineError(f"cannot load the model in {model_dir}: {e}") from e
        self.model = model.to(self.device).eval()
        self.tokenizer = self.codec.tokenizer
        self.max_context = self.codec.max_context
        eos = model.generation_config.eos_token_id
        if eos is None:
            eos = self.tokenizer.eos_token_id
        self.eos: set[int] = (
            set(eos) if isinstance(eos, list) else {eos} if eos is not None else set()
        )
        self.max_in_flight = max_in_flight
        self.kv_tokens = kv_tokens
        self.stats = EngineStats()
        self.on_progress: Callable[[], None] | None = None
        self.guides = Guides(self.tokenizer, self.eos)
        self.in_flight = 0
        self.held_tokens = 0
        super().__init__()
        self._flight: list[_Sequence] = []
        """The sequences decoding (the loop's alone)."""
        self._waiting: list[tuple[tuple[int, int, int], _Sequence]] = []
        """A heap, by `_Sequence.rank`."""
        self._calls = itertools.count()

    def encode(self, prompt: Prompt) -> list[int]:
        return self.codec.encode(prompt)

    def render(self, prompt: Prompt) -> str:
        return self.codec.render(prompt)

    def generate(self, requests: Iterable[GenerationRequest]) -> Iterator[Generation]:
        """Every request's generation, as each finishes. Calls from several threads (the
        stage's batches running at once) share the step loop: a later call's requests wait
        behind an earlier one's and take the places its finished rows free, so the engine
        does not drain between batches. The requests wait from this call on, not from the
        first result asked for."""
        call = Call()
        sequences = [self._sequence(r, call) for r in requests]
        call.left = len(sequences)

        def queue_them() -> None:
            call.order = next(self._calls)
            for sequence in sequences:
                heapq.heappush(self._waiting, (sequence.rank, sequence))

        return self._hand_in(call, queue_them)

    def close(self) -> None:
        """Stop the step loop and let go of the model (a restarted engine loads its own)."""
        self._stop_loop()
        self.model = None

    def _sequence(self, request: GenerationRequest, call: Call) -> _Sequence:
        sequence = _Sequence(request, RowSampler(request.sampling, self.device), call=call)
        if request.structure is not None:
            sequence.guide = self.guides.guide(request.structure)
        return sequence

    def _abandon(self) -> list[Call]:
        calls = [s.call for s in self._flight] + [s.call for _, s in self._waiting]
        self._waiting.clear()
        return calls

    def _steps(self) -> None:
        with torch.inference_mode():  # a thread's own: set in the loop's
            self._decoding()

    def _decoding(self) -> None:
        """Admit, prefill, decode, retire, until closed."""
        flight = self._flight
        batch: BatchCache | None = None
        while True:
            with self._turn:
                while not self._waiting and not flight and not self._closed:
                    self._turn.wait()
                if self._closed:
                    return
                joining = self._admit(flight)
            if joining:
                new = self._prefill(joining)
                if batch is None:
                    batch = new
                else:
                    batch.join(new)
                flight += joining
            elif flight:
                assert batch is not None
                self.in_flight = len(flight)
                self.held_tokens = padded_peak(s.extent for s in flight)
                keys = batch.cache.layers[0].keys
                self.stats.recent.append(
                    Step(
                        step=self.stats.steps,
                        in_flight=self.in_flight,
                        waiting=len(self._waiting),
                        held_tokens=self.held_tokens,
                        cache_slots=int(keys.shape[0] * keys.shape[2]),
                        calls=len({id(s.call) for s in flight}),
                    )
                )
                self._decode(flight, batch)
            kept = [k for k, s in enumerate(flight) if s.finish is None and not s.call.cancelled]
            if len(kept) < len(flight):
                gone = [s for s in flight if s.finish is not None or s.call.cancelled]
                flight[:] = [flight[k] for k in kept]
                if flight:
                    assert batch is not None
                    batch.keep(kept)
                else:
                    batch = None
                # The gauges first: a caller that has its last row reads them as they are now.
                self.in_flight = len(flight)
                self.held_tokens = padded_peak(s.extent for s in flight)
                for s in gone:
                    if not s.call.cancelled:
                        s.call.results.put(self._generation(s))

    def _admit(self, flight: list[_Sequence]) -> list[_Sequence]:
        """The waiting sequences that join those in flight now (called holding `_turn`)."""
        joining: list[_Sequence] = []
        extents = [s.extent for s in flight]
        while self._waiting and len(extents) < self.max_in_flight:
            sequence = self._waiting[0][1]
            if sequence.call.cancelled:
                heapq.heappop(self._waiting)
                continue
            if self.kv_tokens is not None:
                joined = [*extents, (len(sequence.request.prompt_ids), sequence.need)]
                if extents and padded_peak(joined) > self.kv_tokens:
                    break
            heapq.heappop(self._waiting)
            extents.append((len(sequence.request.prompt_ids), sequence.need))
            joining.append(sequence)
            self.stats.admitted.append((self.stats.steps, sequence.request.key))
        return joining

    def _prefill(self, joining: list[_Sequence]) -> BatchCache:
        """The joining sequences' prompts through the model together (left-padded): their
        cache, and each one's first token."""
        longest = max(len(s.request.prompt_ids) for s in joining)
        ids = torch.zeros((len(joining), longest), dtype=torch.long)
        mask = torch.zeros((len(joining), longest), dtype=torch.long)
        for i, s in enumerate(joining):
            prompt = s.request.prompt_ids
            ids[i, longest - len(prompt) :] = torch.tensor(prompt)
            mask[i, longest - len(prompt) :] = 1
            self.stats.prompt_tokens += len(prompt)
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            # A full cache even for a sliding-window model (its own would keep only the
            # window, and could not be padded and joined): the mask keeps the window.
            cache=DynamicCache(),
            use_cache=True,
            logits_to_keep=1,  # the next token's alone, not every prompt position's
        )
        self._take(joining, out.logits[:, -1])
        return BatchCache(out.cache, mask)

    def _decode(self, flight: list[_Sequence], batch: BatchCache) -> None:
        """One token for every sequence in flight."""
        if failpoints.take(failpoints.WORKER_LLM_ENGINE_FAILS, f"step {self.stats.steps}"):
            raise EngineError("the engine failed (failpoint worker.llm_engine_fails)")
        ids = torch.tensor([[s.tokens[-1]] for s in flight], device=self.device)
        positions = torch.tensor([[s.position] for s in flight], device=self.device)
        out = self.model(
            input_ids=ids,
            attention_mask=batch.step_mask(),
            position_ids=positions,
            cache=batch.cache,
            use_cache=True,
        )
        batch.cache = out.cache
        self.stats.steps += 1
        if self.on_progress is not None:
            self.on_progress()
        self._take(flight, out.logits[:, -1])

    def _take(self, sequences: list[_Sequence], logits: torch.Tensor) -> None:
        for i, s in enumerate(sequences):
            if s.guide is not None:  # only the tokens its structure allows next
                allowed = torch.tensor(s.guide.get_tokens(), device=logits.device)
                kept = logits[i, allowed]
                logits[i] = float("-inf")
                logits[i, allowed] = kept
        # Greedy rows' tokens in one call for the whole step; sampled rows' each by its own.
        greedy = torch.argmax(logits, dim=-1).tolist()
        for s, row, best in zip(sequences, logits, greedy, strict=True):
            token = best if s.sampler.generator is None else s.sampler.pick(row)
            if token in self.eos:
                s.finish = "stop"
                continue
            s.tokens.append(token)
            self.stats.output_tokens += 1
            if s.guide is not None:
                s.guide.advance(token, return_tokens=False)
                if s.guide.get_tokens() == [self.guides.eos]:  # a whole match, and no longer
                    s.finish = "stop"
                    continue
            if s.stop_chars and self._stopped(s):
                s.finish = "stop"
            elif len(s.tokens) >= s.request.sampling.max_tokens:
                s.finish = "length"

    def _stopped(self, s: _Sequence) -> bool:
        """Whether its newest token completed one of its stop strings, looked for in the
        text of its last tokens alone (the whole text decoded every step costs a step's
        time over again for long answers): a stop string the newest token completes lies in
        the last `stop_chars` characters, which come from at most 4 tokens each (a byte-level
        tokenizer's bytes of one character), and one more whose text a cut can change (a
        leading space)."""
        return any(
            t in self._text(s.tokens[-(4 * s.stop_chars + 1) :]) for t in s.request.sampling.stop
        )

    def _text(self, tokens: list[int]) -> str:
        self.stats.decoded_tokens += len(tokens)
        return self.codec.decode(tokens)

    def _generation(self, s: _Sequence) -> Generation:
        self.stats.retired.append((self.stats.steps, s.request.key))
        text = self._text(s.tokens)
        for stop in s.request.sampling.stop:
            cut = text.find(stop)
            if cut >= 0:
                text = text[:cut]
        assert s.finish is not None
        return Generation(
            key=s.request.key,
            token_ids=s.tokens,
            text=text,
            finish_reason=s.finish,
            prompt_tokens=len(s.request.prompt_ids),
            output_tokens=len(s.tokens),
        )
