"""The trainer in-process against the session broker, on the tiny HF model and chunk records."""

from __future__ import annotations

import contextlib
import random
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from consumers import checkpoint as ckpts
from consumers.config import TrainConfig
from consumers.outcomes import REMEMBER_STEPS
from consumers.trainer import run_trainer
from schemas.records import TrajectoryChunk
from srl.errors import ProducerFailed
from srl.kafka import Producer, committed_offsets, create_topics, position_group, watermarks
from srl.stores import store_from_config
from srl.topics import Layout
from srl.weights import (
    announce,
    fetch_tensors,
    latest_announcement,
    load_manifest,
    materialize,
    publish,
)
from tests.chunks import (
    group_chunks,
    metric_events,
    produce,
    publish_versions,
    read_topic,
    text_ids,
    traj_chunks,
)


def make_groups(
    n_groups: int, n: int = 4, versions: list[int] | None = None, seed: int = 0, **kw: Any
) -> list[TrajectoryChunk]:
    """Prompt "a+b=" groups; about half the completions are the right answer."""
    rng = random.Random(seed)
    out: list[TrajectoryChunk] = []
    for g in range(n_groups):
        a, b = rng.randrange(10), rng.randrange(10)
        answers = [str(a + b) if rng.random() < 0.5 else str(rng.randrange(20)) for _ in range(n)]
        v = 0 if versions is None else versions[g]
        trajs = group_chunks(
            f"p{g}-{a}+{b}",
            [text_ids(x + "\n") for x in answers],
            prompt=text_ids(f"{a}+{b}="),
            metadata={"answer": a + b},
            chunk_tokens=2,
            versions=v,
            logprobs=[-5.5] * 3,
            **kw,
        )
        out += [c for t in trajs for c in t]
    return out


def train_cfg(make_cfg: Any, model: Path, **kw: Any) -> TrainConfig:
    base = {
        "model": str(model),
        "groups_per_step": 2,
        "lr": 1e-3,
        "micro_batch_tokens": 64,
        "idle_exit_s": 3.0,
        "max_staleness": 100,
        "device": "cpu",
    }
    return make_cfg(TrainConfig, **{**base, **kw})


def test_trains_publishes_hf_loadable_versions_and_commits_offsets(
    make_cfg: Any, tiny_model: Path
) -> None:
    cfg = train_cfg(make_cfg, tiny_model, max_steps=3, reward="consumers.rewards:first_line_match")
    layout = Layout.from_config(cfg)
    create_topics(cfg)
    produce(cfg, make_groups(6))
    result = run_trainer(cfg)
    assert (result.steps, result.version) == (3, 3)
    assert result.outcomes == {"trained": 24}

    store = store_from_config(cfg)
    ann = latest_announcement(cfg, layout, cfg.run)
    assert (
        ann is not None and ann.version == 3 and ann.trainer_step == 3 and ann.parent_version == 2
    )
    out = materialize(store, load_manifest(store, ann), Path(cfg.store[7:]) / "v3-hf")
    from transformers import AutoModelForCausalLM

    v3 = AutoModelForCausalLM.from_pretrained(out)
    v0 = AutoModelForCausalLM.from_pretrained(tiny_model)
    moved = [
        (a - b).abs().max().item() for a, b in zip(v3.parameters(), v0.parameters(), strict=True)
    ]
    assert max(moved) > 1e-4, "training changed the weights"
    assert torch.equal(v3.lm_head.weight, v3.model.embed_tokens.weight), "tied weights stay tied"

    steps = metric_events(cfg, "train_step")
    assert [e.step for e in steps] == [1, 2, 3]
    assert all(
        e.values["groups"] == 2 and e.values["samples"] == 8 and e.values["tokens"] > 0
        for e in steps
    )
    assert [e.values["policy_version"] for e in steps] == [1, 2, 3]
    samples = metric_events(cfg, "sample")
    assert len(samples) == 24 and {e.labels["outcome"] for e in samples} == {"trained"}
    assert {int(e.step) for e in samples} == {1, 2, 3}
    assert {e.values["reward"] for e in samples} == {0.0, 1.0}
    assert [e.values["version"] for e in metric_events(cfg, "weights_published")] == [1, 2, 3]

    # every record was used by a checkpointed step: the committed offsets reach the end
    marks = watermarks(cfg, [layout.trajectories])
    committed = committed_offsets(cfg, cfg.consumer_group, list(marks))
    assert all(committed[tp] == hi for tp, (_, hi) in marks.items() if hi > 0)


