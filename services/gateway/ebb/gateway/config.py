"""The gateway's configuration file: the model catalogue, the keys and their quotas, limits.

```yaml
root: s3://batch/gateway         # files and batches' data: under the master's data roots
models:
  labeller:                      # the `model` a request's body names
    stage:                       # the llm stage its batches run: a pipeline stage's fields
      llm: {model: s3://batch/models/labeller, engine: server, command: [vllm, serve, ...]}
      batch_size: 256
      device: cuda
    resources: {max_workers: 8, gpu: 1, pool: offline}
    rows_per_shard: 1000
  minilm:                        # /v1/embeddings: a SentenceEncoder stage
    stage:
      modelet: ebb.worker.modelets:SentenceEncoder
      params: {model: s3://batch/models/all-MiniLM-L6-v2, backend: onnx}
    dimensions: false            # requests may not ask for fewer (not a Matryoshka model)
keys:
  - {owner: team-a, sha256: 9f86d0...}   # the key's SHA-256 (hex), or `key:` itself
    max_active_batches: 10
windows:
  24h: {seconds: 86400, priority: -10}   # completion_window -> when it expires, its priority
```
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ebb.common import schema
from ebb.common.errors import SchemaError, SpecError
from ebb.common.job.fields import Pool, bad, positive
from ebb.common.job.paths import is_url
from ebb.common.job.pipeline import StageSpec
from ebb.common.job.sections import FaultPolicy, ResourceSpec
from ebb.common.messaging.subjects import OWNER_RE

# An owner is one NATS subject token (the records' keys are `<owner>.<id>`) and the name of
# the team whose NATS identity reads its batches' jobs (ebb.common.messaging.subjects): one
# rule for both, OWNER_RE.


GATEWAY_COLUMNS = ("prompt", "text")
"""The llm stage's prompt and output columns: the gateway's to name, not the catalogue's."""

SENTENCE_ENCODER = "ebb.worker.modelets:SentenceEncoder"
"""The modelet of a catalogue model that answers `/v1/embeddings`."""
ENCODER_PARAMS = {
    "column": "input",
    "ids_column": "input_ids",
    "output": "embedding",
    "inputs": "many",
    "dimensions_column": "dimensions",
    "truncate": False,
    "count_tokens": True,
}
"""The SentenceEncoder's parameters the requests set: a row per request, its inputs as texts
or token ids, its own dimensions; an input over the model's context refused, as the API
refuses it."""
GENERATION_ENDPOINTS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/messages",
)
EMBEDDING_ENDPOINTS = ("/v1/embeddings",)


API_SAMPLING: dict[str, Any] = {"temperature": 1.0, "max_tokens": None}
"""What a request that omits them gets, as the OpenAI API means it (sampled at 1.0, up to
the rest of the context), unless the catalogue model's `llm.sampling` says otherwise."""


