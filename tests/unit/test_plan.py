"""``srl-consumer plan``: the memory plan of a model from its config alone.

* a Qwen2.5-7B-shaped config (``tests/unit/data/qwen2-7b-config.json``, no weights) counts
  its 7.62B parameters exactly on the meta device, does not fit one 80 GiB GPU and fits eight
  under FSDP in bfloat16;
* the real CLI prints the plan as JSON with ``fits``, and bad input as one line;
* the tiny model's plan against what torch really holds: parameters, gradients and AdamW
  state after a real step (within 1 %); the activations against the tensors autograd saves in
  one forward pass through the trainer's log-prob path (deterministic: within 2 %), and the
  whole activation figure against the peak RSS increase of one forward/backward on CPU in a
  fresh process (noisier: within 2x; the plan was 0.83x to 1.13x of it in five runs).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from consumers.plan import (
    GIB,
    ModelShape,
    Plan,
    PlanOptions,
    activations,
    model_shape,
    plan,
    plan_model,
)
from srl.errors import ConfigError
from tests.conftest import ROOT, bin_path

QWEN_7B = ROOT / "tests/unit/data/qwen2-7b-config.json"
FSDP_BF16: dict[str, Any] = {"backend": "fsdp", "dtype": "bfloat16"}
FSDP_CLI = ("--backend", "fsdp", "--dtype", "bfloat16")


@pytest.fixture(scope="module")
def qwen7b() -> ModelShape:
    return model_shape(QWEN_7B)


def rows(p: Plan) -> dict[str, int]:
    return {r.key: r.bytes for r in p.rows}


# -- the 7B config --------------------------------------------------------------------------
def test_the_7b_config_counts_its_parameters_exactly(qwen7b: ModelShape) -> None:
    assert abs(qwen7b.params - 7.6e9) / 7.6e9 < 0.01
    # Qwen2.5-7B: 7,615,616,512 (embeddings and lm_head untied: 2 x 152064 x 3584)
    assert qwen7b.params == 7_615_616_512
    assert qwen7b.root_params == 2 * 152064 * 3584 + 3584
    assert qwen7b.params == qwen7b.root_params + 28 * qwen7b.layer_params
    assert (qwen7b.layers, qwen7b.kv_heads, qwen7b.head_dim) == (28, 4, 128)


@pytest.mark.parametrize("extra", [{}, FSDP_BF16, {**FSDP_BF16, "activation_checkpointing": True}])
def test_7b_does_not_fit_one_80_gib_gpu(qwen7b: ModelShape, extra: dict) -> None:
    p = plan(qwen7b, PlanOptions(ranks=1, gpu_memory_gib=80, **extra))
    assert not p.fits and p.total > 80 * GIB
    assert p.verdict().startswith(f"does not fit (needs {p.total / GIB:.2f} GiB of 80 GiB")


def test_7b_fits_eight_80_gib_gpus_under_fsdp(qwen7b: ModelShape) -> None:
    p = plan(qwen7b, PlanOptions(ranks=8, gpu_memory_gib=80, **FSDP_BF16))
    assert p.fits and p.verdict().startswith("fits")
    r, n = rows(p), qwen7b.params
    assert r["parameters"] == r["gradients"] == 4 * -(-n // 8)  # fp32 shards
    assert r["optimizer"] == 8 * -(-n // 8)
    assert r["parameters_gathered"] == 2 * (2 * qwen7b.layer_params + qwen7b.root_params)
    assert r["reference"] == 0 and r["publish_bucket"] == 6 * qwen7b.largest
    assert qwen7b.largest == 152064 * 3584  # the embedding (and the untied lm_head)
    # replicated, the same 8 ranks hold the whole 7B each: no fit
    assert not plan(qwen7b, PlanOptions(ranks=8, gpu_memory_gib=80)).fits


def test_the_options_move_the_plan_the_right_way(qwen7b: ModelShape) -> None:
    def fsdp8(**extra: Any) -> dict[str, int]:
        return rows(plan(qwen7b, PlanOptions(ranks=8, **FSDP_BF16, **extra)))

    base, ckpt, kl = fsdp8(), fsdp8(activation_checkpointing=True), fsdp8(kl_coef=0.01)
    assert ckpt["activations"] < base["activations"] / 10 and ckpt["logits"] == base["logits"]
    assert kl["reference"] == -(-qwen7b.params * 2 // 8)
    torch8 = rows(plan(qwen7b, PlanOptions(ranks=8, dtype="bfloat16")))
    torch1 = rows(plan(qwen7b, PlanOptions(ranks=1, dtype="bfloat16")))
    # the torch engine keeps fp32 masters and AdamW state, autocast a bf16 copy; 8 ranks add
    # the flat all-reduce
    assert torch8["optimizer"] == 8 * qwen7b.params and torch1["gradient_buffers"] == 0
    assert torch8["parameters_gathered"] == 2 * qwen7b.params
    assert (
        torch8["gradient_buffers"] == 4 * qwen7b.params
        and torch8["publish_bucket"] == 2 * qwen7b.largest
    )
    # the trainer's default micro-batch (consumers/config.py)
    assert PlanOptions().micro_batch_tokens == 4096


@pytest.mark.parametrize(
    ("options", "message"),
    [({"ranks": 0}, "--ranks 0"), ({"gpu_memory_gib": 0}, "--gpu-memory")],
)
def test_bad_options_are_config_errors(options: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        plan_model(QWEN_7B, PlanOptions(**options))


# -- the CLI --------------------------------------------------------------------------------
def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [bin_path("srl-consumer"), "plan", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )


def test_the_cli_prints_the_plan_as_json() -> None:
    out = cli("--model", str(QWEN_7B), "--ranks", "8", "--gpu-memory", "80", "--json", *FSDP_CLI)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["fits"] is True and doc["parameters"] == 7_615_616_512
    assert doc["total_bytes"] == sum(r["bytes"] for r in doc["rows"])
    assert [r["key"] for r in doc["rows"]] == [
        "parameters",
        "parameters_gathered",
        "gradients",
        "gradient_buffers",
        "optimizer",
        "reference",
        "activations",
        "logits",
        "publish_bucket",
    ]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "no/such/dir"], "no such file or directory"),
        (["--model", "tests/unit/data"], "without config.json"),
        (["--model", str(QWEN_7B), "--ranks", "0"], "--ranks 0: at least 1"),
    ],
)
def test_bad_input_is_one_line_and_a_non_zero_exit(args: list[str], message: str) -> None:
    out = cli(*args, *(["--ranks", "1"] if "--ranks" not in args else []), "--gpu-memory", "80")
    assert out.returncode != 0 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr
    assert out.stderr.startswith("srl-consumer: error: ") and message in out.stderr


# -- the tiny model: plan against measurement ------------------------------------------------
def test_parameters_gradients_and_adamw_state_match_a_real_step(tiny_model: Path) -> None:
    import torch

    from srl.tinymodel import load_model

    model = load_model(tiny_model, "cpu", torch.float32).train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8)
    ids = torch.randint(4, 200, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()

    def nbytes(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    measured = sum(nbytes(p) + nbytes(p.grad) for p in params)
    measured += sum(nbytes(v) for s in opt.state.values() for v in s.values() if torch.is_tensor(v))
    r = rows(plan(model_shape(tiny_model), PlanOptions(ranks=1, backend="torch", dtype="float32")))
    planned = r["parameters"] + r["gradients"] + r["optimizer"]
    assert abs(planned - measured) / measured < 0.01, (planned, measured)


def test_activations_match_what_autograd_saves(tiny_model: Path) -> None:
    """Deterministic: the bytes of the distinct storages autograd saves (parameters left out)
    in one forward pass through the trainer's log-prob path, unpadded rows."""
    import torch

    from consumers.losses import token_logprobs
    from srl.tinymodel import load_model

    model = load_model(tiny_model, "cpu", torch.float32).train()
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in weights:
            saved[s.data_ptr()] = s.nbytes()
        return t

    rows_, length = 4, 512  # 2048 positions: token_logprobs keeps the logits itself
    ids = torch.randint(4, 200, (rows_, length))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[:, :-1]
        token_logprobs(logits, ids[:, 1:])
    planned = activations(model_shape(tiny_model), rows_ * length, 4)
    measured = sum(saved.values())
    assert abs(planned.saved - measured) / measured < 0.02, (planned, measured)


RSS_PROBE = """
import resource, sys, torch
from consumers.losses import token_logprobs
from srl.tinymodel import load_model
torch.set_num_threads(1)
model = load_model(sys.argv[1], "cpu", torch.float32).train()
def step(rows, length):
    ids = torch.randint(4, 200, (rows, length))
    logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[:, :-1]
    token_logprobs(logits, ids[:, 1:]).sum().backward()
step(2, 64)  # warm-up: gradients, allocator pools, lazy initialisation
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
step(16, 1024)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
"""
