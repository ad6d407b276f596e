"""User-facing errors. The CLIs print ``str(e)`` on one line and exit non-zero; anything
that is not an ``SrlError`` (or a ``SchemaError``, which ``schemas`` owns) is a bug and keeps
its traceback."""

from __future__ import annotations

from schemas.errors import SchemaError

__all__ = [
    "AccessDenied",
    "BrokerUnavailable",
    "ConfigError",
    "ProducerFailed",
    "SchemaError",
    "SrlError",
    "StartOver",
    "ConsumerFailed",
    "StoreError",
    "WeightsError",
]


class SrlError(Exception):
    """An error the user can act on; its message is one line."""

    exit_code = 1


class ConfigError(SrlError):
    """A bad configuration value, file or option."""

    exit_code = 2


class BrokerUnavailable(SrlError):
    """No Kafka broker answered in time."""


class AccessDenied(SrlError):
    """The cluster refused this client something an ACL would allow: reading or writing a
    topic, joining or reading a consumer group (docs/security.md lists each role's ACLs)."""


class StartOver(SrlError):
    """The role must start over from what is durable, as a restart would; a role whose state
    is all in Kafka and the store does so in its own process (``srl.kafka.start_over``)."""


class ProducerFailed(StartOver):
    """A producer librdkafka declared failed for good (a fatal error): a broker that lost
    records it had acknowledged (a SIGKILLed embedded broker), or a fenced producer. Its
    owner starts over with a new producer, from what is durable."""


class ConsumerFailed(StartOver):
    """A group member librdkafka declared failed for good (a fatal error): a static member
    fenced by its own ``group.instance.id`` when its group's coordinator moved (a Kafka node
    lost) and its rejoin raced its commit. Its owner starts over with a new member."""


class StoreError(SrlError):
    """The object store refused or lost something."""


class WeightsError(SrlError):
    """A weights version is missing, corrupt or out of order."""
