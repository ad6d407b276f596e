"""Apache Kafka's own tools and behaviours agree with srl (the Kafka tier; docs/broker.md).

* ``kafka-consumer-groups --describe`` gives the same offsets and lag per group and partition
  as ``srl top --json``;
* ``kafka-configs --describe`` shows every topic setting srl asks for;
* the log cleaner really compacts the weights topic: after a segment rolls, only the newest
  announcement per run is left, and srl's readers find it;
* a node SIGKILLed right after acknowledging records (``acks=all``) still has every one of
  them after its restart (the embedded broker loses its last ~0.5 s: docs/broker.md);
* srl works unchanged (only ``--bootstrap``) on a node someone else started from the same
  jars with Kafka's stock settings, and on stock Kafka 3.9, 3.7 and 3.0 nodes (3.0: the
  oldest that passes; docs/broker.md, "Kafka versions").

Marked ``kafka``: on an Apache Kafka node whatever the default tier is (tests/conftest.py).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from schemas.records import WeightsAnnouncement, encode
from srl.broker import apache
from srl.broker.process import last_line
from srl.config import CommonConfig, load_config
from srl.kafka import (
    Producer,
    TopicPartition,
    committed_offsets,
    create_topics,
    make_consumer,
    read_range,
    watermarks,
)
from srl.kafka.groupprotocol import kip848_groups
from srl.topics import Layout, TopicSpec
from srl.weights import latest_announcement, read_announcements
from tests.chunks import produce, traj_chunks
from tests.conftest import TEST_KAFKA_JVM_OPTS, bin_path, kafka_node
from tests.integration.test_trainer import make_groups

pytestmark = pytest.mark.kafka


def tool(name: str, *args: str) -> str:
    out = apache.run_tool(name, list(args), timeout_s=180)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def top_json(env: dict[str, str]) -> dict[str, Any]:
    out = subprocess.run(
        [bin_path("srl"), "top", "--json"], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return dict(orjson.loads(out.stdout))


def describe_groups(bootstrap: str, groups: list[str]) -> dict[tuple[str, str, int], dict]:
    """``kafka-consumer-groups --describe`` rows keyed by (group, topic, partition)."""
    args = ["--bootstrap-server", bootstrap, "--describe"]
    for g in groups:
        args += ["--group", g]
    rows: dict[tuple[str, str, int], dict] = {}
    for line in tool("kafka-consumer-groups", *args).splitlines():
        cols = line.split()
        if len(cols) < 6 or cols[0] == "GROUP" or cols[0] not in groups:
            continue
        group, topic, part, current, end, lag = cols[:6]
        num = lambda s: None if s == "-" else int(s)  # noqa: E731
        rows[(group, topic, int(part))] = {
            "current_offset": num(current),
            "log_end_offset": num(end),
            "lag": num(lag),
            "consumer_id": None if len(cols) < 7 or cols[6] == "-" else cols[6],
        }
    return rows


def test_kafka_consumer_groups_gives_the_lag_srl_top_gives(cfg, cli_env) -> None:  # type: ignore[no-untyped-def]
    create_topics(cfg)
    layout = Layout.from_config(cfg)
    chunks = []
    for i, (bucket, n) in enumerate([("le256", 9), ("le256", 5), ("le1024", 12), ("le4096", 7)]):
        chunks += traj_chunks(f"p{i}", 0, 1, [1, 2], list(range(n)), chunk_tokens=3, bucket=bucket)
    produce(cfg, chunks)
    ends = {p: hi for (_t, p), (_lo, hi) in watermarks(cfg, [layout.trajectories]).items()}
    used = sorted(p for p, hi in ends.items() if hi > 0)
    assert len(used) >= 3
    # one group with known commits and no member; one with a live member that read everything
    idle = f"{cfg.topic_prefix}.trainer.idle"
    commits = {used[0]: ends[used[0]], used[1]: ends[used[1]] // 2, used[2]: 0}
    with make_consumer(cfg, idle, "test") as c:
        c.commit_sync([TopicPartition(layout.trajectories, p, o) for p, o in commits.items()])
    live = f"{cfg.topic_prefix}.trainer.live"
    member = make_consumer(cfg, live, "trainer")
    try:
        member.subscribe([layout.trajectories])
        deadline = time.monotonic() + 60
        read = 0
        while read < len(chunks) and time.monotonic() < deadline:
            read += len(member.consume(100, 0.5))
        assert read == len(chunks)
        member.commit_sync(
            [TopicPartition(layout.trajectories, p, ends[p]) for p in range(len(ends))]
        )
        ours = {
            (r["group"], r["topic"], r["partition"]): r
            for r in top_json(cli_env)["groups"]
            if r["group"] in (idle, live)
        }
        theirs = describe_groups(cfg.bootstrap_servers, [idle, live])
    finally:
        member.close()
    # a group without members: Kafka lists the partitions it committed; srl top every partition
    assert {k for k in theirs if k[0] == idle} == {(idle, layout.trajectories, p) for p in commits}
    assert {k for k in theirs if k[0] == live} == {
        (live, layout.trajectories, p) for p in range(len(ends))
    }
    for k, row in theirs.items():
        for col in ("current_offset", "log_end_offset", "lag"):
            assert ours[k][col] == row[col], (k, col, ours[k], row)
        assert (row["consumer_id"] is None) == (k[0] == idle)
        assert ours[k]["consumer_id"] == row["consumer_id"]
    assert theirs[(idle, layout.trajectories, used[1])]["lag"] == ends[used[1]] - commits[used[1]]


def topic_configs(bootstrap: str) -> dict[str, dict[str, str]]:
    """``kafka-configs --describe --entity-type topics``: each topic's dynamic settings."""
    out: dict[str, dict[str, str]] = {}
    topic = None
    for line in tool(
        "kafka-configs", "--bootstrap-server", bootstrap, "--describe", "--entity-type", "topics"
    ).splitlines():
        m = re.match(r"Dynamic configs for topic (\S+) are:", line)
        if m:
            topic = m.group(1)
            out[topic] = {}
        elif topic and "=" in line and line.startswith(" "):
            k, _, rest = line.strip().partition("=")
            out[topic][k] = rest.split(" sensitive=")[0]
    return out


