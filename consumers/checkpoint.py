"""Trainer checkpoints in the object store: sharded per rank, create-only, a marker written last.

Owns what a restart resumes from. Layout: ``checkpoints/{run}/c{n:08d}/`` with

* ``shard-{r:05d}-of-{w:05d}.safetensors``: what rank ``r`` of ``w`` holds, written by that rank
  alone and streamed to the store (hashed while written, multipart on S3: no size ceiling):
  ``model/{name}`` (the master weights), ``exp_avg/{name}`` and ``exp_avg_sq/{name}`` (AdamW's
  moments) as rows ``[start, start + rows)`` of dim 0 of the full tensor. Its safetensors metadata
  ``srl`` (JSON) names each tensor's full first dimension and start row, the optimizer's param
  groups and each parameter's AdamW step. A backend that replicates its state (torch) or
  gathers it (DeepSpeed, every ZeRO stage) has rank 0 write one shard of world 1 holding every
  row;
* ``state.json``: step, policy version, the dedupe ledger (trajectory id → outcome, step), and
  the sample events of the window this checkpoint closes (a restart re-emits those of every kept
  checkpoint, ``window_events``; idempotent by trajectory id and step);
* ``CHECKPOINT.json`` **last**: every file with size and sha256. A directory without it is an
  interrupted write and is ignored; a file that fails its sha256 refuses the load.

Restoring reads, for each tensor, only the rows this rank holds, from whichever shards overlap
them (``Shards.rows``): the same world size reads one file per rank; another world size
(2 ranks → 1, or FSDP → the replicated backend) re-slices the same rows. No pickle anywhere:
safetensors and JSON only. Checkpoint numbers only grow; ``prune`` keeps the newest ``keep``
complete ones. Called by ``consumers.durable`` (every rank writes its shard, rank 0 the rest)
and ``consumers.trainer`` (every rank loads).
"""

from __future__ import annotations

import contextlib
import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson

from schemas.records import now_ms
from srl import tensorfile
from srl.errors import StoreError
from srl.store import ObjectStore

if TYPE_CHECKING:
    import torch

MARKER = "CHECKPOINT.json"
STATE = "state.json"
MOMENTS = ("exp_avg", "exp_avg_sq")
_DIR = re.compile(r"^c(\d{8})$")
_SHARD = re.compile(r"^shard-(\d{5})-of-(\d{5})\.safetensors$")


def prefix(run: str, n: int) -> str:
    return f"checkpoints/{run}/c{n:08d}"


def shard_name(rank: int, world: int) -> str:
    return f"shard-{rank:05d}-of-{world:05d}.safetensors"


# -- a rank's state as named rows ---------------------------------------------------------------
def local_rows(t: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """(this rank's rows, full first dimension, first row) of a parameter or optimizer moment:
    an FSDP2 ``DTensor`` sharded on dim 0 (torch.chunk's split) or a plain, whole tensor."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return t, (t.shape[0] if t.dim() else 1), 0
    local = t.to_local()
    n, world = t.shape[0], t.device_mesh.size()
    chunk = -(-n // world)
    start = min(n, t.device_mesh.get_local_rank() * chunk)
    if local.shape[0] != min(n, start + chunk) - start:
        raise StoreError(f"unexpected shard of {tuple(t.shape)}: {tuple(local.shape)} rows")
    return local, n, start


def engine_state(
    names: Sequence[str], params: Sequence[torch.Tensor], optimizer: dict[str, Any]
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Named rows of the parameters and of AdamW's moments (torch's ``state_dict`` format,
    indexed like ``params``), and the metadata a shard carries (``write_shard``)."""
    tensors: dict[str, torch.Tensor] = {}
    layout: dict[str, list[int]] = {}

    def add(key: str, t: torch.Tensor) -> None:
        local, n, start = local_rows(t.detach())
        tensors[key] = local.cpu().contiguous()
        layout[key] = [n, start]

    steps: dict[str, float] = {}
    for i, (name, p) in enumerate(zip(names, params, strict=True)):
        add(f"model/{name}", p)
        st = optimizer["state"].get(i)
        if st:
            for k in MOMENTS:
                add(f"{k}/{name}", st[k])
            steps[name] = float(st["step"])
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer["param_groups"]]
    return tensors, {"layout": layout, "steps": steps, "param_groups": groups}


def load_engine_state(
    shards: Shards, names: Sequence[str], params: Sequence[torch.Tensor]
) -> dict[str, Any]:
    """Copy this rank's rows of each parameter from ``shards`` into ``params`` (in place: a
    sharded parameter keeps its sharding); returns AdamW's state in torch's format, each moment
    shaped (and sharded) like its parameter."""
    import torch

    state: dict[int, dict[str, Any]] = {}
    with torch.no_grad():
        for i, (name, p) in enumerate(zip(names, params, strict=True)):
            _fill(shards, f"model/{name}", p)
            if name in shards.steps:
                moments = {k: torch.zeros_like(p, dtype=torch.float32) for k in MOMENTS}
                for k, t in moments.items():
                    _fill(shards, f"{k}/{name}", t)
                step = torch.tensor(shards.steps[name], dtype=torch.float32)
                state[i] = {"step": step, **moments}
    groups = [dict(g, params=[]) for g in shards.param_groups]
    if groups:
        groups[0]["params"] = list(range(len(params)))
    for g in groups:
        if "betas" in g:
            g["betas"] = tuple(g["betas"])
    return {"state": state, "param_groups": groups}


