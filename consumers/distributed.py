"""Several trainer ranks through torch.distributed: rank 0 consumes and scatters.

Owns how ranks share the stream. Rank 0 alone reads Kafka, assembles, scores, groups, gates
and batches; every micro-batch it forms goes, round robin, to one rank (itself included),
which runs forward/backward at once. At the step boundary rank 0 tells every rank the step's
normaliser; all ranks all-reduce their summed gradients and take the same AdamW update, so
the replicated model and optimizer never diverge. Why one reader (docs/trainer.md): a group's
samples lie on different partitions, the step must hold a fixed number of groups, and the
dedupe ledger and offset commits must live in one place for exactly-once in effect; token
ids are tiny next to gradients, so the scatter costs nothing that matters.

Wire protocol on a gloo group (CPU tensors; the gradient all-reduce uses the default group,
NCCL on GPUs): an int64 header ``[cmd, a, b, c]`` from rank 0, then the command's tensors.

* ``MB`` (a = rows, b = length): ids, attn, behav, adv, weight of one micro-batch;
* ``STEP`` (a = step): a float64 normaliser; every rank then calls ``Engine.step``;
* ``DISCARD``: forget a partial step; ``STOP``: leave the loop;
* ``STATE``: every rank calls ``Engine.optimizer_state`` (ZeRO gathers its partitions).

Started by ``torchrun`` (RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT in the environment).
Called by ``consumers.trainer``.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from consumers.train_engine import MicroBatch, TrainEngine

if TYPE_CHECKING:
    import torch

log = logging.getLogger("srl.trainer.dist")

MB, STEP, DISCARD, STOP, STATE = 1, 2, 3, 4, 5


class Dist:
    """This process's place among the ranks, and the few collective operations we use."""

    def __init__(self, rank: int, world: int, group: Any = None) -> None:
        self.rank = rank
        self.world = world
        self.group = group  # gloo group for the data plane
        self.next_rank = 0

    @classmethod
    def from_env(cls, device: str) -> Dist | None:
        """Join the process group torchrun describes; None when running alone."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return None
        import torch
        import torch.distributed as dist

        rank = int(os.environ["RANK"])
        backend = "nccl" if device.startswith("cuda") else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend=backend)
        group = dist.new_group(backend="gloo") if backend != "gloo" else None
        return cls(rank, world, group)

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()

    # -- collectives ----------------------------------------------------------------------
    def all_reduce_sum(self, tensors: list[torch.Tensor]) -> None:
        """Sum ``tensors`` over ranks in place, as one flat buffer."""
        import torch
        import torch.distributed as dist

        flat = torch.cat([t.reshape(-1) for t in tensors])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        i = 0
        for t in tensors:
            t.copy_(flat[i : i + t.numel()].view_as(t))
            i += t.numel()

    def all_reduce_floats(self, values: list[float], op: str = "sum") -> list[float]:
        import torch
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(
            t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=self.group
        )
        return [float(x) for x in t.tolist()]

    def broadcast_int(self, value: int) -> int:
        import torch
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.int64)
        dist.broadcast(t, src=0, group=self.group)
        return int(t.item())

    # -- rank 0 → others ------------------------------------------------------------------
    def _header(self, dst: int, cmd: int, a: int = 0, b: int = 0, c: int = 0) -> None:
        import torch
        import torch.distributed as dist

        dist.send(torch.tensor([cmd, a, b, c], dtype=torch.int64), dst=dst, group=self.group)

    def _to_all(self, cmd: int, a: int = 0, payload: torch.Tensor | None = None) -> None:
        import torch.distributed as dist

        for r in range(1, self.world):
            self._header(r, cmd, a)
            if payload is not None:
                dist.send(payload, dst=r, group=self.group)

    def assign(self, mb: MicroBatch) -> bool:
        """Send ``mb`` to the next rank in turn; True when it is rank 0's own to run."""
        import torch.distributed as dist

        dst, self.next_rank = self.next_rank, (self.next_rank + 1) % self.world
        if dst == 0:
            return True
        self._header(dst, MB, mb.ids.shape[0], mb.ids.shape[1])
        for t in mb.tensors():
            dist.send(t.contiguous(), dst=dst, group=self.group)
        return False

    def step(self, step: int, normalizer: float) -> None:
        import torch

        self._to_all(STEP, step, torch.tensor([normalizer], dtype=torch.float64))
        self.next_rank = 0  # every step starts its round robin at rank 0: deterministic

    def discard(self) -> None:
        self._to_all(DISCARD)
        self.next_rank = 0

    def stop(self) -> None:
        self._to_all(STOP)

    def gather_state(self) -> None:
        self._to_all(STATE)


def follow(engine: TrainEngine, dist_: Dist) -> tuple[int, int]:
    """The loop of ranks > 0: run what rank 0 sends until STOP; returns (steps, micro-batches)."""
    import torch
    import torch.distributed as dist

    g = dist_.group
    steps = micro_batches = 0
    while True:
        header = torch.zeros(4, dtype=torch.int64)
        dist.recv(header, src=0, group=g)
        cmd, a, b, _ = (int(x) for x in header.tolist())
        if cmd == MB:
            ids = torch.empty((a, b), dtype=torch.int64)
            attn = torch.empty((a, b), dtype=torch.int64)
            behav = torch.empty((a, b - 1), dtype=torch.float32)
            adv = torch.empty((a,), dtype=torch.float32)
            weight = torch.empty((a, b - 1), dtype=torch.float32)
            for t in (ids, attn, behav, adv, weight):
                dist.recv(t, src=0, group=g)
            engine.backward(MicroBatch(ids, attn, behav, adv, weight))
            micro_batches += 1
        elif cmd == STEP:
            norm = torch.zeros(1, dtype=torch.float64)
            dist.recv(norm, src=0, group=g)
            engine.step(float(norm.item()))
            steps += 1
        elif cmd == DISCARD:
            engine.discard()
        elif cmd == STATE:
            engine.optimizer_state()
        elif cmd == STOP:
            log.info("rank %d: %d steps, %d micro-batches", dist_.rank, steps, micro_batches)
            return steps, micro_batches
        else:
            raise RuntimeError(f"rank {dist_.rank}: unknown command {cmd} from rank 0")
