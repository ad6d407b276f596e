"""The HTTP side of ``srl serve``: a FastAPI app speaking the OpenAI API.

Owns the routes ``POST /v1/completions``, ``POST /v1/chat/completions`` (whole bodies, or
server-sent events with ``stream: true``), ``GET /v1/models``, ``GET /v1/models/{id}``,
srl's ``POST /v1/feedback`` (``app.serve.feedback``), the open ``GET /health`` and
``GET /metrics`` (Prometheus), and the bridge to the engine thread (``app.serve.core``). What
must hold:

* every request becomes one :class:`~app.serve.jobs.Job`; its prompt is rendered, tokenized
  and checked on a worker thread (``ServeEngine.prepare``), never on the event loop, so a bad
  prompt is a 400 before anything runs; the handler then waits for the engine thread's first
  event (``Accepted`` once the job has a batch slot, ``Overloaded`` after the queue-wait bound:
  503 with Retry-After) before it answers, so a refused request is a JSON error even when it
  asked for a stream;
* the engine thread hands events over in one batch per decode step
  (``loop.call_soon_threadsafe``); each job's events land in its own queue, bounded: a client
  that stops reading its stream while ``max_queued_events`` wait is cancelled;
* a client that goes away cancels its job, streaming or not (its choices end in the log with
  ``finish_reason = abort``);
* with an API key, every ``/v1`` route needs ``Authorization: Bearer KEY`` (compared in
  constant time; ``/v1/feedback`` its own key when one is set); ``/health`` and ``/metrics``
  stay open;
* every error is OpenAI's JSON shape with a 4xx/5xx status, never a traceback and never
  internal error text (``ApiError``, validation errors as 400, a body over ``max_body_bytes``
  as 413, unknown routes as 404, 429 and 503 with ``Retry-After``, anything else as 500 with
  the traceback in the server's log only).

The engine thread starts and stops with the app (lifespan). Called by ``app.serve.run``;
tests drive it with Starlette's ``TestClient`` or a uvicorn server in a thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

import anyio
import anyio.to_thread
import orjson
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.serve.core import Busy, Prompt, ServeEngine, Sink, Stopped, user_message
from app.serve.feedback import FeedbackOut
from app.serve.jobs import Accepted, Delta, Event, Failed, Finished, Job, Overloaded
from app.serve.metrics import metrics_response
from app.serve.protocol import (
    SSE_DONE,
    ApiError,
    ChatRequest,
    CompletionRequest,
    FeedbackRequest,
    Kind,
    Logprobs,
    NotEncodable,
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
from producers.engines.base import RequestError
from srl.topics import Layout

log = logging.getLogger("srl.serve")
T = TypeVar("T")

# server-sent events pass proxies unbuffered and uncached (nginx honours X-Accel-Buffering)
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
RETRY_BUSY_S = 1  # Retry-After of a 429 (too many pending) and a 503 (no slot in time)
RETRY_STOPPED_S = 5  # Retry-After of a 503 while the server stops or after its engine failed
CLIENT_GONE = 499  # the status logged for a request whose client went away (nobody reads it)


@dataclass(frozen=True)
class ServeInfo:
    """What the routes need besides the engine: the model id, the request bounds, the keys."""

    model: str
    default_max_tokens: int = 256
    max_n: int = 16
    created: int = 0  # /v1/models' "created" (server start, seconds since epoch)
    api_key: str | None = None  # Bearer key of every /v1 route (None: none needed)
    feedback_api_key: str | None = None  # /v1/feedback's own key (None: api_key)
    max_body_bytes: int = 4 * 1024 * 1024  # a larger request body is a 413
    max_queued_events: int = 16_384  # a job's events waiting for its client; beyond: cancelled


def create_app(
    core: ServeEngine,
    info: ServeInfo,
    on_start: Callable[[], None] | None = None,
    feedback: FeedbackOut | None = None,
) -> FastAPI:
    """The app; its lifespan starts the engine thread (then ``on_start``) and stops it.
    ``feedback``: where ``POST /v1/feedback`` goes (None: refused, as with publishing off)."""
    out = feedback or FeedbackOut(None, Layout(), "")

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # one worker thread prepares prompts (templates, tokenizers): off the event loop and
        # off the decode loop, one at a time (the tokenizer is shared with the engine thread)
        app.state.prepare_limiter = anyio.CapacityLimiter(1)
        loop = asyncio.get_running_loop()
        core.start(_sink_for(loop, info.max_queued_events, core.cancel))
        if on_start is not None:
            on_start()
        try:
            yield
        finally:
            core.stop()

    app = FastAPI(
        title="srl serve",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.add_middleware(BodyLimit, limit=info.max_body_bytes)
    _install_errors(app, info)
    _open_routes(app, core, info, out)
    api = APIRouter(dependencies=[Depends(_authorize(info.api_key))])
    _model_routes(api, info)
    _completion_routes(api, core, info)
    app.include_router(api)
    feedback_key = info.feedback_api_key or info.api_key
    feedback_api = APIRouter(dependencies=[Depends(_authorize(feedback_key))])
    _feedback_route(feedback_api, info, out)
    app.include_router(feedback_api)
    return app


def _sink_for(loop: asyncio.AbstractEventLoop, limit: int, cancel: Callable[[Job], None]) -> Sink:
    def deliver(batch: list[tuple[Job, Event]]) -> None:
        for job, event in batch:
            deliver_event(job, event, limit, cancel)

    def sink(batch: list[tuple[Job, Event]]) -> None:
        # a closed loop (server gone) raises RuntimeError: nobody waits for these events
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(deliver, batch)

    return sink


def deliver_event(job: Job, event: Event, limit: int, cancel: Callable[[Job], None]) -> None:
    """Put ``event`` into ``job``'s mailbox. A mailbox already holding ``limit`` events (a
    streaming client that stopped reading) ends the job: it is cancelled, ``Failed`` is its
    last event and later ones are dropped, so no job holds more than ``limit + 1``."""
    if job.overflowed:
        return
    if job.mailbox.qsize() >= limit:
        job.overflowed = True
        cancel(job)
        job.mailbox.put_nowait(Failed("the client did not read its stream; request cancelled"))
        return
    job.mailbox.put_nowait(event)


class BodyLimit:
    """A request body over ``limit`` bytes is a 413 with OpenAI's error body: at once when its
    Content-Length says so, else as it arrives (raised from ``receive``, answered by the app's
    handler). Starlette's ``RequestBodyLimitMiddleware`` (FastAPI's ``max_body_size``) does the
    same in plain text, which OpenAI clients cannot read."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = Headers(scope=scope).get("content-length", "")
        if length.isdigit() and int(length) > self.limit:
            await _too_large(self.limit)(scope, receive, send)
            return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise StarletteHTTPException(413)
            return message

        await self.app(scope, limited, send)


