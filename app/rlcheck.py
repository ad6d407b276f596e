"""``python -m app.rlcheck``: can the demo's warm start learn under GRPO? (in-process, no Kafka)

Owns the learnability evidence of docs/demo-task.md: it runs the demo's RL recipe in one
process — sample groups from the current policy at temperature T, score them with
``app.task.demo_reward``, GRPO advantages, the trainer's own per-token policy loss
(``consumers.losses``: ``token_logprobs``, ``advantages``, ``policy_loss``, token-mean over the
step, AdamW, gradient clipping as ``consumers.engine`` does) — and reports held-out greedy
accuracy before and after (``app.warmstart.evaluate`` on the demo's fixed eval prompts).

What must hold: it trains only on the train split; sampling is on-policy (the behaviour
log-probs are the policy's own at the start of each step, so the importance weight is 1, as
in the demo with fresh samples). It is not the demo: no staleness, no chunks, no dispatcher;
it answers "do these hyperparameters make this model learn", fast.

Called by hand (docs/demo-task.md has the command and the measured table).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from app import task
from app.report import EVAL_SEED
from app.warmstart import ensure_model, evaluate
from consumers.losses import advantages, policy_loss, token_logprobs
from srl.tinymodel import load_model, load_tokenizer


@dataclass
class RlSettings:
    steps: int = 60
    group_size: int = 8
    groups_per_step: int = 8
    lr: float = 1e-4
    temperature: float = 1.0
    max_new_tokens: int = 72
    loss: str = "tis"
    max_grad_norm: float = 1.0
    eval_prompts: int = 256


def _sample(model: Any, tok: Any, texts: list[str], n: int, s: RlSettings) -> list[list[int]]:
    """``n`` sampled completions (token ids, EOS kept, padding cut) of each text, in order."""
    import torch

    enc = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    width = max(len(e) for e in enc)
    ids = torch.full((len(enc), width), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, e in enumerate(enc):
        ids[i, width - len(e) :] = torch.tensor(e)
        mask[i, width - len(e) :] = 1
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


def _step(model: Any, opt: Any, tok: Any, prompts: list[task.Prompt], s: RlSettings) -> float:
    """One GRPO step over ``groups_per_step`` groups; returns the mean reward."""
    import torch

    comps = _sample(model, tok, [p.text for p in prompts], s.group_size, s)
    rows: list[tuple[list[int], int, float]] = []  # ids, prompt length, advantage
    rewards_all: list[float] = []
    for g, p in enumerate(prompts):
        group = comps[g * s.group_size : (g + 1) * s.group_size]
        r = [
            task.demo_reward(p.text, tok.decode(c, skip_special_tokens=True), p.metadata)
            for c in group
        ]
        rewards_all += r
        adv = advantages("grpo", torch.tensor(r))
        pids = tok(p.text, add_special_tokens=False)["input_ids"]
        rows += [(pids + c, len(pids), float(a)) for c, a in zip(group, adv, strict=True)]
    length = max(len(ids) for ids, _, _ in rows)
    ids = torch.full((len(rows), length), tok.pad_token_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    weight = torch.zeros((len(rows), length - 1))
    for i, (seq, plen, _) in enumerate(rows):
        ids[i, : len(seq)] = torch.tensor(seq)
        attn[i, : len(seq)] = 1
        weight[i, plen - 1 : len(seq) - 1] = 1.0  # position j predicts token j + 1
    adv_t = torch.tensor([a for _, _, a in rows])
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
    logp = token_logprobs(logits, ids[:, 1:], s.temperature)
    behav = logp.detach()  # on-policy: the sampler is the policy at the start of the step
    loss = (policy_loss(s.loss, logp, behav, adv_t) * weight).sum() / weight.sum()  # type: ignore[arg-type]
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if s.max_grad_norm > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), s.max_grad_norm)
    opt.step()
    return sum(rewards_all) / len(rewards_all)


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def run(model_dir: Path, seed: int, s: RlSettings, log: Any = _progress) -> dict[str, Any]:
    """Before/after held-out accuracy of ``s.steps`` GRPO steps from ``model_dir``.

    Progress lines go to stderr; the result is returned (``main`` prints JSON on stdout)."""
    import torch

    torch.manual_seed(seed)
    random.seed(seed)
    tok, model = load_tokenizer(model_dir), load_model(model_dir)
    eval_set = task.demo_prompts(s.eval_prompts, "eval", seed=EVAL_SEED)
    before = evaluate(model.eval(), eval_set, tokenizer=tok)
    log(f"seed {seed}: before {before.accuracy:.3f} {before.by_op}")
    opt = torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=0.0)
    train = task.demo_prompts(s.steps * s.groups_per_step, "train", seed=seed + 1000)
    t0 = time.monotonic()
    rewards = []
    for k in range(s.steps):
        model.train()
        batch = train[k * s.groups_per_step : (k + 1) * s.groups_per_step]
        rewards.append(_step(model, opt, tok, batch, s))
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
