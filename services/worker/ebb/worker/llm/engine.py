"""What every engine offers the `llm` stage: requests in, each one's generation out as soon as
it finishes (not when the slowest of a batch does)."""

from __future__ import annotations

import queue
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

if TYPE_CHECKING:
    from .structured import Structure

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True, kw_only=True)
class Sampling:
    """One row's sampling, resolved: the stage's defaults with the row's own values over them."""

    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    stop: tuple[str, ...] = ()
    seed: int = 0
    """The row's own seed (derived from the stage's and the prompt): its sampling's source."""


@dataclass(frozen=True, kw_only=True)
class GenerationRequest:
    key: int
    """The caller's name for it (its row): the generation comes back under it."""
    prompt_ids: list[int]
    sampling: Sampling
    prompt_text: str = ""
    """The prompt as text (a chat rendered): what a server that takes text is sent."""
    structure: Structure | None = None
    """A shape the text must have (the stage's `structured`): the engine enforces it where
    it can; the stage checks it."""


@dataclass(kw_only=True)
class Generation:
    key: int
    token_ids: list[int] = field(default_factory=list)
    """The tokens made, where the engine tells them (a server tells only their count)."""
    text: str = ""
    finish_reason: FinishReason = "length"
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str | None = None
    """Why this request alone was refused (a server's 4xx for it): its row is an error row."""


class Engine(Protocol):
    max_context: int
    """Prompt tokens plus generated tokens that one sequence may hold."""
    on_progress: Callable[[], None] | None
    """Called as it makes progress: each decoding step, or each completion a server returns."""
    in_flight: int
    """Requests it runs now."""
    held_tokens: int
    """What the KV cache of the requests it runs now may grow to: their prompt tokens plus
    `max_tokens`, and the padding where its cache is padded."""

    def encode(self, prompt: str | list[dict[str, Any]]) -> list[int]:
        """A prompt's token ids (a chat rendered with the model's template)."""
        ...

    def render(self, prompt: str | list[dict[str, Any]]) -> str:
        """A prompt as text (a chat rendered with the model's template)."""
        ...

    def generate(self, requests: Iterable[GenerationRequest]) -> Iterator[Generation]:
        """Every request's generation, each as soon as it finishes (in no set order)."""
        ...


class EngineError(Exception):
    """The engine could not run or stopped running (the model could not load, the device
    failed, it ran out of memory): the stage restarts it."""


class Call:
    """One `generate` call of an engine with a step loop of its own (transformers', vLLM's):
    its results, handed from the loop's thread to the caller's."""

    def __init__(self) -> None:
        self.results: queue.SimpleQueue[Generation | EngineError] = queue.SimpleQueue()
        self.left = 0
        """Results the caller still waits for."""
        self.order = 0
        """Its place among the calls: an earlier call's requests are run first."""
        self.cancelled = False
        """Its caller stopped reading (its batch failed): its rows are of no use any more."""

    def results_as_they_come(self) -> Iterator[Generation]:
        """Each result as the loop hands it over; the loop's failure raised here."""
        try:
            while self.left:
                item = self.results.get()
                if isinstance(item, EngineError):
                    raise item
                self.left -= 1
                yield item
        finally:
            self.cancelled = True  # rows still waiting are dropped, those running retired


class StepLoop(ABC):
    """The thread an in-process engine steps its model in, and the calls waiting on it.

    `generate` hands a call's requests in (`_hand_in`) and returns at once; the loop
    (`_steps`, the engine's own) runs every call's requests together and puts each result in
    its call's queue. A failure of the loop fails every call with a request in it (`_abandon`
    says which), and the engine is not used again: the stage makes another."""

    loop_name = "ebb:llm-engine"

    def __init__(self) -> None:
        self._turn = threading.Condition()
        """Guards the requests handed in, between the callers and the loop."""
        self._loop: threading.Thread | None = None
        self._failed: EngineError | None = None
        self._closed = False

    def _hand_in(self, call: Call, queue_them: Callable[[], None]) -> Iterator[Generation]:
        """`queue_them` (called holding `_turn`) puts the call's requests where `_steps`
        takes them; the loop starts with the first call."""
        if not call.left:
            return iter(())
        with self._turn:
            if self._failed is not None:
                raise EngineError(f"the engine failed before: {self._failed}")
            if self._closed:
                raise EngineError("the engine is closed")
            queue_them()
            if self._loop is None:
                self._loop = threading.Thread(target=self._run, name=self.loop_name, daemon=True)
                self._loop.start()
            self._turn.notify()
        return call.results_as_they_come()

    def _stop_loop(self) -> None:
        with self._turn:
            self._closed = True
            self._turn.notify()
        if self._loop is not None and self._loop is not threading.current_thread():
            self._loop.join(timeout=60)

    def _run(self) -> None:
        try:
            self._steps()
        except BaseException as e:  # noqa: BLE001 - any failure is the engine's: no call waits on
            failure = EngineError(f"the engine failed: {type(e).__name__}: {e}")
            failure.__cause__ = e
            with self._turn:
                self._failed = failure
                calls = {id(c): c for c in self._abandon()}
            for call in calls.values():
                call.results.put(failure)

    @abstractmethod
    def _steps(self) -> None:
        """Run the requests handed in until closed (returns once `_closed` is set)."""

    @abstractmethod
    def _abandon(self) -> list[Call]:
        """After a failure (holding `_turn`): drop every request, and the calls they were of."""
