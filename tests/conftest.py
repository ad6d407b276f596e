"""Shared fixtures: real brokers for the test session, and per-test configs.

Three tiers (docs/broker.md):

* **Apache Kafka, one node** (the default ``bootstrap``): each test process starts its own
  node (``srl.broker.apache``; ``make test`` fetches the jars once per machine first);
* **embedded** (``@pytest.mark.embedded``): the tests of what ``make demo`` depends on and of
  the embedded broker's own gaps, on a noida-db broker of their test process;
* **kafka** (``@pytest.mark.kafka``): what only Apache Kafka does (its tools, compaction,
  KIP-848) runs on an Apache Kafka node whatever the default tier is;
* **cluster** (``@pytest.mark.cluster``): three Apache Kafka nodes (replication factor 3,
  ``min.insync.replicas`` 2), one cluster shared by every test process, started by the first
  test that asks for it (the ``cluster`` fixture) and stopped when the session ends.

``SRL_BOOTSTRAP_SERVERS`` points the default tier at another broker; ``SRL_TEST_BROKER=embedded``
runs it on the embedded broker (a machine without Java); ``SRL_TEST_CONTAINER=1`` on an Apache
Kafka container where Docker runs. Each test gets its own random topic prefix and group ids,
so tests never see each other's records. ``--slow`` runs the tests marked ``slow`` (``make
test`` passes it).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.docs.summary import docs_summary

ROOT = Path(__file__).resolve().parents[1]

# `make test` runs 3 test processes on 2 cores and each starts roles: one torch thread per
# process (the tiny model gains nothing from more, and OpenMP's idle threads spin). Measured on
# three integration/unit modules: 14% less CPU, 10% less wall (2026-11-27). Set before any
# import of torch; the roles the tests start inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--slow", action="store_true", help="also run tests marked slow")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--slow"):
        return
    keep, drop = [], []
    for item in items:
        (drop if item.get_closest_marker("slow") else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def docker_available() -> bool:
    if shutil.which("docker") is None:
        return False
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def kafka_image() -> str:
    """The apache/kafka image of the pinned Kafka version (docker-compose.yml pins the same)."""
    from srl.broker.apache import kafka_version

    return f"apache/kafka:{kafka_version()}"


@contextlib.contextmanager
def apache_kafka_container() -> Iterator[str]:
    """Apache Kafka (KRaft, single node) in a container on a free 127.0.0.1 port, with the
    server settings of ``srl broker start --engine kafka`` (``image_environment``)."""
    from testcontainers.core.container import DockerContainer
    from testcontainers.core.wait_strategies import LogMessageWaitStrategy

    from srl.broker import free_port
    from srl.broker.apache import image_environment

    port = free_port()
    container = (
        DockerContainer(kafka_image())
        .with_bind_ports(9092, ("127.0.0.1", port))
        .with_env("KAFKA_NODE_ID", "1")
        .with_env("KAFKA_LISTENERS", "PLAINTEXT://:9092,CONTROLLER://:9093")
        .with_env("KAFKA_ADVERTISED_LISTENERS", f"PLAINTEXT://127.0.0.1:{port}")
        .with_env(
            "KAFKA_LISTENER_SECURITY_PROTOCOL_MAP", "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT"
        )
        .with_env("KAFKA_CONTROLLER_QUORUM_VOTERS", "1@localhost:9093")
        .waiting_for(LogMessageWaitStrategy("Kafka Server started").with_startup_timeout(120))
    )
    for k, v in image_environment(1).items():
        container = container.with_env(k, v)
    with container:
        yield f"127.0.0.1:{port}"


def test_broker() -> str:
    """What the default tier runs on: ``external``, ``container``, ``embedded`` or ``kafka``."""
    if os.environ.get("SRL_BOOTSTRAP_SERVERS"):
        return "external"
    if os.environ.get("SRL_TEST_CONTAINER") == "1" and docker_available():
        return "container"
    return "embedded" if os.environ.get("SRL_TEST_BROKER") == "embedded" else "kafka"


def embedded_broker_in_use() -> bool:
    """True when the default tier runs on the embedded noida-db."""
    return test_broker() == "embedded"


def kafka_in_use() -> bool:
    """True when the default tier runs on an Apache Kafka node of this session."""
    return test_broker() == "kafka"


# a test process's nodes get less heap than a user's (srl.broker.apache): a few hundred MB
# hold every topic of a session, and C1 alone starts a node with less CPU on 2 cores
TEST_KAFKA_JVM_OPTS = (
    "-Xms96m -Xmx512m -XX:+UseG1GC -XX:MaxGCPauseMillis=20 -XX:TieredStopAtLevel=1"
)


@contextlib.contextmanager
def kafka_node(nodes: int = 1, data_dir: Path | None = None) -> Iterator[Any]:
    """Apache Kafka nodes on free ports for the ``with`` block (``srl.broker.apache``)."""
    from srl.broker import apache

    os.environ.setdefault("SRL_KAFKA_JVM_OPTS", TEST_KAFKA_JVM_OPTS)
    if data_dir is None:
        with apache.temporary(nodes) as cluster:
            yield cluster
        return
    cluster = apache.KafkaCluster(data_dir, nodes=nodes)
    try:
        yield cluster.start()
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def default_bootstrap(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """host:port of this test process's default broker (see the module docstring)."""
    kind = test_broker()
    if kind == "external":
        yield os.environ["SRL_BOOTSTRAP_SERVERS"]
    elif kind == "container":
        with apache_kafka_container() as bootstrap:
            yield bootstrap
    elif kind == "embedded":
        from srl.broker import EmbeddedBroker

        with EmbeddedBroker() as broker:
            yield broker.bootstrap
    else:
        with kafka_node(1, tmp_path_factory.mktemp("kafka")) as node:
            yield node.bootstrap


