"""User-facing errors. The CLIs print ``str(e)`` on one line and exit non-zero; anything
that is not an ``SrlError`` is a bug and keeps its traceback."""

from __future__ import annotations


class SrlError(Exception):
    """An error the user can act on; its message is one line."""

    exit_code = 1


class ConfigError(SrlError):
    """A bad configuration value, file or option."""

    exit_code = 2


class BrokerUnavailable(SrlError):
    """No Kafka broker answered in time."""


class StoreError(SrlError):
    """The object store refused or lost something."""


class WeightsError(SrlError):
    """A weights version is missing, corrupt or out of order."""


class SchemaError(SrlError, ValueError):
    """A record could not be encoded or decoded (``schemas.codec``). The message is one line."""
