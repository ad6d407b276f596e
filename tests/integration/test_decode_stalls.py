"""What a generator's decode loop must never wait for (issue 18), with a real sim-engine worker
on the real broker: the trainer's backlog, measured by ``GroupLag`` (about 11 broker round
trips), here made to hang until the test ends; the worker generates and publishes all the
while. (A straggler's migration, the other wait issue 18 removed, is ``tests/unit/
test_outlet.py``'s, with delivery reports the test controls; on the real broker,
``tests/integration/test_migration.py``.)
"""

from __future__ import annotations

import threading
import uuid
from typing import Any

import orjson
import pytest

from producers import worker as worker_module
from producers.backlog import GroupLag
from schemas.records import PromptTask, encode, pack_tokens
from srl.kafka import Producer, create_topics
from srl.topics import Layout
from tests.chunks import sim_generate_cfg
from tests.integration.test_generation import Trajectories, workers


def task(layout: Layout, i: int, length: int, predicted: int | None = None) -> PromptTask:
    return PromptTask(
        task_id=uuid.uuid4().hex,
        prompt_id=f"p{i}",
        prompt=f"prompt {i}",
        group_size=2,
        max_new_tokens=512,
        bucket=layout.buckets[0],
        prompt_tokens=pack_tokens([5, 6, 7 + i]),
        predicted_length=predicted,
        metadata=orjson.dumps({"sim_length": length}).decode(),
    )


class HangingLag(GroupLag):
    """A real ``GroupLag`` whose every call hangs until ``release`` is set."""

    release = threading.Event()
    calls = 0

    def lag(self) -> int:
        type(self).calls += 1
        self.release.wait()
        return super().lag()


def test_the_decode_loop_goes_on_while_the_backlog_measurement_hangs(
    make_cfg: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = sim_generate_cfg(make_cfg, max_backlog_chunks=1000, worker_id="w")
    layout = Layout.from_config(cfg)
    create_topics(cfg)
    monkeypatch.setattr(worker_module, "GroupLag", HangingLag)
    HangingLag.release.clear()
    t = Trajectories(cfg)
    try:
        with workers(cfg) as ws:
            with Producer(cfg, "test-dispatcher") as p:
                for i in range(3):
                    tk = task(layout, i, 40)
                    p.produce(layout.prompts(tk.bucket), encode(tk), key=tk.prompt_id)
            # every sample generated and published while the one measurement hangs
            t.wait(lambda t: len(t.complete()) == 6, ws, timeout_s=60)
            assert HangingLag.calls == 1
            HangingLag.release.set()  # the worker's exit waits for its measuring thread
    finally:
        HangingLag.release.set()
        t.reader.close()
    assert ws.summaries[0].trajectories == 6
