"""Settings of the app layer's own commands: ``srl top``, ``srl smoke``, ``srl bench
dataplane`` and ``srl-producer bench``.

Each class is composed of the shared groups of :mod:`srl.config` that its command reads, and
nothing else, so its generated CLI options (``app/cli/options.py``) are exactly the command's.
The roles' configs live beside the roles (``producers/config.py``, ``consumers/config.py``,
``ranker/config.py``); ``srl demo``'s is ``app.demoplan.DemoConfig``.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from producers.config import EngineSettings
from srl.config import ProducerSettings, RegistrySettings, RunStoreConfig, TopicsConfig


class TopConfig(TopicsConfig, RunStoreConfig, RegistrySettings):
    """``srl top``: reads every topic and group, the run's weights pointer and its manifest."""


class StreamConfig(ProducerSettings, TopicsConfig, RegistrySettings):
    """``srl smoke`` and ``srl bench dataplane``: records through the broker and the codec, on
    a layout's topics (no run, no store)."""


class EngineBenchConfig(ProducerSettings, TopicsConfig, RegistrySettings, EngineSettings):
    """``srl-producer bench``: an engine's tokens/s, alone and publishing chunks. Reads the
    ``[generate]`` table, so a generator's engine settings apply."""

    section: ClassVar[str] = "generate"

    max_batch: int = Field(
        16,
        ge=1,
        le=65_536,
        description="The large batch: most sequences decoded together (continuous batching).",
    )
