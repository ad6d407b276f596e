"""The trainer's GPU memory per rank, planned from a model's config alone (``srl-consumer plan``).

Owns the arithmetic; the model is built on the meta device (no weights, a 7B config answers in
seconds) only to count its parameters exactly: tied embeddings once, the largest decoder layer,
and the rest (embeddings, lm_head, final norm: the "root"). ``P`` parameters, ``N`` ranks, ``c``
bytes per element of the dtype (4 float32, 2 bfloat16), ``T`` tokens of a micro-batch:

* ``torch`` backend (``consumers.engine``, replicated): fp32 master weights, fp32 gradients
  and AdamW's two fp32 moments, ``4·P``, ``4·P`` and ``8·P``; with ``--dtype bfloat16`` autocast
  holds a bf16 copy of the weights while it computes, ``2·P``; on more than one rank the
  all-reduce concatenates the gradients into one flat buffer, ``4·P`` more. The publisher
  copies each tensor to host memory, cast to the serving dtype first: under ``--dtype
  bfloat16`` the largest parameter's bf16 copy ``2·largest`` on the GPU at once.
* ``fsdp`` backend (``consumers.engine_fsdp``: FSDP2 ``fully_shard`` per decoder layer and once
  at the root): fp32 master shard ``4·P/N``, fp32 gradient shard
  ``4·P/N``, AdamW moments ``8·P/N``; while computing, two decoder layers are gathered at once
  (current and prefetched) and the root stays gathered, ``c·(2·layer + root)``, and their
  unsharded gradients wait for the reduce-scatter, ``c·(layer + root)``; publishing gathers
  the weights one parameter at a time, the largest whole in fp32 plus its cast copy,
  ``(4 + c)·largest`` (the embedding or lm_head, ``V·h``).
* reference model (``--kl-coef`` > 0): ``P·c`` (``/N`` under fsdp). Its logits live only
  before the backward pass, so they never add to the logits' backward peak below.
* activations of one micro-batch (the Hugging Face Llama/Qwen2 layer under SDPA, no dropout;
  bytes per token, ``h`` hidden, ``i`` intermediate, ``q`` = heads·head_dim, ``kv`` =
  kv_heads·head_dim, ``V`` vocabulary), what autograd saves for the backward pass:

  - per decoder layer ``A = 2·(4 + 2c)·h + 2c·(q + kv) + 4c·i + 4·heads``: each RMSNorm keeps
    its fp32 input (4h), its normalised output and its weighted output (c·h each); attention
    keeps the rotated q and k, v and its output (the o_proj input shares the output's
    storage) and a fp32 log-sum-exp per head; the SwiGLU MLP keeps gate, SiLU(gate), up and
    their product (c·i each);
  - all ``L`` layers: ``T·(L·A + (4 + 2c)·h + 2c·head_dim + 8)`` (the final norm, the rotary
    cos/sin, the token ids); with ``--activation-checkpointing`` only each layer's input is
    kept, ``c·h`` per layer, and one layer's ``A`` is recomputed at a time:
    ``T·(L·c·h + A + (4 + 2c)·h + 2c·head_dim + 8)``;
  - the logits: ``T·V·c`` kept for the backward pass, ``2·T·V·c`` of gradient buffers in it
    (the sliced log-softmax's gradients are accumulated into a full-size buffer), and the fp32
    slice that ``consumers.losses.token_logprobs`` recomputes with its softmax,
    ``2·min(T, 2048)·V·4``.

  Checked against the tensors autograd saves for the tiny model (``tests/unit/test_plan.py``:
  within 2 %). Not counted: a padded micro-batch's attention mask (rows·L² per layer, L the
  longest row), the optimizer step's foreach temporaries (they never coexist with the
  activations), the CUDA context and the allocator's fragmentation: leave a few GiB.

Called by ``app.cli.consumer`` (``srl-consumer plan``) and the tests.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from consumers.config import TrainConfig
from consumers.losses import LOGPROB_POSITIONS
from srl.errors import ConfigError

GIB = 1 << 30
MIB = 1 << 20
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
Backend = Literal["fsdp", "torch"]
BACKENDS: tuple[Backend, ...] = ("fsdp", "torch")
GATHERED_LAYERS = 2  # FSDP2: the layer computing and the one prefetched


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs of a model: exact parameter counts and the layer dimensions."""

    architecture: str
    params: int  # tied weights once
    layer_params: int  # the largest decoder layer
    largest: int  # elements of the largest parameter (what publishing gathers whole)
    root_params: int  # outside the decoder layers: embeddings, lm_head, final norm
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int


