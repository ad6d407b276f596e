"""The pipeline benchmark's time model: modes, splits, and the bound each mode is held to.

Pure (numpy only). All times are SIMULATED seconds from WORKLOAD.md's models: generation from
``srl.workload`` (a decode step of ``BS`` running sequences lasts ``PTL(BS)`` ms, continuous
batching per instance, the same model the sim engine paces itself with); training costs
``F·P / (peak·MFU)`` seconds per completion token on one device.

The modes (WORKLOAD.md, "Fair comparison"):

* ``colocated`` (verl-like): every device generates the step's samples, then every device
  trains on them; the split is all devices for each phase in turn;
* ``sync``: disaggregated (n generator instances + D-n trainer devices), a barrier per step
  (k = 0), random dispatch, FIFO, the trainer waits for the whole batch;
* ``stream`` (StreamRL-Sync): the same barrier, longest-predicted-first order, micro-batches
  train as groups complete;
* ``async`` / ``async+skew`` (StreamRL-Async at k = 1): step t's prompts are released once
  step t-1-k is announced, so generation runs k steps ahead; random dispatch / LPT.

:func:`model_iteration` is a mode's modelled iteration; :func:`best_split` picks each mode's
split by it. :func:`run_bound` is what no schedule of the generated workload could beat on a
split, from the first decode step to the end of the last step (docs/benchmarks.md gives the
formulas); a measured
fraction of it above 1.0 would mean the bound or the accounting is wrong.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from app.bench.modes import BARRIER, DESIGNS, LPT_MODES, MODES, RANDOM_DISPATCH
from srl.workload import PTL, finish_times, longest_s, throughput_s

__all__ = ["BARRIER", "DESIGNS", "LPT_MODES", "MODES", "RANDOM_DISPATCH"]


@dataclass(frozen=True)
class Workload:
    """One benchmark setting (simulated seconds unless named ``_wall``)."""

    lengths: str
    scale: float = 0.25
    devices: int = 6  # generator instances + trainer devices, the same for every mode
    b_max: int = 16  # KV-capped decode batch of an instance
    groups_per_step: int = 12
    group_size: int = 8
    iterations: int = 12  # optimizer steps per mode (the first is warm-up, not measured)
    params: float = 7e9  # the modelled policy (WORKLOAD.md: 7B)
    flops_per_token: float = 9.0  # F per parameter (GRPO)
    peak_flops: float = 989e12  # H800 bf16 dense
    mfu: float = 0.3
    compression: float = 20.0  # simulated seconds per wall second
    tokens_per_step: int = 16  # sim engine tokens per decode step
    chunk_tokens: int = 256
    max_staleness: int = 1  # k of the async modes (1: StreamRL-Async)
    design: str = "paced"  # how the async modes keep staleness (app.bench.pipeline.DESIGNS)
    tasks_per_group: int = 1  # the dispatcher's tasks_per_group (a group's samples over workers)
    seed: int = 0
    # weight sync of a real-size version (app.bench.synccost), simulated seconds per version
    model_bytes: float = 0.0
    sync_publish_s: float = 0.0  # the trainer's upload, in the background
    sync_fetch_s: float = 0.0  # a generator's fetch and sha256 verification, off the decode loop
    sync_verify_s: float = 0.0
    sync_load_s: float = 0.0  # the swap: decoding stops

    @property
    def batch(self) -> int:
        return self.groups_per_step * self.group_size

    @property
    def train_s_per_token(self) -> float:
        """Simulated training seconds per completion token on one device."""
        return self.flops_per_token * self.params / (self.peak_flops * self.mfu)

    def k(self, mode: str) -> int:
        return 0 if mode in BARRIER else self.max_staleness

    def sync(self, mode: str) -> dict[str, float]:
        """The weight sync ``mode`` is charged per version (``colocated``: the load only; its
        weights never leave the devices that trained them)."""
        s = {
            "publish": self.sync_publish_s,
            "fetch": self.sync_fetch_s,
            "verify": self.sync_verify_s,
            "load": self.sync_load_s,
        }
        return {p: (v if p == "load" else 0.0) for p, v in s.items()} if mode == "colocated" else s

    def sync_chain_s(self, mode: str) -> float:
        """A version's step end to its first token: publish + fetch + verify + load."""
        return sum(self.sync(mode).values())


