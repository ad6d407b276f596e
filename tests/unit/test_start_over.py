"""``srl.kafka.start_over``: a role whose producer failed for good (a broker that lost what it
acknowledged) runs again in its own process, once per gap; otherwise the error is raised."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from srl.errors import ProducerFailed
from srl.kafka import start_over


def failing(times: int) -> tuple[list[int], Callable[[], str]]:
    calls: list[int] = []

    def run() -> str:
        calls.append(len(calls))
        if len(calls) <= times:
            raise ProducerFailed("the producer to 127.0.0.1:1 failed for good: lost records")
        return "done"

    return calls, run


def test_a_failed_producer_runs_the_role_again() -> None:
    calls, run = failing(1)
    assert start_over(run, "test") == "done"
    assert calls == [0, 1]


def test_a_second_failure_within_the_gap_is_raised() -> None:
    calls, run = failing(2)
    with pytest.raises(ProducerFailed, match="failed for good"):
        start_over(run, "test", gap_s=60)
    assert calls == [0, 1]
    calls, run = failing(2)
    assert start_over(run, "test", gap_s=0) == "done"


def test_a_role_that_may_not_start_over_raises_at_once() -> None:
    calls, run = failing(1)
    with pytest.raises(ProducerFailed):
        start_over(run, "test", again=False)
    assert calls == [0]


def test_other_errors_are_not_caught() -> None:
    def run() -> None:
        raise ValueError("a bug")

    with pytest.raises(ValueError):
        start_over(run, "test")
