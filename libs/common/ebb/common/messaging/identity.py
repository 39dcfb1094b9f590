"""One NATS identity per worker and per team: decentralised (JWT) authentication with scoped
signing keys.

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
- Teams (owners: the tenants of one installation) are users signed by a second scoped
  signing key, the tenants', whose template binds every subject to `{{name()}}`, the team's
  name: it submits on `<prefix>.submit.<team>`, asks `<prefix>.master.<op>.<team>`, hears
  `<prefix>.jobs.*.events.<team>` and replies on `_INBOX.<prefix>.team.<team>`, and nothing
  else. The operator mints each team's credential (`python -m ebb.common.messaging.installation
  team <name>`) with that key, which no service holds.

Everything is checked by nats-server itself (its memory resolver, preloaded with the operator
and account JWTs); the master checks in addition that a lease token is used by its holder,
and that a job a team asks about is its own.
JWTs follow nats-io/jwt v2 (header `ed25519-nkey`, claims under `nats`); keys are NATS nkeys.

On Kubernetes the keys are made once, by `python -m ebb.common.messaging.installation k8s`
(see `ebb.common.messaging.installation`), and kept in Secrets; in the embedded stack, at each
start.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import time
from dataclasses import dataclass
from typing import Any

import nkeys

from .auth import Permissions, Role, permissions, team_template, user_name, worker_template
from .subjects import check_owner, check_worker_id

_KINDS = {
    "operator": nkeys.PREFIX_BYTE_OPERATOR,
    "account": nkeys.PREFIX_BYTE_ACCOUNT,
    "user": nkeys.PREFIX_BYTE_USER,
}
_UNLIMITED = {"subs": -1, "data": -1, "payload": -1}
_WORKER_ROLE = "worker"
_TEAM_ROLE = "team"
TEAM_TAG = "ebb-team"
"""The tag of a team's JWT: how a client tells that its credential is a team's (and so which
subjects it must use). nats-server needs no tag: the key that signed the JWT decides."""


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


def credentials_claims(creds: str) -> dict[str, Any] | None:
    """The claims of a .creds text's JWT (not verified); None if it has none to read."""
    lines = creds.splitlines()
    for i, line in enumerate(lines[:-1]):
        if "BEGIN NATS USER JWT" in line:
            try:
                return decode_jwt(lines[i + 1].strip())
            except (ValueError, IndexError):
                return None
    return None


def credentials_name(creds: str) -> str | None:
    """The user name a .creds text's JWT gives (a role's user, a worker's id, a team)."""
    claims = credentials_claims(creds)
    name = claims.get("name") if claims is not None else None
    return name if isinstance(name, str) else None


def credentials_team(creds: str) -> str | None:
    """The team a team's .creds text is for (`TeamSigner`); None for any other credential."""
    claims = credentials_claims(creds)
    if claims is None:
        return None
    nats_claims = claims.get("nats")
    tags = nats_claims.get("tags") if isinstance(nats_claims, dict) else None
    name = claims.get("name")
    if isinstance(tags, list) and TEAM_TAG in tags and isinstance(name, str):
        return name
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


def _scoped_credentials(
    account: str, signing_key: Key, name: str, *, ttl_s: float | None, tags: tuple[str, ...] = ()
) -> str:
    """A .creds text for a user `name` signed by a scoped signing key (a fresh user key each
    time): no permissions of its own, the key's template gives them, bound to the name."""
    user = Key.new("user")
    nats_claims: dict[str, Any] = {"issuer_account": account, "type": "user", "version": 2}
    if tags:
        nats_claims["tags"] = list(tags)
    claims: dict[str, Any] = {"sub": user.public, "name": name, "nats": nats_claims}
    if ttl_s is not None:
        claims["exp"] = int(time.time() + ttl_s)
    return credentials(encode_jwt(claims, signing_key), user.seed)


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
        return _scoped_credentials(self.account, self.signing_key, worker, ttl_s=ttl_s)


@dataclass(frozen=True)
class TeamSigner:
    """Mints teams' credentials: holds the tenants' scoped signing key (the operator's, kept
    in a Secret no service reads), which can sign users with the team template's permissions
    only."""

    account: str
    """The public key of Ebb's account."""
    signing_key: Key

    def credentials(self, team: str, *, ttl_s: float | None = None) -> str:
        """A .creds text for `team`: its JWT names the team (and is tagged TEAM_TAG), and the
        template binds its permissions to that name. `ttl_s`: it expires after."""
        check_owner(team)
        return _scoped_credentials(
            self.account, self.signing_key, team, ttl_s=ttl_s, tags=(TEAM_TAG,)
        )


@dataclass(frozen=True)
class Trust:
    """The operator, the accounts and the keys of one Ebb installation on one nats-server."""

    prefix: str
    operator: Key
    system: Key
    account: Key
    worker_signing_key: Key
    tenant_signing_key: Key

    @classmethod
    def new(cls, prefix: str) -> Trust:
        return cls(
            prefix=prefix,
            operator=Key.new("operator"),
            system=Key.new("account"),
            account=Key.new("account"),
            worker_signing_key=Key.new("account"),
            tenant_signing_key=Key.new("account"),
        )

    def worker_signer(self) -> WorkerSigner:
        return WorkerSigner(account=self.account.public, signing_key=self.worker_signing_key)

    def team_signer(self) -> TeamSigner:
        return TeamSigner(account=self.account.public, signing_key=self.tenant_signing_key)

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
        scopes = [
            {
                "kind": "user_scope",
                "key": self.worker_signing_key.public,
                "role": _WORKER_ROLE,
                "template": {**_permission_claims(worker_template(self.prefix)), **_UNLIMITED},
                "description": "one worker: only its own subjects",
            },
            {
                "kind": "user_scope",
                "key": self.tenant_signing_key.public,
                "role": _TEAM_ROLE,
                "template": {**_permission_claims(team_template(self.prefix)), **_UNLIMITED},
                "description": "one team: only its own jobs",
            },
        ]
        jetstream = {"mem_storage": -1, "disk_storage": -1, "streams": -1, "consumer": -1}
        account = encode_jwt(
            {
                "sub": self.account.public,
                "name": self.prefix,
                "nats": {
                    "limits": {**limits, **jetstream},
                    "signing_keys": scopes,
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
