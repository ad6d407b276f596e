"""ACLs on the cluster: the grants of ``srl.acls`` created for a principal, and listed back.

For an admin that sets a deployment up from Python (the secured-cluster test does: each of its
principals gets exactly its role's grants); ``srl topics plan --format acls`` prints the same
grants as ``kafka-acls.sh`` commands instead. Needs Alter on the cluster (a super user).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from confluent_kafka.admin import (
    AclBinding,
    AclBindingFilter,
    AclOperation,
    AclPermissionType,
    ResourcePatternType,
    ResourceType,
)

from srl.acls import Grant
from srl.config import KafkaSettings
from srl.kafka.admin import admin

_RESOURCE = {"topic": ResourceType.TOPIC, "group": ResourceType.GROUP}
_PATTERN = {"literal": ResourcePatternType.LITERAL, "prefixed": ResourcePatternType.PREFIXED}
_CLUSTER = "kafka-cluster"  # the one cluster resource's name


def _operation(name: str) -> AclOperation:
    """Kafka's operation ``name`` (``Read``, ``DescribeConfigs`` …) as the client's enum."""
    snake = "".join(f"_{c}" if c.isupper() and i else c for i, c in enumerate(name)).upper()
    return AclOperation[snake]


def bindings(grants: Sequence[Grant], principal: str, host: str = "*") -> list[AclBinding]:
    """One allow binding per operation of each grant, for ``principal`` (``User:NAME``)."""
    out = []
    for g in grants:
        if g.resource == "cluster":
            kind, name, pattern = ResourceType.BROKER, _CLUSTER, ResourcePatternType.LITERAL
        else:
            kind, name, pattern = _RESOURCE[g.resource], g.name, _PATTERN[g.pattern]
        for op in g.operations:
            out.append(
                AclBinding(
                    kind, name, pattern, principal, host, _operation(op), AclPermissionType.ALLOW
                )
            )
    return out


def create_acls(cfg: KafkaSettings, grants: Sequence[Grant], principal: str) -> int:
    """Create ``principal``'s bindings of ``grants``; returns how many."""
    new = bindings(grants, principal)
    client = admin(cfg)
    for fut in client.create_acls(new, request_timeout=cfg.connect_timeout_s).values():
        fut.result()
    return len(new)


def list_acls(cfg: KafkaSettings, principal: str | None = None) -> list[str]:
    """Every ACL on the cluster (of ``principal`` only, when given), one line each."""
    anything: Any = None  # a filter's "any" (the stubs say str)
    flt = AclBindingFilter(
        ResourceType.ANY,
        anything,
        ResourcePatternType.ANY,
        principal if principal is not None else anything,
        anything,
        AclOperation.ANY,
        AclPermissionType.ANY,
    )
    client = admin(cfg)
    found = client.describe_acls(flt, request_timeout=cfg.connect_timeout_s).result()
    return sorted(
        f"{b.principal} {b.permission_type.name} {b.operation.name} "
        f"{b.restype.name}:{b.resource_pattern_type.name}:{b.name}"
        for b in found
    )
