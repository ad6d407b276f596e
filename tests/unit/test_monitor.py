"""The monitor's arithmetic without a broker: rows, buckets, backlog, stalls, the event summary."""

from __future__ import annotations

from typing import Any

import pytest

from app.monitor import (
    FRESH_MS,
    aggregate_backlog,
    backlog_starts,
    bucket_of,
    group_rows,
    stall_reason,
    summarize_events,
    tally_events,
)
from schemas.records import MetricEvent
from srl.kafka import POSITION_SUFFIX, GroupState, Member
from srl.topics import Layout

LAYOUT = Layout("srl", (256, 1024), partitions_per_bucket=2)
TRAJ = LAYOUT.trajectories
NOW = 1_700_000_000_000


@pytest.mark.parametrize(
    ("topic", "part", "bucket"),
    [
        (TRAJ, 0, "le256"),
        (TRAJ, 3, "le1024"),
        (TRAJ, 5, "gt1024"),
        ("srl.prompts.longtail", 0, "longtail"),
        ("srl.resume.le256", 1, "le256"),
        ("srl.metrics", 0, None),
        ("other.prompts.x", 0, None),
    ],
)
def test_bucket_of(topic: str, part: int, bucket: str | None) -> None:
    assert bucket_of(LAYOUT, topic, part) == bucket


def test_group_rows_keep_srl_groups_and_give_lag_only_where_something_is_committed() -> None:
    member = Member("m-1", "/h", "srl-trainer-0")
    parts = {(TRAJ, 0): (0, 10), (TRAJ, 1): (2, 7), ("srl.metrics", 0): (0, 3)}
    groups = [
        GroupState("g", "STABLE", 1, {(TRAJ, 0): 4}, {(TRAJ, 0): member, (TRAJ, 1): member}),
        GroupState("not-srl", "STABLE", 1, {("x.y", 0): 1}, {}),
    ]
    rows, info = group_rows(LAYOUT, groups, parts)
    assert info == {"g": {"state": "STABLE", "members": 1}}
    assert [(r["partition"], r["current_offset"], r["log_end_offset"], r["lag"]) for r in rows] == [
        (0, 4, 10, 6),
        (1, None, 7, None),
    ]
    assert rows[0] == {
        "group": "g",
        "topic": TRAJ,
        "partition": 0,
        "bucket": "le256",
        "current_offset": 4,
        "log_end_offset": 10,
        "lag": 6,
        "consumer_id": "m-1",
        "host": "/h",
        "client_id": "srl-trainer-0",
        "state": "STABLE",
    }


def row(group: str, part: int, current: int | None, end: int, bucket: str | None) -> dict[str, Any]:
    return {
        "group": group,
        "topic": TRAJ,
        "partition": part,
        "bucket": bucket,
        "current_offset": current,
        "log_end_offset": end,
    }


def test_backlog_counts_from_the_committed_offset_else_the_log_start() -> None:
    parts = {(TRAJ, 0): (0, 10), (TRAJ, 1): (3, 8), (TRAJ, 2): (0, 4), (TRAJ, 3): (0, 5)}
    rows = [
        row("g", 0, 6, 10, "le256"),  # 4 pending, all sampled: exact
        row("g", 1, None, 8, "le256"),  # nothing committed: from the low watermark, 5 pending
        row("g", 2, 4, 4, "le1024"),  # caught up
        row("g", 3, 0, 5, None),  # not a bucketed partition: left out
    ]
    starts = backlog_starts(rows, parts)
    assert starts == {("g", TRAJ, 0): 6, ("g", TRAJ, 1): 3}
    sampled = {
        (TRAJ, 0): [(5, 99), (6, 10), (7, 20), (8, 30), (9, 40)],  # offset 5: before the start
        (TRAJ, 1): [(3, 8), (4, None)],  # a record that does not decode; 3 not sampled
    }
    assert aggregate_backlog(rows, starts, sampled) == [
        {
            "group": "g",
            "topic": TRAJ,
            "bucket": "le256",
            "records": 9,
            "tokens": 100 + 40,  # exact 100, then the sampled mean (8) times 5 records
            "tokens_exact": False,
        },
        {
            "group": "g",
            "topic": TRAJ,
            "bucket": "le1024",
            "records": 0,
            "tokens": 0,
            "tokens_exact": True,
        },
    ]


