"""``GET /metrics`` of ``srl serve``: its counters in the Prometheus text format.

Owns the names and meanings of the server's Prometheus families (``srl_serve_*``): counters
of what was served and of what the log lost (``publish_dropped``: trajectories a refused
record cut from the log; ``delivery_failures``: records the broker did not take), gauges of
what runs and waits. The values are the ``/health`` snapshot of the moment
(``ServeEngine.health`` and the feedback counters); prometheus_client renders them. Called by
``app.serve.http``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

COUNTERS = {
    "requests": "Requests taken by the engine thread.",
    "busy": "Requests refused with 429: too many choices pending.",
    "completions": "Choices finished (stop, length).",
    "cancelled": "Choices aborted: client gone, server stopping (never trained).",
    "queue_timeouts": "Requests refused with 503: no batch slot within max_queue_wait_s.",
    "queue_waits": "Requests given their first batch slot.",
    "queue_wait_ms": "Their waits for it, in milliseconds, summed (the mean: over queue_waits).",
    "request_errors": "Requests that failed on the engine thread alone.",
    "tokens": "Completion tokens generated.",
    "published_chunks": "Trajectory chunks handed to the producer.",
    "publish_dropped": "Served trajectories not published: the producer refused a record "
    "(over the record limit, local queue full while the broker is slow or gone).",
    "delivery_failures": "Records the broker did not take.",
    "weights_loaded": "Policy versions loaded.",
    "weights_refused": "Policy versions refused (verification, shape).",
    "feedback_accepted": "Feedback records the broker acknowledged.",
    "feedback_refused": "Feedback requests answered 503: not stored.",
}
GAUGES = {
    "running": "Choices in the running batch.",
    "waiting": "Choices waiting for a batch slot.",
    "pending": "Choices running or waiting (bounded by max_pending).",
    "policy_version": "The policy version served.",
}


class _Snapshot:
    def __init__(self, values: dict[str, Any]) -> None:
        self.values = values

    def collect(self) -> Iterator[Any]:
        for name, text in COUNTERS.items():
            if name in self.values:
                yield CounterMetricFamily(f"srl_serve_{name}", text, value=self.values[name])
        for name, text in GAUGES.items():
            if name in self.values:
                yield GaugeMetricFamily(f"srl_serve_{name}", text, value=self.values[name])


def metrics_response(values: dict[str, Any]) -> Response:
    """The Prometheus exposition of ``values`` (a ``/health`` snapshot)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(values))
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
