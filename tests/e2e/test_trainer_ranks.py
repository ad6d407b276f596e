"""Two CPU ranks (torchrun, gloo) and one rank trained on the same records give the same weights."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from srl.broker import free_port
from srl.config import CommonConfig
from srl.kafka import create_topics
from srl.stores import open_store
from srl.weights import Manifest, fetch_tensors, version_prefix
from tests.chunks import produce
from tests.conftest import bin_path, cli_environment, delete_topics
from tests.integration.test_trainer import make_groups

ARGS = [
    "train",
    "--groups-per-step",
    "2",
    "--max-steps",
    "3",
    "--micro-batch-tokens",
    "40",
    "--lr",
    "1e-3",
    "--idle-exit-s",
    "5",
    "--device",
    "cpu",
    "--loss",
    "decoupled",
    "--updates-per-step",
    "2",
    "--max-staleness",
    "100",
    "--reward",
    "consumers.rewards:first_line_match",
]

Env = dict[str, str]


def weights(store_url: str, run: str, version: int) -> dict[str, torch.Tensor]:
    store = open_store(store_url)
    key = f"{version_prefix(run, version)}/manifest.json"
    return fetch_tensors(store, Manifest.from_json(store.get(key)))


@pytest.fixture(scope="module")
def one_rank(
    default_bootstrap: str, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Env]:
    """Records on one partition (every run sees them in the same order and forms the same
    steps), then run "one": a single torch rank, 3 steps. Produced and trained once for the
    module: each two-rank run reads the same records under its own run name (its own consumer
    group, weights and checkpoints). Yields the environment for those runs."""
    prefix = f"t{uuid.uuid4().hex[:10]}"
    cli_env = cli_environment(default_bootstrap, prefix, tmp_path_factory.mktemp("ranks"))
    env = {**cli_env, "SRL_PARTITIONS_PER_BUCKET": "1", "GLOO_SOCKET_IFNAME": "lo"}
    cfg = CommonConfig(
        bootstrap_servers=default_bootstrap, topic_prefix=prefix, partitions_per_bucket=1
    )
    create_topics(cfg)
    produce(cfg, make_groups(6, seed=3))
    # the run name goes by SRL_RUN: torchrun would take a --run after the module for its own
    one = subprocess.run(
        [bin_path("srl-consumer"), *ARGS, "--model", str(tiny_model)],
        env={**env, "SRL_RUN": "one"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert one.returncode == 0, one.stderr[-3000:]
    assert "trained 3 steps; policy version 3" in one.stdout
    yield env
    delete_topics(default_bootstrap, prefix)


def two_ranks(env: Env, tiny_model: Path, run: str, *extra: str, ranks: int = 2) -> str:
    """Run ``run`` on ``ranks`` gloo ranks under torchrun; returns its stdout."""
    two = subprocess.run(
        [
            bin_path("torchrun"),
            "--nnodes",
            "1",
            "--nproc-per-node",
            str(ranks),
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(free_port()),
            "-m",
            "app.cli.consumer",
            *ARGS,
            "--model",
            str(tiny_model),
            *extra,
        ],
        env={**env, "SRL_RUN": run},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert two.returncode == 0, two.stderr[-3000:]
    return two.stdout


def check_against_one(env: Env, run: str, out: str, steps: int) -> float:
    """``run`` trained ``steps`` steps on two ranks, rank 1 trained micro-batches of its own,
    and its weights at ``steps`` equal one torch rank's there (which moved from v1 by then);
    returns the difference."""
    assert f"trained {steps} steps; policy version {steps}" in out, out[-2000:]
    rank1 = [line for line in out.splitlines() if line.startswith(f"rank 1: {steps} steps")]
    assert rank1 and int(rank1[0].split()[4]) > 0, f"rank 1 trained micro-batches: {out}"
    a, b = weights(env["SRL_STORE"], "one", steps), weights(env["SRL_STORE"], run, steps)
    start = weights(env["SRL_STORE"], "one", 1)  # v1 already moved from v0; compare with it
    assert a.keys() == b.keys()
    diff = max((a[k] - b[k]).abs().max().item() for k in a)
    moved = max((a[k] - start[k]).abs().max().item() for k in a)
    print(f"{run} vs 1 rank at v{steps}: weights moved {moved:.2e} from v1, differ by {diff:.2e}")
    assert moved > 1e-4 and diff < 1e-5, f"moved {moved:.2e}, 1 vs 2 ranks differ by {diff:.2e}"
    return diff


def has_deepspeed() -> bool:
    import importlib.util

    return importlib.util.find_spec("deepspeed") is not None


needs_deepspeed = pytest.mark.skipif(
    not has_deepspeed(), reason="deepspeed is not installed (the .[deepspeed] extra)"
)


# ZeRO-2 runs its micro-batches in lockstep at the step, ZeRO-3 in rounds as they fill (every
# forward all-gathers parameters); 24-token micro-batches give the two ranks 2 and 1 of them
# per step, so rank 1 pads with a zero-weight backward. ZeRO-1 and ZeRO-3 also run in
# test_zero_on_two_ranks_resumes_from_its_checkpoint_to_the_same_weights: its first run is the
# straight-through one, compared at its last step.
BACKENDS = [
    pytest.param([], id="fsdp"),  # the multi-rank default: sharded, FSDP2
    pytest.param(["--backend", "torch"], id="torch"),
    *(
        pytest.param(
            [
                "--backend",
                "deepspeed",
                "--zero-stage",
                str(s),
                *(["--micro-batch-tokens", "24"] if s >= 2 else []),
            ],
            id=f"zero{s}",
            marks=needs_deepspeed,
        )
        for s in (0, 2, 3)
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_two_gloo_ranks_match_one_rank(
    one_rank: Env, tiny_model: Path, backend: list[str], request: pytest.FixtureRequest
) -> None:
    """One torch rank against two ranks of ``backend`` (FSDP shards parameters, gradients and
    AdamW state over them; ZeRO its optimizer state, from stage 2 gradients, at stage 3
    parameters)."""
    run = f"two-{request.node.callspec.id}"
    check_against_one(one_rank, run, two_ranks(one_rank, tiny_model, run, *backend), steps=3)


@needs_deepspeed
def test_zero_3_with_16_bit_masters_is_refused_in_one_line(
    cli_env: dict[str, str], tiny_model: Path
) -> None:
    """What the deepspeed backend cannot do is refused before any model loads (ZeRO-3 runs)."""
    r = subprocess.run(
        [
            bin_path("srl-consumer"),
            *ARGS,
            "--model",
            str(tiny_model),
            "--backend",
            "deepspeed",
            "--zero-stage",
            "3",
            "--master-dtype",
            "bfloat16",
        ],
        env=cli_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "master_dtype: the deepspeed backend keeps float32 master weights" in r.stderr


@pytest.mark.slow
@needs_deepspeed
@pytest.mark.parametrize("stage", [1, 3], ids=["zero1", "zero3"])
def test_zero_on_two_ranks_resumes_from_its_checkpoint_to_the_same_weights(
    one_rank: Env, tiny_model: Path, stage: int
) -> None:
    """Two ZeRO ranks straight through 2 steps land where one torch rank's do; stopped there
    and restarted, the ZeRO partitions saved (gathered) and loaded (sliced per rank) carry
    AdamW's state (and, at stage 3, the weights), so step 3 lands where one torch rank's does
    too."""
    run, zero = f"zero{stage}", ("--backend", "deepspeed", "--zero-stage", str(stage))
    out = two_ranks(one_rank, tiny_model, run, *zero, "--max-steps", "2")
    check_against_one(one_rank, run, out, steps=2)
    out = two_ranks(one_rank, tiny_model, run, *zero, "--max-steps", "3")
    assert "trained 3 steps; policy version 3" in out, out[-2000:]
    a, b = weights(one_rank["SRL_STORE"], "one", 3), weights(one_rank["SRL_STORE"], run, 3)
    diff = max((a[k] - b[k]).abs().max().item() for k in a)
    print(f"ZeRO-{stage} on 2 ranks, restarted after step 2, vs 1 torch rank: differ by {diff:.2e}")
    assert diff < 1e-5


@pytest.mark.slow
def test_three_fsdp_ranks_match_one_rank(one_rank: Env, tiny_model: Path) -> None:
    """Shards of uneven sizes (torch.chunk's split of odd dimensions over 3 ranks)."""
    check_against_one(one_rank, "fsdp3", two_ranks(one_rank, tiny_model, "fsdp3", ranks=3), 3)


@pytest.mark.slow
@pytest.mark.parametrize("again", [2, 1], ids=["on-2-ranks", "on-1-rank"])
def test_fsdp_resumes_from_its_sharded_checkpoint_on_any_world_size(
    one_rank: Env, tiny_model: Path, again: int
) -> None:
    """Two FSDP ranks stop after step 2: each wrote its shard of the master weights and AdamW
    state. Restarted on 2 ranks (each reads its own shard) or on 1 (it reads every shard's
    rows), step 3 lands where one torch rank's does."""
    run = f"fsdp-resume-{again}"
    out = two_ranks(one_rank, tiny_model, run, "--max-steps", "2")
    check_against_one(one_rank, run, out, steps=2)
    store = open_store(one_rank["SRL_STORE"])
    shards = [k.rsplit("/", 1)[1] for k in store.list(f"checkpoints/{run}/") if "shard-" in k]
    assert {"shard-00000-of-00002.safetensors", "shard-00001-of-00002.safetensors"} <= set(shards)
    if again == 2:
        out = two_ranks(one_rank, tiny_model, run, "--max-steps", "3")
    else:
        out = subprocess.run(
            [bin_path("srl-consumer"), *ARGS, "--model", str(tiny_model), "--max-steps", "3"],
            env={**one_rank, "SRL_RUN": run},
            capture_output=True,
            text=True,
            timeout=300,
        ).stdout
    assert "trained 3 steps; policy version 3" in out, out[-2000:]
    a, b = weights(one_rank["SRL_STORE"], "one", 3), weights(one_rank["SRL_STORE"], run, 3)
    diff = max((a[k] - b[k]).abs().max().item() for k in a)
    print(f"FSDP on 2 ranks, resumed on {again} after step 2, vs 1 torch rank: {diff:.2e}")
    assert diff < 1e-5


def _children(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` (from /proc)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_the_ranks_die_with_a_sigkilled_torchrun(one_rank: Env, tiny_model: Path) -> None:
    """torchrun starts each rank in a session of its own: a process manager that SIGKILLed
    torchrun's process group left them running beside the restarted trainer (`srl chaos
    --trainer-ranks 2`). The ranks now ask the kernel to kill them with their launcher."""
    log = tiny_model.parent / f"killed-{uuid.uuid4().hex[:6]}.log"
    argv = [bin_path("torchrun"), "--nnodes", "1", "--nproc-per-node", "2"]
    argv += ["--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    argv += ["-m", "app.cli.consumer", *ARGS, "--model", str(tiny_model)]
    argv += ["--idle-exit-s", "0", "--max-steps", "100"]  # it trains 3 steps, then waits
    with log.open("wb") as out:
        launcher = subprocess.Popen(
            argv,
            env={**one_rank, "SRL_RUN": "killed"},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    ranks: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while "step 3 v3" not in log.read_text():
            assert launcher.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        ranks = _children(launcher.pid)
        assert len(ranks) == 2, ranks
        os.killpg(launcher.pid, signal.SIGKILL)  # what `srl chaos` and a process manager do
        launcher.wait(10)
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in ranks) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in ranks if _alive(p)], "ranks outlived their torchrun"
    finally:
        for p in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
