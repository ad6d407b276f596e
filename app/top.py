"""``srl top``: a live terminal view of every srl topic and group, one JSON snapshot, or a
Prometheus ``/metrics`` endpoint with kafka_exporter's names.

* ``render(snapshot)``: rich tables (consumer groups in the columns of
  ``kafka-consumer-groups.sh``, backlog per bucket, throughput, serving, weights, versions,
  staleness, drops, stalled partitions);
* ``SnapshotCollector``: the Prometheus view of the latest snapshot. Lag metrics use
  kafka_exporter's names and labels (``kafka_consumergroup_lag{consumergroup,topic,partition}``
  …) so its dashboards work unchanged; srl's own metrics are ``srl_*``;
* ``run_top``: the loop behind the command. The snapshot is built by ``app.monitor.Monitor``.

Called by ``srl top`` in ``app/cli/main.py``.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator
from typing import Any

from app.cli.common import echo_json
from app.configs import TopConfig
from app.monitor import Monitor
from srl.errors import SrlError

log = logging.getLogger("app.top")


def _s(v: Any) -> str:
    return "-" if v is None else str(v)


def render(snap: dict[str, Any]) -> Any:
    """The text view of one snapshot, top to bottom: header, stalled partitions, consumer
    groups, backlog per bucket, then one line each for throughput, serving (when a server
    reported), weights, versions, staleness and drops."""
    from rich.console import Group
    from rich.text import Text

    parts: list[Any] = [Text(header_line(snap), style="bold")]
    parts += [Text(stalled_line(s), style="bold red") for s in snap["stalled"]]
    parts.append(
        _groups_table(snap["groups"])
        if snap["groups"]
        else Text("no consumer group on srl topics yet")
    )
    if snap["backlog"]:
        parts.append(_backlog_table(snap["backlog"]))
    parts.append(Text(throughput_line(snap["throughput"])))
    if snap.get("serving"):  # only where a srl serve reported in the window
        parts.append(Text(serving_line(snap["serving"], snap["window_s"])))
    text, style = weights_line(snap["weights"])
    parts.append(Text(text, style=style))
    parts.append(Text(versions_line(snap["versions"])))
    if "store" in snap:
        text, style = store_line(snap["store"])
        parts.append(Text(text, style=style))
    parts.append(Text(staleness_line(snap["staleness"], snap["window_s"])))
    parts.append(Text(drops_line(snap["drops"])))
    return Group(*parts)


GROUP_COLUMNS = (
    "GROUP",
    "TOPIC",
    "PARTITION",
    "BUCKET",
    "CURRENT-OFFSET",
    "LOG-END-OFFSET",
    "LAG",
    "CONSUMER-ID",
    "HOST",
    "CLIENT-ID",
)  # kafka-consumer-groups.sh --describe, with srl's BUCKET


def group_cells(r: dict[str, Any]) -> tuple[str, ...]:
    """One consumer-group row as the cells of :data:`GROUP_COLUMNS` ("-" for nothing)."""
    return (
        r["group"],
        r["topic"],
        str(r["partition"]),
        _s(r["bucket"]),
        _s(r["current_offset"]),
        str(r["log_end_offset"]),
        _s(r["lag"]),
        _s(r["consumer_id"]),
        _s(r["host"]),
        _s(r["client_id"]),
    )


def backlog_cells(b: dict[str, Any]) -> tuple[str, ...]:
    """One backlog row: group, topic, bucket, records, tokens ("~" when estimated)."""
    tokens = f"{b['tokens']}" if b["tokens_exact"] else f"~{b['tokens']}"
    return b["group"], b["topic"], b["bucket"], str(b["records"]), tokens


def _groups_table(rows: list[dict[str, Any]]) -> Any:
    from rich.table import Table

    table = Table(*GROUP_COLUMNS, box=None, title="consumer groups", title_justify="left")
    for r in rows:
        table.add_row(*group_cells(r))
    return table


def _backlog_table(backlog: list[dict[str, Any]]) -> Any:
    from rich.table import Table

    table = Table(
        "GROUP",
        "TOPIC",
        "BUCKET",
        "RECORDS",
        "TOKENS",
        box=None,
        title="backlog per length bucket",
        title_justify="left",
    )
    for b in backlog:
        table.add_row(*backlog_cells(b))
    return table


def header_line(snap: dict[str, Any]) -> str:
    clock = time.strftime("%H:%M:%S", time.localtime(snap["ts_ms"] / 1000))
    return f"srl top  {snap['bootstrap']}  prefix {snap['prefix']}  run {snap['run']}  {clock}"


def stalled_line(s: dict[str, Any]) -> str:
    return f"STALLED {s['group']} {s['topic']}[{s['partition']}] lag {s['lag']}: {s['reason']}"


def throughput_line(t: dict[str, Any]) -> str:
    sim = " (simulated engine)" if t["simulated"] else ""
    return (
        f"throughput: generation {_rate(t['gen_tokens_per_s'])} tok/s{sim}, training "
        f"{_rate(t['train_tokens_per_s'])} tok/s, {_rate(t['trajectories_per_s'], 2)} "
        f"trajectories/s"
    )


def serving_line(sv: dict[str, Any], window_s: float) -> str:
    """``srl serve``'s traffic: request rate, choices in flight, and what became of the
    served choices in the window (served → published → trained), with the publishing losses."""
    flight = (
        f"{sv['in_flight']} in flight ({sv['running']} running, {sv['waiting']} waiting)"
        if sv["in_flight"] is not None
        else "- in flight"
    )
    if sv.get("queue_wait_ms") is not None:
        flight += f", queue wait {sv['queue_wait_ms']:.0f} ms"
    line = (
        f"serving (last {window_s:g}s): {sv['servers']} server(s), "
        f"{_rate(sv['requests_per_s'], 1)} req/s, {flight}; served {sv['served']} → "
        f"published {sv['published']} → trained {sv['trained']}; "
        f"publish drops {sv['publish_dropped']}, delivery failures {sv['delivery_failures']}"
    )
    timeouts = sv["queue_timeouts"]
    return f"{line}; {timeouts} queue timeouts (503)" if timeouts else line


def weights_line(w: dict[str, Any]) -> tuple[str, str]:
    """The weights line and its style: yellow when nothing is announced, red when the
    manifest does not verify."""
    if w["version"] is None:
        return f"weights: no version announced for run {w['run']}", "yellow"
    ok = "manifest ok" if w["manifest_ok"] else f"MANIFEST NOT OK: {w['error']}"
    return f"weights: {w['run']} v{w['version']}  {ok}", "green" if w["manifest_ok"] else "bold red"


def store_line(st: dict[str, Any]) -> tuple[str, str]:
    """The trainer's last checkpoint, and in red each write the store refused since that kind
    last succeeded (how many in a row, the reason, the back-off before the next try)."""
    c = st["checkpoint"]
    line = (
        "checkpoints: none yet"
        if c is None
        else (
            f"checkpoints: c{c['number']} at step {_s(c['step'])} ({c['seconds']:.1f} s, "
            f"{c['age_s']:.0f} s ago)"
        )
    )
    for what, r in st["refused"].items():
        line += (
            f"; {what.upper()} REFUSED {_s(r['in_a_row'])}x in a row ({r['age_s']:.0f} s ago, "
            f"retried after {_s(r['retry_s'])} s): {r['reason']}"
        )
    return line, "bold red" if st["refused"] else ""


def versions_line(v: dict[str, Any]) -> str:
    gens = ", ".join(f"{k}=v{_s(x)}" for k, x in v["generators"].items()) or "-"
    backlog_v = ", ".join(f"v{k}:{n}" for k, n in v["in_backlog"].items()) or "-"
    return (
        f"versions: trainer {_s(v['trainer'])}, published {_s(v['published'])}, "
        f"generators {gens}, in backlog (sampled chunks) {backlog_v}"
    )


def staleness_line(st: dict[str, Any], window_s: float) -> str:
    hist = "  ".join(f"{k}:{n}" for k, n in st["histogram"].items()) or "-"
    return (
        f"staleness (last {window_s:g}s): {hist}   mean {_rate(st['mean'], 2)}  max {_s(st['max'])}"
    )


def drops_line(d: dict[str, Any]) -> str:
    drops = ", ".join(f"{k} {n}" for k, n in d["by_outcome"].items()) or "none"
    line = f"drops: {drops}; dead letters: {d['dead_letter_records']} on the DLQ"
    bad = d.get("unreadable_metric_records", 0)
    return f"{line}; {bad} unreadable metric records" if bad else line


def _rate(x: float | None, digits: int = 0) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


class SnapshotCollector:
    """A prometheus_client collector over the latest snapshot (refreshed by ``run_top``)."""

    def __init__(self) -> None:
        self.snap: dict[str, Any] | None = None
        self.up = 0

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily as G

        up = G("srl_top_up", "1 if the last refresh reached the broker")
        up.add_metric([], self.up)
        yield up
        if self.snap is None:
            return
        yield from kafka_metrics(self.snap)
        yield from srl_metrics(self.snap)


_P = ["topic", "partition"]
_CG = ["consumergroup", "topic", "partition"]
_BUCKET = ["consumergroup", "topic", "bucket"]
# kafka_exporter's families (name, help, labels), then srl's backlog and stall ones
KAFKA_FAMILIES: dict[str, tuple[str, str, list[str]]] = {
    "parts": ("kafka_topic_partitions", "Number of partitions for this Topic", ["topic"]),
    "cur": (
        "kafka_topic_partition_current_offset",
        "Current Offset of a Broker at Topic/Partition",
        _P,
    ),
    "old": (
        "kafka_topic_partition_oldest_offset",
        "Oldest Offset of a Broker at Topic/Partition",
        _P,
    ),
    "gcur": (
        "kafka_consumergroup_current_offset",
        "Current Offset of a ConsumerGroup at Topic/Partition",
        _CG,
    ),
    "gcursum": (
        "kafka_consumergroup_current_offset_sum",
        "Current Offset of a ConsumerGroup at Topic for all partitions",
        _CG[:2],
    ),
    "lag": (
        "kafka_consumergroup_lag",
        "Current Approximate Lag of a ConsumerGroup at Topic/Partition",
        _CG,
    ),
    "lagsum": (
        "kafka_consumergroup_lag_sum",
        "Current Approximate Lag of a ConsumerGroup at Topic for all partitions",
        _CG[:2],
    ),
    "members": (
        "kafka_consumergroup_members",
        "Amount of members in a consumer group",
        ["consumergroup"],
    ),
    "brec": (
        "srl_backlog_records",
        "Records not yet consumed by a group, per length bucket",
        _BUCKET,
    ),
    "btok": (
        "srl_backlog_tokens",
        "Tokens not yet consumed by a group, per length bucket (estimated past the sample)",
        _BUCKET,
    ),
    "stalled": (
        "srl_partition_stalled",
        "1 for a partition with lag and no progress or no consumer",
        _CG,
    ),
}


def partition_counts(topics: list[dict[str, Any]]) -> dict[str, int]:
    """Partitions per topic, in the order topics first appear."""
    count: dict[str, int] = defaultdict(int)
    for r in topics:
        count[r["topic"]] += 1
    return dict(count)


def lag_sums(groups: list[dict[str, Any]]) -> dict[tuple[str, str], tuple[int, int]]:
    """``{(group, topic): (sum of committed offsets, sum of lag)}`` over the partitions with
    a committed offset (kafka_exporter's ``_sum`` metrics)."""
    sums: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    for r in groups:
        if r["lag"] is not None:
            sums[(r["group"], r["topic"])][0] += r["current_offset"]
            sums[(r["group"], r["topic"])][1] += r["lag"]
    return {k: (cur, lag) for k, (cur, lag) in sums.items()}


def kafka_metrics(snap: dict[str, Any]) -> list[Any]:
    """Offsets, lag and members with kafka_exporter's names and labels; backlog and stalls."""
    from prometheus_client.core import GaugeMetricFamily as G

    m = {k: G(name, doc, labels=labels) for k, (name, doc, labels) in KAFKA_FAMILIES.items()}
    for r in snap["topics"]:
        m["cur"].add_metric([r["topic"], str(r["partition"])], r["high"])
        m["old"].add_metric([r["topic"], str(r["partition"])], r["low"])
    for topic, n in partition_counts(snap["topics"]).items():
        m["parts"].add_metric([topic], n)
    for r in snap["groups"]:
        labels = [r["group"], r["topic"], str(r["partition"])]
        current = r["current_offset"]
        m["gcur"].add_metric(labels, -1 if current is None else current)  # -1 as kafka_exporter
        if r["lag"] is not None:
            m["lag"].add_metric(labels, r["lag"])
    for (g, topic), (cur, lag) in lag_sums(snap["groups"]).items():
        m["gcursum"].add_metric([g, topic], cur)
        m["lagsum"].add_metric([g, topic], lag)
    for g, info in snap["group_info"].items():
        m["members"].add_metric([g], info["members"])
    for b in snap["backlog"]:
        m["brec"].add_metric([b["group"], b["topic"], b["bucket"]], b["records"])
        m["btok"].add_metric([b["group"], b["topic"], b["bucket"]], b["tokens"])
    for s in snap["stalled"]:
        m["stalled"].add_metric([s["group"], s["topic"], str(s["partition"])], 1)
    return list(m.values())


THROUGHPUT_METRICS = (
    ("srl_generation_tokens_per_second", "gen_tokens_per_s", "Tokens/s over all generator workers"),
    ("srl_training_tokens_per_second", "train_tokens_per_s", "Tokens/s of the last optimizer step"),
    ("srl_trajectories_per_second", "trajectories_per_s", "Trajectories trained per second"),
)


def srl_metrics(snap: dict[str, Any]) -> Iterator[Any]:
    """srl's own metrics: throughput, weights, policy versions, staleness, drops."""
    t = snap["throughput"]
    for name, key, doc in THROUGHPUT_METRICS:
        if t[key] is not None:
            yield _gauge(name, doc, value=t[key])
    yield from _serving_metrics(snap.get("serving"))
    yield from _weights_metrics(snap["weights"])
    yield from _version_metrics(snap["versions"])
    if "store" in snap:
        yield from _store_metrics(snap["store"])
    yield _labelled(
        "srl_staleness_samples",
        "Samples per staleness (v - b) in the window",
        "staleness",
        snap["staleness"]["histogram"].items(),
    )
    yield _labelled(
        "srl_dropped_samples",
        "Samples not trained in the window, by outcome",
        "outcome",
        snap["drops"]["by_outcome"].items(),
    )
    yield _gauge(
        "srl_dead_letter_records",
        "Records on the dead-letter topic",
        value=snap["drops"]["dead_letter_records"],
    )
    yield _gauge(
        "srl_unreadable_metric_records",
        "Records of the metrics topic that are no metric event (read since the monitor started)",
        value=snap["drops"].get("unreadable_metric_records", 0),
    )


SERVING_METRICS = (
    ("srl_serving_requests_per_second", "requests_per_s", "Requests/s over all srl serve workers"),
    ("srl_serving_in_flight", "in_flight", "Choices running or waiting for a batch slot"),
    ("srl_serving_waiting", "waiting", "Choices waiting for a batch slot"),
    ("srl_serving_served", "served", "Served choices finished in the window"),
    ("srl_serving_published", "published", "Served trajectories published in the window"),
    ("srl_serving_trained", "trained", "Served trajectories trained in the window"),
    ("srl_serving_publish_dropped", "publish_dropped", "Served trajectories not published"),
    ("srl_serving_delivery_failures", "delivery_failures", "Records the broker did not take"),
    ("srl_serving_queue_timeouts", "queue_timeouts", "Requests refused with 503 in the window"),
    ("srl_serving_queue_wait_ms", "queue_wait_ms", "Mean wait for a first batch slot (ms)"),
)


def _serving_metrics(sv: dict[str, Any] | None) -> Iterator[Any]:
    """The serving line's figures; nothing when no srl serve reported in the window."""
    if not sv:
        return
    for name, key, doc in SERVING_METRICS:
        if sv[key] is not None:
            yield _gauge(name, doc, value=sv[key])


def _weights_metrics(w: dict[str, Any]) -> Iterator[Any]:
    if w["version"] is not None:
        ver = _gauge("srl_weights_version", "Latest announced policy version", labels=["run"])
        ver.add_metric([w["run"]], w["version"])
        yield ver
    ok = _gauge(
        "srl_weights_manifest_ok",
        "1 if the latest version's manifest verifies and its files exist",
        labels=["run"],
    )
    if w["version"] is not None:
        ok.add_metric([w["run"]], 1 if w["manifest_ok"] else 0)
    yield ok


def _store_metrics(st: dict[str, Any]) -> Iterator[Any]:
    yield _labelled(
        "srl_store_refused_in_a_row",
        "Writes of this kind the store refused in a row since the last that succeeded",
        "what",
        ((w, r["in_a_row"] or 0) for w, r in st["refused"].items()),
    )
    if st["checkpoint"] is not None:
        yield _gauge(
            "srl_checkpoint_age_seconds",
            "Seconds since the trainer's last complete checkpoint",
            value=st["checkpoint"]["age_s"],
        )


def _version_metrics(v: dict[str, Any]) -> Iterator[Any]:
    yield _labelled(
        "srl_generator_policy_version",
        "Policy version a generator worker runs",
        "source",
        ((src, ver) for src, ver in v["generators"].items() if ver is not None),
    )
    if v["trainer"] is not None:
        yield _gauge(
            "srl_trainer_policy_version",
            "Policy version after the trainer's last step",
            value=v["trainer"],
        )


def _gauge(name: str, doc: str, **kw: Any) -> Any:
    from prometheus_client.core import GaugeMetricFamily

    return GaugeMetricFamily(name, doc, **kw)


def _labelled(name: str, doc: str, label: str, items: Iterable[tuple[str, float]]) -> Any:
    """A gauge with one label, one sample per ``(label value, value)``."""
    family = _gauge(name, doc, labels=[label])
    for key, n in items:
        family.add_metric([key], n)
    return family


def run_top(
    cfg: TopConfig,
    *,
    once: bool,
    as_json: bool,
    prometheus: int | None,
    listen: str,
    interval_s: float,
    window_s: float,
    stall_after_s: float,
) -> None:

    monitor = Monitor(cfg, window_s=window_s, stall_after_s=stall_after_s)
    try:
        if once or as_json:
            snap = monitor.snapshot()
            if as_json:
                echo_json(snap)
            else:
                from rich.console import Console

                console = Console()
                if not console.is_terminal:  # a pipe or file: full columns, no truncation
                    console = Console(width=240)
                console.print(render(snap))
        elif prometheus is not None:
            _serve(monitor, prometheus, listen, interval_s)
        else:
            _live(monitor, interval_s)
    except KeyboardInterrupt:
        pass  # Ctrl-C ends a live view or the exporter normally
    finally:
        monitor.close()


def _live(monitor: Any, interval_s: float) -> None:
    from rich.live import Live

    with Live(render(monitor.snapshot()), auto_refresh=False, screen=False) as live:
        while True:
            time.sleep(interval_s)
            live.update(render(monitor.snapshot()), refresh=True)


def _serve(monitor: Any, port: int, listen: str, interval_s: float) -> None:
    import click
    from prometheus_client import CollectorRegistry, start_http_server

    collector = SnapshotCollector()
    registry = CollectorRegistry()
    registry.register(collector)
    try:
        server, thread = start_http_server(port, addr=listen, registry=registry)
    except OSError as e:
        raise SrlError(f"cannot listen on {listen}:{port}: {e.strerror or e}") from None
    click.echo(f"serving Prometheus metrics on http://{listen}:{port}/metrics", err=True)
    try:
        while True:
            try:
                collector.snap, collector.up = monitor.snapshot(), 1
            except SrlError as e:  # keep serving the last snapshot; srl_top_up says it is old
                collector.up = 0
                log.warning("refresh failed: %s", e)
            time.sleep(interval_s)
    finally:
        server.shutdown()
        thread.join(5)
