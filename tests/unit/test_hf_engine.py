"""The hf engine against a plain, cache-free forward pass of the same model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from producers.engines.base import Request, RequestError, complete
from producers.engines.hf import HFEngine
from srl.errors import WeightsError
from srl.tinymodel import load_model

PROMPTS = [
    "hello",
    "a much longer prompt than the others",
    "x",
    "medium prompt",
    "yet another one",
    "zz",
]


def reference_greedy(
    model_dir: Path, ids: list[int], n: int, eos: set[int]
) -> tuple[list[int], list[float]]:
    """Greedy decoding by recomputing the whole sequence each step: no cache, no batching."""
    model = load_model(model_dir).eval()
    out: list[int] = []
    lps: list[float] = []
    with torch.no_grad():
        for _ in range(n):
            logp = torch.log_softmax(
                model(input_ids=torch.tensor([ids + out])).logits[0, -1].float(), -1
            )
            tok = int(logp.argmax())
            out.append(tok)
            lps.append(float(logp[tok]))
            if tok in eos:
                break
    return out, lps


def test_continuous_batching_matches_unbatched_greedy_decoding(tiny_model: Path) -> None:
    # 6 requests through 2 slots of different lengths: sequences join as others finish
    engine = HFEngine(tiny_model, max_batch=2, seed=0)
    reqs = [
        Request(f"r{i}", engine.tokenize(p), 12 + 7 * i, temperature=0)
        for i, p in enumerate(PROMPTS)
    ]
    seen_running = []
    outputs: dict[str, list[int]] = {}
    for r in reqs:
        engine.add(r)
    while engine.has_work:
        for e in engine.step():
            outputs.setdefault(e.key, []).extend(e.tokens)
        seen_running.append(engine.running)
    assert max(seen_running) == 2
    done = complete(
        HFEngine(tiny_model, max_batch=2, seed=0),
        [Request(r.key, r.prompt_ids, r.max_new_tokens, temperature=0) for r in reqs],
    )
    for r in reqs:
        want, want_lp = reference_greedy(
            tiny_model, list(r.prompt_ids), r.max_new_tokens, engine.eos_ids
        )
        assert outputs[r.key] == want == done[r.key].tokens
        # greedy samples from a point mass: its recorded log-prob is 0 (the behaviour policy,
        # docs/serving.md); the argmax's log-softmax would be want_lp
        assert done[r.key].logprobs == [0.0] * len(want_lp)
        assert done[r.key].finish_reason == ("stop" if want[-1] in engine.eos_ids else "length")


def test_resume_from_a_prefix_continues_the_same_sequence(tiny_model: Path) -> None:
    engine = HFEngine(tiny_model, max_batch=4, seed=0)
    ids = engine.tokenize("resume me")
    full = complete(engine, [Request("a", ids, 40, temperature=0)])["a"]
    k = len(full.tokens) // 2
    resumed = complete(engine, [Request("b", ids, 40, temperature=0, prefix=full.tokens[:k])])["b"]
    assert full.tokens[:k] + resumed.tokens == full.tokens
    assert resumed.logprobs == pytest.approx(full.logprobs[k:], abs=1e-4)


def test_sampling_is_reproducible_and_logprobs_are_of_the_scaled_distribution(
    tiny_model: Path,
) -> None:
    def run(seed: int) -> dict:
        e = HFEngine(tiny_model, max_batch=3, seed=seed)
        return complete(
            e,
            [
                Request(f"s{i}", e.tokenize(p), 30, temperature=0.7)
                for i, p in enumerate(PROMPTS[:3])
            ],
        )

    a, b, c = run(1), run(1), run(2)
    assert {k: v.tokens for k, v in a.items()} == {k: v.tokens for k, v in b.items()}
    assert {k: v.tokens for k, v in a.items()} != {k: v.tokens for k, v in c.items()}
    model = load_model(tiny_model).eval()
    e = HFEngine(tiny_model)
    toks = a["s0"].tokens
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([e.tokenize(PROMPTS[0]) + toks])).logits[0].float()
    n = len(e.tokenize(PROMPTS[0]))
    want = torch.log_softmax(logits[n - 1 : n - 1 + len(toks)] / 0.7, -1).gather(
        -1, torch.tensor(toks)[:, None]
    )
    assert a["s0"].logprobs == pytest.approx(want.squeeze(-1).tolist(), abs=1e-4)


def test_load_weights_swaps_in_place_and_refuses_what_does_not_fit(tiny_model: Path) -> None:
    engine = HFEngine(tiny_model, max_batch=2, seed=0)
    ids = engine.tokenize("weights")
    before = complete(engine, [Request("a", ids, 20, temperature=0)])["a"].tokens
    sd = {k: v.clone() for k, v in engine.model.state_dict().items()}
    bad = dict(sd)
    bad["model.norm.weight"] = torch.zeros(3)
    with pytest.raises(WeightsError, match="shape mismatch"):
        engine.load_weights(bad, 1)
    with pytest.raises(WeightsError, match="missing"):
        engine.load_weights({k: v for k, v in sd.items() if "layers.0." not in k}, 1)
    assert engine.version == 0
    assert complete(engine, [Request("b", ids, 20, temperature=0)])["b"].tokens == before
    torch.manual_seed(5)
    new = {k: v + 0.5 * torch.randn_like(v) for k, v in sd.items()}
    engine.load_weights(new, 1)
    assert engine.version == 1
    assert complete(engine, [Request("c", ids, 20, temperature=0)])["c"].tokens != before


def test_requests_that_cannot_run_are_refused(tiny_model: Path) -> None:
    engine = HFEngine(tiny_model, max_batch=2)
    with pytest.raises(RequestError, match="empty prompt"):
        engine.add(Request("e", [], 5))
    with pytest.raises(RequestError, match="positions"):
        engine.add(Request("l", [5] * engine.max_positions, 5))
    with pytest.raises(RequestError, match="leaves nothing"):
        engine.add(Request("p", [5], 3, prefix=[6, 7, 8]))
    # poison a task may carry: ids the embedding has no row for, a temperature that is no
    # number (each would raise inside a decode step, stopping the worker)
    for bad in ([5, engine.vocab_size], [-1, 5]):
        with pytest.raises(RequestError, match="vocabulary"):
            engine.add(Request("v", bad, 5))
    with pytest.raises(RequestError, match="temperature"):
        engine.add(Request("t", [5], 5, temperature=float("nan")))
    engine.add(Request("ok", [5, 6], 50, temperature=0))
    engine.step()
    assert engine.abort("ok") and engine.running == 0 and not engine.has_work
