"""Shared by every part of Ebb, and depending on none of them.

- `messaging/`: messages, subjects, connections, roles and identities on NATS;
- `data/`: stores, the output root and its commit protocol;
- `job/`: the job spec, its checks, and the metrics a stage computes;
- here, the foundation every folder may use: `errors`, `schema` (plain data <-> dataclasses),
  `envvars`, `log`, `metrics` (Prometheus and health), `aio` and `supervisor` (a service's
  tasks and stopping), `runner` (a service's main), `host` (this machine's cores),
  `lifecycle` (named state machines), `failpoints`, `mlflow_export`.
"""

__version__ = "0.1.0"
