"""The sandbox's first process: ``python -m consumers.sandboxinit LIMITS_JSON DIR PROGRAM``.

Started by ``consumers.sandbox`` for each run of model-written code. In this order:

1. a process limit that binds: a caller that is not root gets ``RLIMIT_NPROC`` (below); the
   kernel exempts real root from it whatever the namespace, so a root caller first moves
   itself into a pids cgroup of its own (``pids.max``; ``sandbox_cgroup``), which every process
   of the run inherits; a root caller without one refuses the run;
2. new user, network and PID namespaces (``unshare(2)``): no interface but a loopback that is
   down, so no connection of any kind; a namespace that cannot be made refuses the run (exit
   ``REFUSED``), never runs the code without it;
3. ``fork``: the child is PID 1 of the new PID namespace, so when it exits the kernel kills
   every process it left (a fork bomb's included); it dies with this process
   (``PR_SET_PDEATHSIG``);
4. the child sets its limits (CPU seconds, address space, file size, processes, open files,
   no core files), enters the run's empty directory and executes ``python -I -S PROGRAM``
   (isolated: no user site, no environment, no current directory on the path);
5. this process waits for it and exits with its status (``128 + signal`` for a signal).

Standard library only: it runs before anything of the caller's could be trusted.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import signal
import sys

CLONE_NEWNET = 0x40000000
CLONE_NEWPID = 0x20000000
CLONE_NEWUSER = 0x10000000
PR_SET_PDEATHSIG = 1
REFUSED = 97  # the namespaces could not be made: the code did not run


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def isolate() -> str | None:
    """Enter new network and PID namespaces; why not, or None."""
    libc = _libc()
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWPID) != 0:
        return f"unshare: {os.strerror(ctypes.get_errno())}"
    with open("/proc/self/setgroups", "w") as f:  # this user is root inside, and only inside
        f.write("deny")
    with open("/proc/self/uid_map", "w") as f:
        f.write(f"0 {uid} 1")
    with open("/proc/self/gid_map", "w") as f:
        f.write(f"0 {gid} 1")
    return None


def pids_base() -> str | None:
    """This process's directory in a pids cgroup hierarchy (v1 ``pids``, or v2 with ``pids``
    delegated to its children), or None."""
    mounts = [line.split() for line in _read("/proc/mounts").splitlines()]
    groups = [line.strip().split(":", 2) for line in _read("/proc/self/cgroup").splitlines()]
    for _dev, point, kind, options, *_ in mounts:
        if kind == "cgroup" and "pids" in options.split(","):
            path = next((g[2] for g in groups if "pids" in g[1].split(",")), None)
        elif kind == "cgroup2":
            path = next((g[2] for g in groups if g[0] == "0"), None)
            sub = os.path.join(point + (path or ""), "cgroup.subtree_control")
            if path is None or "pids" not in _read(sub).split():
                continue
        else:
            continue
        if path is not None:
            return os.path.join(point, path.lstrip("/"))
    return None


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def sandbox_cgroup(launcher: int) -> str | None:
    """Where launcher ``launcher``'s pids cgroup is (or would be)."""
    base = pids_base()
    return None if base is None else os.path.join(base, f"srl-sandbox-{launcher}")


def enter_cgroup(processes: int) -> str | None:
    """Move this process into a new pids cgroup allowing ``processes`` more; why not, or None."""
    path = sandbox_cgroup(os.getpid())
    if path is None:
        return "no pids cgroup hierarchy to bound a root caller's processes"
    try:
        os.mkdir(path)
        with open(os.path.join(path, "pids.max"), "w") as f:
            f.write(str(processes + 1))  # and this process
        with open(os.path.join(path, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
    except OSError as e:
        return f"pids cgroup {path}: {e.strerror}"
    return None


def limit(limits: dict[str, int]) -> None:
    cpu = int(limits["cpu_s"])
    rlimits = {
        resource.RLIMIT_CPU: (cpu, cpu + 1),  # the hard limit is a SIGKILL
        resource.RLIMIT_AS: (limits["memory_bytes"],) * 2,
        resource.RLIMIT_FSIZE: (limits["file_bytes"],) * 2,
        resource.RLIMIT_NPROC: (limits["processes"],) * 2,
        resource.RLIMIT_NOFILE: (64, 64),
        resource.RLIMIT_CORE: (0, 0),
    }
    for what, value in rlimits.items():
        resource.setrlimit(what, value)


def child(limits: dict[str, int], workdir: str, program: str) -> None:
    _libc().prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    limit(limits)
    os.chdir(workdir)
    os.execve(sys.executable, [sys.executable, "-I", "-S", program], {"PATH": "/usr/bin:/bin"})


def main() -> None:
    limits, workdir, program = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
    _libc().prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # dies with its caller
    why = enter_cgroup(limits["processes"]) if os.geteuid() == 0 else None
    why = why or isolate()
    if why is not None:
        print(f"sandbox refused: {why}", file=sys.stderr, flush=True)
        os._exit(REFUSED)
    pid = os.fork()
    if pid == 0:
        try:
            child(limits, workdir, program)
        finally:
            os._exit(127)  # exec failed
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        os._exit(128 + os.WTERMSIG(status))
    os._exit(os.WEXITSTATUS(status))


if __name__ == "__main__":
    main()
