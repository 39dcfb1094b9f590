"""One NATS identity per worker: decentralised (JWT) authentication with a scoped signing key.

With one shared `worker` user, NATS cannot tell two workers apart: any of them could listen to
the replies meant for another (which carry lease tokens) or ask in its name. Here every worker
gets a credential of its own, minted by the controller that launches it:

- An operator (its key made here, at each start of the stack) vouches for two accounts: the
  system account nats-server requires, and Ebb's account, which holds every user and JetStream.
- Ebb's roles (master, controller, client) are users of that account, each with the subject
  permissions `ebb.common.messaging.auth` gives its role, signed by the account's own key.
- Workers are users signed by a *scoped* signing key of the account. nats-server ignores any
  permissions such a user's JWT claims and applies the key's template instead, where
  `{{name()}}` is the user's name: the worker id. So a worker may publish only on
  `<prefix>.master.<op>.<its id>` and subscribe only to `_INBOX.<prefix>.worker.<its id>.>`,
  whatever it asks for; and the key, held by the controller, can mint nothing else.

Everything is checked by nats-server itself (its memory resolver, preloaded with the operator
and account JWTs); the master checks in addition that a lease token is used by its holder.
JWTs follow nats-io/jwt v2 (header `ed25519-nkey`, claims under `nats`); keys are NATS nkeys.

On Kubernetes the keys are made once, by `python -m ebb.common.messaging.identity k8s` (see
`kubernetes_secrets`), and kept in Secrets; in the embedded stack, at each start.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import time
from dataclasses import dataclass
from typing import Any

import nkeys
import yaml

from .auth import Permissions, Role, permissions, user_name, worker_template
from .subjects import check_worker_id

_KINDS = {
    "operator": nkeys.PREFIX_BYTE_OPERATOR,
    "account": nkeys.PREFIX_BYTE_ACCOUNT,
    "user": nkeys.PREFIX_BYTE_USER,
}
_UNLIMITED = {"subs": -1, "data": -1, "payload": -1}
_WORKER_ROLE = "worker"


@dataclass(frozen=True)
class Key:
    """An nkey: `seed` (secret, `S...`) and its public key (`O...`, `A...`, `U...`)."""

    seed: str
    public: str

    @classmethod
    def new(cls, kind: str) -> Key:
        return cls.from_seed(nkeys.encode_seed(os.urandom(32), _KINDS[kind]).decode())

    @classmethod
    def from_seed(cls, seed: str) -> Key:
        try:
            pair = nkeys.from_seed(bytearray(seed.strip().encode()))
        except (nkeys.NkeysError, ValueError) as e:
            raise ValueError(f"not an nkey seed: {e}") from None
        return cls(seed=seed.strip(), public=pair.public_key.decode())

    def sign(self, data: bytes) -> bytes:
        pair = nkeys.from_seed(bytearray(self.seed.encode()))
        try:
            signature: bytes = pair.sign(data)
            return signature
        finally:
            pair.wipe()


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def encode_jwt(claims: dict[str, Any], issuer: Key) -> str:
    """A NATS JWT of `claims` (iss, iat and jti filled in), signed by `issuer`."""
    body = {**claims, "iss": issuer.public, "iat": int(time.time())}
    # The claims' id: a hash of the claims themselves, as nats-io/jwt computes it.
    digest = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).digest()
    body["jti"] = base64.b32encode(digest).decode().rstrip("=")
    header = _b64(json.dumps({"typ": "JWT", "alg": "ed25519-nkey"}).encode())
    payload = _b64(json.dumps(body, separators=(",", ":")).encode())
    signed = f"{header}.{payload}"
    return f"{signed}.{_b64(issuer.sign(signed.encode()))}"


def decode_jwt(token: str) -> dict[str, Any]:
    """The claims of a JWT (not verified: for reading one's own)."""
    payload = token.split(".")[1]
    claims: dict[str, Any] = json.loads(
        base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4))
    )
    return claims


