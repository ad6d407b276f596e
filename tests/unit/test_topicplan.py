"""The layout on paper (``srl topics plan``) and held against a cluster's topics
(``srl.topicplan.problems``: what ``srl topics check`` prints and the roles refuse)."""

from __future__ import annotations

import shlex

import yaml

from srl.topicplan import Found, kafka_topics_commands, plan_json, problems, strimzi_yaml
from srl.topics import Layout, TopicSpec

LAYOUT = Layout(prefix="exp")
TRAJ = next(s for s in LAYOUT.specs() if s.name == "exp.trajectories")
WEIGHTS = next(s for s in LAYOUT.specs() if s.name == "exp.weights")
EPOCHS = next(s for s in LAYOUT.specs() if s.name == "exp.pool.epochs")


def test_the_plan_as_json_commands_and_strimzi_resources() -> None:
    specs = LAYOUT.specs()
    plan = plan_json(specs, 3, 2)
    assert [p["topic"] for p in plan] == [s.name for s in specs]
    traj = next(p for p in plan if p["topic"] == "exp.trajectories")
    assert traj["partitions"] == 8 and traj["replication_factor"] == 3
    assert traj["config"] == {"max.message.bytes": "1048576", "min.insync.replicas": "2"}
    cmds = kafka_topics_commands(specs, "k:9092", None, None)
    args = shlex.split(cmds[specs.index(WEIGHTS)])
    assert args[:5] == [
        "kafka-topics.sh",
        "--bootstrap-server",
        "k:9092",
        "--create",
        "--if-not-exists",
    ]
    assert "--replication-factor" not in args and "cleanup.policy=compact" in args
    docs = [d for d in yaml.safe_load_all(strimzi_yaml(specs, "prod", None, 2)) if d]
    assert len(docs) == len(specs)
    w = next(d for d in docs if d["spec"]["topicName"] == "exp.weights")
    assert w["kind"] == "KafkaTopic" and w["metadata"]["labels"] == {"strimzi.io/cluster": "prod"}
    assert w["spec"]["replicas"] == 3 and w["spec"]["config"]["cleanup.policy"] == "compact"


def test_minimal_configs_keep_only_what_correctness_needs() -> None:
    full = {s.name: s.config for s in Layout(prefix="exp", retention_ms=3_600_000).specs()}
    minimal = {
        s.name: s.config for s in Layout(prefix="exp", retention_ms=3_600_000).specs("minimal")
    }
    assert minimal["exp.weights"] == {"cleanup.policy": "compact"}
    assert minimal["exp.pool.epochs"] == {} and minimal["exp.pool.beats"] == {}
    assert full["exp.pool.epochs"] == {"retention.ms": "-1"}
    assert minimal["exp.trajectories"] == full["exp.trajectories"]  # the retention asked for


def test_partitions_beyond_the_layout_have_no_bucket() -> None:
    assert LAYOUT.bucket_of_partition(7) == "gt4096"
    assert LAYOUT.bucket_of_partition(8) is None and LAYOUT.bucket_of_partition(-1) is None


def test_problems_name_what_a_role_would_refuse() -> None:
    fits = Found(TRAJ.name, 8, 3)
    assert problems(TRAJ, fits, 3) == []
    assert problems(TRAJ, Found(TRAJ.name, 7, 1))[0] == (
        "error",
        "topic exp.trajectories has 7 partitions, fewer than the layout's 8",
    )
    assert "more than" in problems(TRAJ, Found(TRAJ.name, 9, 1))[0][1]
    assert problems(TRAJ, Found(TRAJ.name, 8, 1), replication=3) == [
        ("error", "topic exp.trajectories has 1 replicas, not 3")
    ]
    assert problems(TRAJ, Found(TRAJ.name, 8, 1), brokers=3)[0][0] == "warning"


def test_configs_that_differ_from_the_layout() -> None:
    plain = Found(WEIGHTS.name, 1, 1, configs={"cleanup.policy": "delete"})
    assert problems(WEIGHTS, plain)[0][0] == "error"  # followers rely on compaction
    assert problems(WEIGHTS, Found(WEIGHTS.name, 1, 1, configs={"cleanup.policy": "compact"})) == []
    week = Found(EPOCHS.name, 1, 1, configs={"retention.ms": "604800000"})
    assert problems(EPOCHS, week) == [
        ("warning", "topic exp.pool.epochs: retention.ms 604800000, the layout's is -1 (forever)")
    ]
    isr = Found(TRAJ.name, 8, 3, configs={"min.insync.replicas": "1"})
    assert problems(TRAJ, isr, 3, 2) == [
        ("error", "topic exp.trajectories: min.insync.replicas 1, not 2")
    ]
    assert problems(TopicSpec("x", 1, {}), Found("x", 1, 1, configs={"cleanup.policy": "compact"}))
