"""An OpenAI-API load client: streamed completions, closed-loop or at a fixed request rate.

Owns how ``srl bench serve`` measures a server. Each request is ``POST /v1/completions`` with
``stream: true``; the client notes the time of every server-sent event:

* time to first token (TTFT) = first event − the moment the request was sent;
* inter-token latency (ITL) = the gaps between a request's consecutive events (one event per
  decode step that produced text: one token for the sim engine);
* time per output token (TPOT, as vLLM's ``benchmark_serving`` has it) = (last event − first
  event) / (events − 1) of each request: its decode pace. Its p50 is steadier than ITL's where
  the gaps are of two kinds (the client reads several events per wake-up, a real tokenizer
  holds back a step's text), which makes the gaps' median jump between them;
* requests/s = completed requests / (last completion − first send).

``saturation`` keeps ``concurrency`` requests in flight (more than the engine's batch, so its
queue never runs dry); ``fixed_rate`` sends request ``i`` at ``i / rate`` seconds (open loop:
a slow server does not slow the arrivals). Percentiles pool every request of a phase.
Each request carries a seed derived from its prompt, so an engine that honours seeds (hf)
generates the same tokens for it in every run. Raw ``httpx`` (not the ``openai`` client)
keeps the client's own cost per event low.
Called by ``app.bench.serve``.
"""

from __future__ import annotations

import asyncio
import time
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class Sample:
    sent: float
    events: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return self.events[0] - self.sent if self.events else None

    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.events, self.events[1:], strict=False)]

    @property
    def tpot(self) -> float | None:
        """Time per output event after the first: the request's own decode pace."""
        n = len(self.events)
        return (self.events[-1] - self.events[0]) / (n - 1) if n > 1 else None


@dataclass(frozen=True)
class Load:
    url: str  # the server's /v1 base
    model: str
    prompts: tuple[str, ...]
    max_tokens: int
    timeout_s: float = 300.0


def _pct(values: list[float], q: float) -> float:
    return round(float(np.percentile(values, q)) * 1000, 3) if values else 0.0


def summarize(samples: list[Sample], wall_s: float) -> dict[str, Any]:
    """A phase's figures (milliseconds for latencies)."""
    ok = [s for s in samples if s.error is None and s.events]
    ttft = [t for s in ok if (t := s.ttft) is not None]
    gaps = [g for s in ok for g in s.gaps()]
    tpot = [t for s in ok if (t := s.tpot) is not None]
    events = sum(len(s.events) for s in ok)
    return {
        "requests": len(ok),
        "errors": len(samples) - len(ok),
        "first_error": next((s.error for s in samples if s.error), None),
        "wall_s": round(wall_s, 3),
        "rps": round(len(ok) / wall_s, 3) if wall_s > 0 else 0.0,
        "events_per_s": round(events / wall_s, 1) if wall_s > 0 else 0.0,
        "ttft_ms_p50": _pct(ttft, 50),
        "ttft_ms_p99": _pct(ttft, 99),
        "itl_ms_p50": _pct(gaps, 50),
        "itl_ms_p99": _pct(gaps, 99),
        "tpot_ms_p50": _pct(tpot, 50),
        "tpot_ms_p99": _pct(tpot, 99),
    }


async def one(client: Any, load: Load, prompt: str) -> Sample:
    """One streamed completion, timed."""
    body = {
        "model": load.model,
        "prompt": prompt,
        "max_tokens": load.max_tokens,
        "stream": True,
        "seed": zlib.crc32(prompt.encode()),  # the same tokens for a prompt in every run (hf)
    }
    s = Sample(time.perf_counter())
    try:
        async with client.stream("POST", f"{load.url}/completions", json=body) as r:
            if r.status_code != 200:
                s.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return s
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    break
                s.events.append(time.perf_counter())
    except Exception as e:  # a load client counts failures, whatever they are
        s.error = f"{type(e).__name__}: {e}"
    return s


def _client(load: Load, connections: int) -> Any:
    import httpx

    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    return httpx.AsyncClient(limits=limits, timeout=load.timeout_s)


async def warm_up(load: Load, n: int) -> None:
    """``n`` requests at once, not measured (connections, first allocations)."""
    async with _client(load, n + 4) as client:
        await asyncio.gather(*(one(client, load, p) for p in load.prompts[:n]))


async def saturation(load: Load, concurrency: int) -> dict[str, Any]:
    """Closed loop: ``concurrency`` requests always in flight, over every prompt once."""
    async with _client(load, concurrency + 4) as client:
        todo = list(reversed(load.prompts))
        samples: list[Sample] = []

        async def worker() -> None:
            while todo:
                samples.append(await one(client, load, todo.pop()))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return summarize(samples, wall) | {"concurrency": concurrency}


async def fixed_rate(load: Load, rate_rps: float, connections: int) -> dict[str, Any]:
    """Open loop: request ``i`` is sent at ``i / rate_rps`` seconds from the start."""
    async with _client(load, connections) as client:
        t0 = time.perf_counter()
        tasks = []
        for i, prompt in enumerate(load.prompts):
            delay = t0 + i / rate_rps - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(client, load, prompt)))
        samples = await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
    return summarize(list(samples), wall) | {"target_rps": round(rate_rps, 3)}
