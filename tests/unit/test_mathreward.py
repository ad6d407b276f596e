"""The math reward's extraction rules and equivalence on real-looking answers."""

from __future__ import annotations

import pytest

from consumers.mathreward import extract_answer, math_answer, reference
from consumers.rewards import load_reward

EXTRACT = [
    # MATH and chat models: the last box wins, braces balanced
    ("so $x = \\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}"),
    ("first \\boxed{3}, then corrected: \\boxed{4}", "4"),
    ("\\boxed{\\sqrt{2}+\\frac{1}{\\sqrt{3}}}", "\\sqrt{2}+\\frac{1}{\\sqrt{3}}"),
    ("\\fbox{7}", "7"),
    # GSM8K: what follows the last ####
    ("She pays 3 * 24 = 72.\n#### 72", "72"),
    ("#### 1,080\nExplanation follows", "1,080"),
    # else the last number
    ("so the total is 72 dollars.", "72"),
    ("The answer is 73. Wait, no: 72", "72"),
    ("it is -0.25 of the whole", "-0.25"),
    ("about 3/4 of them", "3/4"),
    ("she earned $1,234.50 in all", "1,234.50"),
    ("the ratio is \\frac{5}{8}", "\\frac{5}{8}"),
    ("I do not know.", None),
    ("\\boxed{unclosed", None),
]


@pytest.mark.parametrize(("text", "answer"), EXTRACT)
def test_the_final_answer_is_extracted_by_the_documented_rules(
    text: str, answer: str | None
) -> None:
    assert extract_answer(text) == answer


CASES = [
    # (reference answer, completion, reward)
    ("72", "She pays 3 * 24 = 72.\n#### 72", 1.0),
    ("Natalia sold 48/2 = 24 clips in May.\n#### 72", "#### 72", 1.0),  # a GSM8K answer field
    (72, "so the total is 72 dollars.", 1.0),  # a number, units in words
    ("\\frac{1}{2}", "The answer is \\boxed{0.5}", 1.0),
    ("0.75", "$\\boxed{\\frac34}$", 1.0),
    ("3/4", "\\boxed{\\dfrac{3}{4}}", 1.0),
    ("1000", "#### 1,000", 1.0),
    ("5", "\\boxed{\\$5}", 1.0),
    ("10", "\\boxed{10 \\text{ cm}}", 1.0),
    ("\\sqrt{2}", "\\boxed{\\sqrt 2}", 1.0),
    ("x^2+2x+1", "\\boxed{(x+1)^2}", 1.0),
    ("-3", "\\boxed{-3.0}", 1.0),
    ("2", "\\boxed{\\frac{4}{2}}", 1.0),
    ("The solution gives \\boxed{\\frac{\\pi}{4}}", "\\boxed{\\frac{\\pi}{4}}", 1.0),
    # wrong, or wrong but close
    ("72", "#### 73", 0.0),
    ("12", "\\boxed{12.5}", 0.0),
    ("\\frac{1}{3}", "\\boxed{0.333}", 0.0),
    ("\\pi", "\\boxed{3.14159}", 0.0),
    ("10", "10.0001 is my guess", 0.0),
    ("(x+1)^2", "\\boxed{x^2+1}", 0.0),
    ("4", "I do not know.", 0.0),
]


@pytest.mark.parametrize(("gold", "completion", "reward"), CASES)
def test_answers_are_compared_by_equivalence(gold: object, completion: str, reward: float) -> None:
    assert math_answer("", completion, {"answer": gold}) == reward


def test_a_task_without_an_answer_fails_its_sample_and_the_builtin_loads() -> None:
    with pytest.raises(KeyError):
        math_answer("", "\\boxed{1}", {})
    assert reference({"answer": " 72 "}) == "72"
    assert load_reward("consumers.rewards:math_answer") is math_answer
