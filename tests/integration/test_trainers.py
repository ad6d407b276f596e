"""Several trainers on one stream, on the real broker: each run in its own consumer group, a
trainer added later starts where ``--from`` says, and a trainer that is not the lead gates
no sample on versions of the lead's lineage."""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from consumers.config import TrainConfig
from consumers.trainer import run_trainer
from producers.follower import WeightFollower
from schemas.records import TrajectoryChunk, now_ms
from srl.kafka import Producer, committed_offsets, create_topics, watermarks
from srl.stores import store_from_config
from srl.tinymodel import load_model
from srl.topics import Layout
from srl.weights import announce, publish
from tests.chunks import metric_events, produce
from tests.integration.test_trainer import make_groups


def cfg_for(make_cfg: Any, model: Path, **kw: Any) -> TrainConfig:
    base = {
        "model": str(model),
        "run": f"r-{uuid.uuid4().hex[:6]}",
        "reward": "consumers.rewards:first_line_match",
        "groups_per_step": 1,
        "batching": "groups",
        "lr": 1e-3,
        "micro_batch_tokens": 64,
        "idle_exit_s": 4.0,
        "device": "cpu",
    }
    return make_cfg(TrainConfig, **{**base, **kw})


def tagged(chunks: list[TrajectoryChunk], tag: str) -> list[TrajectoryChunk]:
    return [dataclasses.replace(c, prompt_id=f"{tag}-{c.prompt_id}") for c in chunks]


def trained_prompts(cfg: TrainConfig) -> set[str]:
    return {
        e.labels["prompt_id"]
        for e in metric_events(cfg, "sample")
        if e.run == cfg.run and e.labels["outcome"] == "trained"
    }


def test_a_trainer_from_latest_skips_what_was_there(make_cfg: Any, tiny_model: Path) -> None:
    cfg = cfg_for(make_cfg, tiny_model, start_from="latest", max_steps=1)
    layout = Layout.from_config(cfg)
    create_topics(cfg)
    produce(cfg, make_groups(2, seed=1))  # before the trainer: not for it
    parts = list(watermarks(cfg, [layout.trajectories]))

    def later() -> None:  # once the new trainer's group has its starting positions
        deadline = time.monotonic() + 60
        while any(v is None for v in committed_offsets(cfg, cfg.consumer_group, parts).values()):
            assert time.monotonic() < deadline
            time.sleep(0.2)
        produce(cfg, tagged(make_groups(1, seed=2), "new"))

    t = threading.Thread(target=later, daemon=True)
    t.start()
    result = run_trainer(cfg)
    t.join(10)
    assert result.steps == 1 and result.outcomes == {"trained": 4}
    assert {p.split("-")[0] for p in trained_prompts(cfg)} == {"new"}


def test_a_trainer_from_a_time_starts_there(make_cfg: Any, tiny_model: Path) -> None:
    first = cfg_for(make_cfg, tiny_model)
    create_topics(first)
    produce(first, make_groups(2, seed=1))
    time.sleep(0.05)
    since = now_ms()
    produce(first, tagged(make_groups(1, seed=2), "new"))
    cfg = cfg_for(make_cfg, tiny_model, start_from=str(since))
    assert run_trainer(cfg).outcomes == {"trained": 4}
    assert {p.split("-")[0] for p in trained_prompts(cfg)} == {"new"}
    # a restart resumes from its commits, not from --from again (nothing new to train)
    assert run_trainer(cfg).outcomes == {"trained": 4}


def test_a_trainer_of_another_lineage_is_not_gated_by_its_own_versions(
    make_cfg: Any, tiny_model: Path
) -> None:
    """Four groups sampled by the lead's v0. The lead itself, at k = 0, may train only the
    first (its version has moved on by the second); a trainer of another run, learning from
    the lead's stream, trains them all and reports no staleness for them."""
    lead = cfg_for(make_cfg, tiny_model, max_staleness=0, run="lead")
    create_topics(lead)
    produce(lead, make_groups(4))
    assert run_trainer(lead).outcomes == {"trained": 4, "dropped_stale": 12}
    other = cfg_for(make_cfg, tiny_model, max_staleness=0, run="other", lead_run="lead")
    assert run_trainer(other).outcomes == {"trained": 16}
    trained = [e for e in metric_events(other, "sample") if e.run == "other"]
    assert len(trained) == 16 and not any("staleness" in e.values for e in trained)
    steps = [e for e in metric_events(other, "train_step") if e.run == "other"]
    assert [e.values["policy_version"] for e in steps] == [1, 2, 3, 4]


def test_followers_load_only_the_run_they_follow(make_cfg: Any, tiny_model: Path) -> None:
    """Generators and srl serve follow the lead (--follow-run); the other runs' announcements
    on the same weights topic are not theirs."""
    cfg = make_cfg(run="serving")
    layout = Layout.from_config(cfg)
    create_topics(cfg)
    store = store_from_config(cfg)
    base = load_model(tiny_model).state_dict()
    with Producer(cfg, "test-trainers") as p:
        for run, version, scale in (("lead", 1, 2.0), ("other", 1, 3.0), ("other", 2, 4.0)):
            tensors = {k: v * scale for k, v in base.items()}
            pub = publish(store, run, version, tensors, trainer_step=version, parent_version=0)
            announce(p, layout, pub)
    lead = WeightFollower(cfg, layout, store, run="lead").start()
    own = WeightFollower(cfg, layout, store).start()  # default: the config's own run
    try:
        lead.sync()
        own.sync()
        deadline = time.monotonic() + 30
        while (ready := lead.take()) is None:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        name = next(iter(base))
        assert ready.version == 1 and lead.latest == 1
        assert (ready.tensors[name] == base[name] * 2.0).all()
        assert own.take() is None and own.latest == 0
    finally:
        lead.stop()
        own.stop()


@pytest.mark.embedded
def test_a_follower_of_an_empty_weights_topic_stops_fetching(
    make_cfg: Any, tiny_model: Path
) -> None:
    """``srl serve`` before any trainer: nothing announced yet. The follower goes quiet (the
    embedded broker answers an idle fetch at once; fetching from a logical start offset never
    paused, so an idle ``srl serve`` spent 0.46 core on it), and still reads the first
    announcement when it comes."""
    cfg = make_cfg(run="lead")
    layout = Layout.from_config(cfg)
    create_topics(cfg)
    store = store_from_config(cfg)
    follower = WeightFollower(cfg, layout, store).start()
    try:
        deadline = time.monotonic() + 20
        while not follower._tail.caught_up:
            assert time.monotonic() < deadline, "the follower never paused on an empty topic"
            time.sleep(0.05)
        assert follower._tail.paused
        tensors = load_model(tiny_model).state_dict()
        with Producer(cfg, "test-trainers") as p:
            announce(
                p, layout, publish(store, "lead", 1, tensors, trainer_step=1, parent_version=0)
            )
        deadline = time.monotonic() + 30
        while (ready := follower.take()) is None:
            assert time.monotonic() < deadline, "the first announcement was not read"
            time.sleep(0.1)
        assert ready.version == 1 and follower.latest == 1
    finally:
        follower.stop()
