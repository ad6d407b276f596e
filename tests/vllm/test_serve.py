"""``srl serve --engine vllm`` as a real subprocess (one server for the module, on the embedded
broker), driven by the official ``openai`` client: the OpenAI contract the hf engine's server
passes (``tests/e2e/test_serve.py``, and the engine-independent checks of
``tests/unit/test_serve_contract.py``), each served completion in the trajectories log once,
its log-probs the trainer's recompute, and a published weights version swapped in while it
serves.

The model is the tiny one at random init: its text is arbitrary bytes, so the checks compare
token ids and log-probs with the log, and text only where the tokenizer decodes the log's
tokens the same way (never one token at a time: a byte token alone may be half a
character)."""

from __future__ import annotations

import signal
import subprocess
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest

from schemas.records import TrajectoryChunk, decode_as, unpack_tokens
from srl.config import CommonConfig, load_config
from srl.ports import free_port
from srl.tinymodel import load_tokenizer
from srl.topics import Layout
from tests.chunks import read_topic
from tests.conftest import bin_path, cli_environment, delete_topics
from tests.e2e.test_serve import wait_healthy
from tests.integration.test_generation import publish_weights
from tests.vllm.test_engine import TOL, hf_model, perturbed, recomputed

pytestmark = pytest.mark.embedded

MODEL = "tiny"


@dataclass
class Served:
    url: str  # .../v1
    proc: subprocess.Popen[str]
    log: Path
    env: dict[str, str]

    @property
    def base(self) -> str:
        return self.url.removesuffix("/v1")

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url, api_key="x", max_retries=0, timeout=120)

    def cfg(self) -> CommonConfig:
        env = {k: v for k, v in self.env.items() if k.startswith("SRL_")}
        return load_config(CommonConfig, env=env)

    def logged(self, completion_id: str, n: int, timeout_s: float = 30) -> list[Trajectory]:
        """The log's ``n`` trajectories of one completion once each is complete, by choice
        index (the last chunks may still be on their way when the response is back)."""
        deadline = time.monotonic() + timeout_s
        while True:
            found = trajectories(self.cfg(), completion_id)
            if len(found) == n and all(t.complete for t in found):
                return found
            assert time.monotonic() < deadline, f"{completion_id}: {len(found)} of {n} logged"
            time.sleep(0.2)

    def health(self) -> dict[str, Any]:
        return dict(httpx.get(f"{self.base}/health", timeout=10).json())


@dataclass
class Trajectory:
    chunks: list[TrajectoryChunk]

    @property
    def complete(self) -> bool:
        seqs = [c.seq for c in self.chunks]
        return seqs == list(range(len(seqs))) and bool(seqs) and self.chunks[-1].is_last

    @property
    def tokens(self) -> list[int]:
        return [t for c in self.chunks for t in c.token_ids().tolist()]

    @property
    def logprobs(self) -> list[float]:
        return [lp for c in self.chunks for lp in c.logprob_values().tolist()]

    @property
    def prompt(self) -> list[int]:
        """The prompt's token ids as the server tokenized it (on the first chunk)."""
        return [int(t) for t in unpack_tokens(self.chunks[0].prompt_tokens or b"")]

    @property
    def finish_reason(self) -> str | None:
        return self.chunks[-1].finish_reason

    @property
    def meta(self) -> dict[str, Any]:
        return dict(orjson.loads(self.chunks[0].metadata or "{}"))


def whole_log(cfg: CommonConfig) -> dict[str, list[Trajectory]]:
    """Every trajectory on the topic now, by completion id and sample index; no chunk twice."""
    by_id: dict[str, dict[int, TrajectoryChunk]] = defaultdict(dict)
    for msg in read_topic(cfg, Layout.from_config(cfg).trajectories):
        c = decode_as(msg.value(), TrajectoryChunk)
        assert c.seq not in by_id[c.trajectory_id], f"chunk {c.trajectory_id}/{c.seq} twice"
        by_id[c.trajectory_id][c.seq] = c
    out: dict[str, list[Trajectory]] = defaultdict(list)
    for cs in by_id.values():
        t = Trajectory([cs[s] for s in sorted(cs)])
        out[t.chunks[0].prompt_id].append(t)
    return {k: sorted(v, key=lambda t: t.chunks[0].sample_index) for k, v in out.items()}


def trajectories(cfg: CommonConfig, completion_id: str) -> list[Trajectory]:
    """Every trajectory of ``completion_id`` on the topic now, by sample index."""
    return whole_log(cfg).get(completion_id, [])


