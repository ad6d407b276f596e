"""``python -m app.rlcheck``: can the demo's warm start learn under GRPO? (in-process, no Kafka)

Owns the learnability evidence of docs/demo-task.md: it runs the demo's RL recipe in one
process on the trainer's own parts — sample groups from the current policy at temperature T,
score them with ``app.task.demo_reward``, then what ``consumers.trainer`` does with complete
groups: the staleness gate with GRPO advantages (``consumers.gate.gate_group``), a barrier
step's micro-batches (``consumers.batcher.StepBatcher``, ``consumers.train_engine
.make_micro_batch``) and the plain-torch backend's ``backward`` / ``step``
(``consumers.engine.Engine``: the configured per-token loss of ``consumers.losses``,
token-mean over the step, gradient clipping, AdamW) — and reports held-out greedy accuracy
before and after (``app.warmstart.evaluate`` on the demo's fixed eval prompts).

What must hold: it trains only on the train split; sampling is on-policy (the behaviour
log-probs are the policy's own at the start of each step, from a no-grad forward pass before
any gradient of the step, so the importance weight is 1 up to float rounding, as in the demo
with fresh samples).
It is not the demo: no staleness, no chunks, no dispatcher; it answers "do these
hyperparameters make this model learn", fast.

Called by hand (docs/demo-task.md has the command and its results).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from app import task
from app.report import EVAL_SEED
from app.warmstart import ensure_model, evaluate, left_padded
from consumers.assembler import Trajectory
from consumers.batcher import Row, StepBatcher
from consumers.config import TrainConfig
from consumers.engine import Engine
from consumers.gate import gate_group
from consumers.groups import Group, Sample
from consumers.losses import LossKind, token_logprobs
from consumers.train_engine import make_micro_batch
from srl.tinymodel import load_tokenizer


@dataclass
class RlSettings:
    steps: int = 60
    group_size: int = 8
    groups_per_step: int = 8
    lr: float = 1e-4
    temperature: float = 1.0
    max_new_tokens: int = 72
    loss: LossKind = "tis"
    max_grad_norm: float = 1.0
    eval_prompts: int = 256
    micro_batch_tokens: int = 4096  # the trainer's budget (tokens computed per micro-batch)


def make_engine(model_dir: Path, seed: int, s: RlSettings) -> Engine:
    """The trainer's plain-torch backend on ``model_dir`` with these settings (CPU, fp32, no
    reference model, one update per step); it seeds torch with ``seed``."""
    cfg = TrainConfig.model_validate(
        {
            "model": str(model_dir),
            "loss": s.loss,
            "temperature": s.temperature,
            "lr": s.lr,
            "max_grad_norm": s.max_grad_norm,
            "micro_batch_tokens": s.micro_batch_tokens,
            "seed": seed,
            "device": "cpu",
        }
    )
    return Engine(cfg)


def _sample(model: Any, tok: Any, texts: list[str], n: int, s: RlSettings) -> list[list[int]]:
    """``n`` sampled completions (token ids, EOS kept, padding cut) of each text, in order."""
    import torch

    ids, mask = left_padded(tok, texts)
    width = ids.shape[1]
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=s.max_new_tokens,
            do_sample=True,
            temperature=s.temperature,
            top_k=0,
            top_p=1.0,
            num_return_sequences=n,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
        )
    comps = []
    for row in out[:, width:].tolist():
        cut = row.index(tok.eos_token_id) + 1 if tok.eos_token_id in row else len(row)
        comps.append(row[:cut])
    return comps


def _behaviour_logprobs(
    engine: Engine, prompt: list[int], comps: list[list[int]], pad_id: int
) -> list[np.ndarray]:
    """Each completion's per-token log-probs under the current policy (no gradient): what a
    generator would send with its chunks, here exactly the trainer's own forward pass."""
    import torch

    rows = [Row("", np.array(prompt + c), len(prompt), np.zeros(len(c)), 0.0) for c in comps]
    mb = make_micro_batch(rows, seq_mean=False, pad_id=pad_id)
    ids, attn = mb.ids.to(engine.device), mb.attn.to(engine.device)
    with torch.no_grad():
        logits = engine.model(input_ids=ids, attention_mask=attn).logits[:, :-1]
        logp = token_logprobs(logits, ids[:, 1:], engine.cfg.temperature).float().cpu()
    start = len(prompt) - 1  # position j predicts token j + 1
    return [logp[i, start : start + len(c)].numpy() for i, c in enumerate(comps)]


