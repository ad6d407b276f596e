"""Apache Kafka 4.x in KRaft mode on 127.0.0.1: one node or a three-node cluster.

``srl broker start --engine kafka [--nodes 1|3]``, the test suite's Apache Kafka tiers and
``srl demo --broker kafka`` run it with this module. The jars come from Maven Central by the
pinned recipe ``apache_kafka/pom.xml``, once per machine, into a cache folder (``fetch``);
``kafka_home`` uses an existing Kafka install's ``libs/`` instead. Every node is a combined
broker and controller with its own ports, its data, its ``server.properties`` and its log
(``kafka.log``) in ``DIR/node-N/``.

What must hold:

* server settings come from ``apache_kafka/server.properties`` (the one file, also checked
  against docker-compose.yml) plus what follows from the node count: replication factor
  ``min(3, nodes)``, ``min.insync.replicas`` 2 on three nodes;
* ``start`` returns only once every node answers a metadata request that lists all nodes,
  or raises SrlError with the line a node printed last; a taken port, a missing Java (or one
  older than 17), or Maven missing when the jars are not cached yet is a one-line SrlError;
* ports and the cluster id are chosen once per data folder (``DIR/kafka.json``), so a
  stopped cluster starts again on its data with the same addresses;
* only processes whose command line is a Kafka node of this data folder are signalled.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import functools
import os
import re
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from importlib.resources import files
from pathlib import Path
from typing import Any

import orjson

from srl.broker.process import (
    alive,
    exit_code,
    kill,
    last_line,
    owned,
    signal_pid,
    spawn,
    wait_gone,
)
from srl.errors import SrlError
from srl.kafka import broker_count
from srl.ports import bindable, free_port, port_open

DIST = "apache_kafka"  # package data of srl.broker: pom.xml, server.properties, log4j2.properties
MAIN_CLASS = "kafka.Kafka"
MIN_JAVA = 17
# JVM flags of a node: Kafka's scripts give it 1 GB of heap and G1; a few hundred MB is
# plenty for srl's topics. SRL_KAFKA_JVM_OPTS replaces them.
DEFAULT_JVM_OPTS = "-Xms128m -Xmx768m -XX:+UseG1GC -XX:MaxGCPauseMillis=20"
TOOL_JVM_OPTS = "-Xmx256m -XX:TieredStopAtLevel=1 -XX:+UseSerialGC"

# Kafka's admin tools by the names of its bin/*.sh scripts, for ``srl broker tool``.
TOOLS = {
    "kafka-consumer-groups": "org.apache.kafka.tools.consumer.group.ConsumerGroupCommand",
    "kafka-topics": "org.apache.kafka.tools.TopicCommand",
    "kafka-configs": "org.apache.kafka.tools.ConfigCommand",
    "kafka-console-consumer": "org.apache.kafka.tools.consumer.ConsoleConsumer",
    "kafka-console-producer": "org.apache.kafka.tools.ConsoleProducer",
    "kafka-get-offsets": "org.apache.kafka.tools.GetOffsetShell",
    "kafka-metadata-quorum": "org.apache.kafka.tools.MetadataQuorumCommand",
    "kafka-storage": "kafka.tools.StorageTool",
}


def dist_file(name: str) -> Path:
    return Path(str(files("srl.broker").joinpath(DIST, name)))


def kafka_version() -> str:
    """The Kafka version the recipe pins (``<kafka.version>`` of pom.xml)."""
    m = re.search(r"<kafka\.version>([^<]+)</kafka\.version>", dist_file("pom.xml").read_text())
    if m is None:
        raise SrlError(f"no <kafka.version> in {dist_file('pom.xml')}")
    return m.group(1).strip()


def read_properties(path: Path) -> dict[str, str]:
    """A Java properties file's ``key=value`` lines (comments and blank lines skipped)."""
    out: dict[str, str] = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", "!")):
            continue
        k, _, v = line.partition("=")
        out[k.strip()] = v.strip()
    return out


def server_settings() -> dict[str, str]:
    """The settings every node gets (``apache_kafka/server.properties``)."""
    return read_properties(dist_file("server.properties"))


