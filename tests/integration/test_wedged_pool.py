"""SIGKILL one of a pool's generators on the embedded broker: the pool must not wedge (issue 18).

The probe of docs/reliability.md ("Wedged pools: what we measured") as a test: two
``srl-producer generate --engine sim`` workers of one pool share 4 prompt partitions (and 4
resume partitions); one is SIGKILLed mid-trajectory. Within 30 s the survivor must hold every
task partition in the pool's assignment (pool epochs, ``producers.pool``) and have resumed
the dead worker's in-flight trajectories from their published prefixes; in the end every
sample is complete exactly once. Without pool epochs (``SRL_POOL_LIVENESS=false``: a plain
consumer group) the embedded broker (noida-db 0.2.3) never evicts the dead member, the
survivor keeps its own partitions for good and this test fails.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from tests.genpool import (
    BOUND_S,
    dispatch,
    generator,
    in_flight_of,
    owners,
    pool_env,
    prompts,
    resumed_by,
    task_partitions,
    wait_for_shares,
)
from tests.integration.test_generation import Trajectories, check_exactly_once

# the embedded broker's tier (tests/conftest.py): the broker that never evicts a dead member
pytestmark = pytest.mark.embedded


@pytest.mark.slow
def test_a_sigkilled_generator_does_not_wedge_its_pool(
    cli_env: dict[str, str], tmp_path: Path
) -> None:
    env, cfg = pool_env(cli_env)
    ids = prompts(tmp_path / "p.jsonl", per_partition=2, length=600)
    t = Trajectories(cfg)
    logs = {w: tmp_path / f"{w}.log" for w in ("wa", "wb")}
    with generator(env, "wa", logs["wa"]) as wa, generator(env, "wb", logs["wb"]) as wb:
        wait_for_shares(cfg, {"wa": wa, "wb": wb}, logs)
        dispatch(env, tmp_path / "p.jsonl")
        t.wait(lambda t: len(in_flight_of(t, "wa")) >= 2, timeout_s=60)
        assert not t.complete(), "the kill must come before any trajectory is complete"
        wa.send_signal(signal.SIGKILL)
        assert wa.wait(timeout=10) == -signal.SIGKILL
        killed = time.monotonic()
        t.poll()
        dead_work = in_flight_of(t, "wa")

        def taken_over(t: Trajectories) -> bool:
            assert wb.poll() is None, logs["wb"].read_text()[-3000:]
            if resumed_by(t, dead_work, "wb") != dead_work:
                return False
            return owners(cfg) == {"wb": task_partitions(cfg)}

        t.wait(taken_over, timeout_s=BOUND_S)
        took_s = time.monotonic() - killed
        print(f"taken over and resumed {took_s:.1f}s after the SIGKILL")
        t.wait(lambda t: len(t.complete()) == len(ids) * 2, timeout_s=60)
        wb.send_signal(signal.SIGTERM)
        assert wb.wait(timeout=60) == 0, logs["wb"].read_text()[-3000:]
    assert took_s <= BOUND_S
    done = check_exactly_once(t, {(p, s) for p in ids for s in range(2)})
    assert t.duplicates == 0
    for tid in dead_work:  # wb continued the numbering right after wa's last chunk
        wids = [c.worker_id for c in t.ordered(tid)]
        switch = wids.index("wb")
        assert set(wids[:switch]) == {"wa"} and set(wids[switch:]) == {"wb"}, wids
    assert all(cs[-1].worker_id in ("wa", "wb") for cs in done.values())
