"""Typed configuration, validated once, from a file, ``SRL_*`` variables and CLI options.

Owns: the shared setting groups, and how every command's settings are read. Precedence,
lowest first:

1. defaults in the config class;
2. a TOML file (``--config FILE``): top-level keys, then the command's own table
   (``[generate]``, ``[train]``, ``[dispatch]`` …) which overrides them; tables of other
   commands are ignored, so producers and consumers may share one file or keep their own;
3. environment variables ``SRL_<FIELD>`` (``SRL_BOOTSTRAP_SERVERS``, ``SRL_LINGER_MS`` …);
4. CLI options, including ``-X key=value`` for any librdkafka setting.

librdkafka settings (``kafka``) merge instead of replacing: ``SRL_KAFKA`` adds to the file's
``[kafka]`` table and ``-X`` adds to both, so a secret can come from the environment while the
tuning stays in the file.

Each command's config class holds exactly the settings that command reads: a few of the
groups below (:class:`KafkaSettings`, :class:`LayoutSettings`, :class:`StoreSettings` …) plus
its own fields; its CLI options are generated from it (``app/cli/options.py``). So that one
file can serve every command, a file key that a command does not read is ignored when it is a
shared setting (a field of :class:`CommonConfig`) or a key another command reads from the same
table (``srl ranker train`` and ``srl ranker eval`` share ``[ranker]``); any other key is an
error (a typo). Environment variables a command does not read are not looked at.

A bad value anywhere is a :class:`~srl.errors.ConfigError` whose one-line message names the
key and where it came from; cross-field rules are model validators that raise it. Called by
every CLI command through :func:`load_config`.
"""

from __future__ import annotations

import os
import re
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from srl.errors import ConfigError
from srl.kafkaenv import kafka_from_environment, settings_as_strings, split_settings

S = TypeVar("S", bound="Settings")

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"


def cli(*aliases: str, metavar: str | None = None) -> dict[str, Any]:
    """A field's ``json_schema_extra``: command-line spellings besides ``--field-name``."""
    return {"aliases": list(aliases), **({"metavar": metavar} if metavar else {})}


