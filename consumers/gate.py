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
* samples whose reward failed never train and never enter the baseline;
* a served group whose admitted samples all have advantage 0 (a group of one, or choices
  rated alike) is not run when the loss has no KL term (``skip_flat``): its gradient is zero,
  so its samples are decided ``no_signal`` instead of costing a forward and backward pass
  (DAPO's dynamic sampling filters such groups the same way).

Served samples (``srl serve``'s, ``Trajectory.served``) have their own bound ``served_k``
(``serve_max_staleness``; None: ``k``), separate from DESIGN.md's ``k``. Dispatched work keeps
``v − b ≤ k`` by admission (the dispatcher releases a step's prompts only when they cannot
outlive ``k``); served requests are never refused or held for training's sake, so no
admission paces them, and a version count tight enough for admitted work would throw most of
them away. They train off-policy instead, each token's weight bounded by the loss's importance
correction against the behaviour log-probs the server recorded (the truncated ratio
``min(pi/mu, C)``, or PPO's clip), and
``v − b ≤ served_k`` is the backstop that keeps a sample from a long-gone policy out.

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


def bound(s: Sample, k: int | None, served_k: int | None) -> int | None:
    """The bound that applies to ``s``: ``served_k`` for a served sample (None: ``k``), ``k``
    for dispatched work; no bound at all when ``k`` is None (another lineage)."""
    if k is None or served_k is None or not s.traj.served:
        return k
    return served_k


# an advantage this small is rounding, not signal: GRPO divides a difference of 1e-17 (equal
# rewards that are not exact binary fractions, e.g. 0.1) by std + 1e-6
SIGNAL_EPS = 1e-9


@dataclass
class Admitted:
    """The outcome of gating one group at policy version ``v``."""

    group: Group
    version: int
    train: list[Sample] = field(default_factory=list)
    advantages: list[float] = field(default_factory=list)  # aligned with ``train``
    stale: list[Sample] = field(default_factory=list)
    flat: list[Sample] = field(default_factory=list)  # served, every advantage 0: not run
    lineage: bool = True  # False: the samples' versions are another run's (no staleness)
    skipped: frozenset[int] = frozenset()  # versions that are no update of these weights

    @property
    def trains(self) -> bool:
        return bool(self.train)

    @property
    def signal(self) -> bool:
        """Whether it trains with a learning signal: some advantage is not zero (a group of one,
        or one whose choices were all rated alike, moves nothing but a KL term)."""
        return any(abs(a) > SIGNAL_EPS for a in self.advantages)


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
    served_k: int | None = None,
    skip_flat: bool = False,
) -> Admitted:
    """Split a complete group's scored samples into trained (with advantages) and stale;
    served samples are judged by ``served_k`` (see the module docstring). ``skip_flat`` (no KL
    term: a zero advantage is a zero gradient): a served group whose admitted samples all have
    advantage 0 is not run at all; its samples are ``flat`` (outcome ``no_signal``)."""
    scored = group.scored()
    out = Admitted(group, v, lineage=k is not None, skipped=skipped)
    fresh = [
        admissible(v, s.traj.behaviour_version, bound(s, k, served_k), skipped) for s in scored
    ]
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
    if skip_flat and group.served and out.train and not out.signal:
        out.flat, out.train, out.advantages = out.train, [], []
    return out
