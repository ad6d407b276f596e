"""``srl top``'s text lines, table cells and Prometheus families, from hand-made snapshots."""

from __future__ import annotations

from typing import Any

import pytest

from app.monitor import summarize_events
from app.top import (
    GROUP_COLUMNS,
    SnapshotCollector,
    backlog_cells,
    drops_line,
    group_cells,
    lag_sums,
    partition_counts,
    render,
    serving_line,
    staleness_line,
    stalled_line,
    throughput_line,
    versions_line,
    weights_line,
)
from schemas.records import MetricEvent

NOW = 1_700_000_000_000
SERVED = "cmpl-" + "a" * 32  # a served group's prompt_id: its completion id


def group(name: str, part: int, current: int | None, lag: int | None) -> dict[str, Any]:
    return {
        "group": name,
        "topic": "srl.trajectories",
        "partition": part,
        "bucket": "le256" if current is not None else None,
        "current_offset": current,
        "log_end_offset": 10,
        "lag": lag,
        "consumer_id": "c-1" if current is not None else None,
        "host": "/10.0.0.1" if current is not None else None,
        "client_id": "srl-trainer-x" if current is not None else None,
    }


def test_group_cells_follow_the_columns_and_show_nothing_as_a_dash() -> None:
    assert len(GROUP_COLUMNS) == 10
    assert group_cells(group("g", 0, 4, 6)) == (
        "g",
        "srl.trajectories",
        "0",
        "le256",
        "4",
        "10",
        "6",
        "c-1",
        "/10.0.0.1",
        "srl-trainer-x",
    )
    assert group_cells(group("g", 1, None, None)) == (
        "g",
        "srl.trajectories",
        "1",
        *["-"] * 2,
        "10",
        *["-"] * 4,
    )


@pytest.mark.parametrize(
    ("exact", "tokens"),
    [(True, "60"), (False, "~60")],
)
def test_backlog_cells_mark_estimated_tokens(exact: bool, tokens: str) -> None:
    b = {"group": "g", "topic": "t", "bucket": "le256", "records": 6, "tokens": 60}
    assert backlog_cells(b | {"tokens_exact": exact}) == ("g", "t", "le256", "6", tokens)


@pytest.mark.parametrize(
    ("throughput", "line"),
    [
        (
            {
                "gen_tokens_per_s": 1234.56,
                "train_tokens_per_s": 99.4,
                "trajectories_per_s": 1.2345,
                "simulated": True,
            },
            "throughput: generation 1235 tok/s (simulated engine), training 99 tok/s, "
            "1.23 trajectories/s",
        ),
        (
            {
                "gen_tokens_per_s": None,
                "train_tokens_per_s": None,
                "trajectories_per_s": None,
                "simulated": False,
            },
            "throughput: generation - tok/s, training - tok/s, - trajectories/s",
        ),
    ],
)
def test_throughput_line(throughput: dict[str, Any], line: str) -> None:
    assert throughput_line(throughput) == line


@pytest.mark.parametrize(
    ("weights", "expected"),
    [
        (
            {"run": "r", "version": None, "manifest_ok": None, "error": None},
            ("weights: no version announced for run r", "yellow"),
        ),
        (
            {"run": "r", "version": 3, "manifest_ok": True, "error": None},
            ("weights: r v3  manifest ok", "green"),
        ),
        (
            {"run": "r", "version": 4, "manifest_ok": False, "error": "missing from the store: a"},
            ("weights: r v4  MANIFEST NOT OK: missing from the store: a", "bold red"),
        ),
    ],
)
def test_weights_line_and_its_style(weights: dict[str, Any], expected: tuple[str, str]) -> None:
    assert weights_line(weights) == expected