@pytest.fixture(scope="session")
def kafka_bootstrap(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """host:port of an Apache Kafka node of this test process: the default tier's when that is
    one, else a node of its own (tests of what only Apache Kafka does, ``@pytest.mark.kafka``)."""
    if kafka_in_use():
        yield str(request.getfixturevalue("default_bootstrap"))
        return
    with kafka_node(1, tmp_path_factory.mktemp("kafka-own")) as node:
        yield node.bootstrap


@pytest.fixture(scope="session")
def embedded_bootstrap() -> Iterator[str]:
    """host:port of this test process's embedded broker (noida-db), started on first use."""
    from srl.broker import EmbeddedBroker

    with EmbeddedBroker() as broker:
        yield broker.bootstrap


def shared_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder every test process of this session shares (xdist workers' common base)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Three Apache Kafka nodes shared by every test process of the session: the first to ask
    starts them (under a file lock), the end of the session stops them (``pytest_unconfigure``
    of the controller); a test that stops a node starts it again before it ends."""
    from srl.broker import apache

    os.environ.setdefault("SRL_KAFKA_JVM_OPTS", TEST_KAFKA_JVM_OPTS)
    data = shared_dir(tmp_path_factory) / "kafka-cluster"
    data.mkdir(parents=True, exist_ok=True)
    with open(data.parent / "kafka-cluster.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        found = apache.load(data)
        c = found if found is not None else apache.KafkaCluster(data, nodes=3)
        if not all(c.running(n) for n in c.nodes):
            c.start()
    return c


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    docs_summary(terminalreporter)


def pytest_unconfigure(config: pytest.Config) -> None:
    """Stop the shared cluster, in the xdist controller (or the only test process)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    factory = getattr(config, "_tmp_path_factory", None)
    if factory is None:
        return
    from srl.broker import apache

    with contextlib.suppress(Exception):
        data = factory.getbasetemp() / "kafka-cluster"
        c = apache.load(data) if data.is_dir() else None
        if c is not None:
            c.stop()


@pytest.fixture
def bootstrap(request: pytest.FixtureRequest) -> str:
    """host:port of the broker of this test's tier (the ``embedded``, ``cluster`` and
    ``kafka`` marks, else the default)."""
    if request.node.get_closest_marker("embedded"):
        return str(request.getfixturevalue("embedded_bootstrap"))
    if request.node.get_closest_marker("cluster"):
        return str(request.getfixturevalue("cluster").bootstrap)
    if request.node.get_closest_marker("kafka"):
        return str(request.getfixturevalue("kafka_bootstrap"))
    return str(request.getfixturevalue("default_bootstrap"))


def delete_topics(bootstrap: str, prefix: str) -> None:
    """Delete the topics named ``prefix…`` (a finished test's). The session broker gets slower
    with every topic it holds (measured on noida-db, 2-core machine under load): at 1 500
    topics (a hundred tests' layouts) creating one more layout took 0.9 s instead of 0.02 s,
    at 4 500 1.4 s, and a producer's first delivery 2.3 s. Cleanup only: a broker that does
    not answer leaves them where they are."""
    from srl.config import CommonConfig
    from srl.kafka.admin import admin

    client = admin(CommonConfig(bootstrap_servers=bootstrap, topic_prefix=prefix))
    with contextlib.suppress(Exception):
        names = [t for t in client.list_topics(timeout=10).topics if t.startswith(prefix)]
        if names:
            for future in client.delete_topics(names, operation_timeout=10).values():
                future.result()


@pytest.fixture
def prefix(request: pytest.FixtureRequest) -> Iterator[str]:
    """This test's topic prefix; its topics are deleted on the session broker afterwards."""
    name = f"t{uuid.uuid4().hex[:10]}"
    yield name
    if "bootstrap" in request.fixturenames:
        delete_topics(request.getfixturevalue("bootstrap"), name)


def roles_create_topics() -> bool:
    """Whether the tests tell roles to create their topics: on a broker srl did not start (an
    external one, a container), where ``create_topics = "auto"`` would not (docs/security.md)."""
    return test_broker() in ("external", "container")


@pytest.fixture
def make_cfg(bootstrap: str, prefix: str, tmp_path: Path):  # type: ignore[no-untyped-def]
    """Factory: a config of ``cls`` on the session broker with this test's prefix and store."""
    from srl.config import CommonConfig, load_config

    def make(cls: type = CommonConfig, **values):  # type: ignore[no-untyped-def]
        base = {
            "bootstrap_servers": bootstrap,
            "topic_prefix": prefix,
            "store": f"file://{tmp_path / 'store'}",
            "connect_timeout_s": 10.0,
        }
        if roles_create_topics() and "create_topics" in cls.model_fields:
            base["create_topics"] = "yes"
        return load_config(cls, cli={**base, **values}, env={})

    return make


@pytest.fixture
def cfg(make_cfg):  # type: ignore[no-untyped-def]
    return make_cfg()


def cli_environment(bootstrap: str, prefix: str, tmp_path: Path) -> dict[str, str]:
    """Environment for running the real CLIs as subprocesses against ``bootstrap``, with
    topic prefix ``prefix`` and the object store in ``tmp_path/store``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SRL_")}
    env.update(
        {
            "SRL_BOOTSTRAP_SERVERS": bootstrap,
            "SRL_TOPIC_PREFIX": prefix,
            "SRL_STORE": f"file://{tmp_path / 'store'}",
            "PYTHONUNBUFFERED": "1",
        }
    )
    if roles_create_topics():
        env["SRL_CREATE_TOPICS"] = "yes"
    return env


@pytest.fixture
def cli_env(bootstrap: str, prefix: str, tmp_path: Path) -> dict[str, str]:
    """Environment for running the real CLIs as subprocesses against the session broker."""
    return cli_environment(bootstrap, prefix, tmp_path)


def bin_path(name: str) -> str:
    """A console script installed beside the running interpreter."""
    return str(Path(sys.executable).parent / name)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-init tiny Qwen2 model + byte-level tokenizer in HF format (built once per
    session)."""
    from srl.tinymodel import TinyModelSpec, build_tiny_model

    spec = TinyModelSpec(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"), spec, seed=0)


@pytest.fixture(scope="session")
def s3_server() -> Iterator[object]:
    """A local S3-compatible server (moto, server mode) on a free 127.0.0.1 port."""
    from tests.s3server import MotoServer

    with MotoServer() as server:
        yield server


@pytest.fixture
def s3_url(s3_server, monkeypatch: pytest.MonkeyPatch) -> str:  # type: ignore[no-untyped-def]
    """``s3://BUCKET/store`` on a fresh bucket; the AWS variables and the endpoint are set."""
    from tests.s3server import TEST_CREDENTIALS

    for k, v in TEST_CREDENTIALS.items():
        monkeypatch.setenv(k, v)
    # boto3 reads the endpoint from AWS_ENDPOINT_URL; srl uses path-style buckets then
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint)
    bucket = f"srl-{uuid.uuid4().hex[:12]}"
    s3_server.make_bucket(bucket)
    return f"s3://{bucket}/store"
