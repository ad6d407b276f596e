"""Config: precedence file < env < CLI, role tables, and one-line errors naming the key."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import pytest
from pydantic import Field

from srl.config import CommonConfig, load_config, parse_kv
from srl.errors import ConfigError


class RoleConfig(CommonConfig):
    section: ClassVar[str] = "train"
    steps: int = Field(10, ge=1, description="steps")


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "srl.toml"
    p.write_text(text)
    return p


def test_defaults() -> None:
    cfg = load_config(CommonConfig, env={})
    assert cfg.bootstrap_servers == "127.0.0.1:9092" and cfg.topic_prefix == "srl"
    assert cfg.bucket_bounds == (256, 1024, 4096)


def test_precedence_file_then_env_then_cli(tmp_path: Path) -> None:
    f = write(
        tmp_path, 'topic_prefix = "file"\nlinger_ms = 7\nrun = "filerun"\n[train]\nsteps = 3\n'
    )
    env = {"SRL_TOPIC_PREFIX": "env", "SRL_LINGER_MS": "9"}
    cfg = load_config(RoleConfig, file=f, env=env, cli={"linger_ms": 11.0, "run": None})
    assert (cfg.topic_prefix, cfg.linger_ms, cfg.run, cfg.steps) == ("env", 11.0, "filerun", 3)


def test_role_tables_of_other_roles_are_ignored(tmp_path: Path) -> None:
    f = write(tmp_path, "[generate]\nengine = 'hf'\n[train]\nsteps = 5\n")
    assert load_config(RoleConfig, file=f, env={}).steps == 5


def test_env_lists_and_maps() -> None:
    env = {
        "SRL_BUCKET_BOUNDS": "64, 512",
        "SRL_KAFKA": "security.protocol=SSL,ssl.ca.location=/ca.pem",
    }
    cfg = load_config(CommonConfig, env=env)
    assert cfg.bucket_bounds == (64, 512)
    assert cfg.kafka == {"security.protocol": "SSL", "ssl.ca.location": "/ca.pem"}


def test_cli_kafka_settings_merge_over_file(tmp_path: Path) -> None:
    f = write(tmp_path, '[kafka]\n"socket.timeout.ms" = "1000"\n"client.rack" = "a"\n')
    cfg = load_config(CommonConfig, file=f, env={}, cli={"kafka": {"client.rack": "b"}})
    assert cfg.kafka == {"socket.timeout.ms": "1000", "client.rack": "b"}


@pytest.mark.parametrize(
    ("env", "cli", "needle"),
    [
        ({"SRL_LINGER_MS": "-1"}, {}, "linger_ms"),
        ({"SRL_LINGER_MS": "soon"}, {}, "linger_ms"),
        ({}, {"compression": "brotli"}, "compression"),
        ({"SRL_BUCKET_BOUNDS": "512,256"}, {}, "bucket_bounds"),
        ({}, {"topic_prefix": "has space"}, "topic_prefix"),
        ({}, {"partitions_per_bucket": 0}, "partitions_per_bucket"),
    ],
)
def test_bad_values_are_one_line_errors_naming_the_key(env: dict, cli: dict, needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(CommonConfig, env=env, cli=cli)
    msg = str(info.value)
    assert needle in msg and "\n" not in msg


def test_error_says_where_the_value_came_from(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="SRL_LINGER_MS"):
        load_config(CommonConfig, env={"SRL_LINGER_MS": "-5"})
    f = write(tmp_path, "linger_ms = -5\n")
    with pytest.raises(ConfigError, match="config file"):
        load_config(CommonConfig, file=f, env={})


def test_unknown_file_key_and_bad_toml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown key 'lingerms'"):
        load_config(CommonConfig, file=write(tmp_path, "lingerms = 3\n"), env={})
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(CommonConfig, file=write(tmp_path, "linger_ms = = 3\n"), env={})
    with pytest.raises(ConfigError, match="config file"):
        load_config(CommonConfig, file=tmp_path / "missing.toml", env={})


def test_parse_kv_requires_equals() -> None:
    assert parse_kv(["a=1", "b = 2"]) == {"a": "1", "b": "2"}
    with pytest.raises(ConfigError, match="key=value"):
        parse_kv(["novalue"])


def test_env_kafka_settings_add_to_the_file_table(tmp_path: Path) -> None:
    f = write(tmp_path, '[kafka]\n"security.protocol" = "SASL_SSL"\n"client.rack" = "a"\n')
    cfg = load_config(CommonConfig, file=f, env={"SRL_KAFKA": "sasl.password=s3cret,client.rack=b"})
    assert cfg.kafka == {
        "security.protocol": "SASL_SSL",
        "client.rack": "b",
        "sasl.password": "s3cret",
    }
    cfg = load_config(
        CommonConfig,
        file=f,
        env={"SRL_KAFKA": "sasl.password=s3cret"},
        cli={"kafka": {"sasl.username": "u"}},
    )
    assert cfg.kafka == {
        "security.protocol": "SASL_SSL",
        "client.rack": "a",
        "sasl.password": "s3cret",
        "sasl.username": "u",
    }
