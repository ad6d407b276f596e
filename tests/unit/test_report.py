"""The demo audit's classification (pending vs lost), the report's sections and its plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from app.report import (
    Audit,
    TrajSeen,
    audit_fields,
    curve_versions,
    last_samples,
    plot,
    published_times,
    reward_ends,
    series,
    step_events,
    throughput_fields,
)
from schemas.records import MetricEvent, TrajectoryChunk


def seen(
    partition: int, first: int, seqs: range, last: bool = True, tail: tuple[int, int] | None = None
) -> TrajSeen:
    """A trajectory whose chunks start at ``first`` on ``partition``; ``tail``: (partition,
    first offset) of the rest after a migration to the long-tail bucket."""
    s = TrajSeen({partition: first} | dict([tail] if tail else []))
    for seq in seqs:
        is_last = last and seq == max(seqs)
        s.lineage.add(
            TrajectoryChunk("t", "p", "k", 0, 1, seq, seq, b"", b"", 0, is_last, "w", "le", 0)
        )
    return s


def test_pending_is_at_or_after_the_committed_offset_and_lost_is_below_it() -> None:
    audit = Audit(
        trajectories={
            "trained": seen(0, 0, range(3)),
            "unread": seen(0, 10, range(2)),  # first chunk at the committed offset
            "skipped": seen(0, 4, range(2)),  # below it, never decided: lost
            "other-partition": seen(1, 0, range(1)),  # nothing committed there
            "cut": seen(0, 12, range(2), last=False),  # no last chunk: not generated
            "gap": seen(0, 14, range(0, 3, 2)),  # seq 1 missing: not complete
            # migrated: its first chunks unread on 0, its tail on 4 at an offset below 0's
            # commit but at 4's own (the demo's Ctrl-C report once called these lost)
            "migrated-unread": seen(0, 11, range(3), tail=(4, 3)),
            "migrated-passed": seen(0, 12, range(3), tail=(4, 1)),  # 4's commit passed it
        },
        duplicate_chunks=0,
        undecodable=0,
        outcomes={"trained": "trained"},
        decided_twice=0,
        committed={0: 10, 1: None, 4: 3},
    )
    assert audit.generated == {
        "trained",
        "unread",
        "skipped",
        "other-partition",
        "migrated-unread",
        "migrated-passed",
    }
    assert audit.pending() == {"unread", "other-partition", "migrated-unread"}
    assert audit.lost() == {"skipped", "migrated-passed"}


def test_plot_writes_a_png(tmp_path: Path) -> None:
    report = {
        "mode": "async",
        "seed": 0,
        "eval_accuracy_before": 0.2,
        "eval_accuracy_after": 0.5,
        "steps": 3,
        "wall_s": 10.0,
        "lost": 0,
        "eval_prompts": 8,
        "staleness_hist": {"0": 5, "1": 3},
        "series": {
            "step": [1, 2, 3],
            "t_s": [1.0, 2.0, 3.0],
            "reward_mean": [0.1, 0.3, 0.4],
            "train_tokens_per_s": [10.0, 12.0, 11.0],
            "staleness_mean": [0, 0.5, 0.4],
            "gen": [[0.5, "regular-0", 100.0], [1.5, "regular-0", 120.0]],
            "ready_latency_ms": [5.0, 7.0, 30.0],
        },
    }
    plot(report, tmp_path / "r.png")
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def ev(kind: str, ts: int, step: int | None = None, **kw: Any) -> MetricEvent:
    return MetricEvent(
        kind=kind, source=kw.pop("source", "trainer"), run="r", step=step, ts_ms=ts, **kw
    )


def test_the_last_event_of_a_step_and_of_a_trajectory_counts() -> None:
    events = [
        ev("train_step", 1000, 1, values={"reward_mean": 0.1}),
        ev("train_step", 2000, 2, values={"reward_mean": 0.2}),
        ev("train_step", 2500, 2, values={"reward_mean": 0.3}),  # step 2 redone after a restart
        ev("train_step", 2600, None),
        ev("weights_published", 2100, values={"version": 1.0}),
    ]
    steps = step_events(events)
    assert sorted(steps) == [1, 2] and steps[2].values["reward_mean"] == 0.3
    assert published_times(events) == {1: 2100}
    a1 = ev("sample", 1, 1, labels={"trajectory_id": "a", "outcome": "dropped_stale"})
    a3 = ev("sample", 2, 3, labels={"trajectory_id": "a", "outcome": "trained"})
    a2 = ev("sample", 3, 2, labels={"trajectory_id": "a", "outcome": "expired"})
    b = ev("sample", 4, None, labels={"trajectory_id": "b"})
    assert last_samples([a1, a3, a2, b]) == {"a": a3, "b": b}


@pytest.mark.parametrize(
    ("every", "final", "versions"),
    [(2, 6, [2, 4]), (2, 5, [2, 4, 6]), (0, 6, []), (1, 3, [1, 2, 4, 5, 6])],
)
def test_curve_versions(every: int, final: int, versions: list[int]) -> None:
    published = {v: 1000 * v for v in (6, 1, 2, 3, 4, 5)}
    assert curve_versions(published, every, final) == versions


@pytest.mark.parametrize(
    ("rewards", "first", "last"),
    [
        ([], None, None),
        ([0.5], 0.5, 0.5),
        ([0.1, 0.2, 0.3], 0.1, 0.3),
        ([0.0] * 10 + [1.0] * 9 + [None], 0.0, 1.0),  # a tenth is 2 steps; None is skipped
        ([float("nan"), 0.2], None, 0.2),
    ],
)
def test_reward_ends_are_means_over_a_tenth(
    rewards: list[float | None], first: float | None, last: float | None
) -> None:
    assert reward_ends(rewards) == {"reward_first": first, "reward_last": last}


def test_audit_fields_count_outcomes_and_the_trainers_duplicates() -> None:
    audit = Audit(
        trajectories={t: seen(0, i, range(2), last=t != "cut") for i, t in enumerate("abcdefg")}
        | {"cut": seen(0, 20, range(1), last=False)},
        duplicate_chunks=2,
        undecodable=0,
        outcomes={"a": "trained", "b": "trained", "c": "dropped_stale", "d": "expired"},
        decided_twice=1,
        committed={0: 5},
    )
    events = [
        ev("counter", 1, source="trainer-0", values={"duplicates": 3.0}),
        ev("counter", 2, source="gen-0", values={"duplicates": 99.0}),
        ev("migrated", 3),
    ]
    assert audit_fields(audit, events) == {
        "trajectories_generated": 7,
        "trajectories_trained": 2,
        "dropped_stale": 1,
        "failed": 1,
        "duplicates_seen": 5,
        "duplicate_chunks_in_topic": 2,
        "decided_twice": 1,
        "pending_at_stop": 2,  # f, g: at or after the committed offset 5
        "migrated": 1,
        "incomplete_at_stop": 1,
        "lost": 1,  # e: offset 4, below it, never decided
    }


def test_throughput_fields_and_series() -> None:
    last = [
        ev("sample", 1, labels={"outcome": "trained"}, values={"staleness": 1.0}),
        ev("sample", 2, labels={"outcome": "trained"}),
        ev("sample", 3, labels={"outcome": "dropped_stale"}, values={"staleness": 4.0}),
    ]
    assert throughput_fields(10.04, 1234, 3, last, [30.0, 10.0, 20.0]) == {
        "wall_s": 10.0,
        "tokens_per_s": 122.9,
        "tokens_generated": 1234,
        "policy_versions": 3,
        "staleness_hist": {"0": 1, "1": 1},
        "ready_latency_ms_p50": 20.0,
        "ready_latency_ms_p99": 30.0,
    }
    assert throughput_fields(0.0, 0, 0, [], [])["tokens_per_s"] is None
    steps = {
        2: ev("train_step", 3500, 2, values={"reward_mean": 0.5, "tokens_per_s": 9.0}),
        1: ev("train_step", 2000, 1, values={"staleness_mean": 0.25}),
    }
    gen = [
        ev(
            "gen_stats",
            1500,
            source="g",
            labels={"worker_id": "regular-0"},
            values={"tokens_per_s": 7.0},
        ),
        ev("gen_stats", 1600, source="g1"),
    ]
    assert series(steps, 1000, gen, [3.0, 1.0]) == {
        "step": [1, 2],
        "t_s": [1.0, 2.5],
        "reward_mean": [None, 0.5],
        "train_tokens_per_s": [None, 9.0],
        "staleness_mean": [0.25, None],
        "gen": [[0.5, "regular-0", 7.0], [0.6, "g1", None]],
        "ready_latency_ms": [1.0, 3.0],
    }
