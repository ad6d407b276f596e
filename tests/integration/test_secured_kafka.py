"""srl on a Kafka that a platform team runs: SASL_SSL, mTLS, ACLs, topics made by an admin.

One KRaft node of this module (``tests/securekafka.py``: certificates made with Python's
``cryptography``, ``StandardAuthorizer`` with ``allow.everyone.if.no.acl.found=false``,
``auto.create.topics.enable=false``, a cluster id srl did not make), one principal per role,
each given exactly its role's ACLs (``srl.acls``, the table of docs/security.md):

=============  =================================================================
admin step     SCRAM-SHA-512 ``topics`` (``srl topics create|check``)
dispatcher     SCRAM-SHA-512, its password in a file (``sasl.password=@FILE``)
generator      SCRAM-SHA-512, ``SRL_KAFKA_SASL_PASSWORD``
trainer        PLAIN, the password (with a comma) inside ``SRL_KAFKA``
serve          OAUTHBEARER, a token from ``kafka_oauth_cb`` (Kafka's unsecured validator)
top            mTLS, a client certificate (CN=top)
=============  =================================================================

Checks: a short pipeline (dispatcher, generator, trainer, ``srl top``, ``srl serve``) loses
nothing and the authorizer refuses none of its principals anything; a sentinel in every
password never reaches an output, a file srl writes or the metrics topic, even after a bad
``-X``; a wrong password and an untrusted CA are one line each, within the connect timeout;
topics with a partition fewer or more are named by ``srl topics check`` and refused by the
roles with one line, and ``srl top`` and ``srl topics describe`` do not crash on them; a missing
topic, a missing group ACL and a missing Write ACL stop a role with one line; each role starts
within 5 s of its plaintext start.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import orjson
import pytest

from schemas.records import TrajectoryChunk, decode_as, encode
from srl import acls
from srl.config import CommonConfig, load_config
from srl.kafka import (
    KafkaException,
    Producer,
    TopicPartition,
    committed_offsets,
    create_topics,
    make_consumer,
    read_range,
)
from srl.kafka.acls import create_acls
from srl.topics import Layout, TopicSpec
from tests.chunks import traj_chunks
from tests.secured_roles import SENTINEL, Roles, one_line, run, start, top_json, wait_all
from tests.securekafka import ADMIN, SecureNode, secure_node

pytestmark = pytest.mark.kafka

SCRAM = {"topics": f"a-{SENTINEL}", "dispatcher": f"d-{SENTINEL}", "generator": f"g-{SENTINEL}"}
PLAIN = {"trainer": f"t-{SENTINEL},Zq=3"}  # a comma SRL_KAFKA must not split at
PRINCIPALS = {
    "admin": "User:topics",
    "dispatcher": "User:dispatcher",
    "generator": "User:generator",
    "trainer": "User:trainer",
    "serve": "User:serve",
    "top": "User:top",
}


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> SecureNode:
    with secure_node(tmp_path_factory.mktemp("secure-kafka"), SCRAM, PLAIN, ("top",)) as n:
        warm_group_coordinator(n)
        yield n  # type: ignore[misc]


def warm_group_coordinator(node: SecureNode, timeout_s: float = 60.0) -> None:
    """Until the node's group coordinator answers (a cluster in use has its offsets topic: on a
    fresh node the first group request creates it and gets NOT_COORDINATOR, and the roles
    started then waited ~15 s more than on a cluster in use)."""
    cfg = admin_cfg(node, "warm")
    create_topics(cfg, [TopicSpec("warm.up", 1, {})])
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            committed_offsets(cfg, "warm.group", [("warm.up", 0)])
            return
        except KafkaException:
            assert time.monotonic() < deadline, "the group coordinator never answered"
            time.sleep(0.2)


def admin_cfg(node: SecureNode, prefix: str) -> CommonConfig:
    """The super user's config (the test's own set-up and reads, never a role's)."""
    kafka = node.plain_settings(ADMIN[0])
    values = {"bootstrap_servers": node.sasl_ssl, "topic_prefix": prefix, "kafka": kafka}
    return load_config(CommonConfig, cli=values, env={})


def grant(node: SecureNode, prefix: str, skip: tuple[str, ...] = ()) -> None:
    """Each role's principal gets exactly its grants on ``prefix``'s layout (not ``skip``'s
    resources: ``role:resource`` pairs, e.g. ``trainer:group``)."""
    cfg = admin_cfg(node, prefix)
    layout = Layout.from_config(cfg)
    for role, principal in PRINCIPALS.items():
        grants = [g for g in acls.grants(role, layout) if f"{role}:{g.resource}" not in skip]
        create_acls(cfg, grants, principal)


def ours_denied(node: SecureNode, since: int = 0) -> list[str]:
    """The authorizer's refusals of srl's principals, after the first ``since`` refusals."""
    later = node.denied()[since:]
    return [d for d in later if any(f"= {p} " in d for p in PRINCIPALS.values())]


