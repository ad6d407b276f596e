"""Pairs from the trajectories topic: joining a trajectory's ends exactly once."""

from __future__ import annotations

import numpy as np

from ranker.online import PairCollector, TrainWindow, commit_offsets, live_report
from schemas.records import TrajectoryChunk, pack_logprobs, pack_tokens


def chunk(tid: str, seq: int, offset: int, n: int, last: bool, **kw: object) -> TrajectoryChunk:
    return TrajectoryChunk(
        trajectory_id=tid,
        prompt_id="p",
        task_id="t",
        sample_index=0,
        group_size=1,
        seq=seq,
        token_offset=offset,
        tokens=pack_tokens(range(n)),
        logprobs=pack_logprobs([0.0] * n),
        policy_version=0,
        is_last=last,
        worker_id="w",
        bucket="le256",
        started_ms=0,
        finish_reason="stop" if last else None,
        **kw,  # type: ignore[arg-type]
    )


def test_pair_from_first_and_last_chunk() -> None:
    c = PairCollector()
    assert (
        c.add(chunk("a", 0, 0, 8, False, prompt_tokens=pack_tokens([1, 2]), predicted_length=30))
        is None
    )
    assert c.add(chunk("a", 1, 8, 8, False)) is None
    pair = c.add(chunk("a", 2, 16, 5, True))
    assert pair is not None and pair.length == 21 and pair.predicted_length == 30
    assert pair.prompt_tokens == pack_tokens([1, 2])
    # a redelivered final chunk makes no second pair
    assert c.add(chunk("a", 2, 16, 5, True)) is None and c.duplicates == 1


def test_pair_when_the_tail_arrives_first_and_single_chunk() -> None:
    c = PairCollector()
    assert c.add(chunk("m", 3, 40, 2, True)) is None  # migrated: tail on another partition
    pair = c.add(chunk("m", 0, 0, 10, False, prompt_tokens=pack_tokens([7])))
    assert pair is not None and pair.length == 42
    one = c.add(chunk("s", 0, 0, 4, True, prompt_tokens=pack_tokens([7])))
    assert one is not None and one.length == 4


def test_aborted_trajectories_and_bounds() -> None:
    c = PairCollector(max_open=2)
    c.add(chunk("x", 0, 0, 3, False, prompt_tokens=pack_tokens([1])))
    aborted = chunk("x", 1, 3, 0, True)
    aborted = TrajectoryChunk.from_dict({**aborted.to_dict(), "finish_reason": "abort"})
    assert c.add(aborted) is None
    for t in ("p", "q", "r"):
        c.add(chunk(t, 0, 0, 3, False, prompt_tokens=pack_tokens([1])))
    assert c.evicted == 1


def test_a_commit_never_passes_the_first_chunk_of_a_half_seen_trajectory() -> None:
    c, T = PairCollector(), "trajectories"
    c.add(chunk("a", 0, 0, 8, False, prompt_tokens=pack_tokens([1])), (T, 0, 5))
    c.add(chunk("b", 0, 0, 8, False, prompt_tokens=pack_tokens([1])), (T, 0, 9))
    c.add(chunk("m", 2, 32, 4, True), (T, 1, 3))  # a migrated tail, read before its head
    assert c.add(chunk("c", 0, 0, 4, True, prompt_tokens=pack_tokens([1])), (T, 2, 7))
    assert c.holds() == {(T, 0): 5, (T, 1): 3}
    pending = {(T, 0): 12, (T, 1): 8, (T, 2): 8}
    got = {(tp.topic, tp.partition): tp.offset for tp in commit_offsets(pending, c.holds())}
    assert got == {(T, 0): 5, (T, 1): 3, (T, 2): 8}
    # once "a" is paired the hold moves to "b"; aborted and paired trajectories hold nothing
    assert c.add(chunk("a", 1, 8, 2, True), (T, 0, 12)) is not None
    aborted = TrajectoryChunk.from_dict(
        {**chunk("b", 1, 8, 0, True).to_dict(), "finish_reason": "abort"}
    )
    assert c.add(aborted, (T, 0, 13)) is None
    assert c.holds() == {(T, 1): 3}


def test_window_slides_and_reports_dispatch_time_quality() -> None:
    w = TrainWindow(window=50, retrain_every=10, min_pairs=20)
    for i in range(60):
        w.add(f"p{i}", i + 1, i + 1 if i % 2 else None)
        if i == 18:
            assert not w.due()
    assert w.due() and len(w.pairs) == 50
    texts, lengths = w.arrays()
    assert texts[0] == "p10" and lengths[-1] == 60
    report = live_report(w)
    assert report is not None and report["n"] == 25 and report["spearman"] == 1.0
    assert np.isnan(w.predicted).sum() == 25