def test_versions_staleness_drops_and_stalled_lines() -> None:
    v = {"trainer": 3, "published": None, "generators": {"a": 2, "b": None}, "in_backlog": {"1": 3}}
    assert versions_line(v) == (
        "versions: trainer 3, published -, generators a=v2, b=v-, in backlog (sampled chunks) v1:3"
    )
    empty = {"trainer": None, "published": None, "generators": {}, "in_backlog": {}}
    assert versions_line(empty).endswith("generators -, in backlog (sampled chunks) -")
    st = {"histogram": {"0": 5, "1": 2}, "mean": 0.2857, "max": 1}
    assert staleness_line(st, 300.0) == "staleness (last 300s): 0:5  1:2   mean 0.29  max 1"
    none = {"histogram": {}, "mean": None, "max": None}
    assert staleness_line(none, 12.5) == "staleness (last 12.5s): -   mean -  max -"
    assert drops_line({"by_outcome": {"expired": 1}, "dead_letter_records": 3}) == (
        "drops: expired 1; dead letters: 3 on the DLQ"
    )
    assert drops_line({"by_outcome": {}, "dead_letter_records": 0}).startswith("drops: none;")
    s = {"group": "g", "topic": "t", "partition": 2, "lag": 4, "reason": "no consumer assigned"}
    assert stalled_line(s) == "STALLED g t[2] lag 4: no consumer assigned"


def test_lag_sums_count_only_partitions_with_a_committed_offset() -> None:
    rows = [
        group("g", 0, 4, 6),
        group("g", 1, None, None),
        group("g", 2, 7, 3),
        group("h", 0, 1, 9),
    ]
    assert lag_sums(rows) == {("g", "srl.trajectories"): (11, 9), ("h", "srl.trajectories"): (1, 9)}
    topics = [{"topic": "a"}, {"topic": "b"}, {"topic": "a"}]
    assert partition_counts(topics) == {"a": 2, "b": 1}


def test_the_collector_says_down_until_it_has_a_snapshot_then_uses_kafka_exporter_names() -> None:
    c = SnapshotCollector()
    assert [(m.name, [s.value for s in m.samples]) for m in c.collect()] == [("srl_top_up", [0])]
    c.up, c.snap = (
        1,
        {
            "topics": [{"topic": "t", "partition": 0, "low": 2, "high": 9}],
            "groups": [group("g", 0, 4, 5) | {"topic": "t"}],
            "group_info": {"g": {"members": 1}},
            "backlog": [],
            "stalled": [],
            "throughput": {
                "gen_tokens_per_s": None,
                "train_tokens_per_s": 5.0,
                "trajectories_per_s": None,
            },
            "weights": {"run": "r", "version": None, "manifest_ok": None},
            "versions": {"trainer": None, "generators": {"a": 1, "b": None}},
            "staleness": {"histogram": {"0": 2}},
            "drops": {"by_outcome": {}, "dead_letter_records": 0},
        },
    )
    got = {m.name: [(s.labels, s.value) for s in m.samples] for m in c.collect()}
    assert got["srl_top_up"] == [({}, 1)]
    assert got["kafka_topic_partitions"] == [({"topic": "t"}, 1)]
    assert got["kafka_topic_partition_oldest_offset"] == [({"topic": "t", "partition": "0"}, 2)]
    cg = {"consumergroup": "g", "topic": "t", "partition": "0"}
    assert got["kafka_consumergroup_lag"] == [(cg, 5)]
    assert got["kafka_consumergroup_lag_sum"] == [({"consumergroup": "g", "topic": "t"}, 5)]
    assert got["kafka_consumergroup_members"] == [({"consumergroup": "g"}, 1)]
    assert got["srl_training_tokens_per_second"] == [({}, 5.0)]
    assert "srl_generation_tokens_per_second" not in got  # no fresh figure: no metric
    assert got["srl_weights_manifest_ok"] == [] and "srl_weights_version" not in got
    assert got["srl_generator_policy_version"] == [({"source": "a"}, 1)]
    assert got["srl_staleness_samples"] == [({"staleness": "0"}, 2)]
    assert got["srl_dead_letter_records"] == [({}, 0)]


def metric(kind: str, age_ms: int, values: dict[str, float], **labels: str) -> MetricEvent:
    return MetricEvent(
        kind=kind, source="srv-0", run="r", ts_ms=NOW - age_ms, values=values, labels=labels
    )


