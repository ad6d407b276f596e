"""``srl serve``: the OpenAI-compatible server (app/serve/, docs/serving.md).

The command's options are generated from :class:`~app.configs.ServeConfig`; it calls
``app.serve.run.run_serve``. uvicorn, torch and the engines are imported inside the command,
so ``srl --help`` answers at once. Registered on the umbrella CLI by ``app/cli/main.py``.
"""

from __future__ import annotations

import signal
import threading
from typing import TYPE_CHECKING, Any

import click

from app.cli.options import ConfigCommand, with_config

if TYPE_CHECKING:
    from app.configs import ServeConfig


@click.command(cls=ConfigCommand)
@with_config("app.configs:ServeConfig")
def serve(cfg: ServeConfig) -> None:
    """Serve the policy over the OpenAI API; every completion is also published as training data.

    POST /v1/completions and /v1/chat/completions (stream, n, max_tokens, temperature, top_p,
    stop, seed, logprobs), GET /v1/models, POST /v1/feedback, GET /health, GET /metrics. The
    engine follows the run's newest verified weights; each served choice goes chunk by chunk
    to {prefix}.trajectories like dispatched work (metadata source "serve"); a slow or absent
    broker costs training data (counted), never answers. Point an OpenAI client at
    http://HOST:PORT/v1 (its api_key: --api-key, required off loopback). SIGTERM or Ctrl-C lets
    running requests finish (--drain-timeout), then exits. See docs/serving.md.
    """
    from app.serve.run import run_serve

    stop = _note_signals()
    summary = run_serve(cfg, announce=lambda line: click.echo(line), stop=stop)
    click.echo(summary.line(), err=True)


def _note_signals() -> threading.Event:
    """Handlers that only take note. While it serves, uvicorn has its own (graceful shutdown)
    and re-raises the signal it caught afterwards: these keep that from killing the process
    before the producer is flushed; one that comes while the model loads stops the server as
    soon as it starts."""
    stop = threading.Event()

    def noted(_signum: int, _frame: Any) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, noted)
    signal.signal(signal.SIGINT, noted)
    return stop
