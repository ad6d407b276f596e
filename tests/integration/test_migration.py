"""Long-tail migration on the real broker: a straggler of the regular pool moves, by prefix, to
the long-tail pool and completes exactly once (issue 6, "Migration").

Two generator workers (sim engine, threads): the regular pool consumes the first length
bucket with ``migrate_to`` = the last bucket; the long-tail pool consumes the last bucket.
Tasks carry a predicted length and an oracle ``sim_length``; one sample group runs far past
its prediction. Then a third worker in a fresh group takes every task again from offset 0
(as after a crash before the regular pool committed): it must publish nothing.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import orjson

from consumers.assembler import Assembler
from schemas.records import MIGRATED, PromptTask, encode, pack_tokens
from srl.kafka import Producer, committed_offsets, create_topics, watermarks
from srl.topics import Layout
from tests.chunks import sim_generate_cfg
from tests.integration.test_generation import Trajectories, events, workers

STRAGGLER = 240  # tokens a straggler really needs; predicted: 20 → migrates after 41


def _task(layout: Layout, bucket: str, i: int, predicted: int, length: int) -> PromptTask:
    return PromptTask(
        task_id=uuid.uuid4().hex,
        prompt_id=f"p{i}",
        prompt=f"prompt {i}",
        group_size=2,
        max_new_tokens=512,
        bucket=bucket,
        prompt_tokens=pack_tokens([5, 6, 7 + i]),
        predicted_length=predicted,
        metadata=orjson.dumps({"sim_length": length}).decode(),
    )


def test_a_straggler_moves_to_the_long_tail_pool_and_completes_exactly_once(
    make_cfg: Any, tmp_path: Path
) -> None:
    regular_cfg = sim_generate_cfg(make_cfg, pool="regular", worker_id="reg")
    layout = Layout.from_config(regular_cfg)
    first, last = layout.buckets[0], layout.buckets[-1]
    regular_cfg = regular_cfg.model_copy(
        update={"buckets": (first,), "migrate_to": last, "migrate_min_tokens": 16}
    )
    # the long-tail pool is over its trainer-backlog bound all along (no trainer consumes):
    # fresh tasks wait, resume tasks (trajectories in flight) must not
    longtail_cfg = sim_generate_cfg(
        make_cfg, pool="longtail", worker_id="lt", buckets=(last,), max_backlog_chunks=1
    )
    create_topics(regular_cfg)
    # p0: both samples are stragglers; p1–p3 finish near their prediction
    tasks = [_task(layout, first, 0, 20, STRAGGLER)] + [
        _task(layout, first, i, 40, 30 + 5 * i) for i in range(1, 4)
    ]
    want = {t.prompt_id: orjson.loads(t.metadata or "")["sim_length"] for t in tasks}
    t = Trajectories(regular_cfg)
    with workers(regular_cfg, longtail_cfg) as ws:
        with Producer(regular_cfg, "test-dispatcher") as p:
            for task in tasks[1:]:  # first the short ones: their chunks put the backlog over 1
                p.produce(layout.prompts(first), encode(task), key=task.prompt_id)
            p.flush()
            t.wait(lambda t: len(t.complete()) == 6, ws)
            time.sleep(2.5)  # the long-tail worker has seen its backlog over the bound
            p.produce(layout.prompts(first), encode(tasks[0]), key=tasks[0].prompt_id)
        t.wait(lambda t: len(t.complete()) == 8, ws)
        time.sleep(1.0)  # let both pools commit
    by_worker = {s.worker_id: s for s in ws.summaries}
    assert by_worker["reg"].migrated == 2 and by_worker["lt"].migrated == 0, by_worker
    assert t.duplicates == 0

    done = t.complete()
    assert len(done) == 8
    assembler = Assembler(finalized=set())
    for tid, cs in done.items():
        pid, sample = cs[0].prompt_id, cs[0].sample_index
        assert [c.seq for c in cs] == list(range(len(cs)))
        offset = 0
        for c in cs:
            assert c.token_offset == offset
            offset += c.n_tokens
        assert offset == want[pid], (pid, sample, offset)
        assert cs[-1].finish_reason == "stop"
        handoffs = [c for c in cs if c.finish_reason == MIGRATED]
        if pid == "p0":  # the straggler: one hand-off chunk, regular before it, long-tail after
            (h,) = handoffs
            assert not h.is_last and h.worker_id == "reg" and h.bucket == first
            assert {c.worker_id for c in cs[: h.seq + 1]} == {"reg"}
            assert {c.worker_id for c in cs[h.seq + 1 :]} == {"lt"}
            assert {c.bucket for c in cs[h.seq + 1 :]} == {last}
            assert 41 <= h.token_offset + h.n_tokens < STRAGGLER  # moved past 2 x 20, early
        else:
            assert not handoffs and {c.worker_id for c in cs} == {"reg"}
        # the trainer's assembler stitches it into one trajectory of the full length
        traj = None
        for c in cs:
            traj = assembler.add(c) or traj
        assert traj is not None and traj.n_tokens == want[pid] and traj.trajectory_id == tid

    # both pools committed every task, the resume tasks on the long-tail topic included
    hw = watermarks(regular_cfg, [layout.prompts(first), layout.resumes(last)])
    assert sum(high for (topic, _), (_lo, high) in hw.items() if topic == layout.resumes(last)) == 2
    for cfg in (regular_cfg, longtail_cfg):
        topics = [t for b in cfg.buckets for t in (layout.prompts(b), layout.resumes(b))]
        mine = {tp: v for tp, v in hw.items() if tp[0] in topics}
        got = committed_offsets(cfg, cfg.consumer_group, list(mine))
        assert all((got[tp] or 0) == high for tp, (_lo, high) in mine.items()), (got, mine)
    moved = events(regular_cfg, "migrated")
    assert len(moved) == 2 and all(e.labels["to"] == last for e in moved)
    lt_stats = [e for e in events(regular_cfg, "gen_stats") if e.labels["worker_id"] == "lt"]
    assert any(e.values["paused"] == 1 and e.values["backlog"] > 1 for e in lt_stats)

    # redelivery: a fresh group re-reads every regular task; nothing is generated twice
    again = regular_cfg.model_copy(
        update={
            "group_id": f"again-{uuid.uuid4().hex[:6]}",
            "worker_id": "again",
            "idle_exit_s": 3.0,
        }
    )
    with workers(again) as ws2:
        deadline = time.monotonic() + 60
        while len(ws2.summaries) < 1 and time.monotonic() < deadline:
            time.sleep(0.5)
    (s,) = ws2.summaries
    assert s.skipped_complete == 8 and s.trajectories == 0 and s.migrated == 0, s
    t.poll()
    assert t.duplicates == 0 and len(t.complete()) == 8
    assert not any(c.worker_id == "again" for tid in t.chunks for c in t.ordered(tid))
    t.reader.close()
