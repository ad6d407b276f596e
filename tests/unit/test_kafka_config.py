"""One source for the Apache Kafka srl ships: srl/broker/apache_kafka/ (pom.xml's version,
server.properties' settings) is what ``srl broker start --engine kafka`` runs, what the tests'
container runs and what docker-compose.yml runs."""

from __future__ import annotations

import base64
import re
from pathlib import Path

import pytest
import yaml

from srl.broker import apache
from srl.broker.apache import KafkaCluster, Layout, Node
from srl.errors import SrlError
from srl.kafka.probe import SRL_MARK
from tests.conftest import ROOT

# what the compose file's node sets because of where it runs (ids, listeners, quorum)
NODE_ENV = {
    "KAFKA_NODE_ID",
    "KAFKA_LISTENERS",
    "KAFKA_ADVERTISED_LISTENERS",
    "KAFKA_INTER_BROKER_LISTENER_NAME",
    "KAFKA_LISTENER_SECURITY_PROTOCOL_MAP",
    "KAFKA_CONTROLLER_QUORUM_VOTERS",
}


def compose_kafka() -> dict:
    return dict(yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["kafka"])


def test_docker_compose_runs_the_pinned_kafka_with_the_settings_of_the_one_file() -> None:
    svc = compose_kafka()
    assert svc["image"] == f"apache/kafka:{apache.kafka_version()}"
    env = {k: str(v) for k, v in svc["environment"].items()}
    ours = apache.image_environment(1)
    assert {k: env.get(k) for k in ours} == ours
    # and nothing else: a setting only the compose file had would not be what CI tests
    assert set(env) - set(ours) == NODE_ENV


def test_the_one_file_is_the_broker_settings_of_every_node(tmp_path: Path) -> None:
    base = apache.server_settings()
    assert base["group.initial.rebalance.delay.ms"] == "0"
    assert base["process.roles"] == "broker,controller"
    layout = Layout("c", [Node(1, 9092, 9095), Node(2, 9093, 9096), Node(3, 9094, 9097)])
    props = apache.node_properties(layout.nodes[1], layout, tmp_path)
    assert {k: props[k] for k in base} == base
    assert props["node.id"] == "2"
    assert props["listeners"] == "PLAINTEXT://127.0.0.1:9093,CONTROLLER://127.0.0.1:9096"
    assert props["controller.quorum.voters"] == (
        "1@127.0.0.1:9095,2@127.0.0.1:9096,3@127.0.0.1:9097"
    )
    assert props["log.dirs"] == str(tmp_path / "node-2" / "data")
    assert props["default.replication.factor"] == props["offsets.topic.replication.factor"] == "3"
    assert props["min.insync.replicas"] == props["transaction.state.log.min.isr"] == "2"
    one = apache.node_properties(Node(1, 9092, 9093), Layout("c", [Node(1, 9092, 9093)]), tmp_path)
    assert one["min.insync.replicas"] == one["offsets.topic.replication.factor"] == "1"


def test_the_pom_pins_kafka_and_a_logging_binding_for_its_slf4j() -> None:
    pom = apache.dist_file("pom.xml").read_text()
    assert re.fullmatch(r"4\.\d+\.\d+", apache.kafka_version())
    for artifact in ("kafka_2.13", "kafka-tools", "log4j-core", "log4j-slf4j-impl"):
        assert f"<artifactId>{artifact}</artifactId>" in pom
    assert "<artifactId>log4j-slf4j2-impl</artifactId>" not in pom  # slf4j-api is 1.7.36
    # Maven refuses a POM with a double dash inside a comment
    assert not [c for c in re.findall(r"<!--(.*?)-->", pom, re.S) if "--" in c]


FAKE_MVN = """\
#!/bin/sh
# records its arguments; copies a kafka_2.13 jar of -Dkafka.version into -DoutputDirectory
echo "$@" >> "$0.calls"
for a in "$@"; do
  case "$a" in
    -Dkafka.version=*) v="${a#-Dkafka.version=}" ;;
    -DoutputDirectory=*) out="${a#-DoutputDirectory=}" ;;
  esac
done
if [ "$v" = 3.9.9 ]; then
  echo "[ERROR] Failed: Could not find artifact org.apache.kafka:kafka_2.13:jar:3.9.9"
  exit 1
fi
mkdir -p "$out" && touch "$out/kafka_2.13-$v.jar"
"""


def test_another_kafka_version_is_fetched_by_the_same_recipe_beside_the_pinned_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mvn = tmp_path / "bin" / "mvn"
    mvn.parent.mkdir()
    mvn.write_text(FAKE_MVN)
    mvn.chmod(0o755)
    monkeypatch.setenv("PATH", f"{mvn.parent}:/usr/bin:/bin")
    monkeypatch.setenv("SRL_KAFKA_CACHE", str(tmp_path / "cache"))
    libs = apache.fetch(version="3.9.2")
    assert libs == tmp_path / "cache" / "3.9.2" / "libs"
    assert apache.installed_version(apache.classpath(version="3.9.2")) == "3.9.2"
    calls = (tmp_path / "bin" / "mvn.calls").read_text().splitlines()
    assert len(calls) == 1 and "-Dkafka.version=3.9.2" in calls[0].split()  # once: cached
    # the one recipe, its pinned version overridden on the command line only
    pom = (tmp_path / "cache" / "3.9.2" / "pom.xml").read_text()
    assert pom == apache.dist_file("pom.xml").read_text()
    assert apache.libs_dir() == tmp_path / "cache" / apache.kafka_version() / "libs"
    with pytest.raises(SrlError, match="mvn could not fetch Apache Kafka 3.9.9: .*Could not find"):
        apache.fetch(version="3.9.9")
    assert not (tmp_path / "cache" / "3.9.9" / "libs").exists()
    with pytest.raises(SrlError, match="'../4.4.0' is not a Kafka version"):
        apache.fetch(version="../4.4.0")


def test_cluster_ids_are_kafka_uuids_that_say_srl_made_them() -> None:
    for _ in range(200):
        cid = apache.new_cluster_id()
        assert re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_\-]{21}", cid)
        assert cid.startswith(SRL_MARK) and base64.urlsafe_b64decode(cid + "==")[:3] == b"srl"
    assert len({apache.new_cluster_id() for _ in range(200)}) == 200


def test_a_data_folder_keeps_its_layout_and_refuses_another(tmp_path: Path) -> None:
    c = KafkaCluster(tmp_path, nodes=3, port=40000)
    assert [(n.port, n.controller_port) for n in c.nodes] == [
        (40000, 40003),
        (40001, 40004),
        (40002, 40005),
    ]
    assert c.bootstrap == "127.0.0.1:40000,127.0.0.1:40001,127.0.0.1:40002"
    c._save()
    again = apache.load(tmp_path)
    assert again is not None and again.layout.cluster_id == c.layout.cluster_id
    with pytest.raises(SrlError, match="holds a 3-node Kafka on port 40000"):
        KafkaCluster(tmp_path, nodes=1, port=40000)
    with pytest.raises(SrlError, match="--nodes is 1 or 3"):
        KafkaCluster(tmp_path / "x", nodes=2)
