"""docker-compose.yml: checked statically everywhere, run for real where a Docker engine answers."""

from __future__ import annotations

import os
import re
import subprocess
import time
import tomllib
from pathlib import Path
from typing import Any

import click
import orjson
import pytest
import yaml

from tests.conftest import ROOT, bin_path, docker_available, kafka_image

COMPOSE = ROOT / "docker-compose.yml"


def services() -> dict[str, dict[str, Any]]:
    return dict(yaml.safe_load(COMPOSE.read_text())["services"])


def cli_groups() -> dict[str, click.Group]:
    from app.cli.consumer import cli as consumer
    from app.cli.main import cli as srl
    from app.cli.producer import cli as producer

    return {"srl": srl, "srl-producer": producer, "srl-consumer": consumer}


def test_images_are_pinned_and_built_services_use_the_dockerfile() -> None:
    for name, svc in services().items():
        if "build" in svc:
            assert svc["build"] == "." and (ROOT / "Dockerfile").is_file(), name
            continue
        image = svc["image"]
        tag = image.rsplit("/", 1)[-1].partition(":")[2]
        assert "@sha256:" in image or (
            tag and tag != "latest" and re.fullmatch(r"v?\d[\w.\-]*|RELEASE\.[\w\-]+", tag)
        ), f"{name}: image {image} is not pinned to a version"
    assert services()["kafka"]["image"] == kafka_image()  # the tests' container runs the same
    base = next(
        line for line in (ROOT / "Dockerfile").read_text().splitlines() if line.startswith("FROM ")
    )
    assert re.fullmatch(r"FROM python:3\.11\.\d+-slim-\w+", base), base


def test_every_port_is_bound_to_loopback() -> None:
    seen = 0
    for name, svc in services().items():
        for port in svc.get("ports", []):
            seen += 1
            if isinstance(port, dict):
                assert port.get("host_ip") == "127.0.0.1", f"{name}: {port}"
            else:
                assert str(port).startswith("127.0.0.1:"), (
                    f"{name}: {port} is not bound to 127.0.0.1"
                )
    assert seen >= 5  # kafka, s3 api + console, exporter, web ui


def test_kafka_advertises_the_published_port_and_the_internal_listener() -> None:
    svc = services()["kafka"]
    env = svc["environment"]
    advertised = dict(item.split("://", 1) for item in env["KAFKA_ADVERTISED_LISTENERS"].split(","))
    host_port = advertised["HOST"].rsplit(":", 1)[1]
    assert f"127.0.0.1:{host_port}:9092" in svc["ports"] and advertised["HOST"].startswith(
        "127.0.0.1:"
    )
    srl_env = services()["srl-consumer"]["environment"]
    assert srl_env["SRL_BOOTSTRAP_SERVERS"] == advertised["INTERNAL"]
    assert (
        services()["kafka-ui"]["environment"]["KAFKA_CLUSTERS_0_BOOTSTRAPSERVERS"]
        == advertised["INTERNAL"]
    )


def test_srl_commands_exist_and_their_options_parse() -> None:
    groups = cli_groups()
    checked = set()
    for name, svc in services().items():
        if "build" not in svc:
            continue
        argv = list(svc["command"])
        assert argv[0] in groups, f"{name}: {argv[0]} is not an srl console script"
        cmd: click.Command = groups[argv[0]]
        args = argv[1:]
        while isinstance(cmd, click.Group):
            sub = cmd.commands.get(args[0]) if args else None
            assert sub is not None, f"{name}: `{' '.join(argv)}`: no command {args[:1]}"
            cmd, args = sub, args[1:]
        with cmd.make_context(argv[0], args) as ctx:  # parses and type-checks every option
            assert ctx.command is cmd
        checked.add(" ".join(argv[:2]))
    assert {
        "srl-producer dispatch",
        "srl-producer generate",
        "srl-consumer train",
        "srl top",
        "srl topics",
        "srl store",
    } <= checked


def test_srl_service_environment_is_a_valid_config() -> None:
    from srl.config import CommonConfig, load_config

    for name, svc in services().items():
        if "build" in svc:
            env = {k: str(v) for k, v in svc["environment"].items()}
            cfg = load_config(CommonConfig, env=env)
            assert cfg.store.startswith("s3://") and cfg.s3_endpoint_url == "http://s3:9000", name
    minio = services()["s3"]["environment"]
    srl_env = services()["srl-consumer"]["environment"]
    assert minio["MINIO_ROOT_USER"] == srl_env["AWS_ACCESS_KEY_ID"]
    assert minio["MINIO_ROOT_PASSWORD"] == srl_env["AWS_SECRET_ACCESS_KEY"]


def test_dockerfile_copies_every_package() -> None:
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "packages"
    ]["find"]["include"]
    copied = {
        line.split()[1]
        for line in (ROOT / "Dockerfile").read_text().splitlines()
        if line.startswith("COPY ")
    }
    for pattern in packages:
        assert pattern.rstrip("*") in copied, f"Dockerfile does not COPY {pattern.rstrip('*')}"
        assert (ROOT / pattern.rstrip("*")).is_dir()


@pytest.mark.docker
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_compose_up_brings_up_a_pipeline_that_trains() -> None:
    if not docker_available():
        pytest.skip(
            "no Docker engine answers here (`docker info` failed); the static compose tests ran"
        )
    from testcontainers.compose import DockerCompose

    from tests.s3server import TEST_CREDENTIALS

    env = {k: v for k, v in os.environ.items() if not k.startswith("SRL_")}
    env.update(
        {
            **TEST_CREDENTIALS,
            "AWS_ACCESS_KEY_ID": "srl-local",
            "AWS_SECRET_ACCESS_KEY": "srl-local-secret",
            "SRL_BOOTSTRAP_SERVERS": "127.0.0.1:9092",
            "SRL_RUN": "compose",
            "SRL_STORE": "s3://srl/compose",
            "SRL_S3_ENDPOINT_URL": "http://127.0.0.1:9000",
        }
    )
    with DockerCompose(ROOT, compose_file_name="docker-compose.yml", build=True, wait=False):
        deadline = time.monotonic() + 1500
        weights: dict[str, Any] = {}
        while time.monotonic() < deadline:
            out = subprocess.run(
                [bin_path("srl"), "top", "--json"],
                env=env,
                capture_output=True,
                text=True,
                timeout=120,
            )
            if out.returncode == 0:
                weights = orjson.loads(out.stdout)["weights"]
                if (weights["version"] or 0) >= 1 and weights["manifest_ok"]:
                    break
            time.sleep(10)
        assert (weights.get("version") or 0) >= 1 and weights["manifest_ok"], weights


def test_compose_walkthrough_is_documented() -> None:
    text = Path(ROOT / "docs" / "operations.md").read_text()
    assert "docker compose up" in text
    for name in services():
        assert f"`{name}`" in text, f"docs/operations.md does not mention service {name}"
