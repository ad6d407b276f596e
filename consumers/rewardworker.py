"""One reward process: ``python -m consumers.rewardworker module:function``.

Writes ``{"ready": true}`` once the reward is imported (its start is not part of any call's
timeout), then reads one JSON request a line on stdin (``{"prompt", "completion",
"metadata"}``) and writes one JSON answer a line (``{"reward": x}`` or ``{"error": why}``) to the
stdout it was started with.
What must hold:

* the reward's own prints cannot corrupt the answers: the answer stream is a private copy of
  fd 1, and fd 1 (``print``, C libraries) goes to stderr;
* it ends with the trainer: at EOF on stdin, and by the kernel (``PR_SET_PDEATHSIG``) if the
  trainer dies without closing it; SIGINT and SIGTERM sent to the trainer's process group
  (Ctrl-C) leave it to end that way, after the trainer;
* a reward that cannot be imported answers every request with that error (the trainer has
  imported it once already, so this is a broken environment, counted per sample, not a crash
  loop).

Started and killed (a call past ``--reward-timeout-s``) by ``consumers.rewardpool``.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import IO, Any

import orjson

from consumers.rewards import RewardFn, call_reward, load_reward
from srl.errors import ConfigError

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    if sys.platform != "linux":
        return
    import ctypes

    parent = os.getppid()
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # it ended before we asked
        os._exit(1)


def answer(fn: RewardFn | None, broken: str, line: bytes) -> dict[str, Any]:
    try:
        req = orjson.loads(line)
        prompt, completion, metadata = req["prompt"], req["completion"], req["metadata"]
    except (orjson.JSONDecodeError, KeyError, TypeError) as e:
        return {"error": f"bad request to the reward process: {e}"}
    if fn is None:
        return {"error": broken}
    s = call_reward(fn, prompt, completion, metadata)
    return {"reward": s.reward} if s.error is None else {"error": s.error}


def serve(spec: str, requests: IO[bytes], answers: IO[bytes]) -> None:
    fn: RewardFn | None = None
    broken = ""
    try:
        fn = load_reward(spec)
    except ConfigError as e:
        broken = f"reward process: {e}"
    answers.write(b'{"ready": true}\n')
    answers.flush()
    for line in requests:
        answers.write(orjson.dumps(answer(fn, broken, line)) + b"\n")
        answers.flush()


def main() -> None:
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    serve(sys.argv[1], sys.stdin.buffer, answers)


if __name__ == "__main__":
    main()
