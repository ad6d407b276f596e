"""Each FSDP rank reads only its rows of a Hugging Face checkpoint: the model is built on the
meta device, sharded, materialised shard by shard, and filled from the safetensors files.

Owns how a sharded trainer starts at real size. What must hold:

* no rank ever holds the whole model: at 7B the old path (``from_pretrained`` on each rank's
  CPU, then ``fully_shard``) held 30 GB of fp32 weights per rank, 240 GB of host RAM on an
  8-GPU node, before the first step. Here a rank allocates its shard (``to_empty``) and reads
  its rows of each tensor (``safe_open(...).get_slice(name)[start:stop]``, an mmap: only those
  bytes are read), cast to the master dtype one tensor at a time;
* the weights are those ``from_pretrained`` gives, bit for bit (the checkpoint's values cast
  to the master dtype), tied embeddings once; non-persistent buffers (rotary ``inv_freq``)
  are recomputed by the model's own ``_init_weights``, as transformers does after its own
  meta-device load;
* a checkpoint this path cannot read (no safetensors, or names that are not the model's:
  an older layout transformers renames on load) falls back to the whole load, with a warning.

Called by ``consumers.engine_fsdp``.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from consumers.checkpoint import local_rows
from srl.errors import ConfigError

log = logging.getLogger("srl.trainer")
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def weight_files(model_dir: str | Path) -> dict[str, Path] | None:
    """Tensor name → the safetensors file holding it (one file, or an index's shards);
    None when the directory has no safetensors weights."""
    from safetensors import safe_open

    d = Path(model_dir)
    if (d / INDEX).is_file():
        try:
            mapping = json.loads((d / INDEX).read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"--model {d}: {INDEX} has no weight_map ({e})") from e
        return {name: d / file for name, file in mapping.items()}
    if (d / SINGLE).is_file():
        with safe_open(str(d / SINGLE), framework="pt") as f:
            return dict.fromkeys(f.keys(), d / SINGLE)
    return None


def meta_model(model_dir: str | Path, dtype: Any) -> Any:
    """The causal LM of ``model_dir``'s config on the meta device: names and shapes, no storage."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_dir))
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def named_state(model: Any) -> dict[str, Any]:
    """The state dict's tensors without tied aliases (what a checkpoint file holds)."""
    out: dict[str, Any] = {}
    seen: set[int] = set()
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            out[name] = t
    return out


def unreadable(model: Any, files: dict[str, Path] | None) -> str | None:
    """Why ``files`` cannot fill ``model`` name by name (None: they can)."""
    if files is None:
        return "no safetensors weights"
    missing = sorted(set(named_state(model)) - set(files))
    if missing:
        return f"{len(missing)} tensors not in the files under their names, e.g. {missing[0]}"
    return None


@dataclass
class Loaded:
    """What one rank read: bytes of its rows, of the checkpoint's total."""

    read: int
    total: int


def init_buffers(model: Any) -> None:
    """Recompute the non-persistent buffers ``to_empty`` left uninitialised (rotary
    ``inv_freq``): ``_init_weights`` of each module that owns one, as transformers does
    after a meta-device load. Its parameters, if any, are filled afterwards."""
    import torch

    with torch.no_grad():
        for module in model.modules():
            if getattr(module, "_non_persistent_buffers_set", None):
                model._init_weights(module)


def fill(model: Any, files: dict[str, Path]) -> Loaded:
    """Copy this rank's rows of every tensor from ``files`` into ``model``'s materialised
    shards (a plain tensor, e.g. a persistent buffer, is read whole), one file at a time: a
    file's mapped pages are let go before the next is opened."""
    import torch
    from safetensors import safe_open

    read = total = 0
    state = named_state(model)
    by_file: dict[Path, list[str]] = {}
    for name in state:
        by_file.setdefault(files[name], []).append(name)
    with torch.no_grad():
        for path, names in sorted(by_file.items()):
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in names:
                    got, size = _fill_one(f.get_slice(name), name, state[name], path)
                    read, total = read + got, total + size
    return Loaded(read, total)


def _fill_one(sl: Any, name: str, t: Any, path: Path) -> tuple[int, int]:
    """This rank's rows of ``t`` from the file's slice ``sl``; (bytes read, bytes in the file)."""
    shape = tuple(sl.get_shape())
    if shape != tuple(t.shape):
        raise ConfigError(
            f"--model: {name} is {shape} in {path.name}, the config makes it {tuple(t.shape)}"
        )
    local, _n, start = local_rows(t.data)
    rows = sl[start : start + local.shape[0]] if local.dim() else sl[:]
    local.copy_(rows.reshape(local.shape))
    return rows.numel() * rows.element_size(), _bytes(sl, shape)


def _bytes(sl: Any, shape: tuple[int, ...]) -> int:
    size = {"F64": 8, "F32": 4, "I64": 8, "I32": 4, "F16": 2, "BF16": 2, "I8": 1, "U8": 1}
    n = 1
    for d in shape:
        n *= d
    return n * size.get(sl.get_dtype(), 4)
