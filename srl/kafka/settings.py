"""librdkafka settings, in one place: every client srl makes starts from these.

* producers are idempotent with ``acks=all``, lz4 by default (zstd for long links), a
  configurable linger, and bounded delivery timeouts so a dead broker is an error, not a hang;
* consumers store offsets manually (``enable.auto.offset.store=false``), never auto-commit,
  and use the cooperative-sticky assignor so pools can grow and shrink without stop-the-world;
* the user's settings (``cfg.kafka``: ``-X key=value``, the ``[kafka]`` table, ``SRL_KAFKA``
  and ``SRL_KAFKA_<NAME>``) are applied last and can override anything: :func:`user_settings`
  gives them to every client with their ``@FILE`` values read and the ``kafka_oauth_cb``
  token callback (OAUTHBEARER) attached; every command checks them (``check_settings``)
  before it does any work, and a bad one is named with its secrets redacted (``srl.secrets``);
* client ids carry the topic prefix and the role (``{prefix}.{role}-{host}``, stable across
  restarts), so a shared cluster's quotas and logs can tell deployments apart.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import socket
from collections.abc import Callable
from typing import Any

import confluent_kafka
from confluent_kafka import KafkaError, KafkaException

from srl.config import KafkaSettings, ProducerSettings
from srl.errors import ConfigError
from srl.kafka.groupprotocol import classic_instead
from srl.secrets import remember, resolve, scrub

# librdkafka's own log lines (connection refused, retries) go here, not to stderr.
rdkafka_log = logging.getLogger("srl.librdkafka")
rdkafka_log.setLevel(logging.DEBUG if os.environ.get("SRL_KAFKA_DEBUG") else logging.CRITICAL)


def client_id(role: str, prefix: str = "srl") -> str:
    """``{prefix}.{role}-{host}``: the same across restarts (a broker's per-client metrics and
    quotas keep one series per role and host, not one per process id)."""
    return f"{prefix}.{role}-{socket.gethostname()}"


SOCKET_TIMEOUT_MS = 10_000


def base_settings(cfg: KafkaSettings, role: str = "client") -> dict[str, Any]:
    return {
        "bootstrap.servers": cfg.bootstrap_servers,
        "client.id": client_id(role, cfg.topic_prefix),
        "logger": rdkafka_log,
        "socket.connection.setup.timeout.ms": int(cfg.connect_timeout_s * 1000),
        # A request unanswered this long closes its connection and is sent again on a new one
        # (librdkafka's default is 60 s). Across a silent partition a connection is not
        # reset: TCP retransmits with exponential backoff, so after the partition heals the
        # old connection may stay mute for tens of seconds (srl chaos, generator-partition).
        "socket.timeout.ms": SOCKET_TIMEOUT_MS,
    }


def user_settings(cfg: KafkaSettings) -> dict[str, Any]:
    """The user's librdkafka settings as a client takes them: ``@FILE`` values read
    (``srl.secrets.resolve``), and the ``kafka_oauth_cb`` callback as librdkafka's
    ``oauth_cb``. Applied last by every client srl makes."""
    out: dict[str, Any] = resolve(cfg.kafka)
    if cfg.kafka_oauth_cb:
        out["oauth_cb"] = oauth_callback(cfg.kafka_oauth_cb)
    return out


@functools.cache
def oauth_callback(spec: str) -> Callable[[str], Any]:
    """The function ``module:function`` names; ConfigError with one line if it cannot be used.
    librdkafka calls it with ``sasl.oauthbearer.config`` whenever a token is due (at start,
    then at 80 % of each token's lifetime) and expects ``(token, expiry in seconds since the
    epoch)``, optionally with the principal and a dict of SASL extensions."""
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"kafka_oauth_cb: cannot import {module_name!r} ({e})") from None
    fn: Any = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"kafka_oauth_cb: {module_name!r} has no function {attr!r}")

    def token(config: str) -> Any:
        got = fn(config)
        remember(str(got[0]))  # a token is a secret too: scrubbed from every line
        return got

    return token


def producer_settings(
    cfg: ProducerSettings, role: str = "producer", **overrides: Any
) -> dict[str, Any]:
    settings = base_settings(cfg, role)
    settings.update(
        {
            "enable.idempotence": True,
            "acks": "all",
            "compression.type": cfg.compression,
            "linger.ms": cfg.linger_ms,
            # Bounded: a message that cannot be delivered fails instead of waiting forever.
            "message.timeout.ms": max(1_000, int(cfg.connect_timeout_s * 3000)),
            "queue.buffering.max.kbytes": 262_144,
        }
    )
    settings.update(overrides)
    settings.update(user_settings(cfg))
    return settings


# A group member's session; also set on clients that never join a group, because librdkafka
# refuses any consumer whose max.poll.interval.ms (-X) is below it (its default is 45 s).
SESSION_TIMEOUT_MS = 10_000


def consumer_settings(
    cfg: KafkaSettings, group_id: str, role: str = "consumer", **overrides: Any
) -> dict[str, Any]:
    settings = base_settings(cfg, role)
    settings.update(
        {
            "group.id": group_id,
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "auto.offset.reset": "earliest",
            "partition.assignment.strategy": "cooperative-sticky",
            "session.timeout.ms": SESSION_TIMEOUT_MS,
            "heartbeat.interval.ms": 1_000,
            "max.poll.interval.ms": 300_000,
        }
    )
    settings.update(overrides)
    settings.update(user_settings(cfg))
    return for_group_protocol(settings)


# What a classic group member sets and a KIP-848 one (group.protocol=consumer) must not: the
# broker owns the session, the heartbeat and the assignor there, and librdkafka refuses a
# consumer that sets them ("`session.timeout.ms` is not supported for group.protocol=consumer")
CLASSIC_ONLY = ("session.timeout.ms", "heartbeat.interval.ms", "partition.assignment.strategy")


def for_group_protocol(settings: dict[str, Any]) -> dict[str, Any]:
    """``settings`` without the classic-only ones when they ask for ``group.protocol=consumer``
    (KIP-848: the broker's ``group.consumer.*`` settings decide them, srl's
    apache_kafka/server.properties sets the same 10 s and 1 s); with ``group.protocol=classic``
    instead, the classic ones kept, where the broker answered that it takes no KIP-848 groups
    (Kafka 3.x: ``srl.kafka.groupprotocol``, asked once per process, only here)."""
    if str(settings.get("group.protocol", "classic")).lower() != "consumer":
        return settings
    if classic_instead(settings):
        return settings | {"group.protocol": "classic"}
    return {k: v for k, v in settings.items() if k not in CLASSIC_ONLY}


def reader_group(prefix: str) -> str:
    """The group id of every srl client that only reads assigned partitions (it never joins
    or commits; librdkafka still looks up its coordinator, which needs Describe on it)."""
    return f"{prefix}.reader"


def check_settings(cfg: KafkaSettings) -> None:
    """ConfigError if librdkafka refuses the settings srl would give it with ``cfg.kafka``
    (``-X``): an unknown name, a bad value, a combination it rejects, a file it cannot read.
    Checked by making a producer and a consumer with srl's settings and closing them at once
    (librdkafka checks its configuration when a client is made, and connects in the
    background afterwards), so a command fails on a bad ``-X`` before it does any work. The
    message names the settings given but shows no value (a secret under a misspelt name is
    still a secret); librdkafka's own words name the one it refused."""
    producer = (
        producer_settings(cfg, "check")
        if isinstance(cfg, ProducerSettings)
        else base_settings(cfg, "check")
        | {"enable.idempotence": True, "acks": "all"}
        | user_settings(cfg)
    )
    consumer = consumer_settings(cfg, reader_group(cfg.topic_prefix), "check")
    # the token callback is checked by importing it (user_settings): a client made with it
    # waits ~1 s for its first token, and this one connects nowhere
    producer.pop("oauth_cb", None)
    consumer.pop("oauth_cb", None)
    try:
        confluent_kafka.Producer(producer).flush(0)
        confluent_kafka.Consumer(consumer).close()
    except KafkaException as e:
        given = ", ".join(cfg.kafka)
        raise ConfigError(f"kafka settings ({given or 'defaults'}): {describe(e)}") from None


def error_of(e: BaseException | None) -> KafkaError | None:
    """The ``KafkaError`` a ``KafkaException`` carries (None for anything else)."""
    if isinstance(e, KafkaException) and e.args and isinstance(e.args[0], KafkaError):
        return e.args[0]
    return None


def describe(e: BaseException | None) -> str:
    """A Kafka error (or any exception) as one short line, remembered secrets scrubbed."""
    if (err := error_of(e)) is not None:
        return scrub(" ".join(err.str().split()))
    return scrub(" ".join(str(e).split())[:200])