class Settings(BaseModel):
    """Base of every config class: frozen, no unknown keys, defaults validated too.

    ``section`` names the file table the command reads over the top-level keys.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)
    section: ClassVar[str] = ""
    # table -> every key some command reads from it (filled as classes are defined)
    table_keys: ClassVar[dict[str, set[str]]] = {}

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        if cls.section:
            Settings.table_keys.setdefault(cls.section, set()).update(cls.model_fields)


# -- the shared groups ---------------------------------------------------------------------
# Composed by inheritance; where a class lists several groups it lists them in this file's
# order, so that every composition has a consistent method resolution order.
class ConnectSettings(Settings):
    """How long to wait for a server (a Kafka broker, the S3 endpoint)."""

    connect_timeout_s: float = Field(
        10.0,
        gt=0,
        le=600,
        description=(
            "How long to wait for a Kafka broker or the S3 endpoint before giving up with an error."
        ),
    )


class ClusterSettings(Settings):
    """Which Kafka cluster, and the prefix of every srl topic, consumer group and client id."""

    bootstrap_servers: str = Field(
        "127.0.0.1:9092",
        description="Kafka bootstrap servers, host:port[,host:port…].",
        json_schema_extra=cli("--bootstrap", metavar="HOST:PORT"),
    )
    topic_prefix: str = Field(
        "srl",
        pattern=NAME_PATTERN,
        description=(
            "Prefix of every topic name ({prefix}.trajectories …), consumer group and client id."
        ),
    )


class KafkaSettings(ConnectSettings, ClusterSettings):
    """The librdkafka settings of every Kafka client srl makes: security, tuning, a token
    callback (docs/security.md)."""

    kafka: dict[str, str] = Field(
        default_factory=dict,
        description=(
            "librdkafka settings passed through verbatim (-X key=value), e.g. security.protocol; "
            "a value @FILE is read from FILE; SRL_KAFKA_<NAME> sets one (docs/security.md)."
        ),
        json_schema_extra=cli("-X", metavar="KEY=VALUE"),
    )
    kafka_oauth_cb: str | None = Field(
        None,
        pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$",
        description=(
            "OAUTHBEARER token callback as module:function, given to every Kafka client: "
            "fn(sasl.oauthbearer.config) -> (token, expiry in seconds since the epoch"
            "[, principal, extensions]); null: none (docs/security.md)."
        ),
        json_schema_extra=cli(metavar="MODULE:FUNCTION"),
    )

    @field_validator("kafka", mode="before")
    @classmethod
    def _scalars_as_strings(cls, v: Any) -> Any:
        return settings_as_strings(v)


class ProducerSettings(KafkaSettings):
    """Producer tuning, for the commands that write records."""

    compression: Literal["lz4", "zstd", "gzip", "snappy", "none"] = Field(
        "lz4", description="Producer compression; zstd for long links between datacenters."
    )
    linger_ms: float = Field(
        5.0, ge=0, le=60_000, description="Producer linger (batching delay), ms."
    )


class LayoutSettings(Settings):
    """How the topics are partitioned: length buckets and partition counts."""

    bucket_bounds: tuple[int, ...] = Field(
        (256, 1024, 4096),
        description="Upper bounds (tokens) of the length buckets; one more bucket holds the rest.",
    )
    partitions_per_bucket: int = Field(
        2, ge=1, le=256, description="Trajectories-topic partitions per length bucket."
    )
    prompt_partitions: int = Field(2, ge=1, le=256, description="Partitions of each prompts topic.")
    retention_ms: int | None = Field(
        None,
        ge=10_000,
        description=(
            "Retention (ms) of the data topics (trajectories, resume tasks, metrics, feedback, "
            "dead letters) "
            "when they are created; null: the broker's default (Kafka: 7 days). The prompt "
            "topics keep the default: they are the dispatcher's log."
        ),
    )

    @field_validator("bucket_bounds")
    @classmethod
    def _increasing(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        if not v or any(b <= 0 for b in v) or any(b >= a for b, a in zip(v, v[1:], strict=False)):
            raise ValueError("must be positive and strictly increasing, e.g. 256,1024,4096")
        return v


class TopicSettings(Settings):
    """How srl creates its topics, and what it checks pre-created ones against (``srl topics
    create|check|plan``; a role that creates what it finds missing)."""

    replication_factor: int | None = Field(
        None,
        ge=1,
        le=32,
        description=(
            "Replicas of each topic srl creates; null: the broker's default.replication.factor "
            "(warned about when that is 1 on a cluster of several nodes)."
        ),
    )
    min_insync_replicas: int | None = Field(
        None,
        ge=1,
        le=32,
        description=(
            "min.insync.replicas of each topic srl creates (acks=all waits for that many); "
            "null: the broker's default."
        ),
    )
    topic_configs: Literal["srl", "minimal"] = Field(
        "srl",
        description=(
            "srl: every topic config of the layout (pool epochs kept forever, pool beats kept "
            "10 minutes, retention_ms); minimal: only what correctness needs (the compacted "
            "weights topic, max.message.bytes), for a managed cluster that refuses the rest."
        ),
    )

    @model_validator(mode="after")
    def _insync_within_replicas(self) -> TopicSettings:
        rf, isr = self.replication_factor, self.min_insync_replicas
        if rf is not None and isr is not None and isr > rf:
            raise ConfigError(
                f"config: min_insync_replicas {isr} is more than replication_factor {rf}"
            )
        return self


class CreationSettings(TopicSettings):
    """Whether a role creates the topics it finds missing; ``srl topics create`` is the admin
    step (docs/security.md)."""

    create_topics: Literal["auto", "yes", "no"] = Field(
        "auto",
        description=(
            "A role that finds one of its topics missing: yes: creates it (needs Create); no: "
            "stops with one line naming it; auto: creates it only on a broker srl started "
            "(srl broker start, embedded or Apache Kafka), else as no."
        ),
    )


class TopicsConfig(KafkaSettings, LayoutSettings):
    """A deployment's topics: the cluster and the layout (``srl topics describe``, ``srl top``)."""


class TopicsAdminConfig(TopicsConfig, TopicSettings):
    """``srl topics create|check``: the layout, and how its topics are created and checked."""


class RunSettings(Settings):
    """The run name."""

    run: str = Field(
        "default",
        pattern=NAME_PATTERN,
        description="Run name: namespaces weights, checkpoints and groups.",
    )