def _permission_claims(p: Permissions) -> dict[str, Any]:
    claims: dict[str, Any] = {
        "pub": {"allow": list(p.publish)},
        "sub": {"allow": list(p.subscribe)},
    }
    if p.allow_responses:
        claims["resp"] = {"max": 1, "ttl": 0}  # as `allow_responses: true` in a config file
    return claims


def credentials_name(creds: str) -> str | None:
    """The user name a .creds text's JWT gives (a role's user, or a worker's id)."""
    lines = creds.splitlines()
    for i, line in enumerate(lines[:-1]):
        if "BEGIN NATS USER JWT" in line:
            try:
                name = decode_jwt(lines[i + 1].strip()).get("name")
            except (ValueError, IndexError):
                return None
            return name if isinstance(name, str) else None
    return None


def credentials(jwt: str, seed: str) -> str:
    """The text of a NATS .creds file: what a NATS client connects with."""
    return (
        "-----BEGIN NATS USER JWT-----\n"
        f"{jwt}\n"
        "------END NATS USER JWT------\n\n"
        "-----BEGIN USER NKEY SEED-----\n"
        f"{seed}\n"
        "------END USER NKEY SEED------\n"
    )


@dataclass(frozen=True)
class WorkerSigner:
    """Mints workers' credentials: holds the account's scoped signing key (what the
    controller is given), which can sign users with the worker template's permissions only."""

    account: str
    """The public key of Ebb's account."""
    signing_key: Key

    def credentials(self, worker: str, *, ttl_s: float | None = None) -> str:
        """A .creds text for `worker` alone (a fresh user key each time): its JWT names it,
        and the template binds its permissions to that name. `ttl_s`: it expires after."""
        check_worker_id(worker)
        user = Key.new("user")
        claims: dict[str, Any] = {
            "sub": user.public,
            "name": worker,
            "nats": {"issuer_account": self.account, "type": "user", "version": 2},
        }
        if ttl_s is not None:
            claims["exp"] = int(time.time() + ttl_s)
        return credentials(encode_jwt(claims, self.signing_key), user.seed)


@dataclass(frozen=True)
class Trust:
    """The operator, the accounts and the keys of one Ebb installation on one nats-server."""

    prefix: str
    operator: Key
    system: Key
    account: Key
    worker_signing_key: Key

    @classmethod
    def new(cls, prefix: str) -> Trust:
        return cls(
            prefix=prefix,
            operator=Key.new("operator"),
            system=Key.new("account"),
            account=Key.new("account"),
            worker_signing_key=Key.new("account"),
        )

    def worker_signer(self) -> WorkerSigner:
        return WorkerSigner(account=self.account.public, signing_key=self.worker_signing_key)

    def role_credentials(self, role: Role) -> str:
        """A .creds text for one of Ebb's roles (the worker role has none: see
        `worker_signer`)."""
        if role == _WORKER_ROLE:
            raise ValueError("workers get credentials of their own: use worker_signer()")
        user = Key.new("user")
        nats_claims = {
            **_permission_claims(permissions(self.prefix, role)),
            **_UNLIMITED,
            "type": "user",
            "version": 2,
        }
        claims = {"sub": user.public, "name": user_name(self.prefix, role), "nats": nats_claims}
        return credentials(encode_jwt(claims, self.account), user.seed)

    def server_config(self) -> str:
        """The nats-server configuration that trusts this operator and knows both accounts."""
        operator = encode_jwt(
            {
                "sub": self.operator.public,
                "name": f"{self.prefix}-operator",
                "nats": {"system_account": self.system.public, "type": "operator", "version": 2},
            },
            self.operator,
        )
        limits = {
            **_UNLIMITED,
            "imports": -1,
            "exports": -1,
            "wildcards": True,
            "conn": -1,
            "leaf": -1,
        }
        system = encode_jwt(
            {
                "sub": self.system.public,
                "name": "SYS",
                "nats": {"limits": limits, "type": "account", "version": 2},
            },
            self.operator,
        )
        template = worker_template(self.prefix)
        scope = {
            "kind": "user_scope",
            "key": self.worker_signing_key.public,
            "role": _WORKER_ROLE,
            "template": {**_permission_claims(template), **_UNLIMITED},
            "description": "one worker: only its own subjects",
        }
        jetstream = {"mem_storage": -1, "disk_storage": -1, "streams": -1, "consumer": -1}
        account = encode_jwt(
            {
                "sub": self.account.public,
                "name": self.prefix,
                "nats": {
                    "limits": {**limits, **jetstream},
                    "signing_keys": [scope],
                    "type": "account",
                    "version": 2,
                },
            },
            self.operator,
        )
        return (
            f"operator: {operator}\n"
            f"system_account: {self.system.public}\n"
            "resolver: MEMORY\n"
            "resolver_preload: {\n"
            f"  {self.system.public}: {system}\n"
            f"  {self.account.public}: {account}\n"
            "}\n"
        )


