"""Clients that never join a group accept the settings group members accept (``-X``); a
member failed for good is started over."""

from __future__ import annotations

import pytest

from srl.config import CommonConfig, load_config
from srl.errors import ConsumerFailed, StartOver
from srl.kafka import KafkaError, Lag, reader
from srl.kafka import consumer as consumer_module


def test_readers_accept_a_max_poll_interval_below_librdkafkas_default_session() -> None:
    # librdkafka refuses max.poll.interval.ms < session.timeout.ms (default 45 s) at creation,
    # even for a client that never joins; generators are run with -X max.poll.interval.ms=15000
    cfg = load_config(
        CommonConfig,
        cli={"bootstrap_servers": "127.0.0.1:1", "kafka": {"max.poll.interval.ms": "15000"}},
        env={},
    )
    reader(cfg, "test").close()
    Lag(cfg).close()


class _Event:
    def __init__(self, err: KafkaError | None) -> None:
        self.err = err

    def error(self) -> KafkaError | None:
        return self.err


def test_a_fatal_consumer_error_makes_its_owner_start_over() -> None:
    """A static member fenced for good (its coordinator moved, its rejoin raced its commit)
    gets a fatal error event and nothing more: the trainer sat there for 80 s (srl chaos,
    kafka-controller-kill). Its owner must start over with a new member instead."""
    fenced = KafkaError(KafkaError._FATAL, "Static consumer fenced", fatal=True)
    with pytest.raises(ConsumerFailed, match="failed for good: Static consumer fenced"):
        consumer_module._alive(_Event(fenced))
    assert issubclass(ConsumerFailed, StartOver)
    transient = _Event(KafkaError(KafkaError._PARTITION_EOF))
    assert consumer_module._alive(transient) is transient and consumer_module._alive(None) is None
