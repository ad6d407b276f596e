"""A local S3-compatible server for tests: moto in server mode, in its own process.

``MotoServer`` starts ``moto_server`` (installed from PyPI by the dev extra) on 127.0.0.1 and a
free port, waits until it answers, and stops it by pid on exit (SIGTERM, then SIGKILL). The
server keeps objects in memory and does not check signatures; it enforces
``If-None-Match: *`` on PutObject, which is what the create-only store relies on.
Used by the ``s3_server`` fixture in ``tests/conftest.py`` and the datacenter harness.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

# moto does not check them, but boto3 refuses to sign a request without credentials.
TEST_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "srl-test",
    "AWS_SECRET_ACCESS_KEY": "srl-test-secret",
    "AWS_REGION": "us-east-1",
}


def _port_open(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex((host, port)) == 0


class MotoServer:
    def __init__(
        self, host: str = "127.0.0.1", port: int | None = None, prefix: list[str] | None = None
    ) -> None:
        from srl.broker import free_port

        self.host = host
        self.port = port or free_port()
        self.prefix = prefix or []  # e.g. ["ip", "netns", "exec", NAME] to run it elsewhere
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> MotoServer:
        exe = str(Path(sys.executable).parent / "moto_server")
        self.proc = subprocess.Popen(
            [*self.prefix, exe, "-H", self.host, "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout_s
        while not self._answers():
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto_server exited with {self.proc.returncode}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"moto_server did not answer on {self.endpoint}")
            time.sleep(0.1)
        return self

    def _answers(self) -> bool:
        if not self.prefix:
            return _port_open(self.host, self.port)
        probe = [
            *self.prefix,
            sys.executable,
            "-c",
            f"import socket,sys; s=socket.socket(); s.settimeout(0.5); "
            f"sys.exit(s.connect_ex(({self.host!r}, {self.port})))",
        ]
        return subprocess.run(probe, capture_output=True).returncode == 0

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        pid = self.proc.pid
        try:
            os.killpg(pid, signal.SIGTERM)  # its own session: the group is moto and nothing else
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(pid, signal.SIGKILL)
            self.proc.wait(10)
        except ProcessLookupError:
            pass

    def make_bucket(self, name: str) -> None:
        import boto3

        client = boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            aws_access_key_id=TEST_CREDENTIALS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=TEST_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        )
        client.create_bucket(Bucket=name)

    def __enter__(self) -> MotoServer:
        return self.start()

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
