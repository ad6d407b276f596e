"""A generator under a produce quota on Apache Kafka: slowed to the quota, nothing lost.

A quota (``kafka-configs --entity-type clients``) of 1 KiB/s on the generator's client id,
which is the same for every run of it (``{prefix}.generator-{host}``), about a fifth of the
rate the paced sim engine generates at. The broker throttles the generator's producer, which
holds the engine back (``srl.kafka.producer.Throttle``: no record queued much longer than a
quarter of the delivery timeout): every trajectory arrives exactly once and the worker ends
cleanly. The delivery timeout is the default 30 s (``connect_timeout_s`` 10 x 3), longer
than the broker's 11 s quota window over which a first unthrottled burst is paid back: a
timeout shorter than that window fails records queued before the first throttle whatever
the producer does (measured: 6 s fails with or without the hold; 15 s passed alone and
failed once beside other tests). At this size the run also completes without the hold (it
asserts the hold engaged); docs/security.md gives a measured run where the hold is what
kept 93 records of 900 from timing out. ``tests/unit/test_throttle.py`` tests the rule.
"""

from __future__ import annotations

import socket
from typing import Any

import pytest

from producers.config import DispatchConfig
from producers.dispatcher import run_dispatcher
from ranker.predictor import BaselinePredictor
from srl.broker import apache
from srl.kafka import client_id, create_topics
from tests.chunks import sim_generate_cfg
from tests.integration.test_generation import Trajectories, check_exactly_once, prompts, workers

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

QUOTA_BYTES_S = 1024


def set_quota(bootstrap: str, client: str, rate: int | None) -> None:
    """``producer_byte_rate`` of ``client`` on the cluster (None: removed)."""
    change = ["--add-config", f"producer_byte_rate={rate}"] if rate else ["--delete-config"]
    change += [] if rate else ["producer_byte_rate"]
    out = apache.run_tool(
        "kafka-configs",
        ["--bootstrap-server", bootstrap, "--alter", *change]
        + ["--entity-type", "clients", "--entity-name", client],
    )
    assert out.returncode == 0, out.stderr[-2000:]


def test_a_generator_under_a_produce_quota_slows_down_and_loses_nothing(
    make_cfg: Any, bootstrap: str, prefix: str
) -> None:
    dcfg = make_cfg(
        DispatchConfig, prompts="unused.jsonl", group_size=4, max_new_tokens=120, window=8
    )
    cfg = sim_generate_cfg(make_cfg, time_scale=1.0, max_batch=8, worker_id="q")
    name = client_id("generator", prefix)
    assert name == f"{prefix}.generator-{socket.gethostname()}"  # stable: a quota can name it
    create_topics(dcfg)
    set_quota(bootstrap, name, QUOTA_BYTES_S)
    try:
        t = Trajectories(dcfg)
        src = prompts(6)
        with workers(cfg) as ws:
            run_dispatcher(dcfg, src, BaselinePredictor(100))
            t.wait(lambda t: len(t.complete()) == 24, ws, timeout_s=240)
    finally:
        set_quota(bootstrap, name, None)
    check_exactly_once(t, {(p.prompt_id, s) for p in src for s in range(4)})
    assert t.duplicates == 0
    (summary,) = ws.summaries
    assert summary.trajectories == 24
    # the broker throttled the generator's producer, which held the engine back
    assert summary.throttled_s > 0 and summary.held_s > 0, summary
    t.reader.close()
