"""Simulated generation makespan: random dispatch + FIFO vs ranker dispatch + LPT vs oracle.

SIMULATED: time comes from the per-token-latency model ``PTL(BS)`` (``srl.workload``,
the same model the ``sim`` engine paces itself with), not from running a model. Prefill and
network time are not modelled. Everything here is labelled simulated where it is reported.

Model of one generator instance (continuous batching, ``srl.workload.instance_makespan``):
it holds a queue of samples and runs up to ``cap`` of them at once; each decode step advances
every running sample by one token and takes ``PTL(running)`` ms; a finished sample's slot is
refilled from the head of the queue at once. An iteration's makespan is the time its slowest
instance finishes.
Skewness matters only in the multi-round regime (an instance holds more than ``cap``).

Policies, for one batch of samples with true lengths ``L`` and predictions ``P``:

* ``random_fifo``: shuffle, deal out evenly over all ``N`` instances (cap ``B_max``), FIFO.
* ``skew_aware``: Algorithm 2 (``plan_pools``) on ``P`` with ``L_regular``/``L_longtail`` from
  the previous iteration's actual lengths; each pool's prompts balanced over its instances by
  predicted tokens; longest-predicted-first inside each instance; each pool runs at its
  planned batch cap.
* oracle: ``skew_aware`` with ``P = L``.

:func:`compare` runs the iterations (:func:`run_iteration`) and :func:`report` sums them up.
Called by ``ranker.evaluate`` (``srl ranker simulate``) and the tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ranker.migrate import MigrationPolicy
from ranker.schedule import PoolPlan, balance, history_lengths, plan_pools, split_longtail
from ranker.simmigrate import skew_aware_migrating
from srl.workload import PtlModel, instance_makespan, longest_s, throughput_s


@dataclass(frozen=True)
class SimResult:
    makespan_s: float
    plan: PoolPlan | None = None


def random_fifo(
    true: np.ndarray, instances: int, b_max: int, ptl: PtlModel, rng: np.random.Generator
) -> SimResult:
    order = rng.permutation(len(true))
    spans = [instance_makespan(true[order[i::instances]], b_max, ptl) for i in range(instances)]
    return SimResult(max(spans))


def skew_aware(
    true: np.ndarray,
    pred: np.ndarray,
    history: np.ndarray,
    instances: int,
    b_max: int,
    ptl: PtlModel,
    alpha: float = 0.2,
    q_typical: float = 0.5,
    q_tail: float = 0.9,
    allow_shared: bool = True,
    plan: PoolPlan | None = None,
) -> SimResult:
    """Ranker dispatch + LPT; ``plan`` overrides Algorithm 2's split (for split sweeps)."""
    lt = split_longtail(pred, alpha)
    if plan is None:
        lengths = history_lengths(history, alpha, q_typical, q_tail)
        n_lt = int(lt.sum())
        plan = plan_pools(n_lt, len(lt) - n_lt, instances, lengths, ptl, b_max, allow_shared)
    pools = [
        (np.flatnonzero(lt), plan.longtail_instances, plan.longtail_batch),
        (np.flatnonzero(~lt), plan.regular_instances, plan.regular_batch),
    ]
    if plan.longtail_instances == 0:  # no split: everything is regular
        pools = [(np.arange(len(true)), plan.regular_instances, plan.regular_batch)]
    spans = [0.0]
    for idx, n_inst, cap in pools:
        if len(idx) == 0:
            continue
        for members in balance(pred[idx], n_inst):
            sel = idx[members]  # balance() returns each instance's list longest-predicted-first
            spans.append(instance_makespan(true[sel], max(1, cap), ptl))
    return SimResult(max(spans), plan)


def lower_bound(true: np.ndarray, instances: int, b_max: int, ptl: PtlModel) -> float:
    """WORKLOAD.md's generation bound: max(longest·PTL(1), tokens·PTL(B_max)/(N·B_max))."""
    return max(longest_s(true, ptl), throughput_s(float(np.sum(true)), instances, b_max, ptl))


@dataclass(frozen=True)
class SimSettings:
    """One simulated regime (all times SIMULATED from ``ptl``)."""

    instances: int = 16
    b_max: int = 32
    batch: int = 2048
    alpha: float = 0.2
    iterations: int = 20
    seed: int = 0
    ptl: PtlModel = PtlModel()
    migrate_factor: float | None = 2.0  # also run ranker + LPT + migration; None: don't
    allow_shared: bool = True  # Algorithm 2 may keep one shared pool (False: always split)

    def rounds(self) -> float:
        """Samples per instance over the batch cap: above 1 is the multi-round regime."""
        return self.batch / (self.instances * self.b_max)


def _stats(values: list[float]) -> dict[str, float]:
    a = np.asarray(values)
    return {"mean": float(a.mean()), "std": float(a.std())}


@dataclass(frozen=True)
class Iteration:
    """One batch under every policy: makespans in SIMULATED seconds, and migration's
    ``(makespan, migrations)`` when it ran."""

    fifo_s: float
    ranker: SimResult
    oracle: SimResult
    bound_s: float
    migrate: tuple[float, int] | None = None