class StoreSettings(ConnectSettings):
    """The object store, and how to reach it when it is S3 (``srl store init``)."""

    store: str = Field(
        "file://runs/store",
        description=(
            "Object store URL: file://DIR (relative paths from the working directory) or "
            "s3://bucket/prefix."
        ),
        json_schema_extra=cli(metavar="URL"),
    )
    s3_endpoint_url: str | None = Field(
        None,
        description=(
            "S3 endpoint for s3:// stores (MinIO, Ceph …); null: AWS_ENDPOINT_URL or AWS itself."
        ),
    )
    s3_region: str | None = Field(
        None, description="S3 region; null: AWS_REGION or boto3's default."
    )
    s3_profile: str | None = Field(
        None,
        description="AWS profile with the S3 credentials; null: AWS_PROFILE / the AWS variables.",
    )
    s3_addressing_style: Literal["auto", "path", "virtual"] = Field(
        "auto", description="S3 bucket addressing; auto: path style when s3_endpoint_url is set."
    )
    s3_create_only: Literal["auto", "conditional", "check-then-put"] = Field(
        "auto",
        description=(
            "How S3 puts stay create-only: If-None-Match (conditional), HEAD then PUT, or auto "
            "(probe)."
        ),
    )


class PlanConfig(ClusterSettings, LayoutSettings, TopicSettings, RunSettings):
    """``srl topics plan``: the layout on paper, and each role's ACLs (no broker is asked)."""


class RunStoreConfig(RunSettings, StoreSettings):
    """A run's objects in the store (published ranker versions, weights, checkpoints)."""


class RegistrySettings(Settings):
    """The record framing, for the commands that encode or decode records."""

    schema_registry_url: str | None = Field(
        None, description="Confluent Schema Registry URL; null: Avro single-object encoding."
    )


class CommonConfig(
    ProducerSettings, TopicsConfig, CreationSettings, RunStoreConfig, RegistrySettings
):
    """Every shared setting: what a role that produces, consumes, stores and names a run reads
    (the dispatcher, the generator, the trainer); the role configs subclass it."""


# A file key that a command does not read is ignored, not refused, when it is one of these.
SHARED_KEYS = frozenset(CommonConfig.model_fields)


# -- reading ---------------------------------------------------------------------------------
def field_kind(annotation: Any) -> str:
    """'seq', 'map', 'flag' or 'scalar': how a string from the environment or CLI is parsed."""
    origin = typing.get_origin(annotation)
    if origin in (tuple, list):
        return "seq"
    if origin is dict:
        return "map"
    if annotation is bool:
        return "flag"
    if origin in (typing.Union, types.UnionType):
        kinds = {field_kind(a) for a in typing.get_args(annotation) if a is not type(None)}
        return kinds.pop() if len(kinds) == 1 else "scalar"
    return "scalar"


def parse_kv(items: str | list[str] | tuple[str, ...], what: str = "-X") -> dict[str, str]:
    """``["a=1", "b=2"]`` or ``"a=1,b=2"`` (:func:`split_settings`) → ``{"a": "1", "b": "2"}``;
    a missing '=' is an error (naming the key only: the item may be a secret)."""
    if isinstance(items, str):
        items = split_settings(items)
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            # shown only if it looks like a setting's name: a bare value may be a secret
            name = re.fullmatch(r"[a-z][a-z0-9_.-]{0,80}", item.strip())
            shown = repr(item.strip()) if name else "a value without a name"
            raise ConfigError(f"{what}: expected key=value, got {shown}")
        out[key.strip()] = value.strip()
    return out


def parse_seq(raw: str) -> list[str]:
    """``"a, b,,c"`` → ``["a", "b", "c"]``; ``""`` → ``[]`` (an empty list)."""
    return [s.strip() for s in raw.split(",") if s.strip()]


def _from_string(cls: type[Settings], key: str, raw: str) -> Any:
    kind = field_kind(cls.model_fields[key].annotation)
    if kind == "seq":
        return parse_seq(raw)
    if kind == "map":
        return parse_kv(raw, f"SRL_{key.upper()}")
    if raw.lower() in ("null", "none") and not cls.model_fields[key].is_required():
        return None
    return raw


def ignorable_keys(cls: type[Settings]) -> set[str]:
    """File keys ``cls`` skips: shared settings, and keys other commands read from its table."""
    return set(SHARED_KEYS | Settings.table_keys.get(cls.section, set())) - set(cls.model_fields)


