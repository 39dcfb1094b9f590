"""The `llm` stage: a column of prompts in, the generated text out, each row on its own.

A batch's rows become requests (the prompt's token ids, the row's sampling: the stage's with
the row's own columns over it) that the engine runs continuously; a row the engine cannot take
(a prompt that with its `max_tokens` exceeds the model's context, a chat for a model without a
chat template, a sampling value out of range) is an error row with the reason, before any
engine sees it, and the others go on.

Each row's seed is derived from the stage's seed and the row's prompt: a row retried,
speculated or resumed generates the same text, at temperature 0 or sampled.

One module past 400 lines: a row's request (its prompt, its sampling checked value by value)
and the engine's life (made, restarted once for batches that fail together, its gauges) are
the stage's one concept, a column of prompts through an engine.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from ebb.common import schema
from ebb.common.errors import SchemaError
from ebb.common.job import LLMSpec, StageSpec, StructuredSpec

from ..chunks.columns import ROW_ERROR, Columns, num_rows
from .engine import Engine, EngineError, Generation, GenerationRequest, Sampling
from .prompts import Prompt
from .structured import INDEX_BUILD_S, Structure

if TYPE_CHECKING:
    from .managed import ManagedServer

log = logging.getLogger(__name__)

ENGINE_RESTARTS = 2
"""Engines made again for one batch before it fails."""

ROW_STRUCTURES = 256
"""Rows' own structured outputs (`per_row.structured`) kept made, the most recently used: a
batch API's requests repeat a few schemas, each made once."""


def local_model_folder(model: str) -> str:
    """A local folder of the model: itself, or (a folder in an object store) its copy in the
    worker's model cache, each file through the node's cache when there is one."""
    from ..modelcache.client import local_model_folder as fetched
    from ..modelcache.store import ModelFetchError

    try:
        return fetched(model)
    except (ModelFetchError, OSError) as e:
        raise EngineError(f"cannot fetch the model folder {model}: {e}") from e


