"""Dispatcher and generator workers against the real broker, with the tiny HF model.

Workers run in threads here (one process, fast); tests/e2e/test_generate_cli.py runs them as
real ``srl-producer generate`` subprocesses for SIGKILL and SIGTERM.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import orjson
import pytest
import torch

from producers.config import DispatchConfig, GenerateConfig
from producers.dispatcher import run_dispatcher
from producers.engines import make_engine
from producers.sources import SourcePrompt
from producers.worker import GenSummary, run_generator
from ranker.predictor import BaselinePredictor
from schemas.records import MetricEvent, PromptTask, TrajectoryChunk, decode_as, encode, now_ms
from srl.config import CommonConfig
from srl.data import STREAMRL_LENGTHS
from srl.errors import ProducerFailed
from srl.kafka import (
    Producer,
    TopicPartition,
    committed_offsets,
    create_topics,
    reader,
    watermarks,
)
from srl.lineage import Lineage
from srl.stores import store_from_config
from srl.tinymodel import load_model
from srl.topics import Layout
from srl.weights import announce, publish

HIST = str(STREAMRL_LENGTHS)


# -- helpers ------------------------------------------------------------------------------------
class TopicReader:
    """Reads a topic from the start in the test's thread, remembering when each record arrived."""

    def __init__(self, cfg: CommonConfig, topic: str) -> None:
        self.c = reader(cfg, f"test-{uuid.uuid4().hex[:8]}")
        md = self.c.list_topics(topic, timeout=10)
        self.c.assign([TopicPartition(topic, p, 0) for p in md.topics[topic].partitions])
        self.records: list[tuple[int, int, Any]] = []  # (broker timestamp, received_ms, message)

    def poll(self, seconds: float = 0.2) -> None:
        for msg in self.c.consume(500, seconds):
            if not msg.error():
                self.records.append((msg.timestamp()[1], now_ms(), msg))

    def close(self) -> None:
        self.c.close()


class Trajectories:
    """Chunks of the trajectories topic that count, as the trainer counts them: deduplicated
    by (trajectory_id, seq), a fenced writer's dropped (``srl.lineage``)."""

    def __init__(self, cfg: CommonConfig) -> None:
        self.reader = TopicReader(cfg, Layout.from_config(cfg).trajectories)
        self.chunks: dict[str, dict[int, tuple[int, int, TrajectoryChunk]]] = defaultdict(dict)
        self.lineages: dict[str, Lineage] = defaultdict(Lineage)
        self.raw: list[TrajectoryChunk] = []  # every chunk, in the order read
        self.duplicates = 0
        self._seen = 0

    @property
    def fenced(self) -> int:
        return sum(lin.fenced for lin in self.lineages.values())

    def poll(self) -> None:
        self.reader.poll()
        for ts, got, msg in self.reader.records[self._seen :]:
            c = decode_as(msg.value(), TrajectoryChunk)
            self.raw.append(c)
            lin, held = self.lineages[c.trajectory_id], self.chunks[c.trajectory_id]
            verdict = lin.add(c)
            if verdict == "duplicate":
                self.duplicates += 1
            elif verdict == "kept":
                held[c.seq] = (ts, got, c)
            for seq in [seq for seq in held if lin.chunks.get(seq) is not held[seq][2]]:
                del held[seq]  # removed by a newer writer's chunk
        self._seen = len(self.reader.records)

    def ordered(self, tid: str) -> list[TrajectoryChunk]:
        return [self.chunks[tid][s][2] for s in sorted(self.chunks[tid])]

    def complete(self) -> dict[str, list[TrajectoryChunk]]:
        out = {}
        for tid in self.chunks:
            cs = self.ordered(tid)
            if cs and cs[-1].is_last and [c.seq for c in cs] == list(range(len(cs))):
                out[tid] = cs
        return out

    def wait(
        self,
        what: Callable[[Trajectories], bool],
        running: Workers | None = None,
        timeout_s: float = 90,
    ) -> None:
        deadline = time.monotonic() + timeout_s
        while not what(self):
            assert not (running and running.errors), running.errors if running else None
            assert time.monotonic() < deadline, (
                f"timed out; {len(self.complete())} complete trajectories"
            )
            self.poll()


