"""Groups, the staleness gate, micro-batch packing and rewards."""

from __future__ import annotations

import types

import pytest

from consumers.assembler import Assembler, Trajectory
from consumers.batcher import StepBatcher, fits, pack, padded_cost
from consumers.gate import admissible, gate_group, staleness
from consumers.groups import Group, GroupBuffer, Sample
from consumers.rewards import Scorer, contains_answer, exact_match, load_reward
from srl.errors import ConfigError
from tests.chunks import traj_chunks


def traj(prompt_id: str, index: int, n: int, length: int = 4, version: int = 0) -> Trajectory:
    asm = Assembler(set())
    chunks = traj_chunks(
        prompt_id, index, n, [1, 2], list(range(length)), chunk_tokens=64, versions=version
    )
    out = [asm.add(c) for c in chunks][-1]
    assert out is not None
    return out


def full_group(rewards: list[float | None], versions: list[int] | None = None) -> Group:
    buf = GroupBuffer()
    n = len(rewards)
    versions = versions or [0] * n
    out = None
    for i, (r, v) in enumerate(zip(rewards, versions, strict=True)):
        out = buf.add(Sample(traj("p", i, n, version=v), r, None if r is not None else "boom"))
    assert out is not None
    return out


def test_group_completes_once_with_every_slot_and_new_epoch_opens_a_new_group() -> None:
    buf = GroupBuffer()
    assert buf.add(Sample(traj("p", 0, 2), 1.0)) is None
    assert buf.add(Sample(traj("p", 0, 2), 0.0)) is None  # slot 0 taken: a second group opens
    g1 = buf.add(Sample(traj("p", 1, 2), 0.5))
    assert g1 is not None and [s.reward for s in g1.scored()] == [1.0, 0.5]
    assert buf.waiting() == 1
    g2 = buf.add_missing("p", 1, 2, "dead")
    assert g2 is not None and g2.missing == {1: "dead"} and len(g2.scored()) == 1
    assert buf.waiting() == 0


def test_idle_groups_expire() -> None:
    buf = GroupBuffer(expire_s=5)
    buf.add(Sample(traj("p", 0, 3), 1.0), now=0.0)
    assert buf.expire(now=4.0) == []
    assert len(buf.expire(now=6.0)) == 1 and buf.waiting() == 0


def test_a_group_whose_trajectory_still_streams_does_not_expire() -> None:
    buf = GroupBuffer(expire_s=5)
    buf.add(Sample(traj("p", 0, 2), 1.0), now=0.0)
    assert buf.expire(now=60.0, alive={"p"}) == []  # its sample 1 is still receiving chunks
    assert len(buf.expire(now=60.0, alive={"q"})) == 1


def test_gate_is_v_minus_b_at_most_k() -> None:
    assert admissible(5, 4, 1) and admissible(5, 5, 0) and not admissible(5, 3, 1)
    assert admissible(2, 7, 0)  # another lineage's versions: negative staleness passes


def test_versions_skipped_by_a_restart_are_no_update() -> None:
    # restarted from v2's checkpoint with v3 in the store, the trainer published v4 from v2:
    # v4 is the third update, so b = 2 is one behind, not two; the orphan v3 is one update
    # past v2, as deep as v4
    skipped = frozenset({3})
    assert staleness(4, 2, skipped) == 1 and admissible(4, 2, 1, skipped)
    assert staleness(4, 3, skipped) == 0 and staleness(2, 3, skipped) == -1
    # found by srl chaos (trainer killed after publishing v5, restarted from step 4's v4):
    # step 7's samples came from the orphan v5 (depth 5) and train v7 (depth 6): one behind
    assert staleness(7, 5, frozenset({5})) == 1 and admissible(7, 5, 1, frozenset({5}))
    # a run of two orphans (v5, v6 from v4) beside the new lineage (v7, v8 from v4)
    assert staleness(8, 6, frozenset({5, 6})) == 0 and staleness(8, 5, frozenset({5, 6})) == 1
    assert staleness(6, 2, skipped) == 3 and not admissible(6, 2, 1, skipped)
    assert staleness(4, 2) == 2 and not admissible(4, 2, 1)


def test_drop_policy_drops_the_whole_group_if_any_sample_is_stale() -> None:
    g = full_group([1.0, 0.0, 0.0, 1.0], versions=[3, 3, 1, 3])
    out = gate_group(g, v=3, k=1, policy="drop")
    assert out.train == [] and len(out.stale) == 4
    out = gate_group(g, v=2, k=1, policy="drop")
    assert len(out.train) == 4 and out.advantages == pytest.approx([1, -1, -1, 1], abs=1e-5)


def test_correct_policy_drops_only_stale_samples_with_the_full_group_baseline() -> None:
    g = full_group([1.0, 0.0, 0.0, 1.0], versions=[3, 3, 1, 3])
    out = gate_group(g, v=3, k=1, policy="correct", advantage="rloo")
    assert [s.traj.sample_index for s in out.train] == [0, 1, 3]
    assert [s.traj.sample_index for s in out.stale] == [2]
    assert out.advantages == pytest.approx([2 / 3, -2 / 3, 2 / 3])


def test_failed_rewards_never_train_nor_enter_the_baseline() -> None:
    g = full_group([3.0, None, 1.0])
    out = gate_group(g, v=0, k=0)
    assert [s.traj.sample_index for s in out.train] == [0, 2]
    assert out.advantages == pytest.approx([1, -1], abs=1e-5)
    assert [s.traj.sample_index for s in g.failed()] == [1]


