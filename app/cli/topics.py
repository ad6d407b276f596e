"""``srl topics``: the layout's topics created (the admin step), planned on paper, checked, shown.

* ``create``: every missing topic of the layout, with the replication factor,
  ``min.insync.replicas`` and topic configs of the settings (docs/security.md: the principal
  needs Create on the prefix);
* ``plan``: the same layout without a broker, as JSON, ``kafka-topics.sh`` commands, Strimzi
  ``KafkaTopic`` resources, or each role's ACLs as ``kafka-acls.sh`` commands, for a platform
  team that creates them itself;
* ``check``: a cluster's topics against the layout (partitions, replicas,
  ``min.insync.replicas``, cleanup policy, retention); exit 1 when a role would refuse them;
* ``describe``: partitions with their watermarks (and bucket, for trajectories).

Registered on ``srl`` by ``app/cli/main.py``; heavy modules are imported inside each command.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

from app.cli.common import echo_json
from app.cli.options import ConfigGroup, with_config

if TYPE_CHECKING:
    from srl.config import PlanConfig, TopicsAdminConfig, TopicsConfig

FORMATS = ("json", "kafka-topics", "strimzi", "acls")


@click.group(cls=ConfigGroup)
def topics() -> None:
    """Create, plan, check and inspect the srl topics ({prefix}.prompts.{bucket} …)."""


@topics.command("create")
@with_config("srl.config:TopicsAdminConfig")
def topics_create(cfg: TopicsAdminConfig) -> None:
    """Create every missing srl topic for the configured prefix and buckets (the admin step:
    Create on the topic prefix); existing ones are left as they are and checked."""
    from srl.kafka import create_topics, find_topics
    from srl.topicplan import problems
    from srl.topics import Layout

    specs = Layout.from_config(cfg).specs(cfg.topic_configs)
    created = set(create_topics(cfg))
    found, brokers = find_topics(cfg, [s.name for s in specs])
    for spec in specs:
        state = "created" if spec.name in created else "exists"
        click.echo(f"{spec.name:40s} {found[spec.name].partitions:3d} partitions  {state}")
        for severity, text in problems(
            spec, found[spec.name], cfg.replication_factor, None, brokers
        ):
            click.echo(f"{severity}: {text}", err=True)


@topics.command("plan")
@with_config("srl.config:PlanConfig")
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="json", show_default=True)
@click.option(
    "--strimzi-cluster",
    default="my-cluster",
    show_default=True,
    help="--format strimzi: the Kafka cluster's name (the strimzi.io/cluster label).",
)
@click.option(
    "--principal",
    "principals",
    multiple=True,
    metavar="ROLE=PRINCIPAL",
    help="--format acls: the principal of a role (repeatable); default User:srl-ROLE.",
)
@click.option(
    "--pools",
    default="regular,longtail",
    show_default=True,
    help="--format acls: the generator pools (one consumer group each).",
)
def topics_plan(
    cfg: PlanConfig, fmt: str, strimzi_cluster: str, principals: tuple[str, ...], pools: str
) -> None:
    """Print the layout without asking a broker: its topics as JSON, kafka-topics.sh commands
    or Strimzi KafkaTopic YAML, or every role's ACLs as kafka-acls.sh commands."""
    from srl import topicplan
    from srl.topics import Layout

    specs = Layout.from_config(cfg).specs(cfg.topic_configs)
    rf, isr = cfg.replication_factor, cfg.min_insync_replicas
    if fmt == "json":
        echo_json({"prefix": cfg.topic_prefix, "topics": topicplan.plan_json(specs, rf, isr)})
    elif fmt == "kafka-topics":
        for line in topicplan.kafka_topics_commands(specs, cfg.bootstrap_servers, rf, isr):
            click.echo(line)
    elif fmt == "strimzi":
        click.echo(topicplan.strimzi_yaml(specs, strimzi_cluster, rf, isr), nl=False)
    else:
        from srl import acls
        from srl.config import parse_kv

        who = parse_kv(list(principals), "--principal")
        if unknown := sorted(set(who) - set(acls.ROLES)):
            raise click.BadParameter(f"no role {unknown[0]}; roles: {', '.join(acls.ROLES)}")
        pool_names = [p for p in pools.split(",") if p] or ["regular"]
        layout = Layout.from_config(cfg)
        for line in topicplan.acl_commands(layout, cfg.bootstrap_servers, cfg.run, pool_names, who):
            click.echo(line)


