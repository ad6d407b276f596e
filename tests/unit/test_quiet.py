"""``srl.kafka.quiet.Quiet`` against a fake client: when it pauses, wakes and seeks."""

from __future__ import annotations

from typing import Any

from srl.kafka import TopicPartition
from srl.kafka.quiet import Quiet

T = "topic"


class FakeClient:
    """The few calls ``Quiet`` makes of a ``confluent_kafka.Consumer``."""

    def __init__(self, highs: dict[int, int], committed: dict[int, int]) -> None:
        self.highs, self.committed_at = highs, committed
        self.paused: set[int] = set()  # librdkafka keeps a pause across assignments
        self.sought: list[tuple[int, int]] = []
        self.assigned: set[int] | None = None  # None: every partition of ``highs``

    def assignment(self) -> list[TopicPartition]:
        parts = self.highs if self.assigned is None else self.assigned
        return [TopicPartition(T, p) for p in parts]

    def offsets_for_times(self, tps: list[TopicPartition], timeout: float) -> list[Any]:
        return [TopicPartition(T, tp.partition, self.highs[tp.partition]) for tp in tps]

    def get_watermark_offsets(self, tp: TopicPartition, cached: bool) -> tuple[int, int]:
        return 0, self.highs[tp.partition]

    def position(self, tps: list[TopicPartition]) -> list[TopicPartition]:
        return [TopicPartition(T, tp.partition, -1001) for tp in tps]

    def committed(self, tps: list[TopicPartition], timeout: float) -> list[TopicPartition]:
        return [TopicPartition(T, tp.partition, self.committed_at[tp.partition]) for tp in tps]

    def pause(self, tps: list[TopicPartition]) -> None:
        self.paused.update(tp.partition for tp in tps)

    def resume(self, tps: list[TopicPartition]) -> None:
        self.paused.difference_update(tp.partition for tp in tps)

    def seek(self, tp: TopicPartition) -> None:
        self.sought.append((tp.partition, tp.offset))


class Msg:
    def __init__(self, partition: int, offset: int) -> None:
        self._p, self._o = partition, offset

    def error(self) -> None:
        return None

    def topic(self) -> str:
        return T

    def partition(self) -> int:
        return self._p

    def offset(self) -> int:
        return self._o


def probe(q: Quiet) -> None:
    q.next_probe = 0.0
    q.tick()


def test_caught_up_and_unread_partitions_sleep_and_wake_where_they_stopped() -> None:
    # partition 0 read to its end (offset 5), 1 never read with its commit at its end, 2
    # never read with its commit behind its end (it has records to fetch)
    raw = FakeClient(highs={0: 5, 1: 3, 2: 9}, committed={0: 0, 1: 3, 2: 4})
    q = Quiet(raw, 0.02)
    q.saw([Msg(0, 4)])  # type: ignore[list-item]
    probe(q)
    assert raw.paused == {0, 1} and q.at == {(T, 0): 5, (T, 1): 3}
    raw.highs[1] = 4  # a record for partition 1
    probe(q)
    assert raw.paused == {0} and raw.sought == [(1, 3)]


def test_a_quiet_partition_whose_broker_forgot_records_reads_from_the_new_end() -> None:
    raw = FakeClient(highs={0: 10}, committed={0: 0})
    q = Quiet(raw, 0.02)
    q.saw([Msg(0, 9)])  # type: ignore[list-item]
    probe(q)
    assert q.at == {(T, 0): 10}
    raw.highs[0] = 7  # SIGKILLed and restarted: offsets 7..9 forgotten
    probe(q)
    raw.highs[0] = 9  # two new records at offsets 7 and 8
    probe(q)
    assert raw.sought == [(0, 7)] and not raw.paused


def test_the_applications_pause_wins() -> None:
    raw = FakeClient(highs={0: 2}, committed={0: 2})
    q = Quiet(raw, 0.02)
    probe(q)
    q.paused([(T, 0)])  # the application pauses it too (flow control)
    raw.highs[0] = 3
    probe(q)
    assert raw.sought == [] and raw.paused == {0}  # not woken while the application holds it
    assert q.resumable([(T, 0)]) == []  # resumed by the application: still quiet
    probe(q)
    assert raw.sought == [(0, 2)] and not raw.paused


def test_a_partition_read_past_the_end_stays_awake() -> None:
    # the broker forgot records the member had read: its fetch is out of range, and
    # librdkafka's reset (auto.offset.reset) must be free to read the partition again
    raw = FakeClient(highs={0: 10}, committed={0: 0})
    q = Quiet(raw, 0.02)
    q.saw([Msg(0, 11)])  # type: ignore[list-item]
    probe(q)
    assert not raw.paused and q.at == {}


def test_a_quiet_partition_revoked_and_given_back_is_not_left_paused() -> None:
    """librdkafka keeps a pause across unassign and assign: a quiet partition that the group
    took away (a broker restart's rebalance; revoked with no callback of ours) and gave back
    was never fetched again (the trainer in a full ``srl chaos`` run read nothing for 4
    minutes). Found unassigned, it is resumed; given back, it is read from its start."""
    raw = FakeClient(highs={0: 5, 1: 3}, committed={0: 5, 1: 3})
    q = Quiet(raw, 0.02)
    probe(q)
    assert raw.paused == {0, 1}  # both caught up: quiet
    raw.assigned = set()  # revoked, no on_revoke of ours
    probe(q)
    assert raw.paused == set() and q.at == {}
    raw.assigned, raw.highs[0] = {0, 1}, 7  # given back; partition 0 grew meanwhile
    probe(q)
    assert raw.paused == {1} and q.at == {(T, 1): 3}  # 0 has records: it fetches


def test_an_assignment_resumes_the_quiet_partitions_it_names() -> None:
    raw = FakeClient(highs={0: 5, 1: 3}, committed={0: 5, 1: 3})
    q = Quiet(raw, 0.02)
    probe(q)
    q.paused([(T, 1)])  # the application pauses partition 1 too: its pause wins
    q.assigned([TopicPartition(T, 0), TopicPartition(T, 1)])
    assert raw.paused == {1} and q.at == {}