def _group(
    p: task.Prompt,
    prompt: list[int],
    comps: list[list[int]],
    behav: list[np.ndarray],
    rewards: list[float],
) -> Group:
    """One complete, scored group of ``p``'s samples, as the trainer's group buffer hands it
    over (behaviour version 0: the policy that is about to be updated)."""
    group = Group(p.prompt_id, len(comps))
    for i, (c, lp, r) in enumerate(zip(comps, behav, rewards, strict=True)):
        traj = Trajectory(
            trajectory_id=f"{p.prompt_id}/{i}",
            prompt_id=p.prompt_id,
            task_id=p.prompt_id,
            sample_index=i,
            group_size=len(comps),
            bucket="rlcheck",
            prompt_tokens=np.array(prompt, dtype=np.int32),
            tokens=np.array(c, dtype=np.int32),
            logprobs=lp,
            versions=(0,),
            finish_reason=None,
            metadata=p.metadata,
            workers=(),
            started_ms=0,
            last_created_ms=0,
        )
        group.samples[i] = Sample(traj, r)
    return group


def _step(engine: Engine, tok: Any, prompts: list[task.Prompt], s: RlSettings) -> float:
    """One GRPO step over ``groups_per_step`` groups, as the trainer takes a barrier step;
    returns the mean reward."""
    comps = _sample(engine.model, tok, [p.text for p in prompts], s.group_size, s)
    batcher = StepBatcher(engine.cfg.micro_batch_tokens, pipeline=False, packed=engine.cfg.packing)
    rewards_all: list[float] = []
    for g, p in enumerate(prompts):  # every behaviour log-prob before the step's first gradient
        group = comps[g * s.group_size : (g + 1) * s.group_size]
        pids = tok(p.text, add_special_tokens=False)["input_ids"]
        behav = _behaviour_logprobs(engine, pids, group, tok.pad_token_id)
        r = [
            task.demo_reward(p.text, tok.decode(c, skip_special_tokens=True), p.metadata)
            for c in group
        ]
        rewards_all += r
        batcher.add(gate_group(_group(p, pids, group, behav, r), v=0, k=0, advantage="grpo"))
    for rows in batcher.drain():
        engine.backward(make_micro_batch(rows, seq_mean=False, pad_id=tok.pad_token_id))
    engine.step(float(batcher.loss_tokens))
    return sum(rewards_all) / len(rewards_all)


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def run(model_dir: Path, seed: int, s: RlSettings, log: Any = _progress) -> dict[str, Any]:
    """Before/after held-out accuracy of ``s.steps`` GRPO steps from ``model_dir``.

    Progress lines go to stderr; the result is returned (``main`` prints JSON on stdout)."""
    random.seed(seed)
    tok, engine = load_tokenizer(model_dir), make_engine(model_dir, seed, s)
    model = engine.model
    eval_set = task.demo_prompts(s.eval_prompts, "eval", seed=EVAL_SEED)
    before = evaluate(model.eval(), eval_set, tokenizer=tok)
    log(f"seed {seed}: before {before.accuracy:.3f} {before.by_op}")
    train = task.demo_prompts(s.steps * s.groups_per_step, "train", seed=seed + 1000)
    t0 = time.monotonic()
    rewards = []
    for k in range(s.steps):
        model.train()
        batch = train[k * s.groups_per_step : (k + 1) * s.groups_per_step]
        rewards.append(_step(engine, tok, batch, s))
        model.eval()
        if (k + 1) % 10 == 0:
            log(f"seed {seed}: step {k + 1} reward {sum(rewards[-10:]) / 10:.3f}")
    rl_s = time.monotonic() - t0
    tenth = max(1, len(rewards) // 10)
    after = evaluate(model.eval(), eval_set, tokenizer=tok)
    log(f"seed {seed}: after {after.accuracy:.3f} {after.by_op} ({rl_s:.0f} s RL)")
    return {
        "seed": seed,
        "before": before.accuracy,
        "after": after.accuracy,
        "gain": round(after.accuracy - before.accuracy, 4),
        "before_by_op": before.by_op,
        "after_by_op": after.by_op,
        "reward_first": round(sum(rewards[:tenth]) / tenth, 3),
        "reward_last": round(sum(rewards[-tenth:]) / tenth, 3),
        "rl_s": round(rl_s, 1),
    }


def main(argv: list[str] | None = None) -> int:
    from dataclasses import fields

    ap = argparse.ArgumentParser(prog="python -m app.rlcheck", description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--model", help="Model directory (default: srl init-model's, seed 0).")
    for f in fields(RlSettings):
        ap.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default)
    a = ap.parse_args(argv)
    s = RlSettings(**{f.name: getattr(a, f.name) for f in fields(RlSettings)})
    # like srl demo: every RL seed starts from the same (seed-0) warm start
    model_dir = Path(a.model) if a.model else ensure_model(seed=0)
    results = [run(model_dir, seed, s) for seed in a.seeds]
    sys.stdout.write(orjson.dumps({"settings": s.__dict__, "results": results}).decode() + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
