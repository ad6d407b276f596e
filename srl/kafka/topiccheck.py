"""The topics a role needs, as the cluster has them: looked up, created where allowed, checked.

* ``find_topics``: each named topic as the cluster has it (partitions, replicas; configs when
  asked: that needs DescribeConfigs), with ``missing`` and ``denied`` told apart (a
  DescribeTopics names a topic the client may not see, where a metadata request for all
  topics just leaves it out);
* ``ensure_topics``: what a role calls before it opens any client on its topics. A missing
  topic is created when the role may (``create_topics``: ``yes``, or ``auto`` on a broker srl
  started: ``srl.kafka.probe.srl_started``), else the role stops with one line naming the
  topic and the ACL it would need; a topic it may not describe is one line too; a topic
  whose partitions differ from the layout stops it (fewer: a bucket without its partitions;
  more: chunks where no reader looks), and so does another replication factor than the one
  it was told. ``srl topics check`` reports the same, and the configs too.

The pure comparison is ``srl.topicplan.problems``; ``srl.acls`` says which grants a role has.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from confluent_kafka import KafkaError, KafkaException, TopicCollection
from confluent_kafka.admin import ConfigResource

from srl.config import CreationSettings, TopicsConfig, TopicSettings
from srl.errors import AccessDenied, SrlError
from srl.kafka.admin import admin, create_topics
from srl.kafka.probe import first_contact, srl_started
from srl.kafka.settings import describe, error_of
from srl.topicplan import Found, problems
from srl.topics import Layout, TopicSpec

log = logging.getLogger("srl.kafka")


class LayoutMismatch(SrlError):
    """A topic exists with another shape than the layout's (``srl topics check``)."""


def find_topics(
    cfg: TopicsConfig, names: Sequence[str], configs: bool = False
) -> tuple[dict[str, Found], int]:
    """Each of ``names`` as the cluster has it, and how many brokers the cluster has."""
    md, client = first_contact(cfg)
    timeout = cfg.connect_timeout_s
    out: dict[str, Found] = {}
    futures = client.describe_topics(TopicCollection(list(names)), request_timeout=timeout)
    for name, fut in futures.items():
        try:
            desc = fut.result()
        except KafkaException as e:
            code = err.code() if (err := error_of(e)) is not None else None
            why = {
                KafkaError.UNKNOWN_TOPIC_OR_PART: "missing",
                KafkaError.TOPIC_AUTHORIZATION_FAILED: "denied",
            }.get(code if code is not None else 0, describe(e))
            out[name] = Found(name, error=why)
            continue
        replicas = max((len(p.replicas) for p in desc.partitions), default=0)
        out[name] = Found(name, len(desc.partitions), replicas)
    if configs:
        out = _with_configs(cfg, out)
    return out, len(md.brokers)


def _with_configs(cfg: TopicsConfig, found: dict[str, Found]) -> dict[str, Found]:
    client = admin(cfg)  # held until the results are in: a dropped client cancels them
    present = [n for n, f in found.items() if f.error is None]
    if not present:
        return found
    res = client.describe_configs([ConfigResource("topic", n) for n in present])
    out = dict(found)
    for resource, fut in res.items():
        try:
            entries = fut.result(timeout=cfg.connect_timeout_s)
        except KafkaException as e:
            raise AccessDenied(
                f"cannot read the configs of topic {resource.name} ({describe(e)}): "
                f"DescribeConfigs on Topic {resource.name} (docs/security.md)"
            ) from None
        f = out[resource.name]
        configs = {k: str(v.value) for k, v in entries.items()}
        out[resource.name] = Found(f.name, f.partitions, f.replicas, None, configs)
    return out


def may_create(cfg: CreationSettings, where: TopicsConfig) -> bool:
    """Whether a role may create a topic it finds missing (the ``create_topics`` rule)."""
    return cfg.create_topics == "yes" or (cfg.create_topics == "auto" and srl_started(where))


def ensure_topics(cfg: TopicsConfig, names: Sequence[str], role: str) -> list[str]:
    """The role's topics ``names``: created where missing and allowed, else one line; refused
    when they do not fit the layout (module docstring). Returns the names created."""
    rf = cfg.replication_factor if isinstance(cfg, TopicSettings) else None
    configs = cfg.topic_configs if isinstance(cfg, TopicSettings) else "srl"
    specs = {s.name: s for s in Layout.from_config(cfg).specs(configs)}
    found, brokers = find_topics(cfg, names)
    if denied := [n for n in names if found[n].error == "denied"]:
        raise AccessDenied(
            f"{role}: not authorized to describe topic {denied[0]}: it needs the ACLs of "
            f"docs/security.md for a {role} (at least Describe on Topic {denied[0]})"
        )
    for n in names:
        if found[n].error not in (None, "missing"):
            raise SrlError(f"{role}: topic {n}: {found[n].error}")
    missing = [n for n in names if found[n].error == "missing"]
    created: list[str] = []
    if missing:
        if not (isinstance(cfg, CreationSettings) and may_create(cfg, cfg)):
            raise SrlError(missing_line(role, missing, Layout.from_config(cfg).prefix))
        created = create_topics(cfg, [specs[n] for n in missing])
    _refuse_mismatch(role, [specs[n] for n in names if n not in missing], found, rf, brokers)
    return created


def missing_line(role: str, missing: Sequence[str], prefix: str) -> str:
    more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
    return (
        f"{role}: topic {missing[0]} does not exist{more}: create the layout first with `srl "
        f"topics create` (Create on Topic prefix {prefix}.), or let the {role} create it with "
        f"create_topics = yes and Create on Topic {missing[0]} (docs/security.md)"
    )


def _refuse_mismatch(
    role: str,
    specs: Sequence[TopicSpec],
    found: dict[str, Found],
    replication: int | None,
    brokers: int,
) -> None:
    for spec in specs:
        for severity, text in problems(spec, found[spec.name], replication, None, brokers):
            if severity == "error":
                raise LayoutMismatch(
                    f"{role}: {text}: the topics do not fit this layout (bucket_bounds, "
                    "partitions_per_bucket, prompt_partitions); `srl topics check` lists "
                    "every difference"
                )
            log.warning("%s: %s", role, text)
