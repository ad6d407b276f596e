"""The DeepSpeed backend: the plain-torch ``Engine`` contract on a DeepSpeed ZeRO engine.

Owns how our streaming step maps onto DeepSpeed (pinned: ``deepspeed==0.19.8``, the
``.[deepspeed]`` extra). What must hold, as for ``consumers.engine.Engine``: micro-batches
backward as they arrive with unnormalised sums; ``step(normalizer)`` divides by a normaliser
known only when the step is full, clips, and updates; every rank ends a step with the same
weights as the torch backend would (tests/unit/test_deepspeed_backend.py,
tests/e2e/test_trainer_ranks.py).

How:

* ``managed_gradient_accumulation: false``: the caller owns the accumulation boundary, so a
  step holds any number of micro-batches and ``engine.step()`` is the boundary;
* the normaliser (and DeepSpeed's mean over data-parallel ranks, where we want a sum)
  is applied at the boundary: stage 0 scales ``p.grad`` before DeepSpeed all-reduces it;
  stages 1 to 3 set the ZeRO optimizer's loss scale to ``normalizer / world`` for the
  step, so its unscale divides the reduced gradient partitions and its clipping sees the
  true norm (stages 2 and 3 reduce during backward, before the normaliser is known);
* the client optimizer is ``torch.optim.AdamW`` (DeepSpeed's own FusedAdam JIT-compiles a
  CUDA/C++ op; on CPU that build hung here, docs/trainer.md);
* checkpoints keep torch's AdamW ``state_dict`` format: ZeRO's flat partitions are gathered
  and cut per parameter on save, flattened and sliced on load, so a checkpoint resumes under
  either backend and any number of ranks.

ZeRO-2 on several ranks reduce-scatters inside every backward, a collective all ranks must
join together, while rank 0 scatters micro-batches one rank at a time as they fill (a rank in
that collective would wait for one that waits for rank 0): there, micro-batches are held and
run at the step, every rank as many as the busiest, padded with zero-weight ones. That loses
backward-while-the-step-fills for this one configuration; ZeRO-0/1 and one-rank ZeRO-2
stream. Stage 3 (parameters partitioned too) is ``consumers.engine_zero3.ZeRO3Engine``, a
subclass. Refused with one line: 16-bit master weights. Called by
``consumers.backends.make_engine``.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from consumers.config import TrainConfig
from consumers.engine import Engine
from consumers.train_engine import MicroBatch, StepStats
from srl.broker import free_port
from srl.errors import ConfigError

log = logging.getLogger(__name__)

# DeepSpeed's CPU accelerator JIT-compiles a shared-memory all-reduce op on first use (83 s of
# CPU on the 2-core machine, 2026-11-27: a stall before a fresh install's first step, and the
# build's lock file, holding no process id, hung every later start once a build was killed).
# CPU ranks reduce through gloo instead, as under the torch backend.
SHM_COMM_OP = "deepspeed_shm_comm"

if TYPE_CHECKING:
    import torch

    from consumers.distributed import Dist

STATE_KEYS = ("exp_avg", "exp_avg_sq")


def check_supported(cfg: TrainConfig) -> None:
    """One-line error when deepspeed is missing, before any model is loaded (the settings it
    does not support are refused by ``TrainConfig``'s validator)."""
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        raise ConfigError(
            "backend: deepspeed is not installed; pip install -e '.[deepspeed]' or --backend torch"
        ) from None


def skip_shm_comm_build() -> None:
    """Tell DeepSpeed its shared-memory all-reduce op cannot run here (see ``SHM_COMM_OP``):
    its comm backend then all-reduces through torch.distributed (gloo) and builds nothing."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__[SHM_COMM_OP] = False


class DeepSpeedEngine(Engine):
    """ZeRO stage 0/1/2 around the same model, loss and AdamW as the torch backend (stage 3:
    ``ZeRO3Engine``)."""

    def __init__(self, cfg: TrainConfig, dist: Dist | None = None) -> None:
        check_supported(cfg)
        super().__init__(cfg, dist)
        if self.device == "cpu":
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import torch.distributed as tdist

        if not tdist.is_initialized():
            # one rank: DeepSpeed still wants a process group. It stays for the process's
            # life: DeepSpeed caches groups, so a second engine cannot use a new one.
            import atexit

            tdist.init_process_group(
                "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
            )
            atexit.register(tdist.destroy_process_group)
        os.environ.setdefault("LOCAL_RANK", "0")
        if self.device == "cpu":
            skip_shm_comm_build()
        import deepspeed

        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
        self.world = tdist.get_world_size()
        self.stage = cfg.zero_stage
        config = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "managed_gradient_accumulation": False,
            # stage 0 clips in our pre-step hook, which also keeps the norm DeepSpeed drops
            "gradient_clipping": cfg.max_grad_norm if self.stage > 0 else 0.0,
            "zero_optimization": self._zero_config(),
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 1 << 30,
        }
        self.ds, _, _, _ = deepspeed.initialize(
            model=self.model, optimizer=self.optimizer, config=config
        )
        self.zero = self.ds.optimizer if self.stage > 0 else None
        self.norm = 0.0
        if self.zero is None:
            self.optimizer.register_step_pre_hook(self._clip)
        self.index = {id(p): i for i, p in enumerate(self.params)}
        # ZeRO-2 reduce-scatters inside every backward: a collective every rank must join, so
        # with several ranks a step's micro-batches wait and run in lockstep at the step
        self.defer = self.stage == 2 and self.world > 1
        self.lockstep = self.defer
        self.deferred: list[MicroBatch] = []

    def _zero_config(self) -> dict[str, Any]:
        """The ``zero_optimization`` section of DeepSpeed's config."""
        return {"stage": self.stage}

    # -- micro-batches and the step -------------------------------------------------------
    def _backprop(self, loss: torch.Tensor) -> None:
        self.ds.backward(loss, scale_wrt_gas=False)

    def backward(self, mb: MicroBatch) -> None:
        if self.defer:
            self.deferred.append(mb)
        else:
            super().backward(mb)

    def step(self, normalizer: float) -> StepStats:
        if self.defer:
            self._run_in_lockstep()
        return super().step(normalizer)

    def _run_in_lockstep(self) -> None:
        """Every rank runs as many backwards as the busiest one: its own micro-batches, then
        zero-weight ones (they add nothing but join each reduce-scatter). The padding is
        stored too, so further passes (``updates_per_step``) stay in lockstep."""
        assert self.dist is not None
        mine, self.deferred = self.deferred, []
        most = int(self.dist.all_reduce_floats([float(len(mine))], op="max")[0])
        for i in range(most):
            if i < len(mine):
                super().backward(mine[i])
            else:
                padded = self.stats.padded_tokens
                super().backward(_zero_weight(mine[0] if mine else None))
                self.stats.padded_tokens = padded

    def _clip(self, *_: Any) -> None:
        """Stage 0, after DeepSpeed's all-reduce: every rank holds the step's gradient."""
        import torch

        if self.cfg.max_grad_norm > 0:
            self.norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.cfg.max_grad_norm))

    def _update(self, normalizer: float) -> float:
        if self.zero is None:
            scale = self.world / normalizer if normalizer > 0 else 0.0
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(scale)
            self.ds.step()  # all-reduce, then AdamW with our clipping pre-step hook
            self.ds.zero_grad()
            return self.norm
        self.zero.override_loss_scale(normalizer / self.world if normalizer > 0 else float("inf"))
        self.ds.step()
        self.zero.override_loss_scale(1.0)
        self.ds.zero_grad()
        norm = self.ds.get_global_grad_norm()
        return float(norm) if norm is not None else 0.0

    def discard(self) -> None:
        self.deferred = []
        # a partial step's gradients: p.grad (stage 0/1) and the ZeRO-2 partitions
        self.ds.zero_grad()
        if self.zero is not None and self.stage == 2:
            # stage 2 reduces during backward and accumulates the partitions' sums here
            for i in list(self.zero.all_grad_tensors):
                self.zero.all_grad_tensors[i] = None
        super().discard()

    # -- state ------------------------------------------------------------------------------
    def _gather(self, part: torch.Tensor) -> torch.Tensor:
        """Every rank's equal-sized partition of a flat group, concatenated in rank order."""
        import torch
        import torch.distributed as tdist

        if self.world == 1:
            return part
        parts = [torch.empty_like(part) for _ in range(self.world)]
        tdist.all_gather(parts, part.contiguous())
        return torch.cat(parts)

    def optimizer_state(self) -> dict[str, Any]:
        """torch AdamW format; with several ranks a collective (``Dist.SAVE`` on rank 0)."""
        if self.zero is None:
            return super().optimizer_state()
        z = self.zero
        state: dict[int, dict[str, Any]] = {}
        for i, group in enumerate(z.round_robin_bit16_groups):
            part = z.single_partition_of_fp32_groups[i]
            st = z.optimizer.state.get(part, {})
            if not st:  # no step yet: AdamW creates its state lazily
                continue
            full = {k: self._gather(st[k]) for k in STATE_KEYS}
            for p, off in zip(group, z.round_robin_bit16_offsets[i], strict=True):
                n = p.numel()
                state[self.index[id(p)]] = {"step": st["step"].clone()} | {
                    k: full[k][off : off + n].view_as(p).clone().cpu() for k in STATE_KEYS
                }
        hyper = {k: v for k, v in z.optimizer.param_groups[0].items() if k != "params"}
        return {"state": state, "param_groups": [hyper | {"params": list(range(len(self.params)))}]}

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        import torch

        if self.zero is None:
            super().load_optimizer_state(state)
            return
        z = self.zero
        per_param = {int(k): v for k, v in state["state"].items()}
        rank = torch.distributed.get_rank()
        for i, group in enumerate(z.round_robin_bit16_groups):
            part = z.single_partition_of_fp32_groups[i]
            idx = [self.index[id(p)] for p in group]
            if not all(j in per_param for j in idx):
                continue
            flat = {
                k: torch.zeros(z.bit16_groups_flat[i].numel(), dtype=part.dtype) for k in STATE_KEYS
            }
            for p, j, off in zip(group, idx, z.round_robin_bit16_offsets[i], strict=True):
                for k in STATE_KEYS:
                    flat[k][off : off + p.numel()] = per_param[j][k].reshape(-1)
            size = part.numel()
            z.optimizer.state[part] = {"step": per_param[idx[0]]["step"].clone()} | {
                k: flat[k][rank * size : (rank + 1) * size].clone().to(part.device)
                for k in STATE_KEYS
            }
        for g, saved in zip(z.optimizer.param_groups, state["param_groups"], strict=False):
            g.update({k: v for k, v in saved.items() if k != "params"})

    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        super().load_tensors(tensors)  # copies into the model's views of ZeRO's flat buffers
        self._loaded()

    def _loaded(self) -> None:
        if self.zero is not None:
            self.zero.refresh_fp32_params()  # into the fp32 master partitions


def _zero_weight(like: MicroBatch | None) -> MicroBatch:
    """A micro-batch whose loss weights are all zero: its gradient is zero everywhere."""
    import torch

    if like is None:
        ids = torch.zeros((1, 2), dtype=torch.int64)
        return MicroBatch(
            ids, torch.ones_like(ids), torch.zeros((1, 1)), torch.zeros(1), torch.zeros((1, 1))
        )
    return MicroBatch(
        like.ids, like.attn, like.behav, torch.zeros_like(like.adv), torch.zeros_like(like.weight)
    )
