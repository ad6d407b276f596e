"""Pure parts of the producer side: sampling, chunker, offset tracking, sim engine."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
import torch

from producers.ackguard import AckGuard
from producers.chunker import Chunker, TrajectoryStart
from producers.engines.base import Request, complete
from producers.engines.sampling import sample
from producers.engines.sim import SimEngine
from producers.planning import recovered, task_state
from producers.recovery import Found, trajectory_id_for
from producers.tasks import OffsetTracker, SamplePlan, TaskState
from schemas.records import MIGRATED, PromptTask, pack_tokens
from srl.data import STREAMRL_LENGTHS
from srl.errors import SrlError
from srl.workload import PTL, LengthHistogram

HIST = STREAMRL_LENGTHS


# -- sampling ---------------------------------------------------------------------------------
def test_greedy_rows_take_the_argmax_of_a_point_mass() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 0.0]])
    tokens, lps = sample(logits, torch.tensor([0.0, 0.0]), torch.tensor([1.0, 1.0]))
    assert tokens.tolist() == [1, 0]
    assert lps.tolist() == [0.0, 0.0]  # the distribution sampled from: all mass on the argmax


def test_top_p_keeps_only_the_nucleus_and_logprobs_are_of_the_renormalised_nucleus() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(400, 1)
    g = torch.Generator().manual_seed(0)
    tokens, lps = sample(logits, torch.full((400,), 1.0), torch.full((400,), 0.7), g)
    assert set(tokens.tolist()) == {0, 1}  # 0.5 + 0.3 reaches 0.7; the tail is never drawn
    assert lps.tolist() == pytest.approx(
        [math.log([0.5, 0.3][t] / 0.8) for t in tokens.tolist()], abs=1e-6
    )
    tiny, _ = sample(logits[:50], torch.full((50,), 1.0), torch.full((50,), 1e-6), g)
    assert set(tiny.tolist()) == {0}


def test_temperature_scales_the_logprob() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    tokens, lps = sample(
        logits, torch.tensor([2.0]), torch.tensor([1.0]), torch.Generator().manual_seed(1)
    )
    assert lps.item() == pytest.approx(torch.log_softmax(logits / 2.0, -1)[0, tokens.item()].item())


# -- chunker ----------------------------------------------------------------------------------
def start(**kw) -> TrajectoryStart:  # type: ignore[no-untyped-def]
    base = dict(
        trajectory_id="t",
        prompt_id="p",
        task_id="k",
        sample_index=1,
        group_size=4,
        bucket="le256",
        predicted_length=9,
        prompt_tokens=pack_tokens([7, 8]),
        metadata='{"a": 1}',
    )
    return TrajectoryStart(**{**base, **kw})  # type: ignore[arg-type]


def test_chunks_are_numbered_without_gaps_and_carry_seq0_fields_once() -> None:
    c = Chunker(3, "w")
    c.open(start())
    out = []
    for i in range(7):
        out += c.add("t", [10 + i], [-0.1 * i], 0, "stop" if i == 6 else None)
    assert [ch.seq for ch in out] == [0, 1, 2]
    assert [ch.token_offset for ch in out] == [0, 3, 6]
    assert [ch.token_ids().tolist() for ch in out] == [[10, 11, 12], [13, 14, 15], [16]]
    assert out[1].logprob_values().tolist() == pytest.approx([-0.3, -0.4, -0.5])
    assert [ch.is_last for ch in out] == [False, False, True] and out[-1].finish_reason == "stop"
    assert out[0].prompt_tokens == pack_tokens([7, 8]) and out[0].metadata == '{"a": 1}'
    assert all(ch.prompt_tokens is None and ch.metadata is None for ch in out[1:])
    assert all(ch.finish_reason is None for ch in out[:-1]) and "t" not in c


def test_a_full_final_chunk_is_the_last_one_and_multi_token_outputs_split() -> None:
    c = Chunker(4, "w")
    c.open(start())
    out = c.add("t", list(range(8)), [0.0] * 8, 0, "length")
    assert [(ch.seq, ch.n_tokens, ch.is_last) for ch in out] == [(0, 4, False), (1, 4, True)]


def test_a_version_change_closes_the_open_chunk() -> None:
    c = Chunker(4, "w")
    c.open(start())
    out = (
        c.add("t", [1, 2], [0.0, 0.0], 0)
        + c.add("t", [3], [0.0], 1)
        + c.add("t", [4], [0.0], 1, "stop")
    )
    assert [(ch.policy_version, ch.token_ids().tolist()) for ch in out] == [
        (0, [1, 2]),
        (1, [3, 4]),
    ]
    c.open(start(trajectory_id="u"))
    c.add("u", [5], [0.0], 1)
    flushed = c.flush_all()
    assert [(ch.trajectory_id, ch.is_last, ch.n_tokens) for ch in flushed] == [("u", False, 1)]
    assert c.flush_all() == []


def test_a_resumed_trajectory_continues_its_numbering_and_omits_seq0_fields() -> None:
    c = Chunker(2, "w2")
    c.open(start(next_seq=3, token_offset=6))
    out = c.add("t", [1, 2, 3], [0.0] * 3, 2, "stop")
    assert [(ch.seq, ch.token_offset) for ch in out] == [(3, 6), (4, 8)]
    assert out[0].prompt_tokens is None and out[0].metadata is None and out[0].worker_id == "w2"


def test_an_abort_without_tokens_is_an_empty_last_chunk() -> None:
    c = Chunker(2, "w")
    c.open(start())
    out = c.add("t", [1, 2], [0.0, 0.0], 0) + c.add("t", [], [], 0, "abort")
    assert [(ch.n_tokens, ch.is_last, ch.finish_reason) for ch in out] == [
        (2, False, None),
        (0, True, "abort"),
    ]


def test_a_hand_off_closes_the_trajectory_with_a_non_last_migrated_chunk() -> None:
    c = Chunker(2, "w")
    c.open(start())
    out = c.add("t", [1, 2, 3], [0.0] * 3, 4) + [c.hand_off("t", 5)]
    assert [(ch.seq, ch.n_tokens, ch.is_last, ch.finish_reason) for ch in out] == [
        (0, 2, False, None),
        (1, 1, False, MIGRATED),
    ]
    assert out[1].policy_version == 4 and "t" not in c
    c.open(start(trajectory_id="u"))
    c.add("u", [1, 2], [0.0, 0.0], 0)  # the open chunk is empty when it moves: still a marker
    empty = c.hand_off("u", 3)
    assert (empty.seq, empty.n_tokens, empty.is_last, empty.finish_reason) == (
        1,
        0,
        False,
        MIGRATED,
    )


# -- offsets ----------------------------------------------------------------------------------
def test_commit_position_never_passes_an_unfinished_task() -> None:
    t = OffsetTracker()
    tp = ("topic", 0)
    for off in (5, 6, 7):
        t.add(tp, off)
    assert t.finish(tp, 6) and not t.finish(tp, 6)
    assert t.committable() == {}
    t.finish(tp, 5)
    assert t.committable() == {tp: 7}
    t.finish(tp, 7)
    assert t.committable() == {tp: 8} and t.in_flight() == 0
    with pytest.raises(ValueError):
        t.add(tp, 7)
    t.add(tp, 9)
    t.forget([tp])
    assert not t.finish(tp, 9) and t.committable() == {}


def test_a_finished_task_is_committed_only_once_the_broker_surely_kept_its_chunks() -> None:
    t = OffsetTracker()
    tp = ("topic", 0)
    for off in (0, 1, 2):
        t.add(tp, off)
    t.finish(tp, 0, at=10.0)
    t.finish(tp, 1, at=11.5)
    t.finish(tp, 2, at=13.0)
    assert t.committable(before=9.0) == {}
    assert t.committable(before=12.0) == {tp: 2}  # offset 2 finished after the cutoff
    assert t.committable() == {tp: 3}


def fake_state() -> TaskState:
    task = PromptTask("k", "p", "prompt", 1, 8, "le16")
    return task_state(task, ("topic", 0), 0, [5, 6], None)


def test_tasks_finished_just_before_an_outage_wait_for_their_read_back() -> None:
    g = AckGuard(unsure_s=2.0)
    a, b, c = (dataclasses.replace(fake_state(), offset=i) for i in range(3))
    g.finished(a, now=100.0)
    g.finished(b, now=104.0)
    assert g.cutoff(now=104.5) == 102.5  # normally: finished UNSURE_S ago
    assert g.cutoff(now=104.5, final=True) == math.inf
    assert not g.watch(outages=0, now=104.6)
    assert g.watch(outages=1, now=104.6)  # every broker went away: b (not a) is a suspect
    assert [s for _, s in g.suspects] == [b] and g.cutoff(now=200.0, final=True) < 104.0
    g.finished(c, now=105.0)
    assert not g.watch(outages=1, now=105.0)  # read back at most every unsure_s
    assert g.verify(lambda states: ["t-b"]) == ["t-b"] and g.suspects  # lost: stays held

    def broker_away(states: list[Any]) -> list[str]:
        raise SrlError("reading back timed out")

    assert g.verify(broker_away) == [] and g.suspects  # not read: tried again later
    assert g.watch(outages=1, now=107.0)
    assert g.verify(lambda states: []) == [] and not g.suspects  # all kept
    assert g.cutoff(now=110.0) == 108.0
    g.outage(now=200.0)
    assert not g.suspects  # nothing finished in the 2 s before it
    g.finished(c, now=201.0)
    g.outage(now=201.5)
    g.forget({c.tp})
    assert not g.suspects


# -- recovery state ---------------------------------------------------------------------------
def test_trajectory_ids_are_stable_per_task_and_sample() -> None:
    assert trajectory_id_for("k", 0) == trajectory_id_for("k", 0) != trajectory_id_for("k", 1)
    assert len(trajectory_id_for("k", 0)) == 32


def test_found_prefix_states() -> None:
    c = Chunker(1, "w")
    c.open(start())
    chunks = (
        c.add("t", [1], [0.0], 0) + c.add("t", [2], [0.0], 0) + c.add("t", [3], [0.0], 0, "stop")
    )
    assert Found().state(0) == "none"
    assert Found({0: chunks[0], 1: chunks[1]}).state(0) == "prefix"
    assert Found({i: ch for i, ch in enumerate(chunks)}).state(0) == "complete"
    assert Found({0: chunks[0], 2: chunks[2]}).state(0) == "gap"
    assert Found({2: chunks[2]}).state(2) == "complete"
    c.open(start(trajectory_id="m"))
    moved = c.add("m", [1], [0.0], 0) + [c.hand_off("m", 0)]
    assert Found(dict(enumerate(moved))).state(0) == "migrated"  # not ours to continue
    later = dataclasses.replace(chunks[2], trajectory_id="m", seq=2, token_offset=1)
    assert Found({**dict(enumerate(moved)), 2: later}).state(0) == "complete"


def test_a_gap_left_by_a_dropped_writer_is_resumed_by_a_newer_epoch() -> None:
    # a writer of epoch 3 cut off past its delivery timeout: seq 1 failed, 2 arrived later
    c = Chunker(1, "w")
    c.open(start())
    a, b, d = c.add("t", [1], [0.0], 0) + c.add("t", [2], [0.0], 0) + c.add("t", [3], [0.0], 0)
    left = {s: dataclasses.replace(x, pool="g", pool_epoch=3) for s, x in ((0, a), (2, d))}
    assert Found(dict(left)).state(0) == "gap"  # outside pool epochs: nobody fences seq 2
    assert Found(dict(left)).state(0, ("g", 4)) == "prefix"  # seq 1 of epoch 4 fences it
    assert Found(dict(left)).state(0, ("g", 3)) == "gap"  # the same epoch fences nothing
    assert Found(dict(left)).state(0, ("other", 9)) == "gap"  # another pool's never does
    assert Found({2: left[2]}).state(0, ("g", 4)) == "none"  # seq 0 lost too: start over
    plan = [SamplePlan("t", 0)]
    r = recovered(plan, {"t": Found(dict(left))}, ("g", 4))
    assert r.gap is None and r.resumed == 1 and r.todo[0].next_seq == b.seq == 1


# -- sim engine ------------------------------------------------------------------------------
def test_sim_engine_batches_up_to_max_batch_and_honours_oracle_lengths() -> None:
    engine = SimEngine(
        max_batch=3, lengths=LengthHistogram.from_file(HIST, 0.01), time_scale=0.0, seed=0
    )
    reqs = [Request(f"r{i}", [1], 50, target_length=5 + i) for i in range(5)]
    reqs.append(Request("long", [1], 20, target_length=100))
    reqs.append(Request("drawn", [1], 1000))
    running = []
    out: dict[str, list[int]] = {}
    finish: dict[str, str] = {}
    for r in reqs:
        engine.add(r)
    while engine.has_work:
        for e in engine.step():
            out.setdefault(e.key, []).extend(e.tokens)
            if e.finish_reason:
                finish[e.key] = e.finish_reason
        running.append(engine.running)
    assert max(running) <= 3 and engine.simulated
    assert {k: len(v) for k, v in out.items() if k.startswith("r")} == {
        f"r{i}": 5 + i for i in range(5)
    }
    assert len(out["long"]) == 20 and finish["long"] == "length" and finish["r0"] == "stop"
    assert 2 <= len(out["drawn"]) <= 200  # 0.01 x the 20K histogram
    steps = len(running)
    assert engine.simulated_ms >= steps * PTL(1) and engine.simulated_ms <= steps * PTL(3)


def test_sim_engine_resumes_after_a_prefix() -> None:
    engine = SimEngine(max_batch=2, time_scale=0.0, seed=0)
    done = complete(engine, [Request("a", [1], 30, prefix=[5] * 10, target_length=25)])
    assert len(done["a"].tokens) == 15 and done["a"].finish_reason == "stop"
