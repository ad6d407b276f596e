"""A generator pool of real ``srl-producer generate --engine sim`` processes, for fault tests.

One pool (``regular``, bucket ``le1024``) on ``PARTITIONS`` prompt partitions (and as many
resume partitions), 6 s sessions; prompts whose sim length is fixed, placed evenly on the
prompt partitions; what the pool's last opened epoch assigns to whom
(``producers.pool_member.current_assignment``). Used by ``tests/integration/test_wedged_pool.py``
and ``tests/integration/test_generator_faults.py``.
"""

from __future__ import annotations

import subprocess
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import orjson

from producers.pool_member import current_assignment
from srl.config import CommonConfig, load_config
from srl.topics import Layout
from tests.conftest import bin_path
from tests.integration.test_generation import Trajectories

PARTITIONS = 4
BOUND_S = 30.0  # issue 18: taken over and resumed within this long of the fault
SESSION = ("-X", "session.timeout.ms=6000")


def pool_env(cli_env: dict[str, str]) -> tuple[dict[str, str], CommonConfig]:
    """The pool's environment (``PARTITIONS`` prompt partitions), its config; topics created."""
    env = {**cli_env, "SRL_PROMPT_PARTITIONS": str(PARTITIONS)}
    cfg = load_config(CommonConfig, env={k: v for k, v in env.items() if k.startswith("SRL_")})
    out = subprocess.run(
        [bin_path("srl"), "topics", "create"], env=env, capture_output=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return env, cfg


def task_partitions(cfg: CommonConfig) -> set[tuple[str, int]]:
    layout = Layout.from_config(cfg)
    return {
        (topic, p)
        for topic in (layout.prompts("le1024"), layout.resumes("le1024"))
        for p in range(PARTITIONS)
    }


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


def dispatch(env: dict[str, str], path: Path, group_size: int = 2) -> None:
    """Publish the prompts of ``path`` at once, each on the partition its key hashes to."""
    out = subprocess.run(
        [
            bin_path("srl-producer"),
            "dispatch",
            "--unpaced",
            "--partitioning",
            "key",
            "--prompts",
            str(path),
            "--group-size",
            str(group_size),
            "--max-new-tokens",
            "1000",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr


@contextmanager
def generator(
    env: dict[str, str], wid: str, log: Path, *extra: str
) -> Iterator[subprocess.Popen[str]]:
    """A worker of the pool; killed (and SIGCONTed first) on exit if the test did not stop it."""
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
        *SESSION,
        *extra,
    ]
    with open(log, "w") as out:
        proc = subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)


def owners(cfg: CommonConfig) -> dict[str, set[tuple[str, int]]]:
    """Which worker holds which task partitions in the pool's last opened epoch."""
    held: dict[str, set[tuple[str, int]]] = {}
    for key, parts in current_assignment(cfg, f"{cfg.topic_prefix}.gen.regular").items():
        held.setdefault(key.split("/")[0], set()).update(parts)
    return held


def wait_for_shares(
    cfg: CommonConfig, procs: dict[str, subprocess.Popen[str]], logs: dict[str, Path]
) -> None:
    """Until the pool's assignment gives every worker of ``procs`` an even share."""
    even = [2 * PARTITIONS // len(procs)] * len(procs)
    deadline = time.monotonic() + 60
    while sorted(len(owners(cfg).get(w, ())) for w in procs) != even:
        assert time.monotonic() < deadline, owners(cfg)
        for w, p in procs.items():
            assert p.poll() is None, logs[w].read_text()[-3000:]
        time.sleep(0.5)


def in_flight_of(t: Trajectories, wid: str) -> set[str]:
    """Trajectories ``wid`` started and published at least one chunk of, not finished."""
    return {
        tid for tid in t.chunks if (cs := t.ordered(tid))[0].worker_id == wid and not cs[-1].is_last
    }


def resumed_by(t: Trajectories, tids: set[str], wid: str) -> set[str]:
    return {tid for tid in tids if any(c.worker_id == wid for c in t.ordered(tid))}
