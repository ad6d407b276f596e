"""Two CPU ranks (torchrun, gloo) and one rank trained on the same records give the same weights."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from srl.broker import free_port
from srl.config import CommonConfig
from srl.kafka import create_topics
from srl.stores import open_store
from srl.weights import Manifest, fetch_tensors, version_prefix
from tests.chunks import produce
from tests.conftest import bin_path
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


def weights(store_url: str, run: str, version: int) -> dict[str, torch.Tensor]:
    store = open_store(store_url)
    key = f"{version_prefix(run, version)}/manifest.json"
    return fetch_tensors(store, Manifest.from_json(store.get(key)))


def one_torch_rank(
    cli_env: dict[str, str], tiny_model: Path, bootstrap: str, prefix: str, seed: int
) -> dict[str, str]:
    """Records on one partition (both runs see them in the same order and form the same steps),
    then run "one": a single torch rank, 3 steps. Returns the environment for the other run."""
    env = {**cli_env, "SRL_PARTITIONS_PER_BUCKET": "1", "GLOO_SOCKET_IFNAME": "lo"}
    cfg = CommonConfig(bootstrap_servers=bootstrap, topic_prefix=prefix, partitions_per_bucket=1)
    create_topics(cfg)
    produce(cfg, make_groups(6, seed=seed))
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
    return env


def two_ranks(env: dict[str, str], tiny_model: Path, *extra: str) -> str:
    """Run "two" on two gloo ranks under torchrun; returns its stdout."""
    two = subprocess.run(
        [
            bin_path("torchrun"),
            "--nnodes",
            "1",
            "--nproc-per-node",
            "2",
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
        env={**env, "SRL_RUN": "two"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert two.returncode == 0, two.stderr[-3000:]
    return two.stdout


def has_deepspeed() -> bool:
    import importlib.util

    return importlib.util.find_spec("deepspeed") is not None


needs_deepspeed = pytest.mark.skipif(
    not has_deepspeed(), reason="deepspeed is not installed (the .[deepspeed] extra)"
)


# ZeRO-2 runs its micro-batches in lockstep at the step; 24-token micro-batches give the two
# ranks 2 and 1 of them per step, so rank 1 pads with a zero-weight backward
BACKENDS = [
    pytest.param([], id="torch"),
    *(
        pytest.param(
            [
                "--backend",
                "deepspeed",
                "--zero-stage",
                str(s),
                *(["--micro-batch-tokens", "24"] if s == 2 else []),
            ],
            id=f"zero{s}",
            marks=needs_deepspeed,
        )
        for s in (0, 1, 2)
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_two_gloo_ranks_match_one_rank(
    cli_env: dict[str, str], tiny_model: Path, bootstrap: str, prefix: str, backend: list[str]
) -> None:
    """One torch rank against two ranks of ``backend`` (ZeRO shards its state over them)."""
    env = one_torch_rank(cli_env, tiny_model, bootstrap, prefix, seed=3)
    out = two_ranks(env, tiny_model, *backend)
    assert "trained 3 steps; policy version 3" in out
    rank1 = [line for line in out.splitlines() if line.startswith("rank 1: 3 steps")]
    assert rank1 and int(rank1[0].split()[4]) > 0, f"rank 1 trained micro-batches: {out}"

    a, b = weights(env["SRL_STORE"], "one", 3), weights(env["SRL_STORE"], "two", 3)
    start = weights(env["SRL_STORE"], "one", 1)  # v1 already moved from v0; compare v3 with it
    assert a.keys() == b.keys()
    diff = max((a[k] - b[k]).abs().max().item() for k in a)
    moved = max((a[k] - start[k]).abs().max().item() for k in a)
    print(f"2 ranks {backend} vs 1: weights moved {moved:.2e} from v1, differ by {diff:.2e}")
    assert moved > 1e-4 and diff < 1e-5, f"moved {moved:.2e}, 1 vs 2 ranks differ by {diff:.2e}"


@needs_deepspeed
def test_zero_3_is_refused_in_one_line(cli_env: dict[str, str], tiny_model: Path) -> None:
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
        ],
        env=cli_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "zero_stage: 3 partitions the parameters" in r.stderr


@pytest.mark.slow
@needs_deepspeed
def test_zero_1_on_two_ranks_resumes_from_its_checkpoint_to_the_same_weights(
    cli_env: dict[str, str], tiny_model: Path, bootstrap: str, prefix: str
) -> None:
    """Stopped after step 2 and restarted: the ZeRO partitions saved (gathered) and loaded
    (sliced per rank) carry AdamW's state, so step 3 lands where one torch rank's does."""
    env = one_torch_rank(cli_env, tiny_model, bootstrap, prefix, seed=4)
    for steps in ("2", "3"):
        out = two_ranks(
            env, tiny_model, "--backend", "deepspeed", "--zero-stage", "1", "--max-steps", steps
        )
        assert f"trained {steps} steps; policy version {steps}" in out, out[-2000:]
    a, b = weights(env["SRL_STORE"], "one", 3), weights(env["SRL_STORE"], "two", 3)
    diff = max((a[k] - b[k]).abs().max().item() for k in a)
    print(f"ZeRO-1 on 2 ranks, restarted after step 2, vs 1 torch rank: differ by {diff:.2e}")
    assert diff < 1e-5
