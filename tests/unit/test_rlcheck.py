"""app.rlcheck: its GRPO step moves the policy towards rewarded completions."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from app import rlcheck, task


def _even_first_mass(model: Any, tok: Any, texts: list[str]) -> float:
    """Mean probability that the first generated token has an even id."""
    import torch

    with torch.no_grad():
        probs = []
        for t in texts:
            ids = torch.tensor([tok(t, add_special_tokens=False)["input_ids"]])
            p = model(input_ids=ids).logits[0, -1].softmax(-1)
            probs.append(float(p[0::2].sum()))
    return sum(probs) / len(probs)


def test_grpo_step_raises_the_probability_of_rewarded_completions(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:

    from srl.tinymodel import load_tokenizer

    s = rlcheck.RlSettings(lr=1e-2, max_new_tokens=2)
    tok, engine = load_tokenizer(tiny_model), rlcheck.make_engine(tiny_model, 0, s)
    model = engine.model

    def first_token_even(prompt: str, completion: str, metadata: dict[str, Any]) -> float:
        ids = tok(completion, add_special_tokens=False)["input_ids"]
        return 1.0 if ids and ids[0] % 2 == 0 else 0.0

    monkeypatch.setattr(task, "demo_reward", first_token_even)
    prompts = task.demo_prompts(8, "train", seed=0)
    texts = [p.text for p in prompts]
    before = _even_first_mass(model, tok, texts)
    rewards = []
    for _ in range(8):
        model.train()
        rewards.append(rlcheck._step(engine, tok, prompts, s))
    after = _even_first_mass(model.eval(), tok, texts)
    assert all(0.0 <= r <= 1.0 for r in rewards)
    assert after > before + 0.1, (before, after)