# -- modelled iterations ------------------------------------------------------------------------
def group_finish(w: Workload, group_lengths: np.ndarray, instances: int, lpt: bool) -> np.ndarray:
    """When each group of one barrier step is complete: groups dealt to instances by key
    (random), each instance admitting its share FIFO or longest first."""
    deal = np.random.default_rng(w.seed).permutation(len(group_lengths))
    done = np.zeros(len(group_lengths))
    for i in range(instances):
        mine = deal[i::instances]
        if lpt:
            mine = mine[np.argsort(-group_lengths[mine], kind="stable")]
        samples = np.repeat(group_lengths[mine], w.group_size)
        per_sample = finish_times(samples, w.b_max).reshape(len(mine), w.group_size)
        done[mine] = per_sample.max(axis=1)
    return done


def model_iteration(
    w: Workload, mode: str, group_lengths: np.ndarray, instances: int, devices: int
) -> dict[str, float]:
    """Modelled seconds of one iteration of ``mode`` on ``instances`` + ``devices``.

    Barrier modes: generation is the step's makespan, tail included; ``sync`` and
    ``colocated`` then train, ``stream`` trains each group as it completes (when the trainer
    is free). Async modes run in steady state (the next steps' prompts fill the tail), every
    instance at ``B_max``, but no faster than the longest sample allows: it must finish within
    the ``k + 1`` steps between its release and its step.
    """
    per_group = group_lengths * w.group_size * w.train_s_per_token / devices
    train_s = float(per_group.sum())
    sync, chain = w.sync(mode), w.sync_chain_s(mode)
    if mode not in BARRIER:
        steady = throughput_s(float(group_lengths.sum()) * w.group_size, instances, w.b_max)
        longest = float(group_lengths.max()) * PTL(w.b_max) / 1000.0
        # the release window holds the version's sync and the longest sample; each instance
        # pauses for one load a step; uploads and fetches run one at a time
        window = (longest + chain) / (1 + w.k(mode))
        gen_s = max(steady + sync["load"], window)
        serial = max(sync["publish"], sync["fetch"] + sync["verify"] + sync["load"])
        it = max(gen_s, train_s, serial)
        return {"gen_s": gen_s, "train_s": train_s, "iteration_s": it, "sync_s": chain}
    done = group_finish(w, group_lengths, instances, lpt=mode in LPT_MODES)
    gen_s = float(done.max())
    if mode != "stream":
        it = chain + gen_s + train_s
        return {"gen_s": gen_s, "train_s": train_s, "iteration_s": it, "sync_s": chain}
    t = 0.0
    for j in np.argsort(done, kind="stable"):
        t = max(t, done[j]) + per_group[j]
    return {"gen_s": gen_s, "train_s": train_s, "iteration_s": chain + float(t), "sync_s": chain}


def best_split(w: Workload, mode: str, batches: list[np.ndarray]) -> dict[str, Any]:
    """The (instances, trainer devices) split minimising ``mode``'s modelled iteration time,
    averaged over ``batches`` (per-group lengths of sampled steps: one step's longest sample
    varies a lot). ``colocated`` has one split: every device, for each phase in turn."""
    options = (
        [(w.devices, w.devices)]
        if mode == "colocated"
        else [(n, w.devices - n) for n in range(1, w.devices)]
    )
    best: dict[str, Any] | None = None
    for n, g in options:
        ms = [model_iteration(w, mode, b, n, g) for b in batches]
        mean = {k: float(np.mean([m[k] for m in ms])) for k in ("iteration_s", "gen_s", "train_s")}
        if best is None or mean["iteration_s"] < best["model_iteration_s"]:
            best = {
                "instances": n,
                "trainer_devices": g,
                "model_iteration_s": round(mean["iteration_s"], 2),
                "model_gen_s": round(mean["gen_s"], 2),
                "model_train_s": round(mean["train_s"], 2),
                "model_sync_s": round(w.sync_chain_s(mode), 2),
            }
    assert best is not None
    return best


