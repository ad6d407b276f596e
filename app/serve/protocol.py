"""The OpenAI API as ``srl serve`` speaks it: request models, validation, response bodies.

Owns the wire format of ``POST /v1/completions`` and ``POST /v1/chat/completions``: what a
request may hold, how it becomes a :class:`Sampling`, and the exact JSON of responses,
streamed chunks (server-sent events) and errors; and of srl's own ``POST /v1/feedback``
(:class:`FeedbackRequest`). What must hold:

* a request is checked once, here; anything the engine cannot honour (penalties, tools, a
  structured ``response_format``, several prompts in one request …) is refused with a 400
  naming the parameter (code ``unsupported_parameter``), never silently ignored; unknown
  fields are ignored, as newer clients send them;
* every field is bounded (lengths of strings and lists, integers within int64 and what the
  log can hold), so no request can make a record the broker refuses or a prompt the engine
  thread chokes on (the body as a whole is bounded by the app: ``max_body_bytes``);
* every error is OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``;
* bodies and chunks are OpenAI's: ``text_completion`` / ``chat.completion`` /
  ``chat.completion.chunk`` objects, ``[DONE]`` last; ``system_fingerprint`` names the engine
  and the policy version that produced the text (``srl-hf-v3``); ``logprobs`` are vLLM's
  shapes (completions: ``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``;
  chat: ``content`` of ``{token, logprob, bytes, top_logprobs}``), the log-probs being the
  behaviour log-probs the log records for the same tokens.

Pure functions and pydantic models; ``app.serve.http`` calls them.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, model_validator

Kind = Literal["completion", "chat"]

MAX_STOPS = 4  # OpenAI's bound on stop sequences
MAX_STOP_CHARS = 256  # characters of one stop sequence
MAX_NAME_CHARS = 256  # model ids, user ids, message names
MAX_MESSAGES = 1024  # messages of one chat request
MAX_LOGPROBS = 20  # OpenAI's (and vLLM's default) bound on top_logprobs
MAX_TOKENS = 2**31 - 1  # max_tokens, token ids
INT64 = 2**63  # seeds are int64, as OpenAI's
LOGPROB_FLOOR = -9999.0  # what JSON shows for -inf, as vLLM
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
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_ or ("invalid_request_error" if status < 500 else "server_error")
        self.retry_after_s = retry_after_s  # a Retry-After header (429, 503)

    @property
    def headers(self) -> dict[str, str]:
        """``Retry-After`` when the client should retry; ``WWW-Authenticate`` on a 401."""
        out = {} if self.retry_after_s is None else {"Retry-After": str(self.retry_after_s)}
        return out | ({"WWW-Authenticate": "Bearer"} if self.status == 401 else {})

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(
    message: str, type_: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


# -- requests ------------------------------------------------------------------------------
class NotEncodable(ValueError):
    """A string of a request that cannot be encoded; ``param``: the top-level field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def check_encodable(value: Any, where: str = "") -> None:
    """ValueError naming the first string in ``value`` (a request body, walked) that is not
    valid Unicode: JSON lets ``"\\ud800"`` through as a lone surrogate, which no tokenizer, no
    Kafka record and no response can encode (it would be a 500 further on)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise NotEncodable(
                f"{where or 'text'}: not valid Unicode text (a lone surrogate at character "
                f"{e.start})",
                re.split(r"[.\[]", where or "text")[0],
            ) from None
    elif isinstance(value, dict):
        for k, v in value.items():
            check_encodable(k, where or "key")
            check_encodable(v, f"{where}.{k}" if where else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            check_encodable(v, f"{where}[{i}]")


class Encodable(BaseModel):
    """A request body whose every string can be encoded (``check_encodable``): else a 400."""

    @model_validator(mode="before")
    @classmethod
    def _encodable(cls, data: Any) -> Any:
        check_encodable(data)
        return data


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class _Request(Encodable):
    """What both endpoints take (OpenAI's names and bounds). The fields after ``metadata`` are
    the ones this server refuses unless they ask for nothing (:func:`refuse_unsupported`)."""

    model_config = ConfigDict(extra="ignore")

    model: str = Field(max_length=MAX_NAME_CHARS)
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int | None = Field(None, ge=1, le=MAX_TOKENS)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-INT64, lt=INT64)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=MAX_NAME_CHARS)
    metadata: dict[str, str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    web_search_options: Any = None


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # top alternatives per token


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = Field(None, max_length=MAX_NAME_CHARS)


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)


@dataclass(frozen=True)
class Sampling:
    """How the choices of one request are generated."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stop: tuple[str, ...] = ()
    seed: int | None = None
    logprobs: int | None = None  # None: none returned; k: each token's and k alternatives


def sampling_of(
    req: CompletionRequest | ChatRequest, default_max_tokens: int, max_n: int
) -> Sampling:
    """The request's sampling, checked; ApiError 400 naming the parameter otherwise."""
    refuse_unsupported(req)
    n = 1 if req.n is None else req.n
    if n > max_n:
        raise ApiError(400, f"n is {n}; this server allows at most {max_n}", "n")
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stops) > MAX_STOPS or any(not s or len(s) > MAX_STOP_CHARS for s in stops):
        raise ApiError(
            400, f"stop: at most {MAX_STOPS} non-empty strings of <= {MAX_STOP_CHARS}", "stop"
        )
    check_metadata(req.metadata)
    max_tokens = req.max_tokens
    logprobs: int | None = None
    if isinstance(req, ChatRequest):
        if req.max_completion_tokens is not None:
            max_tokens = req.max_completion_tokens
        if req.top_logprobs and not req.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    else:
        logprobs = req.logprobs
    return Sampling(
        max_tokens=max_tokens or default_max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        n=n,
        stop=tuple(stops),
        seed=req.seed,
        logprobs=logprobs,
    )