def test_the_trainer_shares_how_far_it_has_read_past_an_unfinished_trajectory(
    make_cfg: Any, tiny_model: Path
) -> None:
    from producers.backlog import GroupLag

    cfg = train_cfg(make_cfg, tiny_model, max_steps=2, reward="consumers.rewards:first_line_match")
    layout = Layout.from_config(cfg)
    create_topics(cfg)
    # the first chunk of a long trajectory that never finishes, then four complete groups
    long = traj_chunks("long", 0, 4, text_ids("1+1="), text_ids("2\n") * 8, chunk_tokens=2)
    produce(cfg, [long[0], *make_groups(4)])
    assert run_trainer(cfg).steps == 2
    marks = watermarks(cfg, [layout.trajectories])
    parts = [tp for tp, (_, hi) in marks.items() if hi > 0]
    committed = committed_offsets(cfg, cfg.consumer_group, parts)
    read = committed_offsets(cfg, position_group(cfg.consumer_group), parts)
    # durable offsets stop at the unfinished trajectory; the shared position is past it
    assert any((committed[tp] or 0) < marks[tp][1] for tp in parts)
    assert all(read[tp] == marks[tp][1] for tp in parts)
    group = cfg.consumer_group
    with contextlib.closing(GroupLag(cfg, [group], [layout.trajectories])) as durable:
        assert durable.lag() > 0
    with contextlib.closing(
        GroupLag(cfg, [group, position_group(group)], [layout.trajectories])
    ) as backlog:  # what a generator's max_backlog_chunks is measured against
        assert backlog.lag() == 0


def test_max_staleness_1_trains_no_sample_with_v_minus_b_over_1(
    make_cfg: Any, tiny_model: Path
) -> None:
    # groups stamped with behaviour versions 0..; as the trainer publishes, old ones go stale
    versions = [0, 0, 0, 0, 1, 0, 2, 1, 3, 0, 3, 4]
    cfg = train_cfg(
        make_cfg,
        tiny_model,
        max_staleness=1,
        groups_per_step=1,
        reward="consumers.rewards:first_line_match",
    )
    create_topics(cfg)
    publish_versions(cfg, max(versions))  # versions the chunks claim exist (another run's)
    produce(cfg, make_groups(len(versions), versions=versions))
    run_trainer(cfg)
    samples = metric_events(cfg, "sample")
    assert len(samples) == 4 * len(versions), "every trajectory has an outcome"
    trained = [e for e in samples if e.labels["outcome"] == "trained"]
    dropped = [e for e in samples if e.labels["outcome"] == "dropped_stale"]
    assert trained and dropped
    assert all(e.values["staleness"] <= 1 for e in trained)
    assert all(
        e.values["policy_version"] - e.values["behaviour_version"] == e.values["staleness"]
        for e in samples
    )
    # a dropped group holds at least one sample beyond the bound
    by_prompt: dict[str, list[float]] = {}
    for e in dropped:
        by_prompt.setdefault(e.labels["prompt_id"], []).append(e.values["staleness"])
    assert all(max(s) > 1 for s in by_prompt.values())
    assert sum(e.values["dropped_stale"] for e in metric_events(cfg, "train_step")) <= len(dropped)


