"""The built-in code reward (``consumers.rewards:code_tests``): the fraction of a task's tests
that a completion's program passes, run in the sandbox (``consumers.sandbox``).

What must hold:

* the program is the completion's last fenced code block (```` ```python ```` or a bare
  ```` ``` ````), else the whole completion; the tests are ``metadata["tests"]``, a list of
  Python snippets (typically ``assert f(2) == 4``) or one string;
* one sandboxed run a completion: the harness executes the program as ``__main__``'s module
  body, then each test in a copy of its namespace, and prints one result line per test,
  prefixed by a nonce it read (and deleted) from a file before any of the program ran; the
  reward is the passed tests over all (0.0 when the program itself fails, exits or is killed;
  tests after a kill count as failed);
* what the run may use: ``metadata["time_limit_s"]`` (default 10 s wall, half of it CPU) and
  ``metadata["memory_mb"]`` (default 1024), the sandbox's other limits as they are;
* a sandbox that cannot be made here raises ``SandboxRefused``: the sample fails
  (``failed_reward``, the reason in the sample event), model code never runs unconfined.

A program written to game the harness (reading the nonce out of the harness's frame) can; the
sandbox bounds what it can do to the machine, not what it can claim. Pure apart from the run.
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Any

from consumers.sandbox import Limits, run

FENCE = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL)
HARNESS = r"""
import json, os
nonce = open("nonce").read().strip()
os.remove("nonce")
tests = json.load(open("tests.json"))
space = {"__name__": "__main__"}
try:
    exec(compile(open("solution.py").read(), "solution.py", "exec"), space)
except BaseException as e:
    print(nonce, "program", type(e).__name__, flush=True)
    raise SystemExit(0)
for i, test in enumerate(tests):
    try:
        exec(compile(test, f"test_{i}", "exec"), dict(space))
        ok = 1
    except BaseException:
        ok = 0
    print(nonce, "test", i, ok, flush=True)
"""


def program_of(completion: str) -> str:
    """The completion's last fenced code block, else the completion."""
    blocks = FENCE.findall(completion)
    return blocks[-1] if blocks else completion


def tests_of(metadata: dict[str, Any]) -> list[str]:
    if "tests" not in metadata:
        raise KeyError("metadata has no 'tests'")
    tests = metadata["tests"]
    tests = [tests] if isinstance(tests, str) else list(tests)
    if not tests or not all(isinstance(t, str) for t in tests):
        raise ValueError("metadata 'tests' must be a string or a non-empty list of strings")
    return tests


def passed(stdout: bytes, nonce: str, n: int) -> int:
    """Tests the harness reported as passed (a line of another prefix counts for nothing)."""
    ok: set[int] = set()
    for line in stdout.decode(errors="replace").splitlines():
        parts = line.split()
        mine = len(parts) == 4 and parts[0] == nonce and parts[1] == "test"
        if mine and parts[3] == "1" and parts[2].isdigit() and int(parts[2]) < n:
            ok.add(int(parts[2]))
    return len(ok)


def code_tests(prompt: str, completion: str, metadata: dict[str, Any]) -> float:
    """Passed tests over all, in the sandbox."""
    tests = tests_of(metadata)
    wall = float(metadata.get("time_limit_s", 10))
    limits = Limits(
        cpu_s=max(1, int(wall / 2)),
        wall_s=wall,
        memory_bytes=int(metadata.get("memory_mb", 1024)) << 20,
    )
    nonce = secrets.token_hex(16)
    files = {
        "harness.py": HARNESS,
        "solution.py": program_of(completion),
        "tests.json": json.dumps(tests),
        "nonce": nonce,
    }
    out = run(files, "harness.py", limits)
    return passed(out.stdout, nonce, len(tests)) / len(tests)