def test_kafka_configs_shows_the_topic_settings_srl_asks_for(make_cfg) -> None:  # type: ignore[no-untyped-def]
    cfg = make_cfg(retention_ms=3_600_000)
    create_topics(cfg)
    seen = topic_configs(cfg.bootstrap_servers)
    specs = Layout.from_config(cfg).specs()
    assert any(s.config for s in specs)
    for spec in specs:
        assert spec.name in seen, spec.name
        for k, v in spec.config.items():
            assert seen[spec.name].get(k) == v, (spec.name, k, v, seen[spec.name])
    weights = Layout.from_config(cfg).weights
    assert seen[weights]["cleanup.policy"] == "compact"


def announcement(run: str, version: int) -> WeightsAnnouncement:
    return WeightsAnnouncement(
        run=run,
        version=version,
        manifest_uri=f"file:///nowhere/weights/{run}/v{version:08d}/manifest.json",
        manifest_sha256="0" * 64,
        trainer_step=version,
        total_bytes=1,
    )


def test_the_log_cleaner_compacts_the_weights_topic_to_the_newest_version_per_run(cfg) -> None:  # type: ignore[no-untyped-def]
    create_topics(cfg)
    layout = Layout.from_config(cfg)
    runs, versions = ("lead", "second"), 30
    with Producer(cfg, "test") as p:
        for v in range(1, versions + 1):
            for run in runs:
                p.produce(layout.weights, encode(announcement(run, v)), key=run)
        p.flush()
    assert len(read_announcements(cfg, layout)) == versions * len(runs)
    # roll the segment: a short segment.ms, then one more record once it has passed (the
    # active segment is never cleaned; the closed one is, by the broker's log cleaner)
    tool(
        "kafka-configs",
        "--bootstrap-server",
        cfg.bootstrap_servers,
        "--alter",
        "--entity-type",
        "topics",
        "--entity-name",
        layout.weights,
        "--add-config",
        "segment.ms=200",
    )
    time.sleep(1.0)
    with Producer(cfg, "test") as p:
        p.produce(layout.weights, encode(announcement("roll", 1)), key="roll")
        p.flush()
    deadline = time.monotonic() + 90
    while True:
        anns = read_announcements(cfg, layout)
        by_run = {r: [a.version for a in anns if a.run == r] for r in runs}
        if all(len(vs) == 1 for vs in by_run.values()) or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    assert by_run == {r: [versions] for r in runs}, by_run
    offsets = [m.offset() for m in read_range(cfg, layout.weights)]
    assert offsets[0] > 0 and len(offsets) < versions * len(runs)  # really gone from the log
    found = latest_announcement(cfg, layout, "lead")
    assert found is not None and found.version == versions


