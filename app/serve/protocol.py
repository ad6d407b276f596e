"""The OpenAI API as ``srl serve`` speaks it: request models, validation, response bodies.

Owns the wire format of ``POST /v1/completions`` and ``POST /v1/chat/completions``: what a
request may hold, how it becomes a :class:`Sampling`, and the exact JSON of responses,
streamed chunks (server-sent events) and errors; and of srl's own ``POST /v1/feedback``
(:class:`FeedbackRequest`). What must hold:

* a request is checked once, here; anything the engine cannot honour (penalties, logprobs,
  tools, several prompts in one request) is refused with a 400 naming the parameter, never
  silently ignored; unknown fields are ignored, as newer clients send them;
* every error is OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``;
* bodies and chunks are OpenAI's: ``text_completion`` / ``chat.completion`` /
  ``chat.completion.chunk`` objects, ``[DONE]`` last; ``system_fingerprint`` names the engine
  and the policy version that produced the text (``srl-hf-v3``).

Pure functions and pydantic models; ``app.serve.http`` calls them.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field

Kind = Literal["completion", "chat"]

MAX_STOPS = 4  # OpenAI's bound on stop sequences
MAX_METADATA = 16  # OpenAI's bounds on request metadata: pairs, key and value lengths
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512
COMPLETION_ID = re.compile(r"^(cmpl|chatcmpl)-[0-9a-f]{32}$")  # what new_completion_id makes


class ApiError(Exception):
    """A request the server refuses: an HTTP status and OpenAI's error body."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type_: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_ or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(
    message: str, type_: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


# -- requests ------------------------------------------------------------------------------
class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class _Request(BaseModel):
    """What both endpoints take (OpenAI's names and bounds)."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    functions: list[Any] | None = None
    response_format: dict[str, Any] | None = None


@dataclass(frozen=True)
class Sampling:
    """How the choices of one request are generated."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stop: tuple[str, ...] = ()
    seed: int | None = None


def sampling_of(
    req: CompletionRequest | ChatRequest, default_max_tokens: int, max_n: int
) -> Sampling:
    """The request's sampling, checked; ApiError 400 naming the parameter otherwise."""
    refuse_unsupported(req)
    n = 1 if req.n is None else req.n
    if n > max_n:
        raise ApiError(400, f"n is {n}; this server allows at most {max_n}", "n")
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stops) > MAX_STOPS or any(not s for s in stops):
        raise ApiError(400, f"stop: at most {MAX_STOPS} non-empty strings", "stop")
    check_metadata(req.metadata)
    max_tokens = req.max_tokens
    if isinstance(req, ChatRequest) and req.max_completion_tokens is not None:
        max_tokens = req.max_completion_tokens
    return Sampling(
        max_tokens=max_tokens or default_max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        n=n,
        stop=tuple(stops),
        seed=req.seed,
    )


def refuse_unsupported(req: CompletionRequest | ChatRequest) -> None:
    """ApiError 400 for a parameter the engine cannot honour."""
    found: list[str] = []
    if req.presence_penalty or req.frequency_penalty:
        found.append("presence_penalty" if req.presence_penalty else "frequency_penalty")
    if req.logit_bias:
        found.append("logit_bias")
    if isinstance(req, CompletionRequest):
        if req.echo:
            found.append("echo")
        if req.suffix:
            found.append("suffix")
        if req.best_of not in (None, 1) and req.best_of != req.n:
            found.append("best_of")
        if req.logprobs is not None:
            found.append("logprobs")
    else:
        if req.logprobs or req.top_logprobs:
            found.append("logprobs")
        if req.tools or req.functions:
            found.append("tools")
        if req.response_format and req.response_format.get("type", "text") != "text":
            found.append("response_format")
    if found:
        raise ApiError(400, f"{found[0]} is not supported by this server", found[0])


def check_metadata(metadata: dict[str, str] | None) -> None:
    if not metadata:
        return
    if len(metadata) > MAX_METADATA or any(
        len(k) > MAX_METADATA_KEY or len(v) > MAX_METADATA_VALUE for k, v in metadata.items()
    ):
        raise ApiError(
            400,
            f"metadata: at most {MAX_METADATA} pairs, keys of at most {MAX_METADATA_KEY} "
            f"characters, values of at most {MAX_METADATA_VALUE}",
            "metadata",
        )


