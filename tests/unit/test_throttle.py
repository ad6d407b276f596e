"""``srl.kafka.producer.Throttle``: when a produce waits under a broker's quota."""

from __future__ import annotations

import pytest

from srl.kafka import producer
from srl.kafka.producer import Throttle


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(producer.time, "monotonic", c)
    return c


def queue(th: Throttle, clock: Clock, n: int) -> None:
    for _ in range(n):
        th.queued.append(clock.t)


def test_unthrottled_nothing_waits(clock: Clock) -> None:
    th = Throttle(30.0)
    queue(th, clock, 1000)
    clock.t += 100  # old records, a long queue: no quota seen, no wait
    assert not th.full(1000)


def test_a_record_older_than_the_share_of_the_timeout_holds_the_next(clock: Clock) -> None:
    th = Throttle(4.0)  # budget 1 s, within the RATE_AFTER_S the rate is not yet known in
    th.saw(1.0)
    queue(th, clock, 10)
    clock.t += 0.9
    assert not th.full(10)
    clock.t += 0.2
    assert th.full(10)
    assert not th.full(Throttle.MIN_QUEUED)  # a short queue always takes one more
    for _ in range(10):
        th.reported()
    assert not th.full(10)  # the old ones were delivered


def test_more_queued_than_the_measured_rate_drains_in_the_share_holds(clock: Clock) -> None:
    th = Throttle(30.0)  # budget 7.5 s
    th.saw(1.0)
    clock.t += Throttle.RATE_AFTER_S
    for _ in range(4):  # 2 records a second since the throttling began: 15 in 7.5 s
        th.reported()
    queue(th, clock, 20)
    assert not th.full(15)
    assert th.full(16)


def test_the_hold_ends_once_the_broker_stops_throttling(clock: Clock) -> None:
    th = Throttle(30.0)
    th.saw(1.0)
    queue(th, clock, 50)
    clock.t += 8.0
    assert th.full(50)
    clock.t += Throttle.HOLD_S
    assert not th.full(50)
