"""``run_trainer``: the trainer consumer's loop, from Kafka records to published weights.

Owns the order of everything durable. The hot loop is flat: poll → decode and assemble
(``consumers.intake``) → reward (queued to reward processes, ``consumers.rewardpool``: the loop
polls on while they run; results come back in order) → group → gate → batch →
forward/backward as micro-batches fill → step when the step's groups are all in. At each step
boundary, in this order:

1. the optimizer step (all ranks); the step's samples are decided (trained, dropped, failed)
   at the policy version they trained from;
2. every ``publish_every`` steps: a snapshot of weights ``v+1`` (all ranks), whose upload to
   the store (create-only files, manifest last) and announcement on the weights topic run in
   the background while the next step trains (``consumers.durable``, ``consumers.publisher``,
   ``srl.weights``); then the ``train_step`` event, with the version after that publish;
3. every ``checkpoint_every`` steps: a checkpoint (model, optimizer, step, version, the
   dedupe ledger, the window's sample events; marker last; ``consumers.durable``), after the
   upload in flight has finished (a checkpoint never names a version that is not out);
4. the window's ``sample`` events, a producer flush (events and dead letters delivered);
5. only then the consumer offsets, up to the first record still held by an unfinished
   trajectory (``consumers.offsets``).

A crash anywhere re-reads from the committed offsets (a producer failed for good, e.g. by a
restarted broker that lost what it had acknowledged, starts the trainer over from its last
checkpoint in its own process: ``srl.kafka.start_over``); the ledger restored with the
checkpoint drops what was already trained or dropped, so each trajectory is trained exactly
once in effect. Steps after the last checkpoint are redone; published versions are never
reused: a restart continues after the newest version in the store. Outcomes of a group that
trains are recorded with its step, so a group is finalized whole. What becomes of each
trajectory (the ledger, the window of sample events, expiries) and the step's metric values
are ``consumers.outcomes``'s, pure; this module does their I/O. The trainer reaches its backend
only through ``consumers.train_engine.TrainEngine``. Called by ``app.cli.consumer``.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from consumers import checkpoint as ckpts
from consumers.assembler import Partial
from consumers.backends import make_engine
from consumers.batcher import Row, StepBatcher
from consumers.config import TrainConfig
from consumers.distributed import Dist, follow
from consumers.durable import Durable
from consumers.engine import resolve_device
from consumers.engine_deepspeed import check_supported
from consumers.feedback import FeedbackPath
from consumers.gate import Admitted, gate_group
from consumers.groups import Group, GroupBuffer, Sample
from consumers.intake import Intake, Invalid
from consumers.offsets import OffsetTracker
from consumers.outcomes import Event, Ledger, Outcomes, step_values
from consumers.rewardpool import RewardPath, RewardPool
from consumers.rewards import Scorer, load_reward
from consumers.steps import StepPlanner
from consumers.train_engine import StepStats, TrainEngine, make_micro_batch
from srl.codecs import use_schema_registry
from srl.errors import ConfigError, StartOver
from srl.kafka import (
    Consumer,
    KafkaException,
    Producer,
    TopicPartition,
    ensure_topics,
    make_consumer,
    position_group,
    share_positions,
    start_group_at,
    start_over,
)
from srl.metrics import Metrics
from srl.stores import store_from_config
from srl.tinymodel import load_tokenizer
from srl.topics import Layout
from srl.weights import KnownVersions

if TYPE_CHECKING:
    from srl.store import ObjectStore

log = logging.getLogger("srl.trainer")
IDLE_CHECKPOINT_S = 2.0  # idle this long with undurable decisions: checkpoint and commit
MAX_POLL_INTERVAL_MS = 1_800_000  # librdkafka's 5 minutes is less than a 70B checkpoint
NO_GROUP = (
    "step %d: no group to train (%d released groups missing); publishing the same weights so "
    "the run moves on"
)
CHECKPOINT_WARN_BYTES = 10 << 30  # a checkpoint this large every step: said at start


@dataclass
class TrainResult:
    steps: int
    version: int
    outcomes: dict[str, int] = field(default_factory=dict)
    rank: int = 0
    micro_batches: int = 0  # ranks > 0: micro-batches this rank ran


def run_trainer(cfg: TrainConfig) -> TrainResult:
    """Train until ``max_steps``, ``idle_exit_s`` without records, or SIGTERM/SIGINT."""
    use_schema_registry(cfg)

    if not cfg.model or not (Path(cfg.model) / "config.json").is_file():
        raise ConfigError(
            f"model: {cfg.model or '(none)'} is not a Hugging Face model directory (--model DIR)"
        )
    if cfg.backend == "deepspeed":
        check_supported(cfg)
    dist = Dist.from_env(resolve_device(cfg.device))
    try:
        store = store_from_config(cfg)
        engine: TrainEngine | None = make_engine(cfg, dist)

        def attempt() -> TrainResult:
            nonlocal engine
            if engine is None:  # started over without a checkpoint: the model's own weights
                gc.collect()
                engine = make_engine(cfg, dist)
            ckpt = restore(cfg, store, engine, dist)
            if dist is not None and dist.rank > 0:
                steps, micro_batches = follow(engine, dist, store, cfg.run)
                return TrainResult(steps, -1, rank=dist.rank, micro_batches=micro_batches)
            try:
                return Trainer(cfg, engine, store, dist, ckpt).run()
            except StartOver:
                engine.discard()
                if ckpt is None:
                    engine = None
                raise

        # ranks > 0 follow rank 0's steps: they cannot start over with it
        return start_over(attempt, "trainer", again=dist is None)
    finally:
        if dist is not None:
            dist.close()


def train_limit(cfg: TrainConfig, engine: TrainEngine) -> tuple[int, str]:
    """The longest trajectory that may train, and what sets it."""
    if cfg.max_train_tokens and cfg.max_train_tokens < engine.max_length:
        return cfg.max_train_tokens, "--max-train-tokens"
    return engine.max_length, "the model's"


def warn_sizes(cfg: TrainConfig, engine: TrainEngine) -> None:
    """Say at start what a setting costs at this model's size, where it cannot work well."""
    n = sum(int(p.numel()) for p in getattr(engine, "params", []))  # a DTensor counts whole
    ckpt = n * 12  # fp32 weights and AdamW's two moments
    if cfg.checkpoint_every_s == 0 and ckpt >= CHECKPOINT_WARN_BYTES:
        log.warning(
            "every %d step(s) a checkpoint writes %.0f GB (fp32 weights and AdamW state): "
            "set --checkpoint-every-s (docs/trainer.md, 7B configuration: 900)",
            *(cfg.checkpoint_every, ckpt / 1e9),
        )
    if cfg.keep_versions == 0 and n * 2 >= CHECKPOINT_WARN_BYTES:
        log.warning(
            "--keep-versions 0 keeps every version in the store, %.0f GB each in bf16",
            n * 2 / 1e9,
        )