def topology_settings(nodes: int) -> dict[str, str]:
    """What follows from the node count: replication of data and of the internal topics."""
    rf = str(min(3, nodes))
    isr = "2" if nodes >= 3 else "1"
    return {
        "default.replication.factor": rf,
        "min.insync.replicas": isr,
        "offsets.topic.replication.factor": rf,
        "transaction.state.log.replication.factor": rf,
        "transaction.state.log.min.isr": isr,
        "share.coordinator.state.topic.replication.factor": rf,
        "share.coordinator.state.topic.min.isr": isr,
    }


# set where the node runs (its listeners), not by the one file: docker-compose.yml's node has
# a listener for the host and one for the compose network, and names the inter-broker one
NETWORK_SETTINGS = ("inter.broker.listener.name", "listener.security.protocol.map")


def image_environment(nodes: int = 1) -> dict[str, str]:
    """The ``KAFKA_*`` variables that give the apache/kafka image the same settings as
    ``srl broker start --engine kafka`` (the image's rule: ``KAFKA_`` + the name in upper
    case with dots as underscores), network settings left to the deployment."""
    settings = server_settings() | topology_settings(nodes)
    return {
        "KAFKA_" + k.upper().replace(".", "_"): v
        for k, v in settings.items()
        if k not in NETWORK_SETTINGS
    }


# -- jars -------------------------------------------------------------------------------------
def cache_root() -> Path:
    env = os.environ.get("SRL_KAFKA_CACHE")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "srl" / "kafka"


def java_binary() -> str:
    home = os.environ.get("JAVA_HOME")
    if home and (Path(home) / "bin" / "java").is_file():
        return str(Path(home) / "bin" / "java")
    found = shutil.which("java")
    if found is None:
        raise SrlError(
            f"Apache Kafka needs Java {MIN_JAVA} or newer: no `java` on PATH or in JAVA_HOME "
            "(install a JDK, or run the embedded broker: srl broker start)"
        )
    return found


@functools.cache
def check_java() -> str:
    """The java binary, once it is known to be Java 17 or newer (asked once per process: a
    cluster's start and every tool would otherwise run ``java -version`` again)."""
    java = java_binary()
    try:
        out = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SrlError(f"{java} -version failed: {e}") from None
    m = re.search(r'version "(\d+)(?:\.(\d+))?', out.stderr + out.stdout)
    if m is None:
        raise SrlError(f"cannot tell the Java version of {java}: {out.stderr.strip()[:200]}")
    major = int(m.group(1)) if m.group(1) != "1" else int(m.group(2) or 0)
    if major < MIN_JAVA:
        raise SrlError(
            f"Apache Kafka {kafka_version()} needs Java {MIN_JAVA} or newer; {java} is Java "
            f"{major} (set JAVA_HOME to a newer JDK)"
        )
    return java


def libs_dir(version: str | None = None) -> Path:
    """Where ``version``'s jars are cached (the pinned version's by default)."""
    return cache_root() / (version or kafka_version()) / "libs"


def _complete(libs: Path) -> bool:
    return (libs / ".complete").is_file()


def check_version(version: str) -> str:
    """``version`` if it reads as a Kafka release (``3.9.2``, ``4.0.0-rc1``), else SrlError."""
    if not re.fullmatch(r"\d+\.\d+\.\d+(-[A-Za-z0-9.]+)?", version):
        raise SrlError(f"{version!r} is not a Kafka version (like {kafka_version()})")
    return version