def stepped_group(
    name: str, step: int, versions: int, answer_len: int = 1
) -> list[TrajectoryChunk]:
    """One group of 4 released for trainer ``step`` (one group per step), sampled by
    ``versions``."""
    answers = ["2\n" * answer_len, "3\n", "2\n", "4\n"]
    trajs = group_chunks(
        name,
        [text_ids(x) for x in answers],
        prompt=text_ids("1+1="),
        metadata={"answer": 2},
        chunk_tokens=2,
        versions=versions,
        step=step,
        step_groups=1,
    )
    return [c for t in trajs for c in t]


@pytest.mark.parametrize("batching", ["windows", "groups"])
def test_a_long_trajectory_trains_in_its_own_step_within_k(
    make_cfg: Any, tiny_model: Path, batching: str
) -> None:
    """Step 1's group has a long sample whose last chunk comes after steps 2 and 3 are complete.
    Stepping on whichever groups complete first (``groups``, main before) trains steps 2 and 3
    first, and the long sample, generated by v0, is stale at v2 and dropped; stepping on the
    dispatcher's steps (``windows``) waits for it, so every sample trains within k = 1."""
    cfg = train_cfg(
        make_cfg,
        tiny_model,
        max_staleness=1,
        groups_per_step=1,
        batching=batching,
        stale_policy="correct",
        reward="consumers.rewards:first_line_match",
    )
    create_topics(cfg)
    publish_versions(cfg, 1)  # c's chunks claim v1, produced here before this trainer makes it
    long = stepped_group("long", step=1, versions=0, answer_len=20)
    last = [c for c in long if c.is_last and c.sample_index == 0]
    produce(cfg, [c for c in long if c not in last], partition=0)
    produce(
        cfg,
        stepped_group("b", step=2, versions=0) + stepped_group("c", step=3, versions=1),
        partition=0,
    )
    produce(cfg, last, partition=0)  # the long sample ends after every other record
    result = run_trainer(cfg)
    events = metric_events(cfg, "sample")
    if batching == "groups":  # b trains v0 -> 1, c v1 -> 2; then the long group's v0 is stale
        assert result.outcomes == {"trained": 8, "dropped_stale": 4}
        assert {e.labels["outcome"] for e in events if e.labels["prompt_id"] == "long"} == {
            "dropped_stale"
        }
        return
    assert result.outcomes == {"trained": 12} and result.steps == 3
    assert all(e.labels["outcome"] == "trained" and e.values["staleness"] <= 1 for e in events)
    assert {e.labels["prompt_id"]: int(e.step or 0) for e in events} == {"long": 1, "b": 2, "c": 3}
    assert max(e.values["tokens"] for e in events if e.labels["prompt_id"] == "long") >= 40
    assert [e.values["staleness_max"] for e in metric_events(cfg, "train_step")] == [0, 1, 1]


def test_malformed_records_go_to_the_dlq_and_training_continues(
    make_cfg: Any, tiny_model: Path
) -> None:
    import dataclasses

    cfg = train_cfg(make_cfg, tiny_model, max_steps=1, reward="consumers.rewards:first_line_match")
    layout = Layout.from_config(cfg)
    create_topics(cfg)
    good = make_groups(2)
    bad_chunk = dataclasses.replace(
        good[0], trajectory_id="bad", sample_index=9
    )  # outside its group
    # The bad records go first, on the partition of a trajectory the step needs, so the
    # trainer must read past them before its one step can complete.
    first = layout.partition_for(good[0].bucket, good[0].trajectory_id)
    produce(cfg, [bad_chunk], extra=[b"\x00garbage", b""], partition=first)
    produce(cfg, good)
    result = run_trainer(cfg)
    assert result.steps == 1 and result.outcomes == {"trained": 8}
    dlq = read_topic(cfg, layout.dlq)
    reasons = sorted(dict(m.headers())["srl.reason"].decode() for m in dlq)
    assert len(dlq) == 3
    assert (
        any("outside group" in r for r in reasons) and sum("undecodable" in r for r in reasons) == 2
    )
    counters = metric_events(cfg, "counter")
    assert counters[-1].values["dead_letters"] == 3


