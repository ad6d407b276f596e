"""Which wire framing this process's records use: Avro single-object encoding, or Confluent
Schema Registry framing when the config names a registry (``schema_registry_url``).

Every role applies its own config at start (``run_generator``, ``run_trainer``,
``run_dispatcher``, ``run_online``) and so does every command, so a role started from Python
frames its records as its config says, not as whichever command ran first in the process.
Decoding reads both framings either way (``schemas.codec``).
"""

from __future__ import annotations

from schemas.codec import Codec
from schemas.records import set_default_codec
from schemas.registry import HttpRegistry
from srl.config import RegistrySettings


def use_schema_registry(cfg: RegistrySettings) -> None:
    """Records encoded from now on use ``cfg``'s registry, if it names one."""
    if cfg.schema_registry_url:
        set_default_codec(Codec(registry=HttpRegistry(cfg.schema_registry_url)))
