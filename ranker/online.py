"""Online ranker training from the trajectories topic: (prompt, actual length) pairs → versions.

Owns ``srl ranker train --online``. The trajectories topic already carries what the ranker
needs: a trajectory's seq-0 chunk has ``prompt_tokens`` (and the ``predicted_length`` it was
dispatched with), and its final chunk gives the length (``token_offset + tokens``). The
ranker reads it in its own consumer group, so it never slows the generators or the trainer.

Loop, in this order:

1. poll chunks; ``PairCollector.add`` returns a pair once both ends of a trajectory are seen
   (either order: a migrated trajectory's tail lands on another bucket's partitions);
2. after every ``retrain_every`` new pairs (and at least ``min_pairs`` in the window), fit on
   the sliding window of the most recent ``window`` pairs, warm-started from the latest
   published version, so the ranker follows the policy's drift;
3. publish the version (``ranker.publish``: files, manifest last);
4. only then commit the consumer offsets of the chunks that went into it, held back on each
   partition to the first chunk of any trajectory still half-seen (``PairCollector.holds``):
   a restarted ranker reads that chunk again and pairs the trajectory, instead of losing it.
   The pairs between the hold and the commit are read again too and count once more in the
   restarted ranker's window (a sliding window; a pair twice is harmless, a pair lost is not).

A record that is not a usable chunk goes to the DLQ with the reason and is counted, and the
run goes on: oversized, undecodable, another record type (``srl.metrics.read_record``), a
chunk with negative positions or version, or prompt tokens outside the tokenizer
(``chunk_defect``), or a policy version no run has published (``srl.weights.KnownVersions``).
The consumer is a static member of its group (``group.instance.id``), so a restarted ranker
gets its partitions back at once (``tests/e2e/test_ranker_restart.py``). A producer that
failed for good (a broker that lost what it acknowledged) starts the ranker over in its
process from the committed offsets (``srl.kafka.start_over``), as the other roles do. Prompt
tokens are turned back into text with the policy's tokenizer (``--model DIR``), because the
dispatcher predicts from the rendered prompt text.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ranker.dispatch import length_quantiles
from ranker.features import FeatureSpec
from ranker.metrics import ranking_report
from ranker.model import LengthRanker
from ranker.publish import RankerFollower, publish
from schemas.records import TrajectoryChunk, unpack_tokens
from srl.codecs import use_schema_registry
from srl.kafka import (
    Consumer,
    KafkaException,
    Message,
    Producer,
    TopicPartition,
    describe,
    ensure_topics,
    make_consumer,
    produced_ms,
    start_over,
)
from srl.metrics import Metrics, dead_letter, origin, read_record
from srl.stores import store_from_config
from srl.tinymodel import build_tokenizer, load_tokenizer
from srl.topics import Layout
from srl.weights import KnownVersions

if TYPE_CHECKING:
    from ranker.config import RankerConfig
    from ranker.model import LengthRanker

log = logging.getLogger("srl.ranker")


@dataclass(frozen=True)
class Pair:
    trajectory_id: str
    prompt_tokens: bytes
    length: int
    predicted_length: int | None


Where = tuple[str, int, int]  # topic, partition, offset of a record


@dataclass
class _Half:
    prompt_tokens: bytes | None = None
    predicted: int | None = None
    length: int | None = None
    first: Where | None = None  # the first of its chunks read


@dataclass
class PairCollector:
    """Joins a trajectory's seq-0 chunk and its final chunk into one ``Pair``, exactly once.

    Bounded: at most ``max_open`` half-seen trajectories are kept (the oldest is forgotten and
    counted in ``evicted``), and the last ``max_done`` finished ids are remembered so that a
    redelivered chunk does not make a second pair. Aborted trajectories make no pair.
    """

    max_open: int = 100_000
    max_done: int = 200_000
    evicted: int = 0
    duplicates: int = 0
    _open: OrderedDict[str, _Half] = field(default_factory=OrderedDict)
    _done: OrderedDict[str, None] = field(default_factory=OrderedDict)

    def add(self, c: TrajectoryChunk, where: Where | None = None) -> Pair | None:
        tid = c.trajectory_id
        if tid in self._done:
            self.duplicates += 1
            return None
        half = self._open.get(tid)
        if half is None:
            half = self._open[tid] = _Half(first=where)
            if len(self._open) > self.max_open:
                self._open.popitem(last=False)
                self.evicted += 1
        if c.seq == 0 and c.prompt_tokens is not None:
            half.prompt_tokens, half.predicted = c.prompt_tokens, c.predicted_length
        if c.is_last:
            if c.finish_reason == "abort":
                self._open.pop(tid, None)
                return None
            half.length = c.token_offset + c.n_tokens
        if half.prompt_tokens is None or half.length is None:
            return None
        del self._open[tid]
        self._done[tid] = None
        if len(self._done) > self.max_done:
            self._done.popitem(last=False)
        return Pair(tid, half.prompt_tokens, half.length, half.predicted)

    def holds(self) -> dict[tuple[str, int], int]:
        """Per (topic, partition), the offset of the earliest first chunk of a half-seen
        trajectory: a commit must not pass it, or a restart never pairs that trajectory."""
        out: dict[tuple[str, int], int] = {}
        for half in self._open.values():
            if half.first is not None:
                t, p, o = half.first
                out[(t, p)] = min(o, out.get((t, p), o))
        return out


def commit_offsets(
    pending: dict[tuple[str, int], int], holds: dict[tuple[str, int], int]
) -> list[TopicPartition]:
    """The offsets to commit: each partition read since the last commit, up to what was read
    or to its hold, whichever is lower. A partition not read since keeps its last commit,
    which was already held back."""
    return [TopicPartition(t, p, min(o, holds.get((t, p), o))) for (t, p), o in pending.items()]


@dataclass
class TrainWindow:
    """The most recent ``window`` (text, length) pairs and when to retrain."""

    window: int = 4000
    retrain_every: int = 500
    min_pairs: int = 200
    since_fit: int = 0
    # (prompt text, actual length, dispatch-time prediction or nan), oldest first
    pairs: deque[tuple[str, int, float]] = field(default_factory=deque)

    def add(self, text: str, length: int, predicted: int | None) -> None:
        self.pairs.append((text, length, float("nan") if predicted is None else float(predicted)))
        if len(self.pairs) > self.window:
            self.pairs.popleft()
        self.since_fit += 1

    @property
    def lengths(self) -> np.ndarray:
        return np.array([p[1] for p in self.pairs], dtype=np.float64)

    @property
    def predicted(self) -> np.ndarray:
        return np.array([p[2] for p in self.pairs], dtype=np.float64)

    def due(self) -> bool:
        return self.since_fit >= self.retrain_every and len(self.pairs) >= self.min_pairs

    def arrays(self) -> tuple[list[str], np.ndarray]:
        return [p[0] for p in self.pairs], self.lengths


def live_report(window: TrainWindow) -> dict[str, float | int] | None:
    """Ranking quality of the predictions the dispatcher actually made, on the window."""

    pred = window.predicted
    ok = ~np.isnan(pred)
    if ok.sum() < 20:
        return None
    return ranking_report(window.lengths[ok], pred[ok])


def decoder_for(model_dir: str | None) -> tuple[Callable[[bytes], str], int]:
    """Token bytes → prompt text, with the policy's tokenizer (the tiny byte-level one if None),
    and the size of its vocabulary."""

    tok = load_tokenizer(model_dir) if model_dir else build_tokenizer()

    def decode(data: bytes) -> str:
        return str(tok.decode(unpack_tokens(data).tolist(), skip_special_tokens=True))

    return decode, len(tok)


def chunk_defect(c: TrajectoryChunk, vocab_size: int) -> str | None:
    """Why a chunk can make no (prompt, length) pair (None: it can): negative positions or
    version, token bytes that are not int32s, prompt tokens outside the tokenizer's vocabulary."""
    if c.seq < 0 or c.token_offset < 0 or c.policy_version < 0:
        return f"negative seq, token_offset or policy version ({c.seq}, {c.token_offset}, " + (
            f"{c.policy_version})"
        )
    if len(c.tokens) % 4 or (c.prompt_tokens is not None and len(c.prompt_tokens) % 4):
        return "token bytes are not packed int32s"
    if c.prompt_tokens:
        ids = unpack_tokens(c.prompt_tokens)
        if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
            return f"prompt token ids outside the tokenizer's {vocab_size}"
    return None


