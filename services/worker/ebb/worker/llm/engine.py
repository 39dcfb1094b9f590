"""What every engine offers the `llm` stage: requests in, each one's generation out as soon as
it finishes (not when the slowest of a batch does)."""

from __future__ import annotations

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
