"""Shared fixtures: one real Kafka-protocol broker per test session, and per-test configs.

The broker is, in order of preference:

1. an external one when ``SRL_BOOTSTRAP_SERVERS`` is set;
2. an Apache Kafka container when ``SRL_TEST_CONTAINER=1`` and a Docker engine answers;
3. the embedded broker (``srl.broker.EmbeddedBroker``) on a free port: the default.

Each test gets its own random topic prefix and group ids, so tests never see each other's
records. ``--slow`` runs the tests marked ``slow`` (``make test`` passes it).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

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


KAFKA_IMAGE = "apache/kafka:3.9.1"  # the same image docker-compose.yml pins


@contextlib.contextmanager
def apache_kafka_container() -> Iterator[str]:
    """Apache Kafka (KRaft, single node) in a container on a free 127.0.0.1 port."""
    from testcontainers.core.container import DockerContainer
    from testcontainers.core.wait_strategies import LogMessageWaitStrategy

    from srl.broker import free_port

    port = free_port()
    container = (
        DockerContainer(KAFKA_IMAGE)
        .with_bind_ports(9092, ("127.0.0.1", port))
        .with_env("KAFKA_NODE_ID", "1")
        .with_env("KAFKA_PROCESS_ROLES", "broker,controller")
        .with_env("KAFKA_LISTENERS", "PLAINTEXT://:9092,CONTROLLER://:9093")
        .with_env("KAFKA_ADVERTISED_LISTENERS", f"PLAINTEXT://127.0.0.1:{port}")
        .with_env("KAFKA_CONTROLLER_LISTENER_NAMES", "CONTROLLER")
        .with_env(
            "KAFKA_LISTENER_SECURITY_PROTOCOL_MAP", "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT"
        )
        .with_env("KAFKA_CONTROLLER_QUORUM_VOTERS", "1@localhost:9093")
        .with_env("KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR", "1")
        .with_env("KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR", "1")
        .with_env("KAFKA_TRANSACTION_STATE_LOG_MIN_ISR", "1")
        .with_env("KAFKA_GROUP_INITIAL_REBALANCE_DELAY_MS", "0")
        .waiting_for(LogMessageWaitStrategy("Kafka Server started").with_startup_timeout(120))
    )
    with container:
        yield f"127.0.0.1:{port}"


def embedded_broker_in_use() -> bool:
    """True when the session's broker is the embedded noida-db (no external broker, no
    container)."""
    return not os.environ.get("SRL_BOOTSTRAP_SERVERS") and not (
        os.environ.get("SRL_TEST_CONTAINER") == "1" and docker_available()
    )


@pytest.fixture(scope="session")
def bootstrap() -> Iterator[str]:
    """host:port of a real broker for the whole session."""
    external = os.environ.get("SRL_BOOTSTRAP_SERVERS")
    if external:
        yield external
        return
    if os.environ.get("SRL_TEST_CONTAINER") == "1" and docker_available():
        with apache_kafka_container() as bootstrap:
            yield bootstrap
        return
    from srl.broker import EmbeddedBroker

    with EmbeddedBroker() as broker:
        yield broker.bootstrap


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
