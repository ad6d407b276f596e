"""The behaviour policy a served trajectory records (docs/serving.md, "Behaviour policy"):
the settings it was sampled with ride on its seq-0 chunk, its log-probs are of the
distribution actually sampled from, and the trainer's recomputed log-probs equal them on
policy for the settings it represents; every other setting is decided not trainable."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from consumers.assembler import Assembler, Trajectory
from consumers.intake import Intake, Invalid
from consumers.losses import token_logprobs
from consumers.outcomes import Ledger, Outcomes
from producers.chunker import Chunker, TrajectoryStart
from producers.engines.base import Request, generate
from producers.engines.hf import HFEngine
from schemas.records import TrajectoryChunk, pack_tokens
from srl.metrics import Metrics
from srl.topics import Layout
from tests.unit.test_trainer_intake import FakeProducer, Versions, records


def served(engine: HFEngine, temperature: float, top_p: float, tid: str) -> list[TrajectoryChunk]:
    """One served choice at these settings, chunked as ``srl serve`` publishes it."""
    ids = engine.tokenize("behaviour policy")
    chunker = Chunker(chunk_tokens=4, worker_id="serve")
    start = TrajectoryStart(tid, tid, tid, 0, 1, "le256", temperature=temperature, top_p=top_p)
    chunker.open(replace(start, prompt_tokens=pack_tokens(ids)))
    out: list[TrajectoryChunk] = []
    for e in generate(engine, [Request(tid, ids, 12, temperature, top_p)]):
        out += chunker.add(tid, e.tokens, e.logprobs, 0, e.finish_reason)
    return out


def trainer_intake(temperature: float) -> Intake:
    metrics = Metrics(None, Layout(), "run", "trainer-0")
    outcomes = Outcomes(Ledger(None), 30.0)
    return Intake(
        outcomes, (1000, "the model's"), 30.0, FakeProducer(), metrics, Versions(0), temperature
    )


def assembled(it: Intake, chunks: list[TrajectoryChunk]) -> Trajectory | Invalid | None:
    got = [it.add(r) for r in records(chunks)]
    return got[-1]


def recomputed(
    engine: HFEngine, traj: Trajectory, temperature: float, top_p: float = 1.0
) -> torch.Tensor:
    """The trainer's log-probs of ``traj``'s completion (``consumers.engine``: the same
    logits, ``token_logprobs`` at its temperature), optionally cut to the nucleus."""
    ids = torch.tensor([[*traj.prompt_tokens.tolist(), *traj.tokens.tolist()]])
    with torch.no_grad():
        logits = engine.model(input_ids=ids).logits[:, :-1].float()
    n = traj.n_tokens
    if top_p >= 1:
        return token_logprobs(logits, ids[:, 1:], temperature)[0, -n:]
    logp = torch.log_softmax(logits[0, -n:] / temperature, -1)
    sorted_p, order = logp.exp().sort(-1, descending=True)
    drop = (sorted_p.cumsum(-1) - sorted_p) >= top_p
    drop[:, 0] = False
    cut = torch.zeros_like(drop).scatter(-1, order, drop)
    logp = torch.log_softmax(logp.masked_fill(cut, -torch.inf), -1)
    return logp.gather(-1, ids[0, -n:, None]).squeeze(-1)


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_trainer_recomputes_the_recorded_logprobs_at_its_settings(
    tiny_model: Path, temperature: float
) -> None:
    engine = HFEngine(tiny_model, max_batch=2, seed=0)
    traj = assembled(trainer_intake(temperature), served(engine, temperature, 1.0, "a"))
    assert isinstance(traj, Trajectory)
    assert (traj.temperature, traj.top_p) == (temperature, 1.0)
    got = recomputed(engine, traj, temperature)
    assert got.tolist() == pytest.approx(traj.logprobs.tolist(), abs=1e-4)


@pytest.mark.parametrize(("temperature", "top_p"), [(0.7, 0.9), (1.0, 0.5), (0.0, 1.0)])
def test_other_settings_record_the_sampled_distribution_and_are_not_trainable(
    tiny_model: Path, temperature: float, top_p: float
) -> None:
    engine = HFEngine(tiny_model, max_batch=2, seed=0)
    chunks = served(engine, temperature, top_p, "b")
    assert (chunks[0].temperature, chunks[0].top_p) == (temperature, top_p)
    assembler = Assembler(Ledger(None), 30.0)
    traj = [assembler.add(c) for c in chunks][-1]
    assert isinstance(traj, Trajectory)
    if temperature == 0:  # greedy: a point mass
        assert traj.logprobs.tolist() == [0.0] * traj.n_tokens
    else:  # scaled, cut to the nucleus and renormalised
        got = recomputed(engine, traj, temperature, top_p)
        assert got.tolist() == pytest.approx(traj.logprobs.tolist(), abs=1e-4)
    decided = assembled(trainer_intake(1.0), served(engine, temperature, top_p, "c"))
    assert isinstance(decided, Invalid)
    assert f"temperature {temperature:g}, top_p {top_p:g}" in decided.reason
