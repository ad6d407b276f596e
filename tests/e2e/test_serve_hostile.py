"""``srl serve`` as a real subprocess (sim engine) under what its data plane can do to it: a
record over the broker's limit, a broker stopped while it serves, no broker at all with
``--no-publish``. Every request is answered; what the log loses is counted, never the
server."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from srl.broker import EmbeddedBroker, free_port
from srl.broker.embedded import stop as stop_broker
from tests.conftest import bin_path
from tests.e2e.test_serve import served_trajectories, wait_healthy

Server = subprocess.Popen[str]


@contextmanager
def serve(
    env: dict[str, str], log: Path, *args: str
) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """``srl serve --engine sim`` on a free port with ``args``: its base URL and process."""
    port = free_port()
    cmd = [bin_path("srl"), "serve", "--engine", "sim", "--port", str(port), *args]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
    try:
        wait_healthy(port, proc, log)
        yield f"http://127.0.0.1:{port}", proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)


def complete(url: str, timeout_s: float = 60, **body: object) -> httpx.Response:
    body = {"model": "sim", "prompt": "hi", "max_tokens": 8} | body
    return httpx.post(f"{url}/v1/completions", json=body, timeout=timeout_s)


def stop(proc: subprocess.Popen[str]) -> int:
    proc.send_signal(signal.SIGTERM)
    return proc.wait(timeout=120)


@pytest.mark.slow
def test_no_publish_needs_no_broker(tmp_path: Path) -> None:
    """``--no-publish`` still created topics and waited for a broker, and failed without one."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SRL_")}
    env |= {"SRL_BOOTSTRAP_SERVERS": f"127.0.0.1:{free_port()}", "SRL_CONNECT_TIMEOUT_S": "2"}
    log = tmp_path / "serve.log"
    with serve(env, log, "--no-publish", "--time-scale", "0.01") as (url, proc):
        r = complete(url)
        assert r.status_code == 200, r.text
        assert httpx.get(f"{url}/health").json()["publish"] is False
        assert stop(proc) == 0, log.read_text()[-2000:]


@pytest.mark.slow
def test_a_record_over_the_brokers_limit_and_oversized_fields(
    cli_env: dict[str, str], tmp_path: Path
) -> None:
    """A prompt whose first chunk is over the broker's 1 MB record limit, and a 1.1 MB ``user``:
    each once raised on the engine thread and took the server down (every later request a
    503 with raw Kafka error text)."""
    log = tmp_path / "serve.log"
    with serve(cli_env, log, "--time-scale", "0.01", "--chunk-tokens", "4") as (url, proc):
        big = complete(url, prompt="x" * 300_000)  # the sim's prompt tokens: 1.2 MB packed
        assert big.status_code == 200, big.text
        user = complete(url, user="u" * 1_100_000)
        assert user.status_code == 400 and user.json()["error"]["param"] == "user"
        small = complete(url, n=2)
        assert small.status_code == 200
        health = httpx.get(f"{url}/health").json()
        assert health["status"] == "ok" and health["publish_dropped"] == 1
        assert stop(proc) == 0, log.read_text()[-2000:]
    assert "1 trajectories not published" in log.read_text()
    assert set(served_trajectories(cli_env)) == {small.json()["id"]}


@pytest.mark.slow
def test_a_stopped_broker_costs_training_data_not_answers(tmp_path: Path) -> None:
    """With the broker gone the producer's queue fills, and the old ``produce`` retried on the
    engine thread until it had room: every request hung. Now each record it cannot queue drops
    its trajectory, counted, and every request is answered. (Records wait 5 minutes for the
    broker: the old loop waited that long for room in the queue.)"""
    broker = EmbeddedBroker().__enter__()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SRL_")}
    env |= {
        "SRL_BOOTSTRAP_SERVERS": broker.bootstrap,
        "SRL_TOPIC_PREFIX": "hostile",
        "SRL_STORE": f"file://{tmp_path / 'store'}",
        "SRL_CONNECT_TIMEOUT_S": "2",
    }
    log = tmp_path / "serve.log"
    args = ["--time-scale", "0.01", "--chunk-tokens", "2"]
    args += ["-X", "queue.buffering.max.messages=20", "-X", "message.timeout.ms=300000"]
    try:
        with serve(env, log, *args) as (url, proc):
            assert complete(url).status_code == 200
            stop_broker(broker.data_dir)
            with ThreadPoolExecutor(4) as pool:
                answers = list(pool.map(lambda _: complete(url, n=2, timeout_s=30), range(16)))
            assert [r.status_code for r in answers] == [200] * 16
            health = httpx.get(f"{url}/health").json()
            assert health["status"] == "ok" and health["publish_dropped"] > 0
            rating = {"id": answers[0].json()["id"], "reward": 1.0}
            feedback = httpx.post(f"{url}/v1/feedback", json=rating, timeout=30)
            assert feedback.status_code == 503 and "retry-after" in feedback.headers
            code = stop(proc)  # the final flush cannot deliver: it says so and exits non-zero
        assert code != 0 and "not published" in log.read_text()
        assert "Traceback" not in log.read_text()
    finally:
        broker.__exit__()