def _too_large(limit: int) -> Response:
    msg = f"request body over {limit} bytes"
    return _json(error_body(msg, "invalid_request_error", None, "request_too_large"), 413)


_BEARER = HTTPBearer(auto_error=False)


def _authorize(key: str | None) -> Callable[..., Awaitable[None]]:
    """A dependency that refuses a request without ``Authorization: Bearer key`` (none when
    ``key`` is None); the key is compared in constant time."""
    expected = key.encode() if key is not None else None

    async def check(
        creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_BEARER)],
    ) -> None:
        if expected is None:
            return
        given = creds.credentials.encode() if creds is not None else b""
        if not secrets.compare_digest(given, expected):
            raise ApiError(
                401,
                "missing or incorrect API key (send Authorization: Bearer KEY)",
                None,
                "invalid_api_key",
            )

    return check


def _json(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(
        orjson.dumps(obj), status_code=status, media_type="application/json", headers=headers
    )


def _install_errors(app: FastAPI, info: ServeInfo) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_request: Request, exc: ApiError) -> Response:
        return _json(exc.body(), exc.status, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, exc: RequestValidationError) -> Response:
        err = exc.errors()[0]
        if isinstance(bad := err.get("ctx", {}).get("error"), NotEncodable):
            return _json(error_body(str(bad), "invalid_request_error", bad.param), 400)
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        msg = f"{'.'.join(loc) or 'request body'}: {err.get('msg')}"
        return _json(error_body(msg, "invalid_request_error", loc[0] if loc else None), 400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 413:
            return _too_large(info.max_body_bytes)
        return _json(error_body(str(exc.detail), "invalid_request_error"), exc.status_code)

    @app.exception_handler(Exception)
    async def internal(_request: Request, exc: Exception) -> Response:
        log.error("internal error: %s", exc, exc_info=exc)
        return _json(error_body("internal server error", "server_error"), 500)


def _model_card(info: ServeInfo) -> dict[str, Any]:
    return {"id": info.model, "object": "model", "created": info.created, "owned_by": "srl"}


def _check_model(model: str, info: ServeInfo) -> None:
    if model != info.model:
        raise ApiError(
            404,
            f"The model `{model[:100]}` does not exist; this server serves `{info.model}`",
            "model",
            "model_not_found",
        )


def _open_routes(app: FastAPI, core: ServeEngine, info: ServeInfo, feedback: FeedbackOut) -> None:
    """Routes without a key: what load balancers and Prometheus read."""

    @app.get("/health")
    async def health() -> Response:
        h = core.health() | {"model": info.model} | feedback.stats()
        return _json(h, 200 if h["status"] == "ok" else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return metrics_response(core.health() | feedback.stats())


def _model_routes(api: APIRouter, info: ServeInfo) -> None:
    @api.get("/v1/models")
    async def models() -> Response:
        return _json({"object": "list", "data": [_model_card(info)]})

    @api.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        _check_model(model_id, info)
        return _json(_model_card(info))


def _completion_routes(api: APIRouter, core: ServeEngine, info: ServeInfo) -> None:
    @api.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest) -> Response:
        _check_model(body.model, info)
        return await _answer(request, core, info, "completion", body, prompt_of(body))

    @api.post("/v1/chat/completions")
    async def chat(request: Request, body: ChatRequest) -> Response:
        _check_model(body.model, info)
        return await _answer(request, core, info, "chat", body, chat_messages(body))


def _feedback_route(api: APIRouter, info: ServeInfo, out: FeedbackOut) -> None:
    @api.post("/v1/feedback")
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
    request: Request,
    core: ServeEngine,
    info: ServeInfo,
    kind: Kind,
    body: CompletionRequest | ChatRequest,
    prompt: Prompt,
) -> Response:
    s = sampling_of(body, info.default_max_tokens, info.max_n)
    limiter = request.app.state.prepare_limiter
    try:
        ids = await anyio.to_thread.run_sync(
            core.prepare, prompt, kind == "chat", s, limiter=limiter
        )
    except RequestError as e:
        raise ApiError(
            400, user_message(str(e)), "messages" if kind == "chat" else "prompt"
        ) from None
    reply = Reply(kind, new_completion_id(kind), int(time.time()), info.model)
    job = Job(reply.id, kind, ids, s, request_record(body, kind, s), asyncio.Queue())
    try:
        core.submit(job)
    except Busy as e:
        raise ApiError(
            429, f"server busy ({e}); retry later", None, "server_busy", retry_after_s=RETRY_BUSY_S
        ) from None
    except Stopped as e:
        raise ApiError(
            503, str(e), None, "server_unavailable", retry_after_s=RETRY_STOPPED_S
        ) from None
    gone = functools.partial(core.cancel, job)
    first = await _unless_gone(request, job.mailbox.get(), gone)
    if first is None:
        return Response(status_code=CLIENT_GONE)
    if isinstance(first, Overloaded):
        raise ApiError(503, first.message, None, "server_overloaded", retry_after_s=RETRY_BUSY_S)
    if isinstance(first, Failed):
        raise _failed(first)
    assert isinstance(first, Accepted)
    if body.stream:
        with_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = _stream(core, job, reply, first.prompt_tokens, with_usage)
        return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)
    answer = await _unless_gone(request, _collect(core, job, reply, first.prompt_tokens), gone)
    return Response(status_code=CLIENT_GONE) if answer is None else _json(answer)


