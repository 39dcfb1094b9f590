"""The pure parts of owners as NATS identities: subjects, permissions, the team template, team
credentials and their minting. (A real nats-server enforcing them: test_owners.)"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
import yaml

from ebb.common.messaging import auth, identity, installation
from ebb.common.messaging.bus import connection_owner
from ebb.common.messaging.natsconfig import NatsConfig
from ebb.common.messaging.subjects import OWNER_RE, Subjects, check_owner
from ebb.common.messaging.submission import job_id_of, message_id


def test_an_owner_is_one_subject_token_and_the_gateway_s_owners_are_the_same() -> None:
    from ebb.common.errors import SpecError
    from ebb.gateway.config import ApiKey

    assert check_owner("team-a_2") == ApiKey(owner="team-a_2", key="k").owner == "team-a_2"
    assert OWNER_RE.pattern == r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$"
    for bad in ("a.b", "t*", "t>", "", "-t", "t 1", "x" * 65, "t\n"):
        with pytest.raises(ValueError, match="bad owner"):
            check_owner(bad)
        # An API key's owner is a team's name: the gateway refuses what NATS could not name.
        with pytest.raises(SpecError, match="owner"):
            ApiKey(owner=bad, key="k")


def test_an_owner_s_subjects_name_it_and_a_job_is_read_back_from_its_events() -> None:
    s = Subjects("ebb")
    assert s.owner_submit("team-a") == "ebb.submit.team-a"
    assert s.owner_op("status", "team-a") == "ebb.master.status.team-a"
    assert s.events("j1") == "ebb.jobs.j1.events"  # a job without an owner: as before
    assert s.events("j1", "team-a") == "ebb.jobs.j1.events.team-a"
    assert s.every_event == ("ebb.jobs.*.events", "ebb.jobs.*.events.*")
    assert Subjects.event_job(s.events("j1")) == Subjects.event_job(s.events("j1", "t")) == "j1"
    assert s.submission_owner("ebb.jobs.submit") == ""
    assert s.submission_owner("ebb.submit.team-a") == "team-a"
    for other in ("ebb.submit", "other.submit.team-a", "ebb.jobs.submit.x", "ebb.submit.a.b"):
        with pytest.raises(ValueError):
            s.submission_owner(other)
    # A job named "submit" has events no submission subject matches (and no owner is one).
    assert not s.events("submit").startswith("ebb.submit.")


def test_an_owner_s_submission_id_is_its_own_and_read_back_for_it_alone() -> None:
    assert message_id("j1") == "j1" and job_id_of("j1") == "j1"
    assert message_id("j1", "team-a") == "team-a.j1"
    assert job_id_of("team-a.j1", "team-a") == "j1"
    assert job_id_of("team-b.j1", "team-a") == ""  # another team's id: none
    assert job_id_of("j1", "team-a") == ""


def test_the_team_template_binds_every_subject_to_the_team_s_name() -> None:
    t = auth.team_template("ebb")
    assert set(t.publish) == {
        "ebb.submit.{{name()}}",
        "ebb.master.status.{{name()}}",
        "ebb.master.cancel.{{name()}}",
        "ebb.master.resume.{{name()}}",
    }
    assert set(t.subscribe) == {"ebb.jobs.*.events.{{name()}}", "_INBOX.ebb.team.{{name()}}.>"}
    assert not t.allow_responses
    # Every subject is the team's alone: the name a token of it, nothing after it but an
    # inbox's tail.
    for subject in (*t.publish, *t.subscribe):
        tokens = subject.split(".")
        assert "{{name()}}" in tokens, subject
        assert tokens[tokens.index("{{name()}}") + 1 :] in ([], [">"]), subject
        assert ">" not in tokens[: tokens.index("{{name()}}")], subject


def test_the_roles_hear_owned_jobs_and_the_gateway_asks_for_any_owner() -> None:
    roles: tuple[auth.Role, ...] = ("client", "controller", "gateway")
    for role in roles:
        p = auth.permissions("ebb", role)
        assert {"ebb.jobs.*.events", "ebb.jobs.*.events.*"} <= set(p.subscribe), role
    master = auth.permissions("ebb", "master")
    assert {"ebb.jobs.*.events", "ebb.jobs.*.events.*"} <= set(master.publish)
    gateway = auth.permissions("ebb", "gateway")
    assert {"ebb.submit.*", "ebb.master.status.*", "ebb.master.cancel.*"} <= set(gateway.publish)
    assert "ebb.master.resume.*" not in gateway.publish
    assert "ebb.jobs.submit" not in gateway.publish  # a batch's job is always its owner's
    client = auth.permissions("ebb", "client")
    assert "ebb.jobs.submit" in client.publish and "ebb.submit.*" not in client.publish
    # No role but the gateway's may act for an owner; workers still ask nothing of one.
    others: tuple[auth.Role, ...] = ("controller", "worker", "client")
    for role in others:
        assert not [s for s in auth.permissions("ebb", role).publish if ".submit." in s], role


def test_a_team_s_credential_names_the_team_is_tagged_and_claims_no_permissions() -> None:
    trust = identity.Trust.new("ebb")
    signer = trust.team_signer()
    creds = signer.credentials("team-a", ttl_s=60)
    claims = identity.decode_jwt(creds.splitlines()[1])
    assert claims["name"] == "team-a" and claims["iss"] == trust.tenant_signing_key.public
    assert claims["nats"]["issuer_account"] == trust.account.public
    assert claims["nats"]["tags"] == [identity.TEAM_TAG]
    assert "pub" not in claims["nats"] and "sub" not in claims["nats"]
    assert claims["exp"] > claims["iat"]
    assert identity.credentials_team(creds) == "team-a"
    # A worker's credential, or a role's, is no team's, whatever its name.
    assert identity.credentials_team(trust.worker_signer().credentials("team-a")) is None
    assert identity.credentials_team(trust.role_credentials("client")) is None
    assert identity.credentials_team("not a creds file") is None
    with pytest.raises(ValueError, match="bad owner"):
        signer.credentials("a.b")
    # The SDK learns it is the team from the credential, and uses the team's own inbox.
    assert connection_owner(NatsConfig(creds=creds)) == "team-a"
    assert connection_owner(NatsConfig(creds=trust.role_credentials("client"))) == ""
    assert connection_owner(NatsConfig()) == ""
    assert auth.team_inbox("ebb", "team-a") == "_INBOX.ebb.team.team-a"


def test_the_account_trusts_the_tenants_key_with_the_team_template() -> None:
    trust = identity.Trust.new("ebb")
    conf = trust.server_config()
    account_jwt = conf.split(f"{trust.account.public}: ")[1].split("\n")[0]
    scopes = {k["role"]: k for k in identity.decode_jwt(account_jwt)["nats"]["signing_keys"]}
    assert scopes["team"]["key"] == trust.tenant_signing_key.public
    assert scopes["worker"]["key"] == trust.worker_signing_key.public
    assert scopes["team"]["template"]["pub"]["allow"] == list(auth.team_template("ebb").publish)
    assert trust.tenant_signing_key.seed not in conf


def test_kubernetes_secrets_hold_the_tenants_signer_and_minting_reads_it_back() -> None:
    trust = identity.Trust.new("ebb")
    secrets = {
        s["metadata"]["name"]: s
        for s in installation.kubernetes_secrets(trust, namespace="ebb", name_prefix="ebb")
    }
    made = secrets["ebb-nats-tenant-signer"]
    assert made["stringData"] == {
        "signing_key": trust.tenant_signing_key.seed,
        "account": trust.account.public,
    }
    # As `kubectl get secret -o yaml` prints it: data, base64.
    fetched = {
        "apiVersion": "v1",
        "kind": "Secret",
        "data": {k: base64.b64encode(v.encode()).decode() for k, v in made["stringData"].items()},
    }
    for text in (yaml.safe_dump(fetched), json.dumps(fetched), yaml.safe_dump(made)):
        signer = installation.read_signer(text)
        assert signer == trust.team_signer()
    worker_secret = yaml.safe_dump(secrets["ebb-nats-worker-signer"])
    assert installation.read_signer(worker_secret).signing_key != trust.tenant_signing_key
    for bad in ("- a list", "{}", "data: {signing_key: '!!'}", "stringData: {account: A}"):
        with pytest.raises(ValueError):
            installation.read_signer(bad)


def test_the_team_command_prints_a_team_s_credential(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trust = identity.Trust.new("ebb")
    (made,) = [
        s
        for s in installation.kubernetes_secrets(trust, namespace="ebb")
        if s["metadata"]["name"] == "ebb-nats-tenant-signer"
    ]
    path = tmp_path / "signer.yaml"
    path.write_text(yaml.safe_dump(made))
    installation.main(["team", "team-a", "--signer", str(path), "--ttl-days", "1"])
    creds = capsys.readouterr().out
    assert identity.credentials_team(creds) == "team-a"
    claims = identity.decode_jwt(creds.splitlines()[1])
    assert claims["iss"] == trust.tenant_signing_key.public
    assert 86000 < claims["exp"] - claims["iat"] <= 86400
    with pytest.raises(SystemExit):
        installation.main(["team", "a.b", "--signer", str(path)])
    assert "bad owner" in capsys.readouterr().err