def test_a_raising_reward_fails_the_sample_and_is_counted(make_cfg: Any, tiny_model: Path) -> None:
    cfg = train_cfg(
        make_cfg, tiny_model, max_steps=1, groups_per_step=1, reward="consumers.rewards:exact_match"
    )
    create_topics(cfg)
    chunks = make_groups(1)
    # one sample's metadata lacks the answer: exact_match raises KeyError for it
    first = next(c for c in chunks if c.sample_index == 1 and c.seq == 0)
    chunks = [
        c if c is not first else c.__class__(**{**c.to_dict(), "metadata": "{}"}) for c in chunks
    ]
    produce(cfg, chunks)
    result = run_trainer(cfg)
    assert result.outcomes == {"trained": 3, "failed_reward": 1}
    failed = [e for e in metric_events(cfg, "sample") if e.labels["outcome"] == "failed_reward"]
    assert (
        len(failed) == 1
        and "KeyError" in failed[0].labels["reason"]
        and "reward" not in failed[0].values
    )
    assert metric_events(cfg, "counter")[-1].values["reward_failures"] == 1


@pytest.mark.parametrize("loss", ["ppo", "decoupled"])
def test_other_objectives_and_kl_run(make_cfg: Any, tiny_model: Path, loss: str) -> None:
    cfg = train_cfg(
        make_cfg,
        tiny_model,
        max_steps=1,
        loss=loss,
        kl_coef=0.1,
        updates_per_step=2,
        advantage="rloo",
        reward="consumers.rewards:first_line_match",
    )
    create_topics(cfg)
    produce(cfg, make_groups(2))
    assert run_trainer(cfg).steps == 1
    (step,) = metric_events(cfg, "train_step")
    assert step.values["kl"] >= 0 and step.values["grad_norm"] > 0


def test_a_long_run_keeps_checkpoints_flat_and_a_new_group_trains_nothing_twice(
    make_cfg: Any, tiny_model: Path
) -> None:
    """Issue 18: the dedupe ledger is pruned by offset, so a checkpoint's ledger stays the
    same size step after step; its floor (the committed offsets it was pruned at) keeps a
    trainer that lost the group's offsets (here: a new group id) from training again what
    the pruned entries covered."""
    cfg = train_cfg(
        make_cfg, tiny_model, groups_per_step=1, keep_checkpoints=100, batching="groups"
    )
    create_topics(cfg)
    produce(cfg, make_groups(30, n=2), partition=0)  # one partition: offsets in step order
    first = run_trainer(cfg)
    assert first.steps == 30 and first.outcomes == {"trained": 60}
    store = store_from_config(cfg)
    ledgers = [ckpts.load(store, cfg.run, n).ledger for n in ckpts.complete(store, cfg.run)]
    sizes = [len(led) for led in ledgers]
    # what a checkpoint keeps is bounded by the last REMEMBER_STEPS steps' decisions and what
    # is in flight (decided since the last commit, or above a record still held on its
    # partition), not by the run's length: here 2 a step, flat after REMEMBER_STEPS steps
    # (unpruned: 2, 4, … 60)
    bound = 2 * REMEMBER_STEPS + 4
    assert len(sizes) >= 30 and max(sizes) <= bound, sizes
    assert min(sizes[REMEMBER_STEPS + 1 :]) >= 2 * REMEMBER_STEPS, sizes  # remembered

    again = run_trainer(cfg.model_copy(update={"group_id": "another-group"}))
    assert (again.steps, again.outcomes) == (30, {"trained": 60})
    # sample events are at least once (a restart re-sends its checkpoint's window), idempotent
    # by (trajectory, step): each trajectory trained at one step
    trained = {
        (e.labels["trajectory_id"], e.step)
        for e in metric_events(cfg, "sample")
        if e.labels["outcome"] == "trained"
    }
    assert len(trained) == len({t for t, _ in trained}) == 60, "a trajectory trained twice"


