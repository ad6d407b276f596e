"""The compute side of the trainer: model, optimizer, frozen reference, micro-batch backward, step.

Owns what touches parameters. What must hold:

* ``backward(rows)`` adds the gradient of ``Σ_tokens weight · loss`` over one micro-batch to the
  parameters' ``.grad``; per-token weights are 1 (``token_mean``) or 1/len (``seq_mean``), so
  micro-batches run at any time, in any order, on any rank, sum to the gradient of the step;
* ``step(normalizer)`` all-reduces the summed gradients across ranks (one flat buffer),
  divides by the step's normaliser (loss tokens or rows, known only when the step is full),
  clips, and takes one AdamW update; every rank holds the same replicated state afterwards;
* ``packing``: a micro-batch runs as one row of its samples' tokens, attention within each
  sample (``consumers.packing``): the same loss terms as the padded rows, no compute on
  padding; the reference and the further passes run the same packed row;
* ``updates_per_step > 1`` re-runs the step's stored micro-batches with the proximal
  log-probs recorded on the first pass (decoupled PPO's ``prox``), one update each pass;
* published and checkpointed tensors are the HF state dict without tied aliases
  (``lm_head.weight`` when tied to the embeddings), so each version loads with from_pretrained.

Called by ``consumers.trainer`` (rank 0) and ``consumers.distributed`` (other ranks).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from consumers import checkpoint as ckpts
from consumers.config import TrainConfig
from consumers.losses import k3_kl, policy_loss, token_logprobs
from consumers.packing import packed, packed_inputs, use_packed_attention
from consumers.train_engine import MicroBatch, StepStats
from srl.errors import SrlError
from srl.tinymodel import load_model

if TYPE_CHECKING:
    import torch

    from consumers.distributed import Dist

log = logging.getLogger("srl.trainer")


def resolve_device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def export_tensors(model: Any) -> dict[str, torch.Tensor]:
    """The state dict without aliases (a tied lm_head is the embedding's parameter)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) in seen:
            continue
        seen.add(id(t))
        out[name] = t.detach()
    return out


def extra_files(model_dir: str | Path) -> dict[str, bytes]:
    """config, generation config and tokenizer files that make a version HF-loadable."""
    out = {}
    for p in sorted(Path(model_dir).iterdir()):
        if (
            p.is_file()
            and not p.name.startswith(".")
            and p.suffix in (".json", ".txt", ".model", ".jinja")
        ) and p.name != "model.safetensors.index.json":
            out[p.name] = p.read_bytes()
    return out


class Engine:
    """Plain-torch backend; ``dist`` is None for one rank."""

    sharded = False  # True: every rank holds (and checkpoints) only its shard of the state
    lockstep = False  # True: every rank must run as many micro-batches as the others

    def __init__(self, cfg: TrainConfig, dist: Dist | None = None) -> None:
        import torch

        self.cfg = cfg
        self.dist = dist
        self.device = resolve_device(cfg.device)
        torch.manual_seed(cfg.seed)
        self.compute_dtype = getattr(torch, cfg.dtype)
        master = getattr(torch, cfg.master_dtype)
        if master != torch.float32 and (dist is None or dist.rank == 0):
            log.warning(
                "master_dtype %s: the optimizer updates %s weights; updates below half their "
                "spacing (most of them at lr %g) round away",
                cfg.master_dtype,
                cfg.master_dtype,
                cfg.lr,
            )
        # bf16 compute over fp32 master weights: autocast casts each matmul's operands
        self.autocast = self.compute_dtype != master
        self.model = self._wrap(self._load(master), master)
        self.model.train()
        if cfg.activation_checkpointing:
            self.model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        self.ref = None
        if cfg.kl_coef > 0:  # frozen: held in the compute dtype, no master copy
            ref = self._load(self.compute_dtype)
            self.ref = self._wrap(ref, self.compute_dtype).eval().requires_grad_(False)
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.optimizer = torch.optim.AdamW(
            self.params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.999), eps=1e-8
        )
        self.stored: list[MicroBatch] = []
        self.stats = StepStats()

    @property
    def _load_device(self) -> str:
        return self.device

    def _load(self, dtype: Any) -> Any:
        """The HF model in ``dtype``, with the packed micro-batches' attention under ``packing``."""
        model = load_model(self.cfg.model, self._load_device, dtype)
        if self.cfg.packing:
            use_packed_attention(model)
        return model

    def _wrap(self, model: Any, dtype: Any) -> Any:
        """The loaded model as the backend trains it (FSDP shards it here)."""
        return model

    def _forward(
        self, model: Any, ids: torch.Tensor, attn: torch.Tensor | None, **packing: torch.Tensor
    ) -> torch.Tensor:
        """Logits of every position but the last. Padded: ``attn`` masks the padding. Packed:
        ``packing`` holds ``position_ids`` and ``cu_seq_lens_q`` (``consumers.packing``) and no
        mask goes in, so transformers masks by the restarting positions, which it does only
        without a KV cache (``use_cache=False``; none is of use in training)."""
        import torch

        dev = "cuda" if self.device.startswith("cuda") else "cpu"
        mask = None if packing else attn
        with torch.autocast(dev, dtype=self.compute_dtype, enabled=self.autocast):
            out = model(input_ids=ids, attention_mask=mask, use_cache=False, **packing)
            return out.logits[:, :-1]

    # -- micro-batches ------------------------------------------------------------------
    def _loss(self, mb: MicroBatch, first_pass: bool) -> torch.Tensor:
        import torch

        cfg = self.cfg
        ids, attn = mb.ids.to(self.device), mb.attn.to(self.device)
        packing = packed_inputs(mb, self.device)
        behav, weight = mb.behav.to(self.device), mb.weight.to(self.device)
        logits = self._forward(self.model, ids, attn, **packing)
        logp = token_logprobs(logits, ids[:, 1:], cfg.temperature)
        if first_pass and cfg.updates_per_step > 1:
            mb.prox = logp.detach().cpu()
        prox = None if mb.prox is None else mb.prox.to(self.device)
        loss = policy_loss(
            cfg.loss,
            logp,
            behav,
            mb.adv.to(self.device),
            prox_logp=prox,
            clip_low=cfg.clip_low,
            clip_high=cfg.clip_high,
            cap=cfg.tis_cap,
        )
        on = weight > 0
        if self.ref is not None:
            with torch.no_grad():
                ref_logits = self._forward(self.ref, ids, attn, **packing)
                ref_logp = token_logprobs(ref_logits, ids[:, 1:], cfg.temperature)
            kl = k3_kl(logp, ref_logp)
            loss = loss + cfg.kl_coef * kl
            self.stats.kl += float((kl.detach() * weight).sum())
        if first_pass:
            ratio = (logp.detach() - behav).exp()[on]
            if ratio.numel():
                self.stats._n += ratio.numel()
                self.stats.ratio_mean += float(ratio.sum())
                self.stats.ratio_max = max(self.stats.ratio_max, float(ratio.max()))
                self.stats.truncated_frac += float((ratio > cfg.tis_cap).sum())
            self.stats.padded_tokens += int(ids.numel())
        return (loss * weight).sum()

    def _backprop(self, loss: torch.Tensor) -> None:
        loss.backward()

    @property
    def max_length(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 1 << 30))

    def backward(self, mb: MicroBatch) -> None:
        """Forward/backward one micro-batch now (packed first under ``packing``); gradients
        accumulate until ``step``."""
        t0 = time.perf_counter()
        if self.cfg.packing:
            mb = packed(mb)
        loss = self._loss(mb, first_pass=True)
        self._backprop(loss)
        self.stats.loss += float(loss.detach())
        if self.cfg.updates_per_step > 1:
            self.stored.append(mb)
        self.stats.compute_s += time.perf_counter() - t0

    # -- the optimizer step -------------------------------------------------------------
    def _update(self, normalizer: float) -> float:
        import torch

        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        if self.dist is not None and self.dist.world > 1:
            self.dist.all_reduce_sum(grads)
        scale = 1.0 / normalizer if normalizer > 0 else 0.0
        for p, g in zip(self.params, grads, strict=True):
            p.grad = g.mul_(scale)
        norm = 0.0
        if self.cfg.max_grad_norm > 0:
            norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.cfg.max_grad_norm))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def step(self, normalizer: float) -> StepStats:
        """All-reduce, normalise, clip, update; then any further passes (updates_per_step)."""
        t0 = time.perf_counter()
        stats = self.stats
        stats.grad_norm = self._update(normalizer)
        for _ in range(self.cfg.updates_per_step - 1):
            for mb in self.stored:
                self._backprop(self._loss(mb, first_pass=False))
            stats.grad_norm = self._update(normalizer)
        self.stored = []
        n = stats._n
        if self.dist is not None and self.dist.world > 1:
            tot = self.dist.all_reduce_floats(
                [
                    stats.loss,
                    stats.kl,
                    stats.ratio_mean,
                    stats.truncated_frac,
                    n,
                    stats.padded_tokens,
                ]
            )
            stats.loss, stats.kl, stats.ratio_mean, stats.truncated_frac, n, padded = tot
            stats.padded_tokens = int(padded)
            stats.ratio_max = self.dist.all_reduce_floats([stats.ratio_max], op="max")[0]
        stats.loss /= max(normalizer, 1e-12)
        stats.kl /= max(normalizer, 1e-12)
        stats.ratio_mean = stats.ratio_mean / n if n else 0.0
        stats.truncated_frac = stats.truncated_frac / n if n else 0.0
        stats.compute_s += time.perf_counter() - t0
        self.stats = StepStats()
        return stats

    def discard(self) -> None:
        """Forget a partial step's gradients (its records are read again after a restart)."""
        self.optimizer.zero_grad(set_to_none=True)
        self.stored = []
        self.stats = StepStats()

    # -- state ----------------------------------------------------------------------------
    def optimizer_state(self) -> dict[str, Any]:
        """AdamW's state in torch's ``state_dict`` format (checkpoints are backend-neutral)."""
        return self.optimizer.state_dict()

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)

    def tensors(self) -> dict[str, torch.Tensor]:
        return export_tensors(self.model)

    def export(self, dtype: Any = None) -> dict[str, torch.Tensor]:
        """The weights to publish, on the CPU in ``dtype`` (the serving dtype), one tensor at a
        time: under FSDP a collective every rank joins (each parameter gathered whole, cast,
        copied out, freed before the next); ranks > 0 get nothing."""
        from torch.distributed.tensor import DTensor

        out: dict[str, torch.Tensor] = {}
        mine = self.dist is None or self.dist.rank == 0
        for name, t in export_tensors(self.model).items():
            full = t.full_tensor() if isinstance(t, DTensor) else t
            if mine:  # a copy, never the parameter itself: it is uploaded while training goes on
                to = {"device": "cpu", "dtype": dtype or full.dtype, "copy": full is t}
                out[name] = full.detach().to(**to).contiguous()
            del full
        return out

    def checkpoint_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """This rank's rows of the master weights and AdamW state (``consumers.checkpoint``)."""
        return ckpts.engine_state(self.names, self.params, self.optimizer_state())

    def load_checkpoint_state(self, shards: ckpts.Shards) -> None:
        """This rank's rows of a checkpoint, whatever world size wrote it."""
        state = ckpts.load_engine_state(shards, self.names, self.params)
        self._loaded()
        if state["state"]:
            self.load_optimizer_state(state)

    def _loaded(self) -> None:
        """After the parameters were overwritten in place (DeepSpeed refreshes its masters)."""

    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        missing, unexpected = self.model.load_state_dict(tensors, strict=False)
        aliases = set(self.model.state_dict()) - set(export_tensors(self.model))
        if unexpected or set(missing) - aliases:
            raise SrlError(
                f"checkpoint does not fit the model: missing {sorted(set(missing) - aliases)[:3]}, "
                f"unexpected {sorted(unexpected)[:3]}"
            )
