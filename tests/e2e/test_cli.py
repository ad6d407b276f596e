"""The real console scripts, run as subprocesses."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import orjson
import pytest

from srl.broker import free_port
from tests.conftest import bin_path


def run(
    *args: str, env: dict[str, str] | None = None, timeout: float = 120, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [bin_path(args[0]), *args[1:]],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        cwd=cwd,
    )


@pytest.mark.parametrize("script", ["srl", "srl-producer", "srl-consumer"])
def test_help_answers_in_under_a_second(script: str) -> None:
    run(script, "--help")  # warm the filesystem cache
    best = min(_timed(script) for _ in range(3))
    assert best < 1.0, f"{script} --help took {best:.2f}s"


def _timed(script: str) -> float:
    t0 = time.perf_counter()
    out = run(script, "--help")
    assert out.returncode == 0 and "Usage:" in out.stdout
    return time.perf_counter() - t0


def test_broker_start_status_stop(tmp_path: Path) -> None:
    port, data = str(free_port()), str(tmp_path / "broker")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SRL_")}
    try:
        out = run("srl", "broker", "start", "--port", port, "--data-dir", data, env=env)
        assert out.returncode == 0, out.stderr
        assert f"127.0.0.1:{port}" in out.stdout
        st = run("srl", "broker", "status", "--data-dir", data, "--json", env=env)
        status = orjson.loads(st.stdout)
        assert st.returncode == 0 and status["running"] and status["answering"]
        pid = status["pid"]
        created = run(
            "srl",
            "topics",
            "create",
            "--bootstrap",
            f"127.0.0.1:{port}",
            "--topic-prefix",
            "cli",
            env=env,
        )
        assert created.returncode == 0 and "cli.trajectories" in created.stdout
        desc = run(
            "srl",
            "topics",
            "describe",
            "--bootstrap",
            f"127.0.0.1:{port}",
            "--topic-prefix",
            "cli",
            "--json",
            env=env,
        )
        parts = orjson.loads(desc.stdout)["partitions"]
        traj = [p for p in parts if p["topic"] == "cli.trajectories"]
        assert len(traj) == 8 and {p["bucket"] for p in traj} == {
            "le256",
            "le1024",
            "le4096",
            "gt4096",
        }
        assert all(p["low"] == 0 and p["high"] == 0 for p in parts)
    finally:
        stopped = run("srl", "broker", "stop", "--data-dir", data, env=env)
    assert stopped.returncode == 0 and "stopped" in stopped.stdout
    assert (
        not Path(f"/proc/{pid}").exists()
        or b"noida" not in Path(f"/proc/{pid}/cmdline").read_bytes()
    )
    st = run("srl", "broker", "status", "--data-dir", data, env=env)
    assert st.returncode == 1 and "not running" in st.stdout


def test_bad_config_value_is_one_line_and_nonzero(tmp_path: Path) -> None:
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("SRL_")},
        "SRL_PARTITIONS_PER_BUCKET": "0",
    }
    out = run("srl", "topics", "describe", env=env)
    assert out.returncode == 2
    assert (
        out.stderr.strip().count("\n") == 0
        and "partitions_per_bucket" in out.stderr
        and "SRL_PARTITIONS_PER_BUCKET" in out.stderr
    )
    bad = tmp_path / "bad.toml"
    bad.write_text("bucket_bounds = [512, 256]\n")
    out = run(
        "srl",
        "topics",
        "create",
        "--config",
        str(bad),
        env={k: v for k, v in env.items() if k != "SRL_PARTITIONS_PER_BUCKET"},
    )
    assert out.returncode == 2 and "bucket_bounds" in out.stderr and "Traceback" not in out.stderr


def test_unreachable_broker_is_one_line_and_bounded() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SRL_")}
    env["SRL_CONNECT_TIMEOUT_S"] = "2"
    t0 = time.monotonic()
    out = run("srl", "topics", "describe", "--bootstrap", f"127.0.0.1:{free_port()}", env=env)
    assert out.returncode == 1 and "no Kafka broker answered" in out.stderr
    assert "Traceback" not in out.stderr and out.stderr.strip().count("\n") == 0
    assert time.monotonic() - t0 < 15


def test_bad_x_setting_is_one_line(cli_env: dict[str, str]) -> None:
    out = run("srl", "topics", "describe", "-X", "novalue", env=cli_env)
    assert out.returncode == 2 and "key=value" in out.stderr and "Traceback" not in out.stderr


def kafka_commands() -> list[tuple[str, ...]]:
    """Every command whose config reads librdkafka settings (``-X``), as its argv."""
    import click

    from app.cli.consumer import cli as consumer_cli
    from app.cli.main import cli as main_cli
    from app.cli.options import config_of
    from app.cli.producer import cli as producer_cli

    def walk(group: click.Group, argv: tuple[str, ...]) -> list[tuple[str, ...]]:
        out = []
        for name, cmd in sorted(group.commands.items()):
            if isinstance(cmd, click.Group):
                out += walk(cmd, (*argv, name))
            elif (cls := config_of(cmd)) is not None and "kafka" in cls.model_fields:
                out.append((*argv, name))
        return out

    scripts = (("srl", main_cli), ("srl-producer", producer_cli), ("srl-consumer", consumer_cli))
    return [c for script, group in scripts for c in walk(group, (script,))]


# what each command needs to get to its heavy work (a model to load, a file to read)
HEAVY = {
    ("srl-consumer", "train"): ("--model", "{model}"),
    ("srl-producer", "generate"): ("--engine", "hf", "--model", "{model}"),
    ("srl-producer", "bench"): ("--engine", "hf", "--model", "{model}"),
    ("srl-producer", "dispatch"): ("--prompts", "{prompts}"),
    ("srl", "serve"): ("--model", "{model}"),
}


@pytest.mark.parametrize("argv", kafka_commands(), ids=" ".join)
def test_a_bad_librdkafka_setting_stops_every_command_first_in_one_line(
    argv: tuple[str, ...], cli_env: dict[str, str], tiny_model: Path, tmp_path: Path
) -> None:
    """Issue 18: an unknown ``-X`` name is one line and exit 2 before the command loads a
    model, reads its input or starts anything (``srl.kafka.check_settings``)."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_id": "a", "prompt": "1+1=", "answer": "2"}\n')
    extra = [a.format(model=tiny_model, prompts=prompts) for a in HEAVY.get(argv[:2], ())]
    out = run(*argv, *extra, "-X", "no.such.setting=1", env=cli_env, cwd=tmp_path)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.count("\n") == 1, out.stderr[-2000:]  # nothing loaded, nothing started
    assert "kafka settings (no.such.setting)" in out.stderr and "no.such.setting" in out.stderr
    assert out.stdout == "" and not list(tmp_path.glob(".srl*"))


def test_the_commands_with_librdkafka_settings_are_all_found() -> None:
    found = {" ".join(c) for c in kafka_commands()}
    assert {"srl-consumer train", "srl-producer generate", "srl demo", "srl top"} <= found


def test_a_bad_librdkafka_value_is_named(cli_env: dict[str, str], tiny_model: Path) -> None:
    out = run("srl-consumer", "train", "--model", str(tiny_model), "-X", "acks=banana", env=cli_env)
    assert out.returncode == 2 and out.stderr.count("\n") == 1
    assert "Invalid value" in out.stderr and "acks" in out.stderr


@pytest.mark.slow
def test_demo_smoke_on_its_own_embedded_broker(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SRL_")}
    out = run("srl", "smoke", "--trajectories", "300", env=env, cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "300/300 trajectories" in out.stdout and "lost 0, duplicates 0" in out.stdout
