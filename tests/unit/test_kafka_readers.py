"""Clients that never join a group accept the settings group members accept (``-X``)."""

from __future__ import annotations

from srl.config import CommonConfig, load_config
from srl.kafka import Lag, reader


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
