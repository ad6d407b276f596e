"""The faults of an Apache Kafka cluster under load: ``srl chaos --broker kafka --nodes 3``.

Each node is a broker and a KRaft controller (``srl.broker.apache``); the data topics have
three replicas and ``min.insync.replicas=2``, so one node may be down while producers with
``acks=all`` go on. The injectors (named in ``app.chaos.catalogue``):

* ``kafka-leader-kill``: SIGKILL the node that leads most partitions of the trajectories
  topic, the one every generator writes to; restarted after ``RESTART_DELAY_S`` on its data,
  as a process manager would. Recovery is counted from the kill: the failover, not the node's
  return.
* ``kafka-node-freeze``: SIGSTOP that node for ``stop_s`` (20 s: past the broker session of
  4 s, ``broker.session.timeout.ms`` in ``srl/broker/apache_kafka/server.properties``, so the
  controller fences it and moves its leaders), then SIGCONT; counted from SIGCONT.
* ``kafka-rolling-restart``: each node in turn stopped with SIGTERM (a controlled shutdown),
  started again, and the next one only once every partition has all its replicas in sync
  again, as an operator rolls an upgrade; counted from the last node's return.
* ``kafka-controller-kill``: SIGKILL the active controller (the quorum's leader, asked with
  ``kafka-metadata-quorum``); restarted after ``RESTART_DELAY_S``; counted from the kill.

Each waits (bounded) for trajectories in flight first, so the fault meets open work, and is
checked by ``app.chaos.faults.inflight_done``: what was in flight is finished and a step
released after the fault is trained. On the embedded broker or one node the rows are skipped
with the reason (``app.chaos.run``). Only the nodes of the suite's own cluster are signalled,
by pid.
"""

from __future__ import annotations

import signal
import time
from collections import Counter

from app.chaos.cast import RESTART_DELAY_S, KafkaBroker
from app.chaos.faults import Injection, Scene, begin_inflight, worker_id
from srl.kafka import replicas
from srl.topics import Layout

REPLICATED_TIMEOUT_S = 120.0  # a rolling restart waits this long at most for in-sync replicas


def _cluster(sc: Scene, inj: Injection) -> KafkaBroker | None:
    if isinstance(sc.broker, KafkaBroker) and len(sc.broker.cluster.nodes) >= 3:
        return sc.broker
    inj.skipped = "needs a three-node Apache Kafka cluster (--broker kafka --nodes 3)"
    return None


def busiest_leader(sc: Scene, broker: KafkaBroker) -> tuple[int, str]:
    """The node leading most partitions of the run's trajectories topic, and how many."""
    parts = replicas(sc.stage.common(), Layout.from_config(sc.stage.common()).trajectories)
    leaders = Counter(p.leader for p in parts if p.leader >= 0)
    if not leaders:
        return broker.cluster.nodes[0].node_id, "no partition had a leader"
    node, n = max(sorted(leaders.items()), key=lambda kv: kv[1])
    return node, f"leads {n} of {len(parts)} trajectory partitions"


def under_replicated(sc: Scene) -> int | None:
    """Partitions (of every topic) short of in-sync replicas; None if no node answered."""
    try:
        return sum(p.under_replicated for p in replicas(sc.stage.common()))
    except Exception:
        return None


def _in_flight(sc: Scene, inj: Injection) -> None:
    begin_inflight(sc, inj, [worker_id(g) for g in sc.stage.generators])


def kill_leader(sc: Scene, inj: Injection) -> None:
    broker = _cluster(sc, inj)
    if broker is None:
        return
    _in_flight(sc, inj)
    node, why = busiest_leader(sc, broker)
    _kill_and_restart(sc, inj, broker, node, f"node {node} ({why})")


def freeze_node(sc: Scene, inj: Injection) -> None:
    broker = _cluster(sc, inj)
    if broker is None:
        return
    _in_flight(sc, inj)
    node, why = busiest_leader(sc, broker)
    inj.target = f"kafka node {node}"
    inj.start = time.time()
    broker.cluster.signal(node, signal.SIGSTOP)
    try:
        sc.sleep(sc.cfg.stop_s)
    finally:
        broker.cluster.signal(node, signal.SIGCONT)
    inj.end = time.time()
    inj.note = (
        f"node {node} ({why}) SIGSTOPped {sc.cfg.stop_s:g} s with {len(inj.inflight)} "
        "trajectories in flight"
    )


def rolling_restart(sc: Scene, inj: Injection) -> None:
    broker = _cluster(sc, inj)
    if broker is None:
        return
    _in_flight(sc, inj)
    inj.target = "kafka nodes " + ", ".join(str(n.node_id) for n in broker.cluster.nodes)
    inj.start = time.time()
    waits = []
    for n in broker.cluster.nodes:
        broker.cluster.stop_node(n.node_id)  # SIGTERM: a controlled shutdown
        broker.cluster.start_node(n.node_id)
        t0 = time.monotonic()
        sc.until(lambda: under_replicated(sc) == 0, REPLICATED_TIMEOUT_S, 0.5)
        waits.append(f"{time.monotonic() - t0:.0f}")
        if sc.halt.is_set():
            break
    inj.end = time.time()
    inj.note = (
        f"each node SIGTERMed and restarted in turn, {inj.end - inj.start:.0f} s in all "
        f"(in sync again after {'/'.join(waits)} s); {len(inj.inflight)} trajectories in flight"
    )


def kill_controller(sc: Scene, inj: Injection) -> None:
    broker = _cluster(sc, inj)
    if broker is None:
        return
    _in_flight(sc, inj)
    node = broker.cluster.active_controller()
    if node is None:
        inj.skipped = "kafka-metadata-quorum named no active controller"
        return
    _kill_and_restart(sc, inj, broker, node, f"active controller node {node}")


def _kill_and_restart(sc: Scene, inj: Injection, broker: KafkaBroker, node: int, what: str) -> None:
    """SIGKILL ``node``, then start it again after ``RESTART_DELAY_S`` on its data; the
    recovery is counted from the kill."""
    inj.target = f"kafka node {node}"
    inj.start = inj.end = time.time()
    broker.cluster.kill(node)
    sc.sleep(RESTART_DELAY_S)
    broker.cluster.start_node(node)
    inj.note = (
        f"{what} SIGKILLed with {len(inj.inflight)} trajectories in flight; "
        f"back after {time.time() - inj.start:.1f} s"
    )
