"""The demo task: answers, split, reward, demonstrator and long-tailed lengths."""

from __future__ import annotations

import statistics

import pytest

from app import task


def test_answers_and_reference_lengths() -> None:
    assert task.reference_answer("desc 93817=") == "98731"
    assert task.reference_answer("asc 93817=") == "13789"
    assert task.reference_answer("dup kqz=") == "kkqqzz"
    assert task.reference_answer("up kqz=") == "KQZ"
    assert task.reference_length("dup kqz=") == 6 and task.reference_length("up kqz=") == 3


@pytest.mark.parametrize("bad", ["sort 123=", "desc 12a=", "up ABC=", "desc 123", "up ="])
def test_malformed_prompts_are_refused(bad: str) -> None:
    with pytest.raises(task.TaskError):
        task.parse(bad)


def test_reward_is_exact_match_and_needs_only_the_prompt() -> None:
    assert task.demo_reward("up kqz=", " KQZ\n", {}) == 1.0
    assert task.demo_reward("up kqz=", "KQZ!", {}) == 0.0
    assert task.demo_reward("up kqz=", "kqz", {"answer": "KQZ"}) == 0.0


def test_reward_is_the_trainer_default_and_takes_any_answer_metadata() -> None:
    from consumers.config import TrainConfig
    from consumers.rewards import load_reward

    assert load_reward(TrainConfig().reward) is task.demo_reward
    # a task whose metadata carries the answer (not a demo-task prompt) scores like exact_match
    assert task.demo_reward("3+4=", " 7\n", {"answer": 7}) == 1.0
    assert task.demo_reward("3+4=", "8", {"answer": "7"}) == 0.0
    with pytest.raises(task.TaskError):
        task.demo_reward("3+4=", "7", {})


def test_prompts_are_deterministic_distinct_and_the_split_is_disjoint() -> None:
    train = task.demo_prompts(500, "train", seed=3)
    assert train == task.demo_prompts(500, "train", seed=3)
    assert train != task.demo_prompts(500, "train", seed=4)
    assert len({p.text for p in train}) == 500
    evals = {p.text for s in range(3) for p in task.demo_prompts(300, "eval", seed=s)}
    trains = {p.text for s in range(3) for p in task.demo_prompts(300, "train", seed=s)}
    assert not evals & trains
    assert all(task.split_of(t) == "eval" for t in evals)
    for p in train[:50]:
        assert p.metadata["answer"] == task.reference_answer(p.text)


def test_answer_lengths_are_long_tailed_and_predictable_from_the_prompt() -> None:
    lengths = [task.reference_length(p.text) for p in task.demo_prompts(3000, "train", seed=0)]
    median, p99 = statistics.median(lengths), sorted(lengths)[int(0.99 * len(lengths))]
    assert p99 >= 3 * median, (median, p99)
    assert max(lengths) <= task.MAX_ANSWER_LEN


def test_the_demonstrator_errs_on_every_op_at_the_stated_rate() -> None:
    pairs = [next(it) for it in [task.sft_pairs(0)] for _ in range(4000)]
    wrong = sum(a != task.reference_answer(p) for p, a in pairs) / len(pairs)
    # a mistake can coincide with the answer (e.g. sorting an already sorted operand)
    assert task.TEACHER_ERROR - 0.1 < wrong <= task.TEACHER_ERROR + 0.03
    assert all(task.split_of(p) == "train" for p, _ in pairs)