@dataclass(frozen=True)
class PlanOptions:
    ranks: int = 1
    gpu_memory_gib: float = 80.0
    dtype: str = str(TrainConfig.model_fields["dtype"].default)
    backend: Backend = "torch"
    activation_checkpointing: bool = False
    micro_batch_tokens: int = int(TrainConfig.model_fields["micro_batch_tokens"].default)
    kl_coef: float = float(TrainConfig.model_fields["kl_coef"].default)

    def check(self) -> None:
        if self.ranks < 1:
            raise ConfigError(f"--ranks {self.ranks}: at least 1")
        if self.gpu_memory_gib <= 0:
            raise ConfigError(f"--gpu-memory {self.gpu_memory_gib:g}: must be positive")
        if self.micro_batch_tokens < 1:
            raise ConfigError(f"--micro-batch-tokens {self.micro_batch_tokens}: at least 1")
        if self.kl_coef < 0:
            raise ConfigError("--kl-coef must not be negative")
        if self.dtype not in DTYPE_BYTES or self.backend not in BACKENDS:
            raise ConfigError(f"dtype {self.dtype!r} / backend {self.backend!r}: not planned")


@dataclass(frozen=True)
class Row:
    key: str
    name: str
    bytes: int
    what: str


@dataclass(frozen=True)
class Activations:
    """Bytes of one micro-batch's activations: the decoder's, the logits kept for the
    backward pass, and the logits' backward transients (gradient buffers, fp32 slice)."""

    layers: int
    logits_kept: int
    logits_backward: int

    @property
    def saved(self) -> int:
        """What autograd holds at the end of the forward pass."""
        return self.layers + self.logits_kept


@dataclass(frozen=True)
class Plan:
    model: str
    shape: ModelShape
    options: PlanOptions
    rows: tuple[Row, ...]

    @property
    def total(self) -> int:
        return sum(r.bytes for r in self.rows)

    @property
    def fits(self) -> bool:
        return self.total <= self.options.gpu_memory_gib * GIB

    def verdict(self) -> str:
        have = f"{self.options.gpu_memory_gib:g} GiB"
        if self.fits:
            return f"fits ({self.total / GIB:.2f} GiB of {have})"
        return f"does not fit (needs {self.total / GIB:.2f} GiB of {have})"

    def to_dict(self) -> dict[str, Any]:
        o = self.options
        return {
            "model": self.model,
            "architecture": self.shape.architecture,
            "parameters": self.shape.params,
            "ranks": o.ranks,
            "backend": o.backend,
            "dtype": o.dtype,
            "activation_checkpointing": o.activation_checkpointing,
            "micro_batch_tokens": o.micro_batch_tokens,
            "kl_coef": o.kl_coef,
            "rows": [
                {"key": r.key, "name": r.name, "bytes": r.bytes, "what": r.what} for r in self.rows
            ],
            "total_bytes": self.total,
            "total_gib": round(self.total / GIB, 3),
            "gpu_memory_gib": o.gpu_memory_gib,
            "fits": self.fits,
            "verdict": self.verdict(),
        }


# -- the model ----------------------------------------------------------------------------------
def brief(e: Exception, limit: int = 100) -> str:
    """An exception's message cut to one short line (transformers lists every model type)."""
    text = (str(e).splitlines() or [type(e).__name__])[0].split(". Should contain")[0]
    return text if len(text) <= limit else text[: limit - 1] + "…"