def test_a_pipeline_on_sasl_ssl_mtls_and_oauth_loses_nothing_and_is_denied_nothing(
    node: SecureNode, tmp_path: Path, tiny_model: Path
) -> None:
    prefix, roles = "sec", Roles(node, "sec", tmp_path, tiny_model, SCRAM | PLAIN)
    grant(node, prefix)
    before = len(node.denied())
    made = run(roles.cmd("topics", "srl", "topics", "create"), roles.env("topics"))
    assert made.returncode == 0, made.stderr
    checked = run(roles.cmd("topics", "srl", "topics", "check"), roles.env("topics"))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    t0 = time.monotonic()
    procs = {
        "trainer": start(roles, "trainer"),
        "generator": start(roles, "generator"),
        "dispatcher": start(roles, "dispatcher"),
    }
    outs = wait_all(roles, procs, timeout_s=240)
    assert all(p.returncode == 0 for p in procs.values()), outs
    assert roles.result("trainer")["outcomes"] == {"trained": 4}  # 2 prompts x 2 samples
    pipeline_s = time.monotonic() - t0
    top = top_json(roles)
    trainer_rows = [r for r in top["groups"] if r["group"] == f"{prefix}.trainer.default"]
    assert trainer_rows and all(r["lag"] in (0, None) for r in trainer_rows)
    served = roles.serve_once()
    assert served["choices"][0]["text"] is not None
    cfg = admin_cfg(node, prefix)
    chunks = [
        decode_as(m.value() or b"", TrajectoryChunk)
        for m in read_range(cfg, f"{prefix}.trajectories")
    ]
    sources = {orjson.loads(c.metadata or "{}").get("source") for c in chunks if c.seq == 0}
    assert "serve" in sources, sources  # the served completion is training data too
    assert not ours_denied(node, before), ours_denied(node, before)[:5]
    metrics = b"".join(m.value() or b"" for m in read_range(cfg, f"{prefix}.metrics"))
    assert metrics and SENTINEL.encode() not in metrics
    leaks = roles.files_with(SENTINEL) + [r for r, o in outs.items() if SENTINEL in o]
    assert not leaks, leaks
    print(f"pipeline on SASL_SSL: {pipeline_s:.1f}s")


def test_a_wrong_password_and_an_untrusted_ca_are_one_line_each_in_time(
    node: SecureNode, tmp_path: Path, tiny_model: Path
) -> None:
    roles = Roles(node, "bad", tmp_path, tiny_model, SCRAM | PLAIN)
    cases = {
        "authentication failed": roles.env("generator", password=f"wrong-{SENTINEL}"),
        "TLS": roles.env("generator", ca=node.other_ca),
    }
    argv = ["srl", "topics", "describe", "--connect-timeout-s", "5"]
    for needle, env in cases.items():
        # side by side with the same command that connects (its start-up is the same: on a
        # loaded machine importing srl alone takes seconds): the error comes within the
        # connect timeout of that, not after it
        t0 = time.monotonic()
        good = run(argv, roles.env("generator"))
        t1 = time.monotonic()
        out = run(argv, env)
        took, base = time.monotonic() - t1, t1 - t0
        assert good.returncode == 0, good.stderr
        assert out.returncode == 1 and one_line(out.stderr) and needle in out.stderr, out.stderr
        assert took < base + 5 and SENTINEL not in out.stdout + out.stderr, (took, base, out)
        print(f"{needle}: {took:.2f}s (connecting: {base:.2f}s): {out.stderr.strip()}")


def test_a_bad_x_shows_no_secret(node: SecureNode, tmp_path: Path, tiny_model: Path) -> None:
    roles = Roles(node, "badx", tmp_path, tiny_model, SCRAM | PLAIN)
    for bad in ("no.such.setting=1", f"sasl.pasword={SENTINEL}", "sasl.password"):
        for argv in (
            ["srl", "top", "--once"],
            ["srl-producer", "generate", "--model", str(tiny_model)],
        ):
            out = run([*argv, "-X", bad], roles.env("generator"))
            assert out.returncode == 2 and one_line(out.stderr), out.stderr
            assert SENTINEL not in out.stdout + out.stderr, out.stderr


