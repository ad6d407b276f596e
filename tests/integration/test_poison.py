"""Poison records on every input topic, on the real broker (issue 18): garbage bytes, an unknown
fingerprint, a truncated record, an oversized one, the wrong schema, and the topic's own bad
values (a chunk with a negative or a future policy version, a task no engine should run, an
announcement with a negative version or one whose manifest is not there). Each goes to
``{prefix}.dlq`` with its reason and origin and is counted, and the consumer goes on to the
good records behind it: the trainer and the online ranker (trajectories), generator workers
(prompt and resume topics; weights topic through their follower), the dispatcher (weights
topic). The monitor (metrics topic) counts what it cannot read instead (it commits no
position, so it would dead-letter the same record at every start)."""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import orjson
import pytest

from app.configs import TopConfig
from app.monitor import Monitor
from consumers.trainer import run_trainer
from producers.config import DispatchConfig, GenerateConfig
from producers.dispatcher import Announcements
from producers.worker import run_generator
from ranker.config import RankerConfig
from ranker.online import run_online
from schemas.records import (
    PromptTask,
    ResumePrefix,
    TrajectoryChunk,
    WeightsAnnouncement,
    decode_as,
    encode,
    pack_tokens,
)
from srl.kafka import Producer, committed_offsets, create_topics, read_range, watermarks
from srl.metrics import Metrics
from srl.stores import store_from_config
from srl.topics import Layout
from srl.weights import announce, prune_versions, publish
from tests.chunks import metric_events, produce, sim_generate_cfg
from tests.integration.test_ranker_online import _trajectory
from tests.integration.test_trainer import make_groups, train_cfg
from tests.poison import BIG, REASONS, check_reasons, dead_letters, kinds

EVENT = Metrics(None, Layout(), "r", "poison").emit("poison")  # a record of another type


def send(cfg: Any, topic: str, values: list[bytes], partition: int = 0) -> None:
    with Producer(cfg, "poisoner") as p:
        for v in values:
            p.produce(topic, v, key=b"poison", partition=partition)


def test_the_trainer_dead_letters_poison_and_trains_on(make_cfg: Any, tiny_model: Path) -> None:
    cfg = train_cfg(make_cfg, tiny_model, max_steps=1, reward="consumers.rewards:first_line_match")
    layout = Layout.from_config(cfg)
    create_topics(cfg)
    good = make_groups(2)
    c = good[0]
    big = dataclasses.replace(c, trajectory_id="big", tokens=bytes(BIG), logprobs=b"")
    bad = kinds(c, EVENT, big)
    bad["negative version"] = encode(dataclasses.replace(c, trajectory_id="n", policy_version=-1))
    bad["future version"] = encode(dataclasses.replace(c, trajectory_id="f", policy_version=10**6))
    first = layout.partition_for(c.bucket, c.trajectory_id)
    send(cfg, layout.trajectories, list(bad.values()), first)  # ahead of what the step needs
    produce(cfg, good)
    result = run_trainer(cfg)
    assert result.steps == 1 and result.outcomes == {"trained": 8}
    found = dead_letters(cfg)
    expected = {**REASONS, "negative version": "negative policy version -1"}
    check_reasons(found, {**expected, "future version": "policy version 1000000 from the future"})
    assert [o for _, o, _ in found] == [f"{layout.trajectories}/{first}@{i}" for i in range(7)]
    assert [len(v) for *_, v in found][3] < len(bad["oversized"])  # kept cut to the limit
    assert metric_events(cfg, "counter")[-1].values["dead_letters"] == 7
    # the poison holds no offset back
    done = committed_offsets(cfg, cfg.consumer_group, [(layout.trajectories, first)])
    assert (done[(layout.trajectories, first)] or 0) > len(bad)


