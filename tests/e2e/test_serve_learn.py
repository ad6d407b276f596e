"""Serve and learn, end to end on the embedded broker: ``srl serve`` answers a client's stream
of requests (the official ``openai`` client, feedback by HTTP) while trainers with different
algorithms learn from the same traffic with the feedback as reward; a third trainer is added
mid-run (``--from latest``) and one removed; every served completion is in the log exactly
once, each trainer's policy versions advance, no request fails. The latencies are printed."""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from schemas.records import MetricEvent, WeightsAnnouncement, decode_as
from srl.broker import free_port
from srl.config import CommonConfig, load_config
from srl.topics import Layout
from tests.chunks import read_topic
from tests.conftest import bin_path
from tests.e2e.test_serve import served_trajectories, wait_healthy

PROMPTS = [f"{a}+{b}=" for a in range(10) for b in range(10)]


@dataclass
class Proc:
    name: str
    proc: subprocess.Popen[str]
    log: Path

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout=timeout_s)

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]


@dataclass
class Procs:
    env: dict[str, str]
    dir: Path
    all: list[Proc] = field(default_factory=list)

    def start(self, name: str, *args: str) -> Proc:
        log = self.dir / f"{name}.log"
        with open(log, "w") as out:
            p = subprocess.Popen(
                list(args), env=self.env, stdout=out, stderr=subprocess.STDOUT, text=True
            )
        self.all.append(Proc(name, p, log))
        return self.all[-1]

    def check(self) -> None:
        for p in self.all:
            rc = p.proc.poll()
            assert rc is None or rc == 0, f"{p.name} exited {rc}: {p.tail()}"

    def kill_all(self) -> None:
        for p in self.all:
            if p.proc.poll() is None:
                p.proc.kill()
            p.proc.wait(timeout=30)


@pytest.fixture
def procs(cli_env: dict[str, str], tmp_path: Path) -> Iterator[Procs]:
    ps = Procs(cli_env | {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}, tmp_path)
    try:
        yield ps
    finally:
        ps.kill_all()


def trainer(procs: Procs, model: Path, run: str, *extra: str) -> Proc:
    return procs.start(
        run,
        bin_path("srl-consumer"),
        "train",
        "--model",
        str(model),
        "--run",
        run,
        "--lead-run",
        "lead",
        "--batching",
        "groups",
        "--groups-per-step",
        "2",
        "--max-staleness",
        "8",
        "--micro-batch-tokens",
        "256",
        "--feedback-window-s",
        "20",
        "--device",
        "cpu",
        *extra,
    )


@dataclass
class Client:
    """Closed-loop load: each thread sends a completion (n = 2), then the feedback of both."""

    base: str
    stop: threading.Event = field(default_factory=threading.Event)
    latencies: list[float] = field(default_factory=list)
    completions: list[tuple[str, float]] = field(default_factory=list)  # id, when
    errors: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def loop(self, worker: int) -> None:
        client = openai.OpenAI(base_url=self.base, api_key="x", max_retries=0, timeout=60)
        i = worker
        while not self.stop.is_set():
            prompt = PROMPTS[i % len(PROMPTS)]
            i += 4
            t0 = time.monotonic()
            try:
                r = client.completions.create(
                    model="tiny", prompt=prompt, max_tokens=8, n=2, temperature=1.0
                )
                for c in r.choices:  # the application's check: a digit answers a sum
                    reward = float(any(ch.isdigit() for ch in c.text))
                    body = {"id": r.id, "index": c.index, "reward": reward}
                    fb = httpx.post(f"{self.base}/feedback", json=body, timeout=30)
                    fb.raise_for_status()
            except Exception as e:  # every failure is counted and fails the test
                with self.lock:
                    self.errors.append(f"{time.monotonic():.1f} {type(e).__name__}: {e}")
                continue
            with self.lock:
                self.latencies.append(time.monotonic() - t0)
                self.completions.append((r.id, time.monotonic()))


