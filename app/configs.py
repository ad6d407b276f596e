"""Settings of the app layer's own commands: ``srl top``, ``srl smoke``, ``srl bench
dataplane``, ``srl-producer bench``, ``srl serve`` and ``srl bench serve``.

Each class is composed of the shared groups of :mod:`srl.config` that its command reads, and
nothing else, so its generated CLI options (``app/cli/options.py``) are exactly the command's.
The roles' configs live beside the roles (``producers/config.py``, ``consumers/config.py``,
``ranker/config.py``); ``srl demo``'s is ``app.demoplan.DemoConfig``.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field, model_validator

from producers.config import ChatSettings, EngineSettings, VLLMSettings
from srl.config import (
    NAME_PATTERN,
    CommonConfig,
    ProducerSettings,
    RegistrySettings,
    RunStoreConfig,
    TopicsConfig,
    cli,
)
from srl.errors import ConfigError


class TopConfig(TopicsConfig, RunStoreConfig, RegistrySettings):
    """``srl top``: reads every topic and group, the run's weights pointer and its manifest."""


class StreamConfig(ProducerSettings, TopicsConfig, RegistrySettings):
    """``srl smoke`` and ``srl bench dataplane``: records through the broker and the codec, on
    a layout's topics (no run, no store)."""


class EngineBenchConfig(
    ProducerSettings, TopicsConfig, RegistrySettings, EngineSettings, VLLMSettings
):
    """``srl-producer bench``: an engine's tokens/s, alone and publishing chunks, and its
    weight-swap pause. Reads the ``[generate]`` table, so a generator's engine settings
    apply."""

    section: ClassVar[str] = "generate"

    max_batch: int = Field(
        16,
        ge=1,
        le=65_536,
        description="The large batch: most sequences decoded together (continuous batching).",
    )
    engines: tuple[Literal["hf", "sim", "vllm"], ...] = Field(
        (),
        description="Engines to measure side by side, one after the other in this run on the "
        "same requests, model and broker (e.g. hf,vllm); empty: engine.",
    )


class ServeConfig(CommonConfig, EngineSettings, VLLMSettings, ChatSettings):
    """``srl serve``: one engine (the generator's: hf, sim, vllm, built by
    ``producers.engines.make_engine`` from these same engine settings) behind an
    OpenAI-compatible HTTP API. docs/serving.md explains each setting."""

    section: ClassVar[str] = "serve"

    host: str = Field(
        "127.0.0.1",
        description="Address to listen on (loopback by default; any other address needs "
        "--api-key).",
    )
    port: int = Field(8000, ge=0, le=65535, description="TCP port; 0: any free port.")
    model_name: str | None = Field(
        None,
        description="Model id clients send and /v1/models lists; null: the model directory's name "
        "(sim: 'sim').",
    )
    follow_run: str | None = Field(
        None,
        pattern=NAME_PATTERN,
        description="The run whose weights are served (the lead, when several trainers learn "
        "from the served traffic); null: run.",
    )
    publish: bool = Field(
        True,
        description="Publish every served completion, chunk by chunk, to {prefix}.trajectories "
        "(false: serve only, e.g. to measure what publishing costs).",
    )
    worker_id: str | None = Field(
        None, description="Id on published chunks and metrics; null: host-pid-serve."
    )
    default_max_tokens: int = Field(
        256, ge=1, le=1_000_000, description="max_tokens of a request that gives none."
    )
    max_n: int = Field(16, ge=1, le=1024, description="Most choices (n) one request may ask for.")
    max_pending: int = Field(
        1024,
        ge=1,
        description="Most choices running or waiting; a request beyond it gets 429 (retry later).",
    )
    stats_interval_s: float = Field(
        5.0, gt=0, description="How often serve_stats metric events are emitted."
    )
    drain_timeout_s: float = Field(
        30.0,
        ge=0,
        description="On SIGTERM: how long running requests may finish before the server closes.",
        json_schema_extra=cli("--drain-timeout"),
    )
    api_key: str | None = Field(
        None,
        min_length=1,
        description="Key every /v1 request must send (Authorization: Bearer KEY); required "
        "unless the host is a loopback address; null: no key (/health and /metrics are open).",
    )
    feedback_api_key: str | None = Field(
        None,
        min_length=1,
        description="A separate key for POST /v1/feedback (whoever holds it sets rewards); null: "
        "api_key.",
    )
    max_body_bytes: int = Field(
        4 * 1024 * 1024, ge=1024, description="Largest request body; a larger one gets 413."
    )
    max_queue_wait_s: float = Field(
        60.0,
        gt=0,
        description="Longest a request waits for a batch slot; then 503 with Retry-After.",
    )
    max_request_slots: int | None = Field(
        None,
        ge=1,
        description="Most batch slots one request's choices hold while other requests wait "
        "(fair share; alone a request may use the whole batch); null: half of max_batch.",
    )

    @model_validator(mode="after")
    def _engine_needs(self) -> ServeConfig:
        if self.engine in ("hf", "vllm") and not self.model:
            raise ConfigError(f"engine {self.engine} needs --model DIR (policy version 0)")
        if self.api_key is None and not _loopback(self.host):
            raise ConfigError(
                f"host {self.host} is not a loopback address: set --api-key (or SRL_API_KEY) so "
                "that only your clients can send prompts and rewards"
            )
        return self

    @property
    def served_model(self) -> str:
        """The model id of the API."""
        if self.model_name:
            return self.model_name
        return Path(self.model).name if self.model else self.engine

    @property
    def weights_run(self) -> str:
        """The run whose weights are served."""
        return self.follow_run or self.run

    @property
    def worker_name(self) -> str:
        return self.worker_id or f"{socket.gethostname()}-{os.getpid()}-serve"


def _loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class ServeBenchConfig(ProducerSettings, TopicsConfig, EngineSettings):
    """``srl bench serve``: the engine and Kafka settings handed to each ``srl serve`` it starts
    (publishing off, then on); the sim engine by default."""

    section: ClassVar[str] = "serve"

    engine: Literal["hf", "sim", "vllm"] = Field(
        "sim",
        description="Generation backend; sim: modelled decode time, so the figure is the "
        "server's and the data plane's.",
    )
    max_batch: int = Field(
        16, ge=1, le=65_536, description="Most sequences decoded together (continuous batching)."
    )
    seed: int | None = Field(0, description="Sampling seed of the servers' engines.")

    @model_validator(mode="after")
    def _engine_needs(self) -> ServeBenchConfig:
        if self.engine in ("hf", "vllm") and not self.model:
            raise ConfigError(f"--engine {self.engine} needs --model DIR")
        return self
