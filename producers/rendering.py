"""Prompts rendered with the tokenizer's chat template at dispatch (``--chat-template``).

Owns what a source's prompts become before they are planned: with ``chat_template`` each
prompt (a row of chat messages as it is, a plain text as one user message, after
``system_prompt``) is rendered by ``srl.chat.ChatTemplate`` of the ``--tokenizer`` model, the
same function ``srl serve`` renders chat requests with; the prompt then carries the rendered
text and its token ids, and the task carries the ids (``PromptTask.prompt_tokens``), so no
generator re-tokenizes it and every engine prefills exactly those ids. The prompt-length check
(``producers.promptfit``) counts the same ids. Rendering happens once, when the source is
loaded (``app.sources.load_source``), so a conversation the template refuses stops the
dispatcher before anything is published, with one line naming the prompt.
"""

from __future__ import annotations

from collections.abc import Sequence

from producers.config import DispatchConfig
from producers.sources import PromptLike, SourcePrompt
from srl.chat import ChatTemplate
from srl.errors import ConfigError
from srl.tinymodel import load_tokenizer


def template_of(cfg: DispatchConfig) -> ChatTemplate:
    """The chat template of ``cfg.tokenizer`` with ``cfg.system_prompt``; ConfigError when
    the tokenizer does not load or has no template."""
    if cfg.tokenizer is None:
        raise ConfigError("--chat-template needs --tokenizer DIR")
    try:
        tok = load_tokenizer(cfg.tokenizer)
    except (OSError, ValueError) as e:
        raise ConfigError(f"--tokenizer {cfg.tokenizer}: cannot load a tokenizer ({e})") from None
    return ChatTemplate(tok, cfg.system_prompt, what=f"--tokenizer {cfg.tokenizer}")


def render_prompts(
    cfg: DispatchConfig, prompts: Sequence[PromptLike], template: ChatTemplate | None = None
) -> list[PromptLike]:
    """``prompts`` as the generators will see them: rendered with the chat template when
    ``cfg.chat_template`` (module docstring), else unchanged."""
    if not cfg.chat_template:
        return list(prompts)
    template = template or template_of(cfg)
    source = cfg.prompts or f"--task {cfg.task}"
    out: list[PromptLike] = []
    for p in prompts:
        messages = getattr(p, "messages", None)
        try:
            text = template.render(list(messages) if messages else p.text)
        except Exception as e:  # jinja's own errors (raise_exception in a template, bad roles)
            raise ConfigError(
                f"{source}: prompt {p.prompt_id!r}: the chat template refused it: {e}"
            ) from None
        ids = tuple(template.token_ids(text))
        out.append(SourcePrompt(p.prompt_id, text, dict(p.metadata), messages, ids))
    return out
