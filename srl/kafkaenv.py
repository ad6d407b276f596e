"""librdkafka settings as text: how ``SRL_KAFKA`` splits, ``SRL_KAFKA_<NAME>``, TOML values.

``srl.config`` reads every command's settings; this is the part that is about librdkafka's
(docs/security.md, "Client settings"):

* ``split_settings``: ``SRL_KAFKA``'s items, split only at a comma that a setting name and
  ``=`` follow (one per line also works), so a value may hold commas;
* ``kafka_from_environment``: one variable per setting, ``SRL_KAFKA_SASL_PASSWORD`` for
  ``sasl.password``, the value verbatim;
* ``settings_as_strings``: a ``[kafka]`` table's numbers and booleans as librdkafka spells them.

Pure; nothing here names a value in an error (it may be a secret).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

# SRL_KAFKA splits at a comma only where a setting name and '=' follow (librdkafka's names are
# lower case and dotted), so a value may hold commas: Confluent Cloud's OAuth extensions
# (logicalCluster=lkc-1,identityPoolId=pool-2), a password. A value with such a comma goes in
# SRL_KAFKA_<NAME> or a file (@FILE), or SRL_KAFKA holds one setting per line.
_NEXT_SETTING = re.compile(r",(?=\s*[a-z][a-z0-9_]*(?:\.[a-z0-9_-]+)*\s*=)")


def split_settings(raw: str) -> list[str]:
    """``SRL_KAFKA``'s ``key=value`` items: one per line if it has several lines, else split at
    the commas that a setting name and ``=`` follow."""
    parts = raw.splitlines() if "\n" in raw.strip() else _NEXT_SETTING.split(raw)
    return [p for p in parts if p.strip()]


# SRL_KAFKA_<NAME> sets the librdkafka setting <name> (lower case, '_' for '.'), e.g.
# SRL_KAFKA_SASL_PASSWORD: sasl.password, the whole value verbatim. Not these, srl's own:
SRL_KAFKA_OWN = frozenset({"DEBUG", "QUIET", "JVM_OPTS", "CACHE"})


def kafka_from_environment(environ: Mapping[str, str], fields: set[str]) -> dict[str, str]:
    """The librdkafka settings of the ``SRL_KAFKA_<NAME>`` variables (not a field's own
    variable such as ``SRL_KAFKA_OAUTH_CB``, not :data:`SRL_KAFKA_OWN`)."""
    out: dict[str, str] = {}
    for var, value in sorted(environ.items()):
        if not var.startswith("SRL_KAFKA_"):
            continue
        name = var[len("SRL_KAFKA_") :]
        if not name or name in SRL_KAFKA_OWN or f"kafka_{name.lower()}" in fields:
            continue
        out[name.lower().replace("_", ".")] = value
    return out


def settings_as_strings(v: Any) -> Any:
    """A TOML ``[kafka]`` table may hold numbers and booleans (``"linger.ms" = 5``): as
    librdkafka spells them. Anything else is refused naming the key, never its value."""
    if not isinstance(v, dict):
        return v
    out: dict[str, str] = {}
    for key, value in v.items():
        if isinstance(value, bool):
            out[str(key)] = "true" if value else "false"
        elif isinstance(value, int | float | str):
            out[str(key)] = str(value)
        else:
            raise ValueError(f"{key}: a string, number or boolean, not {type(value).__name__}")
    return out
