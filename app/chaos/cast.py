"""The processes of a chaos run: every role, and the broker, started, signalled and stopped by pid.

Owns :class:`Cast`, a small supervisor: each role is a real subprocess (the installed
``srl-producer`` / ``srl-consumer`` / ``srl`` scripts) in its own session, optionally inside a
network namespace (``ip netns exec``, which execs, so the pid is the role's). What holds:

* only processes this run started are signalled, by their process group (== their pid);
* a role that exits non-zero on its own is restarted after ``RESTART_DELAY_S`` as a process
  manager would, and the exit is counted as a crash; one that exits 0 is finished (the
  trainer after its last step, the dispatcher after its last prompt);
* a role a fault holds down (killed, or stopped) is left alone until the fault restarts it;
* ``stop`` sends SIGTERM to everything still running, waits, then SIGKILLs what is left.

:class:`EmbeddedBroker` is the embedded broker as a killable process: ``srl.broker.start`` on
a fixed port and data directory, SIGKILL by pid, and a restart on the same port and data.
:class:`KafkaBroker` is the same for Apache Kafka nodes (``srl.broker.apache.KafkaCluster``,
one or three): all of them SIGKILLed and restarted for ``broker-restart``, and one node at a
time for the cluster's own faults (``app.chaos.kafkafaults``). Both are a :class:`Broker`.
Used by ``app.chaos.run`` and the injectors of ``app.chaos.faults``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from srl.broker import apache, embedded

log = logging.getLogger("app.chaos")

RESTART_DELAY_S = 1.0  # a crashed role comes back after this long, as under a process manager
STOP_GRACE_S = 20.0


@dataclass
class Proc:
    """One role: how to start it and what became of it."""

    name: str
    argv: list[str]
    log_path: Path
    prefix: list[str] = field(default_factory=list)  # e.g. ["ip", "netns", "exec", NS]
    popen: subprocess.Popen[bytes] | None = None
    starts: int = 0
    crashes: list[tuple[float, int]] = field(default_factory=list)  # (wall time, exit code)
    held: bool = False  # a fault holds it down: the supervisor leaves it alone
    finished: bool = False  # exited 0 on its own
    exited_at: float | None = None

    @property
    def pid(self) -> int | None:
        return None if self.popen is None else self.popen.pid

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def tail(self, n: int = 8) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])


class Cast:
    """The roles of one run; see the module docstring."""

    def __init__(self, env: dict[str, str], cwd: Path) -> None:
        self.env, self.cwd = env, cwd
        self.procs: dict[str, Proc] = {}
        self.lock = threading.RLock()

    def add(self, proc: Proc) -> Proc:
        with self.lock:
            self.procs[proc.name] = proc
            self._spawn(proc)
        return proc

    def _spawn(self, p: Proc) -> None:
        p.log_path.parent.mkdir(parents=True, exist_ok=True)
        with p.log_path.open("ab") as out:
            out.write(f"\n--- start {p.starts + 1} at {time.strftime('%H:%M:%S')} ---\n".encode())
            out.flush()
            p.popen = subprocess.Popen(
                [*p.prefix, *p.argv],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=self.cwd,
                start_new_session=True,
            )
        p.starts += 1
        p.held, p.finished, p.exited_at = False, False, None
        log.info("started %s (pid %d)", p.name, p.popen.pid)

    def signal(self, name: str, sig: int) -> int | None:
        """Send ``sig`` to the role's process group; its pid, or None if it was not running."""
        with self.lock:
            p = self.procs[name]
            if not p.alive():
                return None
            assert p.popen is not None
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.popen.pid, sig)
            return p.popen.pid

    def kill(self, name: str) -> int | None:
        """SIGKILL the role and hold it down (``restart`` brings it back); its pid."""
        with self.lock:
            p = self.procs[name]
            p.held = True
            pid = self.signal(name, signal.SIGKILL)
            if p.popen is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.popen.wait(10)
            return pid

    def restart(self, name: str) -> None:
        with self.lock:
            p = self.procs[name]
            if p.alive():
                return
            self._spawn(p)

    def supervise(self) -> None:
        """Note roles that exited; restart the crashed ones (see the module docstring)."""
        now = time.time()
        with self.lock:
            for p in self.procs.values():
                if p.popen is None or p.held or p.finished:
                    continue
                rc = p.popen.poll()
                if rc is None:
                    continue
                if p.exited_at is None:
                    p.exited_at = now
                    if rc == 0:
                        p.finished = True
                        continue
                    p.crashes.append((now, rc))
                    log.warning("%s exited with %d:\n%s", p.name, rc, p.tail())
                elif now - p.exited_at >= RESTART_DELAY_S:
                    self._spawn(p)

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM every running role (SIGCONT first: a stopped one could not exit), wait up
        to ``grace_s``, then SIGKILL what is left."""
        with self.lock:
            running = [p for p in self.procs.values() if p.alive()]
            for p in running:
                p.held = True
                self.signal(p.name, signal.SIGCONT)
                self.signal(p.name, signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            for p in running:
                assert p.popen is not None
                try:
                    p.popen.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    log.warning("%s did not stop in %.0f s; killing it", p.name, grace_s)
                    self.signal(p.name, signal.SIGKILL)
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        p.popen.wait(10)
            for pid in self._strays():
                log.warning("killing pid %d: a role started as the run was interrupted", pid)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, 0)

    def _strays(self) -> list[int]:
        """Children of this process started for this cast (its directory in their command
        line) that are not its roles': a SIGTERM that lands between ``Popen`` returning and
        ``p.popen`` being set leaves one running after the run (found by
        tests/e2e/test_chaos.py::test_sigterm_stops_every_role_and_the_broker)."""
        known = {p.popen.pid for p in self.procs.values() if p.popen is not None}
        me, mark, out = os.getpid(), str(self.cwd), []
        for d in Path("/proc").iterdir():
            if not d.name.isdigit() or int(d.name) in known:
                continue
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except (OSError, ValueError, IndexError):
                continue
            if ppid == me and mark in cmd:
                out.append(int(d.name))
        return out

    def crashes(self) -> dict[str, int]:
        with self.lock:
            return {p.name: len(p.crashes) for p in self.procs.values() if p.crashes}


class Broker(Protocol):
    """The suite's broker: where it listens, and a SIGKILL of all of it and a restart."""

    name: str  # "embedded", or "kafka" with its node count
    data_dir: Path

    @property
    def bootstrap(self) -> str: ...

    @property
    def ports(self) -> list[int]: ...  # every port a client connects to (the netns relays)

    def start(self) -> None: ...  # start what is not running, on its ports and data

    def kill(self) -> None: ...  # SIGKILL all of it

    def stop(self) -> None: ...

    def pids(self) -> list[int]: ...  # its processes now

    def data_dirs(self) -> list[Path]: ...  # where it keeps its records


