"""The first contact with a broker, without one: which failures are one line at once, and a
secured client that never asks which kind of broker it talks to."""

from __future__ import annotations

import time

import pytest

from srl.config import CommonConfig
from srl.kafka import KafkaError, embedded_broker, groupprotocol, idle_fetches_spin
from srl.kafka.probe import connect_failure, secured
from srl.kafka.settings import CLASSIC_ONLY, for_group_protocol
from srl.ports import free_port

SASL = {
    "bootstrap.servers": "k:9093",
    "security.protocol": "SASL_SSL",
    "sasl.mechanisms": "SCRAM-SHA-512",
    "sasl.username": "gen",
    "ssl.ca.location": "/etc/ca.pem",
}


def test_authentication_and_tls_failures_are_one_line() -> None:
    auth = KafkaError(
        KafkaError._AUTHENTICATION,
        "sasl_ssl://k:9093/bootstrap: SASL authentication error: Authentication failed during "
        "authentication due to invalid credentials with SASL mechanism SCRAM-SHA-512 (after 309ms "
        "in state AUTH_REQ)",
    )
    line = connect_failure(auth, SASL)
    assert line is not None and line.startswith("kafka: authentication failed at k:9093")
    assert "(SASL SCRAM-SHA-512 as gen)" in line and "after 309ms" not in line
    tls = KafkaError(
        KafkaError._TRANSPORT,
        "sasl_ssl://k:9093/bootstrap: error:0A000086:SSL routines::certificate verify failed",
    )
    line = connect_failure(tls, SASL)
    assert line is not None and "does not verify against ssl.ca.location (/etc/ca.pem)" in line
    down = KafkaError(KafkaError._TRANSPORT, "k:9093/bootstrap: Connect to ipv4#1.2.3.4 failed")
    assert connect_failure(down, SASL) is None  # not up yet: worth waiting for


def test_a_secured_client_is_never_on_the_embedded_broker_and_never_asks() -> None:
    assert secured(SASL) and not secured({"security.protocol": "PLAINTEXT"}) and not secured({})
    cfg = CommonConfig(
        bootstrap_servers=f"127.0.0.1:{free_port()}",  # nothing listens: a probe would wait
        kafka={"security.protocol": "SSL"},
    )
    t0 = time.monotonic()
    assert embedded_broker(cfg) is False and not idle_fetches_spin(cfg)
    assert time.monotonic() - t0 < 0.5


def test_a_plaintext_probe_without_a_broker_says_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SRL_KAFKA_QUIET", raising=False)
    cfg = CommonConfig(bootstrap_servers=f"127.0.0.1:{free_port()}")
    assert embedded_broker(cfg) is None and idle_fetches_spin(cfg)


def test_a_consumer_group_member_is_classic_where_the_broker_takes_no_kip848_groups(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``group.protocol=consumer`` keeps it (without the classic-only settings librdkafka
    refuses) where the broker takes KIP-848 groups or cannot say; becomes ``classic`` with
    them, warned once per bootstrap, where it answered no (Kafka 3.x)."""
    answers = {"k4:9092": True, "k3:9092": False, "quiet:9092": None}
    monkeypatch.setattr(groupprotocol, "kip848_groups", lambda s: answers[s["bootstrap.servers"]])
    monkeypatch.setattr(groupprotocol, "_warned", set())
    asked = {k: 1 for k in CLASSIC_ONLY} | {"group.protocol": "consumer", "group.id": "g"}
    for where in ("k4:9092", "quiet:9092"):
        got = for_group_protocol(asked | {"bootstrap.servers": where})
        assert got["group.protocol"] == "consumer" and not set(CLASSIC_ONLY) & set(got)
    with caplog.at_level("WARNING", logger="srl.kafka"):
        for _ in range(3):
            got = for_group_protocol(asked | {"bootstrap.servers": "k3:9092"})
            assert got == asked | {"bootstrap.servers": "k3:9092", "group.protocol": "classic"}
    assert [r.getMessage() for r in caplog.records if "KIP-848" in r.getMessage()] == [
        "the broker at k3:9092 takes no KIP-848 groups (group.coordinator.rebalance.protocols "
        "lists no consumer: Kafka 3.x); group.protocol=consumer ignored, srl's members are "
        "classic ones"
    ]
    classic = {"group.id": "g", "bootstrap.servers": "k3:9092"}
    assert for_group_protocol(classic) is classic  # never asks: classic is srl's default
