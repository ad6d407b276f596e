"""``srl.kafka.Consumer.commit_sync`` checks every partition of the answer, not only the call.

librdkafka's synchronous commit returns the partitions it committed, each with its own
``error``; a client (or a librdkafka version) that reports a refused partition only there,
with the call itself succeeding, must not pass for committed. The real broker refuses a whole
request when a partition fails (``tests/integration/test_commits.py``), so the per-partition
path is shown here with a hand-written client in place of librdkafka's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from srl.kafka import Consumer, KafkaError, KafkaException, TopicPartition


@dataclass
class Answer:
    """One partition of a commit's answer, as librdkafka returns it."""

    topic: str
    partition: int
    offset: int
    error: Any = None


class Client:
    def __init__(self, answer: list[Answer]) -> None:
        self.answer = answer

    def commit(self, offsets: list[TopicPartition], asynchronous: bool) -> list[Answer]:
        assert asynchronous is False
        return self.answer


def consumer(answer: list[Answer]) -> Consumer:
    c = Consumer.__new__(Consumer)
    c._c = Client(answer)  # type: ignore[assignment]
    return c


def test_a_partition_refused_in_the_answer_raises() -> None:
    refused = KafkaError(KafkaError.UNKNOWN_MEMBER_ID)
    c = consumer([Answer("t", 0, 5), Answer("t", 1, 7, refused)])
    with pytest.raises(KafkaException) as e:
        c.commit_sync([TopicPartition("t", 0, 5), TopicPartition("t", 1, 7)])
    assert e.value.args[0].code() == KafkaError.UNKNOWN_MEMBER_ID


def test_an_answer_without_errors_is_committed() -> None:
    c = consumer([Answer("t", 0, 5), Answer("t", 1, 7)])
    c.commit_sync([TopicPartition("t", 0, 5), TopicPartition("t", 1, 7)])
