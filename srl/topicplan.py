"""The layout on paper, and a cluster's topics held against it.

* ``plan_json`` / ``kafka_topics_commands`` / ``strimzi_yaml`` / ``kafka_acls_commands``: what
  ``srl topics plan`` prints, for a platform team that creates the topics (and the ACLs)
  itself: every topic of the layout with its partitions, replication, ``min.insync.replicas``
  and configs, as JSON, as ``kafka-topics.sh --create`` commands, as Strimzi ``KafkaTopic``
  resources, and each role's ACLs (``srl.acls``) as ``kafka-acls.sh --add`` commands;
* ``Found`` / ``problems``: one topic as a cluster has it, and what is wrong with it for the
  layout: too few or too many partitions (a generator's bucket would have no partition, or
  chunks would go where no reader looks), another replication factor or
  ``min.insync.replicas`` than the settings ask for (or 1 replica on a cluster of several
  nodes, when they ask nothing), a cleanup policy or retention other than the layout's.
  ``srl topics check`` prints them; roles refuse a layout whose partitions differ
  (``srl.kafka.topiccheck``).

Pure: no Kafka client here.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from srl import acls
from srl.acls import Grant
from srl.topics import Layout, TopicSpec

Severity = Literal["error", "warning"]


def topic_config(spec: TopicSpec, min_insync: int | None) -> dict[str, str]:
    """The configs a topic is created with: the layout's, and ``min.insync.replicas``."""
    extra = {"min.insync.replicas": str(min_insync)} if min_insync is not None else {}
    return {**spec.config, **extra}


def plan_json(
    specs: Sequence[TopicSpec], replication: int | None, min_insync: int | None
) -> list[dict[str, Any]]:
    """One object per topic: name, partitions, replication factor (null: the broker's), configs."""
    return [
        {
            "topic": s.name,
            "partitions": s.partitions,
            "replication_factor": replication,
            "config": topic_config(s, min_insync),
        }
        for s in specs
    ]


def kafka_topics_commands(
    specs: Sequence[TopicSpec], bootstrap: str, replication: int | None, min_insync: int | None
) -> list[str]:
    """``kafka-topics.sh --create`` per topic (add ``--command-config FILE`` on a secured
    cluster: the client settings of Kafka's tools)."""
    out = []
    for s in specs:
        args = ["kafka-topics.sh", "--bootstrap-server", bootstrap, "--create", "--if-not-exists"]
        args += ["--topic", s.name, "--partitions", str(s.partitions)]
        if replication is not None:
            args += ["--replication-factor", str(replication)]
        for k, v in topic_config(s, min_insync).items():
            args += ["--config", f"{k}={v}"]
        out.append(shlex.join(args))
    return out


def strimzi_yaml(
    specs: Sequence[TopicSpec], cluster: str, replication: int | None, min_insync: int | None
) -> str:
    """Strimzi ``KafkaTopic`` resources (``kafka.strimzi.io/v1beta2``) for the cluster named
    ``cluster`` (its ``strimzi.io/cluster`` label). Strimzi needs a replication factor:
    without one, 3."""
    docs = []
    for s in specs:
        lines = [
            "apiVersion: kafka.strimzi.io/v1beta2",
            "kind: KafkaTopic",
            "metadata:",
            f"  name: {_k8s_name(s.name)}",
            "  labels:",
            f"    strimzi.io/cluster: {cluster}",
            "spec:",
            f"  topicName: {s.name}",
            f"  partitions: {s.partitions}",
            f"  replicas: {replication or 3}",
        ]
        config = topic_config(s, min_insync)
        if config:
            lines.append("  config:")
            lines += [f'    {k}: "{v}"' for k, v in config.items()]
        docs.append("\n".join(lines))
    return "---\n" + "\n---\n".join(docs) + "\n"


def _k8s_name(topic: str) -> str:
    """A Kubernetes resource name for ``topic`` (lower case, dots and dashes only)."""
    return "".join(c if c.isalnum() or c in ".-" else "-" for c in topic.lower()).strip(".-")


