"""``srl init-model``: the demo's policy v0 — a tiny causal LM, supervised on the demo task.

Owns the warm start and the held-out evaluation the demo reports. The model is
``srl.tinymodel``'s (Qwen2 architecture, byte-level tokenizer, random init, built locally),
then fine-tuned on ``app.task.sft_pairs``: answers of an *imperfect demonstrator* that makes
one plausible mistake per operation with probability ``TEACHER_ERROR`` (> 0.5). The model
learns to execute every operation, but its most likely answer is the demonstrator's mistake,
so greedy accuracy starts low while sampling finds the right answer often: exactly what a
verifiable reward and GRPO can fix (docs/demo-task.md).

What must hold:

* no download: tokenizer, config and weights are made here;
* cached: ``OUT/WARMSTART.json`` records a key of everything that shapes the result (model
  shape, task version, SFT settings, seed); a second call with the same key returns at once;
  the directory is written under a temporary name and renamed, so an interrupted build is
  never mistaken for a finished one;
* prompts are the token ids of the prompt text alone (no BOS), as the generators feed them.

Called by ``srl init-model`` and ``srl demo``.
"""

from __future__ import annotations

import hashlib
import logging
import math
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import orjson

from app import task
from app.evaluation import Complete, Sampling, run_eval
from producers.sources import PromptLike
from srl.errors import SrlError
from srl.tinymodel import TinyModelSpec, build_tiny_model, load_model, load_tokenizer

log = logging.getLogger("app.warmstart")

DEFAULT_DIR = Path("runs/models")
MARKER = "WARMSTART.json"
VERSION = 1  # bump when the recipe below changes: it is part of the cache key


@dataclass(frozen=True)
class SftSettings:
    steps: int = 700
    batch: int = 64
    lr: float = 3e-3
    warmup: int = 50
    teacher_error: float = task.TEACHER_ERROR


@dataclass
class EvalResult:
    accuracy: float
    n: int
    by_op: dict[str, float] = field(default_factory=dict)
    examples: list[tuple[str, str, bool]] = field(default_factory=list)


def cache_key(seed: int, sft: SftSettings) -> str:

    blob = orjson.dumps(
        {
            "v": VERSION,
            "task": task.TASK_VERSION,
            "spec": asdict(TinyModelSpec()),
            "sft": asdict(sft),
            "seed": seed,
        },
        option=orjson.OPT_SORT_KEYS,
    )
    return hashlib.sha256(blob).hexdigest()[:16]


def default_dir(seed: int) -> Path:
    return DEFAULT_DIR / f"strops-s{seed}"


def cached(out: Path, key: str) -> bool:
    try:
        return orjson.loads((out / MARKER).read_bytes()).get("key") == key
    except (OSError, orjson.JSONDecodeError):
        return False


