"""Hugging Face transformers engine: continuous batching over one left-padded KV cache.

Owns generation with any causal LM that ``AutoModelForCausalLM`` loads (CPU or GPU). How the
batch works, and what must hold:

* All running sequences share one ``DynamicCache`` whose rows are **left-padded** to a common
  length; a 2-D attention mask hides the padding and every row passes its own
  ``position_ids``, so a row computes exactly what it would compute alone.
* A new request is prefilled on its own (prompt + resume prefix, no padding, so no query row is
  ever fully masked), its first token is sampled from the prefill logits, and its cache is
  merged into the batch (the shorter side is left-padded with zeros). Admission happens in
  every ``step`` while slots are free: sequences join as others finish.
* A finished row is removed from the cache (``index`` on the batch dimension), and leading
  columns that are padding in every remaining row are cut, so the cache does not keep the
  length of sequences long gone.
* Each step feeds each row its last sampled token and samples one more; every emitted token
  carries its behaviour log-prob (``producers.engines.sampling``) and the engine's version.
* A request with its own ``seed`` (``srl serve``) draws from its own generator, so its tokens do
  not depend on what else is sampled; the logits may still differ in the last bits with the
  batch's shape (best effort, like OpenAI's ``seed``).
* ``load_weights`` checks names and shapes against the model before copying anything, so a
  version that does not fit is refused and the old weights stay intact. The KV cache of
  running sequences is kept across a swap (in-flight update, as PipelineRL does); the tokens
  sampled afterwards carry the new version.

Models whose cache is not a plain full-attention ``DynamicCache`` (sliding-window or hybrid
layers) are refused with one line; use the vllm engine for them. Called via
``producers.engines.make_engine``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from producers.engines.base import (
    FINISH_LENGTH,
    FINISH_STOP,
    Emitted,
    Engine,
    Request,
    RequestError,
)
from producers.engines.sampling import sample, top_logprobs
from srl.errors import ConfigError, WeightsError
from srl.tinymodel import load_model, load_tokenizer

if TYPE_CHECKING:
    import torch

log = logging.getLogger("srl.engine.hf")


@dataclass
class _Row:
    request: Request
    generated: int  # completion tokens so far, prefix included
    next_token: int  # sampled, emitted, not yet fed to the model
    valid: int  # tokens of this row in the cache (prompt + fed completion tokens)


class HFEngine(Engine):
    name = "hf"

    def __init__(
        self,
        model_dir: str | Path,
        max_batch: int = 8,
        device: str = "cpu",
        dtype: str = "float32",
        seed: int | None = None,
    ) -> None:
        import torch
        from transformers.cache_utils import (
            DynamicCache,
        )  # not the lazy top level: thread-safe import
        from transformers.utils import logging as hf_logging

        super().__init__(max_batch)
        if not Path(model_dir, "config.json").is_file():
            raise ConfigError(f"model: {model_dir} is not a Hugging Face model directory")
        self.device = torch.device(device)
        torch_dtype = getattr(torch, dtype, None)
        if not isinstance(torch_dtype, torch.dtype):
            raise ConfigError(f"dtype: unknown torch dtype {dtype!r}")
        hf_logging.disable_progress_bar()  # a worker's stderr is a log, not a terminal
        self.model = load_model(model_dir, device, torch_dtype).eval()
        self.tokenizer = load_tokenizer(model_dir)
        self._cache_cls = DynamicCache
        cfg = self.model.config
        self.max_positions = int(getattr(cfg, "max_position_embeddings", 1 << 30))
        self.vocab_size = int(self.model.get_input_embeddings().num_embeddings)
        self.eos_ids = _eos_ids(self.model, self.tokenizer)
        self.generator = torch.Generator(self.device)
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)
        self.seeded: dict[str, torch.Generator] = {}  # generators of requests with a seed
        self.rows: list[_Row] = []
        self.cache: Any = None
        self.mask: torch.Tensor | None = None  # [B, T] 1 = real token, 0 = left padding

    # -- engine interface ----------------------------------------------------------------
    @property
    def running(self) -> int:
        return len(self.rows)

    def tokenize(self, text: str) -> list[int]:
        ids = list(self.tokenizer(text)["input_ids"])
        if not ids and self.tokenizer.bos_token_id is not None:
            ids = [int(self.tokenizer.bos_token_id)]
        return ids

    def _check(self, request: Request) -> None:
        n = len(request.prompt_ids) + len(request.prefix)
        if n >= self.max_positions:
            raise RequestError(
                f"request {request.key}: prompt + prefix of {n} tokens does not fit the model's "
                f"{self.max_positions} positions"
            )
        ids = [*request.prompt_ids, *request.prefix]
        if ids and not (min(ids) >= 0 and max(ids) < self.vocab_size):
            raise RequestError(
                f"request {request.key}: token ids outside the model's vocabulary of "
                f"{self.vocab_size}"
            )

    def step(self) -> list[Emitted]:
        import torch

        out: list[Emitted] = []
        with torch.inference_mode():
            if self.rows:
                out += self._decode()
            while self.waiting and len(self.rows) < self.max_batch:
                out += self._admit(self._next_waiting())
        if self.seeded:  # forget the generators of finished and aborted requests
            live = {r.request.key for r in self.rows}
            self.seeded = {k: g for k, g in self.seeded.items() if k in live}
        return out

    def running_keys(self) -> list[str]:
        return [row.request.key for row in self.rows]

    def _abort_running(self, key: str) -> bool:
        for i, row in enumerate(self.rows):
            if row.request.key == key:
                self._keep([j for j in range(len(self.rows)) if j != i])
                return True
        return False

    def load_weights(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        import torch

        own = self.model.state_dict()
        unknown = sorted(set(tensors) - set(own))
        tied = getattr(self.model, "_tied_weights_keys", None) or {}
        tied_ok = (
            {k for k, src in dict(tied).items() if src in tensors}
            if isinstance(tied, dict)
            else set()
        )
        missing = sorted(set(own) - set(tensors) - tied_ok)
        bad_shape = sorted(
            k for k in tensors if k in own and tuple(tensors[k].shape) != tuple(own[k].shape)
        )
        if unknown or missing or bad_shape:
            what = [
                f"{len(x)} {name} (e.g. {x[0]})"
                for name, x in (
                    ("unknown tensors", unknown),
                    ("missing tensors", missing),
                    ("shape mismatches", bad_shape),
                )
                if x
            ]
            raise WeightsError(f"v{version} does not fit the model: {', '.join(what)}")
        with torch.no_grad():
            self.model.load_state_dict(tensors, strict=False)
        self.version = version

    # -- batch mechanics -----------------------------------------------------------------
    def _decode(self) -> list[Emitted]:
        import torch

        assert self.mask is not None
        dev = self.device
        ids = torch.tensor([[r.next_token] for r in self.rows], device=dev)
        pos = torch.tensor([[r.valid] for r in self.rows], device=dev)
        mask = torch.cat(
            [self.mask, torch.ones(len(self.rows), 1, dtype=self.mask.dtype, device=dev)], 1
        )
        logits = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=pos,
            past_key_values=self.cache,
            use_cache=True,
        ).logits[:, -1]
        self.mask = mask
        for r in self.rows:
            r.valid += 1
        reqs = [r.request for r in self.rows]
        tokens, logprobs = self._sample(logits, reqs)
        tops = self._tops(logits, reqs)
        out, keep = [], []
        for i, (row, tok, lp) in enumerate(zip(self.rows, tokens, logprobs, strict=True)):
            row.generated += 1
            row.next_token = tok
            finish = self._finish(row, tok)
            out.append(Emitted(row.request.key, [tok], [lp], finish, tops[i]))
            if finish is None:
                keep.append(i)
        if len(keep) < len(self.rows):
            self._keep(keep)
        return out

    def _admit(self, req: Request) -> list[Emitted]:
        import torch

        ids = [*req.prompt_ids, *req.prefix]
        cache = self._cache_cls(config=self.model.config)
        logits = self.model(
            input_ids=torch.tensor([ids], device=self.device),
            position_ids=torch.arange(len(ids), device=self.device)[None],
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        ).logits[:, -1]
        tokens, logprobs = self._sample(logits, [req])
        row = _Row(req, generated=len(req.prefix) + 1, next_token=tokens[0], valid=len(ids))
        finish = self._finish(row, tokens[0])
        if finish is None:
            self._merge(cache, len(ids))
            self.rows.append(row)
        return [Emitted(req.key, [tokens[0]], [logprobs[0]], finish, self._tops(logits, [req])[0])]

    def _sample(self, logits: torch.Tensor, reqs: list[Request]) -> tuple[list[int], list[float]]:
        import torch

        temp = torch.tensor([r.temperature for r in reqs], device=self.device)
        top_p = torch.tensor([r.top_p for r in reqs], device=self.device)
        if all(r.seed is None for r in reqs):
            tokens, logprobs = sample(logits, temp, top_p, self.generator)
            return tokens.tolist(), logprobs.tolist()
        out_t, out_lp = [], []  # a seeded request draws from its own generator, row by row
        for i, r in enumerate(reqs):
            gen = self.generator if r.seed is None else self._generator_of(r)
            t, lp = sample(logits[i : i + 1], temp[i : i + 1], top_p[i : i + 1], gen)
            out_t.append(int(t[0]))
            out_lp.append(float(lp[0]))
        return out_t, out_lp

    def _tops(
        self, logits: torch.Tensor, reqs: list[Request]
    ) -> list[list[list[tuple[int, float]]] | None]:
        """Per row, the ``top_logprobs`` most likely tokens of its one new token (None for a
        request that asked for none)."""
        import torch

        k = max(r.top_logprobs for r in reqs)
        if k == 0:
            return [None] * len(reqs)
        temp = torch.tensor([r.temperature for r in reqs], device=self.device)
        ids, lps = top_logprobs(logits, temp, min(k, logits.shape[-1]))
        ids_l, lps_l = ids.tolist(), lps.tolist()
        return [
            [list(zip(ids_l[i][: r.top_logprobs], lps_l[i][: r.top_logprobs], strict=True))]
            if r.top_logprobs
            else None
            for i, r in enumerate(reqs)
        ]

    def _generator_of(self, req: Request) -> torch.Generator:
        import torch

        gen = self.seeded.get(req.key)
        if gen is None:
            assert req.seed is not None
            gen = self.seeded[req.key] = torch.Generator(self.device).manual_seed(req.seed)
        return gen

    def _finish(self, row: _Row, token: int) -> str | None:
        if token in self.eos_ids:
            return FINISH_STOP
        at_context_end = len(row.request.prompt_ids) + row.generated >= self.max_positions
        if row.generated >= row.request.max_new_tokens or at_context_end:
            return FINISH_LENGTH
        return None

    def _merge(self, cache: Any, length: int) -> None:
        import torch

        _check_layers(cache)
        if self.cache is None or self.mask is None:
            self.cache = cache
            self.mask = torch.ones(1, length, dtype=torch.long, device=self.device)
            return
        width = max(self.mask.shape[1], length)
        for mine, new in zip(self.cache.layers, cache.layers, strict=True):
            mine.keys = torch.cat([_left_pad(mine.keys, width), _left_pad(new.keys, width)], 0)
            mine.values = torch.cat(
                [_left_pad(mine.values, width), _left_pad(new.values, width)], 0
            )
        new_mask = torch.ones(1, length, dtype=self.mask.dtype, device=self.device)
        self.mask = torch.cat([_left_pad(self.mask, width), _left_pad(new_mask, width)], 0)

    def _keep(self, keep: list[int]) -> None:
        """Keep only rows ``keep`` and cut the columns that are padding in all of them."""
        import torch

        self.rows = [self.rows[i] for i in keep]
        if not keep:
            self.cache, self.mask = None, None
            return
        assert self.mask is not None
        idx = torch.tensor(keep, device=self.device)
        mask = self.mask[idx]
        start = int(mask.any(0).nonzero()[0])
        for layer in self.cache.layers:
            layer.keys = layer.keys[idx, :, start:]
            layer.values = layer.values[idx, :, start:]
        self.mask = mask[:, start:]


def _left_pad(x: torch.Tensor, width: int) -> torch.Tensor:
    """Zero-pad the sequence dimension (-2 for K/V [B, H, T, D], -1 for masks [B, T]) on the
    left."""
    import torch.nn.functional as F

    if x.dim() == 2:
        return F.pad(x, (width - x.shape[1], 0))
    return F.pad(x, (0, 0, width - x.shape[-2], 0))


def _check_layers(cache: Any) -> None:
    from transformers.cache_utils import DynamicLayer

    for layer in cache.layers:
        if type(layer) is not DynamicLayer:
            raise ConfigError(
                f"hf engine: the model uses {type(layer).__name__} cache layers (sliding-window or "
                "hybrid attention), which its continuous batching does not support; use the vllm "
                "engine"
            )


def _eos_ids(model: Any, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    eos = getattr(model.generation_config, "eos_token_id", None)
    for v in eos if isinstance(eos, list | tuple) else [eos]:
        if v is not None:
            ids.add(int(v))
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids
