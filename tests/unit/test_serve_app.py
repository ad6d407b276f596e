"""``srl serve`` in process, without Kafka: the FastAPI app over the sim engine, with a
hand-written producer that keeps what is published, and the engine thread on its own
(cancel, weights swaps, failures)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import orjson
import pytest
from fastapi.testclient import TestClient

from app.serve.core import ServeEngine
from app.serve.http import ServeInfo, create_app
from app.serve.jobs import Accepted, Delta, Event, Failed, Finished, Job
from app.serve.protocol import Sampling
from app.serve.publish import Publisher
from app.serve.text import codec_for
from producers.engines.base import Emitted
from producers.engines.sim import SimEngine
from producers.follower import Ready, WeightFollower
from schemas.records import TrajectoryChunk, decode_as
from srl.topics import Layout

LAYOUT = Layout(prefix="t")


class FakeProducer:
    """What the publisher needs of ``srl.kafka.Producer``; keeps every record."""

    def __init__(self) -> None:
        self.records: list[tuple[str, bytes, Any, int | None]] = []
        self.failed = 0
        self.errors: list[str] = []
        self.refuse: str | None = None  # the error a delivery callback gets (None: delivered)
        # what ``produce`` raises for a record (None: it takes it), as confluent-kafka raises
        # for a record over message.max.bytes or a full local queue
        self.raise_for: Callable[[str, bytes], BaseException | None] = lambda _t, _v: None
        self.blocking: list[bool] = []  # each call's ``block``

    def produce(
        self,
        topic: str,
        value: bytes,
        key: Any = None,
        partition: Any = None,
        on_delivery: Any = None,
        headers: Any = None,
        block: bool = True,
    ) -> None:
        self.blocking.append(block)
        error = self.raise_for(topic, value)
        if error is not None:
            raise error
        self.records.append((topic, value, key, partition))
        if on_delivery is not None:
            on_delivery(self.refuse, None)

    def poll(self, timeout: float = 0) -> int:
        return 0

    def chunks(self) -> list[TrajectoryChunk]:
        return [
            decode_as(v, TrajectoryChunk) for t, v, _k, _p in self.records if t == "t.trajectories"
        ]


def make_core(
    producer: FakeProducer | None, max_batch: int = 4, chunk_tokens: int = 4, **kw: Any
) -> ServeEngine:
    engine = SimEngine(max_batch=max_batch, time_scale=0.01, seed=0)
    publisher = Publisher(producer, LAYOUT, chunk_tokens, "w-serve")  # type: ignore[arg-type]
    return ServeEngine(engine, codec_for(engine), publisher, **kw)


@pytest.fixture
def producer() -> FakeProducer:
    return FakeProducer()


@pytest.fixture
def client(producer: FakeProducer) -> Iterator[TestClient]:
    with TestClient(create_app(make_core(producer), ServeInfo("sim", max_n=4))) as c:
        yield c


def by_trajectory(chunks: list[TrajectoryChunk]) -> dict[str, list[TrajectoryChunk]]:
    out: dict[str, list[TrajectoryChunk]] = {}
    for c in chunks:
        out.setdefault(c.trajectory_id, []).append(c)
    return out


def test_a_completion_is_a_group_of_n_trajectories(
    client: TestClient, producer: FakeProducer
) -> None:
    r = client.post(
        "/v1/completions",
        json={"model": "sim", "prompt": "hi", "max_tokens": 10, "n": 3, "user": "u"},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["finish_reason"] for c in body["choices"]] == ["length"] * 3
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 30, "total_tokens": 32}
    trajs = by_trajectory(producer.chunks())
    assert len(trajs) == 3
    assert sorted(cs[0].sample_index for cs in trajs.values()) == [0, 1, 2]
    for cs in trajs.values():
        assert [c.seq for c in cs] == [0, 1, 2] and [c.n_tokens for c in cs] == [4, 4, 2]
        assert {(c.prompt_id, c.task_id, c.group_size) for c in cs} == {(body["id"], body["id"], 3)}
        assert cs[-1].is_last and cs[-1].finish_reason == "length"
        assert cs[0].bucket == "le256" and cs[0].token_ids().tolist()[0] >= 4
        meta = orjson.loads(cs[0].metadata or "{}")
        assert meta["source"] == "serve" and meta["completion_id"] == body["id"]
        assert meta["request"]["user"] == "u" and meta["request"]["n"] == 3
        assert all(c.metadata is None and c.prompt_tokens is None for c in cs[1:])
        assert cs[0].prompt_tokens is not None
    parts = {(r[2], r[3]) for r in producer.records}
    assert parts == {(tid, LAYOUT.partition_for("le256", tid)) for tid in trajs}


def sse_events(text: str) -> list[Any]:
    lines = [line[6:] for line in text.split("\n\n") if line.startswith("data: ")]
    return [line if line == "[DONE]" else orjson.loads(line) for line in lines]


def test_stream_pieces_add_up_and_end_with_done(client: TestClient) -> None:
    r = client.post(
        "/v1/completions",
        json={"model": "sim", "prompt": "hi", "max_tokens": 5, "stream": True, "seed": 1},
    )
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len({c["id"] for c in chunks}) == 1
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 4 + ["length"]
    assert "".join(c["choices"][0]["text"] for c in chunks).count(" w") == 5


def test_chat_stream_with_usage(client: TestClient) -> None:
    r = client.post(
        "/v1/chat/completions",
        json={
            "model": "sim",
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 2,
            "n": 2,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 4
    roles = [e["choices"][0]["index"] for e in events[:2]]
    assert roles == [0, 1] and all(
        e["choices"][0]["delta"]["role"] == "assistant" for e in events[:2]
    )
    finishes = [e["choices"][0] for e in events[2:-2] if e["choices"][0]["finish_reason"]]
    assert sorted(f["index"] for f in finishes) == [0, 1]


def test_a_stop_string_ends_the_choice_and_its_trajectory(
    client: TestClient, producer: FakeProducer
) -> None:
    """Every sim token decodes as ' w{id}': the stop ' w' completes at the first token."""
    r = client.post(
        "/v1/completions", json={"model": "sim", "prompt": "hi", "max_tokens": 50, "stop": [" w"]}
    )
    choice = r.json()["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == ("", "stop")
    assert r.json()["usage"]["completion_tokens"] == 1
    (cs,) = by_trajectory(producer.chunks()).values()
    assert [c.n_tokens for c in cs] == [1] and cs[-1].finish_reason == "stop"


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/completions", {"model": "other", "prompt": "a"}, 404, "model"),
        ("/v1/completions", {"model": "sim"}, 400, "prompt"),
        ("/v1/completions", {"model": "sim", "prompt": "a", "n": 5}, 400, "n"),
        ("/v1/completions", {"model": "sim", "prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/completions", {"model": "sim", "prompt": "a", "temperature": 3}, 400, "temperature"),
        ("/v1/completions", {"model": "sim", "prompt": [1, 10**9]}, 400, "prompt"),
        ("/v1/chat/completions", {"model": "sim", "messages": []}, 400, "messages"),
        ("/v1/chat/completions", {"model": "sim", "messages": [{"role": "x"}]}, 400, "messages"),
    ],
)
def test_bad_requests_are_openai_errors(
    client: TestClient, path: str, body: dict[str, Any], status: int, param: str
) -> None:
    r = client.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"] and err["type"] == "invalid_request_error"


def test_a_rejected_stream_is_a_json_error_not_a_stream(client: TestClient) -> None:
    r = client.post("/v1/completions", json={"model": "sim", "prompt": [10**9], "stream": True})
    assert r.status_code == 400 and r.headers["content-type"] == "application/json"


def test_unknown_routes_bad_json_and_models(client: TestClient) -> None:
    assert client.get("/v1/nope").json()["error"]["message"] == "Not Found"
    assert client.get("/v1/completions").status_code == 405
    r = client.post(
        "/v1/completions", content=b"{bad", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and "error" in r.json()
    assert client.get("/v1/models").json()["data"][0]["id"] == "sim"
    assert client.get("/v1/models/sim").json()["id"] == "sim"
    assert client.get("/v1/models/x").status_code == 404
    health = client.get("/health").json()
    assert health["status"] == "ok" and health["simulated"] is True and health["publish"] is True


def test_over_max_pending_is_429() -> None:
    with TestClient(create_app(make_core(None, max_pending=2), ServeInfo("sim"))) as c:
        r = c.post("/v1/completions", json={"model": "sim", "prompt": "a", "n": 3})
        assert r.status_code == 429 and r.json()["error"]["code"] == "server_busy"
        assert (
            c.post("/v1/completions", json={"model": "sim", "prompt": "a", "n": 2}).status_code
            == 200
        )


# -- the engine thread on its own --------------------------------------------------------------
class Collector:
    def __init__(self) -> None:
        self.events: list[tuple[Job, Event]] = []
        self.lock = threading.Lock()

    def __call__(self, batch: list[tuple[Job, Event]]) -> None:
        with self.lock:
            self.events += batch

    def wait(self, what: Callable[[list[Event]], bool], timeout_s: float = 10) -> list[Event]:
        deadline = time.monotonic() + timeout_s
        while True:
            with self.lock:
                evs = [e for _j, e in self.events]
            if what(evs):
                return evs
            assert time.monotonic() < deadline, evs
            time.sleep(0.005)


def job(max_tokens: int, n: int = 1, **kw: Any) -> Job:
    s = Sampling(max_tokens, n=n, **kw)
    return Job(f"cmpl-{time.monotonic_ns()}", "completion", [108, 109], s)


def test_cancel_closes_the_trajectory_as_abort(producer: FakeProducer) -> None:
    core, sink = make_core(producer), Collector()
    core.start(sink)
    try:
        j = job(10_000)
        core.submit(j)
        sink.wait(lambda evs: sum(isinstance(e, Delta) for e in evs) >= 3)
        core.cancel(j)
        deadline = time.monotonic() + 10
        while core.stats.cancelled < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        core.stop()
    cs = producer.chunks()
    assert cs[-1].is_last and cs[-1].finish_reason == "abort"
    assert [c.seq for c in cs] == list(range(len(cs)))
    assert core.health()["pending"] == 0


class OneVersion:
    """A follower that offers version 1 once ``due()`` says so."""

    def __init__(self, due: Callable[[], bool]) -> None:
        self.due = due
        self.offered = False
        self.loaded: list[int] = []

    def check(self) -> None:
        return None

    def drain_refusals(self) -> list[tuple[int, str]]:
        return []

    def drain_poison(self) -> list[object]:
        return []

    def take(self) -> Ready | None:
        if self.offered or not self.due():
            return None
        self.offered = True
        return Ready(1, {}, 0.0)

    def swapped(self, version: int) -> None:
        self.loaded.append(version)

    def refuse(self, version: int, reason: str) -> None:
        raise AssertionError(f"v{version} refused: {reason}")

    swap_into = WeightFollower.swap_into  # the real swap, over this fake's take and swapped


def test_a_weight_swap_closes_open_chunks_first(producer: FakeProducer) -> None:
    """Tokens 0..k under v0, the rest under v1; the chunk open at the swap is closed first."""
    cores: list[ServeEngine] = []
    follower = OneVersion(lambda: cores[0].stats.tokens >= 5)
    core = make_core(producer, chunk_tokens=8, follower=follower)
    cores.append(core)
    sink = Collector()
    core.start(sink)
    try:
        core.submit(job(20))
        evs = sink.wait(lambda evs: any(isinstance(e, Finished) for e in evs))
    finally:
        core.stop()
    assert follower.loaded == [1]
    cs = producer.chunks()
    versions = [c.policy_version for c in cs]
    assert versions[0] == 0 and versions[-1] == 1 and versions == sorted(versions)
    assert cs[0].n_tokens < 8  # closed early by the swap
    assert sum(c.n_tokens for c in cs) == 20 and [c.seq for c in cs] == list(range(len(cs)))
    finished = [e for e in evs if isinstance(e, Finished)]
    assert finished[0].version == 1 and isinstance(evs[0], Accepted)


class Broken(SimEngine):
    def step(self) -> list[Emitted]:
        if self.waiting or self.rows:
            raise RuntimeError("device lost")
        return []


def test_an_engine_failure_fails_open_jobs_and_stops_the_server() -> None:
    engine = Broken(max_batch=2, time_scale=0.01)
    core = ServeEngine(engine, codec_for(engine), Publisher(None, LAYOUT, 4, "w"))
    stopped = threading.Event()
    core.on_failure = stopped.set
    sink = Collector()
    core.start(sink)
    core.submit(job(5))
    evs = sink.wait(lambda evs: any(isinstance(e, Failed) for e in evs))
    failed = next(e for e in evs if isinstance(e, Failed))
    assert failed.status == 503 and "device lost" not in failed.message  # in the log only
    assert stopped.wait(5) and core.health()["status"] == "failed"
    assert "device lost" in str(core.error)
    core.stop()


def test_delivery_failures_are_counted_and_reported(
    producer: FakeProducer, caplog: pytest.LogCaptureFixture
) -> None:
    core = make_core(producer)
    core.start(Collector())
    try:
        producer.errors.append("Local: Message timed out")
        producer.failed = 2
        deadline = time.monotonic() + 10
        while core.health()["delivery_failures"] != 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        core.stop()
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("2 record(s) failed delivery" in w and "timed out" in w for w in warnings)
