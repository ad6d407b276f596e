"""Typed configuration, validated once, from a file, ``SRL_*`` variables and CLI options.

Owns: how every role's settings are read and checked. Precedence, lowest first:

1. defaults in the config class;
2. a TOML file (``--config FILE``): top-level keys, then the role's own table
   (``[generate]``, ``[train]``, ``[dispatch]`` …) which overrides them; tables of other roles
   are ignored, so producers and consumers may share one file or keep their own;
3. environment variables ``SRL_<FIELD>`` (``SRL_BOOTSTRAP_SERVERS``, ``SRL_LINGER_MS`` …);
4. CLI options, including ``-X key=value`` for any librdkafka setting.

librdkafka settings (``kafka``) merge instead of replacing: ``SRL_KAFKA`` adds to the file's
``[kafka]`` table and ``-X`` adds to both, so a secret can come from the environment while the
tuning stays in the file.

A bad value anywhere is a :class:`~srl.errors.ConfigError` whose one-line message names the
key and where it came from. Role configs subclass :class:`CommonConfig` and set ``section``.
Called by every CLI command through :func:`load_config`.
"""

from __future__ import annotations

import os
import re
import tomllib
import typing
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from srl.errors import ConfigError

C = TypeVar("C", bound="CommonConfig")

_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"


class CommonConfig(BaseModel):
    """Settings every role shares: where Kafka and the store are, and how topics are laid out."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)
    section: ClassVar[str] = ""

    bootstrap_servers: str = Field(
        "127.0.0.1:9092", description="Kafka bootstrap servers, host:port[,host:port…]."
    )
    topic_prefix: str = Field(
        "srl", pattern=_NAME, description="Prefix of every topic name: {prefix}.trajectories …"
    )
    run: str = Field(
        "default",
        pattern=_NAME,
        description="Run name: namespaces weights, checkpoints and groups.",
    )
    store: str = Field(
        "file://runs/store",
        description="Object store URL: file://DIR (relative paths from the working directory) or s3://bucket/prefix.",
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
    schema_registry_url: str | None = Field(
        None, description="Confluent Schema Registry URL; null: Avro single-object encoding."
    )
    bucket_bounds: tuple[int, ...] = Field(
        (256, 1024, 4096),
        description="Upper bounds (tokens) of the length buckets; one more bucket holds the rest.",
    )
    partitions_per_bucket: int = Field(
        2, ge=1, le=256, description="Trajectories-topic partitions per length bucket."
    )
    prompt_partitions: int = Field(2, ge=1, le=256, description="Partitions of each prompts topic.")
    compression: Literal["lz4", "zstd", "gzip", "snappy", "none"] = Field(
        "lz4", description="Producer compression; zstd for long links between datacenters."
    )
    linger_ms: float = Field(
        5.0, ge=0, le=60_000, description="Producer linger (batching delay), ms."
    )
    connect_timeout_s: float = Field(
        10.0,
        gt=0,
        le=600,
        description="How long to wait for a broker before giving up with an error.",
    )
    kafka: dict[str, str] = Field(
        default_factory=dict,
        description=(
            "librdkafka settings passed through verbatim (-X key=value), e.g. security.protocol."
        ),
    )

    @field_validator("bucket_bounds")
    @classmethod
    def _increasing(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        if not v or any(b <= 0 for b in v) or any(b >= a for b, a in zip(v, v[1:], strict=False)):
            raise ValueError("must be positive and strictly increasing, e.g. 256,1024,4096")
        return v


def _field_kind(annotation: Any) -> str:
    """'seq', 'map' or 'scalar': how a string from the environment or CLI is parsed."""
    origin = typing.get_origin(annotation)
    if origin in (tuple, list):
        return "seq"
    if origin is dict:
        return "map"
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        kinds = {_field_kind(a) for a in typing.get_args(annotation) if a is not type(None)}
        return kinds.pop() if len(kinds) == 1 else "scalar"
    return "scalar"


def parse_kv(items: str | list[str] | tuple[str, ...], what: str = "-X") -> dict[str, str]:
    """``["a=1", "b=2"]`` or ``"a=1,b=2"`` → ``{"a": "1", "b": "2"}``; a missing '=' is an error."""
    if isinstance(items, str):
        items = [s for s in items.split(",") if s.strip()]
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"{what}: expected key=value, got {item!r}")
        out[key.strip()] = value.strip()
    return out


def _from_string(cls: type[CommonConfig], key: str, raw: str) -> Any:
    kind = _field_kind(cls.model_fields[key].annotation)
    if kind == "seq":
        return [s.strip() for s in raw.split(",") if s.strip()]
    if kind == "map":
        return parse_kv(raw, f"SRL_{key.upper()}")
    if raw.lower() in ("null", "none") and not cls.model_fields[key].is_required():
        return None
    return raw


def read_file(path: str | Path, section: str, fields: set[str]) -> dict[str, Any]:
    """Keys for one role from a TOML file: top-level keys, then the role's table over them."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except OSError as e:
        raise ConfigError(f"config file {path}: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path}: not valid TOML ({e})") from None
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict) and key not in fields:
            continue  # a role table; only ours is read, below
        if key not in fields:
            raise ConfigError(f"config file {path}: unknown key '{key}'")
        out[key] = value
    table = data.get(section) if section else None
    if isinstance(table, dict):
        for key, value in table.items():
            if key not in fields:
                raise ConfigError(f"config file {path}: unknown key '{section}.{key}'")
            out[key] = value
    return out


def load_config(
    cls: type[C],
    file: str | Path | None = None,
    cli: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
) -> C:
    """Build ``cls`` from defaults < file < ``SRL_*`` env < CLI; one-line ConfigError on a bad
    value.

    ``cli`` values that are None count as not given. ``env`` defaults to ``os.environ``.
    """
    fields = set(cls.model_fields)
    values: dict[str, Any] = {}
    source: dict[str, str] = {}
    if file is None and (env or os.environ).get("SRL_CONFIG"):
        file = (env or os.environ)["SRL_CONFIG"]
    if file is not None:
        for key, value in read_file(file, cls.section, fields).items():
            values[key], source[key] = value, f"config file {file}"
    environ = os.environ if env is None else env
    for key in fields:
        raw = environ.get(f"SRL_{key.upper()}")
        if raw is not None:
            value = _from_string(cls, key, raw)
            if key == "kafka":  # SRL_KAFKA adds to the file's [kafka] table (e.g. a secret)
                value = {**values.get("kafka", {}), **value}
            values[key], source[key] = value, f"SRL_{key.upper()}"
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
        err = e.errors()[0]
        key = ".".join(str(p) for p in err["loc"]) or "?"
        top = str(err["loc"][0]) if err["loc"] else ""
        where = source.get(top, "default")
        got = err.get("input")
        shown = "" if isinstance(got, dict) else f" (got {got!r}, from {where})"
        msg = re.sub(r"\s+", " ", err["msg"])
        raise ConfigError(f"config: {key}: {msg}{shown}") from None


def describe(cls: type[CommonConfig]) -> list[tuple[str, str, str]]:
    """(key, default, description) for every field; docs/configuration.md is made from it."""
    rows = []
    for name, f in cls.model_fields.items():
        default = f.default_factory() if f.default_factory is not None else f.default  # type: ignore[call-arg]
        rows.append((name, repr(default), f.description or ""))
    return rows
