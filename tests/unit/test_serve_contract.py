"""The OpenAI contract of ``srl serve`` as real clients see it: the official ``openai`` client
(and raw ``httpx`` for what it hides) against the app on a real uvicorn server in a thread,
over the sim engine, with the published log kept by a hand-written producer. Covers
``logprobs``/``top_logprobs`` (equal to the behaviour log-probs the log records),
``stream_options.include_usage``, ``max_completion_tokens``, ``stop``, ``seed``, ``n`` with
streaming, ``user``, refused parameters, the finish reason of the API against the log's, API
keys, and a client that goes away."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import orjson
import pytest
import uvicorn

from app.serve.core import ServeEngine
from app.serve.feedback import FeedbackOut
from app.serve.http import ServeInfo, create_app
from app.serve.run import bind
from schemas.records import TrajectoryChunk
from tests.unit.test_serve_app import LAYOUT, FakeProducer, by_trajectory, make_core

KEY, FEEDBACK_KEY = "sk-serve", "sk-rate"


@dataclass
class Live:
    url: str  # .../v1
    core: ServeEngine
    producer: FakeProducer

    def client(self, key: str = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url, api_key=key, max_retries=0, timeout=30)

    def trajectories(self, completion_id: str) -> list[list[TrajectoryChunk]]:
        """The log's trajectories of one completion, by choice index."""
        found = [cs for cs in by_trajectory(self.producer.chunks()).values()]
        mine = [cs for cs in found if cs[0].prompt_id == completion_id]
        return sorted(mine, key=lambda cs: cs[0].sample_index)


@pytest.fixture
def live() -> Iterator[Live]:
    producer = FakeProducer()
    core = make_core(producer, max_batch=8)
    out = FeedbackOut(producer, LAYOUT, "w-serve", timeout_s=5)  # type: ignore[arg-type]
    info = ServeInfo("sim", max_n=4, api_key=KEY, feedback_api_key=FEEDBACK_KEY)
    app = create_app(core, info, feedback=out)
    sock = bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive()
        time.sleep(0.01)
    try:
        yield Live(f"http://127.0.0.1:{port}/v1", core, producer)
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def logged(cs: list[TrajectoryChunk]) -> tuple[list[int], list[float], str | None]:
    tokens = [t for c in cs for t in c.token_ids().tolist()]
    return tokens, [lp for c in cs for lp in c.logprob_values().tolist()], cs[-1].finish_reason


# -- logprobs ----------------------------------------------------------------------------------
def test_completion_logprobs_are_the_behaviour_logprobs_of_the_log(live: Live) -> None:
    r = live.client().completions.create(
        model="sim", prompt="hi", max_tokens=5, logprobs=2, n=2, seed=1
    )
    for choice, cs in zip(r.choices, live.trajectories(r.id), strict=True):
        lp = choice.logprobs
        assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs
        assert "".join(lp.tokens) == choice.text
        _tokens, logprobs, _ = logged(cs)
        assert lp.token_logprobs == pytest.approx(logprobs, abs=1e-6)
        tops = zip(lp.tokens, lp.top_logprobs, strict=True)
        assert all(tok in top and len(top) == 2 for tok, top in tops)
        assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(5)]