@pytest.fixture(scope="module")
def served(
    embedded_bootstrap: str, vllm_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("vllm-serve")
    prefix = f"t{uuid.uuid4().hex[:10]}"
    env = cli_environment(embedded_bootstrap, prefix, tmp)
    port = free_port()
    log = tmp / "serve.log"
    args = [
        bin_path("srl"),
        "serve",
        "--engine",
        "vllm",
        "--model",
        str(vllm_model),
        "--model-name",
        MODEL,
        "--port",
        str(port),
        "--max-batch",
        "4",
        "--chunk-tokens",
        "4",
        "--dtype",
        "float32",
        "--kv-cache-gib",
        "0.25",
        "--max-model-len",
        "512",
    ]
    with open(log, "w") as out:
        proc = subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
    try:
        wait_healthy(port, proc, log, timeout_s=300)
        yield Served(f"http://127.0.0.1:{port}/v1", proc, log, env)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
        delete_topics(embedded_bootstrap, prefix)


# -- the hf engine's end-to-end contract (tests/e2e/test_serve.py) ------------------------------
def test_completions_chat_and_streams_each_land_in_the_log(
    served: Served, vllm_model: Path
) -> None:
    client = served.client()
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert served.health()["engine"] == "vllm"
    tokenizer = load_tokenizer(vllm_model)

    plain = client.completions.create(
        model=MODEL, prompt="12+34=", max_tokens=12, n=2, seed=5, user="app-user"
    )
    assert len(plain.choices) == 2 and plain.usage is not None
    assert all(c.finish_reason in ("stop", "length") for c in plain.choices)
    logged = served.logged(plain.id, 2)
    for choice, t in zip(plain.choices, logged, strict=True):
        assert tokenizer.decode(t.tokens, skip_special_tokens=True) == choice.text
        assert t.finish_reason == choice.finish_reason and t.chunks[0].group_size == 2
        assert t.meta["source"] == "serve" and t.meta["completion_id"] == plain.id
        assert t.meta["request"] | {"seed": 5, "user": "app-user", "n": 2} == t.meta["request"]
    assert sum(len(t.tokens) for t in logged) == plain.usage.completion_tokens

    pieces: list[str] = []
    streamed_id, finish = "", None
    for chunk in client.completions.create(
        model=MODEL, prompt="7*6=", max_tokens=16, stream=True, temperature=0.7
    ):
        streamed_id = chunk.id
        pieces.append(chunk.choices[0].text)
        finish = chunk.choices[0].finish_reason or finish
    assert finish in ("stop", "length") and len(pieces) >= 1
    (streamed,) = served.logged(streamed_id, 1)
    assert tokenizer.decode(streamed.tokens, skip_special_tokens=True) == "".join(pieces)

    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=8
    )
    assert chat.choices[0].message.role == "assistant"
    chat_chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6, stream=True
        )
    )
    assert {c.id for c in chat_chunks} == {chat_chunks[0].id}
    assert chat_chunks[0].choices[0].delta.role == "assistant"
    assert chat_chunks[-1].choices[0].finish_reason in ("stop", "length")
    served.logged(chat.id, 1)
    served.logged(chat_chunks[0].id, 1)


def test_refused_requests_leave_nothing_in_the_log(served: Served) -> None:
    client = served.client()
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x", max_tokens=2)
    # prompt + max_tokens over the engine's --max-model-len 512: refused before vLLM sees it
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x" * 5000, max_tokens=2)
    for kw, param in (
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"logit_bias": {"5": 1}}, "logit_bias"),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "x"}],
                max_tokens=2,
                **kw,  # type: ignore[arg-type]
            )
        body = e.value.body
        assert isinstance(body, dict) and body["param"] == param
        assert body["code"] == "unsupported_parameter"
    assert served.health()["status"] == "ok"


# -- the contract's engine-dependent parts (tests/unit/test_serve_contract.py) ------------------
def test_logprobs_are_the_logs_behaviour_logprobs_and_the_trainers(
    served: Served, vllm_model: Path
) -> None:
    client = served.client()
    r = client.completions.create(
        model=MODEL, prompt="hi", max_tokens=5, logprobs=2, n=2, seed=1, temperature=0.8
    )
    model = hf_model(vllm_model, {})  # v0: the model directory's own weights
    for choice, t in zip(r.choices, served.logged(r.id, 2), strict=True):
        lp = choice.logprobs
        assert lp is not None and lp.token_logprobs and lp.top_logprobs and lp.tokens
        assert lp.token_logprobs == pytest.approx(t.logprobs, abs=1e-6)
        assert len(lp.tokens) == len(t.tokens) == len(lp.top_logprobs)
        # the sampled token and the 2 most likely, keyed by text (byte tokens may decode alike)
        tops = zip(lp.tokens, lp.top_logprobs, strict=True)
        assert all(tok in top and 1 <= len(top) <= 3 for tok, top in tops)
        expected = recomputed(model, t.prompt, t.tokens, 0.8)
        assert max(abs(a - b) for a, b in zip(t.logprobs, expected, strict=True)) < TOL
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_completion_tokens=4,
        logprobs=True,
        top_logprobs=3,
    )
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == chat.usage.completion_tokens  # type: ignore[union-attr]
    assert all(len(tok.top_logprobs) == 3 for tok in content)
    (t,) = served.logged(chat.id, 1)
    assert [tok.logprob for tok in content] == pytest.approx(t.logprobs, abs=1e-6)