def row_seed(stage_seed: int, prompt: Any) -> int:
    """A row's seed: the same for the same prompt under the same stage seed, anywhere."""
    text = prompt if isinstance(prompt, str) else json.dumps(_plain(prompt), sort_keys=True)
    digest = hashlib.blake2b(f"{stage_seed}\x00{text}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _plain(value: Any) -> Any:
    """A chat as plain lists and maps (numpy arrays of dicts, as columns hold them, too)."""
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


class LLMStage:
    """The modelet an `llm` stage runs (columnar: `process_columns`)."""

    def __init__(self, spec: StageSpec) -> None:
        assert spec.llm is not None
        self.stage = spec
        self.llm: LLMSpec = spec.llm
        self.engine: Any = None
        self.engine_restarts = 0
        """Times the engine was made again after it failed."""
        self.prompt_tokens = self.output_tokens = 0
        """Tokens of the rows generated since the stage's process started."""
        self.server: ManagedServer | None = None
        """`engine: server`: the server this stage runs."""
        self.server_starts = 0
        self.progress: Callable[[], None] | None = None
        self.report: Callable[..., None] | None = None
        """Posts the engine's gauges where the worker reads them (the stage's batch board)."""
        self.structure = Structure.of(self.llm.structured) if self.llm.structured else None
        self._row_structures: OrderedDict[str, Structure] = OrderedDict()
        self._structures_lock = threading.Lock()
        """Batches run at once make their rows' structures into one cache."""
        self.model_dir = self.llm.model
        """The model's folder here: `model` itself, or its copy from an object store."""
        self._lock = threading.Lock()
        """Batches run at once (`concurrent_batches`) share the engine and the counts."""

    @property
    def concurrent_batches(self) -> int:
        """Batches the stage's loop may run at once (`LLMSpec.concurrent_batches`)."""
        return self.llm.concurrent_batches

    def setup(self) -> None:
        self.model_dir = local_model_folder(self.llm.model)
        if self.llm.tokenize_only:
            from .prompts import PromptCodec

            self.codec = PromptCodec(self.model_dir)  # the tokenizer alone: no engine
            return
        self.engine = self._engine()
        self.engine.on_progress = self._progressed
        guides = getattr(self.engine, "guides", None)
        if self.structure is not None and guides is not None:
            guides.guide(self.structure)  # a shape its tokens cannot write fails the set-up

    def _engine(self) -> Engine:
        if self.llm.engine == "server":
            return self._served()
        if self.llm.engine == "endpoint":
            from .remote import RemoteEngine

            assert self.llm.endpoint is not None
            return RemoteEngine(
                self.model_dir,
                endpoint=self.llm.endpoint,
                served_model=self.llm.served_model or self.llm.model,
                max_in_flight=self.llm.in_flight,
                prompt_as=self.llm.prompt_as,
            )
        if self.llm.engine == "vllm":
            from .vllm_engine import VLLMEngine

            return VLLMEngine(
                self.model_dir,
                dtype=self.llm.dtype,
                max_in_flight=self.llm.in_flight,
                engine_args=self.llm.engine_args,
            )
        import torch

        from .hf import TransformersEngine

        if self.stage.threads:
            torch.set_num_threads(self.stage.threads)
        return TransformersEngine(
            self.model_dir,
            device=self.stage.device,
            dtype=self.llm.dtype,
            max_in_flight=self.llm.in_flight,
            kv_tokens=self.llm.kv_tokens,
        )

    def _served(self) -> Engine:
        """The stage's own server, started (again, if it died) and fed over loopback."""
        from .managed import ManagedServer
        from .remote import RemoteEngine

        assert self.llm.command is not None
        if self.server is None:
            self.server = ManagedServer(
                self.llm.command,
                model=self.model_dir,
                served_model=self.llm.served_model or self.llm.model,
                startup_s=self.llm.startup_s,
            )
            # A stage that ends stops its server; one killed takes it along
            # (ebb.worker.llm.managed).
            atexit.register(self.server.close)
        if not self.server.alive:
            self.server.stop()
            self.server.start()
            self.server_starts += 1
        server = self.server
        return RemoteEngine(
            self.model_dir,
            endpoint=server.url,
            served_model=server.served_model,
            max_in_flight=self.llm.in_flight,
            prompt_as=self.llm.prompt_as,
            alive=lambda: server.alive,
        )

    def set_progress(self, progress: Callable[[], None]) -> None:
        """Called as the engine makes progress (a decoding step, a finished row): the batch's
        timeout (`fault.batch_timeout_s`) counts from the last, not from its start."""
        self.progress = progress

    def set_engine_report(self, report: Callable[..., None]) -> None:
        """Called with the engine's gauges and counts (ebb.worker.stage.board.ENGINE_FIELDS)
        as it makes progress."""
        self.report = report

    def _progressed(self) -> None:
        if self.progress is not None:
            self.progress()
        if self.report is not None and self.engine is not None:
            self.report(in_flight=self.engine.in_flight, held_tokens=self.engine.held_tokens)

    def set_threads(self, threads: int) -> None:
        import torch

        torch.set_num_threads(threads)

    def process_columns(self, batch: Columns) -> Columns:
        n = num_rows(batch)
        if self.llm.prompt not in batch:
            raise KeyError(
                f"no prompt column {self.llm.prompt!r} among the rows' columns {sorted(batch)}"
            )
        prompts = batch[self.llm.prompt]
        if self.llm.tokenize_only:
            return self._tokenized(batch, prompts)
        errors: list[str | None] = [None] * n
        requests: list[GenerationRequest] = []
        for i in range(n):
            try:
                requests.append(self._request(i, prompts[i], batch))
            except (ValueError, TypeError) as e:
                errors[i] = str(e)
        text = np.full(n, None, dtype=object)
        finish = np.full(n, None, dtype=object)
        prompt_tokens = np.zeros(n, dtype=np.int64)
        output_tokens = np.zeros(n, dtype=np.int64)
        structures = {r.key: r.structure for r in requests}
        for g in self._generate(requests):
            if g.error is not None:
                errors[g.key] = g.error
                continue
            structure = structures[g.key]
            if structure is not None:
                wrong = structure.check(g.text)
                if wrong is not None:
                    errors[g.key] = (
                        f"the text has not the row's structured {structure.kind} "
                        f"(finish_reason {g.finish_reason}): {wrong}"
                    )
            text[g.key], finish[g.key] = g.text, g.finish_reason
            prompt_tokens[g.key], output_tokens[g.key] = g.prompt_tokens, g.output_tokens
            with self._lock:
                self.prompt_tokens += g.prompt_tokens
                self.output_tokens += g.output_tokens
                if self.report is not None:
                    self.report(prompt_tokens=self.prompt_tokens, output_tokens=self.output_tokens)
        if self.report is not None:  # the batch is done: what another batch still runs
            engine = self.engine if self.concurrent_batches > 1 else None
            self.report(
                in_flight=engine.in_flight if engine is not None else 0,
                held_tokens=engine.held_tokens if engine is not None else 0,
                restarts=self.engine_restarts,
            )
        # The generation's columns alone, as a model stage's output: the input's columns reach
        # the output as `carryover` says.
        out: Columns = {
            self.llm.output: text,
            "finish_reason": finish,
            "prompt_tokens": prompt_tokens,
            "output_tokens": output_tokens,
        }
        if any(e is not None for e in errors):
            out[ROW_ERROR] = np.array(errors, dtype=object)
        return out

    def _generate(self, requests: list[GenerationRequest]) -> Iterator[Generation]:
        """Every request's generation. An engine that dies (out of memory, its device lost)
        is made again in place and given the requests it had not finished, up to
        `ENGINE_RESTARTS` times a batch; then the batch fails, and the pipeline's bisection
        finds the rows that kill every engine."""
        left = {r.key: r for r in requests}
        engine = self.engine
        for restart in range(ENGINE_RESTARTS + 1):
            try:
                for g in engine.generate(list(left.values())):
                    del left[g.key]
                    yield g
                return
            except (EngineError, RuntimeError) as e:
                if restart == ENGINE_RESTARTS:
                    raise
                engine = self._restart(engine, e, len(left))

    def _restart(self, failed: Engine, e: Exception, rows: int) -> Engine:
        """The engine made again in place of `failed`; once, when batches running at once
        see it fail together (one server started, not one a batch)."""
        with self._lock:
            current: Engine | None = self.engine
            if current is not None and current is not failed:
                return current  # another batch made it again already
            self.engine_restarts += 1
            if self.report is not None:
                self.report(restarts=self.engine_restarts)
            log.warning(
                "stage %r: the engine failed (%s: %s): restarting it, %d rows again",
                self.stage.name,
                type(e).__name__,
                e,
                rows,
            )
            close = getattr(failed, "close", None)
            if callable(close):
                close()
            if self.concurrent_batches == 1:
                self.engine = None  # its memory freed before another loads
            engine = self._engine()
            engine.on_progress = self._progressed
            self.engine = engine
            return engine

    def _tokenized(self, batch: Columns, prompts: np.ndarray) -> Columns:
        """`tokenize_only`: the rows, with their prompts' token ids and counts."""
        n = num_rows(batch)
        ids = np.empty(n, dtype=object)
        counts = np.zeros(n, dtype=np.int64)
        errors: list[str | None] = [None] * n
        for i in range(n):
            try:
                given, encoded = self._prompt(prompts[i])
                if given is not None:
                    encoded = self.codec.encode(given)
                assert encoded is not None
            except (ValueError, TypeError) as e:
                errors[i] = str(e)
                ids[i] = np.empty(0, dtype=np.int32)
                continue
            ids[i], counts[i] = np.asarray(encoded, dtype=np.int32), len(encoded)
        out = dict(batch)
        out["prompt_ids"], out["prompt_tokens"] = ids, counts
        if any(e is not None for e in errors):
            out[ROW_ERROR] = np.array(errors, dtype=object)
        return out

    def _prompt(self, prompt: Any) -> tuple[Prompt | None, list[int] | None]:
        """(text or chat, None), or (None, token ids) for ids a `tokenize_only` stage wrote."""
        if isinstance(prompt, list | tuple | np.ndarray):
            prompt = _plain(prompt)
        if isinstance(prompt, list) and prompt:
            if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                return None, prompt
            return prompt, None
        if isinstance(prompt, str):
            return prompt, None
        raise TypeError(
            f"prompt {self.llm.prompt!r} is {type(prompt).__name__}: text, a list of "
            "{role, content} messages, or token ids"
        )

    def _request(self, i: int, prompt: Any, batch: Columns) -> GenerationRequest:
        given, ids = self._prompt(prompt)
        if given is not None:
            ids, text = self.engine.encode(given), self.engine.render(given)
        else:
            assert ids is not None
            text = ""  # token ids: a server is sent them as they are
        context = self.engine.max_context
        kv = self.llm.kv_tokens
        room = min(context, kv) if kv is not None else context
        sampling = self._sampling(i, prompt, batch, room=room - len(ids))
        if len(ids) + sampling.max_tokens > context:
            raise ValueError(
                f"the prompt's {len(ids)} tokens and max_tokens {sampling.max_tokens} exceed "
                f"the model's context of {context} tokens"
            )
        if kv is not None and len(ids) + sampling.max_tokens > kv:
            raise ValueError(
                f"the prompt's {len(ids)} tokens and max_tokens {sampling.max_tokens} exceed "
                f"kv_tokens {kv}"
            )
        return GenerationRequest(
            key=i,
            prompt_ids=ids,
            sampling=sampling,
            prompt_text=text,
            structure=self._structure(i, batch),
        )

    def _structure(self, i: int, batch: Columns) -> Structure | None:
        """The row's structured output: its own (`per_row.structured`), else the stage's. One
        that is not a `structured` mapping, or that the model's tokens cannot write, raises
        ValueError (an error row): a request's schema never fails its batch."""
        column = self.llm.per_row.get("structured")
        if column is None:
            return self.structure
        if column not in batch:
            raise ValueError(f"per_row.structured: no column {column!r} among the rows")
        value = batch[column][i]
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return self.structure
        if not isinstance(value, str):
            raise TypeError(f"structured: a JSON text of a mapping, got {type(value).__name__}")
        with self._structures_lock:
            structure = self._row_structures.get(value)
            if structure is not None:
                self._row_structures.move_to_end(value)
                return structure
            try:
                spec = schema.load(StructuredSpec, json.loads(value), path="structured")
            except (ValueError, SchemaError) as e:
                raise ValueError(f"structured: {e}") from None
            structure = Structure.of(spec)
            guides = getattr(self.engine, "guides", None)
            if guides is not None:  # its index made now: one the tokens cannot write
                guides.guide(structure, time_limit=INDEX_BUILD_S)
            self._row_structures[value] = structure
            if len(self._row_structures) > ROW_STRUCTURES:
                self._row_structures.popitem(last=False)
            return structure

    def _sampling(self, i: int, prompt: Any, batch: Columns, *, room: int) -> Sampling:
        """The row's sampling; `room`: the tokens its context leaves after its prompt,
        what it generates at most when neither the row nor the stage says."""
        s = self.llm.sampling
        values: dict[str, Any] = {
            "max_tokens": s.max_tokens if s.max_tokens is not None else max(room, 1),
            "temperature": s.temperature,
            "top_p": s.top_p,
            "top_k": s.top_k,
            "seed": None,
            "stop": tuple(s.stop),
        }
        for key, column in self.llm.per_row.items():
            if key == "structured":
                continue
            if column not in batch:
                raise ValueError(f"per_row.{key}: no column {column!r} among the rows")
            value = batch[column][i]
            if value is None or (isinstance(value, float) and math.isnan(value)):
                continue
            values[key] = value.item() if isinstance(value, np.generic) else value
        seed = values.pop("seed")
        stop = _stop(values.pop("stop"))
        sampling = Sampling(
            max_tokens=_int(values["max_tokens"], "max_tokens", low=1),
            temperature=_float(values["temperature"], "temperature", low=0.0),
            top_p=_float(values["top_p"], "top_p", low=0.0, high=1.0),
            top_k=_int(values["top_k"], "top_k", low=0),
            stop=stop,
            seed=row_seed(s.seed, prompt) if seed is None else _int(seed, "seed", low=0),
        )
        if sampling.top_p == 0:
            raise ValueError("top_p must lie in (0, 1], got 0")
        return sampling


def _stop(value: Any) -> tuple[str, ...]:
    """A row's stop strings: one, or a list of them (an Arrow list column's value)."""
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list | tuple | np.ndarray) or not all(
        isinstance(x, str) and x for x in items
    ):
        raise ValueError(f"stop must be a string or a list of non-empty strings, got {value!r}")
    return tuple(items)


def _int(value: Any, name: str, *, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float) or int(value) != value:
        raise ValueError(f"{name} must be a whole number, got {value!r}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return int(value)


def _float(value: Any, name: str, *, low: float, high: float = math.inf) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{name} must lie in [{low}, {high}], got {value}")
    return float(value)
