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
   * **by trainer step** (``max_staleness`` = k, the default): a window is one trainer step's
     ``groups_per_step`` prompts, numbered from the step after the newest announced (or
     published: a restart) one. Step
     t is released once the trainer has announced step ``t-1-k``; its tasks carry ``step``,
     ``step_groups`` and ``min_version`` (the newest announced version: no worker starts
     them with older weights), and the trainer's step t trains exactly them
     (``consumers.steps``). So every trained sample is within k of the trainer by
     construction, and at most k+1 steps of prompts are ever out. k = 0 is the synchronous
     barrier;
   * **unpaced** (``max_staleness`` null): windows of ``window`` prompts, published while the
     pools' unconsumed backlog (``GroupLag`` over the prompt topics) stays under
     ``max_pending``; the trainer takes whichever groups complete first, so a long sample
     can outlive its staleness window and be dropped (kept for comparison:
     docs/benchmarks.md, "Asynchrony that keeps the long tail");
4. publish (key = prompt id, topic ``{prefix}.prompts.{bucket}``) and flush; with
   ``partitioning = "balanced"`` each task goes to the partition of its topic with the least
   predicted work so far (``Balancer``: greedy LPT over the partitions, so each worker of a
   pool gets an even share of the predicted tokens), otherwise by key hash (random).

