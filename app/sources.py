"""Where the dispatch command and the benchmarks take their prompts from.

``load_source(cfg)`` turns ``--prompts FILE`` or ``--task demo|sim`` into the list of prompts
``producers.dispatcher.run_dispatcher`` takes: a JSONL file and the simulated workload come
from ``producers.sources``, the demo task from ``app.task`` (the app layer owns the task).
"""

from __future__ import annotations

from app import task
from producers.config import DispatchConfig
from producers.sources import PromptLike, read_jsonl, sim_prompts
from srl.workload import LengthHistogram


def load_source(cfg: DispatchConfig) -> list[PromptLike]:
    """The prompts ``cfg`` names: ``--prompts FILE`` or ``--task demo|sim``."""
    if cfg.prompts is not None:
        return list(read_jsonl(cfg.prompts))
    if cfg.task == "sim":
        assert cfg.lengths is not None
        hist = LengthHistogram.from_file(cfg.lengths, cfg.length_scale)
        return list(sim_prompts(cfg.num_prompts, hist, cfg.seed))
    return list(task.demo_prompts(cfg.num_prompts, cfg.split, cfg.seed))
