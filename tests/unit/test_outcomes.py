"""The trainer's outcome bookkeeping (``consumers.outcomes``), against exact ledgers, events
and counts: finalisation of groups, expiries, invalid trajectories, the window of undurable
decisions, and the values of the ``sample`` and ``train_step`` events."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from consumers.assembler import Partial, Trajectory
from consumers.gate import Admitted
from consumers.groups import Group, Sample
from consumers.outcomes import (
    Ledger,
    Outcomes,
    partial_values,
    sample_event,
    sample_values,
    step_values,
)
from consumers.train_engine import StepStats
from tests.chunks import traj_chunks


def traj(
    index: int,
    n_tokens: int = 3,
    versions: tuple[int, ...] = (2,),
    prompt_id: str = "p",
    workers: tuple[str, ...] = ("w0",),
) -> Trajectory:
    return Trajectory(
        trajectory_id=f"{prompt_id}-t{index}",
        prompt_id=prompt_id,
        task_id="task",
        sample_index=index,
        group_size=4,
        bucket="le256",
        prompt_tokens=np.array([1, 2], np.int32),
        tokens=np.arange(n_tokens, dtype=np.int32),
        logprobs=np.full(n_tokens, -1.0, np.float32),
        versions=versions,
        finish_reason="stop",
        metadata={},
        workers=workers,
        started_ms=1_000,
        last_created_ms=1_900,
        assembled_ms=2_000,
    )


def sample(index: int, reward: float | None, error: str | None = None, **kw: Any) -> Sample:
    return Sample(traj(index, **kw), reward, error)


def group(*samples: Sample, missing: dict[int, str] | None = None) -> Group:
    return Group("p", 4, {s.traj.sample_index: s for s in samples}, dict(missing or {}))


def event(
    tid: str, outcome: str, step: int, values: dict[str, float], reason: str | None = None
) -> dict[str, Any]:
    labels = {"trajectory_id": tid, "prompt_id": "p", "bucket": "le256", "outcome": outcome}
    if reason is not None:
        labels["reason"] = reason
    return {"labels": labels, "values": values, "step": step}


# -- values -----------------------------------------------------------------------------------
BASE = {"tokens": 3, "ready_latency_ms": 100, "chunks": 1, "workers": 1}


@pytest.mark.parametrize(
    ("s", "version", "advantage", "expected"),
    [
        (
            sample(0, 1.0),
            3,
            0.5,
            {
                "staleness": 1,
                "behaviour_version": 2,
                "policy_version": 3,
                **BASE,
                "reward": 1.0,
                "advantage": 0.5,
            },
        ),
        (  # no reward (failed), no advantage (not trained)
            sample(0, None, "boom"),
            3,
            None,
            {"staleness": 1, "behaviour_version": 2, "policy_version": 3, **BASE},
        ),
        (  # b = the oldest chunk's version; chunks and distinct workers counted
            sample(0, 0.0, versions=(4, 2, 5), workers=("w0", "w1")),
            5,
            None,
            {
                "staleness": 3,
                "behaviour_version": 2,
                "policy_version": 5,
                **BASE,
                "chunks": 3,
                "workers": 2,
                "reward": 0.0,
            },
        ),
        (  # another lineage's samples: negative staleness
            sample(0, 1.0, versions=(7,)),
            2,
            -1.0,
            {
                "staleness": -5,
                "behaviour_version": 7,
                "policy_version": 2,
                **BASE,
                "reward": 1.0,
                "advantage": -1.0,
            },
        ),
    ],
)
def test_sample_values(
    s: Sample, version: int, advantage: float | None, expected: dict[str, float]
) -> None:
    assert sample_values(s, version, advantage) == expected


def partial(versions: list[int], seqs: list[int]) -> Partial:
    completion = list(range(2 * len(versions)))
    chunks = traj_chunks("p", 1, 4, [1], completion, chunk_tokens=2, versions=versions)
    return Partial("p-t1", "p", 1, 4, "le256", {s: chunks[s] for s in seqs})


@pytest.mark.parametrize(
    ("p", "version", "expected"),
    [
        (
            partial([3, 1, 2], [0, 2]),
            4,
            {"tokens": 4, "policy_version": 4, "behaviour_version": 2, "staleness": 2},
        ),
        (
            partial([3], [0]),
            3,
            {"tokens": 2, "policy_version": 3, "behaviour_version": 3, "staleness": 0},
        ),
        (  # nothing arrived but the expiry: b is the trainer's own version
            Partial("p-t1", "p", 1, 4, "le256"),
            5,
            {"tokens": 0, "policy_version": 5, "behaviour_version": 5, "staleness": 0},
        ),
    ],
)
def test_partial_values(p: Partial, version: int, expected: dict[str, float]) -> None:
    assert partial_values(p, version) == expected


@pytest.mark.parametrize(
    ("reason", "labels_reason"),
    [(None, None), ("", None), ("short", "short"), ("x" * 301, "x" * 300)],
)
def test_sample_event_labels_and_reason_cut_to_300_characters(
    reason: str | None, labels_reason: str | None
) -> None:
    got = sample_event("t", "p", "le256", "expired", 4, None, reason)
    assert got == event("t", "expired", 4, {}, labels_reason)


# -- finalisation -----------------------------------------------------------------------------
def test_a_gated_group_is_finalized_whole_trained_then_stale_then_failed() -> None:
    trained = [sample(0, 1.0), sample(2, 0.0)]
    stale = sample(1, 1.0, versions=(0,))
    failed = sample(3, None, "reward raised ValueError")
    adm = Admitted(group(trained[0], stale, trained[1], failed), 3, trained, [0.5, -0.5], [stale])
    out = Outcomes(Ledger(), expire_s=30)
    events = out.gated(adm, step=7, version=3)
    v = {"staleness": 1, "behaviour_version": 2, "policy_version": 3, **BASE}
    assert events == [
        event("p-t0", "trained", 7, {**v, "reward": 1.0, "advantage": 0.5}),
        event("p-t2", "trained", 7, {**v, "reward": 0.0, "advantage": -0.5}),
        event(
            "p-t1",
            "dropped_stale",
            7,
            {**v, "staleness": 3, "behaviour_version": 0, "reward": 1.0},
        ),
        event("p-t3", "failed_reward", 7, v, "reward raised ValueError"),
    ]
    assert out.window == events
    assert out.ledger.entries == {
        "p-t0": ["trained", 7, {}],
        "p-t2": ["trained", 7, {}],
        "p-t1": ["dropped_stale", 7, {}],
        "p-t3": ["failed_reward", 7, {}],
    }
    assert out.undurable == {"p-t0", "p-t1", "p-t2", "p-t3"}
    assert out.counts() == {"trained": 2, "dropped_stale": 1, "failed_reward": 1}


def test_an_expired_group_reports_its_scored_then_its_failed_samples_as_expired() -> None:
    g = group(sample(2, None, "boom"), sample(1, 1.0), missing={0: "p-t0"})
    out = Outcomes(Ledger(), expire_s=30)
    events = out.expired_group(g, step=4, version=2)
    v = {"staleness": 0, "behaviour_version": 2, "policy_version": 2, **BASE}
    why = "group incomplete for 30s"
    assert events == [
        event("p-t1", "expired", 4, {**v, "reward": 1.0}, why),
        event("p-t2", "expired", 4, v, why),
    ]
    assert out.ledger.entries == {"p-t1": ["expired", 4, {}], "p-t2": ["expired", 4, {}]}


def test_an_expired_partial_trajectory_and_an_invalid_one() -> None:
    out = Outcomes(Ledger({"old": ["trained", 1]}), expire_s=2.5)
    got = out.expired_partial(partial([3, 1, 2], [0, 2]), step=5, version=4)
    values = {"tokens": 4, "policy_version": 4, "behaviour_version": 2, "staleness": 2}
    assert got == event("p-t1", "expired", 5, values, "no chunk for 2.5s; have seqs [0, 2]")
    bad = out.invalid("p-t9", "p", "le256", 5, "trajectory p-t9: 99 tokens > the model's 64")
    assert bad == event("p-t9", "invalid", 5, {}, "trajectory p-t9: 99 tokens > the model's 64")
    assert out.window == [got, bad]
    assert out.ledger.entries == {
        "old": ["trained", 1],  # a checkpoint of before issue 18: no offsets
        "p-t1": ["expired", 5, {}],
        "p-t9": ["invalid", 5, {}],
    }
    assert out.counts() == {"trained": 1, "expired": 1, "invalid": 1}


@pytest.mark.parametrize(
    ("restored", "decided", "checkpointed", "tid", "durable"),
    [
        ({}, [], False, "t", False),  # unknown
        ({"t": ["trained", 1]}, [], False, "t", True),  # restored from a checkpoint
        ({}, ["t"], False, "t", False),  # decided, not checkpointed yet: its records held
        ({}, ["t"], True, "t", True),
        ({"t": ["trained", 1]}, ["t"], False, "t", False),  # decided again since
        ({}, ["u"], True, "t", False),
    ],
)
def test_durable_means_in_the_ledger_and_checkpointed(
    restored: dict[str, list[Any]], decided: list[str], checkpointed: bool, tid: str, durable: bool
) -> None:
    out = Outcomes(Ledger(restored), expire_s=30)
    for t in decided:
        out.invalid(t, "p", "le256", 2, "bad")
    if checkpointed:
        out.checkpointed()
    assert out.durable(tid) is durable


def test_a_checkpoint_empties_the_window_and_keeps_the_ledger() -> None:
    out = Outcomes(Ledger(), expire_s=30)
    out.invalid("a", "p", "le256", 1, "bad")
    out.checkpointed()
    assert (out.window, out.undurable, out.ledger.entries) == ([], set(), {"a": ["invalid", 1, {}]})
    out.invalid("b", "p", "le256", 2, "bad")
    assert [e["labels"]["trajectory_id"] for e in out.window] == ["b"]
    assert out.undurable == {"b"}


def test_the_ledger_copies_what_it_restores_and_the_last_decision_wins() -> None:
    saved = {"a": ["trained", 3]}
    ledger = Ledger(saved)
    ledger.record("a", "dropped_stale", 4)
    ledger.record("b", "trained", 4)
    assert saved == {"a": ["trained", 3]}
    assert ledger.entries == {"a": ["dropped_stale", 4, {}], "b": ["trained", 4, {}]}
    assert ("a" in ledger, "c" in ledger, len(ledger)) == (True, False, 2)
    assert ledger.counts() == {"dropped_stale": 1, "trained": 1}
    assert Ledger().counts() == {}


# -- the train_step event ---------------------------------------------------------------------
STATS = StepStats(
    loss=0.25,
    kl=0.01,
    ratio_mean=1.0,
    ratio_max=1.5,
    truncated_frac=0.125,
    grad_norm=2.0,
    compute_s=0.5,
    padded_tokens=6,
)


def admitted(*samples: Sample) -> Admitted:
    return Admitted(group(*samples), 3, list(samples), [0.0] * len(samples))


@pytest.mark.parametrize(
    ("groups", "tokens", "stats", "elapsed", "idle", "expected"),
    [
        (
            [admitted(sample(0, 1.0), sample(1, 0.0, versions=(1,))), admitted(sample(2, 1.0))],
            40,
            STATS,
            2.0,
            0.5,
            {
                "loss": 0.25,
                "reward_mean": 2 / 3,
                "reward_std": pytest.approx(0.4714045207910317),
                "samples": 3,
                "groups": 2,
                "tokens": 40,
                "tokens_per_s": 20.0,
                "step_time_s": 2.0,
                "idle_s": 0.5,
                "compute_s": 0.5,
                "compute_tokens_per_s": 80.0,
                "staleness_mean": 4 / 3,
                "staleness_max": 2,
                "dropped_stale": 5,
                "kl": 0.01,
                "ratio_mean": 1.0,
                "ratio_max": 1.5,
                "truncated_frac": 0.125,
                "grad_norm": 2.0,
                "padded_tokens": 6,
            },
        ),
        (  # nothing trained (an empty step): no division by zero; idle at most the step time
            [],
            0,
            StepStats(),
            0.0,
            3.0,
            {
                "loss": 0.0,
                "reward_mean": 0.0,
                "reward_std": 0.0,
                "samples": 0,
                "groups": 0,
                "tokens": 0,
                "tokens_per_s": 0.0,
                "step_time_s": 1e-9,
                "idle_s": 1e-9,
                "compute_s": 0.0,
                "compute_tokens_per_s": 0.0,
                "staleness_mean": 0.0,
                "staleness_max": 0,
                "dropped_stale": 5,
                "kl": 0.0,
                "ratio_mean": 0.0,
                "ratio_max": 0.0,
                "truncated_frac": 0.0,
                "grad_norm": 0.0,
                "padded_tokens": 0,
            },
        ),
    ],
)
def test_step_values(
    groups: list[Admitted],
    tokens: int,
    stats: StepStats,
    elapsed: float,
    idle: float,
    expected: dict[str, Any],
) -> None:
    got = step_values(groups, tokens, stats, 3, elapsed, idle, dropped_stale=5)
    assert list(got) == list(expected)  # the event's key order
    assert got == expected