Windows keep order local: sorting a whole dataset longest-first would hand the trainer all
long prompts first. A dispatcher starts by reading back what its run's dispatchers already
published (``producers.dispatch_log``): after a SIGKILL, a restart skips what went out,
completes a window published in part in its own step, and numbers new windows after the
newest step, so no prompt is lost or dispatched twice. ``run_dispatcher`` opens the clients
and picks the loop: ``Windows.paced`` (step 3, by trainer step) or ``Windows.unpaced`` (by
the pools' backlog, ``Room``). The prompt source is an argument (any iterable of
``PromptLike``).
"""

from __future__ import annotations

import contextlib
import dataclasses
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

from producers.backlog import GroupLag
from producers.config import DispatchConfig
from producers.dispatch_log import Published, Stamp, read_published
from producers.follower import announcement
from producers.promptfit import PromptFit
from ranker.api import assign_buckets
from schemas.records import PromptTask, WeightsAnnouncement, encode, pack_tokens
from srl.codecs import use_schema_registry
from srl.errors import SrlError, WeightsError
from srl.kafka import (
    OFFSET_BEGINNING,
    Message,
    Producer,
    QuietTail,
    TopicPartition,
    ensure_topics,
    reader,
)
from srl.metrics import Metrics, dead_letter, origin
from srl.store import ObjectMissing
from srl.stores import store_from_config
from srl.topics import Layout, pool_group
from srl.weights import load_manifest

if TYPE_CHECKING:
    from producers.sources import PromptLike
    from ranker.api import LengthPredictor

log = logging.getLogger("srl.dispatch")
_TASK_NAMESPACE = uuid.UUID("0b7c8f52-4d0e-4c59-a3e1-9f6d2b1e7a40")


def plan_window(
    prompts: Sequence[PromptLike],
    predictions: np.ndarray,
    layout: Layout,
    cfg: DispatchConfig,
    ranker_version: int | None = None,
    epoch: int = 0,
) -> list[PromptTask]:
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
        longtail = cfg.longtail_bucket or layout.buckets[-1]
        layout.bucket_index(longtail)  # one-line error for an unknown bucket
        regular = [b for b in layout.buckets if b != longtail]
        buckets = assign_buckets(lengths, cfg.alpha, longtail, layout.bucket_for, regular)
    else:
        buckets = [layout.bucket_for(n) for n in lengths]
    tasks = []
    parts = split_group(cfg.group_size, cfg.tasks_per_group)
    for p, length, bucket in zip(prompts, lengths, buckets, strict=True):
        prompt_id = p.prompt_id if epoch == 0 else f"{p.prompt_id}.e{epoch}"
        for indices in parts:
            tasks.append(
                PromptTask(
                    task_id=task_id_for(cfg.run, prompt_id, indices),
                    prompt_id=prompt_id,
                    prompt=p.text,
                    prompt_tokens=_packed(p),
                    group_size=cfg.group_size,
                    max_new_tokens=cfg.max_new_tokens,
                    bucket=bucket,
                    temperature=cfg.temperature,
                    top_p=cfg.top_p,
                    predicted_length=length,
                    ranker_version=ranker_version,
                    metadata=orjson.dumps(p.metadata).decode() if p.metadata else None,
                    sample_indices=indices,
                    run=cfg.run,
                )
            )
    return sorted(tasks, key=lambda t: -(t.predicted_length or 0))


def _packed(p: PromptLike) -> bytes | None:
    """The rendered prompt's ids (``producers.rendering``), packed; None: the worker
    tokenizes the text."""
    ids = getattr(p, "prompt_tokens", None)
    return pack_tokens(ids) if ids else None


def task_id_for(run: str, prompt_id: str, indices: tuple[int, ...] | None) -> str:
    """A task's id: uuid5 hex of its run, prompt id (which carries the pass) and sample indices,
    so a dispatcher that plans the same window again gives the same id, and its samples the
    same trajectory ids (``producers.recovery.trajectory_id_for``): a task sent again (its
    record forgotten by the broker) is the same work under the same ids, which the trainer's
    ledger recognises, never a second group of the same samples."""
    which = "all" if indices is None else ",".join(map(str, indices))
    return uuid.uuid5(_TASK_NAMESPACE, f"{run}/{prompt_id}/{which}").hex


def split_group(group_size: int, tasks: int) -> list[tuple[int, ...] | None]:
    """The sample indices of each task of a group: ``[None]`` (all) for one task, otherwise
    ``tasks`` near-equal contiguous runs (each task can go to another worker)."""
    tasks = max(1, min(tasks, group_size))
    if tasks == 1:
        return [None]
    bounds = [round(i * group_size / tasks) for i in range(tasks + 1)]
    return [tuple(range(a, b)) for a, b in zip(bounds, bounds[1:], strict=False)]


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
    waited_s: float = 0.0  # time spent waiting for the trainer or the backlog bound
    versions_seen: list[int] = field(default_factory=list)  # paced: min_version of each step
    first_step: int | None = None  # paced: the step number of the first new window
    skipped: int = 0  # tasks a previous dispatcher of the run had published (not again)
    too_long: int = 0  # prompts dead-lettered at dispatch: they cannot fit the context

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def with_too_long(self, fit: PromptFit | None) -> DispatchSummary:
        self.too_long = fit.dropped if fit is not None else 0
        return self


class Announcements:
    """The newest weights version (and its trainer step) announced for a run.

    A record of the weights topic that is no announcement, or an announcement of our run
    whose manifest does not verify (missing, another store's, a hash or a version or a step
    that does not match: a bogus version would release every step at once), is
    dead-lettered with the reason and counted (``dead_letters``), and reading goes on.
    """

    def __init__(self, cfg: DispatchConfig, layout: Layout, producer: Producer) -> None:
        self.run, self.latest, self.step = cfg.run, 0, 0
        self.layout, self.producer = layout, producer
        self.metrics = Metrics(producer, layout, cfg.run, "dispatcher")
        self.store = store_from_config(cfg)
        self._c = reader(cfg, "dispatch-weights")
        self._tp = TopicPartition(layout.weights, 0)
        self._c.assign([TopicPartition(layout.weights, 0, OFFSET_BEGINNING)])
        self._tail = QuietTail(self._c, self._tp)
        self.catch_up(cfg.connect_timeout_s)

    def catch_up(self, timeout_s: float) -> int:
        """Read everything appended so far; the newest version of our run. Only the newest
        announcements are checked: one older than a version that verifies is superseded, and
        its weights may be gone (the trainer keeps ``keep_versions``), which is no fault."""
        _low, high = self._c.get_watermark_offsets(self._tp, timeout=timeout_s, cached=False)
        deadline = time.monotonic() + timeout_s
        backlog = []
        while self._position() < high and time.monotonic() < deadline:
            msg = self._tail.poll(0.1)
            if msg is not None and not msg.error():
                backlog.append(msg)
        ours = sorted(
            (ann.version, i)
            for i, m in enumerate(backlog)
            if (ann := announcement(m.value() or b"")[0]) is not None and ann.run == self.run
        )
        for _v, i in reversed(ours):  # newest first, down to the first that verifies
            if self._handle(backlog[i]):
                break
        ours_at = {i for _v, i in ours}
        for i, m in enumerate(backlog):
            if i not in ours_at:  # poison, other runs' announcements
                self._handle(m)
        return self.latest

    def _position(self) -> int:
        pos = self._c.position([self._tp])[0].offset
        return pos if pos >= 0 else 0

    def poll(self, timeout_s: float) -> None:
        msg = self._tail.poll(timeout_s)
        if msg is not None and not msg.error():
            self._handle(msg)

    def _handle(self, msg: Message) -> bool:
        """Take one record of the weights topic: True if it is a verified announcement of
        our run (an unverified one, or no announcement, is dead-lettered)."""
        ann, why = announcement(msg.value() or b"")
        if ann is not None and ann.run == self.run and ann.version > self.latest:
            why = self._unverified(ann)
        if why is not None:
            dead_letter(
                self.producer, self.layout, msg.value(), msg.key(), why, origin(msg), self.metrics
            )
            self.metrics.flush_counters()
            return False
        if ann is None or ann.run != self.run:
            return False
        self.latest = max(self.latest, ann.version)
        self.step = max(self.step, ann.trainer_step)
        return True

    def _unverified(self, ann: WeightsAnnouncement) -> str | None:
        """Why a new announcement of our run cannot be trusted (None: its manifest verifies)."""
        where = f"announcement of {ann.run} v{ann.version}"
        if not ann.manifest_uri.startswith(self.store.uri("")):
            return f"{where}: {ann.manifest_uri} is not in the store {self.store.url}"
        try:
            manifest = load_manifest(self.store, ann)
        except (WeightsError, ObjectMissing) as e:
            return f"{where}: {e}"
        if manifest.trainer_step != ann.trainer_step:
            return f"{where}: trainer step {ann.trainer_step}, manifest {manifest.trainer_step}"
        return None

    def close(self) -> None:
        self._c.close()


def run_dispatcher(
    cfg: DispatchConfig,
    source: Iterable[PromptLike],
    predictor: LengthPredictor,
    stop: threading.Event | None = None,
) -> DispatchSummary:
    """Publish ``source``'s prompts as tasks, paced by the trainer's steps (``max_staleness``
    set) or by the pools' backlog, until the source ends (``epochs`` times) or ``stop``."""
    use_schema_registry(cfg)
    stop = stop or threading.Event()
    layout = Layout.from_config(cfg)
    prompts = [layout.prompts(b) for b in layout.buckets]
    others = [layout.trajectories, layout.weights, layout.metrics, layout.dlq]
    ensure_topics(cfg, prompts + others, "dispatcher")
    published = read_published(cfg, layout, cfg.run)  # a restart resumes after them
    fit = PromptFit(cfg) if cfg.tokenizer else None  # a bad tokenizer fails before any work
    with contextlib.ExitStack() as stack:
        producer = stack.enter_context(Producer(cfg, "dispatcher"))
        if fit is not None:  # prompts that cannot fit the context: dead-lettered, never tasks
            source = fit.filter(source, producer, layout)
            stack.callback(lambda: log.info("%d prompts too long: dead-lettered", fit.dropped))
        if cfg.max_staleness is not None:
            anns = Announcements(cfg, layout, producer)
            stack.callback(anns.close)
            out = Windows(cfg, layout, producer, predictor, stop, published=published)
            return out.paced(source, anns, cfg.max_staleness).with_too_long(fit)
        room = None
        if cfg.max_pending is not None:
            lag = GroupLag(
                cfg,
                [pool_group(cfg.topic_prefix, p) for p in cfg.pools],
                [layout.prompts(b) for b in layout.buckets],
            )
            stack.callback(lag.close)
            room = Room(lag, cfg.max_pending)
        out = Windows(cfg, layout, producer, predictor, stop, room, published)
        return out.unpaced(source).with_too_long(fit)