@pytest.mark.parametrize("delta", [-1, 1], ids=["one-partition-fewer", "one-partition-more"])
def test_topics_that_do_not_fit_the_layout_are_named_and_refused(
    node: SecureNode, tmp_path: Path, tiny_model: Path, delta: int
) -> None:
    prefix = f"fit{'m' if delta < 0 else 'p'}"
    cfg = admin_cfg(node, prefix)
    layout = Layout.from_config(cfg)
    traj = layout.trajectories
    n = layout.trajectory_partition_count + delta
    create_topics(
        cfg,
        [
            TopicSpec(s.name, n if s.name == traj else s.partitions, s.config)
            for s in layout.specs()
        ],
    )
    grant(node, prefix)
    with Producer(cfg, "test") as p:  # a record and a commit where no reader of the layout looks
        chunk = traj_chunks("p0", 0, 1, [1], [2, 3], chunk_tokens=2)[0]
        p.produce(traj, encode(chunk), key=chunk.trajectory_id, partition=n - 1)
    with make_consumer(cfg, f"{prefix}.trainer.default", "test") as c:
        c.commit_sync([TopicPartition(traj, n - 1, 0)])
    roles = Roles(node, prefix, tmp_path, tiny_model, SCRAM | PLAIN)
    check = run(roles.cmd("topics", "srl", "topics", "check"), roles.env("topics"))
    assert check.returncode == 1 and f"{traj} has {n} partitions" in check.stdout, check.stdout
    for role in ("generator", "trainer"):
        out = run(roles.cmd(role), roles.env(role))
        assert out.returncode == 1 and one_line(out.stderr), out.stderr
        assert f"{traj} has {n} partitions" in out.stderr, out.stderr
    described = run(["srl", "topics", "describe", "--json"], roles.env("top"))
    assert described.returncode == 0, described.stderr
    parts = orjson.loads(described.stdout)["partitions"]
    assert [p["bucket"] for p in parts if p["topic"] == traj][n - 1] == (
        None if delta > 0 else "gt4096"
    )
    top = top_json(roles)
    extra = [r for r in top["groups"] if r["topic"] == traj and r["partition"] == n - 1]
    if delta > 0:  # a partition beyond the layout: in the view, without a bucket
        assert extra and extra[0]["bucket"] is None, extra


def test_a_missing_topic_and_a_missing_group_acl_stop_a_role_with_one_line(
    node: SecureNode, tmp_path: Path, tiny_model: Path
) -> None:
    prefix = "bare"
    grant(node, prefix, skip=("trainer:group",))
    roles = Roles(node, prefix, tmp_path, tiny_model, SCRAM | PLAIN)
    out = run(roles.cmd("generator"), roles.env("generator"))
    assert out.returncode == 1 and one_line(out.stderr), out.stderr
    assert (
        f"topic {prefix}.prompts.le256 does not exist" in out.stderr
        and "Create on Topic" in out.stderr
    )
    assert run(roles.cmd("topics", "srl", "topics", "create"), roles.env("topics")).returncode == 0
    out = run(roles.cmd("trainer"), roles.env("trainer"))
    assert out.returncode == 1 and one_line(out.stderr), out.stderr
    assert f"consumer group {prefix}.trainer.default" in out.stderr, out.stderr


def test_a_missing_write_acl_stops_the_dispatcher_with_one_line(
    node: SecureNode, tmp_path: Path, tiny_model: Path
) -> None:
    prefix = "ro"
    cfg = admin_cfg(node, prefix)
    create_topics(cfg)
    read_only = [
        replace(g, operations=("Read",)) if g.name == f"{prefix}.prompts." else g
        for g in acls.grants("dispatcher", Layout.from_config(cfg))
    ]
    create_acls(cfg, read_only, PRINCIPALS["dispatcher"])
    roles = Roles(node, prefix, tmp_path, tiny_model, SCRAM | PLAIN)
    out = run(roles.cmd("dispatcher"), roles.env("dispatcher"))
    assert out.returncode == 1 and one_line(out.stderr), out.stderr
    assert f"not authorized to write topic {prefix}.prompts.le256" in out.stderr, out.stderr


@pytest.mark.timeout(900)  # ten role runs, two at a time: 2-3 min idle, 5+ on a loaded machine
def test_each_role_starts_within_5s_of_its_plaintext_start(
    node: SecureNode, tmp_path: Path, tiny_model: Path
) -> None:
    plain = Roles(node, "tp", tmp_path / "plain", tiny_model, {}, plaintext=True)
    secured = Roles(node, "ts", tmp_path / "secured", tiny_model, SCRAM | PLAIN)
    for prefix in ("tp", "ts"):
        create_topics(admin_cfg(node, prefix))
    grant(node, "ts")
    before = len(node.denied())
    took: dict[str, tuple[float, float]] = {}
    for role in ("generator", "trainer", "top", "serve", "dispatcher"):
        a, b = plain.timed(role), secured.timed(role)
        try:
            took[role] = (a.wait(), b.wait())
        finally:
            b.stop()  # a failed a.wait() leaves b running otherwise
    print(
        "start (plaintext, SASL_SSL/mTLS/OAUTHBEARER):",
        {r: (round(a, 1), round(b, 1)) for r, (a, b) in took.items()},
    )
    # 5 s on an idle machine (docs/security.md has the figures); a loaded one stretches both
    # starts alike, by up to a quarter of the plaintext start measured side by side
    assert all(b - a < 5.0 + 0.25 * a for a, b in took.values()), took
    assert not ours_denied(node, before), ours_denied(node, before)[:5]
