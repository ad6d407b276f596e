"""The brokers srl can run on 127.0.0.1 itself: start, stop and inspect them.

Two engines, one protocol (the roles only ever see ``--bootstrap``):

* ``embedded`` (``srl.broker.embedded``): noida-db from PyPI, one process, no Java: the
  zero-setup default of ``srl broker start`` and ``make demo``;
* ``kafka`` (``srl.broker.apache``): Apache Kafka 4.x in KRaft mode from Maven Central's jars,
  one node or three (``srl broker start --engine kafka [--nodes 3]``).

A data folder holds one broker of either engine; ``stop`` and ``status`` find which from
what it holds (``broker.json`` for the embedded one, ``kafka.json`` for Apache Kafka).
Called by ``app.cli.main`` (``srl broker``), the demo, the benchmarks and ``tests/conftest.py``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from srl.broker import apache
from srl.broker.apache import KafkaCluster
from srl.broker.embedded import (
    DEFAULT_DATA_DIR,
    DEFAULT_PORT,
    BrokerInfo,
    EmbeddedBroker,
    broker_binary,
    read_state,
)
from srl.broker.embedded import start as start_embedded
from srl.broker.embedded import status as embedded_status
from srl.broker.embedded import stop as stop_embedded
from srl.errors import SrlError
from srl.ports import free_port, port_open

Engine = Literal["embedded", "kafka"]
ENGINES: tuple[Engine, ...] = ("embedded", "kafka")

__all__ = [
    "DEFAULT_DATA_DIR",
    "DEFAULT_PORT",
    "ENGINES",
    "BrokerInfo",
    "EmbeddedBroker",
    "KafkaCluster",
    "broker_binary",
    "free_port",
    "port_open",
    "read_state",
    "running_broker",
    "Running",
    "start",
    "status",
    "stop",
    "temporary",
]


def start(
    port: int = DEFAULT_PORT,
    data_dir: Path = DEFAULT_DATA_DIR,
    timeout_s: float | None = None,
    engine: Engine = "embedded",
    nodes: int = 1,
    kafka_home: Path | None = None,
    log: Any = None,
) -> dict[str, Any]:
    """Start a broker of ``engine`` from ``data_dir`` (or return the one running there);
    its status."""
    data_dir = Path(data_dir).resolve()
    if engine == "embedded":
        if nodes != 1:
            raise SrlError("the embedded broker is one node; --nodes 3 needs --engine kafka")
        if kafka_home is not None:
            raise SrlError("--kafka-home goes with --engine kafka")
        cluster = apache.load(data_dir)
        if cluster is not None and cluster.status()["running"]:
            raise SrlError(f"an Apache Kafka broker runs from {data_dir}; stop it first")
        start_embedded(port, data_dir, timeout_s or 30.0)
        return status(data_dir)
    if engine != "kafka":
        raise SrlError(f"unknown broker engine {engine!r}: one of {', '.join(ENGINES)}")
    if embedded_status(data_dir)["running"]:
        raise SrlError(f"the embedded broker runs from {data_dir}; stop it first")
    cluster = apache.load(data_dir)
    if cluster is None or len(cluster.nodes) != nodes or cluster.nodes[0].port != port:
        cluster = KafkaCluster(data_dir, nodes=nodes, port=port, kafka_home=kafka_home, log=log)
    cluster.kafka_home, cluster.log = kafka_home, log
    if timeout_s:
        cluster.timeout_s = timeout_s
    cluster.start()
    return cluster.status()


def stop(data_dir: Path = DEFAULT_DATA_DIR) -> bool:
    """Stop the broker of ``data_dir``, whichever engine; False if none was running."""
    data_dir = Path(data_dir).resolve()
    cluster = apache.load(data_dir)
    stopped = cluster.stop() if cluster is not None else False
    return stop_embedded(data_dir) or stopped


def status(data_dir: Path = DEFAULT_DATA_DIR) -> dict[str, Any]:
    """Whether a broker runs from ``data_dir``, its engine, bootstrap and nodes."""
    data_dir = Path(data_dir).resolve()
    st = embedded_status(data_dir)
    if st["running"]:
        return {"engine": "embedded", **st}
    cluster = apache.load(data_dir)
    if cluster is not None:
        return cluster.status()
    return {"engine": None, **st}


def running_broker(data_dir: Path = DEFAULT_DATA_DIR) -> str | None:
    """The bootstrap of the broker running from ``data_dir``, if one does."""
    st = status(data_dir)
    return str(st["bootstrap"]) if st["running"] else None


@dataclass
class Running:
    """A broker of ``temporary``: where it answers, and its processes (for CPU readings)."""

    engine: Engine
    bootstrap: str
    pids: list[int]


@contextlib.contextmanager
def temporary(engine: Engine = "embedded", nodes: int = 1) -> Iterator[Running]:
    """A broker of ``engine`` on free ports in a temporary folder for the ``with`` block
    (benchmarks, the demo, tests)."""
    if engine == "embedded":
        if nodes != 1:
            raise SrlError("the embedded broker is one node; --nodes 3 needs --engine kafka")
        with EmbeddedBroker() as b:
            assert b.info is not None
            yield Running("embedded", b.bootstrap, [b.info.pid])
        return
    if engine != "kafka":
        raise SrlError(f"unknown broker engine {engine!r}: one of {', '.join(ENGINES)}")
    with apache.temporary(nodes) as cluster:
        yield Running("kafka", cluster.bootstrap, [n.pid for n in cluster.nodes if n.pid])
