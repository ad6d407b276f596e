"""The ACLs of each role (``srl.acls``): docs/security.md's table is exactly them, and they
render as ``kafka-acls.sh`` commands and as the admin client's bindings."""

from __future__ import annotations

import re

from srl import acls
from srl.kafka.acls import bindings
from srl.topicplan import acl_commands, kafka_acls_commands
from srl.topics import Layout
from tests.conftest import ROOT

ROW = re.compile(
    r"^\| (\w+) \| (topic|group|cluster) \| `([^`]+)` \| (literal|prefixed) "
    r"\| ([^|]+) \| ([^|]+) \|$"
)


def doc_rows() -> list[tuple[str, ...]]:
    text = (ROOT / "docs" / "security.md").read_text()
    return [m.groups() for line in text.splitlines() if (m := ROW.match(line))]


def code_rows() -> list[tuple[str, ...]]:
    layout = Layout(prefix="PREFIX")
    return [
        (role, g.resource, g.name, g.pattern, ", ".join(g.operations), g.why)
        for role in acls.ROLES
        for g in acls.grants(role, layout, "RUN", "POOL", pools=("POOL",))
    ]


def test_the_documented_acl_table_is_exactly_the_roles_grants() -> None:
    assert [tuple(c.strip() for c in r) for r in doc_rows()] == code_rows()


def test_every_grant_names_a_resource_of_the_prefix_and_real_operations() -> None:
    layout = Layout(prefix="exp")
    known = {"Read", "Write", "Describe", "Create", "DescribeConfigs"}
    for role in acls.ROLES:
        for g in acls.grants(role, layout):
            assert g.name.startswith("exp.") and set(g.operations) <= known, (role, g)
    # no role reads another role's group: only Describe on the trainer's, for the backlog
    gen = {g.name: g.operations for g in acls.grants("generator", layout) if g.resource == "group"}
    assert gen["exp.trainer.default"] == ("Describe",) and gen["exp.gen.regular"] == ("Read",)


def test_grants_render_as_kafka_acls_commands_and_bindings() -> None:
    grants = acls.grants("trainer", Layout(prefix="exp"), run="r1")
    lines = kafka_acls_commands(grants, "User:t", "kafka:9092")
    assert lines[0] == (
        "kafka-acls.sh --bootstrap-server kafka:9092 --add --allow-principal User:t "
        "--operation Read --topic exp.trajectories --resource-pattern-type literal"
    )
    assert any("--group exp.trainer.r1.position" in line for line in lines)
    ops = {(b.name, b.operation.name) for b in bindings(grants, "User:t")}
    assert ("exp.trainer.r1", "READ") in ops and ("exp.weights", "WRITE") in ops
    admin = bindings(acls.grants("admin", Layout(prefix="exp")), "User:a")
    assert {b.operation.name for b in admin} == {"CREATE", "DESCRIBE", "DESCRIBE_CONFIGS"}


def test_the_plan_has_a_block_per_role_and_a_generator_per_pool() -> None:
    lines = acl_commands(Layout(prefix="exp"), "k:9092", "default", ["a", "b"], {"top": "User:mon"})
    assert [line for line in lines if line.startswith("#")] == [f"# {r}" for r in acls.ROLES]
    assert any("--group exp.gen.a " in line for line in lines)
    assert any("--group exp.gen.b " in line for line in lines)
    top = lines[lines.index("# top") + 1 : lines.index("# admin")]
    assert top and all("--allow-principal User:mon " in line for line in top)
    assert all("User:srl-admin" in line for line in lines[lines.index("# admin") + 1 :])
