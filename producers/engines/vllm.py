"""vLLM engine (optional extra, GPUs): streaming generation with in-place weight reload.

Owns the adapter from vLLM's ``LLMEngine`` (``add_request`` / ``step`` / ``abort_request``)
to the srl engine contract (``producers.engines.base``):

* requests go in as token ids (``TokensPrompt``: prompt + resume prefix) with
  ``output_kind=DELTA``, so each ``step`` returns only the tokens generated since the last one;
  vLLM schedules and batches them itself (continuous batching, paged KV cache), with at most
  ``max_batch`` sequences (``max_num_seqs``);
* log-probs: ``logprobs=0`` returns the sampled token's log-prob, and the engine is created
  with ``logprobs_mode="processed_logprobs"`` so it is taken after temperature scaling, the
  quantity the hf engine reports (after top-p filtering too, renormalised; for a greedy
  request vLLM reports the unscaled log-prob where the hf engine reports 0, and the trainer
  trains neither); a request's ``top_logprobs = k`` asks vLLM for ``logprobs=k``, which adds the
  ``k`` most likely tokens (by rank) to the sampled one;
* weights: ``load_weights`` writes the verified tensors to a local safetensors file and asks
  every vLLM worker to load it in place (``collective_rpc`` into :class:`SrlWorkerExtension`,
  which calls the model's own ``load_weights``); requests in flight keep running.

vLLM is imported only when this engine is built; without it the worker fails with one line.
Its tests run where vLLM is importable (a GPU machine) and are skipped elsewhere.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from producers.engines.base import (
    FINISH_ABORT,
    FINISH_LENGTH,
    FINISH_STOP,
    Emitted,
    Engine,
    Request,
)
from srl.errors import ConfigError, WeightsError

if TYPE_CHECKING:
    import torch

_FINISH = {"stop": FINISH_STOP, "length": FINISH_LENGTH, "abort": FINISH_ABORT}


class SrlWorkerExtension:
    """Mixed into vLLM's worker class (``worker_extension_cls``); runs inside each worker."""

    model_runner: Any

    def srl_load_weights(self, path: str) -> int:
        from safetensors.torch import load_file

        tensors = load_file(path)
        self.model_runner.model.load_weights(weights=list(tensors.items()))
        return len(tensors)


class VLLMEngine(Engine):
    name = "vllm"

    def __init__(
        self,
        model_dir: str | Path,
        max_batch: int = 64,
        dtype: str = "auto",
        seed: int | None = None,
        gpu_memory_utilization: float = 0.85,
    ) -> None:
        try:
            from vllm import EngineArgs, LLMEngine
        except ImportError:
            raise ConfigError(
                "engine vllm: vLLM is not installed here; pip install -e '.[vllm]' on a GPU "
                "machine, "
                "or use --engine hf"
            ) from None
        super().__init__(max_batch)
        args = EngineArgs(
            model=str(model_dir),
            dtype=dtype,
            seed=seed or 0,
            max_num_seqs=max_batch,
            gpu_memory_utilization=gpu_memory_utilization,
            logprobs_mode="processed_logprobs",
            worker_extension_cls=f"{__name__}.SrlWorkerExtension",
            enable_prefix_caching=True,
        )
        self.llm = LLMEngine.from_engine_args(args)
        self.tokenizer = self.llm.get_tokenizer()
        self._running: set[str] = set()
        self._top_k: dict[str, int] = {}  # top_logprobs of the running requests that ask
        self._tmp = tempfile.TemporaryDirectory(prefix="srl-vllm-weights-")

    @property
    def running(self) -> int:
        return len(self._running)

    def tokenize(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def step(self) -> list[Emitted]:
        while self.waiting and len(self._running) < self.max_batch:
            self._submit(self._next_waiting())
        if not self._running:
            return []
        out: list[Emitted] = []
        for ro in self.llm.step():
            if ro.request_id not in self._running:
                continue
            comp = ro.outputs[0]
            tokens = list(comp.token_ids)
            steps = comp.logprobs or []
            logprobs = [float(lp[t].logprob) for t, lp in zip(tokens, steps, strict=True)]
            finish = _FINISH.get(comp.finish_reason or "", FINISH_STOP) if ro.finished else None
            k = self._top_k.get(ro.request_id, 0)
            top = [_ranked(lp, k) for lp in steps] if k else None
            if tokens or finish:
                out.append(Emitted(ro.request_id, tokens, logprobs, finish, top))
            if ro.finished:
                self._running.discard(ro.request_id)
                self._top_k.pop(ro.request_id, None)
        return out

    def _submit(self, req: Request) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(
            n=1,
            temperature=req.temperature,
            top_p=req.top_p,
            logprobs=req.top_logprobs,
            seed=req.seed,
            max_tokens=req.max_new_tokens - len(req.prefix),
            output_kind=RequestOutputKind.DELTA,
        )
        prompt = TokensPrompt(prompt_token_ids=[*req.prompt_ids, *req.prefix])
        self.llm.add_request(req.key, prompt, params)
        self._running.add(req.key)
        if req.top_logprobs:
            self._top_k[req.key] = req.top_logprobs

    def running_keys(self) -> list[str]:
        return list(self._running)

    def _abort_running(self, key: str) -> bool:
        if key not in self._running:
            return False
        self.llm.abort_request([key])
        self._running.discard(key)
        self._top_k.pop(key, None)
        return True

    def load_weights(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        from safetensors.torch import save_file

        path = Path(self._tmp.name) / f"v{version:08d}.safetensors"
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
        try:
            self.llm.collective_rpc("srl_load_weights", args=(str(path),))
        except Exception as e:  # vLLM raises its own types from its workers
            raise WeightsError(
                f"v{version}: vLLM refused the weights: {' '.join(str(e).split())[:200]}"
            ) from None
        finally:
            path.unlink(missing_ok=True)
        self.version = version


def _ranked(logprobs: dict[int, Any], k: int) -> list[tuple[int, float]]:
    """The ``k`` most likely ``(token id, log-prob)`` of one position's vLLM logprobs (the
    sampled token plus the top ``k`` by rank)."""
    ranked = sorted(logprobs.items(), key=lambda item: item[1].rank or 0)
    return [(t, float(lp.logprob)) for t, lp in ranked[:k]]