@dataclass(frozen=True, kw_only=True)
class CatalogueModel:
    """One model the gateway serves: the job a batch of requests naming it becomes."""

    stage: dict[str, Any]
    """The llm stage (a pipeline stage's fields, `llm` among them), whose prompt, output and
    per-row sampling are the requests' (the gateway sets them); or a stage of the
    SentenceEncoder modelet, for `/v1/embeddings` (its `params.model` the encoder's folder;
    the columns are the gateway's to set)."""
    resources: ResourceSpec = field(default_factory=ResourceSpec)
    """Workers of a batch's job, and what each asks for."""
    rows_per_shard: int | None = None
    """Requests in one shard (the unit of leasing, retry and commit). None: sized for the
    fleet, as a job's."""
    fault: dict[str, Any] = field(default_factory=dict)
    """The job's fault policy, but `max_error_fraction`: a request that fails is a line of
    the error file, never a failed batch."""
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict[str, Any]] = field(default_factory=list)
    dimensions: bool = False
    """An embeddings model: requests may ask for fewer `dimensions` (a model trained so that
    the first ones hold up on their own, Matryoshka-style)."""

    @property
    def embeds(self) -> bool:
        """It answers `/v1/embeddings` (a SentenceEncoder stage), not the generative ones."""
        return self.stage.get("modelet") == SENTENCE_ENCODER

    @property
    def endpoints(self) -> tuple[str, ...]:
        return EMBEDDING_ENDPOINTS if self.embeds else GENERATION_ENDPOINTS

    def __post_init__(self) -> None:
        if self.embeds:
            self._check_encoder()
        else:
            self._check_llm()
        if "name" in self.stage:
            raise bad("stage.name", "set by the gateway")
        try:
            self.stage_spec()
            schema.load(FaultPolicy, self.fault, path="fault")
        except SchemaError as e:
            raise SpecError(e.path, e.problem) from None

    def _check_encoder(self) -> None:
        params = self.stage.get("params")
        if not isinstance(params, dict) or not params.get("model"):
            raise bad("stage.params", "a SentenceEncoder needs params.model, its folder")
        for key in ENCODER_PARAMS:
            if key in params:
                raise bad(f"stage.params.{key}", "set by the gateway from the requests")
        if "llm" in self.stage:
            raise bad("stage.llm", "a stage is an llm stage or a SentenceEncoder, not both")

    def _check_llm(self) -> None:
        if self.dimensions:
            raise bad("dimensions", "only an embeddings model takes dimensions")
        llm = self.stage.get("llm")
        if not isinstance(llm, dict) or not llm.get("model"):
            raise bad(
                "stage.llm",
                f"a catalogue model is an llm stage (it needs llm.model) or a {SENTENCE_ENCODER}"
                " stage",
            )
        for key in ("prompt", "output", "per_row", "tokenize_only"):
            if key in llm:
                raise bad(f"stage.llm.{key}", "set by the gateway from the requests")
        if not isinstance(llm.get("sampling", {}), dict):
            raise bad("stage.llm.sampling", "must be a mapping of sampling fields")

    def stage_spec(self) -> StageSpec:
        """The stage a batch runs: the catalogue's, with the requests' columns."""
        if self.embeds:
            params = {**self.stage["params"], **ENCODER_PARAMS}
            metrics = {"prompt_tokens": {"kind": "sum", "column": "prompt_tokens"}}
            body = {"metrics": metrics, **self.stage, "name": "embed", "params": params}
            return schema.load(StageSpec, body, path="stage")
        llm = {
            **self.stage["llm"],
            "sampling": {**API_SAMPLING, **self.stage["llm"].get("sampling", {})},
            "prompt": "prompt",
            "output": "text",
            "per_row": {
                k: k
                for k in (
                    "max_tokens",
                    "temperature",
                    "top_p",
                    "top_k",
                    "seed",
                    "stop",
                    "structured",
                )
            },
        }
        metrics = {"output_tokens": {"kind": "sum", "column": "output_tokens"}}
        body = {"metrics": metrics, **self.stage, "name": "generate", "llm": llm}
        return schema.load(StageSpec, body, path="stage")


@dataclass(frozen=True, kw_only=True)
class ApiKey:
    """A key the gateway accepts, whose owner's files and batches it sees (and no other's)."""

    owner: str
    """Whose files and batches: 1-64 letters, digits, - and _. Also the NATS team its
    batches' jobs are submitted under: that team's credential (`python -m
    ebb.common.messaging.installation team <owner>`) reads them with `ebb status`."""
    key: str | None = None
    """The key itself (a file only its operator reads), or"""
    sha256: str | None = None
    """its SHA-256, hex (`printf %s "$KEY" | sha256sum`)."""
    max_active_batches: int | None = None
    """Batches not yet ended at once; one more is refused (429)."""
    max_stored_bytes: int | None = None
    """Bytes of files kept at once (uploads and results); an upload past it is refused (429)."""

    def __post_init__(self) -> None:
        if not OWNER_RE.fullmatch(self.owner):
            raise bad("owner", f"must match {OWNER_RE.pattern}, got {self.owner!r}")
        if (self.key is None) == (self.sha256 is None):
            raise bad("key", "give exactly one of key and sha256")
        if self.sha256 is not None and not re.fullmatch(r"[0-9a-f]{64}", self.sha256):
            raise bad("sha256", "must be 64 lowercase hex digits")
        if self.max_active_batches is not None:
            positive("max_active_batches", self.max_active_batches)
        if self.max_stored_bytes is not None:
            positive("max_stored_bytes", self.max_stored_bytes)

    @property
    def digest(self) -> str:
        if self.sha256 is not None:
            return self.sha256
        assert self.key is not None
        return key_digest(self.key)


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True, kw_only=True)
class Window:
    """A `completion_window` a batch may ask for."""

    seconds: float
    """From creation to expiry: a batch not done by then ends `expired`, with what it did."""
    priority: int = 0
    """Its job's priority: lower runs after others, on what capacity is left."""
    pool: Pool | None = None
    """Where its job's workers may run (a job's `resources.pool`: `mixed`, the nodes the tide
    lends, first), over the catalogue model's. None: the model's."""

    def __post_init__(self) -> None:
        positive("seconds", self.seconds)


