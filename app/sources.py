"""Where the dispatch command and the benchmarks take their prompts from.

``load_source(cfg)`` turns ``--prompts PATH`` or ``--task demo|sim`` into the list of prompts
``producers.dispatcher.run_dispatcher`` takes: a JSONL, parquet or Arrow file, a dataset
directory and the simulated workload come from ``producers.sources`` (with its field mapping),
the demo task from ``app.task`` (the app layer owns the task); with ``--chat-template`` each is
then rendered by the tokenizer's template (``producers.rendering``).
"""

from __future__ import annotations

from app import task
from producers.config import DispatchConfig
from producers.rendering import render_prompts
from producers.sources import Fields, PromptLike, read_prompts, sim_prompts
from srl.workload import LengthHistogram


def load_source(cfg: DispatchConfig) -> list[PromptLike]:
    """The prompts ``cfg`` names: ``--prompts PATH`` or ``--task demo|sim``, rendered with
    the chat template when ``--chat-template``."""
    prompts: list[PromptLike]
    if cfg.prompts is not None:
        prompts = list(read_prompts(cfg.prompts, Fields.of(cfg)))
    elif cfg.task == "sim":
        assert cfg.lengths is not None
        hist = LengthHistogram.from_file(cfg.lengths, cfg.length_scale)
        prompts = list(sim_prompts(cfg.num_prompts, hist, cfg.seed))
    else:
        prompts = list(task.demo_prompts(cfg.num_prompts, cfg.split, cfg.seed))
    return render_prompts(cfg, prompts)