def check_exactly_once(
    t: Trajectories, expected: set[tuple[str, int]]
) -> dict[tuple[str, int], list[TrajectoryChunk]]:
    """Every (prompt_id, sample_index) complete exactly once, chunks consistent."""
    by_sample: dict[tuple[str, int], list[list[TrajectoryChunk]]] = defaultdict(list)
    for cs in t.complete().values():
        by_sample[(cs[0].prompt_id, cs[0].sample_index)].append(cs)
    assert set(by_sample) == expected
    assert all(len(v) == 1 for v in by_sample.values()), "a sample completed twice"
    for (cs,) in by_sample.values():
        offset = 0
        for c in cs:
            assert c.token_offset == offset and c.n_tokens == len(c.logprob_values())
            offset += c.n_tokens
        assert cs[0].prompt_tokens is not None and all(c.prompt_tokens is None for c in cs[1:])
        assert cs[-1].finish_reason in ("stop", "length") and all(
            c.finish_reason is None for c in cs[:-1]
        )
    return {k: v[0] for k, v in by_sample.items()}


class Workers:
    def __init__(self) -> None:
        self.summaries: list[GenSummary] = []
        self.errors: list[BaseException] = []


@contextmanager
def workers(*cfgs: GenerateConfig, no_eos: bool = False) -> Iterator[Workers]:
    """Generator workers in threads (engines built here, in the main thread); stopped on exit.
    ``no_eos``: every sequence runs to ``max_new_tokens`` (the random tiny model otherwise
    stops after a random number of tokens, which makes a test's timing a matter of luck)."""
    stop = threading.Event()
    ws = Workers()

    def run(cfg: GenerateConfig, engine: Any) -> None:
        try:
            ws.summaries.append(run_generator(cfg, stop, engine))
        except BaseException as e:
            ws.errors.append(e)

    engines = [make_engine(c) for c in cfgs]
    for e in engines if no_eos else []:
        e.eos_ids = set()
    threads = [
        threading.Thread(target=run, args=(c, e)) for c, e in zip(cfgs, engines, strict=True)
    ]
    for th in threads:
        th.start()
    try:
        yield ws
    finally:
        stop.set()
        for th in threads:
            th.join(timeout=60)
    assert not ws.errors, ws.errors
    assert len(ws.summaries) == len(cfgs)


def gen_cfg(make_cfg: Any, tiny_model: Path, **kw: Any) -> GenerateConfig:
    base = {
        "model": str(tiny_model),
        "max_batch": 4,
        "chunk_tokens": 16,
        "threads": 1,
        "stats_interval_s": 0.5,
        "drain_timeout_s": 10.0,
        "seed": 0,
    }
    return make_cfg(GenerateConfig, **{**base, **kw})  # type: ignore[no-any-return]


def prompts(n: int) -> list[SourcePrompt]:
    return [
        SourcePrompt(f"p{i}", f"prompt number {i}: " + "x" * i, {"answer": str(i)})
        for i in range(n)
    ]


def publish_weights(
    cfg: CommonConfig, version: int, tensors: dict[str, torch.Tensor], corrupt: bool = False
) -> Any:
    """The trainer's side of the weights protocol; ``corrupt`` flips a byte of the shard before
    announcing."""
    store = store_from_config(cfg)
    pub = publish(
        store, cfg.run, version, tensors, trainer_step=version, parent_version=version - 1
    )
    if corrupt:
        path = store.local_path(f"weights/{cfg.run}/v{version:08d}/model.safetensors")
        assert path is not None
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    with Producer(cfg, "test-trainer") as p:
        announce(p, Layout.from_config(cfg), pub)
    return pub


