"""The roles of tests/integration/test_secured_kafka.py as real CLIs, each as its principal.

``Roles`` gives each role the environment a deployment would: where the cluster is, its
security settings, and its secret the way that role's deployment keeps it (a file, a variable,
a token callback, a certificate; the module docstring of the test has the table). Every
password carries :data:`SENTINEL`, so a leak anywhere is found by one search.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

from srl.ports import free_port
from tests.conftest import ROOT, bin_path
from tests.securekafka import SecureNode

SENTINEL = "S3NTINEL-7f2c"
AUTH = {
    "topics": "SCRAM-SHA-512",
    "dispatcher": "SCRAM-SHA-512",
    "generator": "SCRAM-SHA-512",
    "trainer": "PLAIN",
}


def run(argv: list[str], env: Mapping[str, str], timeout_s: float = 180) -> Any:
    """``argv`` (its first word a console script beside this interpreter) to its end."""
    cmd = [bin_path(argv[0]), *argv[1:]]
    return subprocess.run(cmd, env=dict(env), capture_output=True, text=True, timeout=timeout_s)


def one_line(stderr: str) -> bool:
    """Whether ``stderr`` holds exactly one error line and no traceback (info lines aside)."""
    errors = [line for line in stderr.splitlines() if ": error: " in line]
    return len(errors) == 1 and "Traceback" not in stderr


def _kv(settings: Mapping[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in settings.items())


@dataclass
class Roles:
    """The CLIs of one topic prefix, each with its principal's settings."""

    node: SecureNode
    prefix: str
    root: Path
    model: Path
    passwords: dict[str, str]
    plaintext: bool = False  # the baseline: the PLAINTEXT listener, no security at all
    logs: dict[str, Path] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for d in ("work", "store", "logs", "secrets"):
            (self.root / d).mkdir(parents=True, exist_ok=True)

    # -- environments ------------------------------------------------------------------------
    def env(self, role: str, password: str | None = None, ca: Path | None = None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SRL_")}
        env |= {
            "SRL_TOPIC_PREFIX": self.prefix,
            "SRL_STORE": f"file://{self.root / 'store'}",
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": str(ROOT),  # the token callback lives in tests/
            "OMP_NUM_THREADS": "1",
        }
        if self.plaintext:
            return env | {"SRL_BOOTSTRAP_SERVERS": self.node.plaintext}
        return env | self._secured(role, password, ca)

    def _secured(self, role: str, password: str | None, ca: Path | None) -> dict[str, str]:
        node, ca_path = self.node, str(ca or self.node.ca)
        if role == "top":  # mTLS
            tls = node.mtls_settings("top") | {"ssl.ca.location": ca_path}
            return {"SRL_BOOTSTRAP_SERVERS": node.ssl, "SRL_KAFKA": _kv(tls)}
        out = {"SRL_BOOTSTRAP_SERVERS": node.sasl_ssl}
        if role == "serve":  # OAUTHBEARER, the token from kafka_oauth_cb
            settings = node.oauth_settings("serve") | {"ssl.ca.location": ca_path}
            return out | {
                "SRL_KAFKA": _kv(settings),
                "SRL_KAFKA_OAUTH_CB": "tests.securekafka:oauth_token",
            }
        pw = password if password is not None else self.passwords[role]
        sasl = node.sasl_settings(AUTH[role], role, pw) | {"ssl.ca.location": ca_path}
        secret = sasl.pop("sasl.password")
        if role == "trainer":  # inline, comma and all
            return out | {"SRL_KAFKA": _kv(sasl) + f",sasl.password={secret}"}
        if role == "dispatcher":  # a config file whose [kafka] table reads the secret from a file
            return out | {"SRL_CONFIG": str(self._config_file(sasl, secret))}
        return out | {"SRL_KAFKA": _kv(sasl), "SRL_KAFKA_SASL_PASSWORD": secret}

    def _config_file(self, sasl: dict[str, str], secret: str) -> Path:
        pw = self.root / "secrets" / "dispatcher.pw"
        pw.write_text(secret + "\n")
        lines = ["[kafka]", *(f'"{k}" = "{v}"' for k, v in sasl.items())]
        lines += [f'"sasl.password" = "@{pw}"', '"reconnect.backoff.ms" = 100']
        lines += ['"socket.keepalive.enable" = true']  # TOML numbers and booleans
        path = self.root / "secrets" / "dispatcher.toml"
        path.write_text("\n".join(lines) + "\n")
        return path

    # -- commands ------------------------------------------------------------------------------
    def cmd(self, role: str, *argv: str, quick: bool = False) -> list[str]:
        if argv:
            return list(argv)
        m, idle = str(self.model), "2" if quick else "8"
        return {
            "generator": ["srl-producer", "generate", "--engine", "hf", "--model", m]
            + ["--pool", "regular", "--idle-exit-s", idle, "--threads", "1"],
            "trainer": ["srl-consumer", "train", "--model", m, "--max-steps", "1"]
            + ["--groups-per-step", "2", "--idle-exit-s", "2" if quick else "30"]
            + ["--device", "cpu", "--json"],
            "dispatcher": ["srl-producer", "dispatch", "--task", "demo", "--num-prompts", "2"]
            + ["--group-size", "2", "--groups-per-step", "2", "--max-new-tokens", "8"],
            "top": ["srl", "top", "--once", "--json"],
        }[role]

    def spawn(self, role: str, argv: list[str]) -> subprocess.Popen[bytes]:
        log = self.root / "logs" / f"{role}.log"
        self.logs[role] = log
        with open(log, "wb") as out:
            return subprocess.Popen(
                [bin_path(argv[0]), *argv[1:]],
                env=self.env(role),
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=self.root / "work",
            )

    def output(self, role: str) -> str:
        return self.logs[role].read_text() if role in self.logs else ""

    def result(self, role: str) -> dict[str, Any]:
        """The JSON object a role printed last (``--json``)."""
        text = self.output(role)
        return dict(orjson.loads(text[text.rindex("\n{") :]))

    def files_with(self, needle: str) -> list[str]:
        """Files srl wrote under this root (not the test's own secrets) that hold ``needle``."""
        found = []
        for path in self.root.rglob("*"):
            mine = path.is_file() and "secrets" not in path.parts
            if mine and needle.encode() in path.read_bytes():
                found.append(str(path))
        return found

    # -- srl serve -----------------------------------------------------------------------------
    def serve(self) -> tuple[subprocess.Popen[bytes], int]:
        port = free_port()
        argv = ["srl", "serve", "--model", str(self.model), "--model-name", "tiny"]
        argv += ["--port", str(port), "--threads", "1", "--max-batch", "2", "--chunk-tokens", "4"]
        return self.spawn("serve", argv), port

    def wait_healthy(
        self, proc: subprocess.Popen[bytes], port: int, timeout_s: float = 120
    ) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            assert proc.poll() is None, self.output("serve")[-3000:]
            assert time.monotonic() < deadline, self.output("serve")[-3000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)

    def serve_once(self) -> dict[str, Any]:
        """``srl serve`` up, one completion, SIGTERM: the completion's JSON."""
        proc, port = self.serve()
        try:
            self.wait_healthy(proc, port)
            body = {"model": "tiny", "prompt": "1+1=", "max_tokens": 4}
            r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=60) == 0, self.output("serve")[-3000:]
            return dict(r.json())
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)

    # -- start times -----------------------------------------------------------------------------
    def timed(self, role: str) -> Timed:
        """``role`` started now: a short run to its end (serve: until it answers /health)."""
        if role == "serve":
            proc, port = self.serve()
            return Timed(self, role, proc, port)
        return Timed(self, role, self.spawn(role, self.cmd(role, quick=True)))