def test_the_online_ranker_dead_letters_poison_and_publishes(make_cfg: Any) -> None:
    cfg = make_cfg(RankerConfig, window=100, retrain_every=40, min_pairs=40, epochs=5, hidden=(8,))
    layout = Layout.from_config(cfg)
    create_topics(cfg)
    c = _trajectory(0, 3, layout)[0]
    big = dataclasses.replace(c, trajectory_id="big", prompt_tokens=bytes(BIG))
    bad = kinds(c, EVENT, big)
    bad["negative version"] = encode(dataclasses.replace(c, trajectory_id="n", policy_version=-3))
    bad["future version"] = encode(dataclasses.replace(c, trajectory_id="f", policy_version=77))
    outside = pack_tokens([5, 10**6])  # the tokenizer would decode -1 with an OverflowError
    bad["prompt token"] = encode(dataclasses.replace(c, trajectory_id="v", prompt_tokens=outside))
    send(cfg, layout.trajectories, list(bad.values()))
    good = [ch for i in range(40) for ch in _trajectory(i, 1 + i % 9, layout)]
    produce(cfg, good, partition=0)
    assert run_online(cfg, max_versions=1, idle_timeout_s=15) == 1
    check_reasons(
        dead_letters(cfg),
        {
            **REASONS,
            "negative version": "negative seq, token_offset or policy version (0, 0, -3)",
            "future version": "policy version 77 from the future",
            "prompt token": "prompt token ids outside the tokenizer's",
        },
    )


def sim_cfg(make_cfg: Any, **kw: Any) -> GenerateConfig:
    return sim_generate_cfg(make_cfg, **{"idle_exit_s": 4.0, **kw})


def prompt_task(layout: Layout, i: int, **kw: Any) -> PromptTask:
    fields = {
        "task_id": uuid.uuid4().hex,
        "prompt_id": f"p{i}",
        "prompt": f"prompt {i}",
        "group_size": 2,
        "max_new_tokens": 64,
        "bucket": layout.buckets[0],
        "prompt_tokens": pack_tokens([5, 6, 7]),
        "metadata": orjson.dumps({"sim_length": 20}).decode(),
    }
    return PromptTask(**{**fields, **kw})  # type: ignore[arg-type]


def test_a_generator_dead_letters_poison_tasks_and_generates_on(make_cfg: Any) -> None:
    cfg = sim_cfg(make_cfg, worker_id="w")
    layout = Layout.from_config(cfg)
    create_topics(cfg)
    good = prompt_task(layout, 0)
    bad = kinds(good, EVENT, prompt_task(layout, 9, prompt="x" * BIG))
    bad["huge group"] = encode(prompt_task(layout, 8, group_size=2**31 - 1))
    bad["negative min_version"] = encode(prompt_task(layout, 10, min_version=-3))
    bad["future min_version"] = encode(prompt_task(layout, 11, min_version=10**9, task_id="t11"))
    prompts, resumes = layout.prompts(good.bucket), layout.resumes(good.bucket)
    send(cfg, prompts, list(bad.values()))
    resume = ResumePrefix("t", 0, -1, pack_tokens([5]), 0, "migrated")
    back = [encode(prompt_task(layout, 7, resume=resume))]
    back.append(
        encode(
            prompt_task(layout, 6, resume=dataclasses.replace(resume, next_seq=1, min_version=-2))
        )
    )
    future = dataclasses.replace(resume, trajectory_id="f", next_seq=1, min_version=10**9)
    back.append(encode(prompt_task(layout, 5, resume=future, task_id="t5")))
    send(cfg, resumes, back)
    send(cfg, prompts, [encode(good), encode(prompt_task(layout, 1))])
    summary = run_generator(cfg)
    assert (summary.tasks, summary.trajectories, summary.dead_letters) == (2, 4, 11)
    check_reasons(
        dead_letters(cfg),
        {
            **REASONS,
            "huge group": "group of 2147483647 (1..1024)",
            "negative seq": "resume at seq -1, policy version 0",
            "negative version": "resume at seq 1, policy version -2",
            "negative min_version": "min_version -3",
            "future min_version": "task t11: policy version 1000000000 was never published",
            "future resume version": "task t5: policy version 1000000000 was never published",
        },
    )
    hw = watermarks(cfg, [prompts, resumes])
    done = committed_offsets(cfg, cfg.consumer_group, list(hw))
    assert all((done[tp] or 0) == high for tp, (_, high) in hw.items()), (done, hw)


def announcement(cfg: Any, version: int, step: int, uri: str = "", sha: str = "0" * 64) -> bytes:
    store = store_from_config(cfg)
    uri = uri or store.uri(f"weights/{cfg.run}/v{version:08d}/manifest.json")
    return encode(WeightsAnnouncement(cfg.run, version, uri, sha, step, 1, version - 1))


