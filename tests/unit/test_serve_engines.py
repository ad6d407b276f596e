"""What ``srl serve`` asks of the engines: a request's own ``seed`` in the sim engine, and
``top_logprobs`` (the most likely alternatives of each token, by the temperature-scaled
distribution its behaviour log-prob is taken from before any top-p cut) in the hf and sim
engines."""

from __future__ import annotations

from pathlib import Path

import pytest

from producers.engines.base import Emitted, Request, complete, generate
from producers.engines.hf import HFEngine
from producers.engines.sim import SimEngine


def test_the_sim_engine_honours_a_requests_seed_whatever_runs_beside_it() -> None:
    """The sim engine ignored ``Request.seed``: ``seed`` was refused by nothing and honoured
    by nothing in the benchmarks' engine."""
    together = complete(
        SimEngine(max_batch=4, time_scale=0, seed=1),
        [Request("a", [5], 12, seed=7), Request("b", [6], 12), Request("c", [5], 12, seed=8)],
    )
    alone = complete(SimEngine(max_batch=1, time_scale=0, seed=2), [Request("a2", [5], 12, seed=7)])
    assert alone["a2"].tokens == together["a"].tokens
    assert together["c"].tokens != together["a"].tokens


def test_sim_top_logprobs() -> None:
    outs = list(
        generate(SimEngine(max_batch=2, time_scale=0), [Request("a", [5], 3, top_logprobs=2)])
    )
    for e in outs:
        assert e.top is not None and len(e.top) == len(e.tokens)
        assert all(
            len(alts) == 2 and alts[0][0] == t for t, alts in zip(e.tokens, e.top, strict=True)
        )
    plain = list(generate(SimEngine(max_batch=2, time_scale=0), [Request("b", [5], 3)]))
    assert all(e.top is None for e in plain)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_hf_top_logprobs_come_from_the_sampled_distribution(
    tiny_model: Path, temperature: float
) -> None:
    engine = HFEngine(tiny_model, max_batch=2, seed=0)
    ids = engine.tokenize("top logprobs")
    reqs = [
        Request("a", ids, 6, temperature=temperature, top_logprobs=3),
        Request("b", ids, 6, temperature=temperature),
    ]
    outs: list[Emitted] = list(generate(engine, reqs))
    for e in (e for e in outs if e.key == "a"):
        (alts,) = e.top or [[]]
        assert len(alts) == 3 and [lp for _t, lp in alts] == sorted(
            (lp for _t, lp in alts), reverse=True
        )
        tops = dict(alts)
        if temperature == 0:  # greedy: the sampled token is the most likely one
            assert alts[0][0] == e.tokens[0]
        if temperature == 0:  # the behaviour log-prob is the point mass's
            assert e.logprobs[0] == 0.0
        elif e.tokens[0] in tops:  # the same distribution as the behaviour log-prob
            assert tops[e.tokens[0]] == pytest.approx(e.logprobs[0], abs=1e-5)
    assert all(e.top is None for e in outs if e.key == "b")