@pytest.mark.parametrize(
    ("group", "consumer", "lag", "unmoved_ms", "reason"),
    [
        ("g", "m-1", 0, 10**6, None),  # caught up
        ("g", "m-1", None, 10**6, None),  # nothing committed
        ("g", None, 3, 0, "no consumer assigned"),
        ("g", "m-1", 3, 59_999, None),
        ("g", "m-1", 3, 61_000, "committed offset unchanged for 61s"),
        ("g" + POSITION_SUFFIX, None, 3, 1_000, None),  # a position group has no members
        ("g" + POSITION_SUFFIX, None, 3, 60_000, "committed offset unchanged for 60s"),
    ],
)
def test_stall_reason(
    group: str, consumer: str | None, lag: int | None, unmoved_ms: int, reason: str | None
) -> None:
    r = {"group": group, "consumer_id": consumer, "lag": lag}
    assert stall_reason(r, unmoved_ms, 60_000) == reason


def event(kind: str, source: str = "trainer", age_ms: int = 0, **kw: Any) -> MetricEvent:
    return MetricEvent(kind=kind, source=source, run=kw.pop("run", "r"), ts_ms=NOW - age_ms, **kw)


def test_summarize_events_uses_fresh_rates_and_the_runs_own_events() -> None:
    events = [
        event("gen_stats", "gen-0", 1_000, values={"tokens_per_s": 500.0, "policy_version": 2.0}),
        event("gen_stats", "gen-1", FRESH_MS + 1, values={"tokens_per_s": 300.0}),  # stale
        event("gen_stats", "gen-2", 0, values={"tokens_per_s": 9e9}, run="other"),
        event("gen_stats", "gen-3", 0, values={"tokens_per_s": 1.0}, labels={"simulated": "true"}),
        event(
            "train_step", age_ms=2_000, step=4, values={"tokens_per_s": 77.0, "policy_version": 4}
        ),
        event("weights_published", age_ms=1_500, values={"version": 4.0}),
        event("counter", "trainer", values={"dead_letters": 2.0}),
        event("counter", "gen-0", values={"dead_letters": 1.0}),
        event("sample", age_ms=20_000, values={"staleness": 1.0}),  # no outcome: trained
        event("sample", age_ms=10_000, labels={"outcome": "trained"}, values={"staleness": 0.0}),
        event("sample", labels={"outcome": "dropped_stale"}, values={"staleness": 3.0}),
        event("sample", labels={"outcome": "expired"}),
    ]
    assert summarize_events(events, "r", NOW) == {
        "throughput": {
            "gen_tokens_per_s": 501.0,
            "train_tokens_per_s": 77.0,
            "trajectories_per_s": 2 / 20.0,
            "simulated": True,
        },
        "versions": {"trainer": 4, "published": 4, "generators": {"gen-0": 2, "gen-3": None}},
        "staleness": {"histogram": {"0": 1, "1": 1, "3": 1}, "mean": 4 / 3, "max": 3},
        "drops": {"by_outcome": {"dropped_stale": 1, "expired": 1}, "dead_letters_counted": 3},
        "store": {"checkpoint": None, "refused": {}},
    }


def test_summarize_nothing_and_stale_trainer_figures() -> None:
    assert summarize_events([], "r", NOW) == {
        "throughput": {
            "gen_tokens_per_s": None,
            "train_tokens_per_s": None,
            "trajectories_per_s": None,
            "simulated": False,
        },
        "versions": {"trainer": None, "published": None, "generators": {}},
        "staleness": {"histogram": {}, "mean": None, "max": None},
        "drops": {"by_outcome": {}, "dead_letters_counted": 0},
        "store": {"checkpoint": None, "refused": {}},
    }
    old = [event("train_step", age_ms=FRESH_MS + 1, values={"tokens_per_s": 5.0})]
    got = summarize_events(old, "r", NOW)
    assert got["throughput"]["train_tokens_per_s"] is None  # too old to be "now"
    assert got["versions"]["trainer"] is None  # no policy_version value