def _fill(shards: Shards, key: str, t: torch.Tensor) -> None:
    local, n, start = local_rows(t.data if hasattr(t, "data") else t)
    rows = shards.rows(key, start, start + local.shape[0], n)
    if tuple(rows.shape[1:]) != tuple(local.shape[1:]):
        raise StoreError(f"checkpoint {key}: {tuple(rows.shape)} does not fit {tuple(t.shape)}")
    local.copy_(rows.reshape(local.shape))


# -- files --------------------------------------------------------------------------------------
def write_shard(
    store: ObjectStore,
    run: str,
    n: int,
    rank: int,
    world: int,
    tensors: dict[str, torch.Tensor],
    meta: dict[str, Any],
) -> dict[str, Any]:
    """This rank's shard of checkpoint ``n``, streamed to the store; its marker entry."""
    name = shard_name(rank, world)
    info = {"srl": orjson.dumps(meta).decode()}
    _uri, digest, size = store.put_chunks(
        f"{prefix(run, n)}/{name}", tensorfile.parts(tensors, info)
    )
    return {"name": name, "size": size, "sha256": digest}


def save(
    store: ObjectStore,
    run: str,
    n: int,
    *,
    step: int,
    version: int,
    ledger: dict[str, list[Any]],
    events: list[dict[str, Any]],
    shards: list[dict[str, Any]],
    extra: dict[str, Any] | None = None,
) -> str:
    """Complete checkpoint ``n`` whose ``shards`` every rank has written: ``state.json``, then
    the marker. Returns the marker's URI. StoreError if the store refuses a write, after the
    files written for ``n`` are removed."""
    base = prefix(run, n)
    state = {
        "step": step,
        "version": version,
        "ledger": ledger,
        "events": events,
        "extra": extra or {},
        "created_ms": now_ms(),
    }
    try:
        body = orjson.dumps(state)
        store.put(f"{base}/{STATE}", body)
        entries = [*shards, {"name": STATE, "size": len(body), "sha256": _sha(body)}]
        marker = {"run": run, "number": n, "step": step, "version": version, "files": entries}
        return store.put(f"{base}/{MARKER}", orjson.dumps(marker, option=orjson.OPT_INDENT_2))
    except StoreError:  # a full disk, say: leave no half checkpoint taking its space
        remove(store, run, n)
        raise


def remove(store: ObjectStore, run: str, n: int) -> None:
    """Delete every file of checkpoint ``n`` (a refused or abandoned write)."""
    for key in store.list(prefix(run, n) + "/"):
        with contextlib.suppress(StoreError):
            store.delete(key)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass
