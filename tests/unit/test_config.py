"""Config: precedence file < env < CLI, role tables, one-line errors naming the key, what a
command skips in a shared file, the cross-field rules and the group names spelled once."""

from __future__ import annotations

import re
from pathlib import Path
from typing import ClassVar

import pytest
from pydantic import Field

from consumers.config import TrainConfig
from producers.config import DispatchConfig, GenerateConfig
from srl.config import (
    CommonConfig,
    StoreSettings,
    TopicsConfig,
    describe,
    load_config,
    parse_kv,
)
from srl.errors import ConfigError
from srl.topics import pool_group, trainer_group


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


# -- one file for commands that read different settings -------------------------------------
def test_a_command_ignores_shared_settings_it_does_not_read(tmp_path: Path) -> None:
    f = write(
        tmp_path,
        'store = "file:///tmp/s"\nbootstrap_servers = "h:1"\nlinger_ms = 2\nrun = "r"\n'
        '[kafka]\n"client.rack" = "a"\n',
    )
    cfg = load_config(StoreSettings, file=f, env={})
    assert cfg.store == "file:///tmp/s" and cfg.model_fields_set == {"store"}
    topics = load_config(TopicsConfig, file=f, env={})
    assert topics.bootstrap_servers == "h:1" and topics.kafka == {"client.rack": "a"}
    with pytest.raises(ConfigError, match="unknown key 'linger'"):  # a typo is still an error
        load_config(TopicsConfig, file=write(tmp_path, "linger = 2\n"), env={})


def test_a_role_table_may_hold_shared_settings_and_other_commands_keys_of_that_table(
    tmp_path: Path,
) -> None:
    from ranker.config import RankerConfig, RankerStoreConfig

    f = write(
        tmp_path, '[ranker]\nrun = "r"\nwindow = 100\nlinger_ms = 1\nbootstrap_servers = "x:1"\n'
    )
    assert load_config(RankerStoreConfig, file=f, env={}).run == "r"  # eval ignores window
    assert load_config(RankerConfig, file=f, env={}).window == 100
    with pytest.raises(ConfigError, match="unknown key 'ranker.windw'"):
        load_config(RankerStoreConfig, file=write(tmp_path, "[ranker]\nwindw = 1\n"), env={})
    with pytest.raises(ConfigError, match="unknown key 'train.engine'"):  # another table's key
        load_config(TrainConfig, file=write(tmp_path, "[train]\nengine = 'hf'\n"), env={})


def test_environment_of_settings_a_command_does_not_read_is_not_looked_at() -> None:
    cfg = load_config(TopicsConfig, env={"SRL_LINGER_MS": "-3", "SRL_STORE": "bad://"})
    assert cfg.topic_prefix == "srl"


def test_the_demo_file_serves_every_role_and_tool(tmp_path: Path) -> None:
    """OUT/srl.toml: top-level keys every role reads; commands that read fewer ignore the rest."""
    from app.configs import TopConfig
    from app.demoplan import DemoConfig, Plan

    demo = load_config(DemoConfig, env={}, cli={"kafka": {"client.rack": "a"}})
    plan = Plan(demo, tmp_path, tmp_path / "m", "127.0.0.1:1", "p", "demo-async-s0", "file://s")
    f = plan.write()
    env: dict[str, str] = {}
    train = load_config(TrainConfig, file=f, env=env)
    gen = load_config(GenerateConfig, file=f, env=env)
    dispatch = load_config(DispatchConfig, file=f, env=env)
    assert train.run == gen.run == dispatch.run == "demo-async-s0"
    assert gen.bucket_bounds == train.bucket_bounds == (16, 32) and gen.linger_ms == 2.0
    assert train.kafka == {"client.rack": "a"}
    for cls in (TopicsConfig, StoreSettings, TopConfig):
        load_config(cls, file=f, env=env)
    assert plan.common().topic_prefix == load_config(TopConfig, file=f, env=env).topic_prefix


def test_given_keys_are_the_model_fields_set(tmp_path: Path) -> None:
    f = write(tmp_path, 'topic_prefix = "f"\n')
    cfg = load_config(TopicsConfig, file=f, env={"SRL_RUN": "r", "SRL_PROMPT_PARTITIONS": "3"})
    assert cfg.model_fields_set == {"topic_prefix", "prompt_partitions"}


