"""Secrets in librdkafka settings: which keys hold one, reading ``@FILE`` values, redaction.

What must hold: a secret (``sasl.password``, ``ssl.key.password``, an OAuth client secret, a
private key, anything whose name says password, secret, token or credential) never reaches
an error message, a log line, a file srl writes or a child's command line. So:

* :func:`redact` shows a settings dict with every secret's value replaced (an ``@FILE``
  reference is a path, not a secret: it stays);
* :func:`resolve` reads ``@FILE`` values where a client is made, so a secret given as a file
  lives only in the client's memory (``@@x`` is the literal ``@x``); every secret value it
  sees is remembered, and :class:`Scrubber` (a logging filter on the handlers
  ``app.cli.common.setup_logging`` installs) and :func:`scrub` replace them in any text;
* :func:`secret_environment` hands secrets to a child process as ``SRL_KAFKA_<NAME>``
  variables instead of ``-X`` arguments (the environment of a process is readable by its user
  only, its command line by everyone).

Pure: no Kafka client here (``srl.kafka`` makes the clients).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from pathlib import Path

from srl.errors import ConfigError

REDACTED = "[redacted]"
SECRET_WORDS = ("password", "secret", "token", "credential", "jaas", "key.pem", "private.key")
SECRET_KEYS = frozenset({"sasl.oauthbearer.config", "sasl.oauthbearer.extensions", "ssl_key"})

_seen: set[str] = set()
_lock = threading.Lock()


def is_secret(key: str) -> bool:
    """Whether the librdkafka setting ``key`` holds a secret."""
    k = key.strip().lower()
    return k in SECRET_KEYS or any(w in k for w in SECRET_WORDS)


def is_file_ref(value: str) -> bool:
    return value.startswith("@") and not value.startswith("@@")


def redact(settings: Mapping[str, object]) -> dict[str, str]:
    """``settings`` as text, each secret's value replaced by ``[redacted]`` (``@FILE`` kept)."""
    out: dict[str, str] = {}
    for k, v in settings.items():
        text = str(v)
        out[k] = REDACTED if is_secret(k) and not is_file_ref(text) else text
    return out


def remember(value: str) -> None:
    """Scrub ``value`` from every log line and message from now on."""
    if len(value) >= 4:  # a shorter one would scrub ordinary words
        with _lock:
            _seen.add(value)


def resolve(settings: Mapping[str, str]) -> dict[str, str]:
    """``settings`` with each ``@FILE`` value replaced by the file's text (one trailing newline
    dropped) and ``@@x`` by ``@x``; secret values are remembered (:func:`remember`). A file
    that cannot be read is a ConfigError naming the key and the file."""
    out: dict[str, str] = {}
    for k, v in settings.items():
        if is_file_ref(v):
            path = Path(v[1:]).expanduser()
            try:
                v = path.read_text().removesuffix("\n")
            except OSError as e:
                raise ConfigError(
                    f"kafka setting {k}: cannot read {path}: {e.strerror or e}"
                ) from None
        elif v.startswith("@@"):
            v = v[1:]
        if is_secret(k):
            remember(v)
        out[k] = v
    return out


def scrub(text: str) -> str:
    """``text`` with every remembered secret replaced by ``[redacted]``."""
    with _lock:
        seen = sorted(_seen, key=len, reverse=True)
    for s in seen:
        if s in text:
            text = text.replace(s, REDACTED)
    return text


class Scrubber(logging.Filter):
    """A logging filter that scrubs remembered secrets from each record's final message."""

    def filter(self, record: logging.LogRecord) -> bool:
        if _seen:
            message = record.getMessage()
            clean = scrub(message)
            if clean != message:
                record.msg, record.args = clean, None
        return True


def secret_environment(settings: Mapping[str, str]) -> dict[str, str]:
    """The secrets of ``settings`` as ``SRL_KAFKA_<NAME>`` variables (``sasl.password`` →
    ``SRL_KAFKA_SASL_PASSWORD``): how srl hands them to a child process."""
    return {env_name(k): v for k, v in settings.items() if is_secret(k)}


def env_name(key: str) -> str:
    """The ``SRL_KAFKA_<NAME>`` variable of the librdkafka setting ``key``."""
    return "SRL_KAFKA_" + key.upper().replace(".", "_")
