"""``srl serve`` as a real subprocess on the tiny model, driven by the official ``openai``
client; every served completion must then be in the trajectories log exactly once, with
source ``serve``."""

from __future__ import annotations

import signal
import subprocess
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import orjson
import pytest

from schemas.records import TrajectoryChunk, decode_as
from srl.broker import free_port
from srl.config import CommonConfig, load_config
from srl.tinymodel import load_tokenizer
from srl.topics import Layout
from tests.chunks import read_topic
from tests.conftest import bin_path


@dataclass
class Server:
    url: str
    proc: subprocess.Popen[str]
    log: Path

    def stop(self) -> int:
        """SIGTERM, and the exit code (the producer is flushed before it)."""
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=60)


def wait_healthy(port: int, proc: subprocess.Popen[str], log: Path, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, f"srl serve exited {proc.returncode}: {log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)


@pytest.fixture
def server(cli_env: dict[str, str], tiny_model: Path, tmp_path: Path) -> Iterator[Server]:
    port = free_port()
    log = tmp_path / "serve.log"
    args = [
        bin_path("srl"),
        "serve",
        "--model",
        str(tiny_model),
        "--model-name",
        "tiny",
        "--port",
        str(port),
        "--threads",
        "1",
        "--max-batch",
        "4",
        "--chunk-tokens",
        "4",
    ]
    with open(log, "w") as out:
        proc = subprocess.Popen(args, env=cli_env, stdout=out, stderr=subprocess.STDOUT, text=True)
    try:
        wait_healthy(port, proc, log)
        yield Server(f"http://127.0.0.1:{port}/v1", proc, log)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)


def served_trajectories(env: dict[str, str]) -> dict[str, list[list[TrajectoryChunk]]]:
    """The log's trajectories by prompt id (= completion id), each checked complete and
    consistent, none twice."""
    cfg = load_config(CommonConfig, env={k: v for k, v in env.items() if k.startswith("SRL_")})
    seen: dict[str, dict[int, TrajectoryChunk]] = defaultdict(dict)
    for msg in read_topic(cfg, Layout.from_config(cfg).trajectories):
        c = decode_as(msg.value(), TrajectoryChunk)
        assert c.seq not in seen[c.trajectory_id], f"chunk {c.trajectory_id}/{c.seq} twice"
        seen[c.trajectory_id][c.seq] = c
    out: dict[str, list[list[TrajectoryChunk]]] = defaultdict(list)
    for chunks in seen.values():
        cs = [chunks[s] for s in sorted(chunks)]
        assert [c.seq for c in cs] == list(range(len(cs))) and cs[-1].is_last
        assert cs[-1].finish_reason in ("stop", "length")
        offset = 0
        for c in cs:
            assert c.token_offset == offset and len(c.logprob_values()) == c.n_tokens
            offset += c.n_tokens
        meta = orjson.loads(cs[0].metadata or "{}")
        assert meta["source"] == "serve" and meta["completion_id"] == cs[0].prompt_id
        out[cs[0].prompt_id].append(cs)
    return out


@pytest.mark.slow
def test_openai_client_gets_completions_and_each_lands_in_the_log_once(
    server: Server, cli_env: dict[str, str], tiny_model: Path
) -> None:
    client = openai.OpenAI(base_url=server.url, api_key="x", max_retries=0, timeout=120)
    assert [m.id for m in client.models.list().data] == ["tiny"]

    plain = client.completions.create(
        model="tiny", prompt="12+34=", max_tokens=12, n=2, seed=5, user="app-user"
    )
    assert len(plain.choices) == 2 and plain.usage is not None
    assert all(c.finish_reason in ("stop", "length") for c in plain.choices)

    pieces: list[str] = []
    streamed_id, finish = "", None
    for chunk in client.completions.create(
        model="tiny", prompt="7*6=", max_tokens=16, stream=True, temperature=0.7
    ):
        streamed_id = chunk.id
        pieces.append(chunk.choices[0].text)
        finish = chunk.choices[0].finish_reason or finish
    assert finish in ("stop", "length") and len(pieces) >= 1

    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=8
    )
    assert chat.choices[0].message.role == "assistant"
    chat_stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6, stream=True
    )
    chat_chunks = list(chat_stream)
    assert {c.id for c in chat_chunks} == {chat_chunks[0].id}
    assert chat_chunks[0].choices[0].delta.role == "assistant"
    assert chat_chunks[-1].choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="x" * 5000, max_tokens=2)

    assert server.stop() == 0, server.log.read_text()[-3000:]
    assert "srl serve: http://127.0.0.1:" in server.log.read_text()

    log = served_trajectories(cli_env)
    # every served completion once; the refused requests left nothing
    assert set(log) == {plain.id, streamed_id, chat.id, chat_chunks[0].id}
    tokenizer = load_tokenizer(tiny_model)
    for choice in plain.choices:
        (cs,) = [t for t in log[plain.id] if t[0].sample_index == choice.index]
        tokens = [t for c in cs for t in c.token_ids().tolist()]
        assert tokenizer.decode(tokens, skip_special_tokens=True) == choice.text
        assert cs[0].group_size == 2
        meta = orjson.loads(cs[0].metadata or "{}")
        assert meta["request"] | {"seed": 5, "user": "app-user", "n": 2} == meta["request"]
    assert sum(len(c.token_ids()) for cs in log[plain.id] for c in cs) == (
        plain.usage.completion_tokens
    )
    (streamed,) = log[streamed_id]
    text = tokenizer.decode(
        [t for c in streamed for t in c.token_ids().tolist()], skip_special_tokens=True
    )
    assert text == "".join(pieces)


