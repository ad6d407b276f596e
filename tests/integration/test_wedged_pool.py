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
import subprocess
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import orjson
import pytest

from producers.pool_member import current_assignment
from srl.config import CommonConfig, load_config
from srl.topics import Layout
from tests.conftest import bin_path
from tests.integration.test_generation import Trajectories, check_exactly_once

PARTITIONS = 4
BOUND_S = 30.0  # issue 18: taken over and resumed within this long of the kill


def prompts(path: Path, per_partition: int, length: int) -> list[str]:
    """Prompt ids, ``per_partition`` on each prompt partition (librdkafka hashes keys with
    CRC32), each generating exactly ``length`` tokens in the sim engine."""
    ids: list[str] = []
    count = dict.fromkeys(range(PARTITIONS), 0)
    i = 0
    while len(ids) < per_partition * PARTITIONS:
        pid, i = f"q{i}", i + 1
        part = zlib.crc32(pid.encode()) % PARTITIONS
        if count[part] < per_partition:
            ids.append(pid)
            count[part] += 1
    lines = [
        {"prompt_id": p, "prompt": f"question {p}?", "metadata": {"sim_length": length}}
        for p in ids
    ]
    path.write_text("".join(orjson.dumps(x).decode() + "\n" for x in lines))
    return ids


@contextmanager
def generator(env: dict[str, str], wid: str, log: Path) -> Iterator[subprocess.Popen[str]]:
    args = [
        bin_path("srl-producer"),
        "-v",
        "generate",
        "--engine",
        "sim",
        "--worker-id",
        wid,
        "--max-batch",
        "4",
        "--chunk-tokens",
        "32",
        "--buckets",
        "le1024",
        "-X",
        "session.timeout.ms=6000",
    ]
    with open(log, "w") as out:
        proc = subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)


def in_flight_of(t: Trajectories, wid: str) -> set[str]:
    """Trajectories ``wid`` started and published at least one chunk of, not finished."""
    return {
        tid for tid in t.chunks if (cs := t.ordered(tid))[0].worker_id == wid and not cs[-1].is_last
    }


def resumed_by(t: Trajectories, tids: set[str], wid: str) -> set[str]:
    return {tid for tid in tids if any(c.worker_id == wid for c in t.ordered(tid))}


def owners(cfg: CommonConfig) -> dict[str, set[tuple[str, int]]]:
    """Which worker holds which task partitions in the pool's last opened epoch."""
    held: dict[str, set[tuple[str, int]]] = {}
    for key, parts in current_assignment(cfg, f"{cfg.topic_prefix}.gen.regular").items():
        held.setdefault(key.split("/")[0], set()).update(parts)
    return held


@pytest.mark.slow
def test_a_sigkilled_generator_does_not_wedge_its_pool(
    cli_env: dict[str, str], tmp_path: Path
) -> None:
    env = {**cli_env, "SRL_PROMPT_PARTITIONS": str(PARTITIONS)}
    cfg = load_config(CommonConfig, env={k: v for k, v in env.items() if k.startswith("SRL_")})
    layout = Layout.from_config(cfg)
    ids = prompts(tmp_path / "p.jsonl", per_partition=2, length=600)
    topics = subprocess.run(
        [bin_path("srl"), "topics", "create"], env=env, capture_output=True, timeout=60
    )
    assert topics.returncode == 0, topics.stderr
    t = Trajectories(cfg)
    logs = {w: tmp_path / f"{w}.log" for w in ("wa", "wb")}
    task_parts = {
        (topic, p)
        for topic in (layout.prompts("le1024"), layout.resumes("le1024"))
        for p in range(PARTITIONS)
    }
    with generator(env, "wa", logs["wa"]) as wa, generator(env, "wb", logs["wb"]) as wb:
        deadline = time.monotonic() + 60
        while sorted(len(p) for p in owners(cfg).values()) != [4, 4]:  # 4 partitions each
            assert time.monotonic() < deadline, owners(cfg)
            assert wa.poll() is None and wb.poll() is None, logs["wa"].read_text()[-3000:]
            time.sleep(0.5)
        out = subprocess.run(
            [
                bin_path("srl-producer"),
                "dispatch",
                "--unpaced",
                "--partitioning",
                "key",
                "--prompts",
                str(tmp_path / "p.jsonl"),
                "--group-size",
                "2",
                "--max-new-tokens",
                "1000",
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
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
            return owners(cfg) == {"wb": task_parts}

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