def weights_poison(cfg: Any) -> dict[str, bytes]:
    good = WeightsAnnouncement(cfg.run, 1, "file:///x", "0" * 64, 1, 1, 0)
    bad = kinds(good, EVENT, dataclasses.replace(good, manifest_uri="x" * BIG))
    bad["negative version"] = announcement(cfg, -4, 1)
    return bad


def publish_version(cfg: Any, version: int, corrupt: str | None = None) -> None:
    """Version ``version`` to the store and the weights topic; ``corrupt``: "delete" or
    "flip" its weights file after the announcement (object-store damage)."""
    import torch

    store = store_from_config(cfg)
    pub = publish(
        store,
        cfg.run,
        version,
        {"w": torch.ones(2) * version},
        trainer_step=version,
        parent_version=version - 1,
    )
    # damaged between the manifest and the announcement: to a follower, which fetches after
    # reading the announcement, the same as damage after it (and no race with its fetch)
    key = f"weights/{cfg.run}/v{version:08d}/model.safetensors"
    if corrupt == "delete":
        store.delete(key)
    elif corrupt == "flip":
        path = store.local_path(key)
        assert path is not None
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    with Producer(cfg, "trainer") as p:
        announce(p, Layout.from_config(cfg), pub)


def test_a_generator_dead_letters_poison_announcements_and_follows_the_good_version(
    make_cfg: Any,
) -> None:
    cfg = sim_cfg(make_cfg, worker_id="w", idle_exit_s=None)
    layout = Layout.from_config(cfg)
    create_topics(cfg)
    bad = weights_poison(cfg)
    # a version of our run announced with no manifest behind it, ahead of the good one: it is
    # refused and must not keep the follower from the good version (lower than it)
    send(cfg, layout.weights, [*bad.values(), announcement(cfg, 99, 99)])
    publish_version(cfg, 1)
    stop = threading.Event()
    out: list[Any] = []
    th = threading.Thread(target=lambda: out.append(run_generator(cfg, stop)))
    th.start()
    try:
        deadline = time.monotonic() + 60
        while len(dead_letters(cfg)) < len(bad) and time.monotonic() < deadline:
            time.sleep(0.5)
        while not metric_events(cfg, "weights_loaded") and time.monotonic() < deadline:
            time.sleep(0.5)
    finally:
        stop.set()
        th.join(60)
    [s] = out
    assert (s.weights_loaded, s.policy_version, s.weights_refused, s.dead_letters) == (1, 1, 1, 6)
    check_reasons(dead_letters(cfg), {**REASONS, "negative version": "negative version -4"})
    [refused] = metric_events(cfg, "weights_refused")
    assert refused.values["version"] == 99 and "not found" in refused.labels["reason"]


def test_a_follower_keeps_its_weights_past_damaged_versions_and_takes_the_next_good_one(
    make_cfg: Any,
) -> None:
    """Issue 18: a version whose weights file was deleted, then one whose file was corrupted:
    each is refused with the reason (log, ``weights_refused`` event), the worker keeps the
    weights it runs, and takes the next good version. A task released for the refused
    version waits for that next version rather than run on the old weights (its samples
    would be dropped as stale)."""
    cfg = sim_cfg(make_cfg, worker_id="w", idle_exit_s=None)
    create_topics(cfg)
    stop = threading.Event()
    out: list[Any] = []
    th = threading.Thread(target=lambda: out.append(run_generator(cfg, stop)))
    th.start()

    def until(kind: str, n: int) -> None:
        deadline = time.monotonic() + 60
        while len(metric_events(cfg, kind)) < n and time.monotonic() < deadline:
            time.sleep(0.3)

    try:
        publish_version(cfg, 1)
        until("weights_loaded", 1)
        publish_version(cfg, 2, corrupt="delete")
        until("weights_refused", 1)
        publish_version(cfg, 3, corrupt="flip")
        until("weights_refused", 2)
        layout = Layout.from_config(cfg)
        released = prompt_task(layout, 0, min_version=3, task_id="for-v3")
        send(cfg, layout.prompts(released.bucket), [encode(released)])
        time.sleep(3)  # time enough to start it on v1
        publish_version(cfg, 4)
        until("weights_loaded", 2)
        deadline = time.monotonic() + 60
        while len(finished(cfg, "for-v3")) < 2 and time.monotonic() < deadline:
            time.sleep(0.3)
    finally:
        stop.set()
        th.join(60)
    assert sorted(finished(cfg, "for-v3").values()) == [4, 4]
    [s] = out
    assert [e.values["version"] for e in metric_events(cfg, "weights_loaded")] == [1, 4]
    refused = metric_events(cfg, "weights_refused")
    assert [e.values["version"] for e in refused] == [2, 3]
    assert "not found" in refused[0].labels["reason"]
    assert "fails verification" in refused[1].labels["reason"]
    assert (s.weights_loaded, s.weights_refused, s.policy_version) == (2, 2, 4)