def test_the_first_group_request_on_a_fresh_node_waits_for_its_coordinator(
    tmp_path: Path,
) -> None:
    """On a node just started nothing has made ``__consumer_offsets`` yet: the first group
    request creates it and is answered NOT_COORDINATOR until the topic is loaded, which
    librdkafka reports instead of asking again. srl's offsets reads (a dispatcher's backlog,
    a trainer's starting point, ``srl report``) wait for the coordinator instead: a dispatcher
    that was a fresh node's first group member exited with ``kafka: Failed to get committed
    offsets: Broker: Not coordinator``."""
    with kafka_node(1, tmp_path / "kafka") as node:
        values = {"bootstrap_servers": node.bootstrap, "topic_prefix": "fresh"}
        cfg = load_config(CommonConfig, cli=values, env={})
        create_topics(cfg, [TopicSpec("fresh.t", 2, {})])
        parts = [("fresh.t", 0), ("fresh.t", 1)]
        assert committed_offsets(cfg, "fresh.g", parts) == dict.fromkeys(parts)


def test_a_sigkilled_node_keeps_every_record_it_acknowledged(tmp_path: Path) -> None:
    """``acks=all`` on one node, a steady producer, SIGKILL: after the restart every record
    whose delivery was acknowledged is there (the page cache outlives the process); the
    embedded broker loses its last ~0.5 s (docs/broker.md, ``srl.kafka.start_over``)."""
    with kafka_node(1, tmp_path / "kafka") as node:
        values = {"bootstrap_servers": node.bootstrap, "topic_prefix": "sigkill"}
        cfg = load_config(CommonConfig, cli=values, env={})
        topic = "sigkill.acked"
        create_topics(cfg, [TopicSpec(topic, 1, {})])
        acked: list[int] = []
        stop = threading.Event()

        def on_delivery(err: Any, msg: Any) -> None:
            if err is None:
                acked.append(int(msg.value()))

        def send() -> None:
            with Producer(cfg, "test") as p:
                i = 0
                while not stop.is_set():
                    p.produce(topic, str(i).encode(), key=str(i), on_delivery=on_delivery)
                    p.poll(0)
                    i += 1
                    time.sleep(0.005)
                p.purge_queued()

        sender = threading.Thread(target=send)
        sender.start()
        deadline = time.monotonic() + 60
        while len(acked) < 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        node.signal(1, signal.SIGKILL)
        before = len(acked)
        node.kill(1)
        stop.set()
        sender.join(timeout=60)
        assert before >= 200
        node.start_node(1)
        got = [int(m.value() or b"-1") for m in read_range(cfg, topic, timeout_s=60)]
    assert set(acked) <= set(got), sorted(set(acked) - set(got))[:10]
    assert got == sorted(got) and len(got) == len(set(got))  # idempotent: no duplicate, in order