def test_a_restart_after_a_version_it_never_checkpointed_trains_the_steps_in_flight(
    make_cfg: Any, tiny_model: Path
) -> None:
    """Killed between publishing v3 and checkpointing step 3 (found by ``srl chaos``,
    trainer-kill-checkpoint), the trainer restarts from step 2's checkpoint: its weights are
    v2's and v3 stays in the store, never an ancestor of what it trains next. Its next update
    is the third from v0, so step 3's samples (b = 1) and step 4's (b = 2) are within k = 1 of
    the weights they train and must train. Counting the orphan v3 as an update made them
    2 behind and dropped them as stale, step after step, until the generators caught up."""
    reward = "consumers.rewards:first_line_match"
    cfg = train_cfg(make_cfg, tiny_model, max_staleness=1, groups_per_step=1, reward=reward)
    layout = Layout.from_config(cfg)
    create_topics(cfg)
    produce(cfg, stepped_group("a", 1, versions=0) + stepped_group("b", 2, versions=0))
    assert run_trainer(cfg.model_copy(update={"max_steps": 2})).version == 2
    store = store_from_config(cfg)
    ann = latest_announcement(cfg, layout, cfg.run)
    assert ann is not None and ann.version == 2
    orphan = publish(
        store,
        cfg.run,
        3,
        fetch_tensors(store, load_manifest(store, ann)),
        trainer_step=3,
        parent_version=2,
    )
    with Producer(cfg, "test-trainer") as p:
        announce(p, layout, orphan)  # ... and the trainer died before its checkpoint

    produce(cfg, stepped_group("c", 3, versions=1) + stepped_group("d", 4, versions=2))
    result = run_trainer(cfg.model_copy(update={"max_steps": 4}))
    assert result.outcomes == {"trained": 16} and result.steps == 4 and result.version == 5
    events = [e for e in metric_events(cfg, "sample") if e.labels["prompt_id"] in ("c", "d")]
    assert {e.labels["outcome"] for e in events} == {"trained"}
    # staleness counts the updates the trained weights are ahead of b (v3 is not one of them)
    assert {e.labels["prompt_id"]: e.values["staleness"] for e in events} == {"c": 1.0, "d": 1.0}


def test_a_restarted_trainer_sends_again_the_sample_events_of_every_kept_checkpoint(
    make_cfg: Any, tiny_model: Path
) -> None:
    """A SIGKILLed embedded broker forgets what it acknowledged in its last ~0.5 s: in
    ``srl chaos`` broker-restart it lost step 3's sample events, emitted just before the kill;
    the trainer then checkpointed step 4 and died on its failed producer. Its restart re-sent
    only checkpoint 4's window, so step 3's samples had no decision on the metrics topic
    (32 counted lost). A restart re-sends the windows of every kept checkpoint (at least once:
    the events are idempotent by trajectory and step)."""
    cfg = train_cfg(make_cfg, tiny_model, groups_per_step=1, max_steps=2, batching="groups")
    create_topics(cfg)
    produce(cfg, make_groups(2, n=2), partition=0)
    assert run_trainer(cfg).steps == 2
    sent_once = Counter((e.labels["trajectory_id"], e.step) for e in metric_events(cfg, "sample"))
    assert sorted(Counter(s for _t, s in sent_once).items()) == [(1, 2), (2, 2)]
    assert run_trainer(cfg).steps == 2  # a restart with nothing left to train
    again = Counter((e.labels["trajectory_id"], e.step) for e in metric_events(cfg, "sample"))
    assert again == {k: 2 * n for k, n in sent_once.items()}, again


