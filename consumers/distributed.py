"""Several trainer ranks through torch.distributed: rank 0 consumes and hands out the work.

Owns how ranks share the stream. Rank 0 alone reads Kafka, assembles, scores, groups, gates
and batches; every micro-batch it forms goes to one rank (itself included), which runs
forward/backward at once. A replicated backend takes them round robin; a lockstep one (FSDP,
whose every forward and backward is a collective) in rounds of one per rank, the busiest
rank's first (a round leaves when all its ranks have one; the last round of a step is padded
with zero-weight micro-batches). At the step boundary rank 0 tells every rank the step's
normaliser and every rank takes the same AdamW update (on its shard, or on its replica after
an all-reduce). Why one reader (docs/trainer.md): a group's samples lie on different
partitions, the step must hold a fixed number of groups, and the dedupe ledger and offset
commits must live in one place for exactly-once in effect; token ids are tiny next to
gradients, so handing them out costs nothing that matters.

Wire protocol on a gloo group (CPU tensors; the gradient collectives use the default group,
NCCL on GPUs): an int64 header ``[cmd, a, b, c]`` from rank 0, then the command's tensors.

* ``MB`` (a = rows, b = length): ids, attn, behav, adv, weight of one micro-batch; a = 0: a
  zero-weight one (a lockstep round's padding), no tensors follow;
* ``STEP`` (a = step): a float64 normaliser; every rank then calls ``Engine.step``;
* ``DISCARD``: forget a partial step; ``STOP``: leave the loop;
* ``EXPORT``: every rank joins ``Engine.export`` (FSDP gathers each parameter in turn);
* ``SAVE`` (a = checkpoint number): every rank writes its shard (``save_shard``) and hands its
  marker entry to rank 0.

Started by ``torchrun`` (RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT in the environment).
Called by ``consumers.trainer`` and ``consumers.durable``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from consumers import checkpoint as ckpts
from consumers.train_engine import (
    MicroBatch,
    TrainEngine,
    balanced,
    empty_micro_batch,
    split_rows,
)
from srl.errors import StoreError

if TYPE_CHECKING:
    import torch

    from srl.store import ObjectStore

PR_SET_PDEATHSIG = 1  # prctl(2)
log = logging.getLogger("srl.trainer.dist")

MB, STEP, DISCARD, STOP, EXPORT, SAVE = 1, 2, 3, 4, 6, 7


def die_with_launcher() -> None:
    """Under torchrun, end this rank when its launcher ends, whatever ends it. torchrun starts
    each rank in a session of its own, so a process manager that SIGKILLs torchrun's process
    group left the ranks running (found by ``srl chaos --trainer-ranks 2``: the killed
    trainer's ranks kept their static group membership and checkpoints, beside the restarted
    ones). Linux's parent-death signal makes the kernel SIGKILL the rank instead.

    It is asked for only once the rank runs this, seconds after its start (imports): a
    launcher killed before then has already left the rank to init or a subreaper, and the
    signal would never come. Such an orphan joined the next launcher's rendezvous on the same
    port beside that launcher's own ranks (``srl chaos --trainer-ranks 2``, a trainer killed
    9 s after its restart: the next trainer's ranks then failed in their first broadcast, or
    trained and never exited). So the rank checks that its parent is still a torch launcher,
    and ends itself otherwise."""
    if sys.platform != "linux" or "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        log.warning("rank: cannot ask to die with torchrun (errno %d)", ctypes.get_errno())
    parent = os.getppid()
    if not is_launcher(parent):
        log.error(
            "rank %s: its launcher ended before it joined (its parent is now pid %d, not "
            "torchrun); exiting",
            *(os.environ.get("RANK", "?"), parent),
        )
        os._exit(1)


def is_launcher(pid: int) -> bool:
    """Whether process ``pid`` is a torch launcher (``torchrun``, ``python -m
    torch.distributed.run`` or ``.launch``): what an orphaned rank's new parent is not."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return any(b"torchrun" in a or a.startswith(b"torch.distributed.") for a in argv)


