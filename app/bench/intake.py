"""``srl bench intake``: what rank 0's consume loop costs per record and per trajectory.

Owns the "rank 0 is not the ceiling" figures of docs/benchmarks.md ("Training"). Real parts,
no broker: trajectory chunks are encoded with the project's codec and handed to the trainer's
``consumers.intake.Intake`` as consumed records (decode, offset holds, ledger, assembly), then
each finished trajectory goes through the trainer's ``consumers.rewardpool.RewardPool`` with
a reward that burns ``--reward-ms`` of CPU (a symbolic-equivalence check, say), with the reward
in the loop (``--reward-workers 0``) and in reward processes. Reported: records/s and
completion tokens/s of the intake alone, the loop's busy time per trajectory in each reward
mode, and the rewards' throughput.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from consumers.assembler import Trajectory
from consumers.intake import Intake
from consumers.outcomes import Ledger, Outcomes
from consumers.rewardpool import RewardPool
from consumers.rewards import Scorer, load_reward
from schemas.records import TrajectoryChunk, encode, pack_logprobs, pack_tokens
from srl.metrics import Metrics
from srl.tinymodel import build_tokenizer
from srl.topics import Layout

TOPIC = "bench.trajectories"


def busy_reward(prompt: str, completion: str, metadata: dict[str, Any]) -> float:
    """Spin for ``metadata["ms"]`` ms of CPU (a stand-in for a costly verifier)."""
    end = time.thread_time() + float(metadata.get("ms", 0)) / 1000
    x = 0
    while time.thread_time() < end:
        x += 1
    return float(len(completion) % 2)


@dataclass
class Record:
    """A consumed record, as ``srl.kafka.Message`` shows one to the intake."""

    _value: bytes
    _key: bytes
    _offset: int

    def error(self) -> None:
        return None

    def value(self) -> bytes:
        return self._value

    def key(self) -> bytes:
        return self._key

    def topic(self) -> str:
        return TOPIC

    def partition(self) -> int:
        return 0

    def offset(self) -> int:
        return self._offset

    def timestamp(self) -> tuple[int, int]:
        return (1, int(time.time() * 1000))

    def headers(self) -> list[Any]:
        return []


class Versions:
    newest = 0

    def exists(self, version: int, produced_ms: int | None = None) -> bool:
        return version == 0


def records(n: int, tokens: int, chunk: int, reward_ms: float) -> list[Record]:
    rng = np.random.default_rng(0)
    out: list[Record] = []
    meta = orjson.dumps({"ms": reward_ms}).decode()
    for t in range(n):
        tid = uuid.uuid4().hex
        ids = rng.integers(4, 260, tokens)
        for seq, a in enumerate(range(0, tokens, chunk)):
            last = a + chunk >= tokens
            c = TrajectoryChunk(
                trajectory_id=tid,
                prompt_id=f"p{t // 8}",
                task_id=f"task{t // 8}",
                sample_index=t % 8,
                group_size=8,
                seq=seq,
                token_offset=a,
                tokens=pack_tokens(ids[a : a + chunk].tolist()),
                logprobs=pack_logprobs(np.full(min(chunk, tokens - a), -1.0, np.float32)),
                policy_version=0,
                is_last=last,
                worker_id="w0",
                bucket="le256",
                started_ms=1,
                finish_reason="stop" if last else None,
                prompt_tokens=pack_tokens(ids[:32].tolist()) if seq == 0 else None,
                metadata=meta if seq == 0 else None,
            )
            out.append(Record(encode(c), tid.encode(), len(out)))
    return out


def run(
    trajectories: int, tokens: int, chunk: int, reward_ms: float, workers: int
) -> dict[str, Any]:
    recs = records(trajectories, tokens, chunk, reward_ms)
    metrics = Metrics(None, Layout(prefix="bench"), "bench", "bench")
    outcomes, limit = Outcomes(Ledger(), 600), (1 << 30, "bench")
    intake = Intake(outcomes, limit, 600, None, metrics, Versions())  # type: ignore[arg-type]
    t0 = time.perf_counter()
    trajs = [t for r in recs if isinstance(t := intake.add(r), Trajectory)]
    intake_s = time.perf_counter() - t0
    assert len(trajs) == trajectories, f"{len(trajs)} of {trajectories} assembled"
    spec = "app.bench.intake:busy_reward"
    scorer = Scorer(load_reward(spec), build_tokenizer())
    modes = {}
    for w in sorted({0, workers}):
        pool = RewardPool(spec, scorer, w, 60.0)
        try:
            pool.score(trajs[0])  # the processes start before the clock does
            while not pool.ready():
                time.sleep(0.001)
            t0 = time.perf_counter()
            for t in trajs:
                pool.score(t)
            loop_s = time.perf_counter() - t0
            done = 0
            while done < len(trajs):
                done += len(pool.ready())
                time.sleep(0.0005)
            all_s = time.perf_counter() - t0
        finally:
            pool.close()
        modes[f"workers_{w}"] = {
            "loop_ms_per_trajectory": 1000 * (intake_s + loop_s) / trajectories,
            "rewards_per_s": trajectories / all_s,
        }
    n_records = len(recs)
    return {
        "settings": {
            "trajectories": trajectories,
            "completion_tokens": tokens,
            "chunk_tokens": chunk,
            "reward_ms": reward_ms,
            "records": n_records,
        },
        "intake": {
            "records_per_s": n_records / intake_s,
            "tokens_per_s": trajectories * tokens / intake_s,
            "us_per_record": 1e6 * intake_s / n_records,
        },
        "rewards": modes,
    }