def restore(
    cfg: TrainConfig, store: ObjectStore, engine: TrainEngine, dist: Dist | None
) -> ckpts.Checkpoint | None:
    """The run's newest complete checkpoint (rank 0 picks it for all), loaded into ``engine``."""
    numbers = ckpts.complete(store, cfg.run) if dist is None or dist.rank == 0 else []
    number = numbers[-1] if numbers else 0
    if dist is not None:
        number = dist.broadcast_int(number)
    ckpt = ckpts.load(store, cfg.run, number) if number else None
    if ckpt is not None:
        engine.load_checkpoint_state(ckpt.shards)
    return ckpt


def commit(consumer: Consumer, tracker: OffsetTracker) -> None:
    """Commit the offsets ``tracker`` allows; a failure only logs (the ledger dedupes what a
    restart re-reads)."""
    offsets = tracker.committable()
    if not offsets:
        return
    try:
        consumer.commit_sync([TopicPartition(t, p, o) for (t, p), o in offsets.items()])
        tracker.mark_committed(offsets)
    except KafkaException as e:
        log.warning("offset commit failed (records will be re-read and deduplicated): %s", e)


def open_consumers(cfg: TrainConfig, topics: list[str]) -> tuple[Consumer, Consumer]:
    """The trainer's member of its group, and the client that shares its read positions.
    A group that has committed nothing yet (a trainer added to a running run) first gets the
    starting positions of ``--from``."""
    gid = cfg.consumer_group
    try:
        start_group_at(cfg, gid, topics, cfg.start_ms)
    except KafkaException as e:  # the consumer's auto.offset.reset (earliest) applies instead
        log.warning("--from %s: cannot commit the starting positions: %s", cfg.start_from, e)
    # static membership: a restarted trainer takes its predecessor's place at once instead
    # of waiting for the group to notice the dead member; a second trainer in the same
    # group fences the first rather than splitting the partitions (and the groups) with it
    static: dict[str, Any] = {"group.instance.id": f"{gid}-rank0"}
    # a step, a publish's snapshot and a checkpoint of a large model run between two polls:
    # the group must not drop a trainer that is busy (a 7B checkpoint is minutes)
    static["max.poll.interval.ms"] = MAX_POLL_INTERVAL_MS  # -X max.poll.interval.ms wins
    consumer = make_consumer(cfg, gid, "trainer", **static)
    # how far we have read, for the generators' backlog bound (committed offsets trail
    # behind every unfinished trajectory and every checkpoint interval)
    return consumer, make_consumer(cfg, position_group(gid), "trainer-position")


