"""``srl serve``: build the engine, the weight follower and the publisher, then run uvicorn.

Owns the process: what is opened in which order and closed in the reverse order. What must
hold:

* the engine is ``producers.engines.make_engine`` on the same settings as a generator worker,
  and its weights follow ``{prefix}.weights`` of ``--run`` through the same
  ``WeightFollower`` (verified versions only);
* with publishing on, the trajectories topic exists before the first request (topics are
  created if missing) and the producer is flushed after the last one; delivery failures and
  dropped trajectories are counted while serving (a broker that goes away costs training
  data, never an answer) and the final flush raises if any record is still undelivered, so
  the command exits non-zero and says so;
* with publishing off the server opens no Kafka client at all: no broker is needed, no
  weights are followed (it serves ``--model``'s own, version 0), no metric events are sent;
* the server listens on ``host:port`` (loopback by default; another address only with an API
  key, which the config checks); SIGTERM/SIGINT stop accepting
  connections, running requests get ``drain_timeout_s`` to finish, then the engine thread
  stops (anything still open is closed in the log as ``abort``);
* an engine failure stops the server and is raised here (one line in the CLI).

Called by ``app.cli.serve``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

from app.configs import ServeConfig
from app.serve.core import ServeEngine
from app.serve.feedback import FeedbackOut
from app.serve.http import ServeInfo, create_app
from app.serve.publish import Lossy, Publisher
from app.serve.text import codec_for
from producers.engines import make_engine
from producers.follower import WeightFollower
from srl.errors import SrlError
from srl.kafka import Producer, ensure_topics
from srl.metrics import Metrics
from srl.stores import store_from_config
from srl.topics import Layout

log = logging.getLogger("srl.serve")
KEEP_ALIVE_S = 65  # idle keep-alive connections are closed after this long


@dataclass
class ServeSummary:
    model: str
    engine: str
    simulated: bool
    url: str
    publish: bool
    stats: dict[str, Any]
    published_chunks: int

    def line(self) -> str:
        s = self.stats
        return (
            f"srl serve: {s['requests']} requests, {s['completions']} completions, "
            f"{s['tokens']} tokens, {self.published_chunks} chunks published, "
            f"{s['publish_dropped']} trajectories not published, "
            f"{s['delivery_failures']} delivery failures"
        )


def bind(host: str, port: int) -> socket.socket:
    """The listening socket (bound here, so port 0 gets a real port we can print)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise SrlError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def run_serve(
    cfg: ServeConfig, announce: Any = print, stop: threading.Event | None = None
) -> ServeSummary:
    """Serve until SIGTERM/SIGINT; ``announce`` gets one line once the server answers.

    ``stop`` already set (a signal while the model loaded): start, then shut down at once."""
    import uvicorn

    engine = make_engine(cfg)
    layout = Layout.from_config(cfg)
    with contextlib.ExitStack() as stack:
        producer, follower, metrics = _kafka(cfg, layout, stack) if cfg.publish else (None,) * 3
        publisher = Publisher(producer, layout, cfg.chunk_tokens, cfg.worker_name)
        core = ServeEngine(
            engine,
            codec_for(engine, cfg.chat_template, cfg.system_prompt),
            publisher,
            follower,
            metrics,
            cfg.max_pending,
            cfg.stats_interval_s,
            cfg.max_queue_wait_s,
            cfg.max_request_slots,
        )
        sock = bind(cfg.host, cfg.port)
        stack.callback(sock.close)
        host, port = sock.getsockname()[:2]
        url = f"http://{host}:{port}/v1"
        info = ServeInfo(
            cfg.served_model,
            cfg.default_max_tokens,
            cfg.max_n,
            int(time.time()),
            api_key=cfg.api_key,
            feedback_api_key=cfg.feedback_api_key,
            max_body_bytes=cfg.max_body_bytes,
        )
        where = f"{layout.trajectories}" if cfg.publish else "nowhere (--no-publish)"
        key = "API key required" if cfg.api_key else "no API key"
        line = (
            f"srl serve: {url} (model {info.model}, engine {engine.name}"
            f"{' SIMULATED' if engine.simulated else ''}, publishing to {where}, {key})"
        )
        out = FeedbackOut(producer, layout, cfg.worker_name, cfg.connect_timeout_s)
        app = create_app(core, info, on_start=lambda: announce(line), feedback=out)
        server = uvicorn.Server(_uvicorn_config(app, cfg))
        core.on_failure = lambda: setattr(server, "should_exit", True)
        server.should_exit = stop is not None and stop.is_set()
        server.run(sockets=[sock])
        if core.error is not None:
            raise SrlError(f"serve engine failed: {core.error}") from core.error
    return ServeSummary(
        info.model,
        engine.name,
        engine.simulated,
        url,
        cfg.publish,
        core.stats.to_dict(),
        publisher.chunks,
    )


def _kafka(
    cfg: ServeConfig, layout: Layout, stack: contextlib.ExitStack
) -> tuple[Producer, WeightFollower, Metrics]:
    """Publishing's Kafka side, closed by ``stack``: topics created, the producer (flushed on
    exit), the weight follower and the metric events."""
    names = [layout.trajectories, layout.feedback, layout.weights, layout.metrics, layout.dlq]
    ensure_topics(cfg, names, "serve")
    producer = stack.enter_context(Producer(cfg, "serve"))
    producer.warm([layout.trajectories])
    follower = WeightFollower(cfg, layout, store_from_config(cfg), run=cfg.weights_run).start()
    stack.callback(follower.stop)
    # the engine thread's metric events and dead letters never wait for the broker
    metrics = Metrics(Lossy(producer), layout, cfg.run, cfg.worker_name)  # type: ignore[arg-type]
    return producer, follower, metrics


def _uvicorn_config(app: Any, cfg: ServeConfig) -> Any:
    import uvicorn

    verbose = logging.getLogger("srl").getEffectiveLevel() <= logging.DEBUG
    return uvicorn.Config(
        app,
        log_config=None,  # srl's logging (app.cli.common.setup_logging) stays in charge
        access_log=verbose,
        timeout_graceful_shutdown=math.ceil(cfg.drain_timeout_s),  # uvicorn takes whole seconds
        # longer than clients keep idle connections (httpx, so the openai client: 5 s), so a
        # client never sends a request on a connection the server is closing at that moment
        timeout_keep_alive=KEEP_ALIVE_S,
        lifespan="on",
    )
