"""Feedback → rewards of served trajectories: the trainer's join of ``{prefix}.feedback`` to the
trajectories ``srl serve`` published, by trajectory id, within a window.

A served trajectory (seq-0 metadata ``source = "serve"``) takes its reward from the
application's feedback instead of the ``--reward`` function. What must hold:

* **the join**: a served trajectory and the feedback with its trajectory id meet in whichever
  order the trainer reads them; the first feedback record for a trajectory is its reward;
* **the window**: a trajectory waits at most ``feedback_window_s`` for its feedback, and
  feedback at most as long for its trajectory, counted from when the trainer read it and only
  while the trainer is caught up with the log (a trainer catching up reads records long after
  they were written, the two topics at different speeds); whatever the lag, nothing waits
  longer than ``expire_s``;
* **missing feedback**: a served trajectory whose window passed without feedback is decided
  ``no_feedback``, dead-lettered to ``{prefix}.dlq`` with the reason (counter
  ``samples_no_feedback``) and fills its slot in its group, so the other choices of the
  request still train; with ``feedback_missing = "reward"`` it is scored by ``--reward``
  instead;
* **late, unmatched, duplicate feedback**: feedback for a trajectory decided without it (or
  that could never train) is *late*: dead-lettered, counter ``feedback_late``; feedback whose
  trajectory never came within the window is *unmatched*: dead-lettered, counter
  ``feedback_unmatched``; a second feedback for a trajectory (an application that rated twice,
  or records read again after a restart) is counted as ``feedback_duplicates``; an
  undecodable record is dead-lettered like any other;
* **offsets**: a feedback record is held (``consumers.offsets``, this module's own tracker,
  committed by the trainer with its checkpoints) by the trajectory it rewards until that
  trajectory's outcome is durable, so a restart re-reads the feedback of every trajectory it
  re-reads; records that reward nothing hold nothing.

After a restart the join starts empty: the ledger tells a duplicate (its trajectory has an
outcome) from late feedback (outcome ``no_feedback``, ``expired`` or ``invalid``); a
trajectory scored by ``--reward`` for want of feedback before the restart is not told from
one its feedback rewarded, so late feedback for it counts as a duplicate.

:class:`FeedbackJoin` is the pure join; :class:`FeedbackPath` does its I/O for
``consumers.trainer`` (with ``feedback_window_s`` > 0 the trainer's consumer reads both topics
and hands this module the feedback records; with 0 it reads no feedback and scores served
trajectories by ``--reward`` like any other).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from consumers.assembler import Trajectory
from consumers.config import TrainConfig
from consumers.groups import Group, GroupBuffer, Sample
from consumers.offsets import OffsetTracker
from consumers.outcomes import Outcomes, sample_values
from schemas.codec import SchemaError
from schemas.records import Feedback, decode_as, encode
from srl.kafka import Consumer, Producer
from srl.metrics import Metrics, dead_letter

log = logging.getLogger("srl.trainer")

NO_FEEDBACK = "no_feedback"  # the outcome of a served trajectory whose feedback never came
UNUSABLE = (NO_FEEDBACK, "expired", "invalid")  # outcomes feedback comes too late for
CAUGHT_UP_RECORDS = 1000  # the trainer is caught up while this few records are unread

Verdict = Literal["joined", "early", "duplicate", "late"]


def served(traj: Trajectory) -> bool:
    return traj.served


@dataclass
class Waiting:
    item: Any  # a Trajectory waiting for feedback, or a Feedback waiting for its trajectory
    since: float  # when the trainer read it (monotonic seconds)


class FeedbackJoin:
    """Served trajectories and feedback by trajectory id, until they meet or their window ends.

    Pure; ``ledger`` maps decided trajectory ids to ``[outcome, step, …]`` (the trainer's)."""

    def __init__(self, window_s: float, expire_s: float, ledger: Any) -> None:
        self.window_s, self.expire_s, self.ledger = window_s, expire_s, ledger
        self.trajectories: dict[str, Waiting] = {}  # waiting for their feedback
        self.early: dict[str, Waiting] = {}  # feedback waiting for its trajectory
        self.joined: set[str] = set()  # rewarded by feedback, not yet in the ledger
        self.without: dict[str, float] = {}  # decided without feedback by this process

    def trajectory(self, traj: Trajectory, now: float) -> float | None:
        """The reward of ``traj`` if its feedback is here; None: it waits."""
        tid = traj.trajectory_id
        fb = self.early.pop(tid, None)
        if fb is None:
            self.trajectories[tid] = Waiting(traj, now)
            return None
        self.joined.add(tid)
        return float(fb.item.reward)

    def feedback(self, fb: Feedback, now: float) -> tuple[Verdict, Trajectory | None]:
        """What ``fb`` is: ``joined`` (with the trajectory it rewards), ``early`` (held),
        ``duplicate`` or ``late``."""
        tid = fb.trajectory_id
        if tid in self.joined or tid in self.early:
            return "duplicate", None
        waiting = self.trajectories.pop(tid, None)
        if waiting is not None:
            self.joined.add(tid)
            return "joined", waiting.item
        entry = self.ledger.entries.get(tid)
        if tid in self.without or (entry is not None and entry[0] in UNUSABLE):
            return "late", None
        if entry is not None:
            return "duplicate", None
        self.early[tid] = Waiting(fb, now)
        return "early", None

    def expire(self, now: float, caught_up: bool) -> tuple[list[Trajectory], list[Feedback]]:
        """Trajectories whose feedback did not come, feedback whose trajectory did not."""

        def due(w: Waiting) -> bool:
            age = now - w.since
            return age >= self.expire_s or (caught_up and age >= self.window_s)

        trajs = [tid for tid, w in self.trajectories.items() if due(w)]
        fbs = [tid for tid, w in self.early.items() if due(w)]
        self.without |= dict.fromkeys(trajs, now)
        self.joined = {t for t in self.joined if t not in self.ledger}
        self.without = {t: at for t, at in self.without.items() if now - at < self.expire_s}
        return (
            [self.trajectories.pop(t).item for t in trajs],
            [self.early.pop(t).item for t in fbs],
        )


class FeedbackPath:
    """The trainer's side of feedback: the join, the feedback records' offsets, what becomes of
    missing, late and unmatched feedback. ``score`` queues a trajectory for the ``--reward``
    function (its group completes when the reward comes back: ``consumers.rewardpool``);
    ``at`` gives the trainer's open step and policy version for decisions."""

    def __init__(
        self,
        cfg: TrainConfig,
        producer: Producer,
        metrics: Metrics,
        outcomes: Outcomes,
        groups: GroupBuffer,
        score: Callable[[Trajectory], None],
        at: Callable[[], tuple[int, int]],
    ) -> None:
        self.enabled = cfg.feedback_window_s > 0
        self.topic = metrics.layout.feedback
        self.missing: str = cfg.feedback_missing
        self.join = FeedbackJoin(cfg.feedback_window_s, cfg.expire_s, outcomes.ledger)
        self.producer, self.metrics, self.outcomes, self.groups = (
            producer,
            metrics,
            outcomes,
            groups,
        )
        self.score, self.at = score, at
        self.tracker = OffsetTracker()

    def waits_for(self, traj: Trajectory) -> bool:
        """Whether ``traj``'s reward comes from feedback."""
        return self.enabled and served(traj)

    def sample(self, traj: Trajectory, now: float) -> Sample | None:
        """``traj`` rewarded by its feedback, or None while it waits for it."""
        reward = self.join.trajectory(traj, now)
        return None if reward is None else Sample(traj, reward)

    def add(self, msg: Any, now: float) -> Sample | None:
        """A record of the feedback topic: the served trajectory it rewards, if waiting."""
        if msg.error():
            log.warning("consumer: %s", msg.error())
            return None
        try:
            fb = decode_as(msg.value() or b"", Feedback)
        except SchemaError as e:
            self._seen(msg, None)
            self._dead_letter(msg.value(), msg.key(), f"undecodable: {e}", _origin(msg))
            return None
        verdict, traj = self.join.feedback(fb, now)
        if verdict in ("joined", "early"):
            self._seen(msg, fb.trajectory_id)
        else:
            self._seen(msg, None)
            self._refuse(fb, verdict, _origin(msg))
        return None if traj is None else Sample(traj, fb.reward)

    def expire(self, now: float, consumer: Consumer) -> list[Group]:
        """Decide what waited out its window; the groups that completes."""
        if not (self.join.trajectories or self.join.early):
            return []
        trajs, fbs = self.join.expire(now, behind(consumer) <= CAUGHT_UP_RECORDS)
        for fb in fbs:
            reason = f"no served trajectory {fb.trajectory_id} within the feedback window"
            self._dead_letter(encode(fb), fb.trajectory_id, reason, self.topic)
            self.metrics.incr("feedback_unmatched")
            self.tracker.release({fb.trajectory_id})
        out = [self._without_feedback(t) for t in trajs]
        return [g for g in out if g is not None]

    def _without_feedback(self, traj: Trajectory) -> Group | None:
        if self.missing == "reward":
            self.metrics.incr("feedback_missing_scored")
            self.score(traj)
            return None
        step, version = self.at()
        window = f"{self.join.window_s:g}s"
        reason = f"no feedback for served trajectory {traj.trajectory_id} within {window}"
        t = traj
        values = sample_values(Sample(t, None), version)
        self.outcomes.decide(
            t.trajectory_id, t.prompt_id, t.bucket, NO_FEEDBACK, step, values, reason
        )
        self.metrics.incr(f"samples_{NO_FEEDBACK}")
        value = orjson.dumps(
            {
                "trajectory_id": t.trajectory_id,
                "completion_id": t.prompt_id,
                "choice_index": t.sample_index,
            }
        )
        self._dead_letter(value, t.trajectory_id, reason, "trainer-feedback-join")
        step_of = (t.step, t.step_groups)
        return self.groups.add_missing(
            t.prompt_id, t.sample_index, t.group_size, t.trajectory_id, step=step_of, served=True
        )

    def _refuse(self, fb: Feedback, verdict: Verdict, origin: str) -> None:
        if verdict == "duplicate":
            self.metrics.incr("feedback_duplicates")
            return
        entry = self.join.ledger.entries.get(fb.trajectory_id)
        how = entry[0] if entry is not None else "scored by --reward"
        reason = f"late feedback: served trajectory {fb.trajectory_id} already decided ({how})"
        self._dead_letter(encode(fb), fb.trajectory_id, reason, origin)
        self.metrics.incr("feedback_late")

    def _seen(self, msg: Any, holder: str | None) -> None:
        self.tracker.seen(msg.topic(), msg.partition(), msg.offset(), holder)

    def _dead_letter(self, value: bytes | None, key: Any, reason: str, origin: str) -> None:
        dead_letter(self.producer, self.metrics.layout, value, key, reason, origin, self.metrics)


def _origin(msg: Any) -> str:
    return f"{msg.topic()}/{msg.partition()}@{msg.offset()}"


def behind(consumer: Consumer) -> int:
    """Records the consumer has not read yet on its assigned partitions, from the watermarks
    its fetches brought back (no request); partitions not fetched yet count as caught up."""
    parts = consumer.assignment()
    total = 0
    for tp in consumer.position(parts):
        _low, high = consumer.get_watermark_offsets(tp, cached=True)
        if tp.offset >= 0 and high >= 0:
            total += max(0, high - tp.offset)
    return total