STOCK = """\
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@127.0.0.1:{cport}
listeners=PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{cport}
advertised.listeners=PLAINTEXT://127.0.0.1:{port}
controller.listener.names=CONTROLLER
listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT
log.dirs={logs}
num.partitions=1
offsets.topic.replication.factor=1
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
"""
# Kafka 4.x's quick-start file also sets the share groups' state topic (KIP-932), a setting
# Kafka 3.x does not know
STOCK_4 = (
    STOCK
    + """\
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
"""
)


@contextlib.contextmanager
def stock_node(tmp_path: Path, cp: str, settings: str) -> Iterator[str]:
    """A one-node KRaft cluster as Kafka's quick start runs it, from the jars ``cp`` (``java
    -cp libs/* kafka.Kafka``, not srl's KafkaCluster), formatted with a cluster id of srl's
    kind (so a role creates its topics, as on ``srl broker start``); yields its bootstrap."""
    from srl.broker import free_port
    from srl.kafka import broker_answers

    port, cport = free_port(), free_port()
    props = tmp_path / "server.properties"
    props.write_text(settings.format(port=port, cport=cport, logs=tmp_path / "logs"))
    java = apache.check_java()
    logging = f"-Dlog4j2.configurationFile={apache.dist_file('log4j2.properties')}"
    fmt = [java, logging, "-cp", cp, "kafka.tools.StorageTool", "format"]
    subprocess.run(
        [*fmt, "-t", apache.new_cluster_id(), "-c", str(props)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    with open(tmp_path / "kafka.log", "w") as log:
        proc = subprocess.Popen(
            [java, *TEST_KAFKA_JVM_OPTS.split(), logging, "-cp", cp, "kafka.Kafka", str(props)],
            stdout=log,
            stderr=log,
        )
    try:
        deadline = time.monotonic() + 120
        while not broker_answers(f"127.0.0.1:{port}", 2.0):
            assert proc.poll() is None and time.monotonic() < deadline, (
                f"node did not start: {last_line(tmp_path / 'kafka.log')}"
            )
            time.sleep(0.5)
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


def smoke_and_train(bootstrap: str, tmp_path: Path, tiny_model: Path, *trainer_args: str) -> str:
    """``srl smoke --trajectories 40``, then a trainer's two steps over generated trajectories,
    with only ``--bootstrap`` (``SRL_BOOTSTRAP_SERVERS``); every trained partition's lag is 0
    by ``kafka-consumer-groups``. Returns the trainer's stderr."""
    env = {
        "SRL_BOOTSTRAP_SERVERS": bootstrap,
        "SRL_TOPIC_PREFIX": "elsewhere",
        "SRL_STORE": f"file://{tmp_path / 'store'}",
        **{k: v for k, v in os.environ.items() if not k.startswith("SRL_")},
    }
    smoke = subprocess.run(
        [bin_path("srl"), "smoke", "--trajectories", "40"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert smoke.returncode == 0, smoke.stdout[-2000:] + smoke.stderr[-2000:]
    values = {"bootstrap_servers": bootstrap, "topic_prefix": "elsewhere2"}
    cfg = load_config(CommonConfig, cli=values, env={})
    create_topics(cfg)
    chunks = make_groups(4, n=2)  # four prompts of two samples: two steps of two
    produce(cfg, chunks)
    env["SRL_TOPIC_PREFIX"] = "elsewhere2"
    train = subprocess.run(
        [
            bin_path("srl-consumer"),
            "train",
            "--model",
            str(tiny_model),
            "--groups-per-step",
            "2",
            "--max-steps",
            "2",
            "--idle-exit-s",
            "20",
            "--device",
            "cpu",
            "--reward",
            "consumers.rewards:first_line_match",
            *trainer_args,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert train.returncode == 0, train.stderr[-3000:]
    rows = describe_groups(bootstrap, ["elsewhere2.trainer.default"])
    trained = [
        r
        for (_g, t, _p), r in rows.items()
        if t == "elsewhere2.trajectories" and r["log_end_offset"]
    ]
    assert trained and all(r["lag"] == 0 for r in trained), trained
    return train.stderr


@pytest.mark.slow
def test_srl_runs_unchanged_on_a_node_started_elsewhere_from_the_same_jars(
    tmp_path: Path, tiny_model: Path
) -> None:
    """A node as Kafka's quick start runs it (its config/server.properties: the group join
    delay, the 45 s KIP-848 session and everything else at Kafka's defaults), started with
    ``java -cp libs/* kafka.Kafka``, not by srl: ``srl smoke`` and a trainer step over
    generated trajectories work with only ``--bootstrap``."""
    with stock_node(tmp_path, apache.classpath(), STOCK_4) as bootstrap:
        smoke_and_train(bootstrap, tmp_path, tiny_model)
        assert kip848_groups({"bootstrap.servers": bootstrap}) is True


# Kafka 3.x releases srl is tested on (docs/broker.md, "Kafka versions"): the newest patches of
# 3.9 (the last 3.x minor), of 3.7 and of 3.0, the oldest that passes (2.8's KRaft has no
# idempotent producer); SRL_TEST_KAFKA_VERSIONS=3.5.2,3.3.2 runs others instead
KAFKA_3 = tuple(os.environ.get("SRL_TEST_KAFKA_VERSIONS", "3.9.2,3.7.2,3.0.2").split(","))


@pytest.mark.slow
@pytest.mark.timeout(600)  # with the first fetch of the release's jars (~30-40 s alone)
@pytest.mark.parametrize("version", KAFKA_3)
def test_srl_runs_unchanged_on_kafka_3(version: str, tmp_path: Path, tiny_model: Path) -> None:
    """The same on an Apache Kafka 3.x node with its stock settings (KRaft, a static quorum:
    ``controller.quorum.voters``), from that release's jars on Maven Central (fetched once per
    machine by the pinned recipe with ``-Dkafka.version``: ``srl broker fetch --version``;
    the tools that check the lag are 4.4's). srl's groups are classic ones by default; a
    trainer told ``-X group.protocol=consumer`` (KIP-848 groups: Kafka 4.0's) is a classic
    member here too, with one warning, instead of waiting for an assignment that never comes."""
    cp = apache.classpath(version=version)
    assert apache.installed_version(cp) == version
    with stock_node(tmp_path, cp, STOCK) as bootstrap:
        assert kip848_groups({"bootstrap.servers": bootstrap}) is False
        err = smoke_and_train(bootstrap, tmp_path, tiny_model, "-X", "group.protocol=consumer")
    assert err.count("takes no KIP-848 groups") == 1, err[-3000:]


def test_an_idle_member_fetch_is_held_by_the_broker(cfg) -> None:  # type: ignore[no-untyped-def]
    """Apache Kafka holds a fetch at the end of a partition (``fetch.wait.max.ms``): a member
    that has read everything sends a few fetches a second, not the hundreds it sends to the
    embedded broker (tests/integration/test_quiet_group.py), so srl's members are not quiet
    here (``srl.kafka.idle_fetches_spin``)."""
    from tests.integration.test_quiet_group import Fetches, member, take

    topic = f"{cfg.topic_prefix}.held"
    create_topics(cfg, [TopicSpec(topic, 3, {})])
    with Producer(cfg, "test") as p:
        for i in range(6):
            p.produce(topic, f"a{i}".encode(), key=b"k", partition=i % 3)
    fetches = Fetches()
    c = member(cfg, topic, fetches)  # srl's default: quiet only where idle fetches spin
    try:
        assert c._quiet is None
        assert len(take(c, 6)) == 6
        idle = fetches.during(c, 1.5)
        assert idle <= 10, f"{idle} fetches in 1.5 s while caught up"
    finally:
        c.close()