def _lpt(true: np.ndarray, pred: np.ndarray, history: np.ndarray, s: SimSettings) -> SimResult:
    return skew_aware(
        true, pred, history, s.instances, s.b_max, s.ptl, s.alpha, allow_shared=s.allow_shared
    )


def run_iteration(
    true: np.ndarray,
    pred: np.ndarray | None,
    history: np.ndarray,
    s: SimSettings,
    rng: np.random.Generator,
) -> Iteration:
    """Random + FIFO, oracle + LPT and (with ``pred``) ranker + LPT, with migration when
    ``s.migrate_factor`` is set, on one batch. Without ``pred`` the ranker run is the oracle's."""
    fifo = random_fifo(true, s.instances, s.b_max, s.ptl, rng).makespan_s
    oracle = _lpt(true, true.astype(np.float64), history, s)
    ranker, migrate = oracle, None
    if pred is not None:
        ranker = _lpt(true, pred, history, s)
        if s.migrate_factor is not None and ranker.plan is not None:
            policy = MigrationPolicy(factor=s.migrate_factor)
            migrate = skew_aware_migrating(true, pred, ranker.plan, s.alpha, s.ptl, policy)
    bound = lower_bound(true, s.instances, s.b_max, s.ptl)
    return Iteration(fifo, ranker, oracle, bound, migrate)


def plan_counts(plans: list[PoolPlan | None]) -> dict[str, int]:
    """How often each plan was chosen, keyed ``"{long-tail N}x{BS}+{regular N}x{BS}"``."""
    out: dict[str, int] = {}
    for p in plans:
        assert p is not None
        key = f"{p.longtail_instances}x{p.longtail_batch}+{p.regular_instances}x{p.regular_batch}"
        out[key] = out.get(key, 0) + 1
    return out


def _settings(s: SimSettings) -> dict[str, Any]:
    return {
        "instances": s.instances,
        "b_max": s.b_max,
        "batch": s.batch,
        "alpha": s.alpha,
        "iterations": s.iterations,
        "seed": s.seed,
        "rounds": s.rounds(),
        "allow_shared_pool": s.allow_shared,
        "ptl_ms": s.ptl.describe(),
    }


def report(its: list[Iteration], s: SimSettings, with_ranker: bool) -> dict[str, Any]:
    """The comparison's report: makespans, ratios per iteration against random + FIFO on the
    same batch (then averaged), the plans chosen; the ranker's entries only ``with_ranker``."""
    fifo = [it.fifo_s for it in its]
    runs = {
        "ranker_lpt": [it.ranker.makespan_s for it in its],
        "oracle_lpt": [it.oracle.makespan_s for it in its],
        "lower_bound": [it.bound_s for it in its],
    }
    out: dict[str, Any] = {
        "simulated": True,
        "settings": _settings(s),
        "makespan_s": {"random_fifo": _stats(fifo)} | {k: _stats(v) for k, v in runs.items()},
        "ratio_vs_random_fifo": {
            k: _stats([x / b for x, b in zip(v, fifo, strict=True)]) for k, v in runs.items()
        },
        "ranker_plans": plan_counts([it.ranker.plan for it in its]),
    }
    migrated = [(it.migrate, it.fifo_s) for it in its if it.migrate is not None]
    if migrated:
        out["ratio_vs_random_fifo"]["ranker_lpt_migrate"] = _stats([m[0] / b for m, b in migrated])
        out["migrations_per_iteration"] = _stats([m[1] for m, _ in migrated])
        out["settings"]["migrate_factor"] = s.migrate_factor
    if not with_ranker:  # no ranker: the "ranker" runs were the oracle's
        for key in ("makespan_s", "ratio_vs_random_fifo"):
            del out[key]["ranker_lpt"]
        out["oracle_plans"] = out.pop("ranker_plans")
    return out


def compare(true_pool: np.ndarray, pred_pool: np.ndarray | None, s: SimSettings) -> dict[str, Any]:
    """Makespans of random + FIFO, ranker dispatch + LPT and oracle dispatch + LPT.

    ``true_pool``/``pred_pool`` are paired true lengths (already on the workload's scale) and
    ranker predictions; each iteration draws ``batch`` pairs with replacement, and the true
    lengths of a separate draw stand in for the previous iteration's history. Ratios are per
    iteration against random + FIFO on the same batch, then averaged. Without ``pred_pool``
    only the oracle and the bound are reported.
    """
    rng = np.random.default_rng(s.seed)
    n = len(true_pool)
    its = []
    for _ in range(s.iterations):
        idx = rng.integers(0, n, s.batch)
        history = true_pool[rng.integers(0, n, s.batch)]
        pred = None if pred_pool is None else pred_pool[idx].astype(np.float64)
        its.append(run_iteration(true_pool[idx], pred, history, s, rng))
    return report(its, s, with_ranker=pred_pool is not None)
