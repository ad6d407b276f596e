"""``POST /v1/feedback`` in process: checked, published as a ``Feedback`` record keyed by the
served choice's trajectory id, answered only once the broker has it."""

from __future__ import annotations

from collections.abc import Iterator

import orjson
import pytest
from fastapi.testclient import TestClient

from app.serve.feedback import FeedbackOut
from app.serve.http import ServeInfo, create_app
from schemas.records import Feedback, decode_as
from tests.unit.test_serve_app import LAYOUT, FakeProducer, make_core


def feedback_app(producer: FakeProducer | None, publish: bool = True) -> TestClient:
    out = FeedbackOut(producer if publish else None, LAYOUT, "w-serve", timeout_s=2)  # type: ignore[arg-type]
    return TestClient(create_app(make_core(producer), ServeInfo("sim", max_n=4), feedback=out))


@pytest.fixture
def client(producer: FakeProducer) -> Iterator[TestClient]:
    with feedback_app(producer) as c:
        yield c


@pytest.fixture
def producer() -> FakeProducer:
    return FakeProducer()


def feedback_records(producer: FakeProducer) -> list[tuple[Feedback, object]]:
    return [(decode_as(v, Feedback), k) for t, v, k, _p in producer.records if t == "t.feedback"]


def test_feedback_names_the_trajectory_of_the_choice(
    client: TestClient, producer: FakeProducer
) -> None:
    body = client.post(
        "/v1/completions", json={"model": "sim", "prompt": "hi", "max_tokens": 3, "n": 2}
    ).json()
    r = client.post(
        "/v1/feedback",
        json={"id": body["id"], "index": 1, "reward": 0.5, "metadata": {"rater": "app"}},
    )
    assert r.status_code == 200, r.text
    chunks = [c for c in producer.chunks() if c.sample_index == 1]
    assert r.json() == {
        "object": "feedback",
        "id": body["id"],
        "index": 1,
        "trajectory_id": chunks[0].trajectory_id,
        "reward": 0.5,
    }
    ((rec, key),) = feedback_records(producer)
    assert key == rec.trajectory_id == chunks[0].trajectory_id
    assert (rec.completion_id, rec.choice_index, rec.reward) == (body["id"], 1, 0.5)
    assert orjson.loads(rec.metadata or "") == {"rater": "app"} and rec.source == "w-serve"
    # the index defaults to 0, the only choice of an n = 1 request
    client.post("/v1/feedback", json={"id": body["id"], "reward": -1})
    assert feedback_records(producer)[1][0].choice_index == 0
    assert client.get("/health").json()["feedback_accepted"] == 2


ID = "cmpl-" + "a" * 32


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (f'{{"id": "{ID}"}}', "reward"),
        (f'{{"id": "{ID}", "reward": "good"}}', "reward"),
        (f'{{"id": "{ID}", "reward": NaN}}', "reward"),
        (f'{{"id": "{ID}", "reward": 1e999}}', "reward"),
        ('{"id": "cmpl-xyz", "reward": 1}', "id"),
        (f'{{"id": "{ID}", "reward": 1, "index": 4}}', "index"),
        (f'{{"id": "{ID}", "reward": 1, "index": -1}}', "index"),
        (f'{{"id": "{ID}", "reward": 1, "metadata": {{"k": "{"v" * 600}"}}}}', "metadata"),
    ],
)
def test_bad_feedback_is_a_400_naming_the_parameter(
    client: TestClient, producer: FakeProducer, body: str, param: str
) -> None:
    r = client.post("/v1/feedback", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert not feedback_records(producer)


def test_feedback_the_broker_refuses_is_a_503_and_counted(
    producer: FakeProducer, caplog: pytest.LogCaptureFixture
) -> None:
    producer.refuse = "Broker: not enough replicas"
    with feedback_app(producer) as client:
        r = client.post("/v1/feedback", json={"id": "cmpl-" + "b" * 32, "reward": 1})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        err = r.json()["error"]
        assert err["code"] == "feedback_failed" and "replicas" not in err["message"]
        assert client.get("/health").json()["feedback_refused"] == 1
    assert any("not enough replicas" in rec.getMessage() for rec in caplog.records)


def test_feedback_never_waits_for_room_in_the_producer(producer: FakeProducer) -> None:
    """A full local queue (a slow or absent broker) is a 503 at once: the old produce polled
    and retried on the event loop until the queue had room, freezing every request."""
    producer.raise_for = lambda topic, _v: BufferError("Local: Queue full")
    with feedback_app(producer) as client:
        r = client.post("/v1/feedback", json={"id": "cmpl-" + "d" * 32, "reward": 1})
        assert r.status_code == 503 and r.json()["error"]["code"] == "feedback_failed"
        assert client.get("/health").json()["feedback_refused"] == 1
    assert producer.blocking == [False] and not feedback_records(producer)


def test_feedback_with_publishing_off_is_refused(producer: FakeProducer) -> None:
    with feedback_app(None, publish=False) as client:
        r = client.post("/v1/feedback", json={"id": "cmpl-" + "c" * 32, "reward": 1})
        assert r.status_code == 503 and r.json()["error"]["code"] == "feedback_disabled"
