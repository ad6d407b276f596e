"""The trainer's outcome bookkeeping: what became of each trajectory, and what it reports.

Owns, for ``consumers.trainer``:

* the dedupe ledger (:class:`Ledger`): trajectory id → ``[outcome, step]`` for every trajectory
  with an outcome; saved with each checkpoint and restored after a restart, so the assembler
  drops every chunk of a trajectory already decided (exactly once in effect);
* finalisation (:class:`Outcomes`): each sample gets one of the outcomes ``trained``,
  ``dropped_stale``, ``no_signal`` (a served group whose advantages are all 0, not run:
  ``consumers.gate``), ``failed_reward``, ``expired``, ``invalid``, with its step (the step that
  trained its group; for the others the step the trainer passes, its open step), as a ledger
  entry and a ``sample`` event (labels: trajectory_id, prompt_id, bucket, outcome and a reason
  cut to 300 characters; values: :func:`sample_values`, :func:`partial_values`);
* the window: the sample events and the trajectory ids decided since the last checkpoint. An
  id in ``undurable`` is not durable yet, so its records stay held (``consumers.offsets``);
  the checkpoint saves the ledger and the window's events, and ``checkpointed`` empties both;
* the values of the ``train_step`` event (:func:`step_values`).

What must hold: every decision writes the ledger, appends one event to the window and puts
its id in ``undurable``, in the order decided; values use the policy version the trainer
passes (its version at the moment of the decision, before a publish in the same step); a
group is finalized whole: its trained, stale and failed samples at one step.

Pure: no Kafka, no torch, no store. The trainer calls it and does the I/O (emits the events,
counts ``samples_{outcome}``, writes checkpoints, commits offsets); the intake notes where
each trajectory's records lie (:meth:`Ledger.seen`) and prunes the ledger after each commit.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from consumers.assembler import Partial
from consumers.gate import Admitted, staleness
from consumers.groups import Group, Sample
from consumers.train_engine import StepStats

Event = dict[str, Any]  # a sample event: {"labels": {...}, "values": {...}, "step": int}
REASON_CHARS = 300  # a reason label is cut to this many characters
# a decision is remembered for at least this many steps, whatever the committed offsets say
REMEMBER_STEPS = 16


class Ledger:
    """Trajectory id → ``[outcome, step, {partition: last offset}]``: every trajectory with an
    outcome whose records may still be read again.

    A ``Container`` of trajectory ids for the assembler's dedupe; ``entries`` is what a
    checkpoint saves (JSON: lists, not tuples; partitions as strings). Each entry keeps the
    last offset of its trajectory's records on each partition of the trajectories topic
    (:meth:`seen`, also for duplicates that arrive after the decision), so :meth:`prune` can
    drop the entries a restart can no longer meet: all their records lie below the committed
    offsets, from which a restart re-reads. ``floor`` is the committed offsets of the last
    prune (saved with the checkpoint): records below it are finished and never needed again.
    Entries of old checkpoints, saved without offsets, are kept.

    An entry also stays for ``REMEMBER_STEPS`` steps after its decision, committed offsets or
    not: a copy of a trajectory can come *after* the commit, at a new offset, when the broker
    forgot records it had acknowledged (the embedded broker after a SIGKILL, docs/broker.md)
    and a task went out or was read again: the same task id gives the same trajectory ids
    (``producers.dispatcher.task_id_for``, ``producers.recovery.trajectory_id_for``), and such a
    copy is published within seconds of the roles' restart, while the trainer is at most a few
    steps on (k + 1 steps of tasks are out at a time). Without this, a pruned id's copy would
    train again (``srl chaos``'s broker-restart: 32 samples trained twice). The ledger holds at
    most ``REMEMBER_STEPS`` steps of trajectories plus what is in flight, so a checkpoint's size
    stays bounded.
    """

    def __init__(
        self,
        entries: Mapping[str, Sequence[Any]] | None = None,
        floor: Mapping[str, int] | None = None,
        totals: Mapping[str, int] | None = None,
    ) -> None:
        self.entries: dict[str, list[Any]] = {t: list(e) for t, e in (entries or {}).items()}
        self.floor: dict[str, int] = dict(floor or {})
        # outcomes of the whole run, pruned entries included (an old checkpoint: its entries)
        self.totals: dict[str, int] = dict(totals) if totals is not None else self._count()
        self._where: dict[str, dict[str, int]] = {}  # undecided trajectories' last offsets

    @classmethod
    def restore(cls, entries: Mapping[str, Sequence[Any]], extra: Mapping[str, Any]) -> Ledger:
        """The ledger a checkpoint saved: its entries and :meth:`saved_extra`."""
        return cls(entries, extra.get("ledger_floor"), extra.get("outcome_totals"))

    def saved_extra(self) -> dict[str, Any]:
        """What a checkpoint saves besides the entries: the floor and the run's totals."""
        return {"ledger_floor": dict(self.floor), "outcome_totals": dict(self.totals)}

    def __contains__(self, tid: object) -> bool:
        return tid in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def seen(self, tid: str, partition: int, offset: int) -> None:
        """A record of ``tid`` at ``offset`` of ``partition`` (decided or not)."""
        entry = self.entries.get(tid)
        if entry is None:
            where = self._where.setdefault(tid, {})
        elif len(entry) > 2:
            where = entry[2]
        else:  # restored from an old checkpoint: it stays, so no offsets are noted
            return
        p = str(partition)
        where[p] = max(where.get(p, offset), offset)

    def record(self, tid: str, outcome: str, step: int) -> None:
        if (old := self.entries.get(tid)) is not None:
            self.totals[old[0]] -= 1
        self.entries[tid] = [outcome, step, self._where.pop(tid, {})]
        self.totals[outcome] = self.totals.get(outcome, 0) + 1

    def prune(self, committed: Mapping[int, int], step: int) -> int:
        """Drop every entry whose records all lie below ``committed`` (partition → committed
        offset) and that was decided before the last ``REMEMBER_STEPS`` steps (``step``: the
        trainer's); returns how many were dropped."""
        self.floor.update({str(p): off for p, off in committed.items()})
        floor, before = self.floor, step - REMEMBER_STEPS + 1
        gone = [
            tid
            for tid, e in self.entries.items()
            if len(e) > 2
            and e[1] < before
            and all(off < floor.get(p, -1) for p, off in e[2].items())
        ]
        for tid in gone:
            del self.entries[tid]
        return len(gone)

    def counts(self) -> dict[str, int]:
        """How many trajectories of the run have each outcome (pruned entries included)."""
        return {k: n for k, n in self.totals.items() if n}

    def _count(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for outcome, *_ in self.entries.values():
            out[outcome] = out.get(outcome, 0) + 1
        return out


def sample_event(
    tid: str,
    prompt_id: str,
    bucket: str,
    outcome: str,
    step: int,
    values: dict[str, float] | None = None,
    reason: str | None = None,
) -> Event:
    labels = {"trajectory_id": tid, "prompt_id": prompt_id, "bucket": bucket, "outcome": outcome}
    if reason:
        labels["reason"] = reason[:REASON_CHARS]
    return {"labels": labels, "values": values or {}, "step": step}


def sample_values(
    s: Sample,
    version: int,
    advantage: float | None = None,
    lineage: bool = True,
    skipped: frozenset[int] = frozenset(),
) -> dict[str, float]:
    """A finished sample's event values at policy version ``version``; ``lineage`` False: its
    behaviour version is another run's (no staleness); ``skipped``: versions that are no
    update of its weights (``consumers.gate.staleness``)."""
    t = s.traj
    v: dict[str, float] = {
        "behaviour_version": t.behaviour_version,
        "policy_version": version,
        "tokens": t.n_tokens,
        "ready_latency_ms": t.assembled_ms - t.last_created_ms,
        "chunks": len(t.versions),
        "workers": len(t.workers),
    }
    if lineage:
        v["staleness"] = staleness(version, t.behaviour_version, skipped)
    if s.reward is not None:
        v["reward"] = s.reward
    if advantage is not None:
        v["advantage"] = advantage
    return v


def partial_values(p: Partial, version: int) -> dict[str, float]:
    """An expired partial trajectory's event values: what arrived of it (b over its chunks)."""
    versions = [c.policy_version for c in p.chunks.values()]
    values: dict[str, float] = {
        "tokens": sum(c.n_tokens for c in p.chunks.values()),
        "policy_version": version,
        "behaviour_version": min(versions, default=version),
    }
    values["staleness"] = version - values["behaviour_version"]
    return values


class Outcomes:
    """The ledger, the window of undurable decisions and their sample events."""

    def __init__(self, ledger: Ledger, expire_s: float) -> None:
        self.ledger = ledger
        self.expire_s = expire_s  # for the reasons of expiries
        self.window: list[Event] = []  # sample events since the last checkpoint
        self.undurable: set[str] = set()  # trajectory ids decided since the last checkpoint

    def durable(self, tid: str) -> bool:
        """Whether ``tid``'s outcome is in a checkpoint (its records need not be held)."""
        return tid in self.ledger and tid not in self.undurable

    def decide(
        self,
        tid: str,
        prompt_id: str,
        bucket: str,
        outcome: str,
        step: int,
        values: dict[str, float] | None = None,
        reason: str | None = None,
    ) -> Event:
        """Record one trajectory's outcome; its sample event (also in the window)."""
        self.ledger.record(tid, outcome, step)
        self.undurable.add(tid)
        event = sample_event(tid, prompt_id, bucket, outcome, step, values, reason)
        self.window.append(event)
        return event

    def _sample(
        self,
        s: Sample,
        outcome: str,
        step: int,
        values: dict[str, float],
        reason: str | None = None,
    ) -> Event:
        t = s.traj
        return self.decide(t.trajectory_id, t.prompt_id, t.bucket, outcome, step, values, reason)

    def gated(self, adm: Admitted, step: int, version: int) -> list[Event]:
        """A gated group, whole: trained (with advantages), dropped as stale, without a learning
        signal, failed rewards."""
        out = [
            self._sample(s, "trained", step, sample_values(s, version, a, adm.lineage, adm.skipped))
            for s, a in zip(adm.train, adm.advantages, strict=True)
        ]
        out += [
            self._sample(
                s, "dropped_stale", step, sample_values(s, version, None, True, adm.skipped)
            )
            for s in adm.stale
        ]
        out += [
            self._sample(
                s,
                "no_signal",
                step,
                sample_values(s, version, 0.0, adm.lineage, adm.skipped),
                "served group with no learning signal: every advantage 0, not run",
            )
            for s in adm.flat
        ]
        out += [
            self._sample(
                s,
                "failed_reward",
                step,
                sample_values(s, version, None, adm.lineage, adm.skipped),
                s.error,
            )
            for s in adm.group.failed()
        ]
        return out

    def expired_group(self, group: Group, step: int, version: int) -> list[Event]:
        """A group that expired before all its samples arrived: none of it trains."""
        reason = f"group incomplete for {self.expire_s:g}s"
        return [
            self._sample(s, "expired", step, sample_values(s, version), reason)
            for s in [*group.scored(), *group.failed()]
        ]

    def expired_partial(self, p: Partial, step: int, version: int) -> Event:
        """A trajectory with no new chunk for ``expire_s``: expired with what arrived of it."""
        reason = f"no chunk for {self.expire_s:g}s; have seqs {sorted(p.chunks)}"
        values = partial_values(p, version)
        return self.decide(p.trajectory_id, p.prompt_id, p.bucket, "expired", step, values, reason)

    def invalid(self, tid: str, prompt_id: str, bucket: str, step: int, reason: str) -> Event:
        """A trajectory that can never train (inconsistent chunks, longer than the model)."""
        return self.decide(tid, prompt_id, bucket, "invalid", step, reason=reason)

    def checkpointed(self) -> None:
        """The ledger and the window's events are in a checkpoint: every decision is durable."""
        self.window, self.undurable = [], set()

    def counts(self) -> dict[str, int]:
        return self.ledger.counts()


def step_values(
    groups: list[Admitted],
    tokens: int,
    stats: StepStats,
    version: int,
    elapsed_s: float,
    idle_s: float,
    dropped_stale: int,
) -> dict[str, float]:
    """The ``train_step`` event's values (without ``policy_version``, known after a publish).

    ``groups``: the step's groups that train; ``tokens``: its loss tokens; ``version``: the
    policy version it trained from; ``elapsed_s``: since the previous step; ``idle_s``: of
    that, waiting for records; ``dropped_stale``: samples the gate dropped since then.
    """
    trained = [s for adm in groups for s in adm.train]
    rewards = [float(s.reward) for s in trained if s.reward is not None]
    own = [(adm, s) for adm in groups if adm.lineage for s in adm.train]  # own versions only
    stale = [staleness(adm.version, s.traj.behaviour_version, adm.skipped) for adm, s in own]
    step_time = max(elapsed_s, 1e-9)
    return {
        "loss": stats.loss,
        "reward_mean": statistics.fmean(rewards) if rewards else 0.0,
        "reward_std": statistics.pstdev(rewards) if rewards else 0.0,
        "samples": len(trained),
        "groups": len(groups),
        "tokens": tokens,
        "tokens_per_s": tokens / step_time,
        "step_time_s": step_time,
        "idle_s": min(idle_s, step_time),
        "compute_s": stats.compute_s,
        "compute_tokens_per_s": tokens / stats.compute_s if stats.compute_s else 0.0,
        "staleness_mean": statistics.fmean(stale) if stale else 0.0,
        "staleness_max": max(stale, default=0),
        "dropped_stale": dropped_stale,
        "kl": stats.kl,
        "ratio_mean": stats.ratio_mean,
        "ratio_max": stats.ratio_max,
        "truncated_frac": stats.truncated_frac,
        "grad_norm": stats.grad_norm,
        "padded_tokens": stats.padded_tokens,
    }