def fetch(log: Any = None, version: str | None = None) -> Path:
    """The folder of Apache Kafka's jars, fetched from Maven Central first if need be (once
    per machine and version; concurrent callers wait for one another). ``version``: another
    release than the pinned one, by the same recipe (``mvn -Dkafka.version=VERSION``), cached
    beside it; the project's version stays the pom's."""
    version = check_version(version) if version else kafka_version()
    libs = libs_dir(version)
    if _complete(libs):
        return libs
    libs.parent.mkdir(parents=True, exist_ok=True)
    with open(libs.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _complete(libs):
            return libs
        mvn = shutil.which("mvn")
        if mvn is None:
            raise SrlError(
                f"fetching Apache Kafka {version}'s jars needs Maven: no `mvn` on PATH "
                "(install Maven 3.8+, or use an existing Kafka with --kafka-home DIR)"
            )
        if log is not None:
            log(f"fetching Apache Kafka {version} from Maven Central into {libs} (once)")
        tmp = libs.parent / f"libs.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        _copy_dependencies(mvn, version, tmp)
        shutil.rmtree(libs, ignore_errors=True)
        tmp.rename(libs)
        (libs / ".complete").write_text(version + "\n")
    return libs


def _copy_dependencies(mvn: str, version: str, into: Path) -> None:
    """``mvn dependency:copy-dependencies`` of the recipe with ``kafka.version`` = ``version``
    into ``into``; SrlError with Maven's own error line if it fails."""
    pom = into.parent / "pom.xml"
    shutil.copyfile(dist_file("pom.xml"), pom)
    cmd = [
        mvn,
        "-q",
        "-B",
        "-f",
        str(pom),
        "dependency:copy-dependencies",
        f"-Dkafka.version={version}",
        "-DincludeScope=runtime",
        f"-DoutputDirectory={into}",
    ]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    except subprocess.TimeoutExpired:
        raise SrlError("fetching Apache Kafka's jars took over 30 minutes; gave up") from None
    if out.returncode != 0 or not any(into.glob("kafka_2.13-*.jar")):
        shutil.rmtree(into, ignore_errors=True)
        why = _maven_error(out.stdout + out.stderr)
        raise SrlError(f"mvn could not fetch Apache Kafka {version}: {why}")


def _maven_error(output: str) -> str:
    """The line of Maven's output that says what went wrong, without its ``[ERROR]`` tags."""
    lines = [
        re.sub(r"(\x1b\[[0-9;]*m|\[(ERROR|FATAL)\])", "", ln).strip() for ln in output.splitlines()
    ]
    tagged = [
        ln
        for raw, ln in zip(output.splitlines(), lines, strict=True)
        if ("FATAL" in raw or "ERROR" in raw) and ln and "Some problems" not in ln
    ]
    return (tagged[0] if tagged else (lines[-1] if lines else "no output"))[:300]


def classpath(kafka_home: Path | None = None, log: Any = None, version: str | None = None) -> str:
    """``-cp`` for Kafka's main classes: ``kafka_home/libs`` or the fetched jars (of
    ``version``, the pinned one by default)."""
    if kafka_home is not None:
        libs = Path(kafka_home).expanduser().resolve() / "libs"
        if not any(libs.glob("kafka_2.13-*.jar")):
            raise SrlError(f"{kafka_home} is not a Kafka install: no libs/kafka_2.13-*.jar")
    else:
        libs = fetch(log, version)
    return f"{libs}/*"


def installed_version(cp: str) -> str:
    jars = sorted(Path(cp.rstrip("*")).glob("kafka_2.13-*.jar"))
    m = re.match(r"kafka_2\.13-(.+)\.jar$", jars[0].name) if jars else None
    return m.group(1) if m else "unknown"


def run_tool(
    name: str, args: Sequence[str], kafka_home: Path | None = None, timeout_s: float = 120.0
) -> subprocess.CompletedProcess[str]:
    """One of Kafka's admin tools (``TOOLS``), as its bin script would run it."""
    if name not in TOOLS:
        raise SrlError(f"unknown Kafka tool {name!r}; one of: {', '.join(sorted(TOOLS))}")
    java = check_java()
    cmd = [
        java,
        *TOOL_JVM_OPTS.split(),
        f"-Dlog4j2.configurationFile={dist_file('tools-log4j2.properties')}",
        "-cp",
        classpath(kafka_home),
        TOOLS[name],
        *args,
    ]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise SrlError(f"{name} did not finish within {timeout_s:g}s") from None


# -- nodes ------------------------------------------------------------------------------------
@dataclass
class Node:
    node_id: int
    port: int  # the PLAINTEXT listener clients use
    controller_port: int
    pid: int | None = None
    host: str = "127.0.0.1"  # what it listens on (a test's network namespace: its address)

    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass
class Layout:
    """A data folder's cluster: its id and its nodes' ports, chosen once (``DIR/kafka.json``)."""

    cluster_id: str
    nodes: list[Node] = field(default_factory=list)

    @property
    def bootstrap(self) -> str:
        return ",".join(n.bootstrap for n in self.nodes)


def new_cluster_id() -> str:
    """A KRaft cluster id: 16 bytes, URL-safe base64 without padding (Kafka's ``Uuid``), whose
    first three are ``b"srl"`` and the rest random: it begins with ``c3Js``
    (``srl.kafka.probe.SRL_MARK``), so a client knows that srl started this cluster (where a
    role's ``create_topics = "auto"`` creates what it finds missing) and never with ``-``
    (Kafka's rule: a leading dash reads as a CLI option)."""
    return base64.urlsafe_b64encode(b"srl" + uuid.uuid4().bytes[:13]).decode().rstrip("=")


def node_properties(node: Node, layout: Layout, data_dir: Path) -> dict[str, str]:
    """The ``server.properties`` of ``node``: the one file, then the node count's settings,
    then the node's own."""
    voters = ",".join(f"{n.node_id}@{n.host}:{n.controller_port}" for n in layout.nodes)
    h = node.host
    own = {
        "node.id": str(node.node_id),
        "listeners": f"PLAINTEXT://{h}:{node.port},CONTROLLER://{h}:{node.controller_port}",
        "advertised.listeners": f"PLAINTEXT://{h}:{node.port}",
        "controller.quorum.voters": voters,
        "log.dirs": str(node_dir(data_dir, node.node_id) / "data"),
    }
    return server_settings() | topology_settings(len(layout.nodes)) | own


def node_dir(data_dir: Path, node_id: int) -> Path:
    return Path(data_dir) / f"node-{node_id}"


def _marker(data_dir: Path, node_id: int) -> bytes:
    """In a node's command line: its properties file, so only this folder's nodes are
    signalled."""
    return str(node_dir(data_dir, node_id) / "server.properties").encode()


def _write_properties(path: Path, props: dict[str, str]) -> None:
    lines = ["# written by srl.broker.apache from srl/broker/apache_kafka/server.properties"]
    lines += [f"{k}={v}" for k, v in props.items()]
    path.write_text("\n".join(lines) + "\n")


def jvm_opts() -> list[str]:
    return (os.environ.get("SRL_KAFKA_JVM_OPTS") or DEFAULT_JVM_OPTS).split()


class KafkaCluster:
    """Apache Kafka nodes of one data folder: start, stop, and (for tests and faults) signal
    one node. ``port`` 0 picks free ports. ``host``: the address the nodes listen on (another
    than loopback only for a network namespace of a test's own, whose nodes it starts itself:
    ``prepare`` and ``command``)."""

    def __init__(
        self,
        data_dir: Path,
        nodes: int = 1,
        port: int = 0,
        kafka_home: Path | None = None,
        timeout_s: float = 120.0,
        log: Any = None,
        host: str = "127.0.0.1",
    ) -> None:
        if nodes not in (1, 3):
            raise SrlError(f"--nodes is 1 or 3, not {nodes}")
        self.data_dir = Path(data_dir).resolve()
        self.kafka_home = kafka_home
        self.timeout_s = timeout_s
        self.log = log
        self.host = host
        self.layout = self._layout(nodes, port)
        self._cp: str | None = None

    # -- layout --------------------------------------------------------------------------------
    def _layout_file(self) -> Path:
        return self.data_dir / "kafka.json"

    def _layout(self, nodes: int, port: int) -> Layout:
        try:
            d = orjson.loads(self._layout_file().read_bytes())
            layout = Layout(d["cluster_id"], [Node(**n) for n in d["nodes"]])
        except (OSError, ValueError, KeyError, TypeError):
            layout = None
        if layout is not None:
            have = len(layout.nodes)
            if have != nodes or (port and layout.nodes[0].port != port):
                raise SrlError(
                    f"{self.data_dir} holds a {have}-node Kafka on port {layout.nodes[0].port}; "
                    f"start it as it is, or pick another --data-dir for {nodes} node(s) on "
                    f"port {port or 'any'}"
                )
            return layout
        if port:  # brokers on port, port+1 …; controllers after them
            ports = [port + i for i in range(nodes)]
            cports = [port + nodes + i for i in range(nodes)]
        else:
            ports = [free_port() for _ in range(nodes)]
            cports = [free_port() for _ in range(nodes)]
        made = [Node(i + 1, ports[i], cports[i], host=self.host) for i in range(nodes)]
        return Layout(new_cluster_id(), made)

    def _save(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        d = {"cluster_id": self.layout.cluster_id, "nodes": [asdict(n) for n in self.layout.nodes]}
        self._layout_file().write_bytes(orjson.dumps(d, option=orjson.OPT_INDENT_2))

    @property
    def nodes(self) -> list[Node]:
        return self.layout.nodes

    @property
    def bootstrap(self) -> str:
        return self.layout.bootstrap

    def node(self, node_id: int) -> Node:
        for n in self.nodes:
            if n.node_id == node_id:
                return n
        raise SrlError(f"no node {node_id} (nodes {[n.node_id for n in self.nodes]})")

    # -- processes -----------------------------------------------------------------------------
    def _classpath(self) -> str:
        if self._cp is None:
            self._cp = classpath(self.kafka_home, self.log)
        return self._cp

    def _java(self, main: str, args: list[str], opts: list[str], node_id: int) -> list[str]:
        nd = node_dir(self.data_dir, node_id)
        return [
            check_java(),
            *opts,
            "-Djava.awt.headless=true",
            f"-Dlog4j2.configurationFile={dist_file('log4j2.properties')}",
            f"-Dkafka.logs.dir={nd}",
            "-cp",
            self._classpath(),
            main,
            *args,
        ]

    def running(self, node: Node) -> bool:
        return node.pid is not None and alive(node.pid, _marker(self.data_dir, node.node_id))

    def _format(self, node: Node) -> None:
        nd = node_dir(self.data_dir, node.node_id)
        if (nd / "data" / "meta.properties").is_file():
            return
        nd.mkdir(parents=True, exist_ok=True)
        props = nd / "server.properties"
        args = ["format", "-t", self.layout.cluster_id, "-c", str(props), "--ignore-formatted"]
        cmd = self._java("kafka.tools.StorageTool", args, TOOL_JVM_OPTS.split(), node.node_id)
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if out.returncode != 0:
            why = (out.stderr or out.stdout).strip().splitlines()
            raise SrlError(f"formatting Kafka node {node.node_id} failed: {why[-1] if why else ''}")

    def command(self, node: Node) -> list[str]:
        """The command line that runs ``node`` (once ``prepare`` has written and formatted it)."""
        props = node_dir(self.data_dir, node.node_id) / "server.properties"
        return self._java(MAIN_CLASS, [str(props)], jvm_opts(), node.node_id)

    def _spawn(self, node: Node) -> None:
        nd = node_dir(self.data_dir, node.node_id)
        node.pid = spawn(self.command(node), nd / "kafka.log", nd)

    def prepare(self, nodes: Sequence[Node]) -> None:
        """Write the properties of ``nodes`` and format the new ones' storage."""
        self._save()
        for n in nodes:
            nd = node_dir(self.data_dir, n.node_id)
            nd.mkdir(parents=True, exist_ok=True)
            _write_properties(
                nd / "server.properties", node_properties(n, self.layout, self.data_dir)
            )
        with ThreadPoolExecutor(len(nodes) or 1) as pool:
            list(pool.map(self._format, nodes))

    def start(self) -> KafkaCluster:
        """Start every node not running yet (formatting new ones) and wait until the cluster
        answers with all its nodes."""
        check_java()
        self._classpath()
        todo = [n for n in self.nodes if not self.running(n)]
        for n in todo:
            for p in (n.port, n.controller_port):
                if not bindable(p):
                    raise SrlError(
                        f"port {p} on 127.0.0.1 is already in use; pick another with --port"
                    )
        self.prepare(todo)
        for n in todo:
            self._spawn(n)
        self._save()
        try:
            self.wait_ready([n.node_id for n in todo])
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ready(
        self, node_ids: Sequence[int] | None = None, timeout_s: float | None = None
    ) -> None:
        """Until each of ``node_ids`` (all) answers metadata listing every node."""
        ids = list(node_ids) if node_ids is not None else [n.node_id for n in self.nodes]
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        waiting = [self.node(i) for i in ids]
        while waiting:
            for n in list(waiting):
                assert n.pid is not None
                nd = node_dir(self.data_dir, n.node_id)
                # a child of ours is watched by its exit code (its command line is not the
                # node's until it has exec'd java); one started elsewhere by its command line
                code = exit_code(n.pid)
                if code is not None or (not owned(n.pid) and not self.running(n)):
                    raise SrlError(
                        f"Kafka node {n.node_id} exited"
                        f"{f' with code {code}' if code is not None else ''}: "
                        f"{last_line(nd / 'kafka.log')}"
                    )
                if port_open(n.port) and self._answers(n):
                    waiting.remove(n)
            if not waiting:
                return
            if time.monotonic() > deadline:
                n = waiting[0]
                raise SrlError(
                    f"Kafka node {n.node_id} did not answer on {n.bootstrap} within "
                    f"{timeout_s or self.timeout_s:g}s: "
                    f"{last_line(node_dir(self.data_dir, n.node_id) / 'kafka.log')}"
                )
            time.sleep(0.2)

    def _answers(self, node: Node) -> bool:
        return broker_count(node.bootstrap, timeout_s=2.0) >= len(self.nodes)

    def signal(self, node_id: int, sig: int) -> bool:
        """Send ``sig`` to node ``node_id`` (SIGKILL, SIGSTOP, SIGCONT …); False if it is not
        running."""
        n = self.node(node_id)
        return n.pid is not None and signal_pid(n.pid, sig, _marker(self.data_dir, node_id))

    def kill(self, node_id: int) -> None:
        """SIGKILL one node and wait until it is gone."""
        n = self.node(node_id)
        if n.pid is not None and self.signal(node_id, signal.SIGKILL):
            wait_gone(n.pid, _marker(self.data_dir, node_id))

    def start_node(self, node_id: int) -> None:
        """Start one stopped node again on its data and wait until it answers."""
        n = self.node(node_id)
        if self.running(n):
            return
        self._spawn(n)
        self._save()
        self.wait_ready([node_id])

    def stop_node(self, node_id: int, grace_s: float = 30.0) -> None:
        n = self.node(node_id)
        if n.pid is not None:
            kill([n.pid], _marker(self.data_dir, node_id), grace_s)

    def stop(self, grace_s: float = 30.0) -> bool:
        """SIGTERM every node, SIGKILL what is left after ``grace_s``; False if none ran."""
        was = any(self.running(n) for n in self.nodes)
        for n in self.nodes:
            if n.pid is not None:
                # each node's own marker; all get SIGTERM first, so their shutdowns overlap
                signal_pid(n.pid, signal.SIGTERM, _marker(self.data_dir, n.node_id))
        for n in self.nodes:
            if n.pid is not None:
                kill([n.pid], _marker(self.data_dir, n.node_id), grace_s)
        return was

    def active_controller(self, timeout_s: float = 60.0) -> int | None:
        """The node id of the KRaft quorum's leader (the active controller), asked of the
        controllers with ``kafka-metadata-quorum``; None if none answered."""
        quorum = ",".join(f"127.0.0.1:{n.controller_port}" for n in self.nodes)
        args = ["--bootstrap-controller", quorum, "describe", "--status"]
        try:
            out = run_tool("kafka-metadata-quorum", args, self.kafka_home, timeout_s)
        except SrlError:
            return None
        for line in out.stdout.splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "LeaderId" and value.strip().lstrip("-").isdigit():
                return int(value) if int(value) >= 0 else None
        return None

    def status(self) -> dict[str, Any]:
        nodes = []
        for n in self.nodes:
            up = self.running(n)
            nodes.append(
                {
                    "node_id": n.node_id,
                    "pid": n.pid if up else None,
                    "running": up,
                    "answering": up and port_open(n.port),
                    "bootstrap": n.bootstrap,
                    "controller_port": n.controller_port,
                    "data_dir": str(node_dir(self.data_dir, n.node_id)),
                }
            )
        return {
            "engine": "kafka",
            "running": any(x["running"] for x in nodes),
            "answering": any(x["answering"] for x in nodes),
            "bootstrap": self.bootstrap,
            "cluster_id": self.layout.cluster_id,
            "data_dir": str(self.data_dir),
            "nodes": nodes,
        }

    def __enter__(self) -> KafkaCluster:
        return self.start()

    def __exit__(self, *_: Any) -> None:
        self.stop()


def load(data_dir: Path) -> KafkaCluster | None:
    """The cluster recorded in ``data_dir``, or None if it holds none."""
    if not (Path(data_dir) / "kafka.json").is_file():
        return None
    d = orjson.loads((Path(data_dir) / "kafka.json").read_bytes())
    return KafkaCluster(Path(data_dir), nodes=len(d["nodes"]))


@contextlib.contextmanager
def temporary(nodes: int = 1, log: Any = None, **kw: Any) -> Iterator[KafkaCluster]:
    """A cluster on free ports in a temporary folder, removed afterwards (tests, benchmarks)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="srl-kafka-") as tmp:
        cluster = KafkaCluster(Path(tmp), nodes=nodes, log=log, **kw)
        try:
            yield cluster.start()
        finally:
            cluster.stop()
