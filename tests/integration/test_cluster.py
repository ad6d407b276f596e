"""The cluster tier: three Apache Kafka nodes (``srl broker start --engine kafka --nodes 3``),
replication factor 3, ``min.insync.replicas`` 2, producers ``acks=all``.

* the topics srl creates get three replicas and the cluster's ``min.insync.replicas`` 2;
* the leader of a partition SIGKILLed under a steady idempotent producer loses nothing it
  acknowledged, and nothing is written twice: a broker lost under load loses nothing;
* a client that knew a partition's leader before it was SIGKILLed finds the new one: offsets
  are answered while the old leader is still down (the generators' weights follower);
* srl's data plane (``srl smoke``: chunks through the real codec and topics, consumed in a
  group, reassembled) runs on the cluster with only ``--bootstrap``.

The cluster is the session's (``cluster`` fixture); a test that stops a node starts it again
and waits until every partition is fully replicated before it ends.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from typing import Any

import pytest

from srl.broker.apache import KafkaCluster
from srl.kafka import (
    Producer,
    TopicPartition,
    admin,
    create_topics,
    read_range,
    reader,
    topic_config,
)
from srl.topics import Layout, TopicSpec
from tests.conftest import bin_path

pytestmark = pytest.mark.cluster


def replicas(cfg: Any, topic: str) -> dict[int, tuple[int, list[int], list[int]]]:
    """partition -> (leader, replicas, in-sync replicas)."""
    parts = admin(cfg).list_topics(topic, timeout=10).topics[topic].partitions
    return {p: (m.leader, list(m.replicas), list(m.isrs)) for p, m in parts.items()}


def wait_fully_replicated(cfg: Any, topic: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        # a node whose metadata does not know the topic yet answers with no partitions: wait
        # for them too (all() of nothing held at once, then replicas()[0] failed: KeyError 0)
        parts = replicas(cfg, topic)
        if parts and all(len(isr) == 3 and leader >= 0 for leader, _r, isr in parts.values()):
            return
        assert time.monotonic() < deadline, parts
        time.sleep(0.5)


def test_srl_topics_have_three_replicas_and_min_insync_2(cfg, cluster: KafkaCluster) -> None:  # type: ignore[no-untyped-def]
    assert len(cluster.nodes) == 3 and cfg.bootstrap_servers == cluster.bootstrap
    created = create_topics(cfg)
    layout = Layout.from_config(cfg)
    assert set(created) == {s.name for s in layout.specs()}
    for spec in layout.specs():
        parts = replicas(cfg, spec.name)
        assert len(parts) == spec.partitions
        assert all(sorted(r) == [1, 2, 3] for _l, r, _i in parts.values()), (spec.name, parts)
        assert topic_config(cfg, spec.name)["min.insync.replicas"] == "2"


def test_a_leader_sigkilled_under_load_loses_no_acknowledged_record(
    cfg,  # type: ignore[no-untyped-def]
    cluster: KafkaCluster,
) -> None:
    topic = f"{cfg.topic_prefix}.load"
    create_topics(cfg, [TopicSpec(topic, 1, {})])
    wait_fully_replicated(cfg, topic)
    leader = replicas(cfg, topic)[0][0]
    acked: list[int] = []
    failed: list[str] = []
    stop = threading.Event()

    def on_delivery(err: Any, msg: Any) -> None:
        (failed.append(str(err)) if err is not None else acked.append(int(msg.value())))

    def send() -> None:
        with Producer(cfg, "test") as p:
            i = 0
            while not stop.is_set():
                p.produce(topic, str(i).encode(), key=str(i % 7), on_delivery=on_delivery)
                p.poll(0)
                i += 1
                time.sleep(0.004)
            p.flush(60)

    sender = threading.Thread(target=send)
    sender.start()
    try:
        deadline = time.monotonic() + 60
        while len(acked) < 300 and time.monotonic() < deadline:
            time.sleep(0.05)
        at_kill = len(acked)
        cluster.kill(leader)
        # the producer goes on: a new leader among the two in-sync followers takes the writes
        deadline = time.monotonic() + 60
        while len(acked) < at_kill + 500 and time.monotonic() < deadline:
            time.sleep(0.05)
        stop.set()
        sender.join(timeout=120)
        assert len(acked) >= at_kill + 500, (at_kill, len(acked), failed[:3])
        assert replicas(cfg, topic)[0][0] not in (leader, -1)
        got = [int(m.value() or b"-1") for m in read_range(cfg, topic, timeout_s=60)]
    finally:
        stop.set()
        cluster.start_node(leader)
    assert not failed, failed[:5]
    assert set(acked) <= set(got), sorted(set(acked) - set(got))[:10]
    assert got == sorted(got) and len(got) == len(set(got))  # idempotent: once each, in order
    wait_fully_replicated(cfg, topic)


def test_offsets_are_answered_while_a_lost_leader_is_down(cfg, cluster: KafkaCluster) -> None:  # type: ignore[no-untyped-def]
    """librdkafka asked the dead leader until its metadata of the topic expired (minutes): the
    generators' weights follower could not sync, so they admitted nothing (srl chaos,
    kafka-leader-kill)."""
    topic = f"{cfg.topic_prefix}.offsets"
    create_topics(cfg, [TopicSpec(topic, 1, {})])
    wait_fully_replicated(cfg, topic)
    with Producer(cfg, "test") as p:
        for i in range(5):
            p.produce(topic, str(i).encode())
    probe = reader(cfg, "test-probe")
    tp = TopicPartition(topic, 0)
    try:
        assert probe.get_watermark_offsets(tp, timeout=10) == (0, 5)
        leader = replicas(cfg, topic)[0][0]
        cluster.kill(leader)
        try:
            # the new leader is elected once the controller misses the node's heartbeats
            assert probe.get_watermark_offsets(tp, timeout=30) == (0, 5)
            assert cluster.node(leader).pid is not None and not cluster.running(
                cluster.node(leader)
            )
        finally:
            cluster.start_node(leader)
    finally:
        probe.close()
    wait_fully_replicated(cfg, topic)


@pytest.mark.slow
def test_srl_smoke_runs_on_the_cluster_with_only_bootstrap(cli_env: dict[str, str]) -> None:
    env = {**os.environ, **cli_env}
    out = subprocess.run(
        [bin_path("srl"), "smoke", "--trajectories", "60"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