def reward_pool(cfg: TrainConfig) -> RewardPool:
    """``--reward`` (imported here first: a bad one stops the trainer in one line) and the
    processes that run it (``--reward-workers``)."""
    scorer = Scorer(load_reward(cfg.reward), load_tokenizer(cfg.model))
    return RewardPool(cfg.reward, scorer, cfg.reward_workers, cfg.reward_timeout_s)


def count(metrics: Metrics, *events: Event) -> None:
    """The ``samples_{outcome}`` counters of decided samples."""
    for e in events:
        metrics.incr(f"samples_{e['labels']['outcome']}")


def log_step(step: int, values: dict[str, float], loss: float) -> None:
    log.info(
        "step %d v%d loss %.4f reward %.3f samples %d tokens/s %.0f idle %.2fs",
        step,
        values["policy_version"],
        loss,
        values["reward_mean"],
        values["samples"],
        values["tokens_per_s"],
        values["idle_s"],
    )


def gated(cfg: TrainConfig, group: Group, d: Durable) -> Admitted:
    """``group`` through the gate with the trainer's settings, judged against the weights it
    trains (after a restart, versions published past the checkpoint are no update of them:
    ``consumers.durable``, "skipped")."""
    return gate_group(
        group,
        d.lineage,
        cfg.staleness_bound,
        cfg.stale_policy,
        cfg.advantage,
        d.skipped,
        served_k=cfg.served_staleness_bound,
        skip_flat=cfg.kl_coef == 0,
    )


def step_batcher(cfg: TrainConfig) -> StepBatcher:
    """The trainer's micro-batches: streamed (eagerly) unless it trains at a barrier."""
    return StepBatcher(
        cfg.micro_batch_tokens, not cfg.sync_barrier, cfg.packing, cfg.eager_micro_batches
    )


