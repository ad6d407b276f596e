"""srl's vLLM engine on the tiny model, one engine for the module (``conftest.vllm_engine``):
streaming, log-probs against the trainer's recompute, weight swaps (different weights change
the output; a swap leaves no stale prefix cache; tensors that do not fit are refused), abort
and resume, n samples of a prompt, over-long prompts refused.

Each test loads the weights it compares against first (the engine is shared, versions only
move forward). Log-probs are compared with ``consumers.losses.token_logprobs`` on the Hugging
Face model with the same weights, in fp32: within ``TOL``.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch

from consumers.losses import token_logprobs
from producers.engines.base import Emitted, Request, RequestError, complete
from srl.errors import WeightsError
from srl.tinymodel import load_model

TOL = 1e-3  # max |vLLM - trainer| per token, fp32 (measured: ~1e-6 before a swap, ~1e-4 after)
_ids = itertools.count()


# -- helpers ------------------------------------------------------------------------------------
def published(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict as the trainer publishes it: the tied head left out."""
    return {k: v.detach().clone() for k, v in state.items() if k != "lm_head.weight"}


def base_weights(vllm_model: Path) -> dict[str, torch.Tensor]:
    return published(load_model(vllm_model).state_dict())


def perturbed(vllm_model: Path, seed: int, scale: float = 0.3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        k: v + scale * torch.randn(v.shape, generator=g)
        for k, v in base_weights(vllm_model).items()
    }


def hf_model(vllm_model: Path, weights: dict[str, torch.Tensor]) -> Any:
    model = load_model(vllm_model).eval()
    model.load_state_dict(weights, strict=False)  # the tied head follows embed_tokens
    return model


