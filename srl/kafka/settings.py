"""librdkafka settings, in one place: every client srl makes starts from these.

* producers are idempotent with ``acks=all``, lz4 by default (zstd for long links), a
  configurable linger, and bounded delivery timeouts so a dead broker is an error, not a hang;
* consumers store offsets manually (``enable.auto.offset.store=false``), never auto-commit,
  and use the cooperative-sticky assignor so pools can grow and shrink without stop-the-world;
* ``cfg.kafka`` (``-X key=value``) is applied last and can override anything; every command
  checks it (``check_settings``) before it does any work.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Any

import confluent_kafka
from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient

from srl.config import KafkaSettings, ProducerSettings
from srl.errors import BrokerUnavailable, ConfigError

# librdkafka's own log lines (connection refused, retries) go here, not to stderr.
_rdkafka_log = logging.getLogger("srl.librdkafka")
_rdkafka_log.setLevel(logging.DEBUG if os.environ.get("SRL_KAFKA_DEBUG") else logging.CRITICAL)


def client_id(role: str) -> str:
    return f"srl-{role}-{socket.gethostname()}-{os.getpid()}"


SOCKET_TIMEOUT_MS = 10_000


def base_settings(cfg: KafkaSettings, role: str = "client") -> dict[str, Any]:
    return {
        "bootstrap.servers": cfg.bootstrap_servers,
        "client.id": client_id(role),
        "logger": _rdkafka_log,
        "socket.connection.setup.timeout.ms": int(cfg.connect_timeout_s * 1000),
        # A request unanswered this long closes its connection and is sent again on a new one
        # (librdkafka's default is 60 s). Across a silent partition a connection is not
        # reset: TCP retransmits with exponential backoff, so after the partition heals the
        # old connection may stay mute for tens of seconds (srl chaos, generator-partition).
        "socket.timeout.ms": SOCKET_TIMEOUT_MS,
    }


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
    settings.update(cfg.kafka)
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
    settings.update(cfg.kafka)
    return for_group_protocol(settings)


# What a classic group member sets and a KIP-848 one (group.protocol=consumer) must not: the
# broker owns the session, the heartbeat and the assignor there, and librdkafka refuses a
# consumer that sets them ("`session.timeout.ms` is not supported for group.protocol=consumer")
CLASSIC_ONLY = ("session.timeout.ms", "heartbeat.interval.ms", "partition.assignment.strategy")


def for_group_protocol(settings: dict[str, Any]) -> dict[str, Any]:
    """``settings`` without the classic-only ones when they ask for ``group.protocol=consumer``
    (KIP-848: the broker's ``group.consumer.*`` settings decide them, srl's
    apache_kafka/server.properties sets the same 10 s and 1 s)."""
    if str(settings.get("group.protocol", "classic")).lower() != "consumer":
        return settings
    return {k: v for k, v in settings.items() if k not in CLASSIC_ONLY}


def check_settings(cfg: KafkaSettings) -> None:
    """ConfigError if librdkafka refuses the settings srl would give it with ``cfg.kafka``
    (``-X``): an unknown name, a bad value, a combination it rejects. Checked by making a
    producer and a consumer with srl's settings and closing them at once (librdkafka checks
    its configuration when a client is made, and connects in the background afterwards), so a
    command fails on a bad ``-X`` before it does any work."""
    producer = (
        producer_settings(cfg, "check")
        if isinstance(cfg, ProducerSettings)
        else base_settings(cfg, "check") | {"enable.idempotence": True, "acks": "all"} | cfg.kafka
    )
    consumer = consumer_settings(cfg, "srl-settings-check", "check")
    try:
        confluent_kafka.Producer(producer).flush(0)
        confluent_kafka.Consumer(consumer).close()
    except KafkaException as e:
        given = " ".join(f"{k}={v}" for k, v in cfg.kafka.items())
        raise ConfigError(f"kafka settings ({given or 'defaults'}): {describe(e)}") from None


def wait_for_broker(cfg: KafkaSettings, timeout_s: float | None = None) -> Any:
    """Cluster metadata once a broker answers; BrokerUnavailable after ``timeout_s``."""
    timeout_s = cfg.connect_timeout_s if timeout_s is None else timeout_s
    admin = AdminClient({k: v for k, v in base_settings(cfg, "admin").items()} | cfg.kafka)
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        try:
            md = admin.list_topics(timeout=min(remaining, 2.0))
            if md.brokers:
                return md
        except KafkaException as e:
            last = e
        time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
    why = f" ({describe(last)})" if last else ""
    raise BrokerUnavailable(
        f"no Kafka broker answered at {cfg.bootstrap_servers} within {timeout_s:g}s{why}; "
        "start one with `srl broker start` or point --bootstrap at a running broker"
    )


def describe(e: BaseException | None) -> str:
    """A Kafka error (or any exception) as one short line."""
    if isinstance(e, KafkaException) and e.args and isinstance(e.args[0], KafkaError):
        return " ".join(e.args[0].str().split())
    return " ".join(str(e).split())[:200]


# noida-db 0.2.3, the embedded broker, reports this fixed cluster id (it is in its binary);
# Apache Kafka makes a random one per cluster (``kafka-storage random-uuid``)
EMBEDDED_CLUSTER_ID = "MkU3OEVBNTctOEUyRi00"
_embedded: dict[str, bool] = {}


def embedded_broker(bootstrap: str, timeout_s: float = 5.0) -> bool | None:
    """Whether the broker at ``bootstrap`` is the embedded one (noida-db), known by its cluster
    id, asked once per process and bootstrap; None when no broker answers. Its gaps
    (docs/broker.md) are what srl's broker-specific workarounds answer, so they are on only
    where it runs (``idle_fetches_spin``, ``forgets_acknowledged``)."""
    if bootstrap not in _embedded:
        settings: dict[str, Any] = {"bootstrap.servers": bootstrap, "logger": _rdkafka_log}
        client = AdminClient(settings)
        try:
            md = client.list_topics(timeout=timeout_s)
        except KafkaException:
            return None
        if not md.brokers:
            return None
        _embedded[bootstrap] = md.cluster_id == EMBEDDED_CLUSTER_ID
    return _embedded[bootstrap]


def idle_fetches_spin(bootstrap: str) -> bool:
    """Whether a consumer that has read to the end of its partitions fetches again at once,
    busily: the embedded broker answers such a fetch empty and at once, Apache Kafka holds it
    for ``fetch.wait.max.ms`` (docs/broker.md). True when no broker answers (the workaround,
    ``srl.kafka.quiet``, is correct on every broker, only needless on Kafka).
    ``SRL_KAFKA_QUIET=on|off`` decides instead (benchmarks)."""
    forced = os.environ.get("SRL_KAFKA_QUIET", "").lower()
    if forced in ("on", "off"):
        return forced == "on"
    return embedded_broker(bootstrap) is not False


def forgets_acknowledged(bootstrap: str) -> bool:
    """Whether a broker killed at once can lose records it acknowledged with ``acks=all``: the
    embedded one writes its state down 0.3-0.5 s after a change; Apache Kafka keeps what it
    acknowledged (in the page cache of one node, on min.insync.replicas nodes of a cluster).
    True when no broker answers."""
    return embedded_broker(bootstrap) is not False


def broker_answers(bootstrap: str, timeout_s: float = 1.0) -> bool:
    """Whether a broker at ``bootstrap`` answers a metadata request within ``timeout_s``."""
    return broker_count(bootstrap, timeout_s) > 0


def broker_count(bootstrap: str, timeout_s: float = 1.0) -> int:
    """How many brokers the metadata from ``bootstrap`` lists (0: none answered in time)."""
    settings: dict[str, Any] = {"bootstrap.servers": bootstrap, "logger": _rdkafka_log}
    client = AdminClient(settings)
    try:
        return len(client.list_topics(timeout=timeout_s).brokers)
    except KafkaException:
        return 0
