"""What the engine thread of ``srl serve`` does between decode steps besides serving: weight
swaps, the counters of what the log lost, and metric events.

Owns the served policy version and ``ServeStats``' weights and loss counters. What must hold:

* a newer verified version (``producers.follower.WeightFollower``) is loaded between two
  decode steps, after every open partial chunk is published (no chunk mixes versions); a
  version the engine rejects is refused and the old weights stay; a failure of the follower
  thread is raised (the engine thread then stops: that is no single request's fault);
* new delivery failures and dropped trajectories are counted and logged (one line each time
  they grow): served answers are not affected, the log misses them;
* a ``serve_stats`` event every ``stats_interval_s``; metric events go through a producer
  that never blocks (``app.serve.publish.Lossy``).

Called by ``app.serve.core`` on its thread only.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass

from app.serve.publish import Publisher
from producers.engines.base import Engine
from producers.follower import WeightFollower
from srl.metrics import Metrics, dead_letter

log = logging.getLogger("srl.serve")


@dataclass
class ServeStats:
    requests: int = 0  # jobs taken by the engine thread
    busy: int = 0  # jobs refused: too many choices pending (429)
    completions: int = 0  # choices finished (stop, length)
    cancelled: int = 0  # choices aborted (client gone, server stopping)
    queue_timeouts: int = 0  # jobs that had no batch slot within max_queue_wait_s (503)
    queue_waits: int = 0  # jobs given their first batch slot
    queue_wait_ms: int = 0  # their waits for it, summed (mean: queue_wait_ms / queue_waits)
    request_errors: int = 0  # jobs that failed on the engine thread alone
    tokens: int = 0  # completion tokens generated
    weights_loaded: int = 0
    weights_refused: int = 0
    delivery_failures: int = 0  # records the broker did not take
    publish_dropped: int = 0  # trajectories not published: the producer refused a record

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


class Upkeep:
    """Weights, loss counters and metric events of one engine thread."""

    def __init__(
        self,
        engine: Engine,
        publisher: Publisher,
        stats: ServeStats,
        follower: WeightFollower | None,
        metrics: Metrics | None,
        stats_interval_s: float,
    ) -> None:
        self.engine, self.publisher, self.stats = engine, publisher, stats
        self.follower, self.metrics = follower, metrics
        self.stats_interval_s = stats_interval_s
        self._last_stats = time.monotonic()
        self._stats_tokens = 0

    def swap(self) -> None:
        """Load a newer verified version, if the follower has one."""
        if self.follower is None:
            return
        self.follower.check()
        m = self.metrics
        for bad in self.follower.drain_poison():  # weights-topic records that are no announcement
            if m is not None and (producer := m.producer) is not None:
                dead_letter(producer, m.layout, bad.value, bad.key, bad.reason, bad.origin, m)
        for version, reason in self.follower.drain_refusals():
            self.stats.weights_refused += 1
            self.metric("weights_refused", {"version": version}, {"reason": reason[:500]})
        swap = self.follower.swap_into(self.engine, self.publisher.flush_open)
        if swap is None:
            return
        self.stats.weights_loaded += 1
        values = {"version": swap.version, "load_s": swap.load_s, "pause_ms": swap.pause_ms}
        self.metric("weights_loaded", values, {})
        log.info("weights v%d loaded (pause %.0f ms)", swap.version, swap.pause_ms)

    def tick(self, waiting: int) -> None:
        """Delivery reports, loss counters, and the periodic ``serve_stats`` event."""
        self.publisher.poll()
        self.report_losses()
        now = time.monotonic()
        if now - self._last_stats >= self.stats_interval_s:
            dt, self._last_stats = now - self._last_stats, now
            tokens, self._stats_tokens = self.stats.tokens - self._stats_tokens, self.stats.tokens
            values = {k: float(v) for k, v in self.stats.to_dict().items()}
            values |= {
                "tokens_per_s": tokens / dt,
                "running": float(self.engine.running),
                "waiting": float(waiting),
                "policy_version": float(self.engine.version),
                "published_chunks": float(self.publisher.chunks),
                "published_trajectories": float(self.publisher.trajectories),
            }
            self.metric("serve_stats", values, {"publish": str(self.publisher.enabled).lower()})

    def report_losses(self) -> None:
        """New delivery failures and dropped trajectories: counted, and one log line each
        time they grow (served answers are not affected: the log misses them)."""
        p = self.publisher
        failures = p.failures
        if failures > self.stats.delivery_failures:
            log.warning(
                "%d record(s) failed delivery to Kafka (%d in all; served text was not affected, "
                "the log misses them): %s",
                failures - self.stats.delivery_failures,
                failures,
                p.last_error,
            )
            self.stats.delivery_failures = failures
        if p.dropped > self.stats.publish_dropped:
            log.warning(
                "%d served trajectory(ies) not published (%d in all; their requests were "
                "answered): %s",
                p.dropped - self.stats.publish_dropped,
                p.dropped,
                p.last_drop,
            )
            self.stats.publish_dropped = p.dropped

    def metric(self, kind: str, values: dict[str, float], labels: dict[str, str]) -> None:
        if self.metrics is not None:
            common = {"engine": self.engine.name, "simulated": str(self.engine.simulated).lower()}
            self.metrics.emit(kind, values, {"worker_id": self.metrics.source} | common | labels)
