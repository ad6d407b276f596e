"""``srl bench idle``: what a group member costs while it waits for records, quiet
(``srl.kafka.quiet``: partitions read to their end paused and probed) against fetching them
continuously, side by side on one broker of each engine asked for (the embedded one answers a
fetch at the end of a partition at once; Apache Kafka holds it up to ``fetch.wait.max.ms``).

Each mode: a fresh topic of ``partitions`` partitions, one member of its own group
(``make_consumer`` with ``quiet_s`` 0.02 or None) and, in a thread of this process, a
producer that sends ``records`` records in ``bursts`` evenly spread over ``seconds``. Counted:
CPU seconds per second of the broker (``/proc``) and of this process (the member and its
librdkafka threads, and the producer, the same in both modes), every record read exactly
once, and the delay from a record's timestamp to its arrival (median and p99): what being
quiet adds to a record that arrives while its partition sleeps.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from srl.broker import Engine, temporary
from srl.config import CommonConfig, load_config
from srl.kafka import Producer, create_topics, make_consumer, produced_ms
from srl.topics import TopicSpec

QUIET_S = 0.02


def cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds of processes ``pids`` (Linux ``/proc``)."""
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def phase(
    cfg: CommonConfig,
    broker_pids: list[int],
    quiet: bool,
    partitions: int,
    records: int,
    bursts: int,
    seconds: float,
) -> dict[str, Any]:
    topic = f"bench-idle-{uuid.uuid4().hex[:8]}"
    create_topics(cfg, [TopicSpec(topic, partitions, {})])
    member = make_consumer(cfg, f"{topic}-g", "bench-idle", quiet_s=QUIET_S if quiet else None)
    member.subscribe([topic])
    seen: dict[int, list[int]] = {}
    delays: list[float] = []

    def send() -> None:
        with Producer(cfg, "bench-idle") as p:
            for b in range(bursts):
                time.sleep(seconds / bursts)
                for i in range(b * records // bursts, (b + 1) * records // bursts):
                    p.produce(topic, str(i).encode(), key=str(i), partition=i % partitions)
                p.flush()

    member.next_batch(100, 1.0)  # assigned before the clock starts
    sender = threading.Thread(target=send, name="bench-idle-producer")
    b0, m0, t0 = cpu_s(broker_pids), time.process_time(), time.monotonic()
    sender.start()
    while sender.is_alive() or sum(map(len, seen.values())) < records:
        for m in member.next_batch(500, 0.2):
            if m.error() is None:
                seen.setdefault(m.partition() or 0, []).append(int(m.value() or b"0"))
                delays.append(time.time() - (produced_ms(m) or 0) / 1000)
        if time.monotonic() - t0 > seconds + 30:
            break
    wall = time.monotonic() - t0
    b1, m1 = cpu_s(broker_pids), time.process_time()
    member.close()
    got = sorted(v for vs in seen.values() for v in vs)
    in_order = all(vs == sorted(vs) for vs in seen.values())
    return {
        "mode": "quiet" if quiet else "fetching",
        "broker_cores": round((b1 - b0) / wall, 3),
        "client_cores": round((m1 - m0) / wall, 3),
        "records_read": len(got),
        "each_once_in_order": got == list(range(records)) and in_order,
        "delay_ms_p50": round(float(np.percentile(delays, 50)) * 1000, 1) if delays else None,
        "delay_ms_p99": round(float(np.percentile(delays, 99)) * 1000, 1) if delays else None,
        "seconds": round(wall, 1),
    }


def run(
    partitions: int,
    records: int,
    bursts: int,
    seconds: float,
    brokers: tuple[Engine, ...] = ("embedded",),
) -> dict[str, Any]:
    """Both modes, fetching first, on one broker of each engine in ``brokers``; their rows
    and the CPU ratios, per broker."""
    out: dict[str, Any] = {"partitions": partitions, "records": records, "bursts": bursts}
    for engine in brokers:
        with temporary(engine) as b:
            values = {"bootstrap_servers": b.bootstrap, "topic_prefix": "bench-idle"}
            cfg = load_config(CommonConfig, cli=values, env={})
            if engine == "kafka":  # the JVM's start-up and JIT warm-up, off the clock
                phase(cfg, b.pids, False, partitions, records, bursts, min(seconds, 5.0))
            rows = [
                phase(cfg, b.pids, q, partitions, records, bursts, seconds) for q in (False, True)
            ]
        fetching, quiet = rows
        out[engine] = {
            "rows": rows,
            "broker_cpu_ratio": round(
                quiet["broker_cores"] / max(fetching["broker_cores"], 1e-3), 3
            ),
            "client_cpu_ratio": round(
                quiet["client_cores"] / max(fetching["client_cores"], 1e-3), 3
            ),
        }
    return out