SERVING_EVENTS = [
    metric(
        "serve_stats", 10_000, {"requests": 10.0, "completions": 9.0, "published_trajectories": 9.0}
    ),
    metric(
        "serve_stats",
        5_000,
        {
            "requests": 22.0,
            "completions": 21.0,
            "published_trajectories": 20.0,
            "publish_dropped": 1.0,
            "running": 4.0,
            "waiting": 3.0,
            "queue_waits": 4.0,
            "queue_wait_ms": 250.0,
        },
    ),
    *[
        metric("sample", 0, {}, outcome="trained", prompt_id=SERVED, trajectory_id=f"t-{i}")
        for i in range(6)
    ],
]


def snapshot(events: list[MetricEvent]) -> dict[str, Any]:
    """A whole snapshot, its event part from real metric events."""
    return {
        "ts_ms": NOW,
        "bootstrap": "b:9092",
        "prefix": "srl",
        "run": "r",
        "window_s": 300.0,
        "topics": [],
        "groups": [],
        "group_info": {},
        "backlog": [],
        "weights": {"run": "r", "version": None, "manifest_ok": None, "error": None},
        "stalled": [],
        **summarize_events(events, "r", NOW),
        "versions": {"trainer": None, "published": None, "generators": {}, "in_backlog": {}},
        "drops": {"by_outcome": {}, "dead_letters_counted": 0, "dead_letter_records": 0},
    }


def text_of(snap: dict[str, Any]) -> str:
    from rich.console import Console

    console = Console(width=400)
    with console.capture() as cap:
        console.print(render(snap))
    return cap.get()


def test_the_serving_line_from_serve_stats_and_served_samples() -> None:
    line = (
        "serving (last 300s): 1 server(s), 2.4 req/s, 7 in flight (4 running, 3 waiting), "
        "queue wait 62 ms; "
        "served 12 → published 11 → trained 6; publish drops 1, delivery failures 0"
    )
    snap = snapshot(SERVING_EVENTS)
    assert serving_line(snap["serving"], 300.0) == line
    assert line in text_of(snap)
    stale = dict(
        snap["serving"], servers=0, in_flight=None, running=None, waiting=None, queue_wait_ms=None
    )
    assert "0 server(s), 2.4 req/s, - in flight;" in serving_line(stale | {"queue_timeouts": 2}, 5)
    assert serving_line(stale | {"queue_timeouts": 2}, 5).endswith("; 2 queue timeouts (503)")


def test_no_serving_traffic_leaves_the_view_and_the_exporter_as_they_were() -> None:
    snap = snapshot(SERVING_EVENTS[2:])  # samples, no serve_stats
    assert "serving" not in snap
    assert "serving" not in text_of(snap)
    c = SnapshotCollector()
    c.up, c.snap = 1, snap
    assert not [m.name for m in c.collect() if m.name.startswith("srl_serving")]


def test_the_exporter_carries_the_serving_figures() -> None:
    c = SnapshotCollector()
    c.up, c.snap = 1, snapshot(SERVING_EVENTS)
    got = {m.name: [s.value for s in m.samples] for m in c.collect()}
    assert got["srl_serving_requests_per_second"] == [pytest.approx(2.4)]
    assert got["srl_serving_in_flight"] == [7] and got["srl_serving_waiting"] == [3]
    assert got["srl_serving_served"] == [12] and got["srl_serving_published"] == [11]
    assert got["srl_serving_trained"] == [6] and got["srl_serving_publish_dropped"] == [1]
    assert got["srl_serving_queue_wait_ms"] == [pytest.approx(62.5)]


def test_the_store_line_is_red_while_a_write_kind_is_refused() -> None:
    from app.top import store_line

    ok = {"checkpoint": {"number": 4, "step": 3, "seconds": 2.5, "age_s": 60.0}, "refused": {}}
    assert store_line(ok) == ("checkpoints: c4 at step 3 (2.5 s, 60 s ago)", "")
    full = {"reason": "No space left on device", "in_a_row": 2, "retry_s": 10.0, "age_s": 9.0}
    text, style = store_line({"checkpoint": None, "refused": {"checkpoint": full}})
    assert style == "bold red" and text == (
        "checkpoints: none yet; CHECKPOINT REFUSED 2x in a row (9 s ago, retried after 10.0 s): "
        "No space left on device"
    )
