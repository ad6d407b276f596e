"""``app.serve.publish``: served choices as trajectory chunks, cut exactly as the generator's
chunker cuts them token by token."""

from __future__ import annotations

import random
from typing import Any

import orjson
import pytest

from app.serve.jobs import Job
from app.serve.protocol import Sampling
from app.serve.publish import Publisher, serve_metadata, trajectory_start
from producers.chunker import Chunker
from schemas.records import TrajectoryChunk
from srl.topics import Layout
from tests.unit.test_serve_app import FakeProducer

LAYOUT = Layout(prefix="t")


def comparable(c: TrajectoryChunk) -> dict[str, Any]:
    d = c.to_dict()
    d.pop("created_ms")
    d.pop("started_ms")
    return d


@pytest.mark.parametrize("seed", range(6))
def test_buffered_publishing_cuts_the_chunks_token_by_token_would(seed: int) -> None:
    rng = random.Random(seed)
    job = Job("cmpl-x", "completion", [1, 2], Sampling(max_tokens=300, n=2))
    producer = FakeProducer()
    pub = Publisher(producer, LAYOUT, 5, "w")  # type: ignore[arg-type]
    ref = Chunker(5, "w")
    expected: list[TrajectoryChunk] = []
    tids = ["a", "b"]
    for i, tid in enumerate(tids):
        pub.open(job, i, tid)
        ref.open(trajectory_start(job, i, tid, LAYOUT))
    version, live, finished = 0, list(tids), 0
    while live:
        tid = rng.choice(live)
        if rng.random() < 0.03:  # a weight swap: open chunks first, then the new version
            pub.flush_open()
            expected += ref.flush_all()
            version += 1
            continue
        n = rng.choice([1, 1, 1, 2, 7])
        toks = [rng.randrange(4, 200) for _ in range(n)]
        lps = [-rng.random() for _ in range(n)]
        finish = rng.choice(["stop", "length", "abort"]) if rng.random() < 0.02 else None
        pub.add(tid, toks, lps, version, finish)
        for k, (t, lp) in enumerate(zip(toks, lps, strict=True)):  # the finish on the last
            expected += ref.add(tid, [t], [lp], version, finish if k == n - 1 else None)
        if finish is not None:
            live.remove(tid)
            finished += finish != "abort"
    got = producer.chunks()
    for tid in tids:
        mine = [comparable(c) for c in got if c.trajectory_id == tid]
        theirs = [comparable(c) for c in expected if c.trajectory_id == tid]
        assert mine == theirs
    assert pub.chunks == len(got) == len(expected)
    assert pub.trajectories == finished  # aborted ones are published, not counted


def test_abort_before_any_token_is_an_empty_last_chunk_of_the_current_version() -> None:
    producer = FakeProducer()
    pub = Publisher(producer, LAYOUT, 4, "w")  # type: ignore[arg-type]
    pub.open(Job("c", "chat", [1], Sampling(10)), 0, "t0")
    pub.add("t0", [], [], 3, "abort")
    (c,) = producer.chunks()
    assert (c.seq, c.n_tokens, c.is_last, c.finish_reason, c.policy_version) == (
        0,
        0,
        True,
        "abort",
        3,
    )


def test_publishing_off_does_nothing() -> None:
    pub = Publisher(None, LAYOUT, 4, "w")
    pub.open(Job("c", "chat", [1], Sampling(10)), 0, "t0")
    pub.add("t0", [5], [-1.0], 0, "stop")
    pub.flush_open()
    assert (pub.enabled, pub.chunks, pub.failures) == (False, 0, 0)


@pytest.mark.parametrize(
    ("max_tokens", "bucket"), [(1, "le256"), (256, "le256"), (257, "le1024"), (5000, "gt4096")]
)
def test_trajectory_start(max_tokens: int, bucket: str) -> None:
    job = Job("cmpl-9", "completion", [7, 8], Sampling(max_tokens, n=4), {"user": "u"})
    s = trajectory_start(job, 2, "tid", LAYOUT)
    assert (s.prompt_id, s.task_id, s.sample_index, s.group_size, s.bucket) == (
        "cmpl-9",
        "cmpl-9",
        2,
        4,
        bucket,
    )
    assert orjson.loads(s.metadata or "") == {
        "source": "serve",
        "completion_id": "cmpl-9",
        "request": {"user": "u"},
    }
    assert s.metadata == serve_metadata("cmpl-9", {"user": "u"})