def test_the_store_summary_shows_refusals_since_the_last_success_of_their_kind() -> None:
    full = {"what": "checkpoint", "reason": "No space left on device"}
    events = [
        event("checkpoint_saved", age_ms=60_000, step=3, values={"number": 4.0, "seconds": 2.5}),
        event("store_refused", age_ms=30_000, step=4, labels=full, values={"in_a_row": 1.0}),
        event("store_refused", age_ms=9_000, step=5, labels=full, values=retry(2.0, 10.0)),
        event("store_refused", age_ms=8_000, labels={"what": "publish"}, values=retry(1.0, 5.0)),
        event("weights_published", age_ms=2_000, values={"version": 6.0}),  # published since
    ]
    assert summarize_events(events, "r", NOW)["store"] == {
        "checkpoint": {"number": 4, "step": 3, "seconds": 2.5, "age_s": 60.0},
        "refused": {
            "checkpoint": {
                "reason": "No space left on device",
                "in_a_row": 2,
                "retry_s": 10.0,
                "age_s": 9.0,
            }
        },
    }
    saved = event("checkpoint_saved", age_ms=1_000, step=6, values={"number": 7.0, "seconds": 1})
    assert summarize_events([*events, saved], "r", NOW)["store"]["refused"] == {}


def retry(in_a_row: float, retry_s: float) -> dict[str, float]:
    return {"in_a_row": in_a_row, "retry_s": retry_s}


def test_tally_keeps_the_latest_event_of_each_kind_and_source() -> None:
    first = event("gen_stats", "gen-0", 5_000)
    second = event("gen_stats", "gen-0", 1_000)
    t = tally_events([first, second, event("train_step", step=1), event("train_step", step=2)], "r")
    assert t.gen == {"gen-0": second}
    assert t.train is not None and t.train.step == 2


SERVED = "chatcmpl-" + "0" * 32  # a served group's prompt_id: its completion id


def serve_stats(source: str, age_ms: int, **values: float) -> MetricEvent:
    return event("serve_stats", source, age_ms, values=values, labels={"publish": "true"})


def test_serving_summary_from_serve_stats_and_the_served_samples_trained() -> None:
    events = [
        serve_stats("srv-0", 20_000, requests=10.0, completions=8.0, published_trajectories=8.0),
        serve_stats(
            "srv-0",
            10_000,
            requests=20.0,
            completions=18.0,
            published_trajectories=17.0,
            publish_dropped=1.0,
            running=1.0,
        ),
        serve_stats(
            "srv-0",
            5_000,
            requests=30.0,
            completions=28.0,
            published_trajectories=26.0,
            publish_dropped=2.0,
            queue_timeouts=1.0,
            queue_waits=12.0,
            queue_wait_ms=300.0,
            running=3.0,
            waiting=2.0,
        ),
        # restarted, and stale: counts from 0, not in flight
        serve_stats("srv-1", FRESH_MS + 9_000, requests=50.0, completions=50.0),
        serve_stats("srv-1", FRESH_MS + 1, requests=4.0, completions=4.0, running=7.0),
        event("serve_stats", "srv-9", values={"requests": 1e6}, run="other"),
    ]
    trained = {"outcome": "trained", "prompt_id": SERVED}
    events += [
        event("sample", labels=trained | {"trajectory_id": "s-0"}, values={"staleness": 0.0}),
        event("sample", labels=trained | {"trajectory_id": "s-0"}, step=9),  # re-sent: once
        event("sample", labels=trained | {"trajectory_id": "s-1"}),
        event("sample", labels={"outcome": "dropped_stale", "prompt_id": SERVED}),
        event("sample", labels={"outcome": "trained", "prompt_id": "task-1"}),  # generated
    ]
    got = summarize_events(events, "r", NOW)["serving"]
    # srv-0: 10 requests in its last 5 s; srv-1: 4 since its restart, 8.999 s between events
    assert got.pop("requests_per_s") == pytest.approx(10 / 5.0 + 4 / 8.999)
    assert got == {
        "servers": 1,
        "in_flight": 5,
        "running": 3,
        "waiting": 2,
        "queue_timeouts": 1,
        "queue_wait_ms": 25.0,  # 300 ms over 12 requests (srv-0: none before its last event)
        "served": 20 + 4,
        "published": 18,
        "trained": 2,
        "publish_dropped": 2,
        "delivery_failures": 0,
    }


def test_no_serving_key_without_serve_stats_and_one_event_gives_no_rate() -> None:
    assert "serving" not in summarize_events([event("sample")], "r", NOW)
    got = summarize_events([serve_stats("srv-0", 0, requests=5.0)], "r", NOW)["serving"]
    assert got["requests_per_s"] is None and got["served"] == 0 and got["in_flight"] == 0