@topics.command("check")
@with_config("srl.config:TopicsAdminConfig")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def topics_check(cfg: TopicsAdminConfig, as_json: bool) -> None:
    """Hold the cluster's topics against the layout and the settings: partitions, replicas,
    min.insync.replicas, cleanup.policy, retention. Exit 1 if any topic is missing or would be
    refused by a role (needs DescribeConfigs on the topics)."""
    from srl.kafka import find_topics
    from srl.topicplan import problems
    from srl.topics import Layout

    specs = Layout.from_config(cfg).specs(cfg.topic_configs)
    found, brokers = find_topics(cfg, [s.name for s in specs], configs=True)
    rows: list[dict[str, Any]] = []
    for s in specs:
        f = found[s.name]
        why = {"missing": "does not exist", "denied": "not authorized to describe it"}
        issues = (
            [("error", f"topic {s.name}: {why.get(f.error, f.error)}")]
            if f.error
            else problems(s, f, cfg.replication_factor, cfg.min_insync_replicas, brokers)
        )
        rows.append(
            {
                "topic": s.name,
                "partitions": f.partitions if not f.error else None,
                "layout_partitions": s.partitions,
                "replicas": f.replicas if not f.error else None,
                "problems": [{"severity": sev, "text": text} for sev, text in issues],
            }
        )
    bad = sum(1 for r in rows for p in r["problems"] if p["severity"] == "error")
    if as_json:
        echo_json({"bootstrap": cfg.bootstrap_servers, "ok": not bad, "topics": rows})
    else:
        for r in rows:
            state = "ok" if not r["problems"] else r["problems"][0]["severity"]
            click.echo(
                f"{r['topic']:40s} {_s(r['partitions']):>4s}/{r['layout_partitions']:<4d} {state}"
            )
            for p in r["problems"]:
                click.echo(f"  {p['severity']}: {p['text']}")
    if bad:
        raise click.exceptions.Exit(1)


def _s(v: Any) -> str:
    return "-" if v is None else str(v)


@topics.command("describe")
@with_config("srl.config:TopicsConfig")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def topics_describe(cfg: TopicsConfig, as_json: bool) -> None:
    """Partitions with their low and high watermarks (and bucket, for trajectories; "-" for a
    partition beyond the layout)."""
    from srl.kafka import wait_for_broker, watermarks
    from srl.topics import Layout

    layout = Layout.from_config(cfg)
    md = wait_for_broker(cfg)
    names = sorted(t for t in md.topics if t.startswith(f"{layout.prefix}."))
    rows: list[dict[str, Any]] = []
    for (topic, part), (low, high) in sorted(watermarks(cfg, names).items()):
        bucket = layout.bucket_of_partition(part) if topic == layout.trajectories else None
        rows.append(
            {
                "topic": topic,
                "partition": part,
                "bucket": bucket,
                "low": low,
                "high": high,
                "messages": high - low,
            }
        )
    if as_json:
        echo_json({"bootstrap": cfg.bootstrap_servers, "partitions": rows})
        return
    if not rows:
        click.echo(
            f"no topics with prefix {layout.prefix!r} at {cfg.bootstrap_servers}; run `srl topics "
            f"create`"
        )
        return
    _print_partitions(rows)


def _print_partitions(rows: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table("TOPIC", "PARTITION", "BUCKET", "LOW", "HIGH", "MESSAGES", box=None)
    for r in rows:
        table.add_row(
            r["topic"],
            str(r["partition"]),
            r["bucket"] or "-",
            str(r["low"]),
            str(r["high"]),
            str(r["messages"]),
        )
    Console().print(table)
