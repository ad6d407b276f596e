"""``srl top`` on the real broker: exact lag for known committed offsets, backlog tokens,
metric events, weights health, stalled partitions, the Prometheus endpoint, errors."""

from __future__ import annotations

import subprocess
import time
import urllib.request
from collections import defaultdict
from typing import Any

import orjson
import pytest

from schemas.records import TrajectoryChunk
from srl.broker import free_port
from srl.kafka import (
    TopicPartition,
    committed_offsets,
    create_topics,
    make_consumer,
    watermarks,
)
from srl.topics import Layout
from tests.chunks import produce, traj_chunks
from tests.conftest import bin_path


def top_json(env: dict[str, str], *args: str) -> dict[str, Any]:
    out = subprocess.run(
        [bin_path("srl"), "top", "--json", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return dict(orjson.loads(out.stdout))


def chunks_in_buckets(layout: Layout) -> list[TrajectoryChunk]:
    """Trajectories in three buckets; chunk sizes differ so token counts are checkable."""
    out: list[TrajectoryChunk] = []
    for i, (bucket, length, size) in enumerate(
        [("le256", 10, 4), ("le256", 7, 4), ("le1024", 12, 5), ("le1024", 9, 5), ("le4096", 6, 6)]
    ):
        out += traj_chunks(
            f"p{i}", 0, 1, [1, 2], list(range(length)), chunk_tokens=size, bucket=bucket, versions=0
        )
    return out


def layout_offsets(layout: Layout, chunks: list[TrajectoryChunk]) -> dict[int, list[int]]:
    """Tokens of each record by partition, in offset order (fresh topics start at 0)."""
    by_part: dict[int, list[int]] = defaultdict(list)
    for c in chunks:
        by_part[layout.partition_for(c.bucket, c.trajectory_id)].append(c.n_tokens)
    return by_part


def test_once_json_reports_exact_lag_for_known_committed_offsets(cfg, cli_env) -> None:  # type: ignore[no-untyped-def]
    create_topics(cfg)
    layout = Layout.from_config(cfg)
    chunks = chunks_in_buckets(layout)
    produce(cfg, chunks)
    tokens = layout_offsets(layout, chunks)
    used = sorted(tokens)
    assert len(used) >= 3
    # Known commits: the first used partition fully consumed, the second half-way, the others
    # nothing at all (current_offset and lag must be null there).
    commits = {used[0]: len(tokens[used[0]]), used[1]: len(tokens[used[1]]) // 2}
    group = f"{cfg.topic_prefix}.trainer"
    with make_consumer(cfg, group, "test") as member:
        member.commit_sync([TopicPartition(layout.trajectories, p, o) for p, o in commits.items()])

    snap = top_json(cli_env)
    rows = {r["partition"]: r for r in snap["groups"] if r["group"] == group}
    marks = watermarks(cfg, [layout.trajectories])
    broker_commits = committed_offsets(cfg, group, list(marks))
    assert sorted(rows) == list(range(layout.trajectory_partition_count))
    for p, r in rows.items():
        high = marks[(layout.trajectories, p)][1]
        committed = broker_commits[(layout.trajectories, p)]
        assert committed == commits.get(p)
        assert r["topic"] == layout.trajectories and r["bucket"] == layout.bucket_of_partition(p)
        assert r["log_end_offset"] == high == len(tokens.get(p, []))
        assert r["current_offset"] == committed
        assert r["lag"] == (None if committed is None else high - committed)
    assert (
        rows[used[0]]["lag"] == 0
        and rows[used[1]]["lag"] == len(tokens[used[1]]) - commits[used[1]]
    )
    # Backlog per bucket: records from the committed offset (or the log start), tokens exact.
    expect: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for p, toks in tokens.items():
        pending = toks[commits.get(p, 0) :]
        expect[layout.bucket_of_partition(p)][0] += len(pending)
        expect[layout.bucket_of_partition(p)][1] += sum(pending)
    backlog = {b["bucket"]: b for b in snap["backlog"] if b["group"] == group}
    for bucket, (records, toks) in expect.items():
        assert (backlog[bucket]["records"], backlog[bucket]["tokens"]) == (records, toks)
        assert backlog[bucket]["tokens_exact"]
    assert snap["versions"]["in_backlog"] == {
        "0": sum(len(t) for t in tokens.values()) - commits[used[0]] - commits[used[1]]
    }
    # the group has no member: partitions with lag are flagged
    assert {s["partition"] for s in snap["stalled"] if s["group"] == group} == {
        p for p, r in rows.items() if r["lag"]
    }
    assert snap["weights"] == {
        "run": "default",
        "version": None,
        "manifest_uri": None,
        "manifest_ok": None,
        "error": None,
    }


def test_members_and_the_text_view(cfg, cli_env) -> None:  # type: ignore[no-untyped-def]
    create_topics(cfg)
    layout = Layout.from_config(cfg)
    produce(cfg, chunks_in_buckets(layout))
    group = f"{cfg.topic_prefix}.live"
    consumer = make_consumer(cfg, group, "trainer")
    try:
        consumer.subscribe([layout.trajectories])
        deadline = time.monotonic() + 30
        while not consumer.assignment() and time.monotonic() < deadline:
            consumer.poll(0.2)
        consumer.commit_sync(
            [
                TopicPartition(layout.trajectories, p, 0)
                for p in range(layout.trajectory_partition_count)
            ]
        )
        snap = top_json(cli_env)
        rows = [r for r in snap["groups"] if r["group"] == group]
        assert len(rows) == layout.trajectory_partition_count
        assert all(
            r["consumer_id"] and r["client_id"].startswith(f"{cfg.topic_prefix}.trainer-")
            for r in rows
        )
        assert all(r["host"] and r["state"] == "STABLE" for r in rows)
        assert snap["group_info"][group] == {"state": "STABLE", "members": 1}
        assert not [s for s in snap["stalled"] if s["group"] == group]  # consumed, just started
        text = subprocess.run(
            [bin_path("srl"), "top", "--once"],
            env=cli_env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert text.returncode == 0, text.stderr
        header = next(line for line in text.stdout.splitlines() if "CURRENT-OFFSET" in line)
        assert header.split() == [
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
        ]
        assert f"{group} " in text.stdout and "weights: no version announced" in text.stdout
    finally:
        consumer.close()


def test_metric_events_weights_and_dead_letters(s3_server, s3_url, make_cfg, cli_env) -> None:  # type: ignore[no-untyped-def]
    import torch

    from srl.kafka import Producer
    from srl.metrics import Metrics, dead_letter
    from srl.stores import open_store
    from srl.weights import announce, publish, version_prefix
    from tests.s3server import TEST_CREDENTIALS

    cfg = make_cfg(store=s3_url, s3_endpoint_url=s3_server.endpoint, run="r7")
    env = {
        **cli_env,
        **TEST_CREDENTIALS,
        "SRL_STORE": s3_url,
        "SRL_RUN": "r7",
        "SRL_S3_ENDPOINT_URL": s3_server.endpoint,
    }
    create_topics(cfg)
    layout = Layout.from_config(cfg)
    store = open_store(s3_url)
    pub = publish(store, "r7", 3, {"w": torch.ones(4, 4)}, trainer_step=9, parent_version=2)
    with Producer(cfg) as p:
        announce(p, layout, pub)
        gen = [Metrics(p, layout, "r7", f"gen-{i}") for i in range(2)]
        gen[0].emit("gen_stats", {"tokens_per_s": 100, "policy_version": 3}, {"simulated": "false"})
        gen[1].emit("gen_stats", {"tokens_per_s": 50, "policy_version": 2}, {"simulated": "false"})
        trainer = Metrics(p, layout, "r7", "trainer-0")
        trainer.emit("train_step", {"tokens_per_s": 80, "policy_version": 3}, step=9)
        trainer.emit("weights_published", {"version": 3, "bytes": 64, "publish_s": 0.1})
        for staleness, outcome in (
            [(0, "trained")] * 3 + [(1, "trained")] * 2 + [(3, "dropped_stale")]
        ):
            trainer.emit("sample", {"staleness": staleness}, {"outcome": outcome})
        Metrics(p, layout, "other-run", "trainer-x").emit(
            "sample", {"staleness": 9}, {"outcome": "trained"}
        )
        trainer.incr("dead_letters", 2)
        trainer.flush_counters()
        dead_letter(p, layout, b"junk", b"k", "cannot decode", f"{layout.trajectories}/0@5")
    snap = top_json(env)
    assert snap["throughput"]["gen_tokens_per_s"] == 150
    assert snap["throughput"]["train_tokens_per_s"] == 80
    assert snap["throughput"]["trajectories_per_s"] > 0
    assert snap["versions"] == {
        "trainer": 3,
        "published": 3,
        "in_backlog": {},
        "generators": {"gen-0": 3, "gen-1": 2},
    }
    assert snap["staleness"] == {"histogram": {"0": 3, "1": 2, "3": 1}, "mean": 5 / 6, "max": 3}
    assert snap["drops"] == {
        "by_outcome": {"dropped_stale": 1},
        "dead_letters_counted": 2,
        "dead_letter_records": 1,
        "unreadable_metric_records": 0,
    }
    assert snap["weights"]["version"] == 3 and snap["weights"]["manifest_ok"] is True
    assert snap["weights"]["manifest_uri"] == pub.manifest_uri
    store.delete(f"{version_prefix('r7', 3)}/model.safetensors")
    weights = top_json(env)["weights"]
    assert weights["manifest_ok"] is False and "model.safetensors" in weights["error"]


def test_a_partition_whose_offset_does_not_move_is_flagged(cfg) -> None:  # type: ignore[no-untyped-def]
    from app.monitor import Monitor

    create_topics(cfg)
    monitor = Monitor(cfg, stall_after_s=60)
    try:
        row = {
            "group": "g",
            "topic": "t",
            "partition": 0,
            "current_offset": 5,
            "lag": 3,
            "consumer_id": "m-1",
        }
        assert monitor.stalled([row], now=1_000_000) == []
        assert monitor.stalled([row], now=1_059_000) == []
        assert monitor.stalled([row], now=1_061_000)[0]["reason"].startswith(
            "committed offset unchanged"
        )
        moved = {**row, "current_offset": 6, "lag": 2}
        assert monitor.stalled([moved], now=1_062_000) == []
        assert monitor.stalled([{**moved, "lag": 0}], now=1_200_000) == []  # caught up: fine
        # the trainer's position group has no members by design: flagged only when it stops
        pos = {**row, "group": "p.trainer.r.position", "consumer_id": None}
        assert monitor.stalled([pos], now=2_000_000) == []
        assert monitor.stalled([pos], now=2_061_000)[0]["reason"].startswith(
            "committed offset unchanged"
        )
        assert monitor.stalled([{**pos, "group": "g2"}], now=2_062_000)[0]["reason"] == (
            "no consumer assigned"
        )
    finally:
        monitor.close()


def test_prometheus_endpoint_uses_kafka_exporter_names(cfg, cli_env) -> None:  # type: ignore[no-untyped-def]
    from prometheus_client.parser import text_string_to_metric_families

    create_topics(cfg)
    layout = Layout.from_config(cfg)
    chunks = chunks_in_buckets(layout)
    produce(cfg, chunks)
    tokens = layout_offsets(layout, chunks)
    p0 = min(tokens)
    group = f"{cfg.topic_prefix}.prom"
    with make_consumer(cfg, group, "test") as c:
        c.commit_sync([TopicPartition(layout.trajectories, p0, 1)])
    port = free_port()
    proc = subprocess.Popen(
        [bin_path("srl"), "top", "--prometheus", str(port), "--interval", "0.5"],
        env=cli_env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        samples: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()[1]
            try:
                body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read()
            except OSError:
                time.sleep(0.3)
                continue
            samples = {
                (s.name, frozenset(s.labels.items())): s.value
                for fam in text_string_to_metric_families(body.decode())
                for s in fam.samples
            }
            if ("srl_top_up", frozenset()) in samples and samples[("srl_top_up", frozenset())] == 1:
                break
            time.sleep(0.3)
        labels = frozenset(
            {"consumergroup": group, "topic": layout.trajectories, "partition": str(p0)}.items()
        )
        assert samples[("kafka_consumergroup_lag", labels)] == len(tokens[p0]) - 1
        assert samples[("kafka_consumergroup_current_offset", labels)] == 1
        other = frozenset(
            {"consumergroup": group, "topic": layout.trajectories, "partition": str(p0 + 1)}.items()
        )
        assert samples[("kafka_consumergroup_current_offset", other)] == -1  # as kafka_exporter
        assert ("kafka_consumergroup_lag", other) not in samples
        part = frozenset({"topic": layout.trajectories, "partition": str(p0)}.items())
        assert samples[("kafka_topic_partition_current_offset", part)] == len(tokens[p0])
        assert (
            samples[("kafka_topic_partitions", frozenset({"topic": layout.trajectories}.items()))]
            == layout.trajectory_partition_count
        )
        assert (
            samples[("kafka_consumergroup_members", frozenset({"consumergroup": group}.items()))]
            == 0
        )
        assert (
            samples[
                (
                    "kafka_consumergroup_lag_sum",
                    frozenset({"consumergroup": group, "topic": layout.trajectories}.items()),
                )
            ]
            == len(tokens[p0]) - 1
        )
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=15)
    assert f"serving Prometheus metrics on http://127.0.0.1:{port}/metrics" in err


def test_unreachable_broker_is_one_line(cli_env) -> None:  # type: ignore[no-untyped-def]
    env = {
        **cli_env,
        "SRL_BOOTSTRAP_SERVERS": f"127.0.0.1:{free_port()}",
        "SRL_CONNECT_TIMEOUT_S": "1",
    }
    out = subprocess.run(
        [bin_path("srl"), "top", "--json"], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode != 0 and out.stdout == ""
    assert (
        out.stderr.startswith("srl: error: no Kafka broker answered")
        and out.stderr.count("\n") == 1
    )


@pytest.mark.slow
def test_top_reads_what_the_real_trainer_reports(cfg, cli_env, tiny_model) -> None:  # type: ignore[no-untyped-def]
    """The real `srl-consumer train` on a few groups; `srl top` then shows its group caught up,
    its weights verified, and its steps, staleness and outcomes from the metric events."""
    from tests.chunks import text_ids

    create_topics(cfg)
    chunks: list[TrajectoryChunk] = []
    for g in range(4):
        for i in range(4):
            chunks += traj_chunks(
                f"p{g}",
                i,
                4,
                text_ids(f"{g}+1="),
                text_ids(f"{g + i % 2 + 1}\n"),
                chunk_tokens=2,
                metadata={"answer": g + 1},
            )
    produce(cfg, chunks)
    args = [
        bin_path("srl-consumer"),
        "train",
        "--model",
        str(tiny_model),
        "--groups-per-step",
        "2",
        "--max-steps",  # 4 groups: done after 2 (the idle exit ends one that stops short)
        "2",
        "--idle-exit-s",
        "4",
        "--device",
        "cpu",
        "--reward",
        "consumers.rewards:first_line_match",
    ]
    out = subprocess.run(args, env=cli_env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    snap = top_json(cli_env)
    rows = [r for r in snap["groups"] if r["group"] == f"{cfg.topic_prefix}.trainer.default"]
    assert rows and all(r["lag"] == 0 for r in rows if r["log_end_offset"] > 0)
    assert sum(r["log_end_offset"] for r in rows) == len(chunks)
    assert snap["weights"]["version"] == 2 and snap["weights"]["manifest_ok"] is True
    assert snap["versions"]["published"] == 2 and snap["versions"]["trainer"] == 2
    assert snap["staleness"]["histogram"] == {"0": 8, "1": 8}  # steps v0->v1 and v1->v2 on b = 0
    assert snap["drops"]["by_outcome"] == {} and not snap["stalled"]
