"""Every shell block of README.md and docs/*.md runs as a user would type it (issue 34).

The marker convention and how a block runs: ``tests/docs/blocks.py``. Each block is one test,
named by its page and line: a runnable block passes when its script exits 0 (console blocks:
when it prints the output shown), a block marked not runnable here is skipped with its reason,
a block without a marker fails.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.conftest import shared_dir
from tests.docs.blocks import ROOT, Block, all_blocks, script

BIN = Path(sys.executable).parent


def params() -> list[object]:
    out: list[object] = []
    for b in all_blocks():
        # pytest-timeout leaves room for the block's own bound and its cleanup (and for the
        # session's demo model, which the first block that needs one builds)
        limit = b.timeout_s + (120 if not b.model else 420)
        marks = [pytest.mark.timeout(limit), *([pytest.mark.slow] if b.slow else [])]
        out.append(pytest.param(b, id=b.id, marks=marks))
    return out


def clone_view(where: Path) -> None:
    """Make ``where`` look like a clone's root: a symlink to each top-level tracked entry."""
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    for top in sorted({name.split("/", 1)[0] for name in tracked}):
        (where / top).symlink_to(ROOT / top)


def stop_group(pid: int) -> None:
    """Stop what the block's shell left running: its process group, TERM then KILL."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                os.killpg(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``srl init-model --steps 1``'s model, built once for every test process of the session
    (the first to ask builds it under a file lock)."""
    where = shared_dir(tmp_path_factory) / "docs-model"
    where.mkdir(parents=True, exist_ok=True)
    model = where / "strops-s0"
    with open(where / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (model / "WARMSTART.json").exists():
            subprocess.run(
                [str(BIN / "srl"), "init-model", "--steps", "1", "--out", str(model)],
                cwd=where,
                check=True,
                capture_output=True,
                timeout=600,
            )
    return model


@pytest.mark.parametrize("block", params())
def test_doc_block(block: Block, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    if block.action == "":
        pytest.fail(f"{block.id}: {block.reason}", pytrace=False)
    if block.action == "skip":
        pytest.skip(f"{block.id}: {block.reason}")
    from srl.broker import free_port

    port = free_port()
    text, expected = script(block, port)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SRL_")}
    env.update(
        PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}",
        VIRTUAL_ENV=str(BIN.parent),
        PYTHONUNBUFFERED="1",
        SRL_BROKER_PORT=str(port),
    )
    if "srl broker start" in text:
        env["SRL_BOOTSTRAP_SERVERS"] = f"127.0.0.1:{port}"
    if block.broker:
        env["SRL_BOOTSTRAP_SERVERS"] = str(request.getfixturevalue("bootstrap"))
        env["SRL_TOPIC_PREFIX"] = f"d{uuid.uuid4().hex[:10]}"
    work = tmp_path / "clone"
    work.mkdir()
    clone_view(work)
    if block.model:
        shutil.copytree(request.getfixturevalue("demo_model"), work / "runs/models/strops-s0")
    proc = subprocess.Popen(
        ["bash", "-e", "-c", text],
        cwd=work,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    timed_out = False
    try:
        output, _ = proc.communicate(timeout=block.timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        stop_group(proc.pid)
        output, _ = proc.communicate()
    finally:
        stop_group(proc.pid)
        if (work / ".srl" / "broker").is_dir():
            with contextlib.suppress(subprocess.TimeoutExpired):
                subprocess.run(
                    [str(BIN / "srl"), "broker", "stop", "--data-dir", ".srl/broker"],
                    cwd=work,
                    env=env,
                    capture_output=True,
                    timeout=60,
                )
    tail = output[-4000:]
    if timed_out:
        pytest.fail(f"{block.id}: still running after {block.timeout_s:.0f} s\n{tail}", False)
    if proc.returncode != 0 and block.lang != "console":
        pytest.fail(f"{block.id}: exit {proc.returncode}\n{tail}", pytrace=False)
    missing = [line for line in expected if line not in output]
    if missing:
        pytest.fail(f"{block.id}: output lacks {missing!r}\n{tail}", pytrace=False)
