"""The per-datacenter config files in deploy/datacenters/: valid srl config, settings librdkafka
accepts (the SASL/TLS template included), and the two sides agree on what they share."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from srl.config import CommonConfig, load_config
from srl.kafka import Producer, make_consumer
from tests.conftest import ROOT

DIR = ROOT / "deploy" / "datacenters"
FILES = sorted(DIR.glob("*.toml"))
SHARED = ("bootstrap_servers", "topic_prefix", "run", "store", "s3_endpoint_url")


def with_sasl_template(path: Path, tmp_path: Path) -> Path:
    """The file with its commented SASL/TLS lines switched on (a real CA bundle for the CA)."""
    import certifi

    ca = certifi.where()
    lines = []
    for line in path.read_text().splitlines():
        m = re.fullmatch(r'# ("(?:security|sasl|ssl)\.[^"]+" = .*)', line)
        lines.append(m.group(1) if m else line)
    text = re.sub(r'"/etc/srl/kafka-ca.pem"', f'"{ca}"', "\n".join(lines))
    out = tmp_path / path.name
    out.write_text(text)
    return out


def test_there_is_one_file_per_side() -> None:
    assert [f.name for f in FILES] == ["generators.toml", "trainer.toml"]


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
@pytest.mark.parametrize("sasl", [False, True], ids=["plain", "sasl-template"])
def test_config_is_valid_and_librdkafka_accepts_it(path: Path, sasl: bool, tmp_path: Path) -> None:
    f = with_sasl_template(path, tmp_path) if sasl else path
    env = {"SRL_KAFKA": "sasl.password=from-the-environment"} if sasl else {}
    # A local bootstrap so the clients below never try to resolve the example hosts.
    cfg = load_config(CommonConfig, file=f, env=env, cli={"bootstrap_servers": "127.0.0.1:1"})
    assert cfg.compression == "zstd" and cfg.connect_timeout_s >= 30
    assert cfg.kafka["socket.keepalive.enable"] == "true"
    if sasl:
        assert cfg.kafka["security.protocol"] == "SASL_SSL"
        assert cfg.kafka["sasl.password"] == "from-the-environment"
    # librdkafka validates every property name and value when a client is made.
    # (made and polled, not flushed: librdkafka counts its queued connection errors to the
    # unreachable bootstrap as pending, so flush(0) failed when it had logged some already)
    Producer(cfg, "dc-test", check=False).poll(0)
    make_consumer(cfg, "dc-test", "dc-test").close()


def test_role_tables_are_valid_for_their_roles() -> None:
    from consumers.config import TrainConfig

    cfg = load_config(TrainConfig, file=DIR / "trainer.toml", env={}, cli={"model": "m"})
    assert cfg.checkpoint_every > 1 and cfg.publish_every == 1


def test_both_sides_share_only_kafka_and_the_store() -> None:
    sides = [tomllib.loads(f.read_text()) for f in FILES]
    for key in SHARED:
        assert sides[0][key] == sides[1][key], key
    assert sides[0]["store"].startswith("s3://")