def finished(cfg: Any, task_id: str) -> dict[str, int]:
    """The oldest policy version in each finished trajectory of ``task_id``."""
    oldest: dict[str, int] = {}
    done = set()
    for m in read_range(cfg, Layout.from_config(cfg).trajectories, timeout_s=10, role="t"):
        c = decode_as(m.value() or b"", TrajectoryChunk)
        if c.task_id == task_id:
            oldest[c.trajectory_id] = min(
                oldest.get(c.trajectory_id, c.policy_version), c.policy_version
            )
            if c.is_last:
                done.add(c.trajectory_id)
    return {t: v for t, v in oldest.items() if t in done}


def test_the_dispatcher_dead_letters_poison_and_unverified_announcements(make_cfg: Any) -> None:
    cfg = make_cfg(DispatchConfig, prompts="unused.jsonl")
    layout = Layout.from_config(cfg)
    create_topics(cfg)
    bad = weights_poison(cfg)
    bad["future version"] = announcement(cfg, 99, 99)  # would release every step at once
    send(cfg, layout.weights, list(bad.values()))
    publish_version(cfg, 1)
    with Producer(cfg, "dispatcher") as producer:
        anns = Announcements(cfg, layout, producer)
        anns.close()
    assert (anns.latest, anns.step) == (1, 1)
    check_reasons(
        dead_letters(cfg),
        {**REASONS, "negative version": "negative version -4", "future version": "v99: object"},
    )


def test_a_restarted_dispatcher_does_not_dead_letter_versions_pruned_since(make_cfg: Any) -> None:
    # a dispatcher restarted late in a run reads the whole weights topic back: the versions
    # older than ``keep_versions`` are gone from the store, as they should be (it used to
    # dead-letter every one of them: ~400 letters per restart in the 30-minute soak); a bogus
    # newest announcement is still refused, and the newest good one taken
    cfg = make_cfg(DispatchConfig, prompts="unused.jsonl")
    layout = Layout.from_config(cfg)
    create_topics(cfg)
    for v in range(1, 6):
        publish_version(cfg, v)
    assert prune_versions(store_from_config(cfg), cfg.run, keep=2) == [1, 2, 3]
    send(cfg, layout.weights, [announcement(cfg, 9, 9)])  # announced, never written
    with Producer(cfg, "dispatcher") as producer:
        anns = Announcements(cfg, layout, producer)
        anns.close()
    assert (anns.latest, anns.step) == (5, 5)
    check_reasons(dead_letters(cfg), {"bogus newest": "v9: object"})


def test_the_monitor_counts_unreadable_metric_records_and_shows_the_rest(make_cfg: Any) -> None:
    cfg = make_cfg(TopConfig)
    layout = Layout.from_config(cfg)
    create_topics(cfg)
    m = Metrics(None, layout, cfg.run, "trainer-0")
    good = m.emit("train_step", {"policy_version": 3, "tokens_per_s": 10.0}, step=3)
    chunk = make_groups(1)[0]
    bad = kinds(good, chunk, dataclasses.replace(good, labels={"x": "y" * BIG}))
    nan = m.emit("sample", {"staleness": float("nan")}, {"outcome": "trained"}, step=3)
    send(make_cfg(), layout.metrics, [*bad.values(), encode(nan), encode(good)])
    snap = Monitor(cfg, stall_after_s=60).snapshot()
    assert snap["drops"]["unreadable_metric_records"] == len(bad)
    assert snap["versions"]["trainer"] == 3 and dead_letters(cfg) == []


@pytest.fixture(autouse=True)
def _quiet_dlq_warnings(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("ERROR", logger="srl.metrics")