class Trainer:
    """Rank 0: the consumer, the ledger, the publisher. See the module docstring."""

    def __init__(
        self,
        cfg: TrainConfig,
        engine: TrainEngine,
        store: ObjectStore,
        dist: Dist | None,
        ckpt: ckpts.Checkpoint | None,
    ) -> None:
        self.cfg, self.engine, self.dist = cfg, engine, dist
        self.layout = Layout.from_config(cfg)
        self.step = ckpt.step if ckpt else 0
        ledger = Ledger.restore(ckpt.ledger, ckpt.extra) if ckpt else Ledger()
        self.outcomes = Outcomes(ledger, cfg.expire_s)
        # every kept checkpoint's window, not just this one's (``ckpts.window_events``)
        self.replay_events = ckpts.window_events(store, cfg.run, ckpt.number) if ckpt else []
        self.dirty = False  # steps since the last checkpoint
        self.groups = GroupBuffer(cfg.expire_s)
        self.batcher = step_batcher(cfg)
        self.planner = StepPlanner(
            cfg.groups_per_step, cfg.expire_s, self.step + 1, windows=cfg.batching == "windows"
        )
        pool = reward_pool(cfg)
        self.producer = Producer(cfg, "trainer")
        self.metrics = Metrics(self.producer, self.layout, cfg.run, "trainer-0")
        self.durable = Durable(cfg, engine, store, dist, self.producer, self.metrics, ckpt)
        warn_sizes(cfg, engine)
        versions = KnownVersions(store, floor=lambda: self.version)
        limit, out = train_limit(cfg, engine), (self.producer, self.metrics, versions)
        # the temperature: the only sampling it trains on
        self.intake = Intake(self.outcomes, limit, cfg.expire_s, *out, cfg.temperature)
        # missing feedback is scored by --reward, like any other trajectory
        args = (self.producer, self.metrics, self.outcomes, self.groups, pool.score, self._at)
        self.feedback = FeedbackPath(cfg, *args)
        self.rewards = RewardPath(pool, self.feedback, self.metrics)
        self.stopping, self.next_tick = False, 0.0
        # when it last read records or ended a step or a checkpoint: idle counts from there (a
        # checkpoint over a slow link outlasted --idle-exit-s with records already queued)
        self.active: float | None = None  # None until the group assigns it partitions
        self.step_started, self.idle_s, self.stale_in_step = time.monotonic(), 0.0, 0

    @property
    def version(self) -> int:
        """v: the policy versions this run has published (``consumers.durable``)."""
        return self.durable.version

    # -- the loop ---------------------------------------------------------------------------
    def run(self) -> TrainResult:
        topics = [self.layout.trajectories] + [self.layout.feedback] * self.feedback.enabled
        writes = [self.layout.weights, self.layout.metrics, self.layout.dlq]
        ensure_topics(self.cfg, topics + writes, "trainer")
        self._recover()
        self.consumer, self.sharer = open_consumers(self.cfg, topics)
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            self.consumer.subscribe(topics, on_assign=self._on_assign)
            while not self._done():
                t0 = time.monotonic()
                # rewards in flight come back between polls: wait less for records meanwhile
                msgs = self.consumer.next_batch(500, 0.01 if self.rewards.pending else 0.2)
                now = time.monotonic()
                self.idle_s += now - t0
                for msg in msgs:
                    fb = msg.topic() != topics[0]  # a feedback record: the sample it rewards
                    traj = self.feedback.add(msg, now) if fb else self.intake.add(msg)
                    if traj is not None:
                        self.rewards.submit(traj)
                    self._scored()
                    if self._stop_now():
                        break
                self._scored()
                if rows := self.batcher.flush():  # nothing more to add now: train what waits
                    self._run(rows)
                if msgs:
                    self.active = time.monotonic()  # idle counts from the end of the work
                if now >= self.next_tick:
                    self._tick(now)
            self._shutdown()
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            self.rewards.close()
            with contextlib.suppress(Exception):  # after a crash: the upload ends first and
                self.durable.collect(wait=True)  # is reported (a restart counts its version)
            with contextlib.suppress(KafkaException):
                share_positions(self.sharer, self.consumer, asynchronous=False)
            self.sharer.close()
            self.consumer.close()
        return TrainResult(self.step, self.version, self.outcomes.counts())

    def _on_assign(self, consumer: Consumer, partitions: list[Any]) -> None:
        # a restarted trainer waits for the group to drop its dead predecessor: idle time
        # counts from the assignment, not from the start
        self.active = time.monotonic()
        self.intake.assign(consumer, partitions, self.layout.trajectories)
        log.info("assigned %d partitions", len(partitions))

    def _on_signal(self, signum: int, _frame: Any) -> None:
        log.info("signal %d: stopping after a final checkpoint", signum)
        self.stopping = True

    def _stop_now(self) -> bool:
        return self.stopping or bool(self.cfg.max_steps and self.step >= self.cfg.max_steps)

    def _done(self) -> bool:
        if self._stop_now():
            return True
        last, limit = self.active, self.cfg.idle_exit_s
        idle = limit and last is not None and time.monotonic() - last >= limit
        return bool(idle) and not self.rewards.pending  # a reward in flight: not idle

    # -- trajectories → groups --------------------------------------------------------------
    def _scored(self) -> None:
        """What the reward path hands back, in the order read, to its groups (and steps)."""
        for item in self.rewards.ready():
            group = self._group(item)
            if group is not None:
                self._plan(group)

    def _group(self, traj: Invalid | Sample) -> Group | None:
        """The group ``traj`` completes: rewarded, or (invalid) decided and its slot filled so
        the rest of the group (and its step) is not held until expiry."""
        if isinstance(traj, Sample):
            return self.groups.add(traj)
        c = traj.chunk
        step = self.step + 1
        count(
            self.metrics,
            self.outcomes.invalid(c.trajectory_id, c.prompt_id, c.bucket, step, traj.reason),
        )
        return self.groups.add_missing(
            c.prompt_id, c.sample_index, c.group_size, c.trajectory_id, step=(c.step, c.step_groups)
        )

    def _at(self) -> tuple[int, int]:
        """Where a decision outside a step lands: the open step, the current version."""
        return self.step + 1, self.version

    # -- groups → steps -------------------------------------------------------------------------
    def _plan(self, group: Group) -> None:
        """A complete (or expired) group joins its step, now or when that step opens."""
        for g in self.planner.add(group):
            self._admit(g)
        self._steps()

    def _steps(self) -> None:
        """Take the open step while it is complete (held groups may complete the next one)."""
        while not self._stop_now() and self.planner.complete():
            self._take_step()
            for g in self.planner.advance():
                self._admit(g)

    def _admit(self, group: Group) -> None:
        if not group.complete:  # expired before all its samples arrived: nothing of it trains
            self.planner.credit(group, signal=False)
            count(self.metrics, *self.outcomes.expired_group(group, self.step + 1, self.version))
            return
        d = self.durable
        adm = gated(self.cfg, group, d)
        self.stale_in_step += len(adm.stale)
        self.planner.credit(group, adm.signal)
        if not adm.trains:  # nothing of it will train: finalize the whole group now
            count(self.metrics, *self.outcomes.gated(adm, self.step + 1, d.lineage))
            return
        for rows in self.batcher.add(adm):
            self._run(rows)

    def _run(self, rows: list[Row]) -> None:
        mb = make_micro_batch(rows, self.cfg.loss_agg == "seq_mean")
        for own in self.dist.assign(mb) if self.dist is not None else [mb]:
            self.engine.backward(own)

    def _optimizer_step(self) -> StepStats:
        """The open step's update on every rank (none when nothing of the step trains)."""
        b = self.batcher
        normalizer = float(b.rows if self.cfg.loss_agg == "seq_mean" else b.loss_tokens)
        if not b.groups:  # nothing of the step trains (all lost or failed): same weights
            log.warning(NO_GROUP, self.step + 1, self.planner.missing)
            return StepStats()
        if self.dist is not None:
            self.dist.step(self.step + 1, normalizer, self.engine.backward)
        return self.engine.step(normalizer)

    def _take_step(self) -> None:
        for rows in self.batcher.drain():
            self._run(rows)
        b = self.batcher
        stats = self._optimizer_step()
        if self.planner.missing:
            self.metrics.incr("missing_groups", self.planner.missing)
        self.step += 1
        self.dirty = True
        for adm in b.groups:  # outcomes at the version the step trained from
            count(self.metrics, *self.outcomes.gated(adm, self.step, adm.version))
        elapsed = time.monotonic() - self.step_started
        values = step_values(
            b.groups, b.loss_tokens, stats, self.version, elapsed, self.idle_s, self.stale_in_step
        )
        if self.step % self.cfg.publish_every == 0:
            self.durable.publish(self.step)
        values["policy_version"] = self.version
        self.metrics.emit("train_step", values, step=self.step)
        log_step(self.step, values, stats.loss)
        if self.durable.checkpoint_due(self.step):
            self._checkpoint()
        self.metrics.flush_counters(self.step)
        self.batcher.reset()
        self.step_started = self.active = time.monotonic()
        self.idle_s, self.stale_in_step = 0.0, 0

    # -- outcomes and expiry ----------------------------------------------------------------------
    def _expire_partial(self, p: Partial) -> Group | None:
        """An expired trajectory, decided; it fills its slot in the group (which may complete)."""
        count(self.metrics, self.outcomes.expired_partial(p, self.step + 1, self.version))
        return self.groups.add_missing(
            p.prompt_id, p.sample_index, p.group_size, p.trajectory_id, step=p.step
        )

    def _tick(self, now: float) -> None:
        self.next_tick = now + 1.0
        self._scored()
        try:
            share_positions(self.sharer, self.consumer)
        except KafkaException as e:  # a monitoring signal: the next tick tries again
            log.debug("sharing positions: %s", e)
        for p in self.intake.assembler.expire():
            group = self._expire_partial(p)
            if group is not None:
                self._plan(group)
        prompts, steps = self.intake.assembler.in_flight()  # long tails are waited for
        self.planner.alive(steps, now)
        for g in [*self.groups.expire(now, prompts), *self.feedback.expire(now, self.consumer)]:
            self._plan(g)
        self._steps()  # a step whose groups stopped arriving completes by expiry
        self.durable.collect()  # an upload that finished: its metrics, pruning, or a refusal
        self.durable.publish_owed(self.step)  # the dispatcher waits for a refused publish
        new = self.intake.assembler.duplicates - self.metrics.counters["duplicates"]
        self.metrics.incr("duplicates", new)
        if (
            self.outcomes.undurable
            and self.active is not None
            and now - self.active >= IDLE_CHECKPOINT_S
            and self.durable.due("checkpoint")
        ):
            # decisions no step will follow soon (e.g. stale drops): make them durable and
            # commit, or generators bounded by the trainer's backlog would wait on us forever
            self._checkpoint()
        self.producer.poll(0)

    # -- durability: steps 3 to 5 of the module docstring -------------------------------------
    def _checkpoint(self) -> None:
        t0 = time.perf_counter()
        if not self.durable.save(self.step, self.outcomes):
            return  # nothing became durable: no sample events, no commit; the next one retries
        self._emit_samples(self.outcomes.window)
        self.producer.flush()
        self.intake.tracker.release(self.outcomes.undurable)
        self.feedback.tracker.release(self.outcomes.undurable)
        commit(self.consumer, self.intake.tracker)
        commit(self.consumer, self.feedback.tracker)
        pruned = self.intake.checkpointed(self.outcomes.undurable, self.step)
        self.outcomes.checkpointed()
        self.dirty, self.active = False, time.monotonic()
        self.metrics.incr("checkpoints")
        log.info(
            "checkpoint %d at step %d (%.2fs); ledger %d (%d pruned)",
            *(self.durable.number, self.step, time.perf_counter() - t0),
            *(len(self.outcomes.ledger), pruned),
        )

    def _emit_samples(self, events: list[Event]) -> None:
        for e in events:
            self.metrics.emit("sample", e["values"], e["labels"], step=e["step"])

    def _recover(self) -> None:
        """After a restart: re-send the kept checkpoints' windows; announce the newest version."""
        if self.replay_events:
            self._emit_samples(self.replay_events)
            self.producer.flush()
        self.durable.reannounce()
        log.info("at step %d, v%d; ledger %d", self.step, self.version, len(self.outcomes.ledger))

    def _shutdown(self) -> None:
        self.durable.collect(wait=True)  # the last version is out before the trainer is
        if self.batcher.groups:
            log.info(
                "leaving a partial step of %d groups; its records are read again on restart",
                len(self.batcher.groups),
            )
        self.engine.discard()
        if self.dist is not None:
            self.dist.discard()
        if self.dirty or self.outcomes.undurable:
            self._checkpoint()
        self.metrics.flush_counters(self.step)
        self.producer.flush()
        if self.dist is not None:
            self.dist.stop()
