"""The sharded backend: FSDP2 (``torch.distributed.fsdp.fully_shard``) around the same model,
loss and AdamW as the torch backend.

Owns how a model too large for one rank trains. What must hold:

* parameters, gradients and AdamW state are sharded on dim 0 across the ranks (each decoder
  layer its own FSDP unit, the embeddings, final norm and head the root's): per rank about
  16 bytes per parameter / world, plus the one or two layers gathered in the compute dtype while
  they run (``srl-consumer plan`` computes it);
* master weights, AdamW moments and gradient reduction are fp32; forward and backward run in
  ``dtype`` (bf16: ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``);
* every forward and backward is a collective: the ranks run the same number of micro-batches
  (``lockstep``: ``consumers.distributed`` hands them out in rounds, one per rank, padding the
  last round with zero-weight ones);
* each backward reduce-scatters its gradients (averaged over ranks by FSDP; ``_update`` scales
  by the world size, so the step sees the sum as on one rank, then divides by the normaliser);
* the reference model (KL) is sharded the same way, in the compute dtype, frozen;
* no rank loads the whole model: it is built on the meta device, sharded, and each rank reads
  only its rows of the checkpoint's safetensors files (``consumers.shardload``; at 7B the whole
  fp32 model on each of 8 ranks' CPUs was 240 GB of host RAM before the first step).

gloo on CPU, NCCL on GPUs; torchrun starts the ranks. Called through ``consumers.backends``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from consumers import shardload
from consumers.config import TrainConfig
from consumers.engine import Engine, log
from consumers.packing import use_packed_attention
from srl.errors import ConfigError

if TYPE_CHECKING:
    from consumers.distributed import Dist


def decoder_layers(model: Any) -> list[Any]:
    """The model's repeated blocks: the modules of the classes HF lists as not to be split
    (``Qwen2DecoderLayer``, ``LlamaDecoderLayer``, …)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    return [m for m in model.modules() if type(m).__name__ in names]


class FSDPEngine(Engine):
    """FSDP2 with mixed precision; see the module docstring."""

    sharded = True
    lockstep = True

    def __init__(self, cfg: TrainConfig, dist: Dist | None = None) -> None:
        if dist is None:
            raise ConfigError("backend fsdp: start several ranks with torchrun (one rank: torch)")
        self.world = dist.world
        self.loaded: shardload.Loaded | None = None  # what this rank read of the checkpoint
        self._files: dict[str, Any] = {}
        super().__init__(cfg, dist)
        self.autocast = False  # the policy casts the gathered parameters instead

    @property
    def _load_device(self) -> str:
        return "cpu"  # the whole-model fallback: sharded on the CPU, then each rank moves its shard

    def _load(self, dtype: Any) -> Any:
        """The model on the meta device when this rank can read its rows of the checkpoint
        alone (``consumers.shardload``); else the whole model on the CPU, said once."""
        model = shardload.meta_model(self.cfg.model, dtype)
        files = shardload.weight_files(self.cfg.model)
        why = shardload.unreadable(model, files)
        if why is not None or files is None:
            if self.dist is None or self.dist.rank == 0:
                log.warning("--model %s: %s; every rank loads the whole model", self.cfg.model, why)
            return super()._load(dtype)
        self._files = files
        if self.cfg.packing:
            use_packed_attention(model)
        return model

    def _wrap(self, model: Any, dtype: Any) -> Any:
        import torch
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=torch.float32)
        layers = decoder_layers(model)
        if not layers:
            raise ConfigError(
                f"backend fsdp: {type(model).__name__} names no decoder layer class "
                "(_no_split_modules); use --backend torch"
            )
        for layer in layers:
            fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        if next(model.parameters()).device.type != "meta":
            return model.to(self.device)
        model.to_empty(device=self.device)  # this rank's shards only, uninitialised
        shardload.init_buffers(model)
        got = shardload.fill(model, self._files)
        if self.dist is None or self.dist.rank == 0:
            log.info(
                "rank 0 of %d read %.3f of %.3f GB of %s (its rows)",
                *(self.world, got.read / 1e9, got.total / 1e9, self.cfg.model),
            )
        self.loaded = got
        return model

    def _update(self, normalizer: float) -> float:
        import torch

        scale = self.world / normalizer if normalizer > 0 else 0.0  # FSDP averaged: the sum
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            else:
                p.grad.mul_(scale)
        norm = 0.0
        if self.cfg.max_grad_norm > 0:
            total = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.max_grad_norm)
            norm = float(total.full_tensor() if hasattr(total, "full_tensor") else total)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm
