"""The names of every EBB_* environment variable, in one place.

Environment variables are read only at the edge (entrypoints, the CLI) and written only where
a process starts another (the local backend, the embedded stack, the worker pod template).
Both sides name them from here, so that a rename cannot leave one side behind.
"""

from __future__ import annotations

# NATS connection, shared by every service and the CLI (see natsconfig.NATS_ENVIRONMENT).
NATS_URL = "EBB_NATS_URL"
PREFIX = "EBB_PREFIX"
NATS_USER = "EBB_NATS_USER"
NATS_PASSWORD = "EBB_NATS_PASSWORD"  # noqa: S105 - the variable's name, not a secret
NATS_TOKEN = "EBB_NATS_TOKEN"  # noqa: S105 - the variable's name, not a secret
NATS_CREDS = "EBB_NATS_CREDS"
NATS_CREDENTIALS = "EBB_NATS_CREDENTIALS"
"""The text of a .creds file (JWT and nkey seed), for a credential that is minted, not filed."""
NATS_TLS_CA = "EBB_NATS_TLS_CA"
NATS_TLS_CERT = "EBB_NATS_TLS_CERT"
NATS_TLS_KEY = "EBB_NATS_TLS_KEY"
NATS_NAME_PREFIX = "EBB_NATS_"
"""Every variable of the connection starts so: none is inherited by a child as it is."""

# The NATS identity a controller gives the workers it starts.
WORKER_NATS_USER = "EBB_WORKER_NATS_USER"
WORKER_NATS_PASSWORD = "EBB_WORKER_NATS_PASSWORD"  # noqa: S105 - a name, not a secret
WORKER_NATS_SIGNING_KEY = "EBB_WORKER_NATS_SIGNING_KEY"
"""The seed of the account's scoped signing key with which a controller mints one credential
per worker it starts (ebb.common.messaging.identity)."""
WORKER_NATS_ACCOUNT = "EBB_WORKER_NATS_ACCOUNT"
"""The public key of the account those workers belong to."""
WORKER_NATS_NAME_PREFIX = "EBB_WORKER_NATS_"

# Every service.
LOG_LEVEL = "EBB_LOG_LEVEL"
METRICS_PORT = "EBB_METRICS_PORT"

# The worker.
JOB = "EBB_JOB"
WORKER_ID = "EBB_WORKER_ID"
TIER = "EBB_TIER"
SHUTDOWN_GRACE_S = "EBB_SHUTDOWN_GRACE_S"
SHARDS_IN_FLIGHT = "EBB_SHARDS_IN_FLIGHT"
CPUS = "EBB_CPUS"
"""The cores a worker may use, as its launcher sees it (the local backend: its share of the
machine; Kubernetes: its pod's resources.cpu). Its cgroup quota and affinity still bound it."""
DEVICE = "EBB_DEVICE"
"""Set in each stage process: the device it was given (cpu, or cuda:0 with its one GPU
visible), for modelets that place their own tensors."""
CPU_SET = "EBB_CPU_SET"
"""The cores (comma-separated) a worker pins itself, and so its stage processes, to: set by
the local backend when it pins workers (`--pin-cpus`)."""
CHUNK_ROWS = "EBB_CHUNK_ROWS"
"""Rows of a shard a worker reads and has in its pipeline at once."""
START_JITTER_S = "EBB_START_JITTER_S"
MODEL_CACHE_DIR = "EBB_MODEL_CACHE_DIR"
"""Where model files from a store are cached: a worker's own (its stage processes share it),
or the node cache's (ebb.worker.modelcache)."""
MODEL_CACHE_URL = "EBB_MODEL_CACHE_URL"
"""The node's model cache (http://host:port): a worker copies models from there, and from the
store only when the cache cannot serve them. Unset: from the store."""
MODEL_CACHE_MAX_BYTES = "EBB_MODEL_CACHE_MAX_BYTES"
"""The node cache's bound: least recently used models are removed beyond it."""
MODEL_CACHE_PORT = "EBB_MODEL_CACHE_PORT"
MODEL_ROOTS = "EBB_MODEL_ROOTS"
"""The node cache serves objects under these store URIs only (comma-separated): where the
operator keeps models, not the data roots, whose inputs and outputs are no cache's business."""
PARENT_PID = "EBB_PARENT_PID"
"""Set by the local backend: the worker's entry point (ebb.worker.entry) drains once this
process is gone."""
TERMINATION_LOG = "EBB_TERMINATION_LOG"
STAGE_PRELOAD = "EBB_STAGE_PRELOAD"
"""Set by the controller from the job's spec: the model runtimes (comma-separated modules,
`JobSpec.runtime_modules`) that the fork server of the worker's stage processes imports once."""

# Testing.
FAILPOINT_DIR = "EBB_FAILPOINT_DIR"
"""Arms ebb.common.failpoints: a process dies at a named place when a file of that name is
in this folder. Unset (always, outside tests and the chaos campaign): every point is inert."""

# The shard master.
MASTER_ID = "EBB_MASTER_ID"
DATA_ROOTS = "EBB_DATA_ROOTS"
LEADER_TTL_S = "EBB_LEADER_TTL_S"
JOB_RETENTION_S = "EBB_JOB_RETENTION_S"
"""Seconds a finished job stays in the master's memory and KV (its output stays)."""
SPLIT_HALVES = "EBB_SPLIT_HALVES"
"""`0`: the master moves a split's rest whole, never cut in two for an idle worker (how the
liquid tail split before; benchmarks compare the two)."""
JS_REPLICAS = "EBB_JS_REPLICAS"
"""Copies of the jobs stream and the KV buckets on a NATS cluster (3 on three servers)."""

# The controller.
BACKEND = "EBB_BACKEND"
MAX_WORKERS = "EBB_MAX_WORKERS"
PIN_CPUS = "EBB_PIN_CPUS"
"""The local backend pins each worker to cores of its own (1) or lets them float (unset)."""
WORKER_LOG_DIR = "EBB_WORKER_LOG_DIR"
CONTROLLER_CONFIG = "EBB_CONTROLLER_CONFIG"
CONTROLLER_ID = "EBB_CONTROLLER_ID"
NAMESPACE = "EBB_NAMESPACE"
POD_NAME = "EBB_POD_NAME"

# The Batch API gateway.
GATEWAY_CONFIG = "EBB_GATEWAY_CONFIG"
"""Its configuration file: the model catalogue, the keys, the limits (ebb.gateway.config)."""
GATEWAY_HOST = "EBB_GATEWAY_HOST"
GATEWAY_PORT = "EBB_GATEWAY_PORT"

# The CLI.
CREDENTIALS = "EBB_CREDENTIALS"
CLI_LOG_LEVEL = "EBB_CLI_LOG_LEVEL"
RUNS_DIR = "EBB_RUNS_DIR"
"""Where `ebb run` keeps its stacks' state (ebb.client.runs)."""


def role_password(role: str) -> str:
    """The variable that holds the NATS password of a role (`ebb.common.messaging.auth`)."""
    return f"EBB_{role.upper()}_PASSWORD"