def idle(last_progress: float, idle_timeout_s: float | None) -> bool:
    return idle_timeout_s is not None and time.monotonic() - last_progress > idle_timeout_s


def run_online(
    cfg: RankerConfig,
    max_versions: int | None = None,
    idle_timeout_s: float | None = None,
    on_version: Callable[[LengthRanker, dict[str, float]], None] | None = None,
) -> int:
    """Consume trajectories and publish versions until ``max_versions`` or ``idle_timeout_s``
    without a new pair; returns the number of versions published. A version is trained the
    moment the ``retrain_every``-th new pair arrives, so versions hold exactly those pairs."""
    use_schema_registry(cfg)
    layout = Layout.from_config(cfg)
    ensure_topics(cfg, [layout.trajectories, layout.metrics, layout.dlq], "ranker")
    # static membership: a restarted ranker takes its predecessor's place at once (a broker
    # that never evicts a SIGKILLed member, as the embedded one, would otherwise keep the
    # partitions with the dead one for good); a second ranker in the group fences the first
    gid = cfg.group_id()
    static: dict[str, Any] = {"group.instance.id": f"{gid}-0"}
    published = 0

    def attempt() -> int:
        nonlocal published
        left = None if max_versions is None else max_versions - published
        with (
            Producer(cfg, "ranker") as producer,
            make_consumer(cfg, gid, "ranker", **static) as consumer,
        ):
            run = _OnlineRun(cfg, layout, consumer, producer)
            consumer.subscribe([layout.trajectories])
            try:
                while not run.done(left) and not idle(run.last_progress, idle_timeout_s):
                    for msg in consumer.consume(500, 0.5):
                        if msg.error() or run.done(left):
                            continue  # past max_versions: left uncommitted for the next run
                        version = run.take(msg)
                        if version is not None and on_version is not None:
                            on_version(*version)
            finally:
                published += run.published
        return published

    # a broker that lost what the producer wrote (a SIGKILLed embedded broker): the pairs
    # since the last version are read again from the committed offsets, in this process
    return start_over(attempt, "ranker")


