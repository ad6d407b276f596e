"""DeepSpeed ZeRO-3: the DeepSpeed backend with the parameters partitioned across ranks too.

Owns what stage 3 changes in ``consumers.engine_deepspeed.DeepSpeedEngine`` (pinned
``deepspeed==0.19.8``). What must hold, as for every backend: every rank ends a step with the
weights the torch backend would have (tests/unit/test_deepspeed_backend.py,
tests/e2e/test_trainer_ranks.py), and checkpoints keep torch's AdamW ``state_dict`` format per
parameter, so a ZeRO-3 checkpoint resumes under any backend and any number of ranks.

How:

* every parameter, its gradient, fp32 master and AdamW moments are partitioned: a parameter is
  flattened and cut into ``world`` equal pieces (the last padded), rank r holding piece r.
  ``stage3_param_persistence_threshold: 0``: DeepSpeed would keep parameters under 100k
  elements whole on every rank, all of the tiny test model;
* each decoder layer (the classes the model's ``_no_split_modules`` names) is a ZeRO-3 leaf
  module: its parameters are gathered together for its forward and its backward, as FSDP2's
  per-layer units, instead of one hook per ``nn.Linear``. Measured: with DeepSpeed's hooks on
  every submodule the autograd engine summed some gradient contributions in another order,
  gradients 1 ulp off the torch backend's, and AdamW's first step (lr 1e-3) turned that into
  3.6e-6 of weights; with layer leaves 1.2e-7, as stages 1 and 2;
* ``memory_efficient_linear: false``: else DeepSpeed replaces ``torch.nn.functional.linear``
  for the whole process (every later model, the torch backend's too, runs its version);
* before each forward of the trained model, ``clear_backward_seen_flag``, what DeepSpeed's own
  ``forward`` does first: stage 3 counts micro-steps there (the first backward of a step copies
  into the gradient partitions, later ones add) and resets its gradient-hook bookkeeping.
  Without it the first step's gradient was lost (grad norm 0.0 against torch's 0.0625). The
  model is still called directly, as at stages 0-2: DeepSpeed's ``forward`` turns an outer CUDA
  autocast off unless its own ``torch_autocast`` section is on, which reduces ``nn.Linear``
  gradients in bf16;
* ``discard`` resets that counter and zeroes the gradient partitions: DeepSpeed's
  ``engine.zero_grad()`` alone kept the discarded micro-batch's gradient (the next step's
  grad norm 0.290 against torch's 0.226);
* every forward and backward all-gathers parameters, a collective: with several ranks the
  backend is ``lockstep`` (``consumers.distributed`` hands micro-batches out in rounds, one per
  rank, as for FSDP), and micro-batches still backward as they arrive;
* ``export`` and ``checkpoint_state`` are collectives every rank joins, one parameter at a
  time: ``export`` gathers each parameter whole (``deepspeed.zero.GatheredParameters``) and
  rank 0 copies it to its CPU in the publish dtype; a checkpoint all-gathers each parameter's
  fp32 master and moments (rank 0 keeps them and writes one shard of world 1, as stages 1 and
  2); ``load_checkpoint_state`` reads each parameter's rows whole, one at a time, and keeps
  this rank's piece.

Not done: the model is loaded whole on every rank before it is partitioned (no
``deepspeed.zero.Init``), the reference model (``--kl-coef``) is replicated, and rank 0 holds
the whole fp32 state on its CPU while it writes a checkpoint. Called by
``consumers.backends.make_engine``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from consumers import checkpoint as ckpts
from consumers.engine_deepspeed import STATE_KEYS, DeepSpeedEngine

if TYPE_CHECKING:
    import torch

    from consumers.config import TrainConfig
    from consumers.distributed import Dist


def layer_classes(model: Any) -> list[str]:
    """Names of the model's repeated blocks (``Qwen2DecoderLayer``, ``LlamaDecoderLayer``, …)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    return sorted({type(m).__name__ for m in model.modules() if type(m).__name__ in names})


