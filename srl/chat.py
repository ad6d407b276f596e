"""A tokenizer's own chat template, applied one way wherever a prompt becomes token ids.

Owns how a prompt (a plain text or a conversation of ``{role, content}`` messages) becomes
the token ids a model generates from under ``--chat-template``. The dispatcher renders the
prompts of a dataset with it (``producers.rendering``: the tasks carry the ids, so no
generator re-tokenizes them) and ``srl serve`` its chat requests (``app.serve.text.HfCodec``),
so a conversation gets the same ids in training as in serving. What must hold:

* a plain-text prompt is one user message; ``system_prompt``, when set, is put first unless
  the conversation already begins with a system message of its own;
* the rendered text is the template's, with the generation prompt (``add_generation_prompt``:
  the model writes the assistant's turn);
* its ids are the tokenizer's of that text **without added special tokens** (the template
  already holds the BOS or whatever the model expects): ``encode = token_ids(render(...))``;
* a tokenizer without a chat template is refused when the template is made (one line).

Pure functions of the tokenizer; no imports of the model stack.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from srl.errors import ConfigError

Message = dict[str, str]
ChatPrompt = str | Sequence[Mapping[str, Any]]


def check_messages(value: Any) -> list[Message]:
    """``value`` as a conversation: a non-empty list of objects whose ``role`` and ``content``
    are strings (other keys dropped); ValueError with the reason otherwise."""
    if not isinstance(value, list | tuple) or not value:
        raise ValueError("chat messages must be a non-empty list of {role, content} objects")
    out: list[Message] = []
    for i, m in enumerate(value):
        if not isinstance(m, Mapping):
            raise ValueError(f"message {i} is not an object with role and content")
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or not role:
            raise ValueError(f"message {i}: role must be a non-empty string")
        if not isinstance(content, str):
            raise ValueError(f"message {i}: content must be a string")
        out.append({"role": role, "content": content})
    return out


class ChatTemplate:
    """The chat template of ``tokenizer`` (a Hugging Face tokenizer), with an optional system
    prompt; ``what`` names the tokenizer in the error when it has no template."""

    def __init__(
        self, tokenizer: Any, system_prompt: str | None = None, what: str = "the tokenizer"
    ) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError(
                f"--chat-template: {what} has no chat template (no chat_template in its "
                "tokenizer_config.json nor a chat_template.jinja)"
            )
        self.tokenizer = tokenizer
        self.system_prompt = system_prompt

    def conversation(self, prompt: ChatPrompt) -> list[Message]:
        """The messages the template renders: a text is one user message; the system prompt
        first unless the conversation has its own."""
        if isinstance(prompt, str):
            messages = [{"role": "user", "content": prompt}]
        else:
            messages = [{str(k): v for k, v in m.items()} for m in prompt]
        if self.system_prompt is not None and (not messages or messages[0].get("role") != "system"):
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return messages

    def render(self, prompt: ChatPrompt) -> str:
        """The template's text of ``prompt``, ending in the generation prompt (jinja's own
        exception when the template refuses the conversation)."""
        text = self.tokenizer.apply_chat_template(
            self.conversation(prompt), tokenize=False, add_generation_prompt=True
        )
        return str(text)

    def token_ids(self, rendered: str) -> list[int]:
        """The ids of rendered text: no special tokens added (the template holds them)."""
        return [int(t) for t in self.tokenizer(rendered, add_special_tokens=False)["input_ids"]]

    def encode(self, prompt: ChatPrompt) -> list[int]:
        """``prompt``'s token ids under the template: ``token_ids(render(prompt))``."""
        return self.token_ids(self.render(prompt))