def _failed(ev: Failed) -> ApiError:
    retry = RETRY_STOPPED_S if ev.status == 503 else None
    return ApiError(ev.status, ev.message, retry_after_s=retry)


async def _unless_gone(
    request: Request, work: Coroutine[Any, Any, T], on_gone: Callable[[], None]
) -> T | None:
    """``await work``, or None once the client has disconnected first (``on_gone()`` is
    called): a request's generation ends with its client, as Starlette's StreamingResponse
    ends a stream's. ``work``'s exception, if it raises, is raised."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
    if task.done() and not task.cancelled():
        return task.result()
    on_gone()
    return None


def _fingerprint(core: ServeEngine, version: int) -> str:
    """Which engine and policy version produced the text."""
    return f"srl-{core.engine.name}-v{version}"


async def _collect(core: ServeEngine, job: Job, reply: Reply, prompt_tokens: int) -> dict[str, Any]:
    n = job.sampling.n
    texts: list[list[str]] = [[] for _ in range(n)]
    logprobs: list[Logprobs] = [None if job.sampling.logprobs is None else [] for _ in range(n)]
    done: dict[int, Finished] = {}
    while len(done) < n:
        ev = await job.mailbox.get()
        if isinstance(ev, Delta | Finished):
            texts[ev.index].append(ev.text)
            if ev.logprobs is not None and (lps := logprobs[ev.index]) is not None:
                lps += ev.logprobs
            if isinstance(ev, Finished):
                done[ev.index] = ev
        elif isinstance(ev, Failed):
            raise _failed(ev)
    choices = [("".join(texts[i]), done[i].reason, logprobs[i]) for i in range(n)]
    use = usage(prompt_tokens, sum(d.tokens for d in done.values()))
    version = max(d.version for d in done.values())
    return reply.body(choices, use, _fingerprint(core, version))


async def _stream(
    core: ServeEngine, job: Job, reply: Reply, prompt_tokens: int, with_usage: bool
) -> AsyncGenerator[bytes, None]:
    """Server-sent events of one job: chunks as the engine produces them, then ``[DONE]``."""
    chat = reply.kind == "chat"
    left, tokens, version = job.sampling.n, 0, core.engine.version
    offsets = [0] * left  # completions' text_offset of each choice's next token

    def piece(ev: Delta | Finished, fp: str, reason: str | None = None) -> bytes:
        offset = offsets[ev.index]
        offsets[ev.index] += sum(len(t.token) for t in ev.logprobs or ())
        chunk = reply.chunk(ev.index, ev.text, reason, fp, logprobs=ev.logprobs, offset=offset)
        return sse(chunk)

    try:
        if chat:  # OpenAI opens every chat choice with the assistant role
            for i in range(left):
                yield sse(reply.chunk(i, "", None, _fingerprint(core, version), role=True))
        while left:
            ev = await job.mailbox.get()
            if isinstance(ev, Delta):
                yield piece(ev, _fingerprint(core, version))
            elif isinstance(ev, Finished):
                left, tokens, version = left - 1, tokens + ev.tokens, ev.version
                fp = _fingerprint(core, version)
                if not chat:
                    yield piece(ev, fp, ev.reason)
                    continue
                if ev.text or ev.logprobs:
                    yield piece(ev, fp)
                yield sse(reply.chunk(ev.index, "", ev.reason, fp))
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