class Windows:
    """One dispatcher run: its windows of prompts planned, released and published in order."""

    def __init__(
        self,
        cfg: DispatchConfig,
        layout: Layout,
        producer: Producer,
        predictor: LengthPredictor,
        stop: threading.Event,
        room: Room | None = None,
        published: Published | None = None,
    ) -> None:
        self.cfg, self.layout, self.producer, self.predictor = cfg, layout, producer, predictor
        self.stop, self.room = stop, room
        self.published = published or Published()
        self.balancer = (
            Balancer(layout.prompt_partitions) if cfg.partitioning == "balanced" else None
        )
        self.summary, self.by_bucket = DispatchSummary(), Counter[str]()

    def paced(self, source: Iterable[PromptLike], anns: Announcements, k: int) -> DispatchSummary:
        """A window per trainer step, each released by ``release`` and stamped with its step
        and ``min_version``: the lowest step after the newest announced one that no window a
        previous dispatcher published holds (``producers.dispatch_log``); the rest of a window
        it published in part goes out in its step."""
        step, held = 0, self.published.held()  # steps that surviving windows hold
        for window, tasks in self._planned(source, self.cfg.groups_per_step):
            t0 = time.monotonic()
            if (stamp := self._resumed(tasks)) is not None:
                self._publish(window, [dataclasses.replace(t, **asdict(stamp)) for t in tasks], t0)
                continue
            if not tasks:
                continue
            # the lowest step after the trainer's newest and this run's last that none holds
            step = max(anns.step, step) + 1
            while step in held:
                step += 1
            self.summary.first_step = self.summary.first_step or step
            min_version = release(anns, step, k, self.cfg.barrier_timeout_s, self.stop)
            self.summary.versions_seen.append(min_version)
            stamped = [
                dataclasses.replace(t, step=step, step_groups=len(window), min_version=min_version)
                for t in tasks
            ]
            self._publish(window, stamped, t0)
        return self.summary

    def unpaced(self, source: Iterable[PromptLike]) -> DispatchSummary:
        """Windows of ``window`` prompts, each task published when the pools have room."""
        for window, tasks in self._planned(source, self.cfg.window):
            self._resumed(tasks)
            if tasks:
                self._publish(window, tasks, time.monotonic())
        return self.summary

    def _resumed(self, tasks: list[PromptTask]) -> Stamp | None:
        """Drop from ``tasks`` (in place) what a previous dispatcher of the run published;
        the stamp of its step when it published part of this window (the rest goes there)."""
        todo, stamp = self.published.rest(tasks)
        self.summary.skipped += len(tasks) - len(todo)
        tasks[:] = todo
        return stamp if todo else None

    def _planned(
        self, source: Iterable[PromptLike], size: int
    ) -> Iterator[tuple[list[PromptLike], list[PromptTask]]]:
        """Every window of every epoch with its tasks (``plan_window``), until ``stop``."""
        for epoch in range(self.cfg.epochs):
            for window in windows(source, size):
                if self.stop.is_set():
                    return
                preds = self.predictor.predict([p.text for p in window])
                version = self.predictor.version
                yield window, plan_window(window, preds, self.layout, self.cfg, version, epoch)
            log.info("epoch %d done: %d tasks so far", epoch, self.summary.tasks)

    def _publish(self, window: list[PromptLike], tasks: list[PromptTask], t0: float) -> None:
        """Publish one window's tasks (unpaced: each once the pools have room), flush, count."""
        for task in tasks:
            if self.room is not None:
                self.room.take(self.producer, self.stop)
            if self.stop.is_set():
                break
            part = self.balancer.assign(task) if self.balancer is not None else None
            topic = self.layout.prompts(task.bucket)
            self.producer.produce(topic, encode(task), key=task.prompt_id, partition=part)
            self.summary.tasks += 1
            self.by_bucket[task.bucket] += 1
        self.producer.flush()
        self.summary.waited_s += time.monotonic() - t0
        self.summary.prompts += len(window)
        self.summary.windows += 1
        self.summary.by_bucket = dict(self.by_bucket)