def test_packing_respects_the_padded_token_budget() -> None:
    assert padded_cost([3, 5, 2]) == 15
    assert fits([], 100, 10)  # an over-long row runs alone
    assert pack([4, 4, 4, 9, 2, 2], budget=12) == [[0, 1, 2], [3], [4, 5]]
    assert pack([20, 1], budget=10) == [[0], [1]]


def test_streaming_batcher_hands_out_micro_batches_as_they_fill() -> None:
    b = StepBatcher(budget=24, pipeline=True)
    g1 = gate_group(full_group([1.0, 0.0, 1.0]), v=0, k=0)  # rows of 2 + 4 = 6 tokens
    assert b.add(g1) == []  # 3 rows x 6 = 18 <= 24
    ready = b.add(gate_group(full_group([0.0, 1.0, 0.0]), v=0, k=0))
    assert [len(mb) for mb in ready] == [4]  # the 5th row would make 30 > 24
    assert len(b.groups) == 2 and b.rows == 6 and b.loss_tokens == 24
    assert [len(mb) for mb in b.drain()] == [2]


def test_eager_batcher_hands_out_what_waits_when_the_trainer_has_nothing_more() -> None:
    """``flush`` (after each poll): the open micro-batch's rows run now, so a complete group
    never waits for a fuller micro-batch; without ``eager``, or at a barrier, nothing."""
    b = StepBatcher(budget=24, pipeline=True, eager=True)
    assert b.add(gate_group(full_group([1.0, 0.0, 1.0]), v=0, k=0)) == []
    assert [r.length for r in b.flush()] == [6, 6, 6] and b.flush() == []
    b.add(gate_group(full_group([0.0, 1.0]), v=0, k=0))
    assert b.drain() and b.rows == 5  # the step counts every row, flushed or not
    for lazy in (StepBatcher(24, pipeline=True), StepBatcher(24, pipeline=False, eager=True)):
        lazy.add(gate_group(full_group([1.0, 0.0, 1.0]), v=0, k=0))
        assert lazy.flush() == [] and [len(mb) for mb in lazy.drain()] == [3]


def test_barrier_batcher_waits_for_the_whole_step() -> None:
    b = StepBatcher(budget=24, pipeline=False)
    assert b.add(gate_group(full_group([1.0, 0.0, 1.0]), v=0, k=0)) == []
    assert b.add(gate_group(full_group([0.0, 1.0, 0.0]), v=0, k=0)) == []
    assert [len(mb) for mb in b.drain()] == [4, 2]
    # a group with nothing to train does not count toward the step
    b.reset()
    assert b.add(gate_group(full_group([1.0, 0.0], [0, 0]), v=5, k=1)) == [] and not b.groups


def test_builtin_rewards_and_loader() -> None:
    assert exact_match("q", " 42\n", {"answer": 42}) == 1.0
    assert exact_match("q", "41", {"answer": "42"}) == 0.0
    assert contains_answer("q", "it is 42.", {"answer": "42"}) == 1.0
    assert load_reward("consumers.rewards:exact_match") is exact_match
    for bad, match in [
        ("nomodule_xyz:f", "cannot import"),
        ("consumers.rewards:nope", "no attribute"),
        ("consumers.rewards", "module:function"),
    ]:
        with pytest.raises(ConfigError, match=match):
            load_reward(bad)


def test_scorer_marks_raising_or_non_numeric_rewards_failed() -> None:
    tok = types.SimpleNamespace(decode=lambda ids, skip_special_tokens: "".join(map(str, ids)))
    t = traj("p", 0, 1, length=3)
    assert Scorer(lambda p, c, m: len(c), tok).score(t).reward == 3.0
    s = Scorer(exact_match, tok).score(t)  # metadata has no answer: KeyError
    assert s.reward is None and "KeyError" in (s.error or "")
    assert Scorer(lambda p, c, m: "x", tok).score(t).reward is None
    assert Scorer(lambda p, c, m: float("nan"), tok).score(t).reward is None


def test_sync_barrier_config_rules() -> None:
    from consumers.config import TrainConfig
    from srl.config import load_config

    with pytest.raises(ConfigError, match="synchronous baseline is k = 0"):
        load_config(TrainConfig, cli={"sync_barrier": True}, env={})
    with pytest.raises(ConfigError, match="windows need --publish-every <= max_staleness"):
        load_config(TrainConfig, cli={"max_staleness": 1, "publish_every": 3}, env={})
    cfg = load_config(
        TrainConfig, cli={"max_staleness": 1, "publish_every": 3, "batching": "groups"}, env={}
    )
    assert cfg.publish_every == 3
    with pytest.raises(ConfigError, match="--sync-barrier publishes every step"):
        load_config(
            TrainConfig,
            cli={
                "sync_barrier": True,
                "max_staleness": 0,
                "publish_every": 2,
                "batching": "groups",
            },
            env={},
        )
    with pytest.raises(ConfigError, match="reward: .*module:function"):
        load_config(TrainConfig, cli={"reward": "nocolon"}, env={})
    cfg = load_config(TrainConfig, cli={"sync_barrier": True, "max_staleness": 0}, env={})
    assert cfg.sync_barrier and cfg.consumer_group == "srl.trainer.default"
