"""How to reach NATS: the connection settings, from the environment (EBB_NATS_*), the
command line, or written for a child process."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .. import envvars


@dataclass(frozen=True, kw_only=True)
class NatsConfig:
    url: str = "nats://127.0.0.1:4222"
    """One server URL, or several separated by commas."""
    prefix: str = "ebb"
    """First token of every subject and name, so that several Ebb installations can share NATS."""
    user: str | None = None
    password: str | None = None
    token: str | None = None
    creds_file: str | None = None
    """A NATS .creds file (JWT + nkey seed)."""
    creds: str | None = field(default=None, repr=False)
    """The text of a .creds file: a credential minted for this process
    (ebb.common.messaging.identity)."""
    inbox_prefix: str | None = None
    """Where replies to this connection's requests come; None: its role's
    (ebb.common.messaging.auth) for a role user, else NATS's default."""
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    connect_timeout_s: float = 5.0
    request_timeout_s: float = 5.0
    """Time a request waits for its reply before it is retried."""
    first_connect_timeout_s: float | None = None
    """How long the first connection may take (NATS starting up); None: as long as it takes."""

    @property
    def servers(self) -> list[str]:
        return [u.strip() for u in self.url.split(",") if u.strip()]


NATS_ENVIRONMENT: dict[str, str] = {
    "url": envvars.NATS_URL,
    "prefix": envvars.PREFIX,
    "user": envvars.NATS_USER,
    "password": envvars.NATS_PASSWORD,
    "token": envvars.NATS_TOKEN,
    "creds_file": envvars.NATS_CREDS,
    "creds": envvars.NATS_CREDENTIALS,
    "tls_ca": envvars.NATS_TLS_CA,
    "tls_cert": envvars.NATS_TLS_CERT,
    "tls_key": envvars.NATS_TLS_KEY,
}
"""The NatsConfig field each EBB_NATS_* variable sets: read and written through this alone."""


def nats_config_from_env(environ: Mapping[str, str], **given: Any) -> NatsConfig:
    """The NATS settings in `environ`; `given` values that are not None take precedence
    (the command line over the environment)."""
    found: dict[str, Any] = {
        field: environ[name] for field, name in NATS_ENVIRONMENT.items() if environ.get(name)
    }
    found.update({field: value for field, value in given.items() if value is not None})
    return NatsConfig(**found)


def nats_environment(config: NatsConfig) -> dict[str, str]:
    """Environment that gives a child process the same NATS connection settings."""
    pairs = {name: getattr(config, field) for field, name in NATS_ENVIRONMENT.items()}
    return {k: v for k, v in pairs.items() if v}


def add_nats_arguments(parser: Any) -> None:
    """The NATS options every service takes: flags, defaulting to EBB_NATS_* variables.

    Secrets (password, token) are read from the environment only, never from the command
    line, where any user of the machine could see them in the process list.
    """
    parser.add_argument("--nats", help=f"NATS URL (default: {envvars.NATS_URL}, else local)")
    parser.add_argument("--prefix", help=f"subject prefix (default: {envvars.PREFIX}, else ebb)")
    parser.add_argument("--nats-user")
    parser.add_argument("--nats-creds", help=".creds file")
    parser.add_argument("--nats-tls-ca")
    parser.add_argument("--nats-tls-cert")
    parser.add_argument("--nats-tls-key")


def nats_config_from_args(args: Any) -> NatsConfig:
    return nats_config_from_env(
        os.environ,
        url=args.nats,
        prefix=args.prefix,
        user=args.nats_user,
        creds_file=args.nats_creds,
        tls_ca=args.nats_tls_ca,
        tls_cert=args.nats_tls_cert,
        tls_key=args.nats_tls_key,
    )
