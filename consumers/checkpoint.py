"""Trainer checkpoints in the object store: create-only files, a marker written last.

Owns what a restart resumes from. Layout: ``checkpoints/{run}/c{n:08d}/`` with

* ``model.safetensors``: the model's tensors (tied aliases left out, like published weights);
* ``optimizer.safetensors`` + ``optimizer.json``: AdamW's per-parameter tensors and its
  param groups as JSON (no pickle anywhere: safetensors and JSON only);
* ``state.json``: step, policy version, the dedupe ledger (trajectory id → outcome, step),
  and the sample events of the window this checkpoint closes (a restart re-emits those of
  every kept checkpoint, ``window_events``; idempotent by trajectory id and step);
* ``CHECKPOINT.json`` **last**: every file with size and sha256. A directory without it is
  an interrupted write and is ignored; a file that fails its sha256 refuses the load.

Checkpoint numbers only grow; ``prune`` keeps the newest ``keep`` complete ones. Called by
``consumers.trainer`` (rank 0 writes; every rank loads).
"""

from __future__ import annotations

import contextlib
import hashlib
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson

from schemas.records import now_ms
from srl.errors import StoreError
from srl.store import ObjectStore

if TYPE_CHECKING:
    import torch

MARKER = "CHECKPOINT.json"
_DIR = re.compile(r"^c(\d{8})$")


def prefix(run: str, n: int) -> str:
    return f"checkpoints/{run}/c{n:08d}"


@dataclass
class Checkpoint:
    """What a checkpoint holds, in memory."""

    number: int
    step: int
    version: int
    ledger: dict[str, list[Any]]  # trajectory id -> [outcome, step]
    events: list[dict[str, Any]]
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]  # torch optimizer state_dict
    extra: dict[str, Any]


def optimizer_to_files(state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], bytes]:
    """AdamW state_dict → (tensors, JSON): per-parameter tensors by ``{index}.{name}``."""
    import torch

    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, Any] = {}
    for idx, per in state["state"].items():
        for name, value in per.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{idx}.{name}"] = value.detach().cpu().contiguous()
            else:
                scalars[f"{idx}.{name}"] = value
    body = {"param_groups": state["param_groups"], "scalars": scalars}
    return tensors, orjson.dumps(body)


def optimizer_from_files(tensors: dict[str, torch.Tensor], body: bytes) -> dict[str, Any]:
    meta = orjson.loads(body)
    per: dict[int, dict[str, Any]] = {}
    for key, value in [*tensors.items(), *meta["scalars"].items()]:
        idx, name = key.split(".", 1)
        per.setdefault(int(idx), {})[name] = value
    groups = [dict(g, betas=tuple(g["betas"])) if "betas" in g else g for g in meta["param_groups"]]
    return {"state": dict(sorted(per.items())), "param_groups": groups}


def save(
    store: ObjectStore,
    run: str,
    n: int,
    *,
    step: int,
    version: int,
    ledger: dict[str, list[Any]],
    events: list[dict[str, Any]],
    model: dict[str, torch.Tensor],
    optimizer: dict[str, Any],
    extra: dict[str, Any] | None = None,
) -> str:
    """Write checkpoint ``n``; the marker goes last. Returns the marker's URI. StoreError if the
    store refuses a write, after the files written for ``n`` are removed."""
    from safetensors.torch import save as st_save

    base = prefix(run, n)
    opt_tensors, opt_json = optimizer_to_files(optimizer)
    state = {
        "step": step,
        "version": version,
        "ledger": ledger,
        "events": events,
        "extra": extra or {},
        "created_ms": now_ms(),
    }
    files = {
        "model.safetensors": st_save({k: v.detach().cpu().contiguous() for k, v in model.items()}),
        "optimizer.safetensors": st_save(opt_tensors) if opt_tensors else b"",
        "optimizer.json": opt_json,
        "state.json": orjson.dumps(state),
    }
    entries = []
    try:
        for name, data in files.items():
            store.put(f"{base}/{name}", data)
            entries.append(
                {"name": name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
            )
        marker = {"run": run, "number": n, "step": step, "version": version, "files": entries}
        return store.put(f"{base}/{MARKER}", orjson.dumps(marker, option=orjson.OPT_INDENT_2))
    except StoreError:  # a full disk, say: leave no half checkpoint taking its space
        for key in store.list(base + "/"):
            with contextlib.suppress(StoreError):
                store.delete(key)
        raise


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
    """Checkpoint ``n`` after checking every file against the marker."""
    from safetensors.torch import load as st_load

    base = prefix(run, n)
    marker = orjson.loads(store.get(f"{base}/{MARKER}"))
    data = {}
    for f in marker["files"]:
        body = store.get(f"{base}/{f['name']}")
        if len(body) != f["size"] or hashlib.sha256(body).hexdigest() != f["sha256"]:
            raise StoreError(f"checkpoint {base}: {f['name']} fails its sha256; refusing to load")
        data[f["name"]] = body
    state = orjson.loads(data["state.json"])
    opt_t = st_load(data["optimizer.safetensors"]) if data["optimizer.safetensors"] else {}
    return Checkpoint(
        number=n,
        step=int(state["step"]),
        version=int(state["version"]),
        ledger=state["ledger"],
        events=state["events"],
        model=st_load(data["model.safetensors"]),
        optimizer=optimizer_from_files(opt_t, data["optimizer.json"]),
        extra=state.get("extra", {}),
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
