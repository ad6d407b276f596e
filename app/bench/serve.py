"""``srl bench serve``: what publishing served completions to Kafka costs ``srl serve``.

Owns the serving figures of docs/serving.md and docs/benchmarks.md. One broker per run (the
CLI runs it on each ``--broker``, ``app.bench.brokers``), the same engine settings and the
same prompts for both modes:

* ``publish_off``: ``srl serve --no-publish`` as a child process;
* ``publish_on``: ``srl serve`` publishing every choice, chunk by chunk, to the trajectories
  topic (the default);

and two phases (``app.bench.serveload``): ``saturation`` (closed loop, more requests in flight
than the engine's batch) and ``rate`` (open loop at half the median *publish-off* saturated
rate, the same rate for both modes; every saturation round runs first).

Both servers start once and stay up; a **round** resumes one of them, warms it up (unmeasured
requests), measures one phase, and pauses it again (SIGSTOP), so the server not measured
takes no CPU. Rounds alternate the modes (off, on, on, off, …), so each ``publish_on`` round
has a ``publish_off`` round next to it in time: this machine's speed drifts by several per
cent within a minute (a plain matrix-multiply loop varies by ±8 % on the 2-core test machine),
more than the cost being measured. Results, each the **median over the pairs** of rounds:

* ``overhead_rps`` = 1 − rps(on) / rps(off) at saturation;
* ``overhead_itl_p50`` = p50 ITL(on) / p50 ITL(off) − 1 at the fixed rate (also
  ``overhead_ttft_p50`` and ``overhead_tpot_p50``, the per-request decode pace:
  ``app.bench.serveload``); a positive figure is a loss with publishing on. ``pairs`` keeps
  every pair's figures (their spread is the measurement's).

``--control`` runs the same rounds with publishing off in both servers (an A/A test): its
overheads are what the method reads where there is nothing to find, the floor under which a
publishing figure means nothing.

Where the machine has two CPUs or more, the servers run on the upper half of them and this
process (the load client) and the broker it starts on the lower half (``core_split``; the hf
engine then gets one torch thread per server CPU unless ``--threads`` says otherwise): the
figure is what publishing costs the serving host, as where the broker and the clients are
other machines, not how a broker and a client squeezed onto the same cores slow it down.

Each phase also records the server process's CPU seconds (``/proc``): ``cpu_ms_per_request``,
for information only; the broker's CPU is not counted. Per-phase server counters
(``server``) are the differences of ``/health`` over the measured requests.

The default engine is ``sim`` (decode time modelled as ``PTL(BS)``, see
``producers.engines.sim``), so the figure isolates the server and its data plane: the result
says ``simulated`` and every text line says SIMULATED. ``--engine hf --model DIR`` runs a
real model; the engine and Kafka settings are ``app.configs.ServeBenchConfig``'s, handed to
every server. Called by ``app.bench.cli``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Coroutine, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from app.bench.serveload import Load, fixed_rate, saturation, warm_up
from app.configs import ServeBenchConfig
from srl.broker import free_port
from srl.errors import SrlError
from srl.kafka import create_topics
from srl.secrets import env_name

MODES = ("publish_off", "publish_on")
SIM_LABEL = (
    "SIMULATED engine: decode steps sleep PTL(BS) x time_scale; HTTP, text, chunking and "
    "Kafka are real"
)

CONTROL_LABEL = (
    "CONTROL: both servers publish off (publish_on is a second publish-off server); the "
    "overheads are the measurement's own noise"
)


@dataclass(frozen=True)
class Plan:
    """The load of every phase (the engine and Kafka settings are the config's)."""

    max_tokens: int = 64  # tokens per completion
    requests: int = 200  # per phase
    concurrency: int | None = None  # saturation: requests in flight; None: 2 x max_batch
    repeats: int = 3  # rounds of each mode and phase
    prompt_seed: int = 0
    control: bool = False  # both servers publish off: the overheads are the measurement's noise

    def in_flight(self, cfg: ServeBenchConfig) -> int:
        return self.concurrency or 2 * cfg.max_batch


def bench_prompts(n: int, seed: int) -> tuple[str, ...]:
    rng = random.Random(seed)
    return tuple(
        f"request {i}: " + "".join(rng.choice("abcdefghij ") for _ in range(24)) for i in range(n)
    )


def _optional(flag: str, value: object) -> list[str]:
    return [] if value is None else [flag, str(value)]


def engine_args(cfg: ServeBenchConfig) -> list[str]:
    """The engine settings as ``srl serve`` options."""
    args = ["--engine", cfg.engine, "--device", cfg.device, "--max-batch", str(cfg.max_batch)]
    args += ["--chunk-tokens", str(cfg.chunk_tokens), "--time-scale", str(cfg.time_scale)]
    args += ["--sim-tokens-per-step", str(cfg.sim_tokens_per_step)]
    args += ["--sim-vocab", str(cfg.sim_vocab), "--scale", str(cfg.length_scale)]
    args += _optional("--model", cfg.model) + _optional("--dtype", cfg.dtype)
    args += _optional("--threads", cfg.threads) + _optional("--seed", cfg.seed)
    return args + _optional("--lengths", cfg.lengths)


def kafka_args(cfg: ServeBenchConfig) -> list[str]:
    """The broker, topics and producer settings as ``srl serve`` options; the librdkafka
    settings go by environment (:func:`kafka_env`): a command line is everyone's to read."""
    args = ["--bootstrap", cfg.bootstrap_servers, "--topic-prefix", cfg.topic_prefix]
    args += ["--compression", cfg.compression, "--linger-ms", str(cfg.linger_ms)]
    args += ["--bucket-bounds", ",".join(str(b) for b in cfg.bucket_bounds)]
    args += ["--partitions-per-bucket", str(cfg.partitions_per_bucket)]
    args += ["--prompt-partitions", str(cfg.prompt_partitions)]
    args += ["--connect-timeout-s", str(cfg.connect_timeout_s)]
    return args + (["--kafka-oauth-cb", cfg.kafka_oauth_cb] if cfg.kafka_oauth_cb else [])


def kafka_env(cfg: ServeBenchConfig) -> dict[str, str]:
    """This environment with the librdkafka settings as ``SRL_KAFKA_<NAME>`` variables."""
    return os.environ | {env_name(k): v for k, v in cfg.kafka.items()}


def _serve_args(cfg: ServeBenchConfig, store: str, port: int, publish: bool) -> list[str]:
    args = [sys.executable, "-c", "from app.cli.main import main; main()", "serve"]
    args += kafka_args(cfg) + engine_args(cfg) + ["--store", store, "--port", str(port)]
    args += ["--model-name", "bench", "--publish" if publish else "--no-publish"]
    return args + ["--max-n", "1", "--drain-timeout", "5"]


def _health(port: int) -> dict[str, Any] | None:
    import httpx

    try:
        r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
    except httpx.HTTPError:
        return None
    return dict(r.json()) if r.status_code == 200 else None


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a live process (Linux ``/proc``; 0.0 elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def core_split() -> tuple[frozenset[int], frozenset[int]] | None:
    """The servers' CPUs (the upper half of this process's) and the rest's (the load client,
    the broker); None with fewer than two CPUs."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cpus) < 2:
        return None
    half = len(cpus) // 2
    return frozenset(cpus[half:]), frozenset(cpus[:half])


@contextlib.contextmanager
def pinned(cpus: frozenset[int] | None) -> Iterator[None]:
    """This process (and every child it starts meanwhile: the broker) on ``cpus``."""
    if not cpus:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


@contextlib.contextmanager
def serve_process(
    cfg: ServeBenchConfig,
    store: str,
    publish: bool,
    timeout_s: float = 180,
    cpus: frozenset[int] | None = None,
) -> Iterator[tuple[int, int]]:
    """A ``srl serve`` child on a free port (on ``cpus`` when given), healthy: ``(port, pid)``;
    SIGTERM on exit (and SIGCONT, should it be paused)."""
    port = free_port()
    with tempfile.TemporaryFile("w+") as log:
        args = _serve_args(cfg, store, port, publish)
        pin = None if not cpus else functools.partial(os.sched_setaffinity, 0, cpus)
        proc = subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, preexec_fn=pin, env=kafka_env(cfg)
        )
        try:
            deadline = time.monotonic() + timeout_s
            while _health(port) is None:
                if proc.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    raise SrlError(f"srl serve did not start: {log.read()[-2000:]}")
                time.sleep(0.2)
            yield port, proc.pid
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.send_signal(signal.SIGCONT)  # a paused server acts on SIGTERM once resumed
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


def _measured(pid: int, phase: Coroutine[Any, Any, dict[str, Any]]) -> dict[str, Any]:
    """Run one load phase; add the server's CPU time over it."""
    cpu0 = process_cpu_s(pid)
    result = asyncio.run(phase)
    cpu = process_cpu_s(pid) - cpu0
    per_request = cpu / result["requests"] * 1000 if result["requests"] else 0.0
    return result | {"server_cpu_s": round(cpu, 3), "cpu_ms_per_request": round(per_request, 3)}


KEEP = ("published_chunks", "delivery_failures", "tokens", "completions")


@dataclass(frozen=True)
class _Server:
    """One started ``srl serve``, paused between its rounds."""

    port: int
    pid: int

    def pause(self) -> None:
        os.kill(self.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.pid, signal.SIGCONT)


def _counters(port: int) -> dict[str, Any]:
    health = _health(port) or {}
    return {k: health.get(k) for k in KEEP} | {"policy_version": health.get("policy_version")}


def _round(
    cfg: ServeBenchConfig, plan: Plan, server: _Server, rate: float | None
) -> dict[str, Any]:
    """Resume ``server``, warm it up, measure one phase (saturation when ``rate`` is None,
    else the fixed rate), pause it; the server's counters over the measured requests."""
    server.resume()
    try:
        prompts = bench_prompts(plan.requests, plan.prompt_seed)
        load = Load(f"http://127.0.0.1:{server.port}/v1", "bench", prompts, plan.max_tokens)
        asyncio.run(warm_up(load, cfg.max_batch))
        before = _counters(server.port)
        in_flight = plan.in_flight(cfg)
        if rate is None:
            result = _measured(server.pid, saturation(load, in_flight))
        else:
            result = _measured(server.pid, fixed_rate(load, rate, in_flight * 4))
        after = _counters(server.port)
    finally:
        server.pause()
    grown = {k: (after[k] or 0) - (before[k] or 0) for k in KEEP}
    return result | {"server": grown | {"policy_version": after["policy_version"]}}


WORST_COUNTS = ("errors", "delivery_failures")


def _combine(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Rounds of the same shape, leaf by leaf: the most errors, the median of the rest (the
    machine's speed drifts both ways, so the best round would flatter either mode)."""
    out: dict[str, Any] = {}
    for key, first in runs[0].items():
        values = [r[key] for r in runs]
        if isinstance(first, dict):
            out[key] = _combine(values)
        elif not isinstance(first, int | float) or isinstance(first, bool):
            out[key] = first
        elif key in WORST_COUNTS:
            out[key] = max(values)
        else:
            out[key] = round(statistics.median(values), 3)
    return out


def overheads(off: dict[str, Any], on: dict[str, Any]) -> dict[str, float | None]:
    """Fractional losses with publishing on (0.03 = 3 %) of one pair of rounds: ``off`` and
    ``on`` each hold a ``saturation`` and a ``rate`` phase."""

    def loss(a: float, b: float, higher_is_better: bool) -> float | None:
        if not a or not b:
            return None
        return round(1 - b / a if higher_is_better else b / a - 1, 4)

    return {
        "overhead_rps": loss(off["saturation"]["rps"], on["saturation"]["rps"], True),
        "overhead_itl_p50": loss(off["rate"]["itl_ms_p50"], on["rate"]["itl_ms_p50"], False),
        "overhead_ttft_p50": loss(off["rate"]["ttft_ms_p50"], on["rate"]["ttft_ms_p50"], False),
        "overhead_tpot_p50": loss(off["rate"]["tpot_ms_p50"], on["rate"]["tpot_ms_p50"], False),
    }


def paired(runs: dict[str, dict[str, list[dict[str, Any]]]]) -> list[dict[str, float | None]]:
    """The overheads of each pair of rounds (round ``r`` of either mode ran next to the
    other's round ``r``)."""
    off, on = (runs[m] for m in MODES)
    return [
        overheads({p: off[p][r] for p in off}, {p: on[p][r] for p in on})
        for r in range(len(off["saturation"]))
    ]


def _median_of(pairs: list[dict[str, float | None]], key: str) -> float | None:
    values = [v for p in pairs if (v := p[key]) is not None]
    return round(statistics.median(values), 4) if values else None


def _order(r: int) -> tuple[str, ...]:
    """Modes in alternating order, so a drift of the machine's speed favours neither."""
    return MODES if r % 2 == 0 else MODES[::-1]


def run(cfg: ServeBenchConfig, plan: Plan, cpus: frozenset[int] | None = None) -> dict[str, Any]:
    """Both servers on ``cfg``'s broker (on ``cpus`` when given: ``core_split``), then
    rounds: every saturation round, then every fixed-rate round at half the median publish-off
    saturated rate; modes alternate; the median of each mode's rounds, and of the pairs'
    overheads. On ``cpus``, the hf engine gets one torch thread per CPU unless ``--threads``
    says otherwise (torch would start one per core of the machine)."""
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        m: {"saturation": [], "rate": []} for m in MODES
    }
    if cpus and cfg.engine == "hf" and cfg.threads is None:
        cfg = cfg.model_copy(update={"threads": len(cpus)})
    with contextlib.ExitStack() as stack:
        prefix = f"{cfg.topic_prefix}.benchserve{uuid.uuid4().hex[:6]}"
        store = f"file://{stack.enter_context(tempfile.TemporaryDirectory())}"
        cfg = cfg.model_copy(update={"topic_prefix": prefix})
        create_topics(cfg)
        servers: dict[str, _Server] = {}
        for mode in MODES:
            publish = mode == MODES[1] and not plan.control
            started = serve_process(cfg, store, publish, cpus=cpus)
            servers[mode] = _Server(*stack.enter_context(started))
            servers[mode].pause()
        for r in range(plan.repeats):
            for mode in _order(r):
                runs[mode]["saturation"].append(_round(cfg, plan, servers[mode], None))
        rate = 0.5 * statistics.median(x["rps"] for x in runs["publish_off"]["saturation"])
        for r in range(plan.repeats):
            for mode in _order(r):
                runs[mode]["rate"].append(_round(cfg, plan, servers[mode], rate))
    off, on = ({p: _combine(runs[m][p]) for p in ("saturation", "rate")} for m in MODES)
    pairs = paired(runs)
    simulated = cfg.engine == "sim"
    settings: dict[str, Any] = {"engine": cfg.engine, "model": cfg.model}
    settings |= {"max_batch": cfg.max_batch, "threads": cfg.threads}
    settings |= {"chunk_tokens": cfg.chunk_tokens, "time_scale": cfg.time_scale}
    settings |= asdict(plan) | {"concurrency": plan.in_flight(cfg), "rate_rps": round(rate, 3)}
    settings |= {"server_cpus": sorted(cpus) if cpus else None}
    label = SIM_LABEL if simulated else f"{cfg.engine} engine, model {cfg.model}"
    if plan.control:
        label += f"; {CONTROL_LABEL}"
    return {
        "engine": cfg.engine,
        "simulated": simulated,
        "control": plan.control,
        "label": label,
        "settings": settings,
        "publish_off": off,
        "publish_on": on,
        **{k: _median_of(pairs, k) for k in pairs[0]},
        "pairs": pairs,
        "runs": runs,
    }


def text_report(r: dict[str, Any], broker: str = "") -> str:
    """The human-readable lines of ``srl bench serve`` (without --json) on one broker."""
    on = f" on the {broker} broker" if broker else ""
    lines = [("SIMULATED " if r["simulated"] else "") + f"srl serve, engine {r['engine']}{on}:"]
    if r.get("control"):
        lines.append(f"  {CONTROL_LABEL}")
    for mode in MODES:
        s, p = r[mode]["saturation"], r[mode]["rate"]
        lines.append(
            f"  {mode:<11} saturation {s['rps']:.2f} req/s (TTFT p50 {s['ttft_ms_p50']} ms, "
            f"ITL p50 {s['itl_ms_p50']} ms)  at {p['target_rps']:.2f} req/s: TTFT p50/p99 "
            f"{p['ttft_ms_p50']}/{p['ttft_ms_p99']} ms, ITL p50/p99 {p['itl_ms_p50']}/"
            f"{p['itl_ms_p99']} ms"
        )

    def pct(key: str) -> str:
        if r[key] is None:
            return "n/a"
        spread = [v for p in r.get("pairs", []) if (v := p[key]) is not None]
        rounds = f" (pairs {min(spread):.1%} … {max(spread):.1%})" if len(spread) > 1 else ""
        return f"{r[key]:.1%}{rounds}"

    lines.append(
        f"  publishing costs {pct('overhead_rps')} of requests/s at saturation and "
        f"{pct('overhead_itl_p50')} of p50 inter-token latency at half of it "
        f"({pct('overhead_tpot_p50')} of p50 time per output token)"
    )
    return "\n".join(lines)