class Dist:
    """This process's place among the ranks, and the few collective operations we use."""

    def __init__(self, rank: int, world: int, group: Any = None) -> None:
        self.rank = rank
        self.world = world
        self.group = group  # gloo group for the data plane
        self.next_rank = 0
        self.lockstep = False  # the backend's: hand micro-batches out in rounds
        self.round: list[MicroBatch] = []  # a lockstep round being filled

    @classmethod
    def from_env(cls, device: str) -> Dist | None:
        """Join the process group torchrun describes; None when running alone."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return None
        import torch
        import torch.distributed as dist

        die_with_launcher()
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

    def assign(self, mb: MicroBatch) -> list[MicroBatch]:
        """Hand ``mb`` out; returns the micro-batches rank 0 runs now (none, or one)."""
        if not self.lockstep:
            dst, self.next_rank = self.next_rank, (self.next_rank + 1) % self.world
            if dst == 0:
                return [mb]
            self._send(dst, mb)
            return []
        self.round.append(mb)
        return self._deal() if len(self.round) == self.world else []

    def _balance(self) -> None:
        """The last round of a step (shorter, or its micro-batches of unequal sizes: the step's
        remainder): its rows regrouped into one micro-batch per rank of about equal tokens
        (``balanced``), so no rank waits at the step for the one that got the full micro-batch;
        where that cannot be done within the batcher's bound, ``_spread``."""
        parts = balanced(self.round, self.world) if self.round else None
        if parts is not None:
            self.round = parts
        else:
            self._spread()

    def _spread(self) -> None:
        """A last round with fewer micro-batches than ranks (a step's tokens fit fewer
        micro-batches than there are ranks): split the biggest by rows until every rank has
        one or no micro-batch has two rows, so no rank only pads while another computes."""
        while len(self.round) < self.world:
            many = [m for m in self.round if m.ids.shape[0] > 1]
            if not many:
                return
            big = max(many, key=lambda m: int(m.attn.sum()))
            self.round = [m for m in self.round if m is not big] + list(split_rows(big))

    def _deal(self) -> list[MicroBatch]:
        """One micro-batch per rank, the most tokens to rank 0 (it also reads Kafka, so its
        backward starts last); zero-weight ones where the round is short. Tokens are the
        real ones (``attn``): what a packed micro-batch computes."""
        mbs = sorted(self.round, key=lambda m: -int(m.attn.sum()))
        self.round = []
        for r in range(1, self.world):
            self._send(r, mbs[r] if r < len(mbs) else None)
        return [mbs[0]]

    def _send(self, dst: int, mb: MicroBatch | None) -> None:
        import torch.distributed as dist

        if mb is None:
            self._header(dst, MB, 0, 0)
            return
        self._header(dst, MB, mb.ids.shape[0], mb.ids.shape[1])
        for t in mb.tensors():
            dist.send(t.contiguous(), dst=dst, group=self.group)

    def step(self, step: int, normalizer: float, backward: Callable[[MicroBatch], None]) -> None:
        """The step boundary: a lockstep round still being filled leaves, padded (rank 0 runs
        its part with ``backward``); then every rank steps with the step's normaliser."""
        import torch

        self._balance()
        for own in self._deal() if self.round else []:
            backward(own)
        self._to_all(STEP, step, torch.tensor([normalizer], dtype=torch.float64))
        self.next_rank = 0  # every step starts its round robin at rank 0: deterministic

    def discard(self) -> None:
        self._to_all(DISCARD)
        self.next_rank = 0
        self.round = []

    def stop(self) -> None:
        self._to_all(STOP)

    def export(self) -> None:
        self._to_all(EXPORT)

    def save(self, number: int) -> None:
        self._to_all(SAVE, number)

    def gather_objects(self, obj: Any) -> list[Any]:
        """``obj`` of every rank, in rank order, on every rank."""
        import torch.distributed as dist

        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out


def save_shard(
    engine: TrainEngine, dist_: Dist | None, store: ObjectStore, run: str, number: int
) -> list[dict[str, Any]]:
    """Every rank: its shard of checkpoint ``number`` (a replicated backend: rank 0 writes the
    whole state as one shard); returns every written shard's marker entry, in rank order.
    StoreError on every rank when any rank's write was refused."""
    rank, world = (dist_.rank, dist_.world) if dist_ is not None else (0, 1)
    tensors, meta = engine.checkpoint_state()  # DeepSpeed gathers its partitions: a collective
    entry: dict[str, Any] | None = None
    if engine.sharded or rank == 0:
        at, of = (rank, world) if engine.sharded else (0, 1)
        try:
            entry = ckpts.write_shard(store, run, number, at, of, tensors, meta)
        except StoreError as e:
            entry = {"error": f"rank {rank}: {e}"}
    del tensors
    entries = dist_.gather_objects(entry) if dist_ is not None else [entry]
    refused = [e["error"] for e in entries if e and "error" in e]
    if refused:
        raise StoreError("; ".join(refused))
    return [e for e in entries if e]


def follow(engine: TrainEngine, dist_: Dist, store: ObjectStore, run: str) -> tuple[int, int]:
    """The loop of ranks > 0: run what rank 0 sends until STOP; returns (steps, micro-batches)."""
    import torch
    import torch.distributed as dist

    g = dist_.group
    steps = micro_batches = 0
    while True:
        header = torch.zeros(4, dtype=torch.int64)
        dist.recv(header, src=0, group=g)
        cmd, a, b, _ = (int(x) for x in header.tolist())
        if cmd == MB and a == 0:
            engine.backward(empty_micro_batch())
        elif cmd == MB:
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
        elif cmd == EXPORT:
            engine.export()
        elif cmd == SAVE:
            with contextlib.suppress(StoreError):  # rank 0 reports it
                save_shard(engine, dist_, store, run, a)
        elif cmd == STOP:
            log.info("rank %d: %d steps, %d micro-batches", dist_.rank, steps, micro_batches)
            return steps, micro_batches
        else:
            raise RuntimeError(f"rank {dist_.rank}: unknown command {cmd} from rank 0")