class Shards:
    """The shard files of one checkpoint, opened lazily and checked against the marker."""

    store: ObjectStore
    base: str
    entries: dict[str, dict[str, Any]]  # file name -> marker entry
    _open: dict[str, tuple[dict[str, torch.Tensor], dict[str, Any]]] = field(
        default_factory=dict, repr=False
    )

    def _file(self, name: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        if name not in self._open:
            entry = self.entries[name]
            buf, digest = self.store.get_hashed(f"{self.base}/{name}")
            if len(buf) != entry["size"] or digest != entry["sha256"]:
                raise StoreError(f"checkpoint {self.base}: {name} fails its sha256; refusing it")
            tensors = tensorfile.parse(buf, f"{self.base}/{name}")
            self._open[name] = (tensors, orjson.loads(_metadata(buf)["srl"]))
        return self._open[name]

    @property
    def files(self) -> list[str]:
        return sorted(name for name in self.entries if _SHARD.match(name))

    @property
    def _first(self) -> dict[str, Any]:
        return self._file(self.files[0])[1]

    @property
    def steps(self) -> dict[str, float]:
        return dict(self._first["steps"])

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return list(self._first["param_groups"])

    def rows(self, key: str, start: int, stop: int, full: int) -> torch.Tensor:
        """Rows ``[start, stop)`` of tensor ``key`` (first dimension ``full``), from the shards
        that hold them; StoreError when they do not cover them."""
        import torch

        pieces: list[tuple[int, torch.Tensor]] = []
        for name in self.files:
            tensors, meta = self._file(name)
            if key not in tensors:
                continue
            n, first = meta["layout"][key]
            if n != full:
                raise StoreError(f"checkpoint {key}: {n} rows saved, the model has {full}")
            t = tensors[key]
            last = first + (t.shape[0] if t.dim() else 1)
            lo, hi = max(start, first), min(stop, last)
            if lo < hi or (t.dim() == 0 and start == first):
                pieces.append((lo, t[lo - first : hi - first] if t.dim() else t))
        pieces.sort(key=lambda x: x[0])
        got = sum(p.shape[0] if p.dim() else 1 for _, p in pieces)
        if got != stop - start:
            raise StoreError(f"checkpoint {self.base}: {key} rows {start}:{stop} not all saved")
        if len(pieces) == 1:
            return pieces[0][1]
        return torch.cat([p for _, p in pieces]) if pieces else torch.empty(0)


def _metadata(buf: bytearray | Any) -> dict[str, str]:
    import struct

    (n,) = struct.unpack("<Q", bytes(buf[:8]))
    header = orjson.loads(bytes(buf[8 : 8 + n]))
    return dict(header.get("__metadata__") or {})


@dataclass
class Checkpoint:
    """What a checkpoint holds: its state in memory, its shards to read rows from."""

    number: int
    step: int
    version: int
    ledger: dict[str, list[Any]]  # trajectory id -> [outcome, step]
    events: list[dict[str, Any]]
    extra: dict[str, Any]
    shards: Shards


def complete(store: ObjectStore, run: str) -> list[int]:
    """Numbers of the complete checkpoints of ``run`` (marker present), ascending."""
    out = []
    for key in store.list(f"checkpoints/{run}/"):
        parts = key.split("/")
        if len(parts) == 4 and parts[3] == MARKER and (m := _DIR.match(parts[2])):
            out.append(int(m.group(1)))
    return sorted(out)


def highest_number(store: ObjectStore, run: str) -> int:
    """The highest checkpoint number with any file, complete or not (0: none).

    A new checkpoint takes the next number: a crash mid-write leaves files without a marker,
    and create-only writes must never meet them again.
    """
    best = 0
    for key in store.list(f"checkpoints/{run}/"):
        parts = key.split("/")
        if len(parts) == 4 and (m := _DIR.match(parts[2])):
            best = max(best, int(m.group(1)))
    return best


def load(store: ObjectStore, run: str, n: int) -> Checkpoint:
    """Checkpoint ``n``: its state checked against the marker; its shards read on demand."""
    base = prefix(run, n)
    marker = orjson.loads(store.get(f"{base}/{MARKER}"))
    entries = {f["name"]: f for f in marker["files"]}
    if STATE not in entries or not any(_SHARD.match(name) for name in entries):
        raise StoreError(f"checkpoint {base} is of an older layout (no {STATE}); start afresh")
    body = store.get(f"{base}/{STATE}")
    if _sha(body) != entries[STATE]["sha256"]:
        raise StoreError(f"checkpoint {base}: {STATE} fails its sha256; refusing to load")
    state = orjson.loads(body)
    return Checkpoint(
        number=n,
        step=int(state["step"]),
        version=int(state["version"]),
        ledger=state["ledger"],
        events=state["events"],
        extra=state.get("extra", {}),
        shards=Shards(store, base, entries),
    )


def window_events(store: ObjectStore, run: str, upto: int) -> list[dict[str, Any]]:
    """The sample events of every complete checkpoint up to ``upto``, oldest first (only
    ``state.json`` is read, checked against its marker): what a restarted trainer sends again.
    Not just the newest one's: a broker that forgets the records it acknowledged in its last
    ~0.5 s (the embedded one after a SIGKILL, docs/broker.md) can lose an older window's events
    too, when a second checkpoint followed before the trainer's producer failed."""
    out: list[dict[str, Any]] = []
    for n in complete(store, run):
        if n > upto:
            break
        base = prefix(run, n)
        marker = orjson.loads(store.get(f"{base}/{MARKER}"))
        [entry] = [f for f in marker["files"] if f["name"] == "state.json"]
        body = store.get(f"{base}/state.json")
        if hashlib.sha256(body).hexdigest() != entry["sha256"]:
            raise StoreError(f"checkpoint {base}: state.json fails its sha256; refusing to load")
        out += orjson.loads(body)["events"]
    return out


def prune(store: ObjectStore, run: str, keep: int) -> list[int]:
    """Delete all but the newest ``keep`` complete checkpoints (marker first) and interrupted
    writes older than the newest complete one; returns the numbers of the checkpoints removed."""
    numbers = complete(store, run)
    gone = numbers[:-keep] if keep > 0 else []
    for n in gone:
        store.delete(f"{prefix(run, n)}/{MARKER}")  # first: from here on it is not complete
    newest = numbers[-1] if numbers else 0
    for key in store.list(f"checkpoints/{run}/"):  # the pruned ones, and interrupted writes
        parts = key.split("/")
        if len(parts) == 4 and (m := _DIR.match(parts[2])):
            n = int(m.group(1))
            if n < newest and (n in gone or n not in numbers):
                store.delete(key)
    return gone


def newest_published(store: ObjectStore, run: str) -> int:
    """The highest weights version of ``run`` with a manifest in the store (0: none)."""
    best = 0
    for key in store.list(f"weights/{run}/"):
        parts = key.split("/")
        if len(parts) == 4 and parts[3] == "manifest.json" and parts[2].startswith("v"):
            best = max(best, int(parts[2][1:]))
    return best