def kafka_acls_commands(grants: Sequence[Grant], principal: str, bootstrap: str) -> list[str]:
    """``kafka-acls.sh --add`` per grant of one principal (``User:NAME``)."""
    out = []
    for g in grants:
        args = ["kafka-acls.sh", "--bootstrap-server", bootstrap, "--add"]
        args += ["--allow-principal", principal]
        for op in g.operations:
            args += ["--operation", op]
        if g.resource == "cluster":
            args += ["--cluster"]
        else:
            args += [f"--{g.resource}", g.name, "--resource-pattern-type", g.pattern]
        out.append(shlex.join(args))
    return out


def acl_commands(
    layout: Layout,
    bootstrap: str,
    run: str,
    pools: Sequence[str],
    principals: Mapping[str, str],
) -> list[str]:
    """Every role's ACLs (``srl.acls``; a generator's for each of ``pools``) as ``kafka-acls.sh``
    commands, under a ``# role`` line; ``principals`` maps a role to its principal (default
    ``User:srl-ROLE``)."""
    out: list[str] = []
    for role in acls.ROLES:
        per_pool = [acls.grants(role, layout, run, pool) for pool in pools]
        kept = per_pool if role == "generator" else per_pool[:1]
        grants = list(dict.fromkeys(g for gs in kept for g in gs))
        out.append(f"# {role}")
        out += kafka_acls_commands(grants, principals.get(role, f"User:srl-{role}"), bootstrap)
    return out


@dataclass(frozen=True)
class Found:
    """One topic as the cluster has it. ``error``: ``missing``, ``denied`` (no Describe) or
    the broker's message; ``configs`` only where they were asked for."""

    name: str
    partitions: int = 0
    replicas: int = 0
    error: str | None = None
    configs: dict[str, str] | None = None


def problems(
    spec: TopicSpec,
    found: Found,
    replication: int | None = None,
    min_insync: int | None = None,
    brokers: int = 1,
) -> list[tuple[Severity, str]]:
    """What is wrong with ``found`` for ``spec`` (nothing: an empty list)."""
    name, out = spec.name, list[tuple[Severity, str]]()
    if found.partitions != spec.partitions:
        word = "fewer" if found.partitions < spec.partitions else "more"
        out.append(
            (
                "error",
                f"topic {name} has {found.partitions} partitions, {word} than the layout's "
                f"{spec.partitions}",
            )
        )
    if replication is not None and found.replicas != replication:
        out.append(("error", f"topic {name} has {found.replicas} replicas, not {replication}"))
    elif replication is None and found.replicas == 1 and brokers > 1:
        out.append(
            (
                "warning",
                f"topic {name} has 1 replica on a cluster of {brokers} brokers "
                "(set replication_factor)",
            )
        )
    if found.configs is not None:
        out += _config_problems(spec, found.configs, min_insync)
    return out


def _config_problems(
    spec: TopicSpec, configs: dict[str, str], min_insync: int | None
) -> list[tuple[Severity, str]]:
    name, out = spec.name, list[tuple[Severity, str]]()
    have_isr = configs.get("min.insync.replicas")
    if min_insync is not None and have_isr != str(min_insync):
        out.append(("error", f"topic {name}: min.insync.replicas {have_isr}, not {min_insync}"))
    want = spec.config.get("cleanup.policy", "delete")
    have = configs.get("cleanup.policy", "delete")
    if ("compact" in want) != ("compact" in have):
        out.append(("error", f"topic {name}: cleanup.policy {have}, the layout's is {want}"))
    retention = spec.config.get("retention.ms")
    if retention is not None and configs.get("retention.ms") != retention:
        forever = " (forever)" if retention == "-1" else ""
        out.append(
            (
                "warning",
                f"topic {name}: retention.ms {configs.get('retention.ms')}, the layout's is "
                f"{retention}{forever}",
            )
        )
    return out
