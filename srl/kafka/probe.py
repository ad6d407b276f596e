"""The first contact with a broker: waiting for it, telling why it refuses, and which kind it is.

* ``wait_for_broker``: cluster metadata once a broker answers, with the client's whole config
  (security included); a wrong password, a certificate that does not verify or a TLS
  handshake refused is one line at once (``connect_failure``), not "no broker answered";
* ``embedded_broker``: whether the broker is the embedded one (noida-db), known by its cluster
  id, which switches srl's workarounds for its gaps on (``idle_fetches_spin``,
  ``forgets_acknowledged``; docs/broker.md). The embedded broker speaks PLAINTEXT only, so a
  client with any other ``security.protocol`` is on Apache Kafka (or a Kafka service) without
  asking. Otherwise the cluster id is asked once per process and bootstrap, with the client's
  settings, and kept; ``wait_for_broker`` keeps the one it got, so a role that waited for its
  broker never asks again;
* ``srl_started``: whether srl started the broker (the embedded one, or Apache Kafka from
  ``srl broker start`` / ``srl.broker.apache``, whose cluster ids begin with :data:`SRL_MARK`):
  where ``create_topics = "auto"`` lets a role create a topic it finds missing;
* whether the broker takes KIP-848 groups: ``srl.kafka.groupprotocol``;
* ``broker_answers`` / ``broker_count``: how ``srl broker`` knows a node is up.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping
from typing import Any

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient

from srl.config import KafkaSettings
from srl.errors import BrokerUnavailable, SrlError
from srl.kafka.groupprotocol import connection_settings
from srl.kafka.settings import base_settings, describe, rdkafka_log, user_settings
from srl.secrets import scrub

# noida-db 0.2.3, the embedded broker, reports this fixed cluster id (it is in its binary);
# Apache Kafka makes a random one per cluster (``kafka-storage random-uuid``)
EMBEDDED_CLUSTER_ID = "MkU3OEVBNTctOEUyRi00"
# srl.broker.apache's cluster ids: 16 random bytes whose first three are b"srl" (base64 "c3Js")
SRL_MARK = "c3Js"
PROBE_S = 2.0  # how long a probe of the cluster id waits for a PLAINTEXT broker

_clusters: dict[str, str] = {}  # bootstrap -> cluster id, once a broker answered
_lock = threading.Lock()

Where = KafkaSettings | Mapping[str, Any]


def client_config(where: Where, role: str = "probe") -> dict[str, Any]:
    """A client's connection settings: of ``cfg`` (srl's and the user's), or those of a made
    client (its settings dict), without what only a producer or a consumer takes."""
    if isinstance(where, KafkaSettings):
        return base_settings(where, role) | user_settings(where)
    return connection_settings(where)


def secured(settings: Mapping[str, Any]) -> bool:
    """Whether the client speaks anything but PLAINTEXT (TLS, SASL): never the embedded broker."""
    return str(settings.get("security.protocol", "plaintext")).lower() != "plaintext"


def note_cluster(bootstrap: str, cluster_id: str | None) -> None:
    with _lock:
        _clusters[bootstrap] = cluster_id or ""


def cluster_id(where: Where, timeout_s: float = PROBE_S) -> str | None:
    """The cluster id of the broker at ``where`` (kept once known); None when none answered."""
    settings = client_config(where)
    bootstrap = str(settings["bootstrap.servers"])
    with _lock:
        if bootstrap in _clusters:
            return _clusters[bootstrap]
    try:
        md = AdminClient(settings).list_topics(timeout=timeout_s)
    except KafkaException:
        return None
    if not md.brokers:
        return None
    note_cluster(bootstrap, md.cluster_id)
    return md.cluster_id or ""


def embedded_broker(where: Where) -> bool | None:
    """Whether the broker at ``where`` is the embedded one (noida-db); None when no broker
    answers. A secured client is never on it; otherwise asked once (``cluster_id``)."""
    settings = client_config(where)
    if secured(settings):
        return False
    cid = cluster_id(settings)
    return None if cid is None else cid == EMBEDDED_CLUSTER_ID


def srl_started(where: Where) -> bool:
    """Whether srl started the broker at ``where``: the embedded one, or Apache Kafka nodes of
    ``srl broker start --engine kafka`` (their cluster ids carry :data:`SRL_MARK`)."""
    cid = cluster_id(where)
    return cid is not None and (cid == EMBEDDED_CLUSTER_ID or cid.startswith(SRL_MARK))


def idle_fetches_spin(where: Where) -> bool:
    """Whether a consumer that has read to the end of its partitions fetches again at once,
    busily: the embedded broker answers such a fetch empty and at once, Apache Kafka holds it
    for ``fetch.wait.max.ms`` (docs/broker.md). True when no broker answers (the workaround,
    ``srl.kafka.quiet``, is correct on every broker, only needless on Kafka).
    ``SRL_KAFKA_QUIET=on|off`` decides instead (benchmarks)."""
    forced = os.environ.get("SRL_KAFKA_QUIET", "").lower()
    if forced in ("on", "off"):
        return forced == "on"
    return embedded_broker(where) is not False


def forgets_acknowledged(where: Where) -> bool:
    """Whether a broker killed at once can lose records it acknowledged with ``acks=all``: the
    embedded one writes its state down 0.3-0.5 s after a change; Apache Kafka keeps what it
    acknowledged (in the page cache of one node, on min.insync.replicas nodes of a cluster).
    True when no broker answers."""
    return embedded_broker(where) is not False


def broker_answers(
    bootstrap: str, timeout_s: float = 1.0, settings: Mapping[str, Any] | None = None
) -> bool:
    """Whether a broker at ``bootstrap`` answers a metadata request within ``timeout_s``
    (``settings``: the client's security settings, if it needs any)."""
    return broker_count(bootstrap, timeout_s, settings) > 0


def broker_count(
    bootstrap: str, timeout_s: float = 1.0, settings: Mapping[str, Any] | None = None
) -> int:
    """How many brokers the metadata from ``bootstrap`` lists (0: none answered in time)."""
    conf: dict[str, Any] = {"logger": rdkafka_log, **(settings or {})}
    client = AdminClient(conf | {"bootstrap.servers": bootstrap})
    try:
        return len(client.list_topics(timeout=timeout_s).brokers)
    except KafkaException:
        return 0


class BrokerRefused(SrlError):
    """A broker answered and refused this client: a wrong password, an untrusted certificate,
    a TLS handshake it refused. Retrying cannot help."""


def connect_failure(err: KafkaError, settings: Mapping[str, Any]) -> str | None:
    """The one line for an error a client reported while connecting, when it is one that
    retrying cannot cure (authentication, TLS); None for the others (a broker not up yet)."""
    text = scrub(" ".join(err.str().split()))
    where = settings.get("bootstrap.servers")
    if err.code() == KafkaError._AUTHENTICATION:
        who = settings.get("sasl.username")
        mech = settings.get("sasl.mechanisms") or settings.get("sasl.mechanism") or "GSSAPI"
        as_who = f" as {who}" if who else ""
        return (
            f"kafka: authentication failed at {where} (SASL {mech}{as_who}): {_tail(text)}; "
            "check sasl.username and sasl.password (docs/security.md)"
        )
    lowered = text.lower()
    if err.code() == KafkaError._SSL or "ssl" in lowered or "certificate" in lowered:
        ca = settings.get("ssl.ca.location")
        hint = (
            f"the broker's certificate does not verify against ssl.ca.location ({ca})"
            if "verify failed" in lowered
            else "check the ssl.* settings"
        )
        return f"kafka: TLS with {where} failed: {_tail(text)}; {hint} (docs/security.md)"
    return None


def _tail(text: str) -> str:
    """librdkafka's message without its ``proto://host:port/id: `` head and ``(after …)`` tail."""
    body = text.split(": ", 1)[1] if "://" in text.split(": ", 1)[0] else text
    return body.split(" (after ")[0]


def known(bootstrap: str) -> bool:
    """Whether a broker at ``bootstrap`` has answered this process already."""
    with _lock:
        return bootstrap in _clusters


def wait_for_broker(cfg: KafkaSettings, timeout_s: float | None = None) -> Any:
    """Cluster metadata once a broker answers; ``BrokerRefused`` at once when it refuses the
    client (``connect_failure``); ``BrokerUnavailable`` after ``timeout_s``."""
    return first_contact(cfg, timeout_s)[0]


def first_contact(cfg: KafkaSettings, timeout_s: float | None = None) -> tuple[Any, AdminClient]:
    """``wait_for_broker``'s metadata and the admin client that got it, for a caller that asks
    more of the cluster at once (each client made with ``kafka_oauth_cb`` waits ~1 s for its
    first token in confluent-kafka 2.16: fewer clients, a faster start)."""
    timeout_s = cfg.connect_timeout_s if timeout_s is None else timeout_s
    refused: list[KafkaError] = []
    settings = client_config(cfg, "admin")
    admin = AdminClient(settings | {"error_cb": refused.append})
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while (remaining := deadline - time.monotonic()) > 0:
        try:
            md = admin.list_topics(timeout=min(remaining, 0.5))
            if md.brokers:
                note_cluster(cfg.bootstrap_servers, md.cluster_id)
                return md, admin
        except KafkaException as e:
            last = e
        admin.poll(0)  # serves error_cb
        for err in refused:
            if (line := connect_failure(err, settings)) is not None:
                raise BrokerRefused(line)
        time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
    why = f" ({describe(last)})" if last else ""
    hint = (
        "check bootstrap_servers and security.protocol (docs/security.md)"
        if secured(settings)
        else "start one with `srl broker start` or point --bootstrap at a running broker "
        "(a broker that wants TLS or SASL closes a PLAINTEXT connection at once: set "
        "security.protocol)"
    )
    raise BrokerUnavailable(
        f"no Kafka broker answered at {cfg.bootstrap_servers} within {timeout_s:g}s{why}; {hint}"
    )
