"""Assembler: dedupe, stitching of resumed trajectories, validation, expiry."""

from __future__ import annotations

import dataclasses
import random

import pytest

from consumers.assembler import Assembler, BadChunk, BadTrajectory
from schemas.records import MIGRATED, pack_logprobs
from tests.chunks import traj_chunks


def feed(asm: Assembler, chunks: list) -> list:
    return [t for c in chunks if (t := asm.add(c, now=0.0)) is not None]


def test_in_order_chunks_make_one_trajectory() -> None:
    chunks = traj_chunks(
        "p",
        1,
        4,
        [9, 8],
        list(range(10, 20)),
        chunk_tokens=4,
        versions=[3, 2, 4],
        logprobs=[-0.1 * i for i in range(10)],
        metadata={"answer": "x"},
    )
    asm = Assembler(set())
    assert [asm.add(c) for c in chunks[:-1]] == [None, None]
    t = asm.add(chunks[-1])
    assert t is not None and t.tokens.tolist() == list(range(10, 20))
    assert t.prompt_tokens.tolist() == [9, 8] and t.metadata == {"answer": "x"}
    assert t.logprobs.tolist() == pytest.approx([-0.1 * i for i in range(10)])
    assert t.behaviour_version == 2 and t.versions == (3, 2, 4)  # b = min over chunks
    assert (t.sample_index, t.group_size, t.finish_reason, t.length) == (1, 4, "stop", 12)


def test_duplicates_and_any_order_are_handled() -> None:
    chunks = traj_chunks("p", 0, 1, [1], list(range(30)), chunk_tokens=4)
    shuffled = chunks + chunks[2:5]  # retries
    random.Random(0).shuffle(shuffled)
    asm = Assembler(set())
    done = feed(asm, shuffled)
    assert len(done) == 1 and done[0].tokens.tolist() == list(range(30))
    assert asm.duplicates == 3
    # every chunk of an assembled trajectory is a duplicate from now on (replays)
    assert feed(asm, chunks) == [] and asm.duplicates == 3 + len(chunks)


def test_finalized_ledger_drops_replayed_trajectories() -> None:
    chunks = traj_chunks("p", 0, 1, [1], [5, 6, 7])
    asm = Assembler({chunks[0].trajectory_id})
    assert feed(asm, chunks) == [] and asm.duplicates == len(chunks)


def test_resumed_trajectory_stitches_across_workers_and_buckets() -> None:
    # worker A publishes seq 0..1 at v1 and dies; worker B resumes from seq 2 at v2 in another
    # bucket (the long-tail pool), re-publishing seq 1 on the way
    full = traj_chunks("p", 0, 2, [1, 2], list(range(12)), chunk_tokens=4, versions=[1, 1, 2])
    prefix = full[:2]
    resumed = [dataclasses.replace(c, worker_id="B", bucket="le1024") for c in full[1:]]
    asm = Assembler(set())
    assert feed(asm, prefix) == []
    done = feed(asm, resumed)
    assert len(done) == 1 and asm.duplicates == 1
    t = done[0]
    assert t.tokens.tolist() == list(range(12)) and t.workers == ("w0", "B")
    assert t.behaviour_version == 1


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"seq": -1}, "negative seq"),
        ({"sample_index": 4}, "outside group"),
        ({"logprobs": b"\x00\x00"}, "log-prob bytes"),
        ({"logprobs": pack_logprobs([0.5, -1, -1, -1])}, "<= 0"),
        ({"prompt_tokens": None}, "prompt_tokens"),
        ({"metadata": "{not json"}, "not JSON"),
        ({"metadata": "[1]"}, "not an object"),
        ({"finish_reason": "stop"}, "not the last"),
        ({"tokens": b"", "logprobs": b""}, "empty chunk"),
    ],
)
def test_malformed_chunks_are_refused(change: dict, match: str) -> None:
    c = traj_chunks("p", 0, 4, [1], [1, 2, 3, 4, 5], metadata={})[0]
    with pytest.raises(BadChunk, match=match):
        Assembler(set()).add(dataclasses.replace(c, **change))