class EmbeddedBroker:
    """The embedded broker as a process the suite may SIGKILL and restart (same port, data)."""

    name = "embedded"

    def __init__(self, data_dir: Path, port: int | None = None) -> None:
        self.data_dir = data_dir
        self.port = port or embedded.free_port()
        self.pid: int | None = None

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def ports(self) -> list[int]:
        return [self.port]

    def start(self) -> None:
        if self.pid is None:
            self.pid = embedded.start(self.port, self.data_dir).pid

    def kill(self) -> None:
        """SIGKILL by pid, then reap it (it is our child) and forget its state file."""
        if self.pid is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(self.pid, 0)
        embedded.stop(self.data_dir)  # the pid is dead: only drops broker.json
        self.pid = None

    def stop(self) -> None:
        embedded.stop(self.data_dir)
        self.pid = None

    def pids(self) -> list[int]:
        return [] if self.pid is None else [self.pid]

    def data_dirs(self) -> list[Path]:
        return [self.data_dir / "data"]


class KafkaBroker:
    """Apache Kafka nodes (KRaft, each a broker and a controller) in ``data_dir``."""

    def __init__(self, data_dir: Path, nodes: int) -> None:
        self.cluster = apache.KafkaCluster(data_dir, nodes=nodes)
        self.data_dir = data_dir
        self.name = f"kafka ({nodes} node{'s' if nodes > 1 else ''})"

    @property
    def bootstrap(self) -> str:
        return self.cluster.bootstrap

    @property
    def ports(self) -> list[int]:
        return [n.port for n in self.cluster.nodes]

    def start(self) -> None:
        self.cluster.start()

    def kill(self) -> None:
        for n in self.cluster.nodes:
            self.cluster.kill(n.node_id)  # SIGKILL, and wait until it is gone

    def stop(self) -> None:
        for n in self.cluster.nodes:  # a node a fault left stopped would not take SIGTERM
            self.cluster.signal(n.node_id, signal.SIGCONT)
        self.cluster.stop()

    def pids(self) -> list[int]:
        return [n.pid for n in self.cluster.nodes if n.pid is not None and self.cluster.running(n)]

    def data_dirs(self) -> list[Path]:
        return [apache.node_dir(self.data_dir, n.node_id) / "data" for n in self.cluster.nodes]
