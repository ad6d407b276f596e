"""``srl broker start --engine kafka`` as a user runs it: a real Apache Kafka node from the
fetched jars, its data kept across a stop and a start, ``--kafka-home``, and one-line errors
for a missing Java, a missing Maven and a taken port."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import orjson
import pytest

from srl.broker import apache
from srl.config import CommonConfig, load_config
from srl.kafka import Producer, create_topics, read_range
from srl.ports import free_ports
from srl.topics import TopicSpec
from tests.conftest import TEST_KAFKA_JVM_OPTS, bin_path

pytestmark = pytest.mark.slow


def srl(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {**os.environ, "SRL_KAFKA_JVM_OPTS": TEST_KAFKA_JVM_OPTS}
    return subprocess.run(
        [bin_path("srl"), *args],
        env={**base, **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
    )


def kafka_start(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return srl("broker", "start", "--engine", "kafka", *args, env=env)


def one_line_error(out: subprocess.CompletedProcess[str], text: str) -> None:
    assert out.returncode == 1, out.stdout + out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("srl: error: "), out.stderr
    assert text in lines[0], lines[0]
    assert "Traceback" not in out.stderr


def test_start_status_stop_and_start_again_on_the_same_data(tmp_path: Path) -> None:
    data, port = tmp_path / "k", free_ports(2)  # the node and its controller (P + 1)
    out = kafka_start("--port", str(port), "--data-dir", str(data))
    assert out.returncode == 0, out.stderr
    assert f"bootstrap 127.0.0.1:{port}" in out.stdout
    try:
        st = orjson.loads(srl("broker", "status", "--data-dir", str(data), "--json").stdout)
        assert st["engine"] == "kafka" and st["running"] and st["answering"]
        [node] = st["nodes"]
        assert (Path(node["data_dir"]) / "kafka.log").stat().st_size > 0  # its log, its folder
        assert (Path(node["data_dir"]) / "server.properties").is_file()
        # a second start finds it running; an embedded start from the same folder is refused
        again = kafka_start("--port", str(port), "--data-dir", str(data))
        assert again.returncode == 0 and str(node["pid"]) in again.stdout
        one_line_error(srl("broker", "start", "--data-dir", str(data)), "Apache Kafka broker runs")
        cfg = load_config(
            CommonConfig,
            cli={"bootstrap_servers": f"127.0.0.1:{port}", "topic_prefix": "t"},
            env={},
        )
        create_topics(cfg, [TopicSpec("t.kept", 1, {})])
        with Producer(cfg, "test") as p:
            for i in range(5):
                p.produce("t.kept", str(i).encode())
            p.flush()
        assert srl("broker", "stop", "--data-dir", str(data)).stdout.strip() == "broker stopped"
        down = srl("broker", "status", "--data-dir", str(data))
        assert down.returncode == 1 and "not running" in down.stdout
        out = kafka_start("--data-dir", str(data), "--port", str(port))
        assert out.returncode == 0, out.stderr
        assert [m.value() for m in read_range(cfg, "t.kept", timeout_s=60)] == [
            str(i).encode() for i in range(5)
        ]
    finally:
        srl("broker", "stop", "--data-dir", str(data))
    assert srl("broker", "status", "--data-dir", str(data)).returncode == 1


def test_kafka_home_uses_an_existing_install(tmp_path: Path) -> None:
    home = tmp_path / "kafka_2.13-x"
    home.mkdir()
    (home / "libs").symlink_to(apache.fetch(), target_is_directory=True)
    data, port = tmp_path / "k", free_ports(2)  # the node and its controller (P + 1)
    args = ["--port", str(port), "--data-dir", str(data), "--kafka-home", str(home)]
    out = kafka_start(*args)
    try:
        assert out.returncode == 0, out.stderr
        topics = srl(
            "broker",
            "tool",
            "--kafka-home",
            str(home),
            "kafka-topics",
            "--bootstrap-server",
            f"127.0.0.1:{port}",
            "--list",
        )
        assert topics.returncode == 0, topics.stderr
        st = orjson.loads(srl("broker", "status", "--data-dir", str(data), "--json").stdout)
        cmdline = Path(f"/proc/{st['nodes'][0]['pid']}/cmdline").read_bytes()
        assert str(home / "libs").encode() in cmdline
    finally:
        srl("broker", "stop", "--data-dir", str(data))
    empty = tmp_path / "not-kafka"
    empty.mkdir()
    one_line_error(
        kafka_start(
            "--kafka-home",
            str(empty),
            "--data-dir",
            str(tmp_path / "e"),
        ),
        "is not a Kafka install",
    )


def test_one_line_errors_for_no_java_no_maven_and_a_taken_port(tmp_path: Path) -> None:
    venv_bin = str(Path(bin_path("srl")).parent)
    no_java = {"PATH": venv_bin, "JAVA_HOME": ""}
    one_line_error(
        kafka_start("--data-dir", str(tmp_path / "a"), env=no_java),
        "Apache Kafka needs Java 17 or newer",
    )
    # Java but no Maven, and no jars fetched yet (an empty cache)
    java_only = tmp_path / "bin"
    java_only.mkdir()
    (java_only / "java").symlink_to(apache.java_binary())
    no_mvn = {"PATH": f"{venv_bin}:{java_only}", "SRL_KAFKA_CACHE": str(tmp_path / "cache")}
    one_line_error(
        kafka_start("--data-dir", str(tmp_path / "b"), env=no_mvn),
        "needs Maven: no `mvn` on PATH",
    )
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        one_line_error(
            kafka_start(
                "--port",
                str(port),
                "--data-dir",
                str(tmp_path / "c"),
            ),
            f"port {port} on 127.0.0.1 is already in use",
        )
    one_line_error(
        srl("broker", "start", "--nodes", "3", "--data-dir", str(tmp_path / "d")),
        "--nodes 3 needs --engine kafka",
    )
    one_line_error(srl("broker", "tool", "kafka-nonsense"), "unknown Kafka tool 'kafka-nonsense'")
