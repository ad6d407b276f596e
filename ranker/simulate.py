"""Simulated generation makespan: random dispatch + FIFO vs ranker dispatch + LPT vs oracle.

SIMULATED: time comes from the per-token-latency model ``PTL(BS)`` (``srl.workload``,
the same model the ``sim`` engine paces itself with), not from running a model. Prefill and
network time are not modelled. Everything here is labelled simulated where it is reported.

Model of one generator instance (continuous batching, ``srl.workload.instance_makespan``): it holds
a queue of samples and runs up to ``cap`` of them at once; each decode step advances every
running sample by one token and takes ``PTL(running)`` ms; a finished sample's slot is
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

Called by ``srl ranker simulate`` and the tests.
"""

from __future__ import annotations

from dataclasses import dataclass

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


def compare(
    true_pool: np.ndarray, pred_pool: np.ndarray | None, s: SimSettings
) -> dict[str, object]:
    """Makespans of random + FIFO, ranker dispatch + LPT and oracle dispatch + LPT.

    ``true_pool``/``pred_pool`` are paired true lengths (already on the workload's scale) and
    ranker predictions; each iteration draws ``batch`` pairs with replacement, and the true
    lengths of a separate draw stand in for the previous iteration's history. Ratios are per
    iteration against random + FIFO on the same batch, then averaged. Without ``pred_pool``
    only the oracle and the bound are reported.
    """
    rng = np.random.default_rng(s.seed)
    n = len(true_pool)
    base: list[float] = []
    rank: list[float] = []
    orac: list[float] = []
    bound: list[float] = []
    r_ratio: list[float] = []
    o_ratio: list[float] = []
    b_ratio: list[float] = []
    plans: dict[str, int] = {}
    mig_ratio: list[float] = []
    migrations: list[float] = []
    for _ in range(s.iterations):
        idx = rng.integers(0, n, s.batch)
        history = true_pool[rng.integers(0, n, s.batch)]
        true = true_pool[idx]
        b = random_fifo(true, s.instances, s.b_max, s.ptl, rng).makespan_s
        o = skew_aware(
            true,
            true.astype(np.float64),
            history,
            s.instances,
            s.b_max,
            s.ptl,
            s.alpha,
            allow_shared=s.allow_shared,
        )
        r = o
        if pred_pool is not None:
            pred = pred_pool[idx].astype(np.float64)
            r = skew_aware(
                true,
                pred,
                history,
                s.instances,
                s.b_max,
                s.ptl,
                s.alpha,
                allow_shared=s.allow_shared,
            )
            if s.migrate_factor is not None and r.plan is not None:
                policy = MigrationPolicy(factor=s.migrate_factor)
                m_s, n_mig = skew_aware_migrating(true, pred, r.plan, s.alpha, s.ptl, policy)
                mig_ratio.append(m_s / b)
                migrations.append(n_mig)
        lb = lower_bound(true, s.instances, s.b_max, s.ptl)
        for acc, v in ((base, b), (rank, r.makespan_s), (orac, o.makespan_s), (bound, lb)):
            acc.append(v)
        for acc, v in ((r_ratio, r.makespan_s), (o_ratio, o.makespan_s), (b_ratio, lb)):
            acc.append(v / b)
        assert r.plan is not None
        p = r.plan
        key = f"{p.longtail_instances}x{p.longtail_batch}+{p.regular_instances}x{p.regular_batch}"
        plans[key] = plans.get(key, 0) + 1
    report: dict[str, object] = {
        "simulated": True,
        "settings": {
            "instances": s.instances,
            "b_max": s.b_max,
            "batch": s.batch,
            "alpha": s.alpha,
            "iterations": s.iterations,
            "seed": s.seed,
            "rounds": s.rounds(),
            "allow_shared_pool": s.allow_shared,
            "ptl_ms": s.ptl.describe(),
        },
        "makespan_s": {
            "random_fifo": _stats(base),
            "ranker_lpt": _stats(rank),
            "oracle_lpt": _stats(orac),
            "lower_bound": _stats(bound),
        },
        "ratio_vs_random_fifo": {
            "ranker_lpt": _stats(r_ratio),
            "oracle_lpt": _stats(o_ratio),
            "lower_bound": _stats(b_ratio),
        },
        "ranker_plans": plans,  # "{longtail instances}x{batch}+{regular instances}x{batch}": count
    }
    if mig_ratio:
        report["ratio_vs_random_fifo"]["ranker_lpt_migrate"] = _stats(mig_ratio)  # type: ignore[index]
        report["migrations_per_iteration"] = _stats(migrations)
        report["settings"]["migrate_factor"] = s.migrate_factor  # type: ignore[index]
    if pred_pool is None:  # no ranker: the "ranker" runs above were the oracle's
        for key in ("makespan_s", "ratio_vs_random_fifo"):
            del report[key]["ranker_lpt"]  # type: ignore[attr-defined]
        report["oracle_plans"] = report.pop("ranker_plans")
    return report