def versions(env: dict[str, str]) -> dict[str, list[int]]:
    """Announced policy versions per run, in log order."""
    cfg = load_config(CommonConfig, env={k: v for k, v in env.items() if k.startswith("SRL_")})
    out: dict[str, list[int]] = {}
    for m in read_topic(cfg, Layout.from_config(cfg).weights):
        a = decode_as(m.value(), WeightsAnnouncement)
        out.setdefault(a.run, []).append(a.version)
    return out


def trained_prompts(env: dict[str, str], run: str) -> set[str]:
    cfg = load_config(CommonConfig, env={k: v for k, v in env.items() if k.startswith("SRL_")})
    out = set()
    for m in read_topic(cfg, Layout.from_config(cfg).metrics):
        e = decode_as(m.value(), MetricEvent)
        if e.run == run and e.kind == "sample" and e.labels.get("outcome") == "trained":
            out.add(e.labels["prompt_id"])
    return out


def wait_until(check: Callable[[], bool], procs: Procs, what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        procs.check()
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


@pytest.mark.slow
@pytest.mark.timeout(900)  # under 2 minutes on an idle 2-core machine; process starts dominate
def test_serve_while_several_trainers_learn_from_the_feedback(
    procs: Procs, cli_env: dict[str, str], tiny_model: Path
) -> None:
    port = free_port()
    server = procs.start(
        "serve",
        bin_path("srl"),
        "serve",
        "--model",
        str(tiny_model),
        "--model-name",
        "tiny",
        "--port",
        str(port),
        "--follow-run",
        "lead",
        "--threads",
        "1",
        "--max-batch",
        "8",
        "--chunk-tokens",
        "4",
    )
    a = trainer(procs, tiny_model, "lead", "--advantage", "grpo", "--lr", "1e-3")
    b = trainer(procs, tiny_model, "rloo", "--advantage", "rloo", "--lr", "3e-4")
    wait_healthy(port, server.proc, server.log, timeout_s=300)
    client = Client(f"http://127.0.0.1:{port}/v1")
    threads = [threading.Thread(target=client.loop, args=(w,), daemon=True) for w in range(4)]
    for t in threads:
        t.start()
    try:
        wait_until(
            lambda: len(versions(cli_env).get("lead", [])) >= 2 and versions(cli_env).get("rloo"),
            procs,
            "the lead's v2 and the rloo trainer's v1",
            300,
        )
        added_at = time.monotonic()
        c = trainer(procs, tiny_model, "late", "--from", "latest", "--lr", "1e-3")
        assert b.stop() == 0, b.tail()  # removed; nothing else waits for it
        lead_then = max(versions(cli_env)["lead"])
        wait_until(
            lambda: (
                len(versions(cli_env).get("late", [])) >= 1
                and max(versions(cli_env)["lead"]) > lead_then
            ),
            procs,
            "the added trainer's v1 and the lead's next version",
            300,
        )
    finally:
        client.stop.set()
        for t in threads:
            t.join(90)
    assert not any(t.is_alive() for t in threads), "a request did not finish"
    assert server.stop() == 0, server.tail()
    for p in (a, c):
        assert p.stop() == 0, p.tail()

    assert not client.errors, client.errors[:5]
    lat = np.array(client.latencies) * 1000
    print(
        f"\nserve+learn: {len(lat)} requests (n=2, 8 tokens), latency p50 "
        f"{np.percentile(lat, 50):.0f} ms, p99 {np.percentile(lat, 99):.0f} ms"
    )
    # every served completion exactly once in the log, both choices, complete
    log = served_trajectories(cli_env)
    sent = [cid for cid, _ in client.completions]
    assert sorted(log) == sorted(sent) and all(len(log[cid]) == 2 for cid in sent)
    got = versions(cli_env)
    for run in ("lead", "rloo", "late"):
        assert got.get(run) and got[run] == sorted(got[run]), (run, got)
    assert len(got["lead"]) >= 3
    # the added trainer learnt only from traffic after it joined (--from latest)
    before = {cid for cid, at in client.completions if at < added_at - 1}
    late = trained_prompts(cli_env, "late")
    assert late and not late & before
