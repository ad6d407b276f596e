"""``srl top``: a live terminal view of every srl topic and group, one JSON snapshot, or a
Prometheus ``/metrics`` endpoint with kafka_exporter's names.

* ``render(snapshot)``: rich tables (consumer groups in the columns of
  ``kafka-consumer-groups.sh``, backlog per bucket, throughput, weights, versions,
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
from collections.abc import Iterator
from typing import Any

from app.cli.common import echo_json
from app.configs import TopConfig
from app.monitor import Monitor
from srl.errors import SrlError

log = logging.getLogger("app.top")


def _s(v: Any) -> str:
    return "-" if v is None else str(v)


def render(snap: dict[str, Any]) -> Any:
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    parts: list[Any] = [
        Text(
            f"srl top  {snap['bootstrap']}  prefix {snap['prefix']}  run {snap['run']}  "
            f"{time.strftime('%H:%M:%S', time.localtime(snap['ts_ms'] / 1000))}",
            style="bold",
        )
    ]
    for s in snap["stalled"]:
        parts.append(
            Text(
                f"STALLED {s['group']} {s['topic']}[{s['partition']}] lag {s['lag']}: "
                f"{s['reason']}",
                style="bold red",
            )
        )
    groups = Table(
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
        box=None,
        title="consumer groups",
        title_justify="left",
    )
    for r in snap["groups"]:
        groups.add_row(
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
    parts.append(groups if snap["groups"] else Text("no consumer group on srl topics yet"))
    if snap["backlog"]:
        backlog = Table(
            "GROUP",
            "TOPIC",
            "BUCKET",
            "RECORDS",
            "TOKENS",
            box=None,
            title="backlog per length bucket",
            title_justify="left",
        )
        for b in snap["backlog"]:
            tokens = f"{b['tokens']}" if b["tokens_exact"] else f"~{b['tokens']}"
            backlog.add_row(b["group"], b["topic"], b["bucket"], str(b["records"]), tokens)
        parts.append(backlog)
    t, w, v, st, d = (snap[k] for k in ("throughput", "weights", "versions", "staleness", "drops"))
    sim = " (simulated engine)" if t["simulated"] else ""
    parts.append(
        Text(
            f"throughput: generation {_rate(t['gen_tokens_per_s'])} tok/s{sim}, training "
            f"{_rate(t['train_tokens_per_s'])} tok/s, {_rate(t['trajectories_per_s'], 2)} "
            f"trajectories/s"
        )
    )
    if w["version"] is None:
        parts.append(Text(f"weights: no version announced for run {w['run']}", style="yellow"))
    else:
        ok = "manifest ok" if w["manifest_ok"] else f"MANIFEST NOT OK: {w['error']}"
        parts.append(
            Text(
                f"weights: {w['run']} v{w['version']}  {ok}",
                style="green" if w["manifest_ok"] else "bold red",
            )
        )
    gens = ", ".join(f"{k}=v{_s(x)}" for k, x in v["generators"].items()) or "-"
    backlog_v = ", ".join(f"v{k}:{n}" for k, n in v["in_backlog"].items()) or "-"
    parts.append(
        Text(
            f"versions: trainer {_s(v['trainer'])}, published {_s(v['published'])}, "
            f"generators {gens}, in backlog (sampled chunks) {backlog_v}"
        )
    )
    hist = "  ".join(f"{k}:{n}" for k, n in st["histogram"].items()) or "-"
    parts.append(
        Text(
            f"staleness (last {snap['window_s']:g}s): {hist}   mean {_rate(st['mean'], 2)}"
            f"  max {_s(st['max'])}"
        )
    )
    drops = ", ".join(f"{k} {n}" for k, n in d["by_outcome"].items()) or "none"
    parts.append(Text(f"drops: {drops}; dead letters: {d['dead_letter_records']} on the DLQ"))
    return Group(*parts)


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
        snap = self.snap
        P = ["topic", "partition"]
        CG = ["consumergroup", "topic", "partition"]
        m = {
            "parts": G(
                "kafka_topic_partitions", "Number of partitions for this Topic", labels=["topic"]
            ),
            "cur": G(
                "kafka_topic_partition_current_offset",
                "Current Offset of a Broker at Topic/Partition",
                labels=P,
            ),
            "old": G(
                "kafka_topic_partition_oldest_offset",
                "Oldest Offset of a Broker at Topic/Partition",
                labels=P,
            ),
            "gcur": G(
                "kafka_consumergroup_current_offset",
                "Current Offset of a ConsumerGroup at Topic/Partition",
                labels=CG,
            ),
            "gcursum": G(
                "kafka_consumergroup_current_offset_sum",
                "Current Offset of a ConsumerGroup at Topic for all partitions",
                labels=CG[:2],
            ),
            "lag": G(
                "kafka_consumergroup_lag",
                "Current Approximate Lag of a ConsumerGroup at Topic/Partition",
                labels=CG,
            ),
            "lagsum": G(
                "kafka_consumergroup_lag_sum",
                "Current Approximate Lag of a ConsumerGroup at Topic for all partitions",
                labels=CG[:2],
            ),
            "members": G(
                "kafka_consumergroup_members",
                "Amount of members in a consumer group",
                labels=["consumergroup"],
            ),
            "brec": G(
                "srl_backlog_records",
                "Records not yet consumed by a group, per length bucket",
                labels=["consumergroup", "topic", "bucket"],
            ),
            "btok": G(
                "srl_backlog_tokens",
                "Tokens not yet consumed by a group, per length bucket (estimated past the sample)",
                labels=["consumergroup", "topic", "bucket"],
            ),
            "stalled": G(
                "srl_partition_stalled",
                "1 for a partition with lag and no progress or no consumer",
                labels=CG,
            ),
        }
        count: dict[str, int] = defaultdict(int)
        for r in snap["topics"]:
            count[r["topic"]] += 1
            m["cur"].add_metric([r["topic"], str(r["partition"])], r["high"])
            m["old"].add_metric([r["topic"], str(r["partition"])], r["low"])
        for topic, n in count.items():
            m["parts"].add_metric([topic], n)
        sums: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
        for r in snap["groups"]:
            labels = [r["group"], r["topic"], str(r["partition"])]
            current = r["current_offset"]
            m["gcur"].add_metric(labels, -1 if current is None else current)  # -1 as kafka_exporter
            if r["lag"] is not None:
                m["lag"].add_metric(labels, r["lag"])
                sums[(r["group"], r["topic"])][0] += current
                sums[(r["group"], r["topic"])][1] += r["lag"]
        for (g, topic), (cur, lag) in sums.items():
            m["gcursum"].add_metric([g, topic], cur)
            m["lagsum"].add_metric([g, topic], lag)
        for g, info in snap["group_info"].items():
            m["members"].add_metric([g], info["members"])
        for b in snap["backlog"]:
            m["brec"].add_metric([b["group"], b["topic"], b["bucket"]], b["records"])
            m["btok"].add_metric([b["group"], b["topic"], b["bucket"]], b["tokens"])
        for s in snap["stalled"]:
            m["stalled"].add_metric([s["group"], s["topic"], str(s["partition"])], 1)
        yield from m.values()
        yield from self._srl_metrics(snap)

    @staticmethod
    def _srl_metrics(snap: dict[str, Any]) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily as G

        t, w, v = snap["throughput"], snap["weights"], snap["versions"]
        for name, key, doc in (
            (
                "srl_generation_tokens_per_second",
                "gen_tokens_per_s",
                "Tokens/s over all generator workers",
            ),
            (
                "srl_training_tokens_per_second",
                "train_tokens_per_s",
                "Tokens/s of the last optimizer step",
            ),
            (
                "srl_trajectories_per_second",
                "trajectories_per_s",
                "Trajectories trained per second",
            ),
        ):
            if t[key] is not None:
                yield G(name, doc, value=t[key])
        if w["version"] is not None:
            ver = G("srl_weights_version", "Latest announced policy version", labels=["run"])
            ver.add_metric([w["run"]], w["version"])
            yield ver
        ok = G(
            "srl_weights_manifest_ok",
            "1 if the latest version's manifest verifies and its files exist",
            labels=["run"],
        )
        if w["version"] is not None:
            ok.add_metric([w["run"]], 1 if w["manifest_ok"] else 0)
        yield ok
        gen = G(
            "srl_generator_policy_version",
            "Policy version a generator worker runs",
            labels=["source"],
        )
        for src, ver in v["generators"].items():
            if ver is not None:
                gen.add_metric([src], ver)
        yield gen
        if v["trainer"] is not None:
            yield G(
                "srl_trainer_policy_version",
                "Policy version after the trainer's last step",
                value=v["trainer"],
            )
        hist = G(
            "srl_staleness_samples",
            "Samples per staleness (v - b) in the window",
            labels=["staleness"],
        )
        for k, n in snap["staleness"]["histogram"].items():
            hist.add_metric([k], n)
        yield hist
        drops = G(
            "srl_dropped_samples",
            "Samples not trained in the window, by outcome",
            labels=["outcome"],
        )
        for k, n in snap["drops"]["by_outcome"].items():
            drops.add_metric([k], n)
        yield drops
        yield G(
            "srl_dead_letter_records",
            "Records on the dead-letter topic",
            value=snap["drops"]["dead_letter_records"],
        )


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
