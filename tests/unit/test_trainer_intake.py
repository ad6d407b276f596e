"""The trainer's intake (``consumers.intake``): records → trajectories, with a hand-written
fake producer and records: what is dead-lettered, what is invalid, which offsets are held."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import orjson
import pytest

from consumers.assembler import Trajectory
from consumers.config import TrainConfig
from consumers.intake import Intake, Invalid
from consumers.outcomes import REMEMBER_STEPS, Ledger, Outcomes
from consumers.trainer import train_limit
from schemas.records import ABORTED, TrajectoryChunk, encode
from srl.metrics import Metrics
from srl.topics import Layout
from tests.chunks import traj_chunks

TOPIC = "srl.trajectories"


class FakeProducer:
    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes, Any, dict[str, bytes]]] = []

    def produce(self, topic: str, value: bytes, key: Any = None, headers: Any = None) -> None:
        self.sent.append((topic, value, key, dict(headers or [])))


@dataclass
class Record:
    """A consumed record, as much of ``srl.kafka.Message`` as the intake reads."""

    raw: bytes
    offset_: int
    partition_: int = 0
    key_: bytes = b"k"
    error_: str | None = None

    def value(self) -> bytes:
        return self.raw

    def key(self) -> bytes:
        return self.key_

    def topic(self) -> str:
        return TOPIC

    def partition(self) -> int:
        return self.partition_

    def offset(self) -> int:
        return self.offset_

    def error(self) -> str | None:
        return self.error_

    def timestamp(self) -> tuple[int, int]:
        return 1, 0  # create time, ms


class Versions:
    """Policy versions up to ``newest`` exist."""

    def __init__(self, newest: int = 0) -> None:
        self.newest = newest

    def exists(self, version: int, produced_ms: int | None = None) -> bool:
        return 0 <= version <= self.newest


def intake(
    ledger: dict[str, list[Any]] | None = None, max_len: int = 100, why: str = "the model's"
) -> tuple[Intake, FakeProducer]:
    producer = FakeProducer()
    metrics = Metrics(None, Layout(), "run", "trainer-0")
    outcomes = Outcomes(Ledger(ledger), 30.0)
    return Intake(outcomes, (max_len, why), 30.0, producer, metrics, Versions(3)), producer


def records(chunks: list[TrajectoryChunk], first: int = 0) -> list[Record]:
    return [Record(encode(c), first + i) for i, c in enumerate(chunks)]


def chunks(tid: str = "t", n_tokens: int = 4) -> list[TrajectoryChunk]:
    return traj_chunks("p", 0, 2, [1, 2], list(range(n_tokens)), chunk_tokens=2, trajectory_id=tid)


def test_a_trajectory_completes_and_its_records_stay_held_until_durable() -> None:
    it, dlq = intake()
    got = [it.add(r) for r in records(chunks())]
    assert got[0] is None and isinstance(got[1], Trajectory)
    assert got[1].trajectory_id == "t" and got[1].n_tokens == 4
    assert it.tracker.committable() == {(TOPIC, 0): 0}  # held by "t" from offset 0
    it.outcomes.invalid("t", "p", "le256", 1, "x")  # any outcome: decided, not durable yet
    it.outcomes.checkpointed()
    it.tracker.release({"t"})
    assert it.tracker.committable() == {(TOPIC, 0): 2}


def test_records_of_a_durable_trajectory_are_duplicates_that_hold_nothing() -> None:
    it, dlq = intake(ledger={"t": ["trained", 1]})
    assert [it.add(r) for r in records(chunks())] == [None, None]
    assert it.assembler.duplicates == 2
    assert it.tracker.committable() == {(TOPIC, 0): 2}
    assert dlq.sent == []


@pytest.mark.parametrize(
    ("raw", "reason_starts", "committable"),
    [
        (b"\x00garbage", "undecodable: ", 8),
        # a chunk malformed on its own holds nothing: no outcome of its trajectory may come
        (encode(replace(chunks()[1], seq=-1)), "bad chunk t/-1: ", 8),
    ],
    ids=["undecodable", "bad-chunk"],
)
def test_unusable_records_are_dead_lettered(
    raw: bytes, reason_starts: str, committable: int
) -> None:
    it, dlq = intake()
    assert it.add(Record(raw, 7, partition_=1)) is None
    [(topic, value, key, headers)] = dlq.sent
    assert (topic, value, key) == (Layout().dlq, raw, b"k")
    assert headers["srl.reason"].decode().startswith(reason_starts)
    assert headers["srl.origin"] == f"{TOPIC}/1@7".encode()
    assert it.metrics.counters["dead_letters"] == 1
    assert it.tracker.committable() == {(TOPIC, 1): committable}


def test_a_bad_chunk_does_not_hold_its_partition_back_for_good() -> None:
    """A chunk that fails validation first, then a whole trajectory that becomes durable: the
    committable offset passes both (the bad chunk's trajectory never gets an outcome)."""
    it, dlq = intake()
    bad = replace(chunks("lost")[0], sample_index=5)  # outside its group of 2
    assert it.add(Record(encode(bad), 0)) is None and len(dlq.sent) == 1
    got = [it.add(r) for r in records(chunks("t"), first=1)]
    assert isinstance(got[-1], Trajectory)
    it.outcomes.invalid("t", "p", "le256", 1, "decided")
    it.tracker.release(set(it.outcomes.undurable))
    it.outcomes.checkpointed()
    assert it.tracker.committable() == {(TOPIC, 0): 3}


def test_a_trajectory_longer_than_the_model_is_invalid_and_dead_lettered() -> None:
    it, dlq = intake(max_len=5)  # 2 prompt + 4 completion tokens
    got = [it.add(r) for r in records(chunks())]
    assert got[0] is None and isinstance(got[1], Invalid)
    assert got[1].chunk.seq == 1
    assert got[1].reason == "trajectory t: 6 tokens > the model's 5"
    assert [h["srl.reason"] for *_, h in dlq.sent] == [got[1].reason.encode()]


def test_max_train_tokens_caps_what_trains_below_the_model(tmp_path: Path) -> None:
    """A row that would run the trainer out of memory goes to the DLQ with the reason; a
    restart reads it again and dead-letters it again, instead of crash-looping on it."""
    cfg = TrainConfig(model=str(tmp_path), max_train_tokens=5)
    limit = train_limit(cfg, Limit(100))  # type: ignore[arg-type]
    assert limit == (5, "--max-train-tokens")
    for cap in (0, 500):  # none, or above the model's: the model's
        other = cfg.model_copy(update={"max_train_tokens": cap})
        assert train_limit(other, Limit(100)) == (100, "the model's")  # type: ignore[arg-type]
    it, dlq = intake(max_len=limit[0], why=limit[1])
    got = [it.add(r) for r in records(chunks())]
    assert isinstance(got[1], Invalid)
    assert got[1].reason == "trajectory t: 6 tokens > --max-train-tokens 5" and len(dlq.sent) == 1


class Limit:
    def __init__(self, n: int) -> None:
        self.max_length = n


def test_inconsistent_chunks_make_an_invalid_trajectory() -> None:
    first, last = chunks()
    it, _ = intake()
    got = [it.add(r) for r in records([first, replace(last, token_offset=3)])]
    assert got[0] is None and isinstance(got[1], Invalid)
    assert got[1].reason == "trajectory t: seq 1 token_offset 3 != 2"


def test_a_consumer_error_is_skipped() -> None:
    it, dlq = intake()
    assert it.add(Record(b"", 0, error_="broker down")) is None
    assert it.tracker.committable() == {} and dlq.sent == []


def checkpoint_and_commit(it: Intake, step: int) -> None:
    """What the trainer does at a checkpoint of step ``step``: release, commit what may be,
    prune."""
    it.tracker.release(it.outcomes.undurable)
    it.tracker.mark_committed(it.tracker.committable())
    it.checkpointed(it.outcomes.undurable, step)
    it.outcomes.checkpointed()


def test_a_long_run_keeps_a_bounded_ledger_and_still_drops_what_a_restart_re_reads() -> None:
    """Issue 18: the ledger keeps only trajectories whose records a restart can deliver again
    (at or after the committed offsets), so what a checkpoint saves stays flat; a restart from
    that ledger and the committed offsets trains nothing twice."""
    it, _ = intake()
    log: list[Record] = []
    sizes = []
    for i in range(600):
        recs = records(chunks(f"t{i}"), first=len(log))
        if i % 10 == 0 and i:  # the straggler of the last interval ends
            recs.append(Record(encode(chunks(f"s{i - 1}")[1]), len(log) + 2))
        log += recs
        [it.add(r) for r in recs]
        it.outcomes.invalid(f"t{i}", "p", "le256", i, "decided")  # any outcome
        if i % 10 == 0 and i:
            it.outcomes.invalid(f"s{i - 1}", "p", "le256", i, "decided")
        if i % 10 == 9:
            # one trajectory stays open across the checkpoint: its first record is held
            straggler = records([chunks(f"s{i}")[0]], first=len(log))
            log += straggler
            it.add(straggler[0])
            checkpoint_and_commit(it, i)
            sizes.append(len(orjson.dumps(it.outcomes.ledger.entries)))
    assert max(sizes[5:]) <= 2 * min(sizes[5:]), f"ledger grows: {sizes[:3]} … {sizes[-3:]}"
    assert len(it.outcomes.ledger) < 40 and len(it.assembler.assembled) < 40
    assert it.outcomes.ledger.counts() == {"invalid": 659}  # the run's totals stay whole

    # a restart: the saved ledger, and every record from the committed offset on
    saved, extra = dict(it.outcomes.ledger.entries), it.outcomes.ledger.saved_extra()
    [committed] = it.tracker.committed.values()
    again, _ = intake()
    again.outcomes.ledger = again.assembler.finalized = Ledger.restore(saved, extra)
    replayed = [again.add(r) for r in log[committed:]]
    assert not [t for t in replayed if isinstance(t, Trajectory)], "a trajectory trained twice"
    assert extra["ledger_floor"] == {"0": committed}


def test_a_copy_published_anew_after_the_commit_is_a_duplicate_for_remember_steps() -> None:
    """A broker that forgot records it had acknowledged (the embedded broker after a SIGKILL)
    can make a task go out or be read again after the trainer trained it and committed past
    its records: the copy has the same trajectory ids (deterministic task ids) at new offsets.
    Pruned by offset alone, the ledger no longer knew the id and the copy trained again
    (``srl chaos`` broker-restart); it is remembered for ``REMEMBER_STEPS`` steps, then goes."""
    it, _ = intake()
    first = records(chunks("t"))
    assert isinstance([it.add(r) for r in first][-1], Trajectory)
    it.outcomes.invalid("t", "p", "le256", 5, "trained")  # any outcome, at step 5
    checkpoint_and_commit(it, 5)
    assert it.tracker.committed == {(TOPIC, 0): 2}  # the commit passed every record of "t"
    copy = records(chunks("t"), first=2)  # the same trajectory, published anew
    assert [it.add(r) for r in copy] == [None, None], "a trajectory trained twice"
    checkpoint_and_commit(it, 5 + REMEMBER_STEPS - 1)
    assert "t" in it.outcomes.ledger
    checkpoint_and_commit(it, 5 + REMEMBER_STEPS)  # bounded: older decisions go
    assert "t" not in it.outcomes.ledger and len(it.outcomes.ledger) == 0


@pytest.mark.parametrize("n_tokens", [3, 0], ids=["partial", "empty"])
def test_an_aborted_trajectory_is_invalid_not_trained_and_not_a_dead_letter(
    n_tokens: int,
) -> None:
    """A served choice whose client went away (or a shutdown) is published with
    finish_reason ``abort``, partial or with no token at all: it is decided invalid (its
    group slot filled by the trainer), never trained or scored, and not dead-lettered."""
    done = replace(chunks()[-1], finish_reason=ABORTED) if n_tokens else None
    if n_tokens:
        cs = [*chunks()[:-1], done]
    else:
        cs = [replace(chunks(n_tokens=2)[0], tokens=b"", logprobs=b"", finish_reason=ABORTED)]
    it, dlq = intake()
    got = [it.add(r) for r in records(cs)]  # type: ignore[arg-type]
    assert isinstance(got[-1], Invalid) and "aborted" in got[-1].reason
    assert not [g for g in got if isinstance(g, Trajectory)]
    assert dlq.sent == []
