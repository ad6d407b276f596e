"""Whether the broker takes KIP-848 groups (``group.protocol=consumer``), for a client that asks
for them: Kafka 4.0+ does by default, 3.7-3.9 only with their early access switched on, older
releases not at all. srl's members are classic ones unless ``-X group.protocol=consumer`` says
otherwise; a client that says so on a broker that answers no gets a classic member instead,
with one warning (``srl.kafka.settings.for_group_protocol``), not one that waits for an
assignment that never comes (measured on 3.9.2: no assignment, then ``Commit failed: Local:
No offset stored``).

The broker is asked once per process and bootstrap, with the client's own connection and
security settings, only by a client that asks for KIP-848 groups (srl's default, classic, never
asks): DescribeConfigs of one broker, its :data:`PROTOCOLS_SETTING`. No answer (asked again
next time) or no right to describe the broker's settings (kept): the client does as told.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient, ConfigResource

# The broker setting that lists the group protocols it takes: Kafka 4.x "classic,consumer" by
# default, 3.7-3.9 "classic" (KIP-848 was early access there); older brokers have none
PROTOCOLS_SETTING = "group.coordinator.rebalance.protocols"
PROBE_S = 2.0

log = logging.getLogger("srl.kafka")
_kip848: dict[str, bool | None] = {}  # bootstrap -> kip848_groups, once a broker answered
_warned: set[str] = set()  # bootstraps whose group.protocol=consumer became classic
_lock = threading.Lock()


def connection_settings(settings: Mapping[str, Any]) -> dict[str, Any]:
    """A made client's settings without what only a producer or a consumer takes: where it
    connects, how (security), and where it logs."""
    keep = ("security.", "sasl.", "ssl.", "socket.", "enable.ssl", "client.", "broker.")
    exact = {"bootstrap.servers", "logger", "oauth_cb", "debug", "reconnect.backoff.ms"}
    return {k: v for k, v in settings.items() if k in exact or k.startswith(keep)}


def kip848_groups(settings: Mapping[str, Any], timeout_s: float = PROBE_S) -> bool | None:
    """Whether the broker a client with ``settings`` connects to takes KIP-848 groups: its
    :data:`PROTOCOLS_SETTING` lists ``consumer``. None when it cannot tell: no broker answered
    (asked again next time), or the client may not describe the broker's settings
    (DescribeConfigs on the cluster; kept)."""
    conf = connection_settings(settings)
    bootstrap = str(conf.get("bootstrap.servers"))
    with _lock:
        if bootstrap in _kip848:
            return _kip848[bootstrap]
    admin = AdminClient(conf)
    try:
        md = admin.list_topics(timeout=timeout_s)
    except KafkaException:
        return None
    if not md.brokers:
        return None
    resource = ConfigResource("broker", str(min(md.brokers)))
    offered: bool | None
    try:
        entries = admin.describe_configs([resource], request_timeout=timeout_s)[resource].result()
        entry = entries.get(PROTOCOLS_SETTING)
        offered = entry is not None and "consumer" in str(entry.value).lower().split(",")
    except KafkaException:
        offered = None
    with _lock:
        _kip848[bootstrap] = offered
    return offered


def classic_instead(settings: Mapping[str, Any]) -> bool:
    """Whether a client asking for ``group.protocol=consumer`` must be a classic member: the
    broker answered that it takes no KIP-848 groups (Kafka 3.x). Warned once per process and
    bootstrap."""
    if kip848_groups(settings) is not False:
        return False
    bootstrap = str(settings.get("bootstrap.servers"))
    with _lock:
        first = bootstrap not in _warned
        _warned.add(bootstrap)
    if first:
        log.warning(
            "the broker at %s takes no KIP-848 groups (%s lists no consumer: Kafka 3.x); "
            "group.protocol=consumer ignored, srl's members are classic ones",
            bootstrap,
            PROTOCOLS_SETTING,
        )
    return True
