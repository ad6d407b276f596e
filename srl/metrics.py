"""Metrics and events on ``{prefix}.metrics``, plus the dead-letter path.

Owns how any role reports what it did: ``Metrics.emit`` sends one ``MetricEvent`` (kind,
values, labels, step) and ``Metrics.incr`` keeps counters that ``flush_counters`` sends as a
``counter`` event. ``dead_letter`` puts an unusable record on ``{prefix}.dlq`` with the
reason and its origin in headers, and counts it; ``read_record`` is every input topic's first
check (size, framing, schema), dead-lettering what fails. Nothing here blocks: records go
through the role's producer and are delivered with its next poll/flush.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any, TypeVar

from schemas.records import MetricEvent, Record, SchemaError, decode_as, encode
from srl.kafka import KafkaError, Producer
from srl.topics import Layout

log = logging.getLogger("srl.metrics")
R = TypeVar("R", bound=Record)


class Metrics:
    def __init__(
        self,
        producer: Producer | None,
        layout: Layout,
        run: str,
        source: str,
        best_effort: bool = False,
    ) -> None:
        self.producer = producer
        self.layout = layout
        self.run = run
        self.source = source
        self.counters: Counter[str] = Counter()
        # best effort (a generator's stats): an event that cannot be delivered (the broker was
        # away longer than the delivery timeout) is counted in ``lost``, not raised by flush
        self.best_effort = best_effort
        self.lost = 0

    def emit(
        self,
        kind: str,
        values: dict[str, float] | None = None,
        labels: dict[str, str] | None = None,
        step: int | None = None,
    ) -> MetricEvent:
        event = MetricEvent(
            kind=kind,
            source=self.source,
            run=self.run,
            step=step,
            values={k: float(v) for k, v in (values or {}).items()},
            labels=dict(labels or {}),
        )
        if self.producer is not None:
            cb = self._lost if self.best_effort else None
            self.producer.produce(
                self.layout.metrics, encode(event), key=self.source, on_delivery=cb
            )
        return event

    def _lost(self, err: KafkaError | None, _msg: object) -> None:
        if err is not None:
            self.lost += 1
            log.debug("metric event not delivered: %s", err.str())

    def incr(self, name: str, n: int = 1) -> None:
        self.counters[name] += n

    def flush_counters(self, step: int | None = None) -> None:
        if self.counters:
            self.emit("counter", {k: float(v) for k, v in self.counters.items()}, step=step)


# Records stay far below 1 MB (DESIGN.md: weights never travel through Kafka); one larger than
# this is poison wherever it is read, and a dead letter keeps at most this much of a value
# (the DLQ's own records must fit the producer's and the broker's limits).
MAX_RECORD_BYTES = 512 * 1024


def origin(msg: Any) -> str:
    """Where a consumed record came from: ``topic/partition@offset``."""
    return f"{msg.topic()}/{msg.partition()}@{msg.offset()}"


def dead_letter(
    producer: Producer,
    layout: Layout,
    value: bytes | None,
    key: bytes | str | None,
    reason: str,
    origin: str,
    metrics: Metrics | None = None,
) -> None:
    """Send an unusable record to the DLQ with ``reason`` and ``origin``
    (topic/partition@offset), and count it (``dead_letters``). A value over
    :data:`MAX_RECORD_BYTES` is cut to that size (header ``srl.truncated``: its full size)."""
    value = value or b""
    headers: list[tuple[str, str | bytes | None]] = [
        ("srl.reason", reason.encode()[:1000]),
        ("srl.origin", origin.encode()),
    ]
    if len(value) > MAX_RECORD_BYTES:
        headers.append(("srl.truncated", str(len(value)).encode()))
        value = value[:MAX_RECORD_BYTES]
    producer.produce(layout.dlq, value, key=key, headers=headers)
    if metrics is not None:
        metrics.incr("dead_letters")
    log.warning("dead letter from %s: %s", origin, reason)


def read_record(
    msg: Any, cls: type[R], producer: Producer, layout: Layout, metrics: Metrics
) -> R | None:
    """The record of ``cls`` that ``msg`` (a ``srl.kafka.Message`` of an input topic) holds, or
    None after dead-lettering it: oversized, undecodable (garbage, unknown fingerprint,
    truncated, trailing bytes), or another record type (wrong schema)."""
    value = msg.value() or b""
    if len(value) > MAX_RECORD_BYTES:
        reason = f"oversized: {len(value)} bytes > {MAX_RECORD_BYTES}"
    else:
        try:
            return decode_as(value, cls)
        except SchemaError as e:
            reason = f"undecodable: {e}"
    dead_letter(producer, layout, value, msg.key(), reason, origin(msg), metrics)
    return None