def test_a_producer_failed_for_good_starts_the_trainer_over_in_its_own_process(
    make_cfg: Any, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 18 (``srl chaos`` broker-restart): a broker that lost what the trainer's producer
    had written fails that producer for good. The trainer used to exit and be restarted: a
    second import of torch and transformers, ~21 s of the 32.5 s recovery on 2 cores. It now
    starts over from its last checkpoint in its own process, exactly as a restart would (the
    ledger drops what the checkpoint decided), and exits only if that happens again within
    30 s. The failure is injected at step 3's checkpoint, after its update and publish."""
    from consumers import trainer as trainer_mod

    cfg = train_cfg(make_cfg, tiny_model, groups_per_step=1, max_steps=4, batching="groups")
    create_topics(cfg)
    produce(cfg, make_groups(4, n=2), partition=0)
    real = trainer_mod.Trainer._checkpoint
    failed: list[int] = []

    def failing(self: Any) -> None:
        if self.step == 3 and not failed:
            failed.append(self.step)
            raise ProducerFailed("the producer to the test broker failed for good: injected")
        real(self)

    monkeypatch.setattr(trainer_mod.Trainer, "_checkpoint", failing)
    result = run_trainer(cfg)
    assert failed == [3] and result.steps == 4
    trained = [
        (e.labels["trajectory_id"], e.step)
        for e in metric_events(cfg, "sample")
        if e.labels["outcome"] == "trained"
    ]
    by_traj = {t: {s for tt, s in trained if tt == t} for t, _ in trained}
    assert len(by_traj) == 8 and all(len(s) == 1 for s in by_traj.values()), by_traj
    # step 3 redone from checkpoint 2: its first publish (v3) is never reused
    published = [e.values["version"] for e in metric_events(cfg, "weights_published")]
    assert published == [1, 2, 3, 4, 5], published

    # failing again within 30 s of the last start-over: the process exits for its manager
    failed.clear()
    always = []

    def always_failing(self: Any) -> None:
        always.append(self.step)
        raise ProducerFailed("the producer to the test broker failed for good: injected")

    monkeypatch.setattr(trainer_mod.Trainer, "_checkpoint", always_failing)
    produce(cfg, make_groups(1, n=2, seed=1), partition=0)
    with pytest.raises(ProducerFailed):
        run_trainer(cfg.model_copy(update={"max_steps": 6}))
    assert always == [5, 5]


def test_the_upload_of_a_version_overlaps_the_next_step(
    make_cfg: Any, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """v1's weights file is held back until the optimizer has done step 2: a trainer whose
    step waited for the upload would never get there (the gate gives up after 60 s)."""
    import threading

    from consumers import trainer
    from consumers.engine import Engine

    # a checkpoint waits for the upload in flight (it never names a version that is not out):
    # none but the one at the end here, an hour after the start
    cfg = train_cfg(
        make_cfg,
        tiny_model,
        max_steps=3,
        checkpoint_every_s=3600.0,
        reward="consumers.rewards:first_line_match",
    )
    create_topics(cfg)
    produce(cfg, make_groups(6))
    order: list[str] = []
    stepped = threading.Event()
    real_step, real_store = Engine.step, trainer.store_from_config

    def step(self: Engine, normalizer: float) -> Any:
        out = real_step(self, normalizer)
        order.append("step")
        if order.count("step") == 2:
            stepped.set()
        return out

    def gated_store(c: Any) -> Any:
        store = real_store(c)
        put = store.put_chunks

        def put_chunks(key: str, chunks: Any, **kw: Any) -> Any:
            if "/v00000001/" in key and key.endswith(".safetensors"):
                order.append("v1 upload")
                assert stepped.wait(60), "step 2 never came while v1 was uploading"
            return put(key, chunks, **kw)

        store.put_chunks = put_chunks
        return store

    monkeypatch.setattr(Engine, "step", step)
    monkeypatch.setattr(trainer, "store_from_config", gated_store)
    result = run_trainer(cfg)
    assert (result.steps, result.version) == (3, 3)
    assert order[:3] == ["step", "v1 upload", "step"]
    published = metric_events(cfg, "weights_published")
    assert [e.values["version"] for e in published] == [1, 2, 3]
    assert all(e.values["snapshot_s"] <= e.values["publish_s"] for e in published)
    store = store_from_config(cfg)
    assert ckpts.complete(store, cfg.run) == [1] and ckpts.load(store, cfg.run, 1).step == 3
