"""The HTTP side of ``srl serve``: a FastAPI app speaking the OpenAI API.

Owns the routes ``POST /v1/completions``, ``POST /v1/chat/completions`` (whole bodies, or
server-sent events with ``stream: true``), ``GET /v1/models``, ``GET /v1/models/{id}``,
``GET /health`` and srl's ``POST /v1/feedback`` (``app.serve.feedback``), and the bridge to the
engine thread (``app.serve.core``). What must hold:

* every request becomes one :class:`~app.serve.jobs.Job`; the handler waits for the engine
  thread's first event (``Accepted`` or ``Rejected``) before it answers, so a request the
  engine refuses is a 400 with a JSON body even when it asked for a stream;
* the engine thread hands events over in one batch per decode step
  (``loop.call_soon_threadsafe``); each job's events land in its own ``asyncio.Queue``;
* a streaming client that goes away cancels its job (its choices end in the log with
  ``finish_reason = abort``);
* every error is OpenAI's JSON shape with a 4xx/5xx status, never a traceback
  (``ApiError``, validation errors as 400, unknown routes as 404, anything else as 500 with
  the traceback in the server's log only).

The engine thread starts and stops with the app (lifespan). Called by ``app.serve.run``;
tests drive it with Starlette's ``TestClient``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.serve.core import Busy, ServeEngine, Sink, Stopped
from app.serve.feedback import FeedbackOut
from app.serve.jobs import Accepted, Delta, Event, Failed, Finished, Job, Rejected
from app.serve.protocol import (
    SSE_DONE,
    ApiError,
    ChatRequest,
    CompletionRequest,
    FeedbackRequest,
    Kind,
    Reply,
    chat_messages,
    check_feedback,
    error_body,
    new_completion_id,
    prompt_of,
    request_record,
    sampling_of,
    sse,
    usage,
)
from srl.topics import Layout

log = logging.getLogger("srl.serve")


@dataclass(frozen=True)
class ServeInfo:
    """What the routes need besides the engine: the model id and the request bounds."""

    model: str
    default_max_tokens: int = 256
    max_n: int = 16
    created: int = 0  # /v1/models' "created" (server start, seconds since epoch)


def create_app(
    core: ServeEngine,
    info: ServeInfo,
    on_start: Callable[[], None] | None = None,
    feedback: FeedbackOut | None = None,
) -> FastAPI:
    """The app; its lifespan starts the engine thread (then ``on_start``) and stops it.
    ``feedback``: where ``POST /v1/feedback`` goes (None: refused, as with publishing off)."""

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        core.start(_sink_for(asyncio.get_running_loop()))
        if on_start is not None:
            on_start()
        try:
            yield
        finally:
            core.stop()

    app = FastAPI(
        title="srl serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    _install_errors(app)
    _model_routes(app, core, info, feedback)
    _completion_routes(app, core, info)
    _feedback_route(app, info, feedback or FeedbackOut(None, Layout(), ""))
    return app


def _sink_for(loop: asyncio.AbstractEventLoop) -> Sink:
    def deliver(batch: list[tuple[Job, Event]]) -> None:
        for job, event in batch:
            job.mailbox.put_nowait(event)

    def sink(batch: list[tuple[Job, Event]]) -> None:
        # a closed loop (server gone) raises RuntimeError: nobody waits for these events
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(deliver, batch)

    return sink


def _json(obj: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(obj), status_code=status, media_type="application/json")


def _install_errors(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_request: Request, exc: ApiError) -> Response:
        return _json(exc.body(), exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, exc: RequestValidationError) -> Response:
        err = exc.errors()[0]
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        msg = f"{'.'.join(loc) or 'request body'}: {err.get('msg')}"
        return _json(error_body(msg, "invalid_request_error", loc[0] if loc else None), 400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, exc: StarletteHTTPException) -> Response:
        return _json(error_body(str(exc.detail), "invalid_request_error"), exc.status_code)

    @app.exception_handler(Exception)
    async def internal(_request: Request, exc: Exception) -> Response:
        log.error("internal error: %s", exc, exc_info=exc)
        return _json(
            error_body(f"internal server error ({type(exc).__name__})", "server_error"), 500
        )


def _model_card(info: ServeInfo) -> dict[str, Any]:
    return {"id": info.model, "object": "model", "created": info.created, "owned_by": "srl"}


def _check_model(model: str, info: ServeInfo) -> None:
    if model != info.model:
        raise ApiError(
            404,
            f"The model `{model}` does not exist; this server serves `{info.model}`",
            "model",
            "model_not_found",
        )


def _model_routes(
    app: FastAPI, core: ServeEngine, info: ServeInfo, feedback: FeedbackOut | None
) -> None:
    @app.get("/health")
    async def health() -> Response:
        h = core.health() | {"model": info.model} | (feedback.stats() if feedback else {})
        return _json(h, 200 if h["status"] == "ok" else 503)

    @app.get("/v1/models")
    async def models() -> Response:
        return _json({"object": "list", "data": [_model_card(info)]})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        _check_model(model_id, info)
        return _json(_model_card(info))


def _completion_routes(app: FastAPI, core: ServeEngine, info: ServeInfo) -> None:
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest) -> Response:
        _check_model(body.model, info)
        return await _answer(core, info, "completion", body, prompt_of(body))

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest) -> Response:
        _check_model(body.model, info)
        messages = chat_messages(body)
        try:
            prompt = core.codec.chat_prompt(messages)
        except Exception as e:  # a template that refuses the conversation (jinja raises)
            raise ApiError(400, f"chat template: {e}", "messages") from None
        return await _answer(core, info, "chat", body, prompt)


def _feedback_route(app: FastAPI, info: ServeInfo, out: FeedbackOut) -> None:
    @app.post("/v1/feedback")
    async def feedback(body: FeedbackRequest) -> Response:
        check_feedback(body, info.max_n)
        rec = await out.send(body)
        return _json(
            {
                "object": "feedback",
                "id": rec.completion_id,
                "index": rec.choice_index,
                "trajectory_id": rec.trajectory_id,
                "reward": rec.reward,
            }
        )


async def _answer(
    core: ServeEngine,
    info: ServeInfo,
    kind: Kind,
    body: CompletionRequest | ChatRequest,
    prompt: str | list[int],
) -> Response:
    s = sampling_of(body, info.default_max_tokens, info.max_n)
    reply = Reply(kind, new_completion_id(kind), int(time.time()), info.model)
    job = Job(reply.id, kind, prompt, s, request_record(body, kind, s), asyncio.Queue())
    try:
        core.submit(job)
    except Busy as e:
        raise ApiError(429, f"server busy ({e}); retry later", None, "server_busy") from None
    except Stopped as e:
        raise ApiError(503, str(e)) from None
    first = await job.mailbox.get()
    if isinstance(first, Rejected):
        raise ApiError(400, first.message, "messages" if kind == "chat" else "prompt")
    if isinstance(first, Failed):
        raise ApiError(500, first.message)
    assert isinstance(first, Accepted)
    if body.stream:
        with_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = _stream(core, job, reply, first.prompt_tokens, with_usage)
        return StreamingResponse(events, media_type="text/event-stream")
    try:
        return _json(await _collect(core, job, reply, first.prompt_tokens))
    except asyncio.CancelledError:
        core.cancel(job)
        raise


def _fingerprint(core: ServeEngine, version: int) -> str:
    """Which engine and policy version produced the text."""
    return f"srl-{core.engine.name}-v{version}"


async def _collect(core: ServeEngine, job: Job, reply: Reply, prompt_tokens: int) -> dict[str, Any]:
    n = job.sampling.n
    texts: list[list[str]] = [[] for _ in range(n)]
    done: dict[int, Finished] = {}
    while len(done) < n:
        ev = await job.mailbox.get()
        if isinstance(ev, Delta):
            texts[ev.index].append(ev.text)
        elif isinstance(ev, Finished):
            texts[ev.index].append(ev.text)
            done[ev.index] = ev
        elif isinstance(ev, Failed):
            raise ApiError(500, ev.message)
    choices = [("".join(texts[i]), done[i].reason) for i in range(n)]
    use = usage(prompt_tokens, sum(d.tokens for d in done.values()))
    version = max(d.version for d in done.values())
    return reply.body(choices, use, _fingerprint(core, version))


async def _stream(
    core: ServeEngine, job: Job, reply: Reply, prompt_tokens: int, with_usage: bool
) -> AsyncGenerator[bytes, None]:
    """Server-sent events of one job: chunks as the engine produces them, then ``[DONE]``."""
    chat = reply.kind == "chat"
    left, tokens, version = job.sampling.n, 0, core.engine.version
    try:
        if chat:  # OpenAI opens every chat choice with the assistant role
            for i in range(left):
                yield sse(reply.chunk(i, "", None, _fingerprint(core, version), role=True))
        while left:
            ev = await job.mailbox.get()
            if isinstance(ev, Delta):
                yield sse(reply.chunk(ev.index, ev.text, None, _fingerprint(core, version)))
            elif isinstance(ev, Finished):
                left, tokens, version = left - 1, tokens + ev.tokens, ev.version
                fp = _fingerprint(core, version)
                if chat and ev.text:
                    yield sse(reply.chunk(ev.index, ev.text, None, fp))
                yield sse(reply.chunk(ev.index, "" if chat else ev.text, ev.reason, fp))
            elif isinstance(ev, Failed):
                left = 0
                yield sse(error_body(ev.message, "server_error"))
                return
        if with_usage:
            yield sse(reply.usage_chunk(usage(prompt_tokens, tokens), _fingerprint(core, version)))
        yield SSE_DONE
    finally:
        if left:  # the client went away: stop generating for it
            core.cancel(job)
