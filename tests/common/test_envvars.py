"""The NATS settings travel through the environment and come back the same."""

from __future__ import annotations

from ebb.common import envvars
from ebb.common.messaging.natsconfig import NatsConfig, nats_config_from_env, nats_environment


def test_nats_settings_survive_the_environment_of_a_child() -> None:
    config = NatsConfig(
        url="nats://a:4222,nats://b:4222",
        prefix="p1",
        user="u",
        password="pw",
        token="tk",
        creds_file="/c.creds",
        tls_ca="/ca.pem",
        tls_cert="/cert.pem",
        tls_key="/key.pem",
    )
    environ = nats_environment(config)
    assert environ[envvars.NATS_PASSWORD] == "pw"
    assert all(name.startswith(("EBB_NATS_", envvars.PREFIX)) for name in environ)
    assert nats_config_from_env(environ) == config


def test_given_settings_win_over_the_environment_and_none_is_not_given() -> None:
    environ = {envvars.NATS_URL: "nats://env:1", envvars.PREFIX: "fromenv", "OTHER": "x"}
    assert nats_config_from_env(environ, url="nats://flag:2", prefix=None) == NatsConfig(
        url="nats://flag:2", prefix="fromenv"
    )
    assert nats_config_from_env({}) == NatsConfig()
    assert nats_config_from_env({envvars.NATS_USER: ""}).user is None
    assert nats_environment(NatsConfig()) == {
        envvars.NATS_URL: NatsConfig().url,
        envvars.PREFIX: "ebb",
    }