@pytest.mark.slow
def test_bench_serve_json_shape(cli_env: dict[str, str]) -> None:
    """``srl bench serve --json`` at a tiny size: the shape and the arithmetic, not speed."""
    out = subprocess.run(
        [bin_path("srl"), "bench", "serve", "--requests", "6", "--max-batch", "2"]
        + ["--max-tokens", "4", "--time-scale", "0.2", "--repeats", "2", "--json"],
        capture_output=True,
        text=True,
        env=cli_env,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    (r,) = orjson.loads(out.stdout).values()  # the test broker (SRL_BOOTSTRAP_SERVERS)
    assert r["simulated"] is True and "SIMULATED" in r["label"]
    for mode, chunks in (("publish_off", 0), ("publish_on", 1)):
        for phase in ("saturation", "rate"):
            p = r[mode][phase]
            assert p["requests"] == 6 and p["errors"] == 0, p
            keys = ("rps", "ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p99", "tpot_ms_p50")
            for key in keys:
                assert p[key] > 0, (mode, phase, key)
            assert p["ttft_ms_p50"] <= p["ttft_ms_p99"] and p["itl_ms_p50"] <= p["itl_ms_p99"]
            assert p["tpot_ms_p50"] <= p["tpot_ms_p99"]
            for rnd in r["runs"][mode][phase]:  # the server's counters over the measured requests
                server = rnd["server"]  # (the warm-up's are not counted)
                assert server["delivery_failures"] == 0 and server["tokens"] == 6 * 4
                assert server["completions"] == 6
                assert (server["published_chunks"] >= 6) == bool(chunks), server
        assert r[mode]["rate"]["target_rps"] == r["settings"]["rate_rps"]
    # each figure: the median over the pairs of rounds that ran next to each other
    runs, pairs = r["runs"], r["pairs"]
    assert len(pairs) == 2
    for i, pair in enumerate(pairs):
        off, on = (runs[m]["saturation"][i]["rps"] for m in ("publish_off", "publish_on"))
        assert pair["overhead_rps"] == pytest.approx(1 - on / off, abs=1e-3)
        itl_off, itl_on = (runs[m]["rate"][i]["itl_ms_p50"] for m in ("publish_off", "publish_on"))
        assert pair["overhead_itl_p50"] == pytest.approx(itl_on / itl_off - 1, abs=1e-3)
    for key in ("overhead_rps", "overhead_itl_p50", "overhead_tpot_p50"):
        assert r[key] == pytest.approx(sum(p[key] for p in pairs) / 2, abs=1e-3)
    off_rps = [x["rps"] for x in runs["publish_off"]["saturation"]]
    assert r["publish_off"]["saturation"]["rps"] == pytest.approx(sum(off_rps) / 2, abs=1e-3)
    assert r["settings"]["rate_rps"] == pytest.approx(0.25 * sum(off_rps), rel=1e-3)


@pytest.mark.slow
def test_bench_serve_control_publishes_nothing(cli_env: dict[str, str]) -> None:
    """``--control`` (the A/A test): both servers publish off, and the output says so."""
    from app.bench.serve import text_report

    out = subprocess.run(
        [bin_path("srl"), "bench", "serve", "--requests", "4", "--max-batch", "2"]
        + ["--max-tokens", "3", "--time-scale", "0.2", "--repeats", "1", "--control", "--json"],
        capture_output=True,
        text=True,
        env=cli_env,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    (r,) = orjson.loads(out.stdout).values()
    assert r["control"] is True and "CONTROL" in r["label"]
    assert "CONTROL: both servers publish off" in text_report(r)
    for mode in ("publish_off", "publish_on"):
        for phase in ("saturation", "rate"):
            assert r[mode][phase]["server"]["published_chunks"] == 0
            assert r[mode][phase]["requests"] == 4
