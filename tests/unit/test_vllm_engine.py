"""The vLLM engine on the tiny model: runs only where vLLM and a CUDA device exist."""

from __future__ import annotations

from pathlib import Path

import pytest

vllm = pytest.importorskip(
    "vllm", reason="vLLM is not installed (optional extra: pip install '.[vllm]')"
)
torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("vLLM needs a CUDA device; none here", allow_module_level=True)

from producers.engines.base import Request, complete  # noqa: E402
from producers.engines.vllm import VLLMEngine  # noqa: E402


def test_vllm_streams_tokens_with_logprobs_and_reloads_weights(tiny_model: Path) -> None:
    engine = VLLMEngine(str(tiny_model), 4, "float32", 0)
    reqs = [Request(f"r{i}", engine.tokenize(f"up abc{i}="), 16, temperature=1.0) for i in range(4)]
    out = complete(engine, reqs)
    assert set(out) == {r.key for r in reqs}
    for c in out.values():
        assert len(c.tokens) == len(c.logprobs) > 0 and all(lp <= 0 for lp in c.logprobs)
    state = {k: v.clone() for k, v in engine_state(tiny_model).items()}
    engine.load_weights(state, 1)
    assert engine.version == 1
    again = complete(engine, [Request("after", engine.tokenize("up xyz="), 8, temperature=0.0)])
    assert again["after"].tokens


def engine_state(model_dir: Path) -> dict[str, torch.Tensor]:
    from srl.tinymodel import load_model

    return load_model(model_dir).state_dict()
