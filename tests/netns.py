"""Three datacenters on one machine: network namespaces joined by delayed, rate-capped links.

```
  dc "broker" (Kafka + S3)        dc "gen" (dispatcher, generators)     dc "train" (trainer)
     eth0 198.18.1.2                  eth0 198.18.2.2                     eth0 198.18.3.2
          │ tbf                             │ tbf                                │ tbf
     w1 198.18.1.1 ──────────── router namespace "wan" ─── w2 198.18.2.1 ─── w3 198.18.3.1
                       every packet between links goes through the TUN delay line
                       (tests/delayline.py): DELAY ms one way, so RTT = 2 × DELAY
```

Addresses are from 198.18.0.0/15, the range reserved for network benchmarks (RFC 2544), and
exist only inside these namespaces; nothing is set up in the root namespace. Namespace names
carry the creating pid so concurrent runs do not collide. ``cut(dc)`` / ``heal(dc)`` partition a
datacenter from the others and join it again. ``Topology`` is a context manager:
on exit it kills the processes it started (by pid, SIGTERM then SIGKILL) and deletes the
namespaces, which removes their links.

``netns_unavailable()`` returns the reason the harness cannot run here (not root, no ``ip``,
no TUN device, namespaces refused), or None. Used by ``tests/e2e/test_datacenters.py`` and
``tests/crossdc_bench.py``.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from types import TracebackType

ROOT = Path(__file__).resolve().parents[1]
DCS = {"broker": 1, "gen": 2, "train": 3}


def sh(*args: str) -> None:
    out = subprocess.run(args, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: {out.stderr.strip()}")


def netns_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    if not os.path.exists("/dev/net/tun"):
        return "no /dev/net/tun for the delay line"
    name = f"srl-probe-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    try:
        sh("ip", "netns", "add", name)
        sh("ip", "-n", name, "tuntap", "add", "dev", "probe0", "mode", "tun")
        sh("ip", "-n", name, "link", "add", "pa", "type", "veth", "peer", "name", "pb")
        sh(
            "ip",
            "netns",
            "exec",
            name,
            "tc",
            "qdisc",
            "add",
            "dev",
            "pa",
            "root",
            "tbf",
            "rate",
            "10mbit",
            "burst",
            "32kb",
            "latency",
            "100ms",
        )
    except RuntimeError as e:
        return f"cannot build the namespaces here: {e}"
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


class Topology:
    def __init__(self, delay_ms: float, rate_mbit: float) -> None:
        tag = f"{os.getpid()}-{uuid.uuid4().hex[:4]}"
        self.delay_ms = delay_ms
        self.rate_mbit = rate_mbit
        self.wan = f"srl-wan-{tag}"
        self.ns = {dc: f"srl-{dc}-{tag}" for dc in DCS}
        self.procs: list[subprocess.Popen[bytes]] = []

    def ip(self, dc: str) -> str:
        return f"198.18.{DCS[dc]}.2"

    def prefix(self, dc: str) -> list[str]:
        """The command prefix that runs a program in datacenter ``dc``."""
        return ["ip", "netns", "exec", self.ns[dc]]

    def up(self) -> Topology:
        w = self.wan
        created: list[str] = []
        try:
            for name in [w, *self.ns.values()]:
                sh("ip", "netns", "add", name)
                created.append(name)
                sh("ip", "-n", name, "link", "set", "lo", "up")
            for name, value in [
                ("net.ipv4.ip_forward", "1"),
                ("net.ipv4.conf.all.rp_filter", "0"),
                ("net.ipv4.conf.default.rp_filter", "0"),
            ]:
                sh("ip", "netns", "exec", w, "sysctl", "-qw", f"{name}={value}")
            sh("ip", "-n", w, "tuntap", "add", "dev", "dl0", "mode", "tun")
            sh("ip", "-n", w, "link", "set", "dl0", "up")
            sh("ip", "-n", w, "route", "add", "default", "dev", "dl0", "table", "100")
            for dc, i in DCS.items():
                ns, link = self.ns[dc], f"w{i}"
                sh(
                    "ip",
                    "-n",
                    w,
                    "link",
                    "add",
                    link,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    "eth0",
                    "netns",
                    ns,
                )
                sh("ip", "-n", w, "addr", "add", f"198.18.{i}.1/24", "dev", link)
                sh("ip", "-n", w, "link", "set", link, "up")
                sh("ip", "-n", w, "rule", "add", "iif", link, "lookup", "100")
                sh("ip", "-n", ns, "addr", "add", f"198.18.{i}.2/24", "dev", "eth0")
                sh("ip", "-n", ns, "link", "set", "eth0", "up")
                sh("ip", "-n", ns, "route", "add", "default", "via", f"198.18.{i}.1")
                for where, dev in ((ns, "eth0"), (w, link)):  # the cap, both directions
                    sh(
                        "ip",
                        "netns",
                        "exec",
                        where,
                        "tc",
                        "qdisc",
                        "add",
                        "dev",
                        dev,
                        "root",
                        "tbf",
                        "rate",
                        f"{self.rate_mbit:g}mbit",
                        "burst",
                        "64kb",
                        "latency",
                        "200ms",
                    )
            self.start(
                "wan",
                [
                    sys.executable,
                    "-m",
                    "tests.delayline",
                    "--dev",
                    "dl0",
                    "--delay-ms",
                    f"{self.delay_ms:g}",
                ],
            )
        except BaseException:
            self.down()
            raise
        return self

    def cut(self, dc: str) -> None:
        """Partition datacenter ``dc`` from the others: its link's router end goes down, so every
        packet to or from it is dropped silently (no reset, no unreachable) until :meth:`heal`."""
        sh("ip", "-n", self.wan, "link", "set", f"w{DCS[dc]}", "down")

    def heal(self, dc: str) -> None:
        sh("ip", "-n", self.wan, "link", "set", f"w{DCS[dc]}", "up")

    def start(
        self, dc: str, argv: list[str], env: dict[str, str] | None = None, log: Path | None = None
    ) -> subprocess.Popen[bytes]:
        """Run ``argv`` in datacenter ``dc`` ("wan" for the router), in its own session."""
        ns = self.wan if dc == "wan" else self.ns[dc]
        out = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115 (closed in down)
        proc = subprocess.Popen(
            ["ip", "netns", "exec", ns, *argv],
            env=env,
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        if log:
            proc._srl_log = out  # type: ignore[attr-defined]
        self.procs.append(proc)
        return proc

    def run(
        self, dc: str, argv: list[str], env: dict[str, str] | None = None, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["ip", "netns", "exec", self.ns[dc], *argv],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def stop(self, proc: subprocess.Popen[bytes], grace_s: float = 15.0) -> int:
        """SIGTERM the process group of ``proc`` (SIGKILL after ``grace_s``); its exit code."""
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
            except ProcessLookupError:
                proc.wait(10)
        log = getattr(proc, "_srl_log", None)
        if log is not None:
            log.close()
        return int(proc.returncode)

    def down(self) -> None:
        for proc in reversed(self.procs):
            self.stop(proc)
        self.procs.clear()
        for name in [*self.ns.values(), self.wan]:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)

    def __enter__(self) -> Topology:
        return self.up()

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.down()