def read_config(model: str | Path) -> Any:
    """The transformers config of a model directory or of a ``config.json`` path."""
    path = Path(model)
    file = path / "config.json" if path.is_dir() else path
    if not path.exists():
        raise ConfigError(f"--model {model}: no such file or directory")
    if not file.is_file():
        raise ConfigError(f"--model {model}: a directory without config.json")
    from transformers import AutoConfig

    try:
        values = json.loads(file.read_text())
        if not isinstance(values, dict) or "model_type" not in values:
            raise ValueError("no model_type")
        return AutoConfig.for_model(values.pop("model_type"), **values)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError(f"--model {file}: not a transformers model config ({brief(e)})") from e


def meta_model(config: Any) -> Any:
    """The causal LM of ``config`` on the meta device: shapes, no storage."""
    import torch
    from transformers import AutoModelForCausalLM

    quiet = logging.getLogger("transformers")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)
    except (ValueError, KeyError) as e:
        raise ConfigError(f"model_type {config.model_type}: no causal LM ({brief(e)})") from e
    finally:
        quiet.setLevel(level)


def decoder_layers(model: Any) -> list[Any]:
    """The decoder layers: the children of the module list holding the most parameters."""
    import torch

    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m)]
    if not lists:
        raise ConfigError(f"{type(model).__name__}: no decoder layers found")
    best = max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))
    return list(best)


def model_shape(model: str | Path) -> ModelShape:
    config = read_config(model)
    built = meta_model(config)
    layers = decoder_layers(built)
    per_layer = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    params = sum(p.numel() for p in built.parameters())  # a tied parameter is yielded once
    text = config.get_text_config()
    try:
        hidden, heads = int(text.hidden_size), int(text.num_attention_heads)
        shape = ModelShape(
            architecture=type(built).__name__,
            params=params,
            layer_params=max(per_layer),
            largest=max(p.numel() for p in built.parameters()),
            root_params=params - sum(per_layer),
            layers=len(layers),
            hidden=hidden,
            intermediate=int(text.intermediate_size),
            heads=heads,
            kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(text, "head_dim", None) or hidden // heads),
            vocab=int(text.vocab_size),
        )
    except (AttributeError, TypeError) as e:
        raise ConfigError(
            f"model_type {config.model_type}: the plan models Llama/Qwen2-style decoders "
            f"({brief(e)})"
        ) from e
    return shape


# -- the arithmetic -----------------------------------------------------------------------------
def layer_activation_bytes(s: ModelShape, c: int) -> int:
    """Bytes per token one decoder layer saves for the backward pass (module docstring)."""
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    return 2 * (4 + 2 * c) * s.hidden + 2 * c * (q + kv) + 4 * c * s.intermediate + 4 * s.heads


def activations(s: ModelShape, tokens: int, c: int, checkpointing: bool = False) -> Activations:
    per_layer = layer_activation_bytes(s, c)
    shared = (4 + 2 * c) * s.hidden + 2 * c * s.head_dim + 8  # final norm, cos/sin, ids
    layers = s.layers * c * s.hidden + per_layer if checkpointing else s.layers * per_layer
    logits = tokens * s.vocab * c
    fp32_slice = 2 * min(tokens, LOGPROB_POSITIONS) * s.vocab * 4
    return Activations(tokens * (layers + shared), logits, 2 * logits + fp32_slice)


