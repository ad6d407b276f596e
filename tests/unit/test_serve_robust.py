"""``srl serve`` under hostile requests and a broken data plane, in process (no broker): one
request can fail, be refused or lose its trajectory, never the server; publishing never
blocks serving. Each test names the defect it pins down (issue 32)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from app.configs import ServeConfig
from app.serve.core import ServeEngine
from app.serve.http import ServeInfo, create_app, deliver_event
from app.serve.jobs import Delta, Failed, Finished, Job
from app.serve.protocol import Sampling
from app.serve.publish import Publisher
from app.serve.text import SimCodec, codec_for
from producers.engines.base import Emitted
from producers.engines.sim import SimEngine
from srl.config import load_config
from srl.errors import ConfigError
from srl.kafka import KafkaError, KafkaException, Producer
from tests.unit.test_serve_app import (
    LAYOUT,
    Broken,
    Collector,
    FakeProducer,
    by_trajectory,
    job,
    make_core,
)


def too_large(_topic: str, value: bytes) -> BaseException | None:
    """What confluent-kafka raises for a record over ``message.max.bytes`` (1 MB by default)."""
    if len(value) > 10_000:
        return KafkaException(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE))
    return None


def app_client(core: ServeEngine, **info: Any) -> TestClient:
    return TestClient(create_app(core, ServeInfo("sim", **({"max_n": 4} | info))))


def complete(client: TestClient, **body: Any) -> Any:
    return client.post("/v1/completions", json={"model": "sim", "prompt": "hi"} | body)


# -- one request never takes the server down ---------------------------------------------------
def test_a_record_over_the_broker_limit_costs_its_trajectory_not_the_server(
    producer: FakeProducer,
) -> None:
    """A prompt whose first chunk is over the record limit made ``produce`` raise on the
    engine thread: the engine died, the request hung, every later one got a 503."""
    producer.raise_for = too_large
    with app_client(make_core(producer)) as client:
        big = complete(client, prompt="x" * 5_000, max_tokens=6, n=2)
        assert big.status_code == 200, big.text
        assert [c["finish_reason"] for c in big.json()["choices"]] == ["length"] * 2
        health = client.get("/health").json()
        assert health["status"] == "ok" and health["publish_dropped"] == 2
        small = complete(client, max_tokens=6)
        assert small.status_code == 200
    published = {c.prompt_id for c in producer.chunks()}
    assert published == {small.json()["id"]}  # the big one left nothing half-published


def test_a_dropped_trajectory_then_cancelled_closes_cleanly(producer: FakeProducer) -> None:
    """The chunker ``KeyError`` of the old clean-up: a trajectory whose record was refused,
    then aborted (client gone), must not raise on the engine thread."""
    producer.raise_for = too_large
    core, sink = make_core(producer), Collector()
    core.start(sink)
    try:
        doomed = Job("cmpl-doomed", "completion", [50] * 5_000, Sampling(10_000))
        core.submit(doomed)
        sink.wait(lambda evs: any(isinstance(e, Delta) for e in evs))
        core.cancel(doomed)
        fine = job(5)
        core.submit(fine)
        sink.wait(lambda evs: any(isinstance(e, Finished) for e in evs))
        assert core.alive and core.stats.cancelled == 1 and core.stats.publish_dropped == 1
    finally:
        core.stop()
    assert {c.prompt_id for c in producer.chunks()} == {fine.completion_id}


class Flaky(SimCodec):
    """A tokenizer that fails to decode token 2, as a broken tokenizer file would (the sim
    engine never samples ids below 4)."""

    def decode(self, ids: Any) -> str:
        if 2 in ids:
            raise ValueError("no such token")
        return super().decode(ids)


def test_a_failure_on_the_engine_thread_fails_that_request_only(producer: FakeProducer) -> None:
    """Any exception while the engine thread handled one request's outputs stopped the thread:
    every open request failed and the server exited."""
    engine = Scripted([2])
    publisher = Publisher(producer, LAYOUT, 4, "w")  # type: ignore[arg-type]
    core = ServeEngine(engine, Flaky(engine.vocab, engine.tokenize), publisher)
    with app_client(core) as client:
        r = complete(client, max_tokens=3)
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        assert "no such token" not in r.text
        assert complete(client, max_tokens=3).status_code == 200
        assert client.get("/health").json()["request_errors"] == 1
    ends = [cs[-1].finish_reason for cs in by_trajectory(producer.chunks()).values()]
    assert ends == ["abort", "length"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"user": "u" * 1_100_000}, "user"),
        ({"stop": ["s" * 5000]}, "stop"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"max_tokens": 10**30}, "max_tokens"),
        ({"seed": 10**30}, "seed"),
        ({"model": "m" * 100_000}, "model"),
    ],
)
def test_oversized_fields_are_a_400_and_the_server_goes_on(
    producer: FakeProducer, body: dict[str, Any], param: str
) -> None:
    """A 1.1 MB ``user`` (or a huge integer that orjson cannot write into the request record)
    once raised on the engine thread and took the server down."""
    with app_client(make_core(producer)) as client:
        r = complete(client, **body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert complete(client, max_tokens=2).status_code == 200


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", b'{"model": "sim", "prompt": "\\ud800abc"}', "prompt"),
        ("/v1/completions", b'{"model": "sim", "prompt": ["ok", "x\\udfff"]}', "prompt"),
        (
            "/v1/chat/completions",
            b'{"model": "sim", "messages": [{"role": "user", "content": "a\\ud800"}]}',
            "messages",
        ),
        ("/v1/completions", b'{"model": "sim", "prompt": "a", "stop": ["\\ud800"]}', "stop"),
        ("/v1/completions", b'{"model": "sim", "prompt": "a", "user": "\\udc80"}', "user"),
    ],
)
def test_text_that_cannot_be_encoded_is_a_400_with_its_reason(
    producer: FakeProducer, path: str, body: bytes, param: str
) -> None:
    """JSON lets a lone surrogate through (``"\\ud800abc"``): it answered 500, raised where
    the prompt was tokenized or the request record encoded."""
    with app_client(make_core(producer)) as client:
        r = client.post(path, content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and "lone surrogate" in err["message"], err
        assert complete(client, max_tokens=2).status_code == 200


def test_a_body_over_the_limit_is_a_413_json_error(producer: FakeProducer) -> None:
    with app_client(make_core(producer), max_body_bytes=2048) as client:
        r = complete(client, prompt="x" * 4096)
        assert r.status_code == 413
        assert r.json()["error"]["code"] == "request_too_large"
        chunked = client.post(  # no Content-Length: counted as it arrives
            "/v1/completions",
            content=iter([b'{"model": "sim", "prompt": "', b"x" * 4096, b'"}']),
            headers={"content-type": "application/json"},
        )
        assert chunked.status_code == 413
        assert complete(client, max_tokens=2).status_code == 200


class Watched(SimCodec):
    """Notes the thread that renders and tokenizes each prompt."""

    def __init__(self, *a: Any) -> None:
        super().__init__(*a)
        self.threads: list[str] = []

    def encode(self, text: str, chat: bool) -> list[int]:
        self.threads.append(threading.current_thread().name)
        return super().encode(text, chat)

    def chat_prompt(self, messages: list[dict[str, str]]) -> str:
        self.threads.append(threading.current_thread().name)
        return super().chat_prompt(messages)


def test_prompts_are_rendered_and_tokenized_off_the_event_loop_and_the_decode_loop() -> None:
    """Templates ran on the event loop (every connection waited) and tokenizing on the engine
    thread (every running choice waited)."""
    engine = SimEngine(max_batch=2, time_scale=0.01, seed=0)
    codec = Watched(engine.vocab, engine.tokenize)
    core = ServeEngine(engine, codec, Publisher(None, LAYOUT, 4, "w"))
    with app_client(core) as client:
        messages = [{"role": "user", "content": "hi"}]
        chat = client.post("/v1/chat/completions", json={"model": "sim", "messages": messages})
        assert chat.status_code == 200 and complete(client, max_tokens=1).status_code == 200
    assert len(codec.threads) == 3
    assert all(name.startswith("AnyIO worker thread") for name in codec.threads), codec.threads


# -- publishing never blocks serving -----------------------------------------------------------
@pytest.fixture
def nowhere() -> Iterator[Producer]:
    """A real producer whose broker is gone (nothing listens), with room for 2 records."""
    cfg = load_config(
        ServeConfig,
        cli={
            "engine": "sim",
            "bootstrap_servers": "127.0.0.1:9",
            "kafka": {"queue.buffering.max.messages": "2", "message.max.bytes": "100000"},
        },
        env={},
    )
    p = Producer(cfg, "serve", check=False)
    yield p
    p._p.purge()  # nothing will ever be delivered: no flush


def test_a_full_local_queue_drops_and_counts_instead_of_blocking(nowhere: Producer) -> None:
    """The broker gone, the producer's queue fills: the old ``produce`` polled and retried on
    the engine thread forever, so every request hung. Now each refused record drops its
    trajectory (counted) and every request is answered. The real client raises the real
    ``BufferError`` and ``MSG_SIZE_TOO_LARGE`` here."""
    engine = SimEngine(max_batch=4, time_scale=0.01, seed=0)
    core = ServeEngine(engine, codec_for(engine), Publisher(nowhere, LAYOUT, 2, "w"))
    with app_client(core) as client:
        for _ in range(4):
            assert complete(client, max_tokens=8, n=2).status_code == 200
        big = complete(client, prompt="x" * 30_000, max_tokens=2)  # one record over 100 kB
        assert big.status_code == 200
        health = client.get("/health").json()
    assert health["status"] == "ok" and health["publish_dropped"] >= 8
    assert nowhere.pending() <= 2


# -- the queue: a bound on waiting, fair shares, bounded mailboxes ---------------------------
def test_the_wait_for_a_first_batch_slot_is_counted(producer: FakeProducer) -> None:
    """``queue_waits`` / ``queue_wait_ms``: what ``srl top`` shows as the mean queue wait."""
    core = make_core(producer, max_batch=1)
    core.engine.time_scale = 1.0  # type: ignore[attr-defined]
    with app_client(core) as client:
        first = threading.Thread(target=complete, args=(client,), kwargs={"max_tokens": 40})
        first.start()
        wait_for(lambda: client.get("/health").json()["running"] == 1)
        t0 = time.monotonic()
        assert complete(client, max_tokens=2).status_code == 200  # waits for the first
        waited_ms = (time.monotonic() - t0) * 1000
        first.join(30)
        health = client.get("/health").json()
    assert health["queue_waits"] == 2
    assert 50 <= health["queue_wait_ms"] <= waited_ms + 50, (health, waited_ms)


def test_no_slot_within_the_queue_wait_is_a_503_with_retry_after(producer: FakeProducer) -> None:
    core = make_core(producer, max_batch=1, max_queue_wait_s=0.2)
    core.engine.time_scale = 1.0  # type: ignore[attr-defined]
    with app_client(core) as client:
        long = threading.Thread(target=complete, args=(client,), kwargs={"max_tokens": 10_000})
        long.start()
        wait_for(lambda: client.get("/health").json()["running"] == 1)
        r = complete(client, max_tokens=2)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "server_overloaded"
        assert client.get("/health").json()["queue_timeouts"] == 1
        core.stop()  # ends the long request
        long.join(30)
    assert len({c.prompt_id for c in producer.chunks()}) == 1  # the refused one left nothing


def test_a_request_cannot_hold_every_slot_while_others_wait(producer: FakeProducer) -> None:
    """n = 4 on 2 slots (cap 1 while others wait): a later n = 1 request gets the next free
    slot, not the end of the line. In the old FIFO queue it waited for all of A."""
    core = make_core(producer, max_batch=2, max_request_slots=1)
    core.engine.time_scale = 0.5  # type: ignore[attr-defined]  # a's first two: ~1.6 s
    with app_client(core) as client:
        a = threading.Thread(target=complete, args=(client,), kwargs={"max_tokens": 400, "n": 4})
        a.start()
        wait_for(lambda: held(client) == (2, 2))
        b = complete(client, max_tokens=5)
        a.join(30)
    assert b.status_code == 200
    ends = [c.prompt_id for c in producer.chunks() if c.is_last]
    b_id = b.json()["id"]
    assert ends.index(b_id) < len(ends) - 1, "b finished after every choice of a"


def test_a_mailbox_is_bounded_and_its_job_cancelled() -> None:
    """A streaming client that stops reading: its job's events stop at the bound, the job is
    cancelled and its stream ends with an error; the queue was unbounded."""
    import asyncio

    cancelled: list[Job] = []
    j = Job("cmpl-slow", "completion", [5], Sampling(100), mailbox=asyncio.Queue())
    for i in range(10):
        deliver_event(j, Delta(0, f"t{i}"), 4, cancelled.append)
    assert j.mailbox.qsize() == 5 and cancelled == [j] and j.overflowed
    events = [j.mailbox.get_nowait() for _ in range(5)]
    assert isinstance(events[-1], Failed) and "did not read" in events[-1].message


def test_429_says_when_to_retry(producer: FakeProducer) -> None:
    with app_client(make_core(producer, max_pending=1)) as client:
        r = complete(client, n=2)
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert client.get("/metrics").text.count("srl_serve_busy_total 1.0") == 1


def test_after_an_engine_failure_503s_say_nothing_internal() -> None:
    engine = Broken(max_batch=2, time_scale=0.01)
    core = ServeEngine(engine, codec_for(engine), Publisher(None, LAYOUT, 4, "w"))
    with app_client(core) as client:
        first = complete(client, max_tokens=2)
        wait_for(lambda: not core.alive)
        later = complete(client, max_tokens=2)
    for r in (first, later):
        assert r.status_code == 503 and r.headers["retry-after"] == "5"
        assert "device lost" not in r.text and r.json()["error"]["type"] == "server_error"


def test_streams_tell_proxies_not_to_buffer(producer: FakeProducer) -> None:
    with app_client(make_core(producer)) as client:
        r = complete(client, max_tokens=2, stream=True)
    assert r.headers["cache-control"] == "no-cache" and r.headers["x-accel-buffering"] == "no"


# -- the finish reason: the API's is the log's -------------------------------------------------
class Scripted(SimEngine):
    """The sim engine on one slot whose first tokens are ``script``."""

    def __init__(self, script: list[int]) -> None:
        super().__init__(max_batch=1, time_scale=0.0, seed=0)
        self.script = list(script)

    def step(self) -> list[Emitted]:
        out = super().step()
        for e in out:
            if self.script:
                e.tokens = [self.script.pop(0)]
        return out


class Replacement(SimCodec):
    """Token 7 alone decodes as an incomplete character (U+FFFD), as a byte-level tokenizer's
    first byte of a multi-byte character does: its text is held until the end."""

    def decode(self, ids: Any) -> str:
        return "".join("\ufffd" if i == 7 else "a" for i in ids)


def test_a_stop_string_completing_at_the_end_is_stop_in_the_api_and_the_log(
    producer: FakeProducer,
) -> None:
    """The old loop published ``length`` before it found the stop in the held text, and
    answered ``stop``."""
    engine = Scripted([10, 10, 7])
    publisher = Publisher(producer, LAYOUT, 4, "w")  # type: ignore[arg-type]
    core = ServeEngine(engine, Replacement(engine.vocab, engine.tokenize), publisher)
    with app_client(core) as client:
        r = complete(client, max_tokens=3, stop=["\ufffd"])
    choice = r.json()["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == ("aa", "stop")
    (cs,) = by_trajectory(producer.chunks()).values()
    assert cs[-1].finish_reason == "stop"


# -- the configuration -------------------------------------------------------------------------
@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "::", "example.com"])
def test_a_public_host_needs_an_api_key(host: str) -> None:
    with pytest.raises(ConfigError, match="api-key"):
        load_config(ServeConfig, cli={"engine": "sim", "host": host}, env={})
    cfg = load_config(ServeConfig, cli={"engine": "sim", "host": host, "api_key": "k"}, env={})
    assert cfg.api_key == "k"


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost"])
def test_loopback_needs_no_key(host: str) -> None:
    assert load_config(ServeConfig, cli={"engine": "sim", "host": host}, env={}).api_key is None


def held(client: TestClient) -> tuple[int, int]:
    """``(running, waiting)`` choices, as /health says."""
    h = client.get("/health").json()
    return h["running"], h["waiting"]


def wait_for(what: Callable[[], bool], timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while not what():
        assert time.monotonic() < deadline
        time.sleep(0.01)


@pytest.fixture
def producer() -> FakeProducer:
    return FakeProducer()
