"""Tokens ↔ text for ``srl serve``: prompts in, completion text out, stop strings, chat prompts.

Owns what a served choice's text is. What must hold:

* streamed text is exactly the non-streamed text cut into pieces: a token whose bytes do not
  yet form whole characters is held back (``Detokenizer``: the incremental decode of
  text-generation-inference, which decodes a short window so that tokenizers that merge spaces
  across tokens stay right);
* a stop string is never sent, nor anything after it; text that could still become a stop
  string is held back until it cannot (``scan_stops``); the token that completes a stop string
  is the choice's last token, so the published trajectory ends there too (``TextStream``);
* a chat request becomes one prompt string: the tokenizer's chat template when it has one
  (with the generation prompt), else the plain join of ``plain_chat_prompt``; the template is
  applied by ``srl.chat.ChatTemplate``, the function the dispatcher renders dataset prompts
  with (``--chat-template``: required, and ``--system-prompt`` put first), so a conversation
  gets the same token ids served as dispatched;
* ``logprobs`` show each token's own text (``token_logprobs``).

Pure functions and small classes; the engine thread of ``app.serve.core`` calls them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from app.serve.protocol import TokenLogprob
from srl.chat import ChatTemplate
from srl.errors import ConfigError

Decode = Callable[[Sequence[int]], str]


class TextCodec(Protocol):
    """What the server needs of a tokenizer."""

    vocab_size: int

    def encode(self, text: str, chat: bool) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def chat_prompt(self, messages: list[dict[str, str]]) -> str: ...


def plain_chat_prompt(messages: list[dict[str, str]]) -> str:
    """A prompt for a tokenizer without a chat template: one ``role: content`` line per
    message, then ``assistant:`` for the model to continue."""
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


class HfCodec:
    """A Hugging Face tokenizer. Completion prompts are tokenized as the engine tokenizes
    dispatched prompts (``encode_prompt``), chat prompts as ``srl.chat.ChatTemplate`` renders
    and tokenizes them (no added special tokens: the template already holds them).
    ``template``: the one to use (``--chat-template``); None: the tokenizer's own, if any."""

    def __init__(
        self,
        tokenizer: Any,
        encode_prompt: Callable[[str], list[int]],
        template: ChatTemplate | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self._encode_prompt = encode_prompt
        self.vocab_size = len(tokenizer)
        if template is None and getattr(tokenizer, "chat_template", None):
            template = ChatTemplate(tokenizer)
        self.template = template

    def encode(self, text: str, chat: bool) -> list[int]:
        if chat and self.template is not None:
            return self.template.token_ids(text)
        if chat:
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return self._encode_prompt(text)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    def chat_prompt(self, messages: list[dict[str, str]]) -> str:
        if self.template is None:
            return plain_chat_prompt(messages)
        return self.template.render(messages)


class SimCodec:
    """The sim engine's stand-in tokenizer: bytes + 4 in; out, a Latin-1 character for ids
    below 260 and a word ``' w{id}'`` for the rest (its random tokens are mostly those), one
    piece per token. Simulated text."""

    def __init__(self, vocab_size: int, encode_prompt: Callable[[str], list[int]]) -> None:
        self.vocab_size = vocab_size
        self._encode_prompt = encode_prompt

    def encode(self, text: str, chat: bool) -> list[int]:
        return self._encode_prompt(text)

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(chr(i - 4) if 4 <= i < 260 else f" w{i}" for i in ids)

    def chat_prompt(self, messages: list[dict[str, str]]) -> str:
        return plain_chat_prompt(messages)


def codec_for(
    engine: Any, chat_template: bool = False, system_prompt: str | None = None
) -> TextCodec:
    """The codec of an engine: its tokenizer (hf, vllm), else the sim stand-in.
    ``chat_template`` (``--chat-template``): the tokenizer's template, required, with
    ``system_prompt``; ConfigError for a tokenizer without one or the sim engine."""
    tokenizer = getattr(engine, "tokenizer", None)
    if tokenizer is not None:
        template = None
        if chat_template:
            template = ChatTemplate(tokenizer, system_prompt, "the model's tokenizer")
        return HfCodec(tokenizer, engine.tokenize, template)
    if chat_template:
        raise ConfigError("--chat-template: the sim engine has no tokenizer, so no chat template")
    return SimCodec(int(getattr(engine, "vocab", 32_000)), engine.tokenize)


def token_logprobs(
    decode: Decode,
    tokens: Sequence[int],
    logprobs: Sequence[float],
    top: Sequence[Sequence[tuple[int, float]]] | None,
) -> list[TokenLogprob]:
    """What the API shows of ``tokens``: each one's text, (behaviour) log-prob and the engine's
    most likely alternatives (``top``, per token; None: none)."""
    alts = top or [()] * len(tokens)
    return [
        TokenLogprob(decode([t]), lp, tuple((decode([a]), alp) for a, alp in alt))
        for t, lp, alt in zip(tokens, logprobs, alts, strict=False)
    ]


def choice_seed(seed: int | None, index: int) -> int | None:
    """The sampling seed of choice ``index`` of a request with ``seed``: distinct per choice
    (n samples of one seed must differ), stable, in [0, 2**63)."""
    if seed is None:
        return None
    digest = hashlib.blake2b(f"{seed}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def scan_stops(text: str, stops: Sequence[str]) -> tuple[str, str, bool]:
    """``(send, hold, stopped)`` for text not yet sent.

    Stopped: ``send`` is the text before the earliest stop string and nothing is held.
    Otherwise ``hold`` is the longest end of ``text`` that begins some stop string (it may yet
    become one) and ``send`` the rest.
    """
    if not stops:
        return text, "", False
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    if hits:
        return text[: min(hits)], "", True
    keep = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), keep, -1):
            if text.endswith(s[:k]):
                keep = k
                break
    return text[: len(text) - keep], text[len(text) - keep :], False


