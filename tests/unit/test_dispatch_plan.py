"""Dispatcher planning, prompt sources and the length predictors (no Kafka)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest

from app.sources import load_source
from producers.config import DispatchConfig
from producers.dispatch_log import Published, Stamp
from producers.dispatcher import plan_window, windows
from producers.recovery import trajectory_id_for
from producers.sources import SourcePrompt, make_predictor, read_jsonl, sim_prompts
from ranker.predictor import BaselinePredictor, LengthPredictor, OraclePredictor
from srl.config import load_config
from srl.data import STREAMRL_LENGTHS
from srl.errors import ConfigError
from srl.topics import Layout
from srl.workload import LengthHistogram
from tests.chunks import traj_chunks

HIST = str(STREAMRL_LENGTHS)


def cfg(**kw) -> DispatchConfig:  # type: ignore[no-untyped-def]
    return load_config(DispatchConfig, cli={"task": "sim", "lengths": HIST, **kw}, env={})


def test_tasks_are_bucketed_by_prediction_and_longest_first_across_buckets() -> None:
    layout = Layout(bucket_bounds=(100, 1000))
    prompts = [SourcePrompt(f"p{i}", f"text {i}", {"i": i} if i % 2 else {}) for i in range(6)]
    preds = np.array([50, 2000, 90, 500, 10, 700])
    tasks = plan_window(
        prompts, preds, layout, cfg(group_size=3, temperature=0.5), ranker_version=7
    )
    assert [(t.bucket, t.prompt_id) for t in tasks] == [
        ("gt1000", "p1"),
        ("le1000", "p5"),
        ("le1000", "p3"),
        ("le100", "p2"),
        ("le100", "p0"),
        ("le100", "p4"),
    ]
    t = next(t for t in tasks if t.prompt_id == "p3")
    assert (t.group_size, t.predicted_length, t.ranker_version, t.temperature) == (3, 500, 7, 0.5)
    assert orjson.loads(t.metadata or "") == {"i": 3}
    assert next(t for t in tasks if t.prompt_id == "p0").metadata is None
    assert len({t.task_id for t in tasks}) == 6


def test_ranker_dispatch_sends_the_top_alpha_to_the_long_tail_bucket() -> None:
    layout = Layout(bucket_bounds=(16, 32))
    prompts = [SourcePrompt(f"p{i}", f"text {i}", {}) for i in range(10)]
    preds = np.array([5, 40, 9, 12, 30, 7, 20, 3, 8, 60])  # 60 and 40 are the top 20 %
    tasks = plan_window(prompts, preds, layout, cfg(predictor="ranker", alpha=0.2))
    by_id = {t.prompt_id: t.bucket for t in tasks}
    assert {p for p, b in by_id.items() if b == "gt32"} == {"p1", "p9"}
    assert by_id["p4"] == "le32" and by_id["p6"] == "le32" and by_id["p0"] == "le16"
    # a long prediction outside the top alpha stays on the regular pool's last bucket
    tasks = plan_window(prompts, preds, layout, cfg(predictor="ranker", alpha=0.1))
    assert {t.prompt_id: t.bucket for t in tasks}["p1"] == "le32"
    with pytest.raises(ValueError, match="unknown bucket"):
        plan_window(prompts, preds, layout, cfg(predictor="ranker", longtail_bucket="le99"))


def test_windows_cover_the_source_in_order() -> None:
    assert [len(w) for w in windows(range(7), 3)] == [3, 3, 1]  # type: ignore[arg-type]


def test_jsonl_source_and_its_errors(tmp_path: Path) -> None:
    f = tmp_path / "p.jsonl"
    f.write_text(
        '{"prompt_id": "a", "prompt": "2+2=", "metadata": {"answer": "4"}}\n\n{"prompt_id": "b", '
        '"prompt": "x"}\n'
    )
    assert read_jsonl(f) == [SourcePrompt("a", "2+2=", {"answer": "4"}), SourcePrompt("b", "x", {})]
    for line, why in [
        ("not json", "p.jsonl:1: not JSON"),
        ('{"prompt_id": "", "prompt": "x"}', "prompt_id must be"),
        ('{"prompt_id": "a", "prompt": 3}', "prompt must be a string"),
        ('{"prompt_id": "a", "prompt": "x", "metadata": [1]}', "metadata must be a JSON object"),
        (
            '{"prompt_id": "a", "prompt": "x"}\n{"prompt_id": "a", "prompt": "y"}',
            "p.jsonl:2: duplicate",
        ),
    ]:
        f.write_text(line + "\n")
        with pytest.raises(ConfigError, match=why):
            read_jsonl(f)


def test_sim_source_carries_oracle_lengths_for_the_oracle_predictor() -> None:
    c = cfg(num_prompts=50, length_scale=0.25, predictor="oracle")
    prompts = load_source(c)
    assert len(prompts) == 50 and all(70 <= p.metadata["sim_length"] <= 5000 for p in prompts)
    predictor = make_predictor(c, prompts)
    assert isinstance(predictor, LengthPredictor) and predictor.version is None
    assert predictor.predict([p.text for p in prompts]).tolist() == [
        p.metadata["sim_length"] for p in prompts
    ]
    assert sim_prompts(3, LengthHistogram.from_file(HIST), seed=1) == sim_prompts(
        3, LengthHistogram.from_file(HIST), seed=1
    )


def test_predictors() -> None:
    assert BaselinePredictor(64).predict(["a", "b"]).tolist() == [64, 64]
    assert OraclePredictor({"a": 5}, 9).predict(["a", "b"]).tolist() == [5, 9]
    with pytest.raises(ConfigError, match="no prompt carries"):
        make_predictor(cfg(predictor="oracle"), [SourcePrompt("a", "x")])


def test_dispatch_config_needs_exactly_one_source() -> None:
    with pytest.raises(ConfigError, match="exactly one prompt source"):
        load_config(DispatchConfig, cli={}, env={})
    with pytest.raises(ConfigError, match="needs --lengths"):
        load_config(DispatchConfig, cli={"task": "sim"}, env={})


def test_each_epoch_gets_its_own_prompt_ids_so_groups_never_merge() -> None:
    layout = Layout(bucket_bounds=(100,))
    prompts = [SourcePrompt(f"p{i}", f"text {i}", {}) for i in range(3)]
    preds = np.array([10, 20, 30])
    ids = [
        {t.prompt_id for t in plan_window(prompts, preds, layout, cfg(), epoch=e)} for e in range(3)
    ]
    assert ids[0] == {"p0", "p1", "p2"}
    assert ids[1] == {"p0.e1", "p1.e1", "p2.e1"}
    assert ids[2] == {"p0.e2", "p1.e2", "p2.e2"}


def test_what_a_previous_dispatcher_published_is_skipped_and_its_window_kept_in_its_step() -> None:
    layout = Layout(bucket_bounds=(100, 1000))
    c = cfg(group_size=4, tasks_per_group=2, run="r")
    window = [SourcePrompt(f"p{i}", f"text {i}") for i in range(3)]
    tasks = plan_window(window, np.array([50, 60, 70]), layout, c)
    assert {t.run for t in tasks} == {"r"} and len(tasks) == 6  # two tasks per group
    log = Published()
    assert log.rest(tasks) == (tasks, None)  # nothing went out: a new step
    for t in tasks[:3]:  # the previous dispatcher died after three tasks of step 5
        log.add(dataclasses.replace(t, step=5, step_groups=3, min_version=2))
    again = plan_window(window, np.array([50, 60, 70]), layout, c)  # new task ids, same keys
    todo, stamp = log.rest(again)
    assert [(t.prompt_id, t.sample_indices) for t in todo] == [
        (t.prompt_id, t.sample_indices) for t in tasks[3:]
    ]
    assert stamp == Stamp(5, 3, 2) and log.last_step == 5
    for t in todo:
        log.add(dataclasses.replace(t, step=5, step_groups=3, min_version=2))
    assert log.rest(again) == ([], Stamp(5, 3, 2))  # all of it went out


def test_task_ids_are_the_same_when_the_same_window_is_planned_again() -> None:
    """A task sent again (its record forgotten by a broker that was SIGKILLed) must carry the
    same id, so its samples keep their trajectory ids; uuid4 ids gave the copy new ones, and
    the trainer trained those samples twice (``srl chaos`` broker-restart)."""
    layout = Layout(bucket_bounds=(100, 1000))
    window = [SourcePrompt(f"p{i}", f"text {i}") for i in range(3)]
    preds = np.array([50, 60, 700])

    def ids(**kw: Any) -> list[str]:
        c = cfg(group_size=4, tasks_per_group=2, run=kw.pop("run", "r"))
        return sorted(t.task_id for t in plan_window(window, preds, layout, c, **kw))

    assert ids() == ids() and len(set(ids())) == 6  # two tasks per group, each its own id
    assert not set(ids()) & set(ids(run="other")) and not set(ids()) & set(ids(epoch=1))
    assert ids() == ids(ranker_version=3)  # what is predicted does not name the work


def test_a_task_generated_but_forgotten_by_the_broker_is_not_sent_again() -> None:
    """The broker forgot the newest tasks' records, but workers had read and generated them:
    their complete trajectories on the topic (same task ids) count as published, in the step
    their seq 0 chunks carry; a task started but unfinished goes out again."""
    layout = Layout(bucket_bounds=(100, 1000))
    c = cfg(group_size=2, run="r")
    window = [SourcePrompt(f"p{i}", f"text {i}") for i in range(3)]
    tasks = plan_window(window, np.array([50, 60, 70]), layout, c)
    log = Published()
    log.add(dataclasses.replace(tasks[0], step=4, step_groups=3, min_version=3))  # kept
    done, started = tasks[1], tasks[2]
    for t, finished in ((done, True), (started, False)):
        for i in t.samples():
            tid = trajectory_id_for(t.task_id, i)
            cs = traj_chunks(t.prompt_id, i, 2, [1], [5, 6, 7], chunk_tokens=2, trajectory_id=tid)
            cs = [dataclasses.replace(x, task_id=t.task_id, step=4, step_groups=3) for x in cs]
            [log.chunk(x) for x in (cs if finished else cs[:1])]
    again = plan_window(window, np.array([50, 60, 70]), layout, c)
    todo, stamp = log.rest(again)
    assert [t.task_id for t in todo] == [started.task_id]
    assert stamp == Stamp(4, 3, 3)
    alone = Published()  # a whole window known from its trajectories alone
    for i in done.samples():
        tid = trajectory_id_for(done.task_id, i)
        for x in traj_chunks(done.prompt_id, i, 2, [1], [5], trajectory_id=tid):
            alone.chunk(dataclasses.replace(x, task_id=done.task_id, step=6, step_groups=1))
    assert alone.rest([done]) == ([], Stamp(6, 1, 0)) and alone.held() == {6}
