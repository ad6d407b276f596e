"""``run_trainer``: the trainer consumer's loop, from Kafka records to published weights.

Owns the order of everything durable. The hot loop is flat: poll → decode → assemble →
score → group → gate → batch → forward/backward as micro-batches fill → step when the step's
groups are all in. At each step boundary, in this order:

1. the optimizer step (all ranks), then the ``train_step`` event;
2. every ``publish_every`` steps: weights ``v+1`` to the store (create-only files, manifest
   last) and the announcement on the weights topic (``srl.weights``);
3. every ``checkpoint_every`` steps: a checkpoint (model, optimizer, step, version, the
   dedupe ledger, the window's sample events; marker last);
4. the window's ``sample`` events, a producer flush (events and dead letters delivered);
5. only then the consumer offsets, up to the first record still held by an unfinished
   trajectory (``consumers.offsets``).

A crash anywhere re-reads from the committed offsets; the ledger restored with the
checkpoint drops what was already trained or dropped, so each trajectory is trained exactly
once in effect. Steps after the last checkpoint are redone; published versions are never
reused: a restart continues after the newest version in the store. Outcomes of a group that
trains are recorded with its step, so a group is finalized whole. Called by ``app.cli.consumer``.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from consumers import checkpoint as ckpts
from consumers.assembler import Assembler, BadChunk, BadTrajectory, Partial, Trajectory
from consumers.backends import make_engine
from consumers.batcher import Row, StepBatcher
from consumers.config import TrainConfig
from consumers.distributed import Dist, follow
from consumers.engine import extra_files, resolve_device
from consumers.engine_deepspeed import check_supported
from consumers.gate import Admitted, gate_group, staleness
from consumers.groups import Group, GroupBuffer, Sample
from consumers.offsets import OffsetTracker
from consumers.rewards import Scorer, load_reward
from consumers.steps import StepPlanner
from consumers.train_engine import StepStats, TrainEngine, make_micro_batch
from schemas.codec import SchemaError
from schemas.records import TrajectoryChunk, decode_as
from srl.errors import ConfigError
from srl.kafka import (
    KafkaException,
    Producer,
    TopicPartition,
    commit_sync,
    create_topics,
    make_consumer,
    position_group,
    share_positions,
)
from srl.metrics import Metrics, dead_letter
from srl.stores import store_from_config
from srl.tinymodel import load_tokenizer
from srl.topics import Layout
from srl.weights import MANIFEST, Manifest, Published, announce, publish, version_prefix

if TYPE_CHECKING:
    from consumers.distributed import Dist
    from srl.store import ObjectStore

log = logging.getLogger("srl.trainer")
IDLE_CHECKPOINT_S = 2.0  # idle this long with undurable decisions: checkpoint and commit


@dataclass
class TrainResult:
    steps: int
    version: int
    outcomes: dict[str, int] = field(default_factory=dict)
    rank: int = 0
    micro_batches: int = 0  # ranks > 0: micro-batches this rank ran


def run_trainer(cfg: TrainConfig) -> TrainResult:
    """Train until ``max_steps``, ``idle_exit_s`` without records, or SIGTERM/SIGINT."""

    if not cfg.model or not (Path(cfg.model) / "config.json").is_file():
        raise ConfigError(
            f"model: {cfg.model or '(none)'} is not a Hugging Face model directory (--model DIR)"
        )
    if cfg.backend == "deepspeed":
        check_supported(cfg)
    dist = Dist.from_env(resolve_device(cfg.device))
    try:
        store = store_from_config(cfg)
        engine = make_engine(cfg, dist)
        numbers = ckpts.complete(store, cfg.run) if dist is None or dist.rank == 0 else []
        number = numbers[-1] if numbers else 0
        if dist is not None:
            number = dist.broadcast_int(number)
        ckpt = ckpts.load(store, cfg.run, number) if number else None
        if ckpt is not None:
            engine.load_tensors(ckpt.model)
            engine.load_optimizer_state(ckpt.optimizer)
        if dist is not None and dist.rank > 0:
            steps, micro_batches = follow(engine, dist)
            return TrainResult(steps, -1, rank=dist.rank, micro_batches=micro_batches)
        return Trainer(cfg, engine, store, dist, ckpt).run()
    finally:
        if dist is not None:
            dist.close()


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

        self.cfg, self.engine, self.store, self.dist = cfg, engine, store, dist
        self.layout = Layout.from_config(cfg)
        self.step = ckpt.step if ckpt else 0
        self.ckpt_number = ckpts.highest_number(store, cfg.run)
        self.ledger: dict[str, list[Any]] = dict(ckpt.ledger) if ckpt else {}
        self.replay_events = list(ckpt.events) if ckpt else []
        self.lineage = int(ckpt.extra.get("lineage", ckpt.version)) if ckpt else 0
        self.version = max(ckpt.version if ckpt else 0, ckpts.newest_published(store, cfg.run))
        self.window: list[dict[str, Any]] = []  # sample events since the last checkpoint
        self.undurable: set[str] = set()  # outcomes decided since the last checkpoint
        self.dirty = False  # steps since the last checkpoint
        self.assembler = Assembler(self.ledger, cfg.expire_s)
        self.groups = GroupBuffer(cfg.expire_s)
        self.batcher = StepBatcher(cfg.micro_batch_tokens, not cfg.sync_barrier)
        self.planner = StepPlanner(
            cfg.groups_per_step, cfg.expire_s, self.step + 1, windows=cfg.batching == "windows"
        )
        self.scorer = Scorer(load_reward(cfg.reward), load_tokenizer(cfg.model))
        self.tracker = OffsetTracker()
        self.files = extra_files(cfg.model)
        self.max_len = engine.max_length
        self.producer = Producer(cfg, "trainer")
        self.metrics = Metrics(self.producer, self.layout, cfg.run, "trainer-0")
        self.stopping = False
        self.last_record: float | None = None  # None until the group assigns us partitions
        self.step_started = time.monotonic()
        self.idle_s = 0.0
        self.stale_in_step = 0
        self.next_tick = 0.0

    # -- the loop ---------------------------------------------------------------------------
    def run(self) -> TrainResult:

        create_topics(
            self.cfg,
            [s for s in self.layout.specs() if not self.layout.is_task_topic(s.name)],
        )
        self._recover()
        # static membership: a restarted trainer takes its predecessor's place at once instead
        # of waiting for the group to notice the dead member; a second trainer in the same
        # group fences the first rather than splitting the partitions (and the groups) with it
        gid = self.cfg.consumer_group
        consumer = make_consumer(self.cfg, gid, "trainer", **{"group.instance.id": f"{gid}-rank0"})
        self.consumer = consumer
        # how far we have read, for the generators' backlog bound (committed offsets trail
        # behind every unfinished trajectory and every checkpoint interval)
        self.sharer = make_consumer(self.cfg, position_group(gid), "trainer-position")
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            consumer.subscribe([self.layout.trajectories], on_assign=self._on_assign)
            while not self._done():
                t0 = time.monotonic()
                msgs = consumer.next_batch(500, 0.2)
                now = time.monotonic()
                self.idle_s += now - t0
                for msg in msgs:
                    if msg.error():
                        log.warning("consumer: %s", msg.error())
                        continue
                    chunk = self._decode(msg)
                    if chunk is None:
                        continue
                    traj = self._assemble(chunk, msg)
                    if traj is None:
                        continue
                    group = self.groups.add(self._score(traj))
                    if group is not None:
                        self._plan(group)
                    if self._stop_now():
                        break
                if msgs:
                    self.last_record = time.monotonic()  # idle counts from the end of the work
                if now >= self.next_tick:
                    self._tick(now)
            self._shutdown()
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            with contextlib.suppress(KafkaException):
                share_positions(self.sharer, consumer, asynchronous=False)
            self.sharer.close()
            consumer.close()
        counts: dict[str, int] = {}
        for outcome, _ in self.ledger.values():
            counts[outcome] = counts.get(outcome, 0) + 1
        return TrainResult(self.step, self.version, counts)

    def _on_assign(self, _consumer: Any, partitions: list[Any]) -> None:
        # a restarted trainer waits for the group to drop its dead predecessor: idle time
        # counts from the assignment, not from the start
        self.last_record = time.monotonic()
        log.info("assigned %d partitions", len(partitions))

    def _on_signal(self, signum: int, _frame: Any) -> None:
        log.info("signal %d: stopping after a final checkpoint", signum)
        self.stopping = True

    def _stop_now(self) -> bool:
        return self.stopping or bool(self.cfg.max_steps and self.step >= self.cfg.max_steps)

    def _done(self) -> bool:
        if self._stop_now():
            return True
        idle = (
            self.cfg.idle_exit_s
            and self.last_record is not None
            and time.monotonic() - self.last_record >= self.cfg.idle_exit_s
        )
        return bool(idle)

    # -- records → samples ------------------------------------------------------------------
    def _dead_letter(self, msg: Any, reason: str) -> None:
        origin = f"{msg.topic()}/{msg.partition()}@{msg.offset()}"
        dead_letter(
            self.producer, self.layout, msg.value(), msg.key(), reason, origin, self.metrics
        )

    def _decode(self, msg: Any) -> TrajectoryChunk | None:
        try:
            return decode_as(msg.value() or b"", TrajectoryChunk)
        except SchemaError as e:
            self._dead_letter(msg, f"undecodable: {e}")
            self.tracker.seen(msg.topic(), msg.partition(), msg.offset(), None)
            return None

    def _assemble(self, chunk: TrajectoryChunk, msg: Any) -> Trajectory | None:
        tid = chunk.trajectory_id
        durable = tid in self.ledger and tid not in self.undurable
        self.tracker.seen(msg.topic(), msg.partition(), msg.offset(), None if durable else tid)
        try:
            traj = self.assembler.add(chunk)
        except BadChunk as e:
            self._dead_letter(msg, f"bad chunk {tid}/{chunk.seq}: {e}")
            return None
        except BadTrajectory as e:
            self._invalid(msg, chunk, str(e))
            return None
        if traj is not None and traj.length > self.max_len:
            self._invalid(
                msg, chunk, f"trajectory {tid}: {traj.length} tokens > the model's {self.max_len}"
            )
            return None
        return traj

    def _invalid(self, msg: Any, chunk: TrajectoryChunk, reason: str) -> None:
        """A trajectory that can never train: dead-lettered, and its slot in the group filled
        so the rest of the group (and its step) is not held until expiry."""
        self._dead_letter(msg, reason)
        self._finalize(chunk.trajectory_id, chunk.prompt_id, chunk.bucket, "invalid", reason=reason)
        group = self.groups.add_missing(
            chunk.prompt_id,
            chunk.sample_index,
            chunk.group_size,
            chunk.trajectory_id,
            step=(chunk.step, chunk.step_groups),
        )
        if group is not None:
            self._plan(group)

    def _score(self, traj: Trajectory) -> Sample:
        scored = self.scorer.score(traj)
        if scored.error is not None:
            self.metrics.incr("reward_failures")
            log.warning("reward failed for %s: %s", traj.trajectory_id, scored.error)
        return Sample(traj, scored.reward, scored.error)

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
            for s in [*group.scored(), *group.failed()]:
                self._finalize_sample(
                    s,
                    "expired",
                    self.step + 1,
                    self._sample_values(s),
                    f"group incomplete for {self.cfg.expire_s:g}s",
                )
            return
        adm = gate_group(
            group, self.version, self.cfg.max_staleness, self.cfg.stale_policy, self.cfg.advantage
        )
        self.stale_in_step += len(adm.stale)
        if not adm.trains:  # nothing of it will train: finalize the whole group now
            self._finalize_group(adm, self.step + 1)
            return
        for rows in self.batcher.add(adm):
            self._run(rows)

    def _run(self, rows: list[Row]) -> None:
        mb = make_micro_batch(rows, self.cfg.loss_agg == "seq_mean")
        if self.dist is None or self.dist.assign(mb):
            self.engine.backward(mb)

    def _take_step(self) -> None:
        for rows in self.batcher.drain():
            self._run(rows)
        b = self.batcher
        normalizer = float(b.rows if self.cfg.loss_agg == "seq_mean" else b.loss_tokens)
        if b.groups:
            if self.dist is not None:
                self.dist.step(self.step + 1, normalizer)
            stats = self.engine.step(normalizer)
        else:  # nothing of the step trains (all lost or failed): same weights, next version
            log.warning(
                "step %d: no group to train (%d released groups missing); publishing "
                "the same weights so the run moves on",
                self.step + 1,
                self.planner.missing,
            )
            stats = StepStats()
        if self.planner.missing:
            self.metrics.incr("missing_groups", self.planner.missing)
        self.step += 1
        self.dirty = True
        samples = [s for adm in b.groups for s in adm.train]
        for adm in b.groups:
            self._finalize_group(adm, self.step)
        rewards = [float(s.reward) for s in samples if s.reward is not None]
        stale = [staleness(self.version, s.traj.behaviour_version) for s in samples]
        now = time.monotonic()
        step_time = max(now - self.step_started, 1e-9)
        values = {
            "loss": stats.loss,
            "reward_mean": statistics.fmean(rewards) if rewards else 0.0,
            "reward_std": statistics.pstdev(rewards) if rewards else 0.0,
            "samples": len(samples),
            "groups": len(b.groups),
            "tokens": b.loss_tokens,
            "tokens_per_s": b.loss_tokens / step_time,
            "step_time_s": step_time,
            "idle_s": min(self.idle_s, step_time),
            "compute_s": stats.compute_s,
            "compute_tokens_per_s": b.loss_tokens / stats.compute_s if stats.compute_s else 0.0,
            "staleness_mean": statistics.fmean(stale) if stale else 0.0,
            "staleness_max": max(stale, default=0),
            "dropped_stale": self.stale_in_step,
            "kl": stats.kl,
            "ratio_mean": stats.ratio_mean,
            "ratio_max": stats.ratio_max,
            "truncated_frac": stats.truncated_frac,
            "grad_norm": stats.grad_norm,
            "padded_tokens": stats.padded_tokens,
        }
        if self.step % self.cfg.publish_every == 0:
            self._publish()
        values["policy_version"] = self.version
        self.metrics.emit("train_step", values, step=self.step)
        log.info(
            "step %d v%d loss %.4f reward %.3f samples %d tokens/s %.0f idle %.2fs",
            self.step,
            self.version,
            stats.loss,
            values["reward_mean"],
            len(samples),
            values["tokens_per_s"],
            values["idle_s"],
        )
        if self.step % self.cfg.checkpoint_every == 0:
            self._checkpoint()
        self.metrics.flush_counters(self.step)
        self.batcher.reset()
        self.step_started, self.idle_s, self.stale_in_step = time.monotonic(), 0.0, 0

    # -- outcomes ---------------------------------------------------------------------------------
    def _finalize(
        self,
        tid: str,
        prompt_id: str,
        bucket: str,
        outcome: str,
        step: int | None = None,
        values: dict[str, float] | None = None,
        reason: str | None = None,
    ) -> None:
        step = self.step + 1 if step is None else step
        self.ledger[tid] = [outcome, step]
        self.undurable.add(tid)
        labels = {
            "trajectory_id": tid,
            "prompt_id": prompt_id,
            "bucket": bucket,
            "outcome": outcome,
        }
        if reason:
            labels["reason"] = reason[:300]
        self.window.append({"labels": labels, "values": values or {}, "step": step})
        self.metrics.incr(f"samples_{outcome}")

    def _sample_values(self, s: Sample, advantage: float | None = None) -> dict[str, float]:
        t = s.traj
        v: dict[str, float] = {
            "staleness": staleness(self.version, t.behaviour_version),
            "behaviour_version": t.behaviour_version,
            "policy_version": self.version,
            "tokens": t.n_tokens,
            "ready_latency_ms": t.assembled_ms - t.last_created_ms,
            "chunks": len(t.versions),
            "workers": len(t.workers),
        }
        if s.reward is not None:
            v["reward"] = s.reward
        if advantage is not None:
            v["advantage"] = advantage
        return v

    def _finalize_group(self, adm: Admitted, step: int) -> None:
        for s, a in zip(adm.train, adm.advantages, strict=True):
            self._finalize_sample(s, "trained", step, self._sample_values(s, a))
        for s in adm.stale:
            self._finalize_sample(s, "dropped_stale", step, self._sample_values(s))
        for s in adm.group.failed():
            self._finalize_sample(s, "failed_reward", step, self._sample_values(s), s.error)

    def _finalize_sample(
        self,
        s: Sample,
        outcome: str,
        step: int,
        values: dict[str, float],
        reason: str | None = None,
    ) -> None:
        t = s.traj
        self._finalize(t.trajectory_id, t.prompt_id, t.bucket, outcome, step, values, reason)

    def _expire_partial(self, p: Partial) -> None:
        versions = [c.policy_version for c in p.chunks.values()]
        values: dict[str, float] = {
            "tokens": sum(c.n_tokens for c in p.chunks.values()),
            "policy_version": self.version,
            "behaviour_version": min(versions, default=self.version),
        }
        values["staleness"] = self.version - values["behaviour_version"]
        self._finalize(
            p.trajectory_id,
            p.prompt_id,
            p.bucket,
            "expired",
            values=values,
            reason=f"no chunk for {self.cfg.expire_s:g}s; have seqs {sorted(p.chunks)}",
        )
        group = self.groups.add_missing(
            p.prompt_id, p.sample_index, p.group_size, p.trajectory_id, step=p.step
        )
        if group is not None:
            self._plan(group)

    def _tick(self, now: float) -> None:
        self.next_tick = now + 1.0
        try:
            share_positions(self.sharer, self.consumer)
        except KafkaException as e:  # a monitoring signal: the next tick tries again
            log.debug("sharing positions: %s", e)
        for p in self.assembler.expire():
            self._expire_partial(p)
        for g in self.groups.expire():
            self._plan(g)
        self._steps()  # a step whose groups stopped arriving completes by expiry
        self.metrics.incr(
            "duplicates", self.assembler.duplicates - self.metrics.counters["duplicates"]
        )
        if (
            self.undurable
            and self.last_record is not None
            and now - self.last_record >= IDLE_CHECKPOINT_S
        ):
            # decisions no step will follow soon (e.g. stale drops): make them durable and
            # commit, or generators bounded by the trainer's backlog would wait on us forever
            self._checkpoint()
        self.producer.poll(0)

    # -- durability -------------------------------------------------------------------------------
    def _publish(self) -> None:

        t0 = time.perf_counter()
        version = self.version + 1
        pub = publish(
            self.store,
            self.cfg.run,
            version,
            self.engine.tensors(),
            trainer_step=self.step,
            parent_version=self.lineage,
            extra_files=self.files,
        )
        announce(self.producer, self.layout, pub)
        self.version = self.lineage = version
        self.metrics.emit(
            "weights_published",
            {
                "version": version,
                "bytes": pub.manifest.total_bytes,
                "publish_s": time.perf_counter() - t0,
            },
            step=self.step,
        )

    def _optimizer_state(self) -> dict[str, Any]:
        if self.dist is not None:
            self.dist.gather_state()  # ZeRO's partitions live on every rank
        return self.engine.optimizer_state()

    def _checkpoint(self) -> None:
        t0 = time.perf_counter()
        self.ckpt_number += 1
        ckpts.save(
            self.store,
            self.cfg.run,
            self.ckpt_number,
            step=self.step,
            version=self.version,
            ledger=self.ledger,
            events=self.window,
            model=self.engine.tensors(),
            optimizer=self._optimizer_state(),
            extra={"lineage": self.lineage},
        )
        ckpts.prune(self.store, self.cfg.run, self.cfg.keep_checkpoints)
        self._emit_samples(self.window)
        self.producer.flush()
        self.tracker.release(self.undurable)
        offsets = self.tracker.committable()
        if offsets:
            tps = [TopicPartition(t, p, o) for (t, p), o in offsets.items()]
            try:
                commit_sync(self.consumer, tps)
                self.tracker.mark_committed(offsets)
            except KafkaException as e:  # the ledger covers it: records are re-read, deduped
                log.warning(
                    "offset commit failed (records will be re-read and deduplicated): %s", e
                )
        self.window, self.undurable, self.dirty = [], set(), False
        self.metrics.incr("checkpoints")
        log.info(
            "checkpoint %d at step %d (%.2fs)",
            self.ckpt_number,
            self.step,
            time.perf_counter() - t0,
        )

    def _emit_samples(self, events: list[dict[str, Any]]) -> None:
        for e in events:
            self.metrics.emit("sample", e["values"], e["labels"], step=e["step"])

    def _recover(self) -> None:
        """After a restart: re-send the last window's events; re-announce the newest version."""

        if self.replay_events:
            self._emit_samples(self.replay_events)
            self.producer.flush()
        if self.version > 0:
            import hashlib

            key = f"{version_prefix(self.cfg.run, self.version)}/{MANIFEST}"
            body = self.store.get(key)
            pub = Published(
                Manifest.from_json(body, key), self.store.uri(key), hashlib.sha256(body).hexdigest()
            )
            announce(self.producer, self.layout, pub)
        log.info(
            "trainer at step %d, policy version %d, %d trajectories in the ledger",
            self.step,
            self.version,
            len(self.ledger),
        )

    def _shutdown(self) -> None:
        if self.batcher.groups:
            log.info(
                "leaving a partial step of %d groups; its records are read again on restart",
                len(self.batcher.groups),
            )
        self.engine.discard()
        if self.dist is not None:
            self.dist.discard()
        if self.dirty or self.undurable:
            self._checkpoint()
        self.metrics.flush_counters(self.step)
        self.producer.flush()
        if self.dist is not None:
            self.dist.stop()
