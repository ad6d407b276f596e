"""A dispatcher killed and restarted (issue 18): no prompt lost, none dispatched twice into a step.

The prompt topics are the dispatcher's log (``producers.dispatch_log``). Two faults, each
followed by a restart the ordinary way on the same source:

* the dispatcher dies in the middle of a window (its producer fails after six tasks: one
  whole step and half of the next went out): the restart completes that step's window in the
  same step, with the same ``step_groups`` and ``min_version``, and numbers the next window
  after it;
* ``srl-producer dispatch`` is SIGKILLed while it waits for the trainer to release a step;
  the restart publishes the steps still to come, after the ones already out.

Before the restart learnt to read its run's tasks back it numbered from the newest announced
step + 1 and sent the whole source again: every prompt twice, into steps that already had
their groups.
"""

from __future__ import annotations

import dataclasses
import signal
import subprocess
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import orjson
import pytest
import torch

from producers.config import DispatchConfig
from producers.dispatch_log import read_published
from producers.dispatcher import Announcements, Windows, plan_window, run_dispatcher
from producers.recovery import trajectory_id_for
from producers.sources import SourcePrompt
from ranker.predictor import BaselinePredictor
from schemas.records import PromptTask, decode_as, encode
from srl.config import CommonConfig, load_config
from srl.kafka import Producer, create_topics, read_range
from srl.stores import store_from_config
from srl.topics import Layout
from srl.weights import announce, publish
from tests.chunks import traj_chunks
from tests.conftest import bin_path


def prompts(n: int) -> list[SourcePrompt]:
    return [SourcePrompt(f"p{i}", f"question {i}?") for i in range(n)]


def tasks_of(cfg: CommonConfig) -> list[PromptTask]:
    layout = Layout.from_config(cfg)
    out = []
    for b in layout.buckets:
        for msg in read_range(cfg, layout.prompts(b), timeout_s=30):
            out.append(decode_as(msg.value() or b"", PromptTask))
    return out


def announce_step(cfg: CommonConfig, step: int) -> None:
    """What the trainer publishes and announces after its step ``step`` (version ``step``; the
    dispatcher takes only an announcement whose manifest verifies)."""
    published = publish(
        store_from_config(cfg),
        cfg.run,
        step,
        {"w": torch.zeros(1)},
        trainer_step=step,
        parent_version=step - 1,
    )
    with Producer(cfg, "test") as p:
        announce(p, Layout.from_config(cfg), published)


