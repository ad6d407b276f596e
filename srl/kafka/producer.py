"""``Producer``: an idempotent producer with counted deliveries (STYLE.md's producer discipline).

``poll(0)`` after each produce, poll-and-retry on ``BufferError`` (or, for a caller that must
never wait, ``block=False``: the ``BufferError`` is raised), delivery failures counted and
surfaced (``flush`` raises), flush on exit of a ``with`` block. A record produced with its own
``on_delivery`` callback is its caller's to account for: a failure goes to that callback and
is not raised again by ``flush`` (a generator's chunks: its outlet decides what a failure
means, e.g. nothing for a task it has abandoned). A producer that librdkafka declares failed
for good (a fatal error: an idempotent producer whose acknowledged records the broker lost, as
a SIGKILLed embedded broker does, or one fenced by another) raises ``ProducerFailed`` from
``produce``, ``poll`` and ``flush``; its owner starts over from what is durable in its own
process (``start_over``: the trainer, the dispatcher, a generator) or exits and is restarted.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import confluent_kafka
from confluent_kafka import KafkaError, KafkaException

from srl.config import ProducerSettings
from srl.errors import AccessDenied, ProducerFailed, SrlError, StartOver
from srl.kafka.callbacks import callback
from srl.kafka.probe import known, wait_for_broker
from srl.kafka.settings import describe, error_of, producer_settings

log = logging.getLogger("srl.kafka")

DeliveryCallback = Callable[[KafkaError | None, Any], None]
T = TypeVar("T")
START_OVER_GAP_S = 30.0  # a second failure this soon after a start-over: exit instead


def start_over(
    run: Callable[[], T], role: str, gap_s: float = START_OVER_GAP_S, again: bool = True
) -> T:
    """``run()``, run again while it ends in ``StartOver`` (``ProducerFailed``: a broker that lost
    what the role's producer had written): a role whose state is all in Kafka and the store
    starts over from what is durable in its own process, as a restart would, without a second
    start-up (imports, a model load). Raised instead (the role exits for its process manager)
    unless ``again``, or when it fails within ``gap_s`` of the last start-over."""
    last: float | None = None
    while True:
        try:
            return run()
        except StartOver as e:
            if not again or (last is not None and time.monotonic() - last < gap_s):
                raise
            log.warning("%s: %s: starting over from what is durable, in this process", role, e)
        last = time.monotonic()


HOLD_POLL_S = 0.05  # a held-back produce serves callbacks in slices this long


class Throttle:
    """A producer's view of the broker's quota throttling (KIP-219: the broker answers at once
    with a throttle time and librdkafka sends that broker nothing until it has passed).

    Unthrottled, a producer queues up to ``queue.buffering.max.kbytes`` locally; under a
    produce quota below the caller's rate that queue drains at the quota's rate, and its tail
    outlives ``message.timeout.ms``: chunks fail, and a generator stops on a failed chunk.
    While a throttle was seen in the last ``HOLD_S``, a produce waits (``full``) while the
    oldest record still queued has waited more than ``SHARE`` of the delivery timeout, or more
    records are queued than were delivered in that long at the rate measured since the
    throttling began (at least ``MIN_QUEUED``): no record then waits much longer than that
    share, whatever the quota and the record size. The oldest record's age is that of the
    first enqueue time not yet matched by a delivery report (reports come about in the order
    records were queued)."""

    HOLD_S = 10.0
    SHARE = 0.25
    MIN_QUEUED = 2
    RATE_AFTER_S = 2.0  # the delivery rate of an episode counts once measured this long

    def __init__(self, delivery_timeout_s: float) -> None:
        self.budget_s = max(0.2, delivery_timeout_s * self.SHARE)
        self.last = -1e9  # monotonic time of the last throttle seen
        self.events = 0
        self.throttled_s = 0.0  # the brokers' throttle times, summed
        self.waited_s = 0.0  # time produce() held the caller back
        self.queued: collections.deque[float] = collections.deque()  # enqueue times
        self.delivered = 0  # delivery reports, every outcome
        self._since = (0.0, 0)  # (time, delivered) the episode began at

    def saw(self, throttle_s: float) -> None:
        now = time.monotonic()
        if not self.active():  # a new episode: its rate is measured afresh
            self._since = (now, self.delivered)
        self.last, self.events = now, self.events + 1
        self.throttled_s += throttle_s

    def active(self) -> bool:
        return time.monotonic() - self.last < self.HOLD_S

    def reported(self) -> None:
        """One delivery report (served by ``poll``, whatever its outcome)."""
        self.delivered += 1
        if self.queued:
            self.queued.popleft()

    def full(self, queued: int) -> bool:
        """Whether a produce waits now, with ``queued`` records in the local queue."""
        if queued <= self.MIN_QUEUED or not self.queued or not self.active():
            return False
        now = time.monotonic()
        if now - self.queued[0] > self.budget_s:
            return True
        t0, d0 = self._since
        if now - t0 < self.RATE_AFTER_S:
            return False
        return queued > (self.delivered - d0) / (now - t0) * self.budget_s


class Producer:
    """An idempotent producer with counted deliveries; use it in a ``with`` block.

    ``produce`` never drops a record on a full local queue (it polls and retries), and each
    delivery outcome is counted; ``flush`` raises if records are still undelivered after its
    timeout, so a dead broker surfaces as an error within a bounded time.
    """

    def __init__(
        self, cfg: ProducerSettings, role: str = "producer", check: bool = True, **overrides: Any
    ) -> None:
        if check and not known(cfg.bootstrap_servers):  # not when a client reached it already
            wait_for_broker(cfg)
        self.cfg = cfg
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self.delivered = 0
        self.failed = 0  # failures ``flush`` raises
        self.failed_handled = 0  # failures of records whose caller took them (``on_delivery``)
        self.outages = 0  # times every broker went away (librdkafka's _ALL_BROKERS_DOWN)
        self.fatal = False  # librdkafka declared this producer failed for good
        self.purged = 0  # records dropped from the local queue by ``purge_queued``
        self.denied: str | None = None  # a topic the broker refused us to write (an ACL)
        self._failed_reported = 0
        settings = producer_settings(cfg, role, **overrides)
        settings["error_cb"] = callback(self._on_error)
        settings["throttle_cb"] = callback(self._on_throttle)
        self.throttle = Throttle(float(settings["message.timeout.ms"]) / 1000)
        self._p = confluent_kafka.Producer(settings)

    def _on_error(self, err: KafkaError) -> None:
        if err.fatal():
            self.fatal = True
            self.errors.append(err.str())
        elif err.code() == KafkaError._ALL_BROKERS_DOWN:
            self.outages += 1  # what the brokers acknowledged last may be gone (ackguard)
        log.debug("producer error: %s", err.str())

    def _on_throttle(self, event: Any) -> None:
        """A broker delayed us for a quota (``ThrottleEvent.throttle_time``, seconds; 0: the
        throttle is over)."""
        if event.throttle_time > 0:
            self.throttle.saw(event.throttle_time)

    def _counted(self, err: KafkaError | None, msg: Any, handled: bool = False) -> None:
        self._take_lock()
        try:
            self.throttle.reported()
            if err is None:
                self.delivered += 1
            elif err.code() == KafkaError._PURGE_QUEUE:  # dropped on purpose: purge_queued
                self.purged += 1
            elif err.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED:  # raised by the next call
                self.denied = str(msg.topic()) if msg is not None else "?"
                self.failed += 1
            elif handled:  # its producer's callback accounts for it
                self.failed_handled += 1
            else:
                self.failed += 1
                if len(self.errors) < 100:
                    self.errors.append(err.str())
        finally:
            self._lock.release()

    def _take_lock(self) -> None:
        """Take the counters' lock in a delivery report. After a fatal error confluent-kafka
        serves the reports with that error still pending, so the first call in them raises
        SystemError, after the lock was taken: give it back before the error goes on (it
        was left held, and the next flush waited for it forever)."""
        try:
            self._lock.acquire()
        except SystemError:
            self._lock.release()
            raise

    def _failed_for_good(self, e: BaseException | str) -> ProducerFailed:
        """The error a producer that librdkafka declared failed raises (``e``: what surfaced)."""
        cause = e.__context__ if isinstance(e, SystemError) and e.__context__ else e
        return ProducerFailed(
            f"the producer to {self.cfg.bootstrap_servers} failed for good: "
            f"{cause if isinstance(cause, str) else describe(cause)} "
            "(a broker that lost records it had acknowledged, or a fenced producer)"
        )

    def _surfaced(self, e: KafkaException) -> Exception:
        """What a Kafka error from the client raises: ``ProducerFailed`` once librdkafka has
        declared this producer failed for good, else the error itself."""
        return self._failed_for_good(e) if self._fatal(e) or self.fatal else e

    @staticmethod
    def _fatal(e: KafkaException) -> bool:
        err = error_of(e)
        return err is not None and (err.fatal() or err.code() == KafkaError._FATAL)

    def _refused(self) -> None:
        """``AccessDenied`` once the broker refused a record for want of an ACL: a role that
        may not write one of its topics stops with one line, not a crash loop of failures."""
        if self.denied is not None:
            raise AccessDenied(
                f"kafka: not authorized to write topic {self.denied}: the principal needs "
                f"Write on Topic {self.denied} (docs/security.md)"
            )

    def produce(
        self,
        topic: str,
        value: bytes,
        key: str | bytes | None = None,
        partition: int | None = None,
        headers: list[tuple[str, str | bytes | None]] | None = None,
        on_delivery: DeliveryCallback | None = None,
        block: bool = True,
    ) -> None:
        """Queue one record. On a full local queue: serve callbacks and retry until it fits,
        or, with ``block=False`` (a caller that must not wait, e.g. ``srl serve``'s engine
        thread), raise ``BufferError`` at once: the record is not queued."""
        # the per-record path of every generator: no kwargs dict, no closure unless the
        # caller wants its own callback (partition -1: librdkafka's partitioner picks)
        if on_delivery is None:
            cb: DeliveryCallback = self._counted
        else:

            @callback
            def cb(err: KafkaError | None, msg: Any) -> None:
                self._counted(err, msg, handled=True)
                on_delivery(err, msg)

        self._refused()
        p = self._p
        part = -1 if partition is None else partition
        try:
            if block and self.throttle.active():
                self._hold_back()
            while True:
                try:
                    p.produce(topic, value, key, partition=part, on_delivery=cb, headers=headers)
                    self.throttle.queued.append(time.monotonic())
                    break
                except BufferError:
                    if not block:
                        raise
                    p.poll(0.05)  # local queue full: serve callbacks, then retry
            p.poll(0)
        except SystemError as e:
            raise self._failed_for_good(e) from None
        except KafkaException as e:
            raise self._surfaced(e) from None

    def _hold_back(self) -> None:
        """Under a quota, wait (serving callbacks) while more records are queued than the
        broker lets through in a share of the delivery timeout: the caller slows to the
        quota's rate instead of queueing records that would time out (``Throttle``)."""
        while self.throttle.full(len(self._p)):
            self.throttle.waited_s += HOLD_POLL_S
            self._p.poll(HOLD_POLL_S)

    def poll(self, timeout: float = 0) -> int:
        try:
            served = int(self._p.poll(timeout))
        except SystemError as e:
            raise self._failed_for_good(e) from None
        except KafkaException as e:
            raise self._surfaced(e) from None
        self._refused()
        return served

    def warm(self, topics: Iterable[str], timeout_s: float = 10.0) -> None:
        """Fetch ``topics``' metadata now, not at the first record (a fresh producer holds its
        first records while it looks the topic up; it also holds them ~0.5 s until it has its
        idempotent producer id, which only a delivered record shows: docs/benchmarks.md)."""
        for topic in topics:
            self._p.list_topics(topic, timeout=timeout_s)

    def purge_queued(self) -> int:
        """Drop the records not yet sent to a broker (a fenced generator's chunks, queued while
        it was cut off: sent after the cut healed they would be a zombie's copies beside its
        successor's); returns how many. Records already in flight may still land
        (``srl.lineage`` fences them). Their delivery reports say ``_PURGE_QUEUE``: counted in
        ``purged``, never raised."""
        before = self.purged
        self._p.purge(in_queue=True, in_flight=False, blocking=True)
        self.poll(0)
        return self.purged - before

    def pending(self) -> int:
        return len(self._p)

    def flush(self, timeout_s: float | None = None) -> None:
        """Wait for every outstanding delivery.

        SrlError if records are still pending after ``timeout_s`` or if any delivery failed
        since the last flush (callers that handle failures per record catch it).
        """
        timeout_s = max(10.0, self.cfg.connect_timeout_s * 4) if timeout_s is None else timeout_s
        try:
            left = self._p.flush(timeout_s)
        except SystemError as e:
            raise self._failed_for_good(e) from None
        except KafkaException as e:
            raise self._surfaced(e) from None
        self._refused()
        last = f": {self.errors[-1]}" if self.errors else ""
        if self.fatal:  # its undelivered records failed with it
            raise self._failed_for_good(self.errors[0])
        if left:
            raise SrlError(
                f"{left} record(s) not delivered within {timeout_s:g}s to "
                f"{self.cfg.bootstrap_servers}{last}"
            )
        with self._lock:
            new_failures, self._failed_reported = self.failed - self._failed_reported, self.failed
        if new_failures:
            raise SrlError(
                f"{new_failures} record(s) failed delivery to {self.cfg.bootstrap_servers}{last}"
            )

    def __enter__(self) -> Producer:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is None:
            self.flush()
        else:  # already failing: deliver what we can, do not mask the original error
            with contextlib.suppress(SystemError, KafkaException):  # a failed producer's
                self._p.flush(5)