def quiet_transformers() -> None:
    """No per-file progress bars from transformers (ours says what is happening)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def ensure_model(
    seed: int = 0,
    out: Path | None = None,
    force: bool = False,
    progress: bool = True,
    sft: SftSettings | None = None,
) -> Path:
    """The warm-started model directory for ``seed`` (built the first time, then cached)."""
    quiet_transformers()
    sft = sft or SftSettings()
    out = Path(out or default_dir(seed))
    key = cache_key(seed, sft)
    if not force and cached(out, key):
        return out
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    t0 = time.monotonic()
    result = build(tmp, seed, sft, progress)
    (tmp / MARKER).write_bytes(
        orjson.dumps(
            {
                "key": key,
                "seed": seed,
                "sft": asdict(sft),
                "build_s": round(time.monotonic() - t0, 1),
                "final_loss": result["loss"],
                "eval_greedy": result["eval"],
            },
            option=orjson.OPT_INDENT_2,
        )
    )
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def _encode(tok: Any, prompt: str, answer: str) -> tuple[list[int], int]:
    p = tok(prompt, add_special_tokens=False)["input_ids"]
    a = tok(answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    return p + a, len(p)


def build(out: Path, seed: int, sft: SftSettings, progress: bool = True) -> dict[str, Any]:
    """Random-init the tiny model in ``out``, fine-tune it on the demonstrator, save it there."""
    import torch
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    build_tiny_model(out, seed=seed)
    tok, model = load_tokenizer(out), load_model(out)
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=sft.lr, weight_decay=0.01, betas=(0.9, 0.98))

    def lr_at(step: int) -> float:
        if step < sft.warmup:
            return (step + 1) / sft.warmup
        frac = (step - sft.warmup) / max(1, sft.steps - sft.warmup)
        return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * frac))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    pairs = task.sft_pairs(seed, sft.teacher_error)
    model.train()
    loss_ema = None
    with Progress(
        TextColumn("warm start (SFT)"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TextColumn("loss {task.fields[loss]}"),
        TimeRemainingColumn(),
        disable=not progress,
    ) as bar:
        tid = bar.add_task("sft", total=sft.steps, loss="-")
        for _step in range(sft.steps):
            batch = [_encode(tok, *next(pairs)) for _ in range(sft.batch)]
            width = max(len(ids) for ids, _ in batch)
            ids = torch.full((len(batch), width), tok.pad_token_id, dtype=torch.long)
            labels = torch.full_like(ids, -100)
            mask = torch.zeros_like(ids)
            for i, (seq, plen) in enumerate(batch):
                ids[i, : len(seq)] = torch.tensor(seq)
                labels[i, plen : len(seq)] = torch.tensor(seq[plen:])
                mask[i, : len(seq)] = 1
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            loss_ema = loss.item() if loss_ema is None else 0.95 * loss_ema + 0.05 * loss.item()
            bar.update(tid, advance=1, loss=f"{loss_ema:.3f}")
    model.eval()
    model.save_pretrained(out)
    tok.save_pretrained(out)
    ev = evaluate(model, task.demo_prompts(200, "eval", seed=1), tokenizer=tok)
    log.info(
        "warm start: loss %.3f, greedy held-out accuracy %.3f %s", loss_ema, ev.accuracy, ev.by_op
    )
    return {"loss": round(loss_ema or 0.0, 4), "eval": {"accuracy": ev.accuracy, "by_op": ev.by_op}}


def _load(model_or_dir: Any, tokenizer: Any) -> tuple[Any, Any]:

    if isinstance(model_or_dir, str | Path):
        d = Path(model_or_dir)
        if not (d / "config.json").exists():
            raise SrlError(f"{d}: not a Hugging Face model directory (no config.json)")
        return load_model(d).eval(), tokenizer or load_tokenizer(d)
    if tokenizer is None:
        raise SrlError("evaluate: a model object needs its tokenizer")
    return model_or_dir, tokenizer


def evaluate(
    model_or_dir: Any, prompts: list[task.Prompt], tokenizer: Any = None, batch: int = 128
) -> EvalResult:
    """Greedy accuracy on ``prompts`` (exact answer), overall and per operation: greedy pass@1
    of ``app.evaluation`` (``srl eval``'s core) with the demo task's check as the reward."""
    model, tok = _load(model_or_dir, tokenizer)
    if not prompts:
        return EvalResult(0.0, 0)
    out = run_eval(
        list(prompts),
        _batched_greedy(model, tok, batch),
        lambda items: [float(task.is_correct(p.text, c, p.metadata)) for p, c in items],
        Sampling(max_new_tokens=task.MAX_ANSWER_LEN + 2),
        group_of=lambda p: str(p.metadata.get("op", "?")),
    )
    examples = [(r.prompt.text, r.greedy or "", out.passed(r.greedy_reward)) for r in out.results]
    return EvalResult(
        accuracy=round(out.greedy_pass(), 4),
        n=len(out.results),
        by_op=out.by_group(),
        examples=examples[:8],
    )


def _batched_greedy(model: Any, tok: Any, batch: int) -> Complete:
    """The demo's generation for ``run_eval``: greedy only, ``batch`` prompts at a time."""

    def complete(
        prompts: list[PromptLike], temperature: float, n: int, max_new_tokens: int
    ) -> list[list[str | None]]:
        import torch

        if temperature != 0 or n != 1:
            raise SrlError("the demo's evaluation is greedy only")
        out: list[list[str | None]] = []
        with torch.no_grad():
            for i in range(0, len(prompts), batch):
                texts = [p.text for p in prompts[i : i + batch]]
                out += [[c] for c in greedy(model, tok, texts, max_new_tokens)]
        return out

    return complete


def left_padded(tok: Any, texts: list[str]) -> tuple[Any, Any]:
    """``(input_ids, attention_mask)`` of ``texts`` as one left-padded batch (no special
    tokens), the form ``generate`` continues; the prompts end at column ``ids.shape[1]``."""
    import torch

    enc = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    width = max(len(e) for e in enc)
    ids = torch.full((len(enc), width), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, e in enumerate(enc):
        ids[i, width - len(e) :] = torch.tensor(e)
        mask[i, width - len(e) :] = 1
    return ids, mask


def greedy(model: Any, tok: Any, texts: list[str], max_new_tokens: int) -> list[str]:
    """Greedy completions of ``texts`` (left-padded batch, no special tokens in the prompt)."""
    ids, mask = left_padded(tok, texts)
    width = ids.shape[1]
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
    )
    return [tok.decode(o[width:], skip_special_tokens=True) for o in out]