class ZeRO3Engine(DeepSpeedEngine):
    """ZeRO stage 3 around the same model, loss and AdamW as the torch backend."""

    def __init__(self, cfg: TrainConfig, dist: Dist | None = None) -> None:
        import torch.distributed as tdist

        super().__init__(cfg, dist)
        self.rank = tdist.get_rank()
        # every forward all-gathers: rank 0 hands micro-batches out in rounds, one per rank,
        # and each runs at once (no deferral to the step, as ZeRO-2's)
        self.lockstep = self.world > 1

    @property
    def z(self) -> Any:
        """DeepSpeed's ``DeepSpeedZeroOptimizer_Stage3``."""
        return self.zero

    def _zero_config(self) -> dict[str, Any]:
        zero: dict[str, Any] = {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "memory_efficient_linear": False,
        }
        if layers := layer_classes(self.model):  # none named: DeepSpeed's hooks and leaves
            zero["leaf_module"] = {"classes": layers}
        return zero

    def _forward(
        self, model: Any, ids: torch.Tensor, attn: torch.Tensor | None, **packing: torch.Tensor
    ) -> torch.Tensor:
        if model is self.model:
            self.z.clear_backward_seen_flag()
        return super()._forward(model, ids, attn, **packing)

    def discard(self) -> None:
        # micro-step 0 again: the next backward overwrites the gradient partitions
        self.z.zero_grad()
        self.z.grad_partitions_flat_buffer.zero_()
        super().discard()

    # -- the weights, whole -----------------------------------------------------------------
    def export(self, dtype: Any = None) -> dict[str, torch.Tensor]:
        """Each parameter gathered whole in turn (every rank joins), copied to rank 0's CPU in
        ``dtype``, freed before the next; ranks > 0 get nothing."""
        import deepspeed

        out: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        for name, t in self.model.state_dict(keep_vars=True).items():
            if id(t) in seen:  # a tied alias (lm_head.weight)
                continue
            seen.add(id(t))
            with deepspeed.zero.GatheredParameters([t]):  # a no-op for a buffer
                if self.rank == 0:
                    to = {"device": "cpu", "dtype": dtype or t.dtype, "copy": True}
                    out[name] = t.detach().to(**to).contiguous()
        return out

    def tensors(self) -> dict[str, torch.Tensor]:
        return self.export()

    # -- state ------------------------------------------------------------------------------
    def _full(self, p: torch.Tensor, key: str | None = None) -> torch.Tensor | None:
        """``p``'s fp32 master (``key`` None) or AdamW moment, whole: all-gathered from every
        rank's piece (a collective); on rank 0's CPU, None on the others."""
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        t = safe_get_full_fp32_param(p) if key is None else safe_get_full_optimizer_state(p, key)
        return t.detach().cpu().clone() if self.rank == 0 else None

    def _adam_state(self, p: torch.Tensor) -> dict[str, Any] | None:
        """AdamW's state of the sub-group that holds ``p`` (None before the first step)."""
        z = self.z
        group = z.grad_position[z.get_param_id(p)][0]
        state: dict[str, Any] | None = z.optimizer.state.get(z.fp32_partitioned_groups_flat[group])
        return state

    def optimizer_state(self) -> dict[str, Any]:
        """torch AdamW format, each moment whole on rank 0 (a collective: every rank joins)."""
        state: dict[int, dict[str, Any]] = {}
        for i, p in enumerate(self.params):
            st = self._adam_state(p)
            if not st:  # no step yet: AdamW creates its state lazily
                continue
            moments = {k: self._full(p, k) for k in STATE_KEYS}
            if self.rank == 0:
                state[i] = {"step": st["step"].clone()} | moments
        hyper = {k: v for k, v in self.z.optimizer.param_groups[0].items() if k != "params"}
        return {"state": state, "param_groups": [hyper | {"params": list(range(len(self.params)))}]}

    def checkpoint_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The whole fp32 masters and moments on rank 0 (one shard of world 1); ranks > 0 join
        the gathers and hand back nothing."""
        state = self.optimizer_state()
        weights = [self._full(p) for p in self.params]
        if self.rank != 0:
            return {}, {}
        return ckpts.engine_state(self.names, [w for w in weights if w is not None], state)

    def _piece(self, p: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece of ``full`` (``p``'s shape), zero-padded as ZeRO-3 pads it."""
        import torch

        n = int(p.ds_tensor.numel())
        flat = full.reshape(-1)[self.rank * n : (self.rank + 1) * n]
        piece = torch.zeros(n, dtype=torch.float32, device=p.ds_tensor.device)
        piece[: flat.numel()] = flat
        return piece

    def load_checkpoint_state(self, shards: ckpts.Shards) -> None:
        """Each parameter's rows whole (and its moments), then this rank's piece of each."""
        import torch
        from deepspeed.utils import safe_set_local_fp32_param, safe_set_local_optimizer_state

        groups: list[dict[str, Any]] = []
        for name, p in zip(self.names, self.params, strict=True):
            full = torch.empty(p.ds_shape, dtype=torch.float32)
            state = ckpts.load_engine_state(shards, [name], [full])
            groups = state["param_groups"]
            with torch.no_grad():
                piece = self._piece(p, full)
                p.ds_tensor.data.copy_(piece)
                safe_set_local_fp32_param(p, piece)
            saved = state["state"].get(0)
            if saved is None:
                continue
            self._adam_state_for_load(p, saved["step"])
            for k in STATE_KEYS:
                safe_set_local_optimizer_state(p, self._piece(p, saved[k]), k)
        for g, saved_group in zip(self.z.optimizer.param_groups, groups, strict=False):
            g.update({k: v for k, v in saved_group.items() if k != "params"})

    def _adam_state_for_load(self, p: torch.Tensor, step: torch.Tensor) -> None:
        """AdamW's state of ``p``'s sub-group, created (zero moments) if no step ran yet."""
        import torch

        z = self.z
        flat = z.fp32_partitioned_groups_flat[z.grad_position[z.get_param_id(p)][0]]
        st = z.optimizer.state.setdefault(flat, {})
        st["step"] = step.clone()
        for k in STATE_KEYS:
            if k not in st:
                st[k] = torch.zeros_like(flat)

    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        import torch
        from deepspeed.utils import safe_set_local_fp32_param

        with torch.no_grad():
            for name, p in zip(self.names, self.params, strict=True):
                piece = self._piece(p, tensors[name].float())
                p.ds_tensor.data.copy_(piece)
                safe_set_local_fp32_param(p, piece)