def perturbed(tiny_model: Path, seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {
        k: v + 0.3 * torch.randn_like(v) for k, v in load_model(tiny_model).state_dict().items()
    }


def events(cfg: CommonConfig, kind: str) -> list[MetricEvent]:
    reader = TopicReader(cfg, Layout.from_config(cfg).metrics)
    try:
        for _ in range(10):
            reader.poll(0.3)
    finally:
        reader.close()
    evs = [decode_as(m.value(), MetricEvent) for _, _, m in reader.records]
    return [e for e in evs if e.kind == kind]


# -- tests --------------------------------------------------------------------------------------
def test_dispatcher_to_two_workers_streams_every_sample_exactly_once(
    make_cfg: Any, tiny_model: Path
) -> None:
    dcfg = make_cfg(
        DispatchConfig, prompts="unused.jsonl", group_size=3, max_new_tokens=150, window=4
    )
    w1 = gen_cfg(make_cfg, tiny_model, worker_id="w1")
    w2 = gen_cfg(make_cfg, tiny_model, worker_id="w2")
    create_topics(dcfg)
    t = Trajectories(dcfg)
    src = prompts(8)
    with workers(w1, w2) as ws:
        run_dispatcher(dcfg, src, BaselinePredictor(100))
        t.wait(lambda t: len(t.complete()) == 24, ws)
    summaries = ws.summaries
    by_sample = check_exactly_once(t, {(p.prompt_id, s) for p in src for s in range(3)})
    assert t.duplicates == 0
    assert {w.worker_id for w in summaries} == {"w1", "w2"} and all(
        w.tasks > 0 for w in summaries
    ), summaries
    assert sum(w.tasks for w in summaries) == 8 and sum(w.trajectories for w in summaries) == 24
    # long outputs arrive as several chunks, on the broker before the trajectory ended
    long = [cs for cs in by_sample.values() if len(cs) >= 3]
    assert long, "no trajectory long enough to span several chunks"
    for cs in long:
        ts0, _got0, _ = t.chunks[cs[0].trajectory_id][0]
        assert ts0 < cs[-1].created_ms  # the broker had the first chunk before the last existed
    for cs in by_sample.values():
        assert orjson.loads(cs[0].metadata or "") == {"answer": cs[0].prompt_id[1:]}
        assert cs[0].bucket == "le256" and cs[0].predicted_length == 100
    # every task committed by the pool
    layout = Layout.from_config(dcfg)
    hw = watermarks(dcfg, [layout.prompts(b) for b in layout.buckets])
    done = committed_offsets(dcfg, w1.consumer_group, list(hw))
    assert all((done[tp] or 0) == high for tp, (_low, high) in hw.items()), (done, hw)
    stats = events(dcfg, "gen_stats")
    assert stats and all(
        e.labels["simulated"] == "false" and e.labels["engine"] == "hf" for e in stats
    )
    t.reader.close()


def test_weights_published_mid_generation_are_followed_and_a_corrupt_version_refused(
    make_cfg: Any, tiny_model: Path
) -> None:
    cfg = gen_cfg(make_cfg, tiny_model, max_batch=2, chunk_tokens=8, worker_id="wv")
    dcfg = make_cfg(
        DispatchConfig, prompts="unused.jsonl", group_size=2, max_new_tokens=400, temperature=0.7
    )
    create_topics(cfg)
    t = Trajectories(cfg)
    # every trajectory runs its 400 tokens, so the one in flight when v1 is published is
    # still decoding when the worker swaps to it; 4 of them (2 at a time) and 2 short ones
    # after the refusal keep the decoding short
    with workers(cfg, no_eos=True) as ws:
        run_dispatcher(dcfg, prompts(2), BaselinePredictor(10))

        def mid_trajectory(t: Trajectories) -> bool:
            return any(
                len(cs) >= 2 and not t.ordered(tid)[-1].is_last for tid, cs in t.chunks.items()
            )

        t.wait(mid_trajectory, ws)
        publish_weights(cfg, 1, perturbed(tiny_model, 1))
        t.wait(lambda t: len(t.complete()) == 4, ws)
        # v2 with a file that no longer matches its manifest: refused, v1 stays
        pub = publish_weights(cfg, 2, perturbed(tiny_model, 2), corrupt=True)
        deadline = time.monotonic() + 30
        while not events(cfg, "weights_refused") and time.monotonic() < deadline:
            time.sleep(0.2)
        short = dcfg.model_copy(update={"max_new_tokens": 40})
        run_dispatcher(short, [SourcePrompt("after", "after the refusal")], BaselinePredictor(10))
        t.wait(lambda t: len(t.complete()) == 6, ws)
    assert pub.manifest.version == 2
    s = ws.summaries[0]
    assert (s.weights_loaded, s.weights_refused, s.policy_version) == (1, 1, 1)
    refused = events(cfg, "weights_refused")
    assert [(e.values["version"], e.labels["worker_id"]) for e in refused] == [(2.0, "wv")]
    assert "fails verification" in refused[0].labels["reason"]
    loaded = events(cfg, "weights_loaded")
    assert [e.values["version"] for e in loaded] == [1.0] and loaded[0].values["pause_ms"] >= 0
    done = check_exactly_once(
        t, {(f"p{i}", s) for i in range(2) for s in range(2)} | {("after", s) for s in range(2)}
    )
    versions = {k: [c.policy_version for c in cs] for k, cs in done.items()}
    assert all(v == sorted(v) for v in versions.values()), (
        "versions only move forward within a trajectory"
    )
    assert any(v[0] == 0 and v[-1] == 1 for v in versions.values()), "a trajectory spans the swap"
    assert all(set(versions[("after", s)]) == {1} for s in range(2)), (
        "the refused v2 was never used"
    )
    loaded_at = loaded[0].ts_ms
    later = [c for cs in done.values() for c in cs if c.created_ms > loaded_at + 50]
    assert later and all(c.policy_version == 1 for c in later)


def test_sync_barrier_publishes_one_step_of_prompts_per_weights_version(
    make_cfg: Any, tiny_model: Path
) -> None:
    dcfg = make_cfg(
        DispatchConfig,
        prompts="unused.jsonl",
        group_size=2,
        max_new_tokens=40,
        max_staleness=0,
        groups_per_step=2,
        barrier_timeout_s=60,
    )
    cfg = gen_cfg(make_cfg, tiny_model, max_staleness=0, worker_id="ws")
    layout = Layout.from_config(dcfg)
    create_topics(dcfg)
    t = Trajectories(dcfg)

    def published() -> int:
        return sum(
            h
            for (_tp, (_lo, h)) in watermarks(
                dcfg, [layout.prompts(b) for b in layout.buckets]
            ).items()
        )

    result: dict[str, Any] = {}
    with workers(cfg) as ws:
        th = threading.Thread(
            target=lambda: result.update(s=run_dispatcher(dcfg, prompts(6), BaselinePredictor(10)))
        )
        th.start()
        for step in range(3):
            t.wait(lambda t, n=4 * (step + 1): len(t.complete()) == n, ws)
            assert published() == 2 * (step + 1), "the dispatcher ran ahead of the trainer"
            if step < 2:
                publish_weights(dcfg, step + 1, perturbed(tiny_model, step))
        th.join(timeout=30)
    done = check_exactly_once(t, {(f"p{i}", s) for i in range(6) for s in range(2)})
    for (pid, _s), cs in done.items():
        step = int(pid[1:]) // 2
        assert {c.policy_version for c in cs} == {step}, (
            f"{pid}: step {step} generated with {cs[0].policy_version}"
        )
    # step t is released by the announcement of step t - 1 and may not start with older weights
    assert result["s"].versions_seen == [0, 1, 2] and result["s"].tasks == 6
    assert result["s"].first_step == 1
    seq0 = {(c.prompt_id, c.sample_index): c for cs in done.values() for c in cs if c.seq == 0}
    assert {(pid, c.step, c.step_groups) for (pid, _s), c in seq0.items()} == {
        (f"p{i}", i // 2 + 1, 2) for i in range(6)
    }


def test_async_dispatch_keeps_the_backlog_bounded(make_cfg: Any) -> None:
    dcfg = make_cfg(
        DispatchConfig,
        task="sim",
        lengths=HIST,
        length_scale=0.01,
        num_prompts=12,
        group_size=2,
        max_new_tokens=500,
        max_pending=3,
    ).model_copy(update={"max_staleness": None})
    cfg = make_cfg(
        GenerateConfig,
        engine="sim",
        time_scale=0.0,
        max_batch=4,
        chunk_tokens=16,
        stats_interval_s=0.5,
    )
    layout = Layout.from_config(dcfg)
    create_topics(dcfg)
    from app.sources import load_source

    src = load_source(dcfg)
    th = threading.Thread(target=run_dispatcher, args=(dcfg, src, BaselinePredictor(100)))
    th.start()
    time.sleep(3)
    hw = watermarks(dcfg, [layout.prompts(b) for b in layout.buckets])
    assert sum(h for _lo, h in hw.values()) == 3, (
        "published past max_pending with no generator running"
    )
    t = Trajectories(dcfg)
    with workers(cfg) as ws:
        t.wait(lambda t: len(t.complete()) == 24, ws)
        th.join(timeout=30)
        assert not th.is_alive()
    done = check_exactly_once(t, {(p.prompt_id, s) for p in src for s in range(2)})
    for (pid, _), cs in done.items():  # sim lengths are the oracle lengths from the task
        want = next(p.metadata["sim_length"] for p in src if p.prompt_id == pid)
        assert sum(c.n_tokens for c in cs) == want and cs[-1].finish_reason == "stop"
    assert ws.summaries[0].simulated and all(
        e.labels["simulated"] == "true" for e in events(cfg, "gen_stats")
    )


@pytest.mark.parametrize("pool_liveness", [True, False], ids=["pool-epochs", "consumer-group"])
def test_unusable_tasks_are_dead_lettered_and_committed(
    make_cfg: Any, tiny_model: Path, pool_liveness: bool
) -> None:
    # both intakes: the pool's epochs (the default) and the classic consumer group
    cfg = gen_cfg(make_cfg, tiny_model, idle_exit_s=3.0, pool_liveness=pool_liveness)
    layout = Layout.from_config(cfg)
    create_topics(cfg)
    topic = layout.prompts("le256")
    bad_meta = PromptTask(
        task_id="k1",
        prompt_id="m",
        prompt="x",
        group_size=1,
        max_new_tokens=5,
        bucket="le256",
        metadata="[1, 2]",
    )
    too_long = PromptTask(
        task_id="k2",
        prompt_id="l",
        prompt="y" * 2000,
        group_size=1,
        max_new_tokens=5,
        bucket="le256",
    )
    good = PromptTask(
        task_id="k3", prompt_id="g", prompt="fine", group_size=2, max_new_tokens=20, bucket="le256"
    )
    with Producer(cfg, "test") as p:
        for value in (b"garbage", encode(bad_meta), encode(too_long), encode(good)):
            p.produce(topic, value, key=b"k", partition=0)
    t = Trajectories(cfg)
    s = run_generator(cfg)  # exits after idle_exit_s
    t.wait(lambda t: len(t.complete()) == 2)
    assert (s.dead_letters, s.tasks) == (3, 1)
    dlq = TopicReader(cfg, layout.dlq)
    for _ in range(5):
        dlq.poll()
    reasons = sorted(dict(m.headers())["srl.reason"].decode() for _, _, m in dlq.records)
    dlq.close()
    assert len(reasons) == 3
    assert any("not an srl record" in r for r in reasons) and any(
        "metadata is not a JSON object" in r for r in reasons
    )
    assert any("positions" in r for r in reasons)
    assert committed_offsets(cfg, cfg.consumer_group, [(topic, 0)])[(topic, 0)] == 4


def test_generate_config_errors_are_one_line(make_cfg: Any) -> None:
    from srl.errors import ConfigError

    with pytest.raises(ConfigError, match="engine hf needs --model DIR"):
        make_cfg(GenerateConfig)


def test_a_worker_whose_producer_failed_starts_over_in_its_process_and_resumes(
    make_cfg: Any, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 18 (``srl chaos`` broker-restart): a broker that lost what a generator's producer
    had written fails that producer for good. The worker exited and was restarted (imports,
    the engine: minutes for a large vLLM model); now it drops its engine's requests, leaves
    its pool and joins again in its own process, with the same engine. Its tasks were never
    committed: they come back and resume from their published prefixes, each sample complete
    exactly once. The failure is injected mid-trajectory, where the worker checks its
    producer."""
    from producers import worker as worker_mod

    cfg = gen_cfg(make_cfg, tiny_model, max_batch=2, chunk_tokens=8, worker_id="so")
    dcfg = make_cfg(
        DispatchConfig, prompts="unused.jsonl", group_size=2, max_new_tokens=120, temperature=0.7
    )
    create_topics(cfg)
    t = Trajectories(cfg)
    real = worker_mod.GeneratorWorker._guard
    failed: list[int] = []

    def failing(self: Any) -> None:
        if not failed and self.summary.chunks >= 3 and self.engine.running:
            failed.append(self.summary.chunks)
            raise ProducerFailed("the producer to the test broker failed for good: injected")
        real(self)

    monkeypatch.setattr(worker_mod.GeneratorWorker, "_guard", failing)
    with workers(cfg, no_eos=True) as ws:
        run_dispatcher(dcfg, prompts(2), BaselinePredictor(10))
        t.wait(lambda t: len(t.complete()) == 4, ws)
    assert failed, "the failure was never injected"
    check_exactly_once(t, {(f"p{i}", s) for i in range(2) for s in range(2)})
    s = ws.summaries[0]  # the second run's
    assert s.resumed > 0 and s.trajectories == 4 - s.skipped_complete, s
    t.reader.close()


def test_a_prompt_too_long_for_the_context_is_dead_lettered_at_dispatch(
    make_cfg: Any, tiny_model: Path
) -> None:
    """Counted with the generators' tokenizer; a prompt whose tokens + max_new_tokens exceed
    the context goes to the DLQ with the reason and never becomes a task."""
    from tests.chunks import read_topic

    dcfg = make_cfg(
        DispatchConfig,
        prompts="unused.jsonl",
        group_size=1,
        max_new_tokens=32,
        tokenizer=str(tiny_model),
        context_tokens=96,
    ).model_copy(update={"max_staleness": None})
    create_topics(dcfg)
    src = prompts(4) + [SourcePrompt("long", "word " * 500, {})]
    summary = run_dispatcher(dcfg, src, BaselinePredictor(100))
    assert summary.too_long == 1 and summary.tasks == 4, summary
    layout = Layout.from_config(dcfg)
    tasks = [
        decode_as(m.value(), PromptTask)
        for b in layout.buckets
        for m in read_topic(dcfg, layout.prompts(b))
    ]
    assert sorted(t.prompt_id for t in tasks) == ["p0", "p1", "p2", "p3"]
    (dead,) = read_topic(dcfg, layout.dlq)
    reason = dict(dead.headers())["srl.reason"].decode()
    assert dead.key() == b"long" and "prompt too long" in reason and "context of 96" in reason
    assert orjson.loads(dead.value())["prompt"] == "word " * 500


def test_a_chat_templated_source_is_generated_from_its_rendered_ids(
    make_cfg: Any, tiny_model: Path, tmp_path: Path
) -> None:
    """--chat-template at dispatch: each row rendered by the tokenizer's template, the task
    carrying the ids, which the worker prefills as they are (seq 0's prompt tokens), with the
    mapped answer in the metadata (the reward's); a row that fits as text but not rendered
    (the system prompt and the template's tokens) goes to the DLQ."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from app.sources import load_source
    from schemas.records import unpack_tokens
    from tests.chat import with_chat_template
    from tests.chunks import read_topic

    model = with_chat_template(tiny_model, tmp_path / "chat-model")
    questions = {"q0": "2+2?", "q1": "3+3?", "long": "y" * 40}
    f = tmp_path / "gsm.parquet"
    pq.write_table(
        pa.table(
            {
                "id": list(questions),
                "question": [[{"role": "user", "content": q}] for q in questions.values()],
                "solution": ["#### 4", "#### 6", "#### 0"],
            }
        ),
        f,
    )
    dcfg = make_cfg(
        DispatchConfig,
        prompts=str(f),
        prompt_field="question",
        id_field="id",
        answer_field="solution",
        chat_template=True,
        system_prompt="Think.",
        tokenizer=str(model),
        context_tokens=96,
        group_size=1,
        max_new_tokens=16,
    ).model_copy(update={"max_staleness": None})
    create_topics(dcfg)
    src = load_source(dcfg)
    rendered = {p.prompt_id: list(p.prompt_tokens or ()) for p in src}  # type: ignore[attr-defined]
    assert len(rendered["q1"]) <= 96 - 16 < len(rendered["long"])  # 40 tokens as text
    t = Trajectories(dcfg)
    with workers(gen_cfg(make_cfg, model)) as ws:
        summary = run_dispatcher(dcfg, src, BaselinePredictor(10))
        t.wait(lambda t: len(t.complete()) == 2, ws)
    assert summary.too_long == 1 and summary.tasks == 2, summary
    by_sample = check_exactly_once(t, {("q0", 0), ("q1", 0)})
    for (pid, _), cs in by_sample.items():
        assert cs[0].prompt_tokens is not None
        assert unpack_tokens(cs[0].prompt_tokens).tolist() == rendered[pid]
        assert orjson.loads(cs[0].metadata or "{}")["answer"] == f"#### {int(pid[1]) * 2 + 4}"
    (dead,) = read_topic(dcfg, Layout.from_config(dcfg).dlq)
    reason = dict(dead.headers())["srl.reason"].decode()
    assert dead.key() == b"long" and f"{len(rendered['long'])} tokens" in reason, reason
    t.reader.close()