def test_usage_n_and_max_completion_tokens_in_streams(served: Served) -> None:
    client = served.client()
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "x"}],
            max_completion_tokens=3,
            n=2,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    logged = served.logged(chunks[0].id, 2)
    assert chunks[-1].usage.completion_tokens == sum(len(t.tokens) for t in logged)
    assert all(1 <= len(t.tokens) <= 3 for t in logged)
    finished: dict[int, str] = {}
    for chunk in client.completions.create(model=MODEL, prompt="x", max_tokens=4, n=3, stream=True):
        for c in chunk.choices:
            if c.finish_reason:
                finished[c.index] = c.finish_reason
    assert sorted(finished) == [0, 1, 2]
    assert set(finished.values()) <= {"stop", "length"}


def test_a_seed_gives_the_same_tokens_whatever_runs_beside_it(served: Served) -> None:
    client = served.client()

    def tokens(seed: int) -> list[list[int]]:
        r = client.completions.create(model=MODEL, prompt="s", max_tokens=8, n=2, seed=seed)
        return [t.tokens for t in served.logged(r.id, 2)]

    alone = tokens(42)
    other = threading.Thread(
        target=client.completions.create,
        kwargs={"model": MODEL, "prompt": "o", "max_tokens": 40},
    )
    other.start()
    beside = tokens(42)
    other.join()
    assert alone == beside and alone[0] != alone[1]
    assert tokens(43) != alone


def test_a_stream_is_cancelled_mid_way_and_logged_as_aborted(served: Served) -> None:
    before = served.health()["cancelled"]
    stream = served.client().completions.create(
        model=MODEL, prompt="x", max_tokens=400, stream=True
    )
    completion_id = ""
    for i, chunk in enumerate(stream):
        completion_id = chunk.id
        if i == 2:
            break
    stream.close()
    deadline = time.monotonic() + 30
    while served.health()["cancelled"] <= before:
        assert time.monotonic() < deadline, served.health()
        time.sleep(0.05)
    (t,) = served.logged(completion_id, 1)
    assert t.finish_reason == "abort" and 0 < len(t.tokens) < 400


def test_a_published_version_is_served_with_its_logprobs(served: Served, vllm_model: Path) -> None:
    """The server follows the run's weights: the version is swapped into the vLLM engine
    between decode steps, and what it serves next carries that version and the new
    weights' log-probs."""
    weights = perturbed(vllm_model, seed=7)
    publish_weights(served.cfg(), 1, weights)
    deadline = time.monotonic() + 60
    while served.health()["policy_version"] < 1:
        assert time.monotonic() < deadline, served.log.read_text()[-2000:]
        time.sleep(0.2)
    r = served.client().completions.create(
        model=MODEL, prompt="hi", max_tokens=6, temperature=1.0, seed=3
    )
    (t,) = served.logged(r.id, 1)
    assert {c.policy_version for c in t.chunks} == {1}
    expected = recomputed(hf_model(vllm_model, weights), t.prompt, t.tokens, 1.0)
    assert max(abs(a - b) for a, b in zip(t.logprobs, expected, strict=True)) < TOL


def test_sigterm_flushes_and_every_completion_is_in_the_log_once(served: Served) -> None:
    """Last in the module: it stops the server."""
    served.proc.send_signal(signal.SIGTERM)
    assert served.proc.wait(timeout=120) == 0, served.log.read_text()[-3000:]
    text = served.log.read_text()
    assert "srl serve: http://127.0.0.1:" in text and "engine vllm" in text
    log = whole_log(served.cfg())  # no chunk twice
    assert len(log) >= 10
    ends = [t.finish_reason for ts in log.values() for t in ts]
    assert all(t.complete for ts in log.values() for t in ts)
    assert "abort" in ends and set(ends) <= {"stop", "length", "abort"}
