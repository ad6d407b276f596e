"""Secrets in librdkafka settings: where they come from, and never where they go.

The rules of docs/security.md, "Client settings": ``SRL_KAFKA`` splits only at a comma that
a setting name follows; ``SRL_KAFKA_<NAME>`` and ``@FILE`` values; TOML numbers; and a secret
never in an error, a log line, a file srl writes (the demo's ``srl.toml``) or a child's
command line (``srl bench serve``).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from app.bench.serve import kafka_args, kafka_env
from app.configs import ServeBenchConfig
from app.demoplan import kafka_secrets, kafka_table
from srl.config import CommonConfig, load_config, split_settings
from srl.errors import ConfigError
from srl.kafka import check_settings, user_settings
from srl.secrets import (
    REDACTED,
    Scrubber,
    env_name,
    is_secret,
    redact,
    remember,
    resolve,
    scrub,
    secret_environment,
)

SECRET = "pw-S3NTINEL,x=1"


@pytest.mark.parametrize(
    ("raw", "items"),
    [
        ("a.b=1,c=2", ["a.b=1", "c=2"]),
        (
            "sasl.oauthbearer.extensions=logicalCluster=lkc-1,identityPoolId=pool-2,acks=all",
            ["sasl.oauthbearer.extensions=logicalCluster=lkc-1,identityPoolId=pool-2", "acks=all"],
        ),
        ("sasl.password=Ab,Cd=ef,sasl.username=u", ["sasl.password=Ab,Cd=ef", "sasl.username=u"]),
        ("sasl.password=a,b=c\nsasl.username=u\n", ["sasl.password=a,b=c", "sasl.username=u"]),
        ("", []),
    ],
)
def test_srl_kafka_splits_only_where_a_setting_name_follows(raw: str, items: list[str]) -> None:
    assert split_settings(raw) == items


def test_one_variable_per_setting_and_the_precedence(tmp_path: Path) -> None:
    f = tmp_path / "srl.toml"
    f.write_text(
        '[kafka]\n"sasl.username" = "file"\n"linger.ms" = 5\n"socket.keepalive.enable" = true\n'
    )
    env = {
        "SRL_KAFKA": "sasl.username=env,client.rack=r1",
        "SRL_KAFKA_SASL_USERNAME": "one",
        "SRL_KAFKA_SASL_PASSWORD": SECRET,
        "SRL_KAFKA_DEBUG": "1",  # srl's own variables, not librdkafka's
        "SRL_KAFKA_JVM_OPTS": "-Xmx1g",
        "SRL_KAFKA_OAUTH_CB": "tests.securekafka:oauth_token",
    }
    cfg = load_config(CommonConfig, file=f, env=env, cli={"kafka": {"client.rack": "cli"}})
    assert cfg.kafka == {
        "sasl.username": "one",
        "linger.ms": "5",
        "socket.keepalive.enable": "true",
        "client.rack": "cli",
        "sasl.password": SECRET,
    }
    assert cfg.kafka_oauth_cb == "tests.securekafka:oauth_token"


def test_a_bad_value_in_the_kafka_table_names_the_key_not_the_value(tmp_path: Path) -> None:
    f = tmp_path / "srl.toml"
    f.write_text(f'[kafka]\n"sasl.password" = ["{SECRET}"]\n')
    with pytest.raises(ConfigError) as info:
        load_config(CommonConfig, file=f, env={})
    assert "sasl.password" in str(info.value) and SECRET not in str(info.value)
    with pytest.raises(ConfigError) as info:
        load_config(CommonConfig, env={"SRL_KAFKA": f"security.protocol=SSL\n{SECRET[:11]}"})
    assert SECRET not in str(info.value)


def test_a_refused_setting_names_the_keys_given_never_a_value() -> None:
    for bad in ({"sasl.pasword": SECRET}, {"sasl.password": SECRET, "no.such": "1"}):
        cfg = CommonConfig(kafka=bad)
        with pytest.raises(ConfigError) as info:
            check_settings(cfg)
        assert SECRET not in str(info.value) and "kafka settings (" in str(info.value)


def test_file_values_are_read_where_a_client_is_made(tmp_path: Path) -> None:
    pw = tmp_path / "pw"
    pw.write_text(SECRET + "\n")
    cfg = CommonConfig(kafka={"sasl.password": f"@{pw}", "client.rack": "@@r"})
    assert cfg.kafka["sasl.password"] == f"@{pw}"  # the config holds the path, not the secret
    assert user_settings(cfg) == {"sasl.password": SECRET, "client.rack": "@r"}
    with pytest.raises(ConfigError, match="cannot read"):
        resolve({"sasl.password": f"@{tmp_path / 'missing'}"})


def test_secrets_are_known_by_name_and_redacted() -> None:
    for key in ("sasl.password", "ssl.key.password", "ssl.keystore.password", "ssl.key.pem"):
        assert is_secret(key)
    assert is_secret("sasl.oauthbearer.client.secret") and is_secret("sasl.oauthbearer.config")
    assert not is_secret("sasl.username") and not is_secret("ssl.ca.location")
    shown = redact({"sasl.password": SECRET, "ssl.key.password": "@/f", "sasl.username": "u"})
    assert shown == {"sasl.password": REDACTED, "ssl.key.password": "@/f", "sasl.username": "u"}


def test_a_remembered_secret_is_scrubbed_from_text_and_log_lines(
    caplog: pytest.LogCaptureFixture,
) -> None:
    remember(SECRET)
    assert scrub(f"failed: {SECRET}!") == f"failed: {REDACTED}!"
    log = logging.getLogger("srl.test-scrub")
    caplog.handler.addFilter(Scrubber())
    with caplog.at_level(logging.INFO):
        log.info("connecting with %s", SECRET)
    assert SECRET not in caplog.text and REDACTED in caplog.text


def test_children_get_secrets_by_environment_never_by_file_or_command_line() -> None:
    settings = {"security.protocol": "SASL_SSL", "sasl.password": SECRET, "ssl.key.pem": "k"}
    assert secret_environment(settings) == {
        "SRL_KAFKA_SASL_PASSWORD": SECRET,
        "SRL_KAFKA_SSL_KEY_PEM": "k",
    }
    assert env_name("sasl.oauthbearer.client.secret") == "SRL_KAFKA_SASL_OAUTHBEARER_CLIENT_SECRET"
    cfg = CommonConfig(kafka=settings)
    assert kafka_table(cfg) == {"security.protocol": "SASL_SSL"}  # the demo's srl.toml
    assert kafka_secrets(cfg) == secret_environment(
        {k: settings[k] for k in settings if k != "security.protocol"}
    )
    bench = ServeBenchConfig(kafka=settings)
    assert SECRET not in " ".join(kafka_args(bench))
    assert kafka_env(bench)["SRL_KAFKA_SASL_PASSWORD"] == SECRET
    back = load_config(
        CommonConfig, env={k: v for k, v in kafka_env(bench).items() if k.startswith("SRL_KAFKA_")}
    )
    assert back.kafka == settings
