"""``srl bench trainer``: the trainer's compute on 1 and 2 CPU ranks, replicated vs sharded.

Owns the trainer figures of docs/benchmarks.md ("Training"). For each backend (``torch``:
parameters, gradients and AdamW state replicated, gradients all-reduced; ``fsdp``: FSDP2,
all of it sharded) and each rank count, it runs :func:`worker` in a fresh process group
(torchrun with gloo on loopback; one rank without), on the same synthetic rows as
``app.bench.train`` (prompt 32 tokens, completions log-normal around 128): each rank takes
its share of a step's rows, packs them into micro-batches (``consumers.batcher.pack``), runs
the same number as the other ranks (a lockstep backend needs it: short ranks run zero-weight
ones, as the trainer's rounds do), then the optimizer step. No Kafka: the compute alone.

Reported per run: completion tokens per second over all ranks (after one warm-up step), the
median step, and each rank's peak resident memory above what the process held before the
engine was built (``VmHWM`` − ``VmRSS`` from /proc), beside ``srl-consumer plan``'s figure for
the same model, ranks, backend and micro-batch budget (``consumers.plan``). Resident memory
counts more than the plan does (allocator caches, the CPU autograd's temporaries), and both
ranks share the machine's two cores: the sharded backend's gain here is memory, not speed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

from app.bench.train import model_spec, synthetic_rows
from app.bench.weights import SIZES
from app.demoplan import console_script
from consumers.backends import make_engine
from consumers.batcher import pack
from consumers.config import TrainConfig
from consumers.distributed import Dist
from consumers.plan import PlanOptions, plan_model
from consumers.train_engine import empty_micro_batch, make_micro_batch
from srl.config import load_config
from srl.errors import SrlError
from srl.ports import free_port
from srl.tinymodel import build_tiny_model

BACKENDS = ("torch", "fsdp")


def _memory_kib(field: str) -> int:
    """``VmRSS`` (now) or ``VmHWM`` (peak) of this process, in KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise SrlError(f"/proc/self/status has no {field}")


def _import_model_code(model: str) -> None:
    """Load transformers and the model's class (on the meta device: no weights), and run the
    CPU autograd once, so that their code and caches are in memory before the baseline."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model))
    x = torch.ones(4, requires_grad=True)
    (x * 2).sum().backward()


def worker(model: str, backend: str, steps: int, rows: int, budget: int) -> dict[str, Any] | None:
    """One rank of one run (see the module docstring); rank 0 returns the run's figures."""
    import numpy as np

    dist = Dist.from_env("cpu")
    rank, world = (0, 1) if dist is None else (dist.rank, dist.world)
    cli = {"model": model, "device": "cpu", "backend": backend, "lr": 1e-5}
    cfg = load_config(TrainConfig, cli=cli, env={})
    _import_model_code(model)  # libraries are not what the plan counts
    before = _memory_kib("VmRSS")
    engine = make_engine(cfg, dist)
    rng = np.random.default_rng(rank)
    times, tokens = [], 0
    for step in range(steps + 1):
        mine = synthetic_rows(rng, rows // world)
        groups = pack([r.length for r in mine], budget, cfg.packing)
        mbs = [make_micro_batch([mine[i] for i in mb], seq_mean=False) for mb in groups]
        n = [float(len(mbs)), float(sum(r.loss_tokens for r in mine))]
        total = n if dist is None else dist.all_reduce_floats(n, op="sum")
        most = len(mbs) if dist is None else int(dist.all_reduce_floats([n[0]], op="max")[0])
        t0 = time.perf_counter()
        for mb in mbs + [empty_micro_batch() for _ in range(most - len(mbs))]:
            engine.backward(mb)
        engine.step(total[1])
        if step:  # the first step warms up
            times.append(time.perf_counter() - t0)
            tokens += int(total[1])
    peak = (_memory_kib("VmHWM") - before) * 1024
    peaks = [peak] if dist is None else dist.gather_objects(peak)
    if dist is not None:
        dist.close()
    if rank:
        return None
    options = PlanOptions(ranks=world, backend=backend, micro_batch_tokens=budget)  # type: ignore[arg-type]
    # what a step holds; the publish bucket is not in it (nothing is published here)
    planned = sum(r.bytes for r in plan_model(model, options).rows if r.key != "publish_bucket")
    return {
        "backend": backend,
        "ranks": world,
        "tokens_per_s": round(tokens / sum(times), 1),
        "step_s_median": round(float(np.median(times)), 3),
        "peak_rss_mib": [round(p / 2**20, 1) for p in peaks],
        "plan_mib": round(planned / 2**20, 1),
    }


SPECS = ("test", "default", "10M")


def spec_of(name: str) -> Any:
    """``test``, ``default`` (the demo model, 0.9M) or ``10M`` (``srl bench weights``'s)."""

    return SIZES[name] if name == "10M" else model_spec(name)


def _argv(ranks: int, args: list[str]) -> list[str]:

    if ranks == 1:
        return [sys.executable, "-m", "app.bench.trainranks", *args]
    rdzv = ["--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    nodes = ["--nnodes", "1", "--nproc-per-node", str(ranks), *rdzv]
    return console_script("torchrun", *nodes, "-m", "app.bench.trainranks", *args)


def run(
    backends: list[str], ranks: list[int], steps: int, rows: int, budget: int, spec: str
) -> dict[str, Any]:
    """Every (backend, ranks) run, one after the other, each in processes of its own."""

    env = os.environ | {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    out = []
    with tempfile.TemporaryDirectory(prefix="srl-bench-trainer-") as tmp:
        model = str(build_tiny_model(tmp, spec_of(spec)))
        for backend in backends:
            for n in ranks:
                if backend == "fsdp" and n == 1:
                    continue  # FSDP on one rank is the torch backend (refused at start)
                args = ["worker", model, backend, str(steps), str(rows), str(budget)]
                done = subprocess.run(
                    _argv(n, args), env=env, capture_output=True, text=True, timeout=1800
                )
                lines = [x for x in done.stdout.splitlines() if x.startswith("{")]
                if done.returncode or not lines:
                    raise SrlError(f"{backend} on {n} ranks failed: {done.stderr[-2000:]}")
                out.append(orjson.loads(lines[-1]))
    return {"spec": spec, "steps": steps, "rows_per_step": rows, "budget": budget, "runs": out}


if __name__ == "__main__":  # a worker: python -m app.bench.trainranks worker MODEL BACKEND …
    _, _, model_dir, backend_name, *nums = sys.argv
    steps_, rows_, budget_ = (int(x) for x in nums)
    result = worker(model_dir, backend_name, steps_, rows_, budget_)
    if result is not None:
        print(orjson.dumps(result).decode(), flush=True)
    # Done (figures printed, process group destroyed): leave without the interpreter's and
    # the C++ libraries' teardown. Under load about 1 run in 25 had rank 1 abort there after
    # a clean finish ("terminate called without an active exception", or SIGSEGV; no Python
    # frame left), and torchrun reported the whole run failed.
    sys.stderr.flush()
    os._exit(0)