def state_rows(s: ModelShape, o: PlanOptions) -> list[Row]:
    """Parameters, gradients, optimizer state and the reference model, per rank."""
    c, n, p = DTYPE_BYTES[o.dtype], o.ranks, s.params
    shard = -(-p // n)
    if o.backend == "torch":
        flat = p * 4 if n > 1 else 0
        cast = p * c if c != 4 else 0
        return [
            Row("parameters", "parameters", p * 4, "fp32 master weights, replicated"),
            Row(
                "parameters_gathered",
                "parameters gathered",
                cast,
                f"autocast's {o.dtype} copies" if cast else "float32: computed on the masters",
            ),
            Row("gradients", "gradients", p * 4, "fp32, replicated"),
            Row(
                "gradient_buffers",
                "gradient all-reduce",
                flat,
                "one flat buffer of all gradients" if n > 1 else "one rank: no all-reduce",
            ),
            Row("optimizer", "optimizer (AdamW)", 2 * p * 4, "two fp32 moments"),
            Row(
                "reference",
                "reference model",
                p * c if o.kl_coef > 0 else 0,
                f"{o.dtype}, replicated" if o.kl_coef > 0 else "--kl-coef 0: none",
            ),
        ]
    gathered = GATHERED_LAYERS * s.layer_params + s.root_params
    return [
        Row("parameters", "parameters", shard * 4, f"fp32 master shard, 1/{n}"),
        Row(
            "parameters_gathered",
            "parameters gathered",
            gathered * c,
            f"{o.dtype}: {GATHERED_LAYERS} layers + embeddings/lm_head",
        ),
        Row("gradients", "gradients", shard * 4, f"fp32 shard, 1/{n}"),
        Row(
            "gradient_buffers",
            "gradients unsharded",
            (s.layer_params + s.root_params) * c,
            "1 layer + embeddings/lm_head before reduce-scatter",
        ),
        Row("optimizer", "optimizer (AdamW)", 2 * shard * 4, f"two fp32 moments, 1/{n}"),
        Row(
            "reference",
            "reference model",
            -(-p * c // n) if o.kl_coef > 0 else 0,
            f"{o.dtype} shard, 1/{n}" if o.kl_coef > 0 else "--kl-coef 0: none",
        ),
    ]


def plan(shape: ModelShape, options: PlanOptions, model: str = "") -> Plan:
    """The per-rank plan of ``shape`` under ``options`` (checked first)."""
    options.check()
    c, t = DTYPE_BYTES[options.dtype], options.micro_batch_tokens
    act = activations(shape, t, c, options.activation_checkpointing)
    how = "layer inputs + 1 layer" if options.activation_checkpointing else "all layers"
    fsdp = options.backend == "fsdp"
    bucket = shape.largest * ((4 + c) if fsdp else (c if c != 4 else 0))
    rows = [
        *state_rows(shape, options),
        Row("activations", "activations", act.layers, f"{t} tokens, {how}"),
        Row("logits", "logits", act.logits_kept + act.logits_backward, "kept + backward peak"),
        Row(
            "publish_bucket",
            "publish bucket",
            bucket,
            ("largest parameter gathered, fp32 + cast" if fsdp else "largest parameter cast")
            if bucket
            else "tensors copied straight to host",
        ),
    ]
    return Plan(model, shape, options, tuple(rows))


def plan_model(model: str | Path, options: PlanOptions) -> Plan:
    """:func:`plan` of a model directory or ``config.json``; bad options fail before the build."""
    options.check()
    return plan(model_shape(model), options, str(model))


def format_plan(p: Plan) -> str:
    """A plain table, one row per part, then the total and the verdict."""
    s, o = p.shape, p.options
    ckpt = ", activation checkpointing" if o.activation_checkpointing else ""
    lines = [
        f"{s.architecture}: {s.params:,} parameters ({s.layers} layers, hidden {s.hidden}, "
        f"vocabulary {s.vocab})",
        f"backend {o.backend}, {o.ranks} rank{'s' if o.ranks > 1 else ''}, {o.dtype}, "
        f"{o.micro_batch_tokens}-token micro-batches{ckpt}, kl_coef {o.kl_coef:g}",
        "",
        f"{'per rank':<22}{'GiB':>8}  what",
    ]
    lines += [f"{r.name:<22}{r.bytes / GIB:>8.2f}  {r.what}" for r in p.rows]
    lines += [f"{'total':<22}{p.total / GIB:>8.2f}", p.verdict()]
    return "\n".join(lines)