def refuse_unsupported(req: CompletionRequest | ChatRequest) -> None:
    """ApiError 400 (code ``unsupported_parameter``) for a parameter the engine cannot honour;
    the values a client sends to ask for nothing (zero penalties, ``tool_choice: "none"``, a
    text ``response_format``, ``modalities: ["text"]``) are accepted."""
    asks = {
        "presence_penalty": bool(req.presence_penalty),
        "frequency_penalty": bool(req.frequency_penalty),
        "logit_bias": bool(req.logit_bias),
        "tools": bool(req.tools),
        "tool_choice": req.tool_choice not in (None, "none", "auto"),
        "functions": bool(req.functions),
        "function_call": req.function_call not in (None, "none", "auto"),
        "response_format": req.response_format not in (None, {"type": "text"}),
        "audio": req.audio is not None,
        "modalities": req.modalities not in (None, ["text"]),
        "prediction": req.prediction is not None,
        "web_search_options": req.web_search_options is not None,
    }
    if isinstance(req, CompletionRequest):
        asks["echo"] = bool(req.echo)
        asks["suffix"] = bool(req.suffix)
        asks["best_of"] = req.best_of not in (None, 1) and req.best_of != req.n
    found = [name for name, asked in asks.items() if asked]
    if found:
        raise ApiError(
            400, f"{found[0]} is not supported by this server", found[0], "unsupported_parameter"
        )


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
        "logprobs": s.logprobs,
        "stream": bool(req.stream),
        "user": req.user,
        "metadata": req.metadata,
    }


class FeedbackRequest(Encodable):
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
class TokenLogprob:
    """One generated token as ``logprobs`` show it: its text, its (behaviour) log-prob and the
    most likely alternatives ``(text, log-prob)``, most likely first."""

    token: str
    logprob: float
    top: tuple[tuple[str, float], ...] = ()


Logprobs = list[TokenLogprob] | None  # a choice's (or a piece's) tokens; None: not asked for


def _lp(x: float) -> float:
    return max(x, LOGPROB_FLOOR)


def completion_logprobs(items: list[TokenLogprob], offset: int = 0) -> dict[str, Any]:
    """A completion choice's ``logprobs`` (the legacy shape): each token's text, log-prob, a
    dict of it and the alternatives, and its character offset (the first: ``offset``)."""
    offsets = []
    for t in items:
        offsets.append(offset)
        offset += len(t.token)
    return {
        "tokens": [t.token for t in items],
        "token_logprobs": [_lp(t.logprob) for t in items],
        "top_logprobs": [{t.token: _lp(t.logprob)} | {s: _lp(v) for s, v in t.top} for t in items],
        "text_offset": offsets,
    }


def _chat_token(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": _lp(logprob), "bytes": list(token.encode())}


def chat_logprobs(items: list[TokenLogprob]) -> dict[str, Any]:
    """A chat choice's ``logprobs``: ``content``, one entry per token with its alternatives."""
    content = [
        _chat_token(t.token, t.logprob) | {"top_logprobs": [_chat_token(s, v) for s, v in t.top]}
        for t in items
    ]
    return {"content": content, "refusal": None}


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

    def logprobs(self, items: Logprobs, offset: int = 0) -> dict[str, Any] | None:
        """A choice's ``logprobs`` in this endpoint's shape (``offset``: of its first token's
        text, completions only)."""
        if items is None:
            return None
        return chat_logprobs(items) if self.kind == "chat" else completion_logprobs(items, offset)

    def body(
        self,
        choices: list[tuple[str, str, Logprobs]],
        use: dict[str, int],
        fingerprint: str,
    ) -> dict[str, Any]:
        """The whole response: ``choices`` are ``(text, finish_reason, logprobs)`` by index."""
        if self.kind == "chat":
            out = [
                {
                    "index": i,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": self.logprobs(lps),
                    "finish_reason": reason,
                }
                for i, (text, reason, lps) in enumerate(choices)
            ]
            return self._head("chat.completion", fingerprint) | {"choices": out, "usage": use}
        out = [
            {"index": i, "text": text, "logprobs": self.logprobs(lps), "finish_reason": reason}
            for i, (text, reason, lps) in enumerate(choices)
        ]
        return self._head("text_completion", fingerprint) | {"choices": out, "usage": use}

    def chunk(
        self,
        index: int,
        text: str,
        finish_reason: str | None,
        fingerprint: str,
        role: bool = False,
        logprobs: Logprobs = None,
        offset: int = 0,
    ) -> dict[str, Any]:
        """One streamed piece of choice ``index`` (``role``: the chat's opening delta), with
        the log-probs of its tokens (``offset``: of the first one's text, completions only)."""
        lps = self.logprobs(logprobs, offset)
        if self.kind == "chat":
            delta: dict[str, str] = {"role": "assistant"} if role else {}
            if text or role:
                delta["content"] = text
            choice = {"index": index, "delta": delta, "logprobs": lps}
            return self._head("chat.completion.chunk", fingerprint) | {
                "choices": [choice | {"finish_reason": finish_reason}]
            }
        choice = {"index": index, "text": text, "logprobs": lps, "finish_reason": finish_reason}
        return self._head("text_completion", fingerprint) | {"choices": [choice]}

    def usage_chunk(self, use: dict[str, int], fingerprint: str) -> dict[str, Any]:
        """The last chunk when ``stream_options.include_usage``: no choices, the usage."""
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return self._head(obj, fingerprint) | {"choices": [], "usage": use}


def sse(obj: dict[str, Any]) -> bytes:
    """One server-sent event."""
    return b"data: " + orjson.dumps(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