def test_chat_logprobs_with_top_logprobs(live: Live) -> None:
    r = live.client().chat.completions.create(
        model="sim",
        messages=[{"role": "user", "content": "hi"}],
        max_completion_tokens=4,
        logprobs=True,
        top_logprobs=3,
    )
    content = r.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 4 == r.usage.completion_tokens  # type: ignore[union-attr]
    assert "".join(t.token for t in content) == r.choices[0].message.content
    assert all(
        len(t.top_logprobs) == 3 and bytes(t.bytes or []) == t.token.encode() for t in content
    )
    ((cs),) = live.trajectories(r.id)
    assert [t.logprob for t in content] == pytest.approx(logged(cs)[1], abs=1e-6)
    plain = live.client().chat.completions.create(
        model="sim", messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert plain.choices[0].logprobs is None


def test_streamed_logprobs_add_up_to_the_text(live: Live) -> None:
    pieces, tokens, offsets = [], [], []
    for chunk in live.client().completions.create(
        model="sim", prompt="hi", max_tokens=6, logprobs=1, stream=True
    ):
        c = chunk.choices[0]
        pieces.append(c.text)
        if c.logprobs is not None:
            tokens += c.logprobs.tokens or []
            offsets += c.logprobs.text_offset or []
    assert "".join(tokens) == "".join(pieces) and len(tokens) == 6
    assert offsets == [len("".join(tokens[:i])) for i in range(6)]
    chat_tokens = []
    messages: Any = [{"role": "user", "content": "x"}]
    for piece in live.client().chat.completions.create(
        model="sim", messages=messages, max_tokens=3, logprobs=True, stream=True
    ):
        if piece.choices and piece.choices[0].logprobs is not None:
            chat_tokens += [t.token for t in piece.choices[0].logprobs.content or []]
    assert len(chat_tokens) == 3


# -- the knobs ---------------------------------------------------------------------------------
def test_usage_in_streams_and_max_completion_tokens(live: Live) -> None:
    client = live.client()
    chunks = list(
        client.chat.completions.create(
            model="sim",
            messages=[{"role": "user", "content": "x"}],
            max_completion_tokens=3,
            n=2,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 6
    assert [len(logged(cs)[0]) for cs in live.trajectories(chunks[0].id)] == [3, 3]
    done = list(
        client.completions.create(
            model="sim",
            prompt="x",
            max_tokens=2,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert done[-1].usage is not None and done[-1].usage.total_tokens == 3


def test_n_with_streaming_finishes_every_choice(live: Live) -> None:
    stream = live.client().completions.create(
        model="sim", prompt="x", max_tokens=4, n=3, stream=True
    )
    texts: dict[int, str] = {}
    finished = {}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                finished[c.index] = c.finish_reason
    assert finished == {0: "length", 1: "length", 2: "length"}
    assert len(set(texts.values())) == 3


def test_seed_gives_the_same_text_whatever_runs_beside_it(live: Live) -> None:
    client = live.client()
    other = threading.Thread(
        target=client.completions.create, kwargs={"model": "sim", "prompt": "o", "max_tokens": 40}
    )
    other.start()
    a = client.completions.create(model="sim", prompt="s", max_tokens=8, n=2, seed=42)
    other.join()
    b = client.completions.create(model="sim", prompt="s", max_tokens=8, n=2, seed=42)
    c = client.completions.create(model="sim", prompt="s", max_tokens=8, n=2, seed=43)
    texts = [[ch.text for ch in r.choices] for r in (a, b, c)]
    assert texts[0] == texts[1] and texts[0][0] != texts[0][1] and texts[2] != texts[0]


def test_stop_user_and_the_finish_reason_of_the_log(live: Live) -> None:
    """Whatever ends a choice, the API's finish reason is its last chunk's in the log."""
    client = live.client()
    stopped = client.completions.create(
        model="sim", prompt="x", max_tokens=9, stop=[" w"], user="app-user"
    )
    long = client.chat.completions.create(
        model="sim", messages=[{"role": "user", "content": "x"}], max_tokens=3, user="u2"
    )
    assert stopped.choices[0].finish_reason == "stop" and stopped.choices[0].text == ""
    assert long.choices[0].finish_reason == "length"
    for r, reason, user in ((stopped, "stop", "app-user"), (long, "length", "u2")):
        ((cs),) = live.trajectories(r.id)
        assert logged(cs)[2] == reason
        assert orjson.loads(cs[0].metadata or "{}")["request"]["user"] == user


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"logit_bias": {"5": 1}}, "logit_bias"),
    ],
)
def test_unsupported_parameters_are_refused_not_ignored(
    live: Live, kw: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        live.client().chat.completions.create(
            model="sim", messages=[{"role": "user", "content": "x"}], max_tokens=2, **kw
        )
    err = e.value.body
    assert (
        isinstance(err, dict) and err["param"] == param and err["code"] == "unsupported_parameter"
    )
    assert not live.producer.chunks()


# -- keys --------------------------------------------------------------------------------------
def test_api_keys(live: Live) -> None:
    with pytest.raises(openai.AuthenticationError):
        live.client("wrong").models.list()
    with pytest.raises(openai.AuthenticationError):
        live.client(FEEDBACK_KEY).completions.create(model="sim", prompt="x", max_tokens=1)
    base = live.url.removesuffix("/v1")
    r = httpx.post(f"{live.url}/completions", json={"model": "sim", "prompt": "x"})
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{base}/health").status_code == 200  # open: load balancers
    assert "srl_serve_requests_total" in httpx.get(f"{base}/metrics").text
    done = live.client().completions.create(model="sim", prompt="x", max_tokens=1)
    rating = {"id": done.id, "reward": 1.0}
    as_app = httpx.post(f"{live.url}/feedback", json=rating, headers=bearer(KEY))
    assert as_app.status_code == 401  # the serving key sets no rewards when a rater key is set
    as_rater = httpx.post(f"{live.url}/feedback", json=rating, headers=bearer(FEEDBACK_KEY))
    assert as_rater.status_code == 200, as_rater.text


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


# -- a client that goes away -------------------------------------------------------------------
def wait_cancelled(live: Live, n: int) -> None:
    deadline = time.monotonic() + 30
    while live.core.stats.cancelled < n:
        assert time.monotonic() < deadline, live.core.health()
        time.sleep(0.02)


def test_a_non_streaming_request_is_cancelled_when_its_client_goes_away(live: Live) -> None:
    """openai-python and LangChain time out and retry: the abandoned attempt ran on to its
    max_tokens (so under load a request ran up to three times), and trained as complete."""
    live.core.engine.time_scale = 1.0  # type: ignore[attr-defined]
    body = {"model": "sim", "prompt": "x", "max_tokens": 100_000, "n": 2}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{live.url}/completions", json=body, headers=bearer(KEY), timeout=1.0)
    wait_cancelled(live, 2)
    ends = [cs[-1] for cs in by_trajectory(live.producer.chunks()).values()]
    assert [c.finish_reason for c in ends] == ["abort", "abort"]
    assert live.core.health()["pending"] == 0


def test_a_stream_is_cancelled_mid_way(live: Live) -> None:
    live.core.engine.time_scale = 1.0  # type: ignore[attr-defined]
    stream = live.client().completions.create(
        model="sim", prompt="x", max_tokens=100_000, stream=True
    )
    for i, _chunk in enumerate(stream):
        if i == 2:
            break
    stream.close()
    wait_cancelled(live, 1)
    (cs,) = by_trajectory(live.producer.chunks()).values()
    assert cs[-1].finish_reason == "abort" and logged(cs)[0]