@dataclass(frozen=True, kw_only=True)
class GatewayConfig:
    root: str
    """Where uploaded files, results and batches' jobs lie: a folder or object-store URL
    under the shard master's data roots (jobs read and write there)."""
    models: dict[str, CatalogueModel]
    keys: list[ApiKey] = field(default_factory=list)
    """The keys accepted (and `keys_file`'s)."""
    keys_file: str | None = None
    """A YAML list of more keys, in a file of its own (a Kubernetes Secret's): the catalogue
    may then be a ConfigMap anyone may read."""
    windows: dict[str, Window] = field(default_factory=lambda: {"24h": Window(seconds=86400)})
    max_file_bytes: int = 200 * 1024 * 1024
    """Largest upload (the API's 200 MB); a bigger one is refused (413) as it streams in."""
    max_requests: int = 50_000
    """Most requests (lines) in one batch's file."""
    max_line_bytes: int = 1024 * 1024
    """Largest request line; a bigger one is an error line of its own (413)."""
    file_expiry_s: float = 30 * 86400.0
    """How long an uploaded file is kept (the API's default for `purpose: batch`)."""

    def __post_init__(self) -> None:
        if not self.root:
            raise bad("root", "must name a folder or object-store URL")
        if not is_url(self.root) and not Path(self.root).is_absolute():
            raise bad("root", f"must be absolute, got {self.root!r}")
        if not self.models:
            raise bad("models", "the catalogue needs at least one model")
        if not self.keys:
            raise bad("keys", "needs at least one key (here or in keys_file): nobody could use it")
        if not self.windows:
            raise bad("windows", "needs at least one completion window")
        owners: dict[str, str] = {}
        for k in self.keys:
            if owners.setdefault(k.digest, k.owner) != k.owner:
                raise bad("keys", f"one key is given to two owners ({owners[k.digest]}, {k.owner})")
        for name in ("max_file_bytes", "max_requests", "max_line_bytes", "file_expiry_s"):
            positive(name, getattr(self, name))

    def owner_of(self, key: str) -> ApiKey | None:
        """The key's entry, if the gateway accepts it (compared in constant time)."""
        digest = key_digest(key)
        found = None
        for k in self.keys:
            if hmac.compare_digest(k.digest, digest):
                found = k
        return found


def _resolved(data: dict[str, Any], base: Path) -> dict[str, Any]:
    """The root and the catalogue's model folders as given, or, relative, taken from the
    configuration file's folder (as a job file's paths are)."""

    def at(uri: object) -> object:
        if isinstance(uri, str) and uri and not is_url(uri) and not Path(uri).is_absolute():
            return str(base / uri)
        return uri

    data = {**data, "root": at(data.get("root"))}
    models = data.get("models")
    if isinstance(models, dict):
        resolved = {}
        for name, entry in models.items():
            llm = entry.get("stage", {}).get("llm") if isinstance(entry, dict) else None
            resolved[name] = entry
            if isinstance(llm, dict) and "model" in llm:
                llm = {**llm, "model": at(llm["model"])}
                resolved[name] = {**entry, "stage": {**entry["stage"], "llm": llm}}
        data["models"] = resolved
    return data


def load_config(path: str | Path) -> GatewayConfig:
    """Read the YAML (or JSON) configuration; SpecError naming the first bad field."""
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text())
    except OSError as e:
        raise SpecError("", f"cannot read the gateway configuration {p}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise SpecError("", f"{p} is not valid YAML or JSON: {e}") from None
    if isinstance(data, dict):
        data = _resolved(data, p.resolve().parent)
    if isinstance(data, dict) and data.get("keys_file"):
        keys_path = p.parent / str(data["keys_file"])
        try:
            more = yaml.safe_load(keys_path.read_text())
        except OSError as e:
            raise SpecError("keys_file", f"cannot read {keys_path}: {e.strerror}") from None
        except yaml.YAMLError as e:
            raise SpecError("keys_file", f"{keys_path} is not valid YAML: {e}") from None
        if not isinstance(more, list):
            raise SpecError("keys_file", f"{keys_path} must hold a list of keys")
        data = {**data, "keys": [*(data.get("keys") or []), *more]}
    try:
        config = schema.load(GatewayConfig, data, strict=True)
    except SpecError:
        raise
    except SchemaError as e:
        raise SpecError(e.path, e.problem) from None
    return config
