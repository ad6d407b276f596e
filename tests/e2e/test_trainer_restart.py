"""SIGKILL the real ``srl-consumer train`` mid-run, restart it, and audit exactly-once in effect.

The records include resumed trajectories (a prefix from one worker, continued by another in
another bucket's partitions, re-sending a chunk) and plain duplicate chunks, with behaviour
versions that make some groups stale under ``--max-staleness 1``.
"""

from __future__ import annotations

import dataclasses
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import orjson
import pytest

from consumers import checkpoint as ckpts
from schemas.records import TrajectoryChunk, WeightsAnnouncement, decode_as
from srl.config import CommonConfig
from srl.kafka import create_topics
from srl.stores import open_store
from srl.topics import Layout
from tests.chunks import (
    metric_events,
    produce,
    publish_versions,
    read_topic,
    text_ids,
    traj_chunks,
)
from tests.conftest import bin_path


def wave(first: int, count: int, rng: random.Random) -> list[TrajectoryChunk]:
    out: list[TrajectoryChunk] = []
    for g in range(first, first + count):
        a, b = rng.randrange(10), rng.randrange(10)
        version = max(0, g // 3 - rng.choice([0, 0, 1, 3]))  # some groups lag far behind
        for i in range(4):
            answer = str(a + b) if rng.random() < 0.5 else str(rng.randrange(20))
            chunks = traj_chunks(
                f"p{g}",
                i,
                4,
                text_ids(f"{a}+{b}="),
                text_ids(answer + "\n\n"),
                chunk_tokens=2,
                versions=version,
                logprobs=[-5.5] * (len(answer) + 2),
                metadata={"answer": a + b},
            )
            if i == 1 and len(chunks) > 1:  # resumed by worker B in the long-tail bucket
                chunks = chunks[:1] + [
                    dataclasses.replace(c, worker_id="B", bucket="le1024") for c in chunks
                ]
            if i == 2:
                chunks = chunks + chunks[-1:]  # a producer retry
            out += chunks
    return out


def train(
    cli_env: dict[str, str],
    model: Path,
    log: Path,
    reward: str = "consumers.rewards:first_line_match",
    idle_exit_s: int = 6,
    extra: tuple[str, ...] = (),
) -> subprocess.Popen[bytes]:
    args = [
        bin_path("srl-consumer"),
        "-v",
        "train",
        "--model",
        str(model),
        "--groups-per-step",
        "1",
        "--publish-every",
        "1",
        "--checkpoint-every",
        "2",
        "--keep-versions",  # every version stays: the audit checks none was skipped
        "0",
        "--max-staleness",
        "1",
        "--lr",
        "1e-3",
        "--micro-batch-tokens",
        "64",
        "--idle-exit-s",
        str(idle_exit_s),
        "--device",
        "cpu",
        "--reward",
        reward,
        *extra,
    ]
    with log.open("ab") as out:
        return subprocess.Popen(args, env=cli_env, stdout=out, stderr=subprocess.STDOUT)


def stop_once_decided(
    cfg: CommonConfig, proc: subprocess.Popen[bytes], n: int, timeout_s: float
) -> int:
    """SIGTERM the trainer once ``n`` trajectories have their sample event (decided and made
    durable) rather than waiting out its idle exit (which still ends a trainer that stops
    short); its exit code."""
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None and time.monotonic() < deadline:
        if len({e.labels["trajectory_id"] for e in metric_events(cfg, "sample")}) >= n:
            proc.send_signal(signal.SIGTERM)
            break
        time.sleep(1.0)
    return proc.wait(60)


def published(store_dir: Path, run: str = "default") -> list[int]:
    root = store_dir / "weights" / run
    return (
        sorted(int(p.parent.name[1:]) for p in root.glob("v*/manifest.json"))
        if root.exists()
        else []
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "protocol",
    ["classic", pytest.param("consumer", marks=pytest.mark.kafka)],  # KIP-848: Apache Kafka 4.x
    ids=["classic", "kip848"],
)
def test_sigkill_and_restart_train_each_trajectory_exactly_once(
    cli_env: dict[str, str],
    tiny_model: Path,
    tmp_path: Path,
    bootstrap: str,
    prefix: str,
    protocol: str,
) -> None:
    """SIGKILL the trainer mid-run and start it again: each trajectory is decided once. With
    ``-X group.protocol=consumer`` (KIP-848, Apache Kafka 4.x) the restarted trainer takes
    its static member's place back in the broker-run group as it does in a classic one."""
    extra = ("-X", f"group.protocol={protocol}")
    cfg = CommonConfig(bootstrap_servers=bootstrap, topic_prefix=prefix, store=cli_env["SRL_STORE"])
    layout = Layout.from_config(cfg)
    store_dir = Path(cli_env["SRL_STORE"][len("file://") :])
    create_topics(cfg)
    publish_versions(cfg, 40 // 3)  # the versions the waves claim exist (another run's)
    rng = random.Random(7)
    first = wave(0, 30, rng)
    produce(cfg, first)
    log = tmp_path / "trainer.log"

    proc = train(cli_env, tiny_model, log, extra=extra)
    try:
        deadline = time.monotonic() + 120
        while len(published(store_dir)) < 4 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert proc.poll() is None, f"trainer exited early:\n{log.read_text()[-3000:]}"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    before = published(store_dir)
    second = wave(30, 10, rng)
    produce(cfg, second)

    generated = {c.trajectory_id for c in first + second}
    proc = train(cli_env, tiny_model, log, extra=extra)
    try:
        assert stop_once_decided(cfg, proc, len(generated), 180) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)

    store = open_store(cli_env["SRL_STORE"])
    final = ckpts.load(store, "default", ckpts.complete(store, "default")[-1])
    # the ledger keeps only what a restart could read again (issue 18); the run's totals
    # count every trajectory once
    totals = final.extra["outcome_totals"]
    assert set(final.ledger) <= generated and sum(totals.values()) == len(generated)
    assert set(totals) == {"trained", "dropped_stale"}

    # the sample events (at least once, idempotent by (trajectory, step)) name one outcome each
    decided: dict[str, set[tuple[str, int]]] = {}
    for e in metric_events(cfg, "sample"):
        decided.setdefault(e.labels["trajectory_id"], set()).add((e.labels["outcome"], int(e.step)))
        if e.labels["outcome"] == "trained":
            assert e.values["staleness"] <= 1
    assert set(decided) == generated
    twice = {t: d for t, d in decided.items() if len(d) != 1}
    assert not twice, f"trained or dropped twice: {list(twice.items())[:3]}"
    assert all(next(iter(decided[t])) == (e[0], e[1]) for t, e in final.ledger.items())

    # versions only increase: contiguous in the store, non-decreasing on the weights topic
    after = published(store_dir)
    assert after == list(range(1, len(after) + 1)) and len(after) > len(before) >= 4
    anns = [decode_as(m.value(), WeightsAnnouncement) for m in read_topic(cfg, layout.weights)]
    assert [a.version for a in anns] == sorted(a.version for a in anns) and anns[
        -1
    ].version == after[-1]
    manifests = [
        orjson.loads((store_dir / f"weights/default/v{v:08d}/manifest.json").read_bytes())
        for v in after
    ]
    assert all(m["parent_version"] < m["version"] for m in manifests)
    text = log.read_text()
    assert "Traceback" not in text
    assert f"policy version {before[-1]}" in text, "the restart continued after the newest version"


def generator(cli_env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """A real sim-engine generator worker; token ids fit the tiny model's vocabulary."""
    args = [
        bin_path("srl-producer"),
        "-v",
        "generate",
        "--engine",
        "sim",
        "--time-scale",
        "1",
        "--max-batch",
        "8",
        "--chunk-tokens",
        "8",
        "--sim-vocab",
        "250",
        "--worker-id",
        "sim-0",
        "--seed",
        "0",
        "--max-backlog-chunks",
        "24",
    ]
    with log.open("ab") as out:
        return subprocess.Popen(args, env=cli_env, stdout=out, stderr=subprocess.STDOUT)


@pytest.mark.slow
def test_sigkill_the_trainer_fed_by_a_sim_generator_and_every_trajectory_is_decided_once(
    cli_env: dict[str, str], tiny_model: Path, tmp_path: Path, bootstrap: str, prefix: str
) -> None:
    """Issue 4's acceptance with real roles: a sim-engine generator process streams chunks,
    the trainer is SIGKILLed after a few versions and restarted; from its ledger every
    generated trajectory was trained or dropped as stale exactly once, none lost."""
    from schemas.records import PromptTask, encode, pack_tokens
    from srl.kafka import Producer

    cfg = CommonConfig(bootstrap_servers=bootstrap, topic_prefix=prefix, store=cli_env["SRL_STORE"])
    layout = Layout.from_config(cfg)
    store_dir = Path(cli_env["SRL_STORE"][len("file://") :])
    create_topics(cfg)
    rng = random.Random(3)
    with Producer(cfg, "test-dispatcher") as p:
        for i in range(40):  # 40 groups of 4; lengths 6-40 tokens (1-5 chunks)
            task = PromptTask(
                task_id=f"task-{i}",
                prompt_id=f"p{i}",
                prompt=f"{i}+{i}=",
                group_size=4,
                max_new_tokens=48,
                bucket=layout.buckets[0],
                prompt_tokens=pack_tokens(text_ids(f"{i}+{i}=")),
                metadata=orjson.dumps({"sim_length": rng.randrange(6, 41)}).decode(),
            )
            p.produce(layout.prompts(task.bucket), encode(task), key=task.prompt_id)
    glog, tlog = tmp_path / "generator.log", tmp_path / "trainer.log"
    gen = generator(cli_env, glog)
    procs = [gen]
    try:
        proc = train(cli_env, tiny_model, tlog, "app.bench.pipeline:sim_reward", idle_exit_s=20)
        procs.append(proc)
        deadline = time.monotonic() + 120
        while len(published(store_dir)) < 4 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert proc.poll() is None, f"trainer exited early:\n{tlog.read_text()[-3000:]}"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        before = published(store_dir)
        proc = train(cli_env, tiny_model, tlog, "app.bench.pipeline:sim_reward", idle_exit_s=20)
        procs.append(proc)
        assert stop_once_decided(cfg, proc, 160, 240) == 0, tlog.read_text()[-3000:]
        gen.send_signal(signal.SIGTERM)
        assert gen.wait(60) == 0, glog.read_text()[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)

    chunks = [decode_as(m.value(), TrajectoryChunk) for m in read_topic(cfg, layout.trajectories)]
    assert chunks and {c.worker_id for c in chunks} == {"sim-0"}
    generated = {c.trajectory_id for c in chunks if c.is_last}
    assert len(generated) == 160, "the generator finished every sample"
    store = open_store(cli_env["SRL_STORE"])
    final = ckpts.load(store, "default", ckpts.complete(store, "default")[-1])
    totals = final.extra["outcome_totals"]
    assert set(final.ledger) <= generated and sum(totals.values()) == len(generated)
    assert set(totals) <= {"trained", "dropped_stale"}
    decided: dict[str, set[tuple[str, int]]] = {}
    for e in metric_events(cfg, "sample"):
        decided.setdefault(e.labels["trajectory_id"], set()).add((e.labels["outcome"], int(e.step)))
        if e.labels["outcome"] == "trained":
            assert e.values["staleness"] <= 1
    assert set(decided) == generated
    assert not {t: d for t, d in decided.items() if len(d) != 1}, "trained or dropped twice"
    after = published(store_dir)
    assert after == list(range(1, len(after) + 1)) and len(after) > len(before) >= 4
    anns = [decode_as(m.value(), WeightsAnnouncement) for m in read_topic(cfg, layout.weights)]
    assert [a.version for a in anns] == sorted(a.version for a in anns)
    assert "Traceback" not in tlog.read_text() + glog.read_text()