# -- cross-field rules ----------------------------------------------------------------------
GEN = {"engine": "sim"}


@pytest.mark.parametrize(
    ("values", "needle"),
    [
        ({"buckets": ["le7"]}, "buckets: unknown bucket 'le7'; buckets are le256"),
        ({"migrate_to": "gt9"}, "migrate_to: unknown bucket 'gt9'"),
        ({"engine": "hf"}, "engine hf needs --model"),
    ],
)
def test_generate_rules_are_one_line_config_errors(values: dict, needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(GenerateConfig, env={}, cli={**GEN, **values})
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_bucket_names_follow_the_layout_wherever_it_comes_from(tmp_path: Path) -> None:
    """No dependence on field order: the bounds may come from the file, the names from the CLI."""
    f = write(tmp_path, "bucket_bounds = [16, 32]\n")
    cli = {**GEN, "buckets": ["le16", "le32"], "migrate_to": "gt32"}
    cfg = load_config(GenerateConfig, file=f, env={}, cli=cli)
    assert cfg.buckets == ("le16", "le32") and cfg.migrate_to == "gt32"
    with pytest.raises(ConfigError, match="buckets: unknown bucket 'le256'"):
        load_config(GenerateConfig, file=f, env={}, cli={**GEN, "buckets": ["le256"]})


@pytest.mark.parametrize(
    ("values", "needle"),
    [
        ({"backend": "deepspeed", "master_dtype": "bfloat16"}, "keeps float32 master weights"),
        ({"sync_barrier": True}, "add --max-staleness 0"),
        ({"publish_every": 3}, "windows need --publish-every <= max_staleness + 1"),
    ],
)
def test_train_rules_are_one_line_config_errors(values: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(needle)):
        load_config(TrainConfig, env={}, cli=values)
    zero3 = {"backend": "deepspeed", "zero_stage": 3}  # ZeRO-3 runs (consumers/engine_zero3.py)
    assert load_config(TrainConfig, env={}, cli=zero3).zero_stage == 3


@pytest.mark.parametrize(
    ("env", "cli", "embedded"),
    [
        ({}, {}, True),
        ({"SRL_BOOTSTRAP_SERVERS": "h:1"}, {}, False),
        ({}, {"bootstrap_servers": "h:1"}, False),
        ({}, {"bootstrap_servers": "h:1", "embedded": True}, True),
    ],
)
def test_the_demo_uses_a_given_broker(env: dict, cli: dict, embedded: bool) -> None:
    from app.demoplan import DemoConfig

    assert load_config(DemoConfig, env=env, cli=cli).embedded is embedded


# -- group names, spelled once --------------------------------------------------------------
def test_the_trainer_and_pool_groups_have_one_spelling() -> None:
    train = load_config(TrainConfig, env={}, cli={"run": "r"})
    gen = load_config(GenerateConfig, env={}, cli={**GEN, "run": "r", "pool": "p"})
    assert train.consumer_group == gen.trainer_group == trainer_group("srl", "r") == "srl.trainer.r"
    assert gen.consumer_group == pool_group("srl", "p") == "srl.gen.p"
    override = load_config(GenerateConfig, env={}, cli={**GEN, "backlog_group": "g"})
    assert override.trainer_group == "g"


def test_describe_lists_every_field_with_its_default() -> None:
    rows = {key: (default, text) for key, default, text in describe(TopicsConfig)}
    assert set(rows) == set(TopicsConfig.model_fields)
    assert rows["bucket_bounds"][0] == "(256, 1024, 4096)" and rows["kafka"][0] == "{}"


def test_a_role_frames_records_as_its_own_config_says(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """``use_schema_registry`` (called by every role at start) installs the registry its
    config names; a config without one changes nothing."""
    from schemas import records
    from srl.codecs import use_schema_registry
    from srl.config import RegistrySettings

    monkeypatch.setattr(records, "_default_codec", None)
    use_schema_registry(RegistrySettings())
    assert records.default_codec().registry is None
    use_schema_registry(RegistrySettings(schema_registry_url="http://127.0.0.1:1"))
    assert records.default_codec().registry is not None
