"""``srl demo`` end to end: real processes, the test broker, a user's own reward, Ctrl-C."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from tests.conftest import bin_path

# the embedded broker's tier (tests/conftest.py): what `make demo` runs on
pytestmark = pytest.mark.embedded

REWARD = '''
import os

def odd_length(prompt, completion, metadata):
    """A reward srl has never seen: it leaves a mark, and prefers odd-length answers."""
    with open(os.environ["MARK_FILE"], "a") as f:
        f.write(prompt + "\\n")
    return float(len(completion.strip()) % 2)
'''


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is not alive; /proc tells
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def _pids(out: Path) -> list[int]:
    """The roles' pids, from the demo's log lines."""
    return [
        int(line.split("(pid ")[1].split(")")[0])
        for line in out.read_text().splitlines()
        if "(pid " in line
    ]


def _demo(tmp_path: Path, cli_env: dict[str, str], tiny_model: Path, *args: str) -> list[str]:
    """The demo run from ``tmp_path`` with --model relative to it (the roles run elsewhere)."""
    link = tmp_path / "policy0"
    if not link.exists():
        link.symlink_to(tiny_model, target_is_directory=True)
    # a small held-out set, no intermediate evaluations and steps of 4 groups of 4 (the demo's
    # are 8 of 8) keep the test short on a busy machine
    (tmp_path / "demo.toml").write_text(
        "[demo]\neval_prompts = 32\neval_every = 0\ngroup_size = 4\ngroups_per_step = 4\n"
    )
    return [
        bin_path("srl"),
        "-v",
        "demo",
        "--out",
        str(tmp_path / "demo"),
        "--model",
        "policy0",
        "--config",
        str(tmp_path / "demo.toml"),
        "--steps",
        "3",
        *args,
    ]


def _run_to_end(
    tmp_path: Path, env: dict[str, str], tiny_model: Path, *args: str
) -> tuple[dict[str, Any], dict[str, Any], Path]:
    """Run the demo to its end (exit 0): (what --json printed, report.json, the demo's log)."""
    log, out = tmp_path / "demo.log", tmp_path / "demo.json"
    with log.open("w") as f, out.open("wb") as o:
        proc = subprocess.Popen(
            [*_demo(tmp_path, env, tiny_model, *args), "--json"],
            env=env,
            stdout=o,
            stderr=f,
            cwd=tmp_path,
        )
    try:
        rc = proc.wait(900)
    finally:
        leaked = _stop(proc, log)
    assert rc == 0, log.read_text()[-3000:]
    assert not leaked, f"roles still running after the demo ended: {leaked}"
    report = orjson.loads((tmp_path / "demo" / "report.json").read_bytes())
    return orjson.loads(out.read_bytes()), report, log


def _stop(proc: subprocess.Popen[bytes], log: Path) -> list[int]:
    """Whatever happened: let the demo stop its roles (SIGINT), then kill what is left.

    Returns the roles still alive once the demo itself had ended (they are killed)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    leaked = [p for p in _pids(log) if _alive(p)]
    for pid in _pids(log):  # never leave a role behind
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
    return leaked


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_demo_runs_every_role_with_a_users_reward_and_audits_the_run(
    tmp_path: Path, cli_env: dict[str, str], tiny_model: Path
) -> None:
    (tmp_path / "userreward.py").write_text(REWARD)
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)
    env = cli_env | {"PYTHONPATH": path, "MARK_FILE": str(tmp_path / "marks")}
    printed, report, log = _run_to_end(
        tmp_path, env, tiny_model, "--reward", "userreward:odd_length"
    )
    assert printed["lost"] == report["lost"] == 0
    assert report["steps"] == 3 and report["policy_versions"] == 3
    assert report["trajectories_trained"] > 0
    assert (
        report["trajectories_generated"]
        == report["trajectories_trained"]
        + report["dropped_stale"]
        + report["failed"]
        + report["pending_at_stop"]
    )
    assert report["decided_twice"] == 0
    # async, k = 1: no trained sample is more than one version stale, and since each step
    # trains the prompts released for it, none is dropped as stale either
    assert report["max_staleness"] <= 1 and max(int(k) for k in report["staleness_hist"]) <= 1
    assert report["dropped_stale"] == 0
    # the user's reward ran in the trainer, and its values are what the trainer reports
    assert (tmp_path / "marks").exists() and (tmp_path / "marks").read_text().count("=") > 0
    assert 0.0 < report["reward_first"] < 1.0
    for key in ("eval_accuracy_before", "eval_accuracy_after", "wall_s", "tokens_per_s"):
        assert report[key] is not None
    assert (tmp_path / "demo" / "report.png").stat().st_size > 10_000
    assert (tmp_path / "demo" / "final-model" / "config.json").exists()
    assert len(_pids(log)) == 4  # four roles started, all gone when it ended (_run_to_end)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_ctrl_c_stops_every_process_and_still_writes_the_report(
    tmp_path: Path, cli_env: dict[str, str], tiny_model: Path
) -> None:
    log = tmp_path / "demo.log"
    with log.open("w") as f:
        proc = subprocess.Popen(
            _demo(tmp_path, cli_env, tiny_model, "--steps", "500"),
            env=cli_env,
            stdout=f,
            stderr=subprocess.STDOUT,
            cwd=tmp_path,
            # as in a terminal: a suite started in the background (``cmd &`` in a script)
            # ignores SIGINT, and a Python child keeps an inherited ignore (stop 25's failure)
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
    try:
        deadline = time.monotonic() + 600
        trained = re.compile(r"^step [1-9]\d*/500", re.MULTILINE)  # progress skips steps
        while not trained.search(log.read_text()) and time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()[-3000:]
            time.sleep(0.5)
        assert trained.search(log.read_text()), log.read_text()[-3000:]
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(300)
    finally:
        leaked = _stop(proc, log)
    text = log.read_text()
    assert rc != 0 and "Traceback" not in text, text[-3000:]
    assert text.strip().splitlines()[-1].startswith("srl: error: interrupted")
    assert len(_pids(log)) == 4 and not leaked, leaked
    report = orjson.loads((tmp_path / "demo" / "report.json").read_bytes())
    assert report["status"] == "interrupted" and report["lost"] == 0


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_sync_mode_never_lets_a_generator_run_ahead_of_the_trainer(
    tmp_path: Path, cli_env: dict[str, str], tiny_model: Path
) -> None:
    """--mode sync (dispatcher barrier + trainer --sync-barrier): every chunk of every trained
    trajectory was sampled by exactly the version the trainer was updating (staleness 0, no
    drops), i.e. no generator ran ahead of the trainer."""
    _printed, report, _log = _run_to_end(tmp_path, cli_env, tiny_model, "--mode", "sync")
    assert report["steps"] == 3 and report["lost"] == 0 and report["dropped_stale"] == 0
    assert report["staleness_hist"] == {"0": report["trajectories_trained"]}
    assert report["trajectories_trained"] == 3 * 4 * 4