def release_after(step: int, k: int) -> int:
    """The trainer step whose announcement releases ``step``'s prompts: ``step - 1 - k``."""
    return step - 1 - k


def release(anns: Announcements, step: int, k: int, timeout_s: float, stop: threading.Event) -> int:
    """Wait until step ``step`` may be released; the newest announced version (its tasks'
    ``min_version``)."""
    need = release_after(step, k)
    deadline = time.monotonic() + timeout_s
    while anns.step < need:
        if stop.is_set():
            return anns.latest
        if time.monotonic() > deadline:
            raise SrlError(
                f"step {step} waits for the trainer's step {need}, but none came for "
                f"{timeout_s:g}s; "
                "is the trainer running?"
            )
        anns.poll(0.05)
    return anns.latest


class Balancer:
    """Greedy LPT over the partitions of each prompt topic: a task goes to the partition with
    the least predicted tokens so far (tasks arrive longest first within a window)."""

    def __init__(self, partitions: int) -> None:
        self.partitions = partitions
        self.load: dict[str, list[float]] = {}

    def assign(self, task: PromptTask) -> int:
        load = self.load.setdefault(task.bucket, [0.0] * self.partitions)
        p = min(range(self.partitions), key=load.__getitem__)
        load[p] += float(task.predicted_length or 1) * len(task.samples())
        return p


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