def read_file(
    path: str | Path, section: str, fields: set[str], ignore: set[str] | None = None
) -> dict[str, Any]:
    """Keys for one command from a TOML file: top-level keys, then its table over them.

    Keys in ``ignore`` (read by other commands) are skipped; any other key not in ``fields``
    is an error."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except OSError as e:
        raise ConfigError(f"config file {path}: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path}: not valid TOML ({e})") from None
    ignore = ignore or set()
    out: dict[str, Any] = {}
    table = data.get(section) if section else None
    for where, items in (("", data), (f"{section}.", table if isinstance(table, dict) else {})):
        for key, value in items.items():
            if where == "" and isinstance(value, dict) and key not in fields | ignore:
                continue  # a command's table; only ours is read (the second pass)
            if key in ignore:
                continue
            if key not in fields:
                raise ConfigError(f"config file {path}: unknown key '{where}{key}'")
            out[key] = value
    return out


def load_config(
    cls: type[S],
    file: str | Path | None = None,
    cli: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
) -> S:
    """Build ``cls`` from defaults < file < ``SRL_*`` env < CLI; one-line ConfigError on a bad
    value.

    ``cli`` values that are None count as not given. ``env`` defaults to ``os.environ``. The
    keys given anywhere are ``cfg.model_fields_set`` (a command may ask whether e.g.
    ``bootstrap_servers`` was given at all).
    """
    fields = set(cls.model_fields)
    values: dict[str, Any] = {}
    source: dict[str, str] = {}
    environ = os.environ if env is None else env
    if file is None and environ.get("SRL_CONFIG"):
        file = environ["SRL_CONFIG"]
    if file is not None:
        for key, value in read_file(file, cls.section, fields, ignorable_keys(cls)).items():
            values[key], source[key] = value, f"config file {file}"
    for key in fields:
        raw = environ.get(f"SRL_{key.upper()}")
        if raw is not None:
            value = _from_string(cls, key, raw)
            if key == "kafka":  # SRL_KAFKA adds to the file's [kafka] table (e.g. a secret)
                value = {**values.get("kafka", {}), **value}
            values[key], source[key] = value, f"SRL_{key.upper()}"
    if "kafka" in fields and (one := kafka_from_environment(environ, fields)):
        values["kafka"] = {**values.get("kafka", {}), **one}  # over SRL_KAFKA, under -X
        source["kafka"] = "SRL_KAFKA_<NAME>"
    for key, value in (cli or {}).items():
        if value is None or (key == "kafka" and not value):
            continue
        if key not in fields:
            raise ConfigError(f"unknown option '{key}'")
        if key == "kafka":  # -X merges over file/env settings instead of replacing them
            value = {**values.get("kafka", {}), **value}
        values[key], source[key] = value, "command line"
    try:
        return cls(**values)
    except ValidationError as e:
        raise ConfigError(_one_line(e, source)) from None


def _one_line(e: ValidationError, source: dict[str, str]) -> str:
    err = e.errors()[0]
    key = ".".join(str(p) for p in err["loc"]) or "?"
    top = str(err["loc"][0]) if err["loc"] else ""
    where = source.get(top, "default")
    got = err.get("input")
    # a librdkafka setting's value may be a secret: its key and where it came from only
    hidden = isinstance(got, dict) or top == "kafka"
    shown = f" (from {where})" if hidden and top == "kafka" else ""
    shown = shown if hidden else f" (got {got!r}, from {where})"
    msg = re.sub(r"\s+", " ", err["msg"])
    return f"config: {key}: {msg}{shown}"


def default_of(cls: type[Settings], name: str) -> Any:
    """The default value of field ``name`` (calling its factory if it has one)."""
    f = cls.model_fields[name]
    return f.default_factory() if f.default_factory is not None else f.default  # type: ignore[call-arg]


def describe(cls: type[Settings]) -> list[tuple[str, str, str]]:
    """(key, default, description) for every field; docs/configuration.md is made from it."""
    return [
        (name, repr(default_of(cls, name)), f.description or "")
        for name, f in cls.model_fields.items()
    ]


# The groups in the order commands list their options and docs/configuration.md its tables.
GROUPS: tuple[type[Settings], ...] = (
    ClusterSettings,
    KafkaSettings,
    ProducerSettings,
    LayoutSettings,
    TopicSettings,
    CreationSettings,
    RunSettings,
    StoreSettings,
    ConnectSettings,
    RegistrySettings,
)
