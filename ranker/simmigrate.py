"""SIMULATED pools with long-tail migration: every instance on one clock, stragglers move.

Extends ``ranker.simulate`` (same continuous-batching model, same ``PTL(BS)``) to instances
that interact: a regular-pool sample that has generated more than its migration threshold
(``ranker.migrate.MigrationPolicy``) leaves its instance, freeing the slot, and joins the
front of the queue of the long-tail instance with the fewest samples, where it resumes with
its remaining tokens. The resume's prefill is not modelled (prefill is not modelled anywhere
in this simulator), so migration's figures are an optimistic bound on its benefit.

Events are processed in global time order: each instance advances between its own events
(a sample finishing or crossing its threshold) at ``PTL(running)`` per token, and is brought
to the current time before a migrant joins it. With migration off this reproduces
``srl.workload.instance_makespan`` of every instance exactly (a tested invariant).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

import numpy as np

from ranker.migrate import MigrationPolicy
from ranker.schedule import PoolPlan, balance, split_longtail
from srl.workload import PtlModel


@dataclass
class _Instance:
    cap: int
    longtail: bool
    queue: list[int]  # sample ids, next to admit last (a stack: pop() from the end)
    t_ms: float = 0.0
    step: float = 0.0
    events: list[tuple[float, int, int]] = field(default_factory=list)  # (step, kind, sample)
    running: set[int] = field(default_factory=set)
    done_ms: float = 0.0


FINISH, MIGRATE = 0, 1


@dataclass
class MigrationSim:
    true: np.ndarray
    pred: np.ndarray
    ptl: PtlModel
    policy: MigrationPolicy
    migrations: int = 0
    migrated_tokens: int = 0
    remaining: dict[int, int] = field(default_factory=dict)
    instances: list[_Instance] = field(default_factory=list)

    def add_instance(self, samples: list[int], cap: int, longtail: bool) -> None:
        """``samples`` in admission order (longest-predicted first for LPT)."""
        for s in samples:
            self.remaining[s] = int(self.true[s])
        self.instances.append(_Instance(max(1, cap), longtail, list(reversed(samples))))

    def _admit(self, inst: _Instance) -> None:
        while inst.queue and len(inst.running) < inst.cap:
            s = inst.queue.pop()
            inst.running.add(s)
            rem = self.remaining[s]
            heapq.heappush(inst.events, (inst.step + rem, FINISH, s))
            thr = None if inst.longtail else self.policy.threshold(int(self.pred[s]))
            done = int(self.true[s]) - rem  # tokens already generated before this admission
            if thr is not None and done < thr < int(self.true[s]):
                heapq.heappush(inst.events, (inst.step + thr - done, MIGRATE, s))

    def _next_time(self, inst: _Instance) -> float:
        while inst.events and inst.events[0][2] not in inst.running:
            heapq.heappop(inst.events)  # stale: the sample finished or left
        if not inst.events:
            return math.inf
        return inst.t_ms + (inst.events[0][0] - inst.step) * self.ptl(len(inst.running))

    def _advance(self, inst: _Instance, t_ms: float) -> None:
        if inst.running and t_ms > inst.t_ms:
            inst.step += (t_ms - inst.t_ms) / self.ptl(len(inst.running))
        inst.t_ms = max(inst.t_ms, t_ms)

    def run(self) -> float:
        """Makespan in seconds."""
        for inst in self.instances:
            self._admit(inst)
        longtail = [i for i in self.instances if i.longtail]
        while True:
            times = [self._next_time(i) for i in self.instances]
            k = int(np.argmin(times))
            if times[k] == math.inf:
                break
            inst = self.instances[k]
            step, kind, s = heapq.heappop(inst.events)
            inst.t_ms, inst.step = times[k], step
            inst.running.discard(s)
            if kind == FINISH:
                inst.done_ms = inst.t_ms
            else:
                thr = self.policy.threshold(int(self.pred[s]))
                assert thr is not None  # MIGRATE events exist only for thresholded samples
                self.remaining[s] = int(self.true[s]) - thr
                self.migrations += 1
                self.migrated_tokens += self.remaining[s]
                dest = min(longtail, key=lambda i: len(i.running) + len(i.queue))
                self._advance(dest, inst.t_ms)
                dest.queue.append(s)  # front of its queue
                self._admit(dest)
            self._admit(inst)
        return max(i.done_ms for i in self.instances) / 1000.0


def skew_aware_migrating(
    true: np.ndarray,
    pred: np.ndarray,
    plan: PoolPlan,
    alpha: float,
    ptl: PtlModel,
    policy: MigrationPolicy,
) -> tuple[float, int]:
    """(makespan s, migrations) of ranker dispatch + LPT under ``plan``, with migration.

    Without a long-tail pool there is nowhere to migrate to, and nothing moves.
    """
    lt = split_longtail(pred, alpha)
    sim = MigrationSim(true, pred, ptl, policy)
    pools = [
        (np.flatnonzero(lt), plan.longtail_instances, plan.longtail_batch, True),
        (np.flatnonzero(~lt), plan.regular_instances, plan.regular_batch, False),
    ]
    if plan.longtail_instances == 0:
        pools = [(np.arange(len(true)), plan.regular_instances, plan.regular_batch, False)]
        sim.policy = MigrationPolicy(enabled=False)
    for idx, n_inst, cap, is_lt in pools:
        if len(idx):
            for members in balance(pred[idx], n_inst):
                sim.add_instance([int(i) for i in idx[members]], cap, is_lt)
    return sim.run(), sim.migrations