def recomputed(model: Any, prompt: list[int], tokens: list[int], temperature: float) -> list[float]:
    """The trainer's log-probs of ``tokens`` after ``prompt`` (``consumers.engine``'s
    quantity: ``log softmax(logits / T)`` of each completion token)."""
    ids = torch.tensor([[*prompt, *tokens]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, :-1].float()
    return token_logprobs(logits, ids[:, 1:], temperature)[0, -len(tokens) :].tolist()


def swap(engine: Any, weights: dict[str, torch.Tensor]) -> int:
    version = engine.version + 1
    engine.load_weights(weights, version)
    assert engine.version == version
    return version


def greedy(engine: Any, prompts: list[list[int]], n: int = 16) -> list[list[int]]:
    reqs = [Request(f"g{next(_ids)}", p, n, temperature=0.0) for i, p in enumerate(prompts)]
    out = complete(engine, reqs)
    return [out[r.key].tokens for r in reqs]


def diffs(
    engine: Any, model: Any, prompts: list[list[int]], temperature: float, n: int = 24
) -> list[float]:
    """|vLLM − trainer| of every sampled token of one request per prompt."""
    reqs = [
        Request(f"lp{next(_ids)}", p, n, temperature=temperature) for i, p in enumerate(prompts)
    ]
    out = complete(engine, reqs)
    got: list[float] = []
    for r in reqs:
        c = out[r.key]
        assert c.tokens and len(c.tokens) == len(c.logprobs)
        ref = recomputed(model, list(r.prompt_ids), c.tokens, temperature)
        got += [abs(a - b) for a, b in zip(c.logprobs, ref, strict=True)]
    return got


def report(what: str, d: list[float]) -> None:
    print(f"\n{what}: {len(d)} tokens, mean |diff| {sum(d) / len(d):.2e}, max {max(d):.2e}")


def prompts_of(engine: Any, n: int) -> list[list[int]]:
    return [engine.tokenize(f"reverse: {'abcdefg'[: 2 + i]}=") for i in range(n)]


# -- tests --------------------------------------------------------------------------------------
def test_tokens_stream_step_by_step_while_the_batch_decodes(vllm_engine: Any) -> None:
    engine = vllm_engine
    reqs = [Request(f"s{i}", p, 12, temperature=1.0) for i, p in enumerate(prompts_of(engine, 4))]
    for r in reqs:
        engine.add(r)
    steps: list[list[Emitted]] = []
    while engine.has_work:
        steps.append(engine.step())
    per_key: dict[str, list[Emitted]] = {r.key: [] for r in reqs}
    for outs in steps:
        for e in outs:
            per_key[e.key].append(e)
    for key, es in per_key.items():
        tokens = [t for e in es for t in e.tokens]
        assert 0 < len(tokens) <= 12, key
        assert all(len(e.tokens) == 1 for e in es), "one token per step: streamed, not at the end"
        assert [e.finish_reason is not None for e in es] == [False] * (len(es) - 1) + [True]
        assert all(lp <= 0 for e in es for lp in e.logprobs)
        assert {e.version for e in es} == {engine.version}
    assert max(len(outs) for outs in steps) > 1, "the requests decoded as one batch"


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_the_trainers_recompute(
    vllm_engine: Any, vllm_model: Path, temperature: float
) -> None:
    weights = base_weights(vllm_model)
    swap(vllm_engine, weights)
    d = diffs(vllm_engine, hf_model(vllm_model, weights), prompts_of(vllm_engine, 8), temperature)
    report(f"log-probs at T={temperature}, the model's own weights", d)
    assert max(d) < TOL


def test_different_weights_change_greedy_output_and_match_the_trainer(
    vllm_engine: Any, vllm_model: Path
) -> None:
    engine, prompts = vllm_engine, prompts_of(vllm_engine, 3)
    base = base_weights(vllm_model)
    swap(engine, base)
    before = greedy(engine, prompts)
    other = perturbed(vllm_model, seed=1)
    swap(engine, other)
    after = greedy(engine, prompts)
    assert after != before, "loading different weights left the output unchanged"
    d = diffs(engine, hf_model(vllm_model, other), prompts, 1.0)
    report("log-probs at T=1 after a swap to different weights", d)
    assert max(d) < TOL  # every layer took them, the tied lm_head too
    swap(engine, base)
    assert greedy(engine, prompts) == before, "the reload is exact: the old weights come back"


def test_a_prompt_prefilled_before_a_swap_gets_the_new_weights_after_it(
    vllm_engine: Any, vllm_model: Path
) -> None:
    """The prefix cache: blocks prefilled by the old weights are not reused after a swap, even
    while another request holds blocks (vLLM refuses to reset the cache then)."""
    engine = vllm_engine
    swap(engine, base_weights(vllm_model))
    old = engine.version
    prompt = engine.tokenize("a system prompt every sample shares, " * 4 + "then: abc=")
    assert len(prompt) > 128  # a full KV block (128 tokens on CPU), cached by the first request
    complete(engine, [Request("first", prompt, 4, temperature=0.0)])
    engine.add(Request("long", engine.tokenize("keeps running: "), 200, temperature=0.0))
    before = engine.step()
    assert "long" in engine.running_keys(), "a request holds KV blocks across the swap"
    assert {e.version for e in before} == {old}
    new_weights = perturbed(vllm_model, seed=2)
    new = swap(engine, new_weights)
    engine.add(Request("again", prompt, 16, temperature=1.0))
    got: dict[str, list[Emitted]] = {"again": [], "long": []}
    while any(k == "again" for k in [*engine.running_keys(), *(r.key for r in engine.waiting)]):
        for e in engine.step():
            got[e.key].append(e)
    assert engine.abort("long")
    tokens = [t for e in got["again"] for t in e.tokens]
    logprobs = [lp for e in got["again"] for lp in e.logprobs]
    assert {e.version for e in got["again"] + got["long"]} == {new}
    ref = recomputed(hf_model(vllm_model, new_weights), prompt, tokens, 1.0)
    d = [abs(a - b) for a, b in zip(logprobs, ref, strict=True)]
    report("log-probs of a cached prompt after a swap", d)
    assert max(d) < TOL, "the prompt's KV came from the old weights' prefix cache"


def test_tensors_that_do_not_fit_are_refused_and_the_old_weights_stay(
    vllm_engine: Any, vllm_model: Path
) -> None:
    engine, prompts = vllm_engine, prompts_of(vllm_engine, 2)
    base = base_weights(vllm_model)
    swap(engine, base)
    before, version = greedy(engine, prompts), engine.version
    name = "model.layers.0.mlp.down_proj.weight"
    bad_shape = {**base, name: torch.zeros(3, 3)}
    unknown = {**base, "model.layers.9.extra.weight": torch.zeros(2)}
    missing = {k: v for k, v in base.items() if k != name}
    for bad, why in ((bad_shape, "shape"), (unknown, "unknown"), (missing, "missing")):
        with pytest.raises(WeightsError, match=why):
            engine.load_weights(bad, version + 1)
    assert engine.version == version
    assert greedy(engine, prompts) == before


def test_abort_and_resume_from_a_prefix(vllm_engine: Any, vllm_model: Path) -> None:
    engine = vllm_engine
    swap(engine, base_weights(vllm_model))
    prompt = engine.tokenize("resume me: xyz=")
    whole = complete(engine, [Request("whole", prompt, 16, temperature=0.0)])["whole"]
    assert len(whole.tokens) >= 8
    engine.add(Request("cut", prompt, 16, temperature=0.0))
    seen = [t for _ in range(4) for e in engine.step() for t in e.tokens]
    assert seen == whole.tokens[: len(seen)] and engine.abort("cut")
    assert not engine.has_work and not engine.abort("cut")
    prefix = whole.tokens[:5]
    rest = complete(engine, [Request("resumed", prompt, 16, temperature=0.0, prefix=prefix)])
    assert rest["resumed"].tokens == whole.tokens[5:]  # max_new_tokens counts the prefix
    assert rest["resumed"].logprobs == pytest.approx(whole.logprobs[5:], abs=TOL)


def test_n_samples_of_one_prompt(vllm_engine: Any) -> None:
    engine = vllm_engine
    prompt = engine.tokenize("one prompt, a group of samples: ")
    reqs = [Request(f"n{i}", prompt, 16, temperature=1.0) for i in range(8)]
    seeded = [
        Request(f"seed{i}", prompt, 16, temperature=1.0, seed=s) for i, s in enumerate((7, 7, 8))
    ]
    out = complete(engine, [*reqs, *seeded])
    samples = [tuple(out[r.key].tokens) for r in reqs]
    assert all(samples) and len(set(samples)) > 1, "8 samples of a random model all alike"
    assert all(len(out[r.key].logprobs) == len(out[r.key].tokens) for r in reqs)
    assert out["seed0"].tokens == out["seed1"].tokens != out["seed2"].tokens


def test_an_over_long_prompt_is_refused_and_the_engine_goes_on(vllm_engine: Any) -> None:
    engine = vllm_engine
    assert engine.max_model_len == 256
    with pytest.raises(RequestError, match="does not fit the engine's max_model_len 256"):
        engine.add(Request("long", [65] * 250, 16))
    with pytest.raises(RequestError, match="vocabulary"):
        engine.add(Request("oov", [65, 10**6], 4))
    assert not engine.has_work
    fits = complete(engine, [Request("fits", [65] * 240, 16, temperature=0.0)])["fits"]
    assert 0 < len(fits.tokens) <= 16 and fits.finish_reason in ("stop", "length")
