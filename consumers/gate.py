"""The staleness gate, exactly as DESIGN.md defines it, and the group's advantages.

Owns which samples of a complete group may train the update ``v → v+1``:

* ``v`` is the trainer's current policy version (versions it has published), ``b`` a
  trajectory's behaviour version (the oldest version that produced any of its tokens);
* a sample may train only if ``v − b ≤ k`` (``max_staleness``); under ``--sync-barrier`` k = 0;
* ``stale_policy = "drop"``: a group with any stale sample is dropped whole, so every trained
  group is complete and its advantages come from one policy's samples;
  ``"correct"``: only the stale samples are dropped; the others train, their advantages
  computed against the rewards of every scored sample of the group (a reward is a function
  of the text, so older samples still estimate the baseline), with the loss's importance
  correction;
* samples whose reward failed never train and never enter the baseline.

A trainer that is not the lead (``lead_run``: the generators and ``srl serve`` follow another
run) gates with ``k = None``: its samples' versions number the lead's lineage, not its own, so
``v − b`` measures nothing and no bound applies; every scored sample trains, with the loss's
importance correction against the chunks' behaviour log-probs (docs/trainer.md, "Several
trainers on one stream").

``v − b`` counts the updates between ``b`` and the weights being trained. After a restart from
a checkpoint older than the newest published version, the versions published after that
checkpoint (``skipped``) exist but are no update of the weights trained from then on: they
are not counted (``staleness``), so the samples in flight are judged by the updates they
really lag; samples of an orphan version count from its depth (``staleness``). Pure; called
by the trainer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from consumers.groups import Group, Sample
from consumers.losses import advantages


def staleness(v: int, b: int, skipped: frozenset[int] = frozenset()) -> int:
    """Updates from behaviour version ``b`` to the trained weights ``v``; versions in
    ``skipped`` are no update of these weights.

    An orphan ``b`` (itself skipped) is as many updates past the checkpointed version ``L``
    its run of skipped versions descends from as its place in that run: the dispatcher
    released its step for that depth, so it is judged as its sibling of the same depth on the
    new lineage (a run of adjacent skipped versions is taken as one chain from ``L``)."""
    if b in skipped:
        start = b
        while start - 1 in skipped:
            start -= 1
        parent = start - 1
        return staleness(v, parent, skipped) - (b - parent)
    return v - b - sum(1 for o in skipped if b < o <= v)


def admissible(v: int, b: int, k: int | None, skipped: frozenset[int] = frozenset()) -> bool:
    """Whether the update ``v → v+1`` may use a sample of behaviour version ``b``; ``k`` None:
    ``b`` is another lineage's version, no bound."""
    return k is None or staleness(v, b, skipped) <= k


@dataclass
class Admitted:
    """The outcome of gating one group at policy version ``v``."""

    group: Group
    version: int
    train: list[Sample] = field(default_factory=list)
    advantages: list[float] = field(default_factory=list)  # aligned with ``train``
    stale: list[Sample] = field(default_factory=list)
    lineage: bool = True  # False: the samples' versions are another run's (no staleness)
    skipped: frozenset[int] = frozenset()  # versions that are no update of these weights

    @property
    def trains(self) -> bool:
        return bool(self.train)


def group_advantages(kind: Literal["grpo", "rloo"], rewards: list[float]) -> list[float]:
    import torch

    return advantages(kind, torch.tensor(rewards, dtype=torch.float64)).tolist()


def gate_group(
    group: Group,
    v: int,
    k: int | None,
    policy: Literal["drop", "correct"] = "drop",
    advantage: Literal["grpo", "rloo"] = "grpo",
    skipped: frozenset[int] = frozenset(),
) -> Admitted:
    """Split a complete group's scored samples into trained (with advantages) and stale."""
    scored = group.scored()
    out = Admitted(group, v, lineage=k is not None, skipped=skipped)
    fresh = [admissible(v, s.traj.behaviour_version, k, skipped) for s in scored]
    if policy == "drop" and not all(fresh):
        out.stale = scored
        return out
    if not scored:
        return out
    adv = group_advantages(advantage, [s.reward for s in scored])  # type: ignore[misc]
    for s, a, ok in zip(scored, adv, fresh, strict=True):
        if ok:
            out.train.append(s)
            out.advantages.append(a)
        else:
            out.stale.append(s)
    return out
