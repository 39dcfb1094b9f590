"""The `llm` section of a stage: a generative model run over a column of prompts.

A stage with `llm` reads a prompt per row (plain text, or a chat: a list of `{role, content}`
messages, rendered with the model's chat template) and writes the generated text with its
finish reason and token counts. Sampling is set for the stage and may be overridden per row
from columns. Each dataclass keeps its fields' docstrings (the job spec reference) beside the
checks of their values."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from .fields import ModelDtype, bad, positive

LLMEngine = Literal["transformers", "vllm", "endpoint", "server"]
PromptAs = Literal["ids", "text"]
SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop")
"""The sampling fields a row may override from a column of its own (`per_row`)."""
PER_ROW_FIELDS = (*SAMPLING_FIELDS, "structured")
"""What a row may set from a column of its own: its sampling, and its structured output."""


@dataclass(frozen=True, kw_only=True)
class SamplingSpec:
    """How tokens are chosen: the stage's defaults, each overridable per row (`per_row`)."""

    max_tokens: int | None = 256
    """Most tokens generated for a row. A prompt whose tokens and `max_tokens` exceed the
    model's context is an error row, before any engine sees it. None: as many as the
    context (and `kv_tokens`) leaves after the row's prompt, as the OpenAI API means by an
    omitted `max_tokens`."""
    temperature: float = 0.0
    """0: greedy (the most likely token each step); above 0, sampled at that temperature."""
    top_p: float = 1.0
    """Sampling keeps the most likely tokens whose probabilities sum to this (nucleus)."""
    top_k: int = 0
    """Sampling keeps the k most likely tokens; 0: no limit."""
    stop: list[str] = field(default_factory=list)
    """Text that ends a row's generation where it first appears (not included)."""
    seed: int = 0
    """The stage's seed. Each row's own seed is derived from it and the row's prompt, so a
    row retried, speculated or resumed generates the same text, sampled or not."""

    def __post_init__(self) -> None:
        if self.max_tokens is not None:
            positive("max_tokens", self.max_tokens)
        if not 0 <= self.temperature < math.inf:
            raise bad("temperature", f"must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", f"must lie in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise bad("top_k", f"must be >= 0, got {self.top_k}")
        if any(not s for s in self.stop):
            raise bad("stop", "a stop string must not be empty")


@dataclass(frozen=True, kw_only=True)
class StructuredSpec:
    """A shape every row's text must have, exactly one of `json`, `choice` and `regex`. The
    transformers engine enforces it token by token (outlines-core, the library vLLM uses);
    a server is asked to (vLLM's `structured_outputs`, SGLang's `json_schema` and `regex`);
    either way the stage checks each row's text, and a row whose text does not parse (its
    `max_tokens` ran out first, or a server ignored the request) is an error row saying so."""

    json: dict[str, Any] | None = None
    """A JSON Schema the text is a JSON document of: `{type: object, properties: {label:
    {enum: [spam, ham]}}, required: [label]}`."""
    choice: list[str] | None = None
    """The text is one of these strings."""
    regex: str | None = None
    """The text matches this regular expression, whole."""

    def __post_init__(self) -> None:
        given = [k for k in ("json", "choice", "regex") if getattr(self, k) is not None]
        if len(given) != 1:
            raise bad("structured", f"needs exactly one of json, choice, regex; got {given}")
        if self.json is not None and not self.json:
            raise bad("structured.json", "an empty schema constrains nothing: leave it out")
        if self.choice is not None and (not self.choice or any(not c for c in self.choice)):
            raise bad("structured.choice", "needs at least one choice, none of them empty")
        if self.regex is not None:
            try:
                re.compile(self.regex)
            except re.error as e:
                raise bad("structured.regex", f"not a regular expression: {e}") from None


@dataclass(frozen=True, kw_only=True)
class LLMSpec:
    """A generative model over a column of prompts, fed continuously: rows enter the engine
    as others finish, never waiting for the longest answer of a batch."""

    model: str
    """A folder in Hugging Face format (config, weights, tokenizer), local or in an object
    store (`s3://bucket/models/labeller`): a store's folder is copied file by file into the
    worker's model cache, through the node's model cache where there is one, once per node
    and version, and must lie under the data roots as every path of a job. With `engine: endpoint`
    the stage reads only its tokenizer and config (to count tokens, check the context and
    render chats); the server runs the same model."""
    engine: LLMEngine = "transformers"
    """What runs the model: `transformers`, in the stage's own process, on its `device`;
    `vllm`, vLLM's engine in the stage's own process (vLLM installed in the worker's
    environment; `engine_args` given to `vllm.LLM`); `server`, an OpenAI-compatible server
    (`vllm serve`, SGLang's, `transformers serve`) the stage starts beside it on its devices
    (`command`), restarts when it dies and stops with it; or `endpoint`, such a server
    already running, fed over HTTP."""
    engine_args: dict[str, Any] = field(default_factory=dict)
    """`engine: vllm`: vLLM's engine arguments, as `vllm.LLM` takes them
    (`tensor_parallel_size`, `gpu_memory_utilization`, `max_model_len`, `kv_cache_memory_bytes`,
    `enable_prefix_caching`...). `model`, `dtype` and `max_num_seqs` (`max_in_flight`) are the
    stage's."""
    command: list[str] | None = None
    """`engine: server`: the server's command line, `{model}`, `{port}` and `{served_model}`
    filled in: `[vllm, serve, "{model}", --port, "{port}"]`."""
    startup_s: float = 600.0
    """`engine: server`: how long the server may take to answer its health check."""
    endpoint: str | None = None
    """`engine: endpoint`: the server's base URL, up to and with `/v1`
    (`http://vllm.llm.svc:8000/v1`)."""
    served_model: str | None = None
    """`engine: endpoint`: the model's name at the server (its `/v1/models` id). None: `model`."""
    prompt_as: PromptAs = "ids"
    """`engine: server` and `endpoint`: how a prompt is sent. `ids`: the token ids the stage
    counted (vLLM, SGLang): the server runs exactly them and adds no special token again.
    `text`: the prompt as text that tokenizes to the same ids (a chat rendered with the
    model's template, less the BOS the server's tokenizer adds itself), for a server that
    takes text alone (`transformers serve`). A server that counts other prompt tokens than
    the stage is warned of once."""
    prompt: str = "prompt"
    """The column of prompts: text, a chat (a list of `{role, content}` messages, rendered
    with the model's chat template), or token ids (as a `tokenize_only` stage writes them)."""
    tokenize_only: bool = False
    """The stage only renders and tokenizes the prompts, with the model's tokenizer: it passes
    its rows on with `prompt_ids` (the token ids, ready for the answer) and `prompt_tokens`,
    for a later llm stage whose `prompt` is `prompt_ids`. With tiers, this is the CPU tier's
    work, and the GPU tier's generates; a prompt it cannot tokenize is an error row there.
    Engine and sampling are not used."""
    output: str = "text"
    """The column the generated text goes under. Beside it: `finish_reason` (`stop`: the
    model ended or a stop string came; `length`: `max_tokens` reached), `prompt_tokens` and
    `output_tokens`."""
    sampling: SamplingSpec = field(default_factory=SamplingSpec)
    """The stage's sampling."""
    per_row: dict[str, str] = field(default_factory=dict)
    """Sampling fields overridden per row, each from a column: `{max_tokens: budget}` reads
    a row's `max_tokens` from its `budget` column (max_tokens, temperature, top_p, top_k,
    seed; stop, a string or a list of them). A null value keeps the stage's. `structured`:
    the row's own structured output, a JSON text of a `structured` mapping
    (`{"json": {...schema...}}`, `{"choice": [...]}` or `{"regex": "..."}`); one that is not,
    or that the model's tokens cannot write, is an error row."""
    max_in_flight: int | None = None
    """Rows generating at once: as one finishes, the next waiting row takes its place.
    None: 32 for the transformers engine; 256 requests at once for a server (vLLM's own
    default of sequences it runs: it queues what it cannot run yet, and is never left short
    while Ebb waits on an answer)."""
    kv_tokens: int | None = None
    """Most token slots the KV cache of the rows in flight together may come to hold, if each
    runs to its `max_tokens`; a row alone is admitted if its prompt and `max_tokens` fit. The
    transformers engine's cache is left-padded (each row as long as the longest): it counts
    the padding. None: no bound beyond `max_in_flight`."""
    dtype: ModelDtype | None = None
    """The precision to run the model in; None: the model's own."""
    structured: StructuredSpec | None = None
    """A shape each row's text must have (a JSON Schema, a choice list or a regex)."""

    @property
    def in_flight(self) -> int:
        """`max_in_flight`, or the engine's default."""
        if self.max_in_flight is not None:
            return self.max_in_flight
        return 32 if self.engine == "transformers" else 256

    @property
    def concurrent_batches(self) -> int:
        """Batches the stage runs at once: every engine takes the next batch's rows while the
        last of one finish (one queue of requests for both: the transformers engine's step
        loop, a server's pool of requests), so generation never drains between the stage's
        batches. vLLM in the stage's process four: it keeps `max_in_flight` rows running only
        while more wait, and rows of spread lengths leave a batch fast (with four batches
        queued, 4,450 tokens/s against 4,046 with two, 1,536 spread prompts; equal lengths
        alike). A `tokenize_only` stage runs no engine: one at a time."""
        if self.tokenize_only:
            return 1
        return 4 if self.engine == "vllm" else 2

    def __post_init__(self) -> None:
        if not self.model:
            raise bad("model", "must name a model folder")
        if not self.prompt:
            raise bad("prompt", "must name a column")
        if not self.output:
            raise bad("output", "must name a column")
        for key in self.per_row:
            if key not in PER_ROW_FIELDS:
                raise bad(f"per_row.{key}", f"not a field a row may set: {PER_ROW_FIELDS}")
        if self.engine == "endpoint":
            if not self.endpoint or not self.endpoint.startswith(("http://", "https://")):
                raise bad("endpoint", "engine endpoint needs the server's http(s):// base URL")
        elif self.endpoint is not None:
            raise bad("endpoint", f"only engine endpoint has an endpoint, not {self.engine}")
        if self.engine == "server":
            if not self.command or "{port}" not in " ".join(self.command):
                raise bad("command", "engine server needs a command line that names {port}")
        elif self.command is not None:
            raise bad("command", f"only engine server has a command, not {self.engine}")
        in_process = self.engine in ("transformers", "vllm")
        if in_process and self.served_model is not None:
            raise bad("served_model", "only a server's model has a served name")
        if in_process and self.prompt_as != "ids":
            raise bad("prompt_as", f"only a server is sent prompts: engine {self.engine} runs ids")
        if self.engine_args and self.engine != "vllm":
            raise bad("engine_args", f"only engine vllm takes engine_args, not {self.engine}")
        for key in ("model", "dtype", "max_num_seqs"):
            if key in self.engine_args:
                raise bad(f"engine_args.{key}", "is the stage's own: set it on the stage")
        if self.engine == "vllm" and self.kv_tokens is not None:
            raise bad(
                "kv_tokens",
                "vLLM sizes its own KV cache: engine_args gpu_memory_utilization or "
                "kv_cache_memory_bytes",
            )
        positive("startup_s", self.startup_s)
        if self.max_in_flight is not None:
            positive("max_in_flight", self.max_in_flight)
        if self.kv_tokens is not None:
            positive("kv_tokens", self.kv_tokens)