# -- the bound of a measured span -------------------------------------------------------------
@dataclass(frozen=True)
class StepWork:
    """What one trainer step of a run generated and trained (completion tokens)."""

    step: int
    lengths: Sequence[int]  # every sample finalized in the step (trained or not)
    trained_tokens: int
    # per group (prompt) of the step: its longest sample and the tokens of it that trained
    groups: Sequence[tuple[int, int]] = ()


def run_bound(
    w: Workload, mode: str, split: dict[str, Any], work: list[StepWork], paced: bool = True
) -> dict[str, Any]:
    """Simulated seconds, from the first decode step to the end of the last step, that no
    schedule of the generated workload could beat on ``split`` (docs/benchmarks.md).

    With ``T_0 = 0`` (the first decode) and, for step j of the run, ``G_j`` its samples'
    tokens at the split's best generation rate, ``L_j`` its longest sample alone and ``R_j``
    its training time: step j's prompts are released at ``T_{j-1-k}`` (k = 0 for the barrier
    modes; ``T_i = 0`` for ``i <= 0``), its micro-batches run after step j-1 ends, so

    * ``colocated``, ``sync``: ``T_j >= T_{j-1} + max(G_j, L_j) + R_j`` (train after generating);
    * the others: ``T_j >= max(T_{j-1} + R_j, T_{j-1-k} + L_j + r_j,
      max_{m<=j} T_{m-1-k} + G_m + … + G_j)`` (steps m..j cannot start before step m's
      release and must all be generated by ``T_j``; a group trains only once its last sample
      is in, its advantages need every reward, so ``L_j + r_j`` is the most, over the step's
      groups, of its longest sample alone and then its trained tokens on the ``g`` devices);
      unpaced designs release no steps, so only ``T_N >= max(Σ R, Σ G)`` holds for them.

    With a real-size version (``Workload.sync``), version i can generate no earlier than
    ``T_i + S`` (``S``: publish + fetch + verify + load; version 0 is loaded at the start), so
    each ``T_{i}`` that releases generation above reads ``T_i + S`` for ``i >= 1``.

    Every term is a true lower bound, so measured time below ``T_N`` would be a bug.
    """
    n, g = split["instances"], split["trainer_devices"]
    G = [throughput_s(sum(x.lengths), n, w.b_max) for x in work]
    R = [x.trained_tokens * w.train_s_per_token / g for x in work]
    # the step's last group to train: its longest sample alone, then its tokens trained
    L = [
        max(
            [longest_s(x.lengths)]
            + [longest_s([most]) + t * w.train_s_per_token / g for most, t in x.groups]
        )
        for x in work
    ]
    if mode not in BARRIER and not paced:
        return {"bound_s": max(sum(R), sum(G)), "steps_s": []}
    k, S = w.k(mode), w.sync_chain_s(mode)
    T: list[float] = []

    def at(i: int) -> float:  # T_i, 0 before the run
        return T[i - 1] if i >= 1 else 0.0

    def go(i: int) -> float:  # when version i can generate: T_i + its sync (v0 is loaded)
        return T[i - 1] + S if i >= 1 else 0.0

    for j in range(1, len(work) + 1):
        g_j, l_j, r_j = G[j - 1], L[j - 1], R[j - 1]
        if mode in ("colocated", "sync"):  # every group trains after the step's generation
            T.append(go(j - 1) + max(g_j, longest_s(work[j - 1].lengths)) + r_j)
            continue
        gen = max(go(m - 1 - k) + sum(G[m - 1 : j]) for m in range(1, j + 1))
        T.append(max(at(j - 1) + r_j, go(j - 1 - k) + l_j, gen))
    return {"bound_s": T[-1] if T else 0.0, "steps_s": [round(t, 2) for t in T]}
