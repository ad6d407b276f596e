"""The code sandbox contains what model-written code may try, each within its limit, and the
code reward scores the tests a program passes."""

from __future__ import annotations

import os
import socket
import sys
import time

import pytest

from consumers.coderewards import code_tests, passed, program_of
from consumers.sandbox import Limits, SandboxRefused, run
from consumers.sandboxinit import pids_base


def refused() -> str | None:
    """Why the sandbox cannot be made on this machine (then these tests skip with it)."""
    if sys.platform != "linux":
        return "the sandbox is Linux-only"
    try:
        run({"main.py": "pass"}, "main.py")
    except SandboxRefused as e:
        return str(e)
    return None


WHY = refused()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"no sandbox here: {WHY}")
FAST = Limits(cpu_s=2, wall_s=4.0, memory_bytes=512 << 20, processes=16, output_bytes=64 << 10)


def sandboxed(code: str, limits: Limits = FAST):  # type: ignore[no-untyped-def]
    return run({"main.py": code}, "main.py", limits)


def test_a_plain_program_runs_and_its_output_comes_back() -> None:
    r = sandboxed("print(6 * 7)")
    assert (r.status, r.stdout, r.killed) == (0, b"42\n", None)


def test_an_infinite_loop_is_killed_within_its_cpu_or_wall_limit() -> None:
    r = sandboxed("while True:\n    pass")
    assert r.status == 128 + 9 and r.seconds < FAST.wall_s + 2


def test_a_fork_bomb_stops_at_the_process_limit_and_leaves_nothing() -> None:
    code = (
        "import os, time\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n"
        "            time.sleep(60)\n            os._exit(0)\n        n += 1\n"
        "except OSError:\n    print(n, flush=True)\n"
    )
    r = sandboxed(code)
    assert r.status == 0 and int(r.stdout) < FAST.processes, r
    assert r.seconds < FAST.wall_s, "refused at the limit, not killed by the clock"
    time.sleep(0.5)  # the kernel ends the namespace's processes with its PID 1
    base = pids_base()
    if base is not None and os.geteuid() == 0:
        assert not [n for n in os.listdir(base) if n.startswith("srl-sandbox-")]


def test_a_10_gb_allocation_fails_inside() -> None:
    r = sandboxed("x = bytearray(10 * 1024**3)\nprint('allocated')")
    assert r.status == 1 and b"MemoryError" in r.stderr and b"allocated" not in r.stdout


def test_a_1_gb_print_is_cut_at_the_output_cap() -> None:
    r = sandboxed("import sys\nfor _ in range(1 << 14):\n    sys.stdout.write('x' * 65536)")
    assert r.killed == "output" and len(r.stdout) == FAST.output_bytes


def test_no_connection_leaves_the_sandbox() -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('in')"
    r = sandboxed(code)
    assert r.status == 1 and b"in" not in r.stdout and b"unreachable" in r.stderr.lower()
    server.setblocking(False)
    with pytest.raises(BlockingIOError):
        server.accept()  # nothing reached the host's loopback
    server.close()


def test_a_large_file_is_refused_and_the_directory_is_empty_and_removed() -> None:
    code = "import os\nprint(sorted(os.listdir('.')))\nopen('big', 'wb').write(b'x' * (64 << 20))"
    r = sandboxed(code, Limits(file_bytes=1 << 20, wall_s=4.0))
    assert r.stdout == b"['main.py']\n" and b"File too large" in r.stderr


def test_the_code_reward_is_the_fraction_of_tests_passed() -> None:
    completion = "Here:\n```python\ndef double(x):\n    return x * 2 if x < 10 else x\n```\n"
    tests = ["assert double(2) == 4", "assert double(3) == 6", "assert double(10) == 20"]
    assert code_tests("", completion, {"tests": tests}) == pytest.approx(2 / 3)
    assert program_of(completion).startswith("def double")
    # a program that exits at once, or prints fake results, passes nothing
    cheat = "print('x test 0 1')\nprint('x test 1 1')\nraise SystemExit(0)"
    assert code_tests("", cheat, {"tests": tests}) == 0.0
    assert passed(b"n test 0 1\nm test 1 1\nn test 7 1\n", "n", 3) == 1
    # a fork bomb or a loop in a test fails that test, within the limit
    bomb = "import os\ndef f():\n    while True:\n        os.fork()\n"
    meta = {"tests": ["f()", "assert 1 == 1"], "time_limit_s": 4}
    assert code_tests("", bomb, meta) == pytest.approx(1 / 2)
    with pytest.raises(KeyError):
        code_tests("", completion, {})
