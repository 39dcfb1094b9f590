"""One installation's keys as the operator handles them: the Kubernetes Secrets that
`k8s/make-secrets.sh` prints (every role's credentials, the signers' keys), and a team's
credential minted from the tenants' Secret.

    python -m ebb.common.messaging.installation k8s --namespace ebb | kubectl create -f -
    kubectl -n ebb get secret ebb-nats-tenant-signer -o yaml \\
        | python -m ebb.common.messaging.installation team team-a --signer - > team-a.creds
"""

from __future__ import annotations

import argparse
import base64
import sys
from pathlib import Path
from typing import Any

import yaml

from .auth import Role
from .identity import Key, TeamSigner, Trust

SERVER_SECRET = "nats-auth"  # noqa: S105 - a Secret's name
"""The Secret (after the prefix) with nats-server's operator and accounts: `auth.conf`."""
SERVER_SECRET_KEY = "auth.conf"  # noqa: S105 - a key's name
SIGNER_SECRET = "nats-worker-signer"  # noqa: S105 - a Secret's name
"""The Secret (after the prefix) with the key that signs workers' credentials: only the
controller reads it."""
TENANT_SIGNER_SECRET = "nats-tenant-signer"  # noqa: S105 - a Secret's name
"""The Secret (after the prefix) with the key that signs teams' credentials: no pod reads it;
the operator does, to mint a team's credential (`team`)."""
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
      with which the controller mints each worker pod a credential of its own;
    - `<name_prefix>-nats-tenant-signer`: the same for teams, with which the operator mints
      each team a credential of its own (`python -m ebb.common.messaging.identity team`).
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
        secret(
            TENANT_SIGNER_SECRET,
            {"signing_key": trust.tenant_signing_key.seed, "account": trust.account.public},
        ),
    ]


def read_signer(text: str) -> TeamSigner:
    """The tenants' signer from a Kubernetes Secret as `kubectl get secret -o yaml` (or
    `-o json`) prints it (`data`, base64) or as `kubernetes_secrets` writes it
    (`stringData`). ValueError if it holds no such key."""
    try:
        secret = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(f"not a Secret (YAML or JSON): {e}") from None
    if not isinstance(secret, dict):
        raise ValueError("not a Secret (YAML or JSON)")  # noqa: TRY004 - bad input, not a bug
    values: dict[str, str] = {}
    for key, value in (secret.get("data") or {}).items():
        try:
            values[key] = base64.b64decode(str(value), validate=True).decode()
        except (ValueError, UnicodeDecodeError):
            raise ValueError(f"the Secret's data.{key} is not base64") from None
    values.update({k: str(v) for k, v in (secret.get("stringData") or {}).items()})
    if "signing_key" not in values or "account" not in values:
        raise ValueError("the Secret has no signing_key and account (is it the tenant signer?)")
    key = Key.from_seed(values["signing_key"])
    account = values["account"].strip()
    if not key.public.startswith("A") or not account.startswith("A"):
        raise ValueError("the Secret's signing_key and account are not an account's keys")
    return TeamSigner(account=account, signing_key=key)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m ebb.common.messaging.installation",
        description="Make the NATS keys of a new Ebb installation (an operator, its accounts, "
        "each role's credentials and the keys that sign workers' and teams' credentials) and "
        "print them; or mint one team's credential with the tenants' key.",
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
    team = commands.add_parser(
        "team",
        help="print a team's .creds (its jobs and no other team's), minted with the tenants' "
        "signing key",
    )
    team.add_argument("name", help="the team (an owner of the Batch API gateway's keys)")
    team.add_argument(
        "--signer",
        required=True,
        metavar="FILE",
        help="the Secret ebb-nats-tenant-signer as `kubectl get secret -o yaml` prints it "
        "(- : read it from stdin)",
    )
    team.add_argument(
        "--ttl-days", type=float, default=None, help="it expires after (default: never)"
    )
    args = p.parse_args(argv)
    if args.command == "team":
        try:
            text = sys.stdin.read() if args.signer == "-" else Path(args.signer).read_text()
            signer = read_signer(text)
            ttl_s = None if args.ttl_days is None else args.ttl_days * 86400.0
            print(signer.credentials(args.name, ttl_s=ttl_s), end="")
        except (OSError, ValueError) as e:
            p.error(str(e))
        return
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