class _OnlineRun:
    """One ``run_online``: pairs in, versions out, offsets committed after each version."""

    def __init__(
        self, cfg: RankerConfig, layout: Layout, consumer: Consumer, producer: Producer
    ) -> None:
        self.layout, self.consumer, self.producer = layout, consumer, producer
        self.metrics = Metrics(producer, layout, cfg.run, "ranker")
        self.trainer = _VersionTrainer(cfg)
        self.collector = PairCollector()
        self.versions = KnownVersions(self.trainer.store)
        self.published, self.last_progress = 0, time.monotonic()
        self.pending: dict[tuple[str, int], int] = {}  # next offsets not yet in a version

    def done(self, max_versions: int | None) -> bool:
        return max_versions is not None and self.published >= max_versions

    def take(self, msg: Message) -> tuple[LengthRanker, dict[str, float]] | None:
        """One record; the version published because of it, if any (steps 1-4 above)."""
        where = (msg.topic() or "", msg.partition() or 0, msg.offset() or 0)
        self.pending[where[:2]] = where[2] + 1
        chunk = read_record(msg, TrajectoryChunk, self.producer, self.layout, self.metrics)
        if chunk is None:
            return None
        why = chunk_defect(chunk, self.trainer.vocab_size)
        if why is None and not self.versions.exists(chunk.policy_version, produced_ms(msg)):
            why = f"policy version {chunk.policy_version} from the future"
        if why is not None:
            reason = f"bad chunk {chunk.trajectory_id}/{chunk.seq}: {why}"
            dead_letter(
                self.producer,
                self.layout,
                msg.value(),
                msg.key(),
                reason,
                origin(msg),
                self.metrics,
            )
            return None
        pair = self.collector.add(chunk, where)
        if pair is None:
            return None
        self.last_progress = time.monotonic()
        self.trainer.add(pair)
        self.metrics.incr("ranker_pairs")
        if not self.trainer.window.due():
            return None
        ranker, values = self.trainer.train_and_publish()  # steps 2 and 3
        self.published += 1
        self.metrics.emit("ranker_published", values)
        self.metrics.flush_counters()
        # step 4: the version holding these pairs is durable
        offsets = commit_offsets(self.pending, self.collector.holds())
        try:
            self.consumer.commit_sync(offsets)
        except KafkaException as e:  # a rebalance (a restarted broker): not worth an exit
            log.warning("commit after ranker v%s failed: %s", ranker.version, describe(e))
            self.metrics.incr("commit_failures")  # at worst these pairs are read again
        self.pending.clear()
        log.info("ranker v%s published from %d pairs", ranker.version, values["pairs"])
        return ranker, values


class _VersionTrainer:
    """Window of pairs → a fitted, published version (warm-started from the latest)."""

    def __init__(self, cfg: RankerConfig) -> None:

        self.cfg = cfg
        self.store = store_from_config(cfg)
        self.decode_prompt, self.vocab_size = decoder_for(cfg.model_dir)
        self.window = TrainWindow(cfg.window, cfg.retrain_every, cfg.min_pairs)
        self.follower = RankerFollower(self.store, cfg.run)

    def add(self, pair: Pair) -> None:
        self.window.add(self.decode_prompt(pair.prompt_tokens), pair.length, pair.predicted_length)

    def train_and_publish(self) -> tuple[LengthRanker, dict[str, float]]:

        texts, lengths = self.window.arrays()
        live = live_report(self.window)
        init = self.follower.poll(force=True)

        ranker = LengthRanker.fit(
            texts,
            lengths,
            spec=FeatureSpec(self.cfg.buckets),
            hidden=self.cfg.hidden,
            epochs=self.cfg.epochs,
            init=init,
        )
        ranker.info["length_quantiles"] = length_quantiles(lengths)
        ranker = publish(self.store, self.cfg.run, ranker, {"dispatch_time_metrics": live})
        self.window.since_fit = 0
        values = {"version": float(ranker.version or 0), "pairs": float(len(texts))}
        if live:
            values |= {f"live_{k}": float(v) for k, v in live.items()}
        return ranker, values