class Detokenizer:
    """Incremental decode: text for each new token once its characters are complete."""

    def __init__(self, decode: Decode) -> None:
        self.decode = decode
        self.ids: list[int] = []
        self._prefix = 0  # window start: decoding from here gives the right spacing
        self._read = 0  # tokens whose text was returned
        self._before: str | None = ""  # decode(ids[prefix:read]), cached

    def add(self, token: int) -> str:
        self.ids.append(token)
        before = self._window_text()
        text = self.decode(self.ids[self._prefix :])
        if len(text) > len(before) and not text.endswith("\ufffd"):
            self._prefix, self._read, self._before = self._read, len(self.ids), None
            return text[len(before) :]
        return ""

    def flush(self) -> str:
        """What is left at the end (an incomplete character decodes as U+FFFD)."""
        before = self._window_text()
        text = self.decode(self.ids[self._prefix :])
        self._prefix = self._read = len(self.ids)
        self._before = ""
        return text[len(before) :]

    def _window_text(self) -> str:
        if self._before is None:
            self._before = self.decode(self.ids[self._prefix : self._read])
        return self._before


class TextStream:
    """One choice's text: tokens in, text to send out, cut at the first stop string."""

    def __init__(self, decode: Decode, stops: Sequence[str] = ()) -> None:
        self.detok = Detokenizer(decode)
        self.stops = tuple(stops)
        self.held = ""

    def feed(self, tokens: Sequence[int]) -> tuple[int, str, bool]:
        """``(tokens used, text to send, stopped)``: with a stop, the tokens after the one
        that completed it are not used."""
        sent: list[str] = []
        for i, token in enumerate(tokens):
            piece = self.detok.add(token)
            if not piece:
                continue
            send, self.held, stopped = scan_stops(self.held + piece, self.stops)
            sent.append(send)
            if stopped:
                return i + 1, "".join(sent), True
        return len(tokens), "".join(sent), False

    def finish(self) -> tuple[str, bool]:
        """``(the rest of the text, stopped)`` when generation ended: held text and any
        incomplete character; a stop string may still complete in it."""
        rest = self.held + self.detok.flush()
        self.held = ""
        send, _hold, stopped = scan_stops(rest, self.stops)
        return (send, True) if stopped else (rest, False)