def test_a_migrated_trajectory_stitches_through_its_hand_off_chunk() -> None:
    chunks = traj_chunks("p", 0, 1, [1], list(range(6)), chunk_tokens=2)  # seq 0, 1, 2 (last)
    marker = dataclasses.replace(chunks[1], tokens=b"", logprobs=b"", finish_reason=MIGRATED)
    rest = [
        dataclasses.replace(chunks[1], seq=2, worker_id="B"),
        dataclasses.replace(chunks[2], seq=3, worker_id="B"),
    ]
    done = feed(Assembler(set()), [rest[1], chunks[0], marker, rest[0]])
    assert len(done) == 1 and done[0].tokens.tolist() == list(range(6))
    assert done[0].finish_reason == chunks[2].finish_reason


def test_inconsistent_offsets_fail_the_trajectory() -> None:
    chunks = traj_chunks("p", 0, 1, [1], list(range(8)), chunk_tokens=4)
    chunks[1] = dataclasses.replace(chunks[1], token_offset=5)
    asm = Assembler(set())
    asm.add(chunks[0])
    with pytest.raises(BadTrajectory, match="token_offset 5 != 4"):
        asm.add(chunks[1])
    assert asm.add(chunks[0]) is None and asm.duplicates == 1  # it is not retried


def test_idle_incomplete_trajectories_expire() -> None:
    a = traj_chunks("p", 0, 2, [1], list(range(8)), chunk_tokens=4)
    b = traj_chunks("p", 1, 2, [1], list(range(8)), chunk_tokens=4)
    asm = Assembler(set(), expire_s=10)
    asm.add(a[0], now=0.0)
    asm.add(b[0], now=5.0)
    assert asm.expire(now=9.0) == []
    dead = asm.expire(now=12.0)
    assert [p.trajectory_id for p in dead] == [a[0].trajectory_id]
    assert asm.add(a[1], now=13.0) is None and asm.duplicates == 1  # late chunk after expiry
    assert asm.add(b[1], now=13.0) is not None


def test_in_flight_names_the_prompts_and_steps_still_streaming() -> None:
    a = traj_chunks("p", 0, 2, [1], list(range(8)), chunk_tokens=4, step=3, step_groups=1)
    b = traj_chunks("q", 0, 1, [1], list(range(8)), chunk_tokens=4)
    asm = Assembler(set(), expire_s=10)
    asm.add(a[0], now=0.0)
    asm.add(b[0], now=0.0)
    assert asm.in_flight() == ({"p", "q"}, {3, None})
    asm.add(a[1], now=1.0)  # p's sample 0 is complete: no longer in flight
    assert asm.in_flight() == ({"q"}, {None})


def test_a_fenced_writers_chunks_never_mix_into_the_trajectory() -> None:
    # worker A (epoch 1) publishes seq 0..1 and is SIGSTOPped with seq 2..3 queued; B (epoch 2)
    # resumes from seq 2; A's queued chunks land between B's: they are the zombie's, dropped
    done = traj_chunks("p", 0, 1, [1], list(range(16)), chunk_tokens=4, worker_id="a")
    tid = done[0].trajectory_id
    a = [dataclasses.replace(c, pool="g", pool_epoch=1) for c in done]
    resumed = traj_chunks("p", 0, 1, [1], list(range(100, 116)), chunk_tokens=4, trajectory_id=tid)
    b = [dataclasses.replace(c, pool="g", pool_epoch=2, worker_id="b") for c in resumed[2:]]
    asm = Assembler(set())
    (t,) = feed(asm, [a[0], a[1], b[0], a[2], a[3], b[1]])
    assert t.workers == ("a", "b") and t.tokens.tolist() == [*range(8), *range(108, 116)]
    assert asm.fenced == 2 and asm.duplicates == 0
    zombie_first = Assembler(set())  # the zombie's land before B's first chunk: removed by it
    (t2,) = feed(zombie_first, [a[0], a[1], a[2], b[0], a[3], b[1]])
    assert t2.tokens.tolist() == t.tokens.tolist() and zombie_first.fenced == 2
