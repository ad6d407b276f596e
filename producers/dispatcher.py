"""The dispatcher: prompts → length predictions → ``PromptTask`` records on the bucket topics.

Owns ``srl-producer dispatch``. In order, for each window of prompts from the source:

1. ask the length predictor (``ranker.predictor.LengthPredictor``) for every prompt of the
   window at once;
2. ``plan_window`` (pure): bucket each prompt by its prediction (``Layout.bucket_for``) and
   order the window longest-predicted first, across buckets (LPT: a long task published
   after the window's short ones starts last, behind the backlog bound, and is the one that
   goes stale; bucket by bucket, short first, ``srl bench pipeline``'s skew mode dropped
   26–29 % of its tokens as stale, longest first 10–20 %); each task asks for
   ``group_size`` samples and carries the prediction, the predictor's version and the
   prompt's metadata (JSON);
3. wait for permission to publish:
   * **sync barrier** (``sync_barrier``, window = ``groups_per_step``): every window after the
     first waits for a weights announcement newer than the one the previous window was
     published under, so no generator runs ahead of the trainer;
   * **async**: while the pools' unconsumed backlog (``GroupLag`` over the prompt topics)
     reaches ``max_pending``, wait; the backlog stays bounded instead of holding the dataset;
4. publish (key = prompt id, topic ``{prefix}.prompts.{bucket}``) and flush.

Windows keep order local: sorting a whole dataset longest-first would hand the trainer all
long prompts first. The prompt source is an argument (any iterable of ``PromptLike``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import orjson

from producers.config import DispatchConfig, pool_group
from schemas.records import PromptTask, SchemaError, WeightsAnnouncement, decode_as, encode
from srl.errors import SrlError

if TYPE_CHECKING:
    from producers.backlog import GroupLag
    from producers.sources import PromptLike
    from ranker.predictor import LengthPredictor
    from srl.kafka import Producer
    from srl.topics import Layout

log = logging.getLogger("srl.dispatch")


def plan_window(
    prompts: Sequence[PromptLike], predictions: np.ndarray, layout: Layout, cfg: DispatchConfig,
    ranker_version: int | None = None, epoch: int = 0,
) -> list[PromptTask]:  # fmt: skip
    """Tasks for one window: bucketed by prediction, longest-predicted first (across buckets).

    A group is identified by its prompt id, so epoch ``e > 0`` sends ``{prompt_id}.e{e}``: the
    groups of different passes over the same prompt never merge on the trainer's side.
    """
    if len(predictions) != len(prompts):
        raise SrlError(
            f"length predictor returned {len(predictions)} predictions for {len(prompts)} prompts"
        )
    lengths = [max(1, int(round(float(pred)))) for pred in predictions]
    if cfg.predictor == "ranker":  # Algorithm 2: the top alpha of the window is the long tail
        from ranker.dispatch import assign_buckets

        longtail = cfg.longtail_bucket or layout.buckets[-1]
        layout.bucket_index(longtail)  # one-line error for an unknown bucket
        regular = [b for b in layout.buckets if b != longtail]
        buckets = assign_buckets(lengths, cfg.alpha, longtail, layout.bucket_for, regular)
    else:
        buckets = [layout.bucket_for(n) for n in lengths]
    tasks = []
    for p, length, bucket in zip(prompts, lengths, buckets, strict=True):
        tasks.append(PromptTask(
            task_id=uuid.uuid4().hex, prompt_id=p.prompt_id if epoch == 0 else f"{p.prompt_id}.e{epoch}", prompt=p.text, group_size=cfg.group_size,
            max_new_tokens=cfg.max_new_tokens, bucket=bucket, temperature=cfg.temperature,
            top_p=cfg.top_p, predicted_length=length, ranker_version=ranker_version,
            metadata=orjson.dumps(p.metadata).decode() if p.metadata else None,
        ))  # fmt: skip
    return sorted(tasks, key=lambda t: -(t.predicted_length or 0))


def windows(source: Iterable[PromptLike], size: int) -> Iterator[list[PromptLike]]:
    window: list[PromptLike] = []
    for p in source:
        window.append(p)
        if len(window) == size:
            yield window
            window = []
    if window:
        yield window


@dataclass
class DispatchSummary:
    prompts: int = 0
    tasks: int = 0
    windows: int = 0
    by_bucket: dict[str, int] = field(default_factory=dict)
    waited_s: float = 0.0  # time spent at the barrier or the backlog bound
    versions_seen: list[int] = field(
        default_factory=list
    )  # sync mode: version each window waited for

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Announcements:
    """The newest weights version announced for a run, read from the weights topic."""

    def __init__(self, cfg: DispatchConfig, layout: Layout) -> None:
        from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

        from srl.kafka import consumer_settings

        self.run, self.latest = cfg.run, 0
        self._c = Consumer(consumer_settings(cfg, "srl-dispatch-weights", "dispatch-weights"))
        self._tp = TopicPartition(layout.weights, 0)
        self._c.assign([TopicPartition(layout.weights, 0, OFFSET_BEGINNING)])
        self.catch_up(cfg.connect_timeout_s)

    def catch_up(self, timeout_s: float) -> int:
        """Read everything appended so far; the newest version of our run."""
        _low, high = self._c.get_watermark_offsets(self._tp, timeout=timeout_s, cached=False)
        deadline = time.monotonic() + timeout_s
        while self._position() < high and time.monotonic() < deadline:
            self.poll(0.1)
        return self.latest

    def _position(self) -> int:
        pos = self._c.position([self._tp])[0].offset
        return pos if pos >= 0 else 0

    def poll(self, timeout_s: float) -> None:
        msg = self._c.poll(timeout_s)
        if msg is None or msg.error():
            return
        with contextlib.suppress(SchemaError):
            ann = decode_as(msg.value() or b"", WeightsAnnouncement)
            if ann.run == self.run:
                self.latest = max(self.latest, ann.version)

    def close(self) -> None:
        self._c.close()


def run_dispatcher(
    cfg: DispatchConfig, source: Iterable[PromptLike], predictor: LengthPredictor,
    stop: threading.Event | None = None,
) -> DispatchSummary:  # fmt: skip
    from producers.backlog import GroupLag
    from srl.kafka import Producer, create_topics
    from srl.topics import Layout

    stop = stop or threading.Event()
    layout = Layout.from_config(cfg)
    create_topics(cfg)
    summary, by_bucket = DispatchSummary(), Counter[str]()
    size = cfg.groups_per_step if cfg.sync_barrier else cfg.window
    with contextlib.ExitStack() as stack:
        producer = stack.enter_context(Producer(cfg, "dispatcher"))
        anns = Announcements(cfg, layout) if cfg.sync_barrier else None
        if anns is not None:
            stack.callback(anns.close)
        room = None
        if not cfg.sync_barrier and cfg.max_pending is not None:
            lag = GroupLag(cfg, [pool_group(cfg.topic_prefix, p) for p in cfg.pools],
                           [layout.prompts(b) for b in layout.buckets])  # fmt: skip
            stack.callback(lag.close)
            room = Room(lag, cfg.max_pending)
        version = anns.latest if anns is not None else 0
        for epoch in range(cfg.epochs):
            for window in windows(source, size):
                if stop.is_set():
                    return summary
                tasks = plan_window(
                    window,
                    predictor.predict([p.text for p in window]),
                    layout,
                    cfg,
                    predictor.version,
                    epoch,
                )
                t0 = time.monotonic()
                if anns is not None and summary.windows > 0:
                    version = _wait_for_weights(anns, version, cfg.barrier_timeout_s, stop)
                    summary.versions_seen.append(version)
                for task in tasks:
                    if room is not None:
                        room.take(producer, stop)
                    if stop.is_set():
                        break
                    producer.produce(layout.prompts(task.bucket), encode(task), key=task.prompt_id)
                    summary.tasks += 1
                    by_bucket[task.bucket] += 1
                producer.flush()
                summary.waited_s += time.monotonic() - t0
                summary.prompts += len(window)
                summary.windows += 1
                summary.by_bucket = dict(by_bucket)
            log.info("epoch %d done: %d tasks so far", epoch, summary.tasks)
    return summary


def _wait_for_weights(
    anns: Announcements, version: int, timeout_s: float, stop: threading.Event
) -> int:
    deadline = time.monotonic() + timeout_s
    while anns.latest <= version:
        if stop.is_set():
            return version
        if time.monotonic() > deadline:
            raise SrlError(
                f"sync barrier: no weights newer than v{version} for {timeout_s:g}s; is the trainer running?"
            )
        anns.poll(0.2)
    return anns.latest


class Room:
    """Credit to publish while the pools' unconsumed backlog stays under ``bound``.

    The lag is measured only when the credit from the last measurement is used up, so a large
    dataset costs one measurement per ``bound - lag`` tasks, not one per task.
    """

    def __init__(self, lag: GroupLag, bound: int) -> None:
        self.lag, self.bound, self.credit = lag, bound, 0

    def take(self, producer: Producer, stop: threading.Event) -> None:
        while self.credit <= 0 and not stop.is_set():
            producer.flush()  # what we published counts in the lag only once the broker has it
            self.credit = self.bound - self.lag.lag()
            if self.credit <= 0:
                time.sleep(0.2)
        self.credit -= 1