SERVER_SECRET = "nats-auth"  # noqa: S105 - a Secret's name
"""The Secret (after the prefix) with nats-server's operator and accounts: `auth.conf`."""
SERVER_SECRET_KEY = "auth.conf"  # noqa: S105 - a key's name
SIGNER_SECRET = "nats-worker-signer"  # noqa: S105 - a Secret's name
"""The Secret (after the prefix) with the key that signs workers' credentials: only the
controller reads it."""
CREDS_KEY = "creds"
"""The key of a role's Secret (`<prefix>-nats-<role>`) that holds its .creds text."""
_SECRET_ROLES: tuple[Role, ...] = ("master", "controller", "client", "gateway")


def kubernetes_secrets(
    trust: Trust, *, namespace: str, name_prefix: str = "ebb"
) -> list[dict[str, Any]]:
    """The Secrets of one installation on Kubernetes, from `trust`:

    - `<name_prefix>-nats-auth`: `auth.conf`, which nats-server's configuration includes
      (operator, system account, Ebb's account with the workers' scoped signing key);
    - `<name_prefix>-nats-{master,controller,client,gateway}`: `creds`, each role's
      credentials;
    - `<name_prefix>-nats-worker-signer`: `signing_key` (a seed) and `account` (a public key),
      with which the controller mints each worker pod a credential of its own.
    """

    def secret(name: str, data: dict[str, str]) -> dict[str, Any]:
        return {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {
                "name": f"{name_prefix}-{name}",
                "namespace": namespace,
                "labels": {"app.kubernetes.io/part-of": "ebb"},
            },
            "type": "Opaque",
            "stringData": data,
        }

    return [
        secret(SERVER_SECRET, {SERVER_SECRET_KEY: trust.server_config()}),
        *(
            secret(f"nats-{role}", {CREDS_KEY: trust.role_credentials(role)})
            for role in _SECRET_ROLES
        ),
        secret(
            SIGNER_SECRET,
            {"signing_key": trust.worker_signing_key.seed, "account": trust.account.public},
        ),
    ]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m ebb.common.messaging.identity",
        description="Make the NATS keys of a new Ebb installation (an operator, its accounts, "
        "each role's credentials and the key that signs workers' credentials) and print them.",
    )
    commands = p.add_subparsers(dest="command", required=True)
    k8s = commands.add_parser(
        "k8s",
        help="as Kubernetes Secrets, for `kubectl create -f -` (create, never apply: "
        "running it again makes new keys, which would lock out running pods)",
    )
    k8s.add_argument("--namespace", default="ebb")
    k8s.add_argument("--prefix", default="ebb", help="Ebb's subject prefix (EBB_PREFIX)")
    k8s.add_argument("--name-prefix", default="ebb", help="what the Secrets' names start with")
    args = p.parse_args(argv)
    trust = Trust.new(args.prefix)
    secrets = kubernetes_secrets(trust, namespace=args.namespace, name_prefix=args.name_prefix)
    text = yaml.dump_all(secrets, Dumper=_BlockDumper, sort_keys=False, explicit_start=True)
    print(text, end="")


class _BlockDumper(yaml.SafeDumper):
    """Multi-line strings (a .creds text, a configuration) as YAML block literals, readable."""


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_BlockDumper.add_representer(str, _represent_str)


if __name__ == "__main__":
    main()