def check_steps(tasks: list[PromptTask], n_prompts: int, per_step: int) -> dict[int, set[str]]:
    """Every prompt exactly once, each step exactly its ``step_groups`` prompts, one stamp."""
    count = Counter(t.prompt_id for t in tasks)
    assert count == {f"p{i}": 1 for i in range(n_prompts)}, count
    steps: dict[int, set[str]] = defaultdict(set)
    stamps: dict[int, set[tuple[Any, ...]]] = defaultdict(set)
    for t in tasks:
        assert t.step is not None
        steps[t.step].add(t.prompt_id)
        stamps[t.step].add((t.step_groups, t.min_version))
    assert {s: len(p) for s, p in steps.items()} == {
        s + 1: per_step for s in range(n_prompts // per_step)
    }
    assert all(len(v) == 1 and next(iter(v))[0] == per_step for v in stamps.values()), stamps
    return steps


class Died(RuntimeError):
    pass


class DyingProducer(Producer):
    """Publishes ``left`` records, then dies (the records produced so far still go out)."""

    def __init__(self, cfg: DispatchConfig, left: int) -> None:
        super().__init__(cfg, "dispatcher")
        self.left = left

    def produce(self, *args: Any, **kw: Any) -> None:
        if self.left == 0:
            raise Died("SIGKILL")
        self.left -= 1
        super().produce(*args, **kw)


def test_a_dispatcher_dead_mid_window_is_completed_in_the_same_step(make_cfg: Any) -> None:
    dcfg = make_cfg(
        DispatchConfig, prompts="unused.jsonl", group_size=2, groups_per_step=4, max_staleness=1
    )
    layout = Layout.from_config(dcfg)
    create_topics(dcfg)
    stop = threading.Event()
    with pytest.raises(Died), DyingProducer(dcfg, left=6) as producer:
        anns = Announcements(dcfg, layout, producer)
        published = read_published(dcfg, layout, dcfg.run)
        Windows(dcfg, layout, producer, BaselinePredictor(10), stop, published=published).paced(
            prompts(12), anns, 1
        )
    anns.close()
    assert Counter(t.step for t in tasks_of(dcfg)) == {1: 4, 2: 2}  # died inside step 2
    announce_step(dcfg, 1)  # the trainer moved on meanwhile: step 3 may go out
    summary = run_dispatcher(dcfg, prompts(12), BaselinePredictor(10))
    assert (summary.skipped, summary.tasks, summary.first_step) == (6, 6, 3)
    steps = check_steps(tasks_of(dcfg), 12, 4)
    assert steps[2] == {"p4", "p5", "p6", "p7"}  # the window, not the next prompts


@pytest.mark.slow
def test_a_sigkilled_dispatcher_restarted_resumes_after_what_it_published(
    cli_env: dict[str, str], tmp_path: Path
) -> None:
    cfg = load_config(CommonConfig, env={k: v for k, v in cli_env.items() if k.startswith("SRL_")})
    (tmp_path / "p.jsonl").write_text(
        "".join(
            orjson.dumps({"prompt_id": p.prompt_id, "prompt": p.text}).decode() + "\n"
            for p in prompts(16)
        )
    )
    args = [
        bin_path("srl-producer"),
        "dispatch",
        "--prompts",
        str(tmp_path / "p.jsonl"),
        "--groups-per-step",
        "4",
        "--max-staleness",
        "1",
        "--group-size",
        "2",
    ]
    log = tmp_path / "d1.log"
    with open(log, "w") as out:
        first = subprocess.Popen(args, env=cli_env, stdout=out, stderr=subprocess.STDOUT)
    try:  # steps 1 and 2 go out at once; step 3 waits for the trainer's step 1
        deadline = time.monotonic() + 60
        while len(tasks_of(cfg)) < 8:
            assert time.monotonic() < deadline and first.poll() is None, log.read_text()
            time.sleep(0.5)
        first.send_signal(signal.SIGKILL)
        assert first.wait(timeout=10) == -signal.SIGKILL
    finally:
        if first.poll() is None:
            first.kill()
    announce_step(cfg, 1)
    announce_step(cfg, 2)  # both remaining steps may go out now
    restarted = subprocess.run(args, env=cli_env, capture_output=True, text=True, timeout=120)
    assert restarted.returncode == 0, restarted.stderr
    assert "8 tasks already published (newest step 2)" in restarted.stderr
    assert "dispatched 8 tasks" in restarted.stdout and "8 published before" in restarted.stdout
    check_steps(tasks_of(cfg), 16, 4)


def test_tasks_the_broker_forgot_after_workers_generated_them_are_not_sent_again(
    make_cfg: Any,
) -> None:
    """A SIGKILLed embedded broker forgets the records it acknowledged in its last ~0.5 s
    (docs/broker.md): here the newest step's tasks, after workers had read them and published
    their trajectories. The restarted dispatcher finds step 1 on the prompt topics and step 2
    only as complete trajectories of its tasks (the same deterministic task ids): it sends
    neither again and numbers the next window 3. Before, it sent step 2's prompts again under
    new task ids, in a new step, and the trainer trained those samples twice (``srl chaos``
    broker-restart: 32 samples)."""
    dcfg = make_cfg(
        DispatchConfig, prompts="unused.jsonl", group_size=2, groups_per_step=2, max_staleness=1
    )
    layout = Layout.from_config(dcfg)
    create_topics(dcfg)
    source, predictor = prompts(6), BaselinePredictor(10)
    planned = [
        plan_window(w, predictor.predict([p.text for p in w]), layout, dcfg)
        for w in (source[0:2], source[2:4])
    ]
    with Producer(dcfg, "test") as p:
        for t in planned[0]:  # step 1: its records survived
            stamped = dataclasses.replace(t, step=1, step_groups=2, min_version=0)
            p.produce(layout.prompts(t.bucket), encode(stamped), key=t.prompt_id)
        for t in planned[1]:  # step 2: records forgotten, trajectories generated
            for i in t.samples():
                tid = trajectory_id_for(t.task_id, i)
                for c in traj_chunks(t.prompt_id, i, 2, [1], [5, 6, 7], trajectory_id=tid):
                    c = dataclasses.replace(c, task_id=t.task_id, step=2, step_groups=2)
                    p.produce(layout.trajectories, encode(c), key=tid)
        p.flush()
    announce_step(dcfg, 1)  # step 3 may go out
    summary = run_dispatcher(dcfg, source, predictor)
    assert (summary.skipped, summary.tasks, summary.first_step) == (4, 2, 3)
    sent = {(t.prompt_id, t.step) for t in tasks_of(dcfg)}
    assert sent == {("p0", 1), ("p1", 1), ("p4", 3), ("p5", 3)}


def step_2_forgotten(make_cfg: Any, started: bool) -> DispatchConfig:
    """Three windows of two prompts; on the topics, steps 1 and 3 (step 2's tasks forgotten
    by the broker), and with ``started`` the first chunk of one of step 2's tasks (not its
    last). A step numbered wrong waits for a trainer step that never comes: 10 s."""
    dcfg = make_cfg(
        DispatchConfig,
        prompts="unused.jsonl",
        group_size=2,
        groups_per_step=2,
        max_staleness=1,
        barrier_timeout_s=10,
    )
    layout = Layout.from_config(dcfg)
    create_topics(dcfg)
    source, predictor = prompts(6), BaselinePredictor(10)
    planned = [
        plan_window(w, predictor.predict([p.text for p in w]), layout, dcfg)
        for w in (source[0:2], source[2:4], source[4:6])
    ]
    with Producer(dcfg, "test") as p:
        for step in (1, 3):
            for t in planned[step - 1]:
                stamped = dataclasses.replace(t, step=step, step_groups=2, min_version=0)
                p.produce(layout.prompts(t.bucket), encode(stamped), key=t.prompt_id)
        if started:
            t = planned[1][1]
            tid = trajectory_id_for(t.task_id, 0)
            first = traj_chunks(t.prompt_id, 0, 2, [1], [5, 6, 7], trajectory_id=tid)[0]
            first = dataclasses.replace(
                first, task_id=t.task_id, step=2, step_groups=2, is_last=False
            )
            p.produce(layout.trajectories, encode(first), key=tid)
        p.flush()
    announce_step(dcfg, 1)  # the trainer waits for step 2
    return dcfg


def test_a_window_the_broker_forgot_whole_goes_out_in_its_own_step(make_cfg: Any) -> None:
    """A SIGKILLed embedded broker forgot step 2's tasks (all on partitions it had not written
    yet) while step 3's, on others, survived, and no worker had started step 2. The restarted
    dispatcher sends window 2 into step 2 again, not after step 3: numbered after the newest
    surviving step, step 2 stayed empty and the trainer waited out its step timeout (``srl
    chaos`` broker-restart, 90 s; the row failed as not recovered)."""
    dcfg = step_2_forgotten(make_cfg, started=False)
    summary = run_dispatcher(dcfg, prompts(6), BaselinePredictor(10))
    assert (summary.skipped, summary.tasks, summary.first_step) == (4, 2, 2)
    steps = check_steps(tasks_of(dcfg), 6, 2)
    assert steps[2] == {"p2", "p3"}


def test_a_started_task_the_broker_forgot_goes_out_again_in_its_step(make_cfg: Any) -> None:
    """Step 2's tasks forgotten (step 3's survived) after a worker had published the first
    chunk of one of them, not its last: the window goes out again in step 2, where the
    trainer waits for it (its chunk says so), not into a new step."""
    dcfg = step_2_forgotten(make_cfg, started=True)
    summary = run_dispatcher(dcfg, prompts(6), BaselinePredictor(10))
    assert (summary.skipped, summary.tasks) == (4, 2)
    steps = check_steps(tasks_of(dcfg), 6, 2)
    assert steps[2] == {"p2", "p3"}
