"""A request's own ``seed`` (``srl serve``'s ``seed``): the hf engine samples it from its own
generator, so it does not depend on what else runs or on the engine's seed."""

from __future__ import annotations

from pathlib import Path

from producers.engines.base import Request, complete
from producers.engines.hf import HFEngine


def test_a_seeded_request_samples_the_same_tokens_whatever_runs_beside_it(
    tiny_model: Path,
) -> None:
    engine = HFEngine(tiny_model, max_batch=4, seed=1)
    ids = engine.tokenize("seeded prompt")
    together = complete(
        engine,
        [
            Request("a", ids, 12, temperature=1.0, seed=7),
            Request("b", ids, 12, temperature=1.0, seed=7),
            Request("c", engine.tokenize("other"), 12, temperature=1.0),
            Request("d", ids, 12, temperature=1.0, seed=8),
        ],
    )
    assert together["a"].tokens == together["b"].tokens
    assert together["a"].logprobs == together["b"].logprobs
    alone = complete(HFEngine(tiny_model, max_batch=1, seed=2), [Request("a2", ids, 12, seed=7)])
    assert alone["a2"].tokens == together["a"].tokens
    assert together["d"].tokens != together["a"].tokens  # 12 tokens of a random model
    assert not engine.seeded  # finished requests' generators are forgotten