def prompt_of(req: CompletionRequest) -> str | list[int]:
    """The one prompt of a completion request: text or token ids."""
    p = req.prompt
    if isinstance(p, str):
        return p
    if p and all(isinstance(x, int) for x in p):
        return [int(x) for x in p]  # type: ignore[arg-type]
    if len(p) == 1:
        first = p[0]
        return first if isinstance(first, str) else [int(x) for x in first]  # type: ignore[union-attr]
    raise ApiError(400, "one prompt per request: send several requests instead", "prompt")


def chat_messages(req: ChatRequest) -> list[dict[str, str]]:
    """The conversation as ``{"role", "content"}`` dicts of plain text."""
    out = []
    for i, m in enumerate(req.messages):
        if m.content is None or isinstance(m.content, str):
            text = m.content or ""
        else:
            if any(part.type != "text" for part in m.content):
                raise ApiError(400, "only text content is supported", f"messages.[{i}].content")
            text = "".join(part.text or "" for part in m.content)
        out.append({"role": m.role, "content": text})
    return out


def request_record(req: CompletionRequest | ChatRequest, kind: Kind, s: Sampling) -> dict[str, Any]:
    """What the log keeps of a request (the seq-0 chunk's metadata, under ``request``)."""
    return {
        "endpoint": "chat.completions" if kind == "chat" else "completions",
        "model": req.model,
        "max_tokens": s.max_tokens,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "n": s.n,
        "stop": list(s.stop),
        "seed": s.seed,
        "stream": bool(req.stream),
        "user": req.user,
        "metadata": req.metadata,
    }


class FeedbackRequest(BaseModel):
    """``POST /v1/feedback``: an application's reward for one served choice."""

    model_config = ConfigDict(extra="ignore")

    id: str  # the completion's id, as the API returned it
    reward: float = Field(allow_inf_nan=False)
    index: int = Field(0, ge=0)  # the choice (0 for n = 1)
    metadata: dict[str, str] | None = None


def check_feedback(req: FeedbackRequest, max_n: int) -> None:
    """ApiError 400 naming the parameter unless the feedback can belong to a served choice."""
    if not COMPLETION_ID.match(req.id):
        raise ApiError(400, f"id: {req.id[:80]!r} is not a completion id of srl serve", "id")
    if req.index >= max_n:
        raise ApiError(400, f"index is {req.index}; this server allows n <= {max_n}", "index")
    check_metadata(req.metadata)


# -- responses -----------------------------------------------------------------------------
def new_completion_id(kind: Kind) -> str:
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


@dataclass(frozen=True)
class Reply:
    """The response of one request: its id, and OpenAI's bodies and chunks for it."""

    kind: Kind
    id: str
    created: int
    model: str

    def _head(self, obj: str, fingerprint: str) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": fingerprint,
        }

    def body(
        self, choices: list[tuple[str, str]], use: dict[str, int], fingerprint: str
    ) -> dict[str, Any]:
        """The whole response: ``choices`` are ``(text, finish_reason)`` by index."""
        if self.kind == "chat":
            out = [
                {
                    "index": i,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": None,
                    "finish_reason": reason,
                }
                for i, (text, reason) in enumerate(choices)
            ]
            return self._head("chat.completion", fingerprint) | {"choices": out, "usage": use}
        out = [
            {"index": i, "text": text, "logprobs": None, "finish_reason": reason}
            for i, (text, reason) in enumerate(choices)
        ]
        return self._head("text_completion", fingerprint) | {"choices": out, "usage": use}

    def chunk(
        self,
        index: int,
        text: str,
        finish_reason: str | None,
        fingerprint: str,
        role: bool = False,
    ) -> dict[str, Any]:
        """One streamed piece of choice ``index`` (``role``: the chat's opening delta)."""
        if self.kind == "chat":
            delta: dict[str, str] = {"role": "assistant"} if role else {}
            if text or role:
                delta["content"] = text
            choice = {"index": index, "delta": delta, "logprobs": None}
            return self._head("chat.completion.chunk", fingerprint) | {
                "choices": [choice | {"finish_reason": finish_reason}]
            }
        choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return self._head("text_completion", fingerprint) | {"choices": [choice]}

    def usage_chunk(self, use: dict[str, int], fingerprint: str) -> dict[str, Any]:
        """The last chunk when ``stream_options.include_usage``: no choices, the usage."""
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return self._head(obj, fingerprint) | {"choices": [], "usage": use}


def sse(obj: dict[str, Any]) -> bytes:
    """One server-sent event."""
    return b"data: " + orjson.dumps(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
