"""``read_range``: every record of some partitions, from a start to the end as of the call.

The one "read this topic back" loop: the demo's report (whole topics), the weights
announcements (the weights topic), a generator's recovery of published prefixes (partitions
of the trajectories topic since a time). What must hold:

* the end of each partition is its high watermark when the call starts, so a growing topic
  still ends; a partition already at its end yields nothing;
* the start is the low watermark, a given offset, or the first offset at or after a timestamp
  (``offsets_for_times``); a partition with nothing after that time yields nothing;
* records come in offset order per partition; a record with an error is skipped (and logged);
* a read that has not reached every end within ``timeout_s`` raises ``SrlError`` naming the
  unfinished partitions, so a caller never mistakes a partial read for the whole.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence

from confluent_kafka import Message, TopicPartition

from srl.config import KafkaSettings
from srl.errors import SrlError
from srl.kafka.consumer import Consumer, reader

log = logging.getLogger("srl.kafka")


def read_range(
    cfg: KafkaSettings,
    topic: str,
    partitions: Sequence[int] | None = None,
    since_ms: int | None = None,
    start: dict[int, int] | None = None,
    timeout_s: float = 30.0,
    role: str = "range-reader",
) -> Iterator[Message]:
    """Records of ``topic`` (``partitions``: all when None) from their start to the high
    watermark at call time; start: ``start[p]``, else the first at or after ``since_ms``,
    else the low watermark."""
    with reader(cfg, role) as c:
        ends = _bounds(c, topic, partitions, since_ms, start or {}, timeout_s)
        if not ends:
            return
        c.assign([TopicPartition(topic, p, first) for p, (first, _end) in ends.items()])
        todo = {p: end for p, (_first, end) in ends.items()}
        deadline = time.monotonic() + timeout_s
        while todo:
            if time.monotonic() >= deadline:
                raise SrlError(
                    f"reading {topic} back timed out after {timeout_s:g}s on partitions "
                    f"{sorted(todo)}"
                )
            msg = c.poll(0.2)
            if msg is None:
                continue
            if msg.error() is not None:
                log.debug("%s: %s", topic, msg.error())
                continue
            p, offset = msg.partition() or 0, msg.offset() or 0
            if p not in todo or offset >= todo[p]:
                continue
            if offset >= todo[p] - 1:
                del todo[p]
            yield msg


def _bounds(
    c: Consumer,
    topic: str,
    partitions: Sequence[int] | None,
    since_ms: int | None,
    start: dict[int, int],
    timeout_s: float,
) -> dict[int, tuple[int, int]]:
    """``{partition: (first offset, end offset)}`` of the partitions with something to read."""
    tps = c.partitions_of([topic], timeout_s)
    if partitions is not None:
        wanted = set(partitions)
        tps = [tp for tp in tps if tp.partition in wanted]
    firsts: dict[int, int] = {}
    if since_ms is not None:
        at = [TopicPartition(topic, tp.partition, since_ms) for tp in tps]
        firsts = {tp.partition: tp.offset for tp in c.offsets_for_times(at, timeout=timeout_s)}
    out = {}
    deadline = time.monotonic() + timeout_s
    for tp in tps:
        low, high = watermarks_of(c, tp, deadline)
        first = start.get(tp.partition, firsts.get(tp.partition, low))
        if first < 0:  # nothing at or after since_ms
            continue
        first = max(first, low)
        if first < high:
            out[tp.partition] = (first, high)
    return out


def watermarks_of(c: Consumer, tp: TopicPartition, deadline: float) -> tuple[int, int]:
    """``(low, high)`` of ``tp`` by ``deadline``, asked again while its leader moves
    (``Consumer.get_watermark_offsets``)."""
    return c.get_watermark_offsets(tp, timeout=max(0.1, deadline - time.monotonic()))
