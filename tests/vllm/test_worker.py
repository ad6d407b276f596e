"""A generator worker on srl's vLLM engine against the embedded broker (one engine for the
module): token chunks stream, a task whose prompt cannot fit the engine's context is
dead-lettered with the reason while the worker goes on, and a weights version published to
the store is followed, verified and swapped in without a file: the next task's chunks carry
the new version and its log-probs.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from producers.config import GenerateConfig
from producers.worker import GenSummary, run_generator
from schemas.records import PromptTask, encode, unpack_tokens
from srl.kafka import Producer, create_topics
from srl.topics import Layout
from tests.integration.test_generation import TopicReader, Trajectories, publish_weights
from tests.vllm.test_engine import TOL, hf_model, perturbed, recomputed

pytestmark = pytest.mark.embedded


def task(task_id: str, prompt: str, group_size: int, max_new_tokens: int) -> PromptTask:
    return PromptTask(
        task_id=task_id,
        prompt_id=task_id,
        prompt=prompt,
        group_size=group_size,
        max_new_tokens=max_new_tokens,
        bucket="le256",
    )


def test_a_vllm_worker_dead_letters_what_cannot_fit_streams_the_rest_and_follows_weights(
    make_cfg: Any, vllm_model: Path, vllm_engine: Any
) -> None:
    cfg = make_cfg(
        GenerateConfig,
        engine="vllm",
        model=str(vllm_model),
        max_batch=4,
        chunk_tokens=4,
        max_staleness=0,  # a task after an announcement starts only on that version
        stats_interval_s=0.5,
        drain_timeout_s=10.0,
    )
    layout = Layout.from_config(cfg)
    create_topics(cfg)
    topic = layout.prompts("le256")
    with Producer(cfg, "test") as p:
        for t in (task("long", "y" * 300, 1, 16), task("first", "fine: abc=", 2, 24)):
            p.produce(topic, encode(t), key=t.prompt_id.encode(), partition=0)
    summaries: list[GenSummary] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def run() -> None:
        try:
            summaries.append(run_generator(cfg, stop, vllm_engine))
        except BaseException as e:  # the test asserts none
            errors.append(e)

    worker = threading.Thread(target=run)
    worker.start()
    t = Trajectories(cfg)
    try:
        t.wait(lambda t: len(t.complete()) == 2, timeout_s=120)
        weights = perturbed(vllm_model, seed=3)
        publish_weights(cfg, 1, weights)
        with Producer(cfg, "test") as p:
            second = task("second", "fine: abc=", 2, 24)
            p.produce(topic, encode(second), key=b"second", partition=0)
        t.wait(lambda t: len(t.complete()) == 4, timeout_s=120)
    finally:
        stop.set()
        worker.join(timeout=60)
    assert not errors, errors
    (s,) = summaries
    assert (s.dead_letters, s.tasks, s.weights_loaded, s.policy_version) == (1, 2, 1, 1)

    dlq = TopicReader(cfg, layout.dlq)
    for _ in range(5):
        dlq.poll()
    reasons = [dict(m.headers())["srl.reason"].decode() for _, _, m in dlq.records]
    dlq.close()
    assert len(reasons) == 1 and "does not fit the engine's max_model_len 256" in reasons[0]

    by_prompt: dict[str, list[list[Any]]] = {"first": [], "second": []}
    for chunks in t.complete().values():
        by_prompt[chunks[0].prompt_id].append(chunks)
    model = hf_model(vllm_model, weights)
    for prompt_id, version in (("first", 0), ("second", 1)):
        assert len(by_prompt[prompt_id]) == 2
        for chunks in by_prompt[prompt_id]:
            assert {c.policy_version for c in chunks} == {version}
            tokens = [int(x) for c in chunks for x in c.token_ids()]
            assert len(chunks) == -(-len(tokens) // 4), "a chunk every 4 tokens, then the rest"
            if version == 1:  # the store's verified tensors are what vLLM runs
                prompt = unpack_tokens(chunks[0].prompt_tokens or b"").tolist()
                logprobs = [float(x) for c in chunks for x in c.logprob_values()]
                ref = recomputed(model, prompt, tokens, 1.0)
                assert max(abs(a - b) for a, b in zip(logprobs, ref, strict=True)) < TOL
