"""The evaluation core (``app.evaluation``): the pass@k estimator on known values, what a
report holds, and the demo's held-out evaluation computed through it exactly as before."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from app import task, warmstart
from app.evalrun import summary
from app.evaluation import Sampling, pass_at_k, run_eval
from producers.sources import PromptLike, SourcePrompt
from srl.errors import ConfigError


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (10, 0, 1, 0.0),
        (10, 10, 1, 1.0),
        (5, 1, 1, 0.2),  # pass@1 is c / n
        (10, 3, 1, 0.3),
        (4, 2, 2, 1 - 1 / 6),  # 1 - C(2,2)/C(4,2)
        (10, 3, 5, 1 - 21 / 252),  # 1 - C(7,5)/C(10,5)
        (2, 1, 2, 1.0),  # n - c < k: every draw of k holds a pass
        (200, 1, 100, 0.5),
        (1, 0, 1, 0.0),
    ],
)
def test_pass_at_k_known_values(n: int, c: int, k: int, expected: float) -> None:
    assert math.isclose(pass_at_k(n, c, k), expected, rel_tol=1e-12, abs_tol=1e-12)


def test_pass_at_k_matches_the_product_form_and_is_monotone_in_k() -> None:
    n, c = 20, 4
    for k in range(1, n + 1):
        prod = 1.0
        for i in range(n - c + 1, n + 1):  # Chen et al.'s numerically stable form
            prod *= 1.0 - k / i
        assert math.isclose(pass_at_k(n, c, k), 1 - prod, abs_tol=1e-12)
    values = [pass_at_k(n, c, k) for k in range(1, n + 1)]
    assert values == sorted(values)


@pytest.mark.parametrize(("n", "c", "k"), [(4, 5, 1), (4, 1, 0), (4, 1, 5), (3, -1, 1)])
def test_pass_at_k_refuses_impossible_counts(n: int, c: int, k: int) -> None:
    with pytest.raises(ValueError, match="pass@k"):
        pass_at_k(n, c, k)


def prompts() -> list[PromptLike]:
    return [SourcePrompt(f"p{i}", f"What is {i} + 1?", {"answer": str(i + 1)}) for i in range(4)]


def fake_complete(
    ps: list[PromptLike], temperature: float, n: int, max_new_tokens: int
) -> list[list[str | None]]:
    """Greedy: right for p0 and p1. Sampled: sample j of prompt i right when j < i; prompt 3's
    last sample refused (None)."""
    out: list[list[str | None]] = []
    for i, p in enumerate(ps):
        right = str(p.metadata["answer"])
        if temperature == 0:
            out.append([right if i < 2 else "no"])
        else:
            row: list[str | None] = [right if j < i else "no" for j in range(n)]
            if i == 3:
                row[-1] = None
            out.append(row)
    return out


def fake_score(items: list[tuple[PromptLike, str]]) -> list[float | None]:
    # "no" on prompt p2 is a failed reward (None); else exact match
    return [
        None if (c == "no" and p.prompt_id == "p2") else float(c == p.metadata["answer"])
        for p, c in items
    ]


def test_report_shape_and_counts() -> None:
    s = Sampling(samples=4, ks=(1, 2, 4), temperature=0.7)
    out = run_eval(prompts(), fake_complete, fake_score, s, group_of=lambda p: p.prompt_id[-1])
    fig = out.figures()
    assert fig["prompts"] == 4
    g = fig["greedy"]
    assert g["pass@1"] == 0.5 and g["passed"] == 2 and g["completions"] == 4
    assert g["reward_failures"] == 1 and g["refused"] == 0  # p2's greedy "no"
    assert g["by_group"] == {"0": 1.0, "1": 1.0, "2": 0.0, "3": 0.0}
    sm = fig["sampled"]
    # passes per prompt: 0, 1, 2, 3 of 4 (prompt 3's refused sample is its 4th, a fail)
    c = [0, 1, 2, 3]
    for k in (1, 2, 4):
        assert sm["pass@k"][str(k)] == round(sum(pass_at_k(4, ci, k) for ci in c) / 4, 4)
    assert sm["pass@k"]["1"] == 0.375
    assert sm["samples"] == 4 and sm["temperature"] == 0.7
    assert sm["passed"] == 6 and sm["completions"] == 16 and sm["prompts_with_a_pass"] == 3
    assert sm["refused"] == 1 and sm["reward_failures"] == 2  # p2's two "no" samples
    rows = out.per_prompt()
    assert [r["prompt_id"] for r in rows] == ["p0", "p1", "p2", "p3"]
    assert rows[0]["greedy"] == {"completion": "1", "reward": 1.0, "passed": True}
    assert rows[3]["sampled"]["rewards"][-1] is None and rows[3]["sampled"]["passed"] == 3
    assert rows[3]["sampled"]["completions"][-1] is None


def test_greedy_only_and_default_ks() -> None:
    out = run_eval(prompts(), fake_complete, fake_score, Sampling())
    assert set(out.figures()) == {"prompts", "greedy"}
    assert Sampling(samples=8).k_values() == [1, 8]
    assert Sampling(samples=8, ks=(4, 1, 4)).k_values() == [1, 4]
    with pytest.raises(ConfigError, match="each k must be in 1..2"):
        Sampling(samples=2, ks=(4,)).check()
    with pytest.raises(ConfigError, match="nothing to evaluate"):
        Sampling(greedy=False).check()


def test_pass_threshold() -> None:
    def score(items: list[tuple[PromptLike, str]]) -> list[float | None]:
        return [0.5 for _ in items]

    assert run_eval(prompts(), fake_complete, score, Sampling()).greedy_pass() == 0.0
    half = Sampling(pass_threshold=0.5)
    assert run_eval(prompts(), fake_complete, score, half).greedy_pass() == 1.0


def test_summary_line() -> None:
    rep = {
        "run": None,
        "model": "m",
        "version": 0,
        "prompts": 4,
        "dataset": "d.jsonl",
        "greedy": {"pass@1": 0.5, "passed": 2, "completions": 4},
        "sampled": {"pass@k": {"1": 0.375, "4": 0.75}, "samples": 4, "temperature": 1.0},
    }
    line = summary(rep)
    assert "greedy pass@1 0.5000 (2/4)" in line and "pass@4 0.7500 (4 samples at T=1)" in line


def old_evaluate(model_dir: Path, ps: list[task.Prompt]) -> warmstart.EvalResult:
    """The demo's held-out evaluation as it was before it went through app.evaluation."""
    import torch

    from srl.tinymodel import load_model, load_tokenizer

    model, tok = load_model(model_dir).eval(), load_tokenizer(model_dir)
    right: dict[str, list[bool]] = {}
    examples: list[tuple[str, str, bool]] = []
    with torch.no_grad():
        for i in range(0, len(ps), 128):
            chunk = ps[i : i + 128]
            outs = warmstart.greedy(model, tok, [p.text for p in chunk], task.MAX_ANSWER_LEN + 2)
            for p, text in zip(chunk, outs, strict=True):
                ok = task.is_correct(p.text, text, p.metadata)
                right.setdefault(str(p.metadata.get("op", "?")), []).append(ok)
                if len(examples) < 8:
                    examples.append((p.text, text, ok))
    flat = [x for xs in right.values() for x in xs]
    return warmstart.EvalResult(
        accuracy=round(sum(flat) / len(flat), 4),
        n=len(flat),
        by_op={op: round(sum(xs) / len(xs), 4) for op, xs in sorted(right.items())},
        examples=examples,
    )


def test_the_demos_evaluation_is_unchanged(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its figures through the shared core equal the old code's, prompt for prompt: on the
    tiny model's own completions, and on a "model" right on every third prompt."""
    ps = task.demo_prompts(24, "eval", seed=1)
    assert warmstart.evaluate(tiny_model, ps) == old_evaluate(tiny_model, ps)
    assert warmstart.evaluate(tiny_model, []) == warmstart.EvalResult(0.0, 0)

    def some_right(model: object, tok: object, texts: list[str], n: int) -> list[str]:
        return [task.reference_answer(t) if i % 3 == 0 else "x" for i, t in enumerate(texts)]

    monkeypatch.setattr(warmstart, "greedy", some_right)
    new, old = warmstart.evaluate(tiny_model, ps), old_evaluate(tiny_model, ps)
    assert new == old and new.accuracy == round(8 / 24, 4) and len(set(new.by_op.values())) > 1
