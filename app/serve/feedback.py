"""``POST /v1/feedback`` → ``{prefix}.feedback``: an application's reward for a served choice.

Owns how feedback reaches the log. What must hold:

* one :class:`~schemas.records.Feedback` record per accepted request, key = the choice's
  trajectory id (``producers.recovery.trajectory_id_for(completion id, index)``, the id its
  chunks carry), so a trainer joins it to that trajectory (``consumers.feedback``);
* the request is answered only once the broker has acknowledged the record (200), or with
  503 when it did not within ``timeout_s`` or refused it, or the producer could not queue it
  (a full local queue while the broker is slow or gone: at once, the event loop never waits
  for room): an accepted rating is in the log, a refused one is the application's to retry;
  nothing is dropped silently;
* with publishing off there is nothing to join feedback to: 503 ``feedback_disabled``.

Deliveries are served by the producer's polls (the engine thread polls it every step and
every 50 ms when idle); the callback hands the outcome to the event loop. Called by
``app.serve.http``; built by ``app.serve.run``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import orjson

from app.serve.protocol import ApiError, FeedbackRequest
from producers.recovery import trajectory_id_for
from schemas.records import Feedback, encode
from srl.kafka import Producer
from srl.topics import Layout

log = logging.getLogger("srl.serve")


def feedback_record(req: FeedbackRequest, source: str) -> Feedback:
    """The record of one checked request."""
    metadata = orjson.dumps(req.metadata).decode() if req.metadata else None
    tid = trajectory_id_for(req.id, req.index)
    return Feedback(tid, req.id, req.index, req.reward, source, metadata)


class FeedbackOut:
    """Feedback records into the producer, each awaited until the broker has it."""

    def __init__(
        self, producer: Producer | None, layout: Layout, source: str, timeout_s: float = 10.0
    ) -> None:
        self.producer, self.layout, self.source = producer, layout, source
        self.timeout_s = timeout_s
        self.accepted = 0  # records the broker acknowledged
        self.refused = 0  # records it refused or did not acknowledge in time

    def stats(self) -> dict[str, int]:
        return {"feedback_accepted": self.accepted, "feedback_refused": self.refused}

    async def send(self, req: FeedbackRequest) -> Feedback:
        """Publish ``req`` and wait for the broker; ApiError 503 if it does not take it."""
        if self.producer is None:
            raise ApiError(
                503,
                "feedback needs publishing: this srl serve runs with --no-publish",
                None,
                "feedback_disabled",
            )
        rec = feedback_record(req, self.source)
        loop = asyncio.get_running_loop()
        done: asyncio.Future[str | None] = loop.create_future()

        def delivered(err: Any, _msg: Any) -> None:  # on whichever thread polls the producer
            loop.call_soon_threadsafe(_settle, done, None if err is None else str(err))

        try:
            self.producer.produce(
                self.layout.feedback,
                encode(rec),
                key=rec.trajectory_id,
                on_delivery=delivered,
                block=False,
            )
        except BufferError:
            error: str | None = "the producer's queue is full (the broker is slow or away)"
        except Exception as e:  # a failed producer
            error = f"not queued: {e}"
        else:
            try:
                error = await asyncio.wait_for(done, self.timeout_s)
            except TimeoutError:
                error = f"not acknowledged within {self.timeout_s:g}s"
        if error is not None:  # the broker's words go to the log, not to the client
            self.refused += 1
            log.warning("feedback for %s not stored: %s", rec.trajectory_id, error)
            raise ApiError(
                503, "feedback not stored; retry", None, "feedback_failed", retry_after_s=1
            )
        self.accepted += 1
        return rec


def _settle(fut: asyncio.Future[str | None], error: str | None) -> None:
    if not fut.done():  # a late delivery after the request timed out
        fut.set_result(error)
