"""Prompts that cannot fit the generators' context, refused at dispatch.

With ``--tokenizer DIR``, the dispatcher counts each prompt's tokens as the generators will
(``producers.engines.hf.HFEngine.tokenize``: the tokenizer's ``input_ids`` of the prompt text,
a lone BOS for an empty one; with ``--chat-template``, the rendered prompt's ids the task
carries, ``producers.rendering``) and sends a prompt whose tokens plus ``max_new_tokens`` exceed
the context (``context_tokens``, else the model's ``max_position_embeddings``) to the DLQ with
the reason, keyed by its prompt id, instead of dispatching it: a generator would dead-letter
the task anyway, after a trainer step had been planned around its group (the step would wait
for a group that never comes). The check is a pure function of the prompt and the settings,
so a restarted dispatcher skips the same prompts (and dead-letters them again: the DLQ then
holds two records of the prompt, with the same key).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import orjson

from producers.config import DispatchConfig
from producers.sources import PromptLike
from srl.errors import ConfigError
from srl.kafka import Producer
from srl.metrics import dead_letter
from srl.tinymodel import load_tokenizer
from srl.topics import Layout

log = logging.getLogger("srl.dispatch")


def context_of(model_dir: str, given: int | None) -> int:
    """``given``, else ``max_position_embeddings`` of ``model_dir``'s config.json."""
    if given is not None:
        return given
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"--tokenizer {model_dir}: no readable config.json to take the context from ({e}); "
            "give --context-tokens"
        ) from None
    n = config.get("max_position_embeddings")
    if not isinstance(n, int) or n < 2:
        raise ConfigError(
            f"--tokenizer {model_dir}: config.json has no max_position_embeddings; give "
            "--context-tokens"
        )
    return n


def tokenizer_of(model_dir: str) -> Callable[[str], int]:
    """How many tokens a generator's tokenizer makes of a prompt (``HFEngine.tokenize``)."""
    try:
        tok = load_tokenizer(model_dir)
    except (OSError, ValueError) as e:
        raise ConfigError(f"--tokenizer {model_dir}: cannot load a tokenizer ({e})") from None

    def count(text: str) -> int:
        return max(1, len(tok(text)["input_ids"]))

    return count


class PromptFit:
    """The dispatch-time check; ``dropped`` counts the prompts it dead-lettered."""

    def __init__(self, cfg: DispatchConfig, count: Callable[[str], int] | None = None) -> None:
        if cfg.tokenizer is None:
            raise ConfigError("PromptFit needs --tokenizer")
        self.cfg = cfg
        self.context = context_of(cfg.tokenizer, cfg.context_tokens)
        if cfg.max_new_tokens >= self.context:
            raise ConfigError(
                f"max_new_tokens {cfg.max_new_tokens} leaves no room for a prompt in a context "
                f"of {self.context} tokens"
            )
        self.count = count or tokenizer_of(cfg.tokenizer)
        self.dropped = 0

    def reason(self, prompt: PromptLike) -> str | None:
        """Why ``prompt`` cannot be dispatched, or None if it fits."""
        ids = getattr(prompt, "prompt_tokens", None)  # rendered by the chat template
        n = len(ids) if ids else self.count(prompt.text)
        if n + self.cfg.max_new_tokens <= self.context:
            return None
        return (
            f"prompt too long: {n} tokens + max_new_tokens {self.cfg.max_new_tokens} > the "
            f"generators' context of {self.context}"
        )

    def filter(
        self, source: Iterable[PromptLike], producer: Producer, layout: Layout
    ) -> Iterator[PromptLike]:
        """``source`` without the prompts that do not fit (each dead-lettered)."""
        origin = f"dispatch:{self.cfg.prompts or self.cfg.task}"
        for prompt in source:
            why = self.reason(prompt)
            if why is None:
                yield prompt
                continue
            value = orjson.dumps(
                {"prompt_id": prompt.prompt_id, "prompt": prompt.text, "metadata": prompt.metadata}
            )
            dead_letter(producer, layout, value, prompt.prompt_id, why, origin)
            self.dropped += 1