@dataclass
class Timed:
    roles: Roles
    role: str
    proc: subprocess.Popen[bytes]
    port: int | None = None
    t0: float = field(default_factory=time.monotonic)

    def wait(self) -> float:
        """Seconds from the start to the end (serve: to its first healthy answer); a process
        still running when this fails (a timeout) is killed, not left to the next test."""
        try:
            if self.port is not None:
                self.roles.wait_healthy(self.proc, self.port)
                took = time.monotonic() - self.t0
                self.proc.send_signal(signal.SIGTERM)
                self.proc.wait(timeout=60)
                return took
            rc = self.proc.wait(timeout=180)
            assert rc == 0, self.roles.output(self.role)[-3000:]
            return time.monotonic() - self.t0
        finally:
            self.stop()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)


def start(roles: Roles, role: str) -> subprocess.Popen[bytes]:
    return roles.spawn(role, roles.cmd(role))


def wait_all(
    roles: Roles, procs: dict[str, subprocess.Popen[bytes]], timeout_s: float
) -> dict[str, str]:
    """Wait for every process (killing what outlives ``timeout_s``); each one's output."""
    deadline = time.monotonic() + timeout_s
    for p in procs.values():
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=30)
    return {role: roles.output(role) for role in procs}


def top_json(roles: Roles) -> dict[str, Any]:
    out = run(roles.cmd("top"), roles.env("top"), timeout_s=120)
    assert out.returncode == 0, out.stderr
    assert SENTINEL not in out.stdout + out.stderr
    return dict(orjson.loads(out.stdout))
