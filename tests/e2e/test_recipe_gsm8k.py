"""docs/recipes/gsm8k.md, "The same on this machine", run as written: a GSM8K-format parquet
made by the block, the embedded broker, ``srl topics plan|create``, ``srl eval`` before, a
generator, the trainer with the math reward and the dispatcher reading the parquet, then
``srl eval`` of the run's newest version. It checks that the pipeline works (steps trained and
published, both reports written with their figures), not that anything was learnt."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from srl.broker import free_port
from tests.docs.blocks import ROOT, blocks_of

BIN = Path(sys.executable).parent
RECIPE = ROOT / "docs" / "recipes" / "gsm8k.md"
INIT = "srl init-model --out model/"


def local_block() -> str:
    """The shell block of the recipe's "The same on this machine" section."""
    text = RECIPE.read_text()
    start = text.index("## The same on this machine")
    line = text[:start].count("\n") + 1
    blocks = [b for b in blocks_of(RECIPE) if b.line > line and b.lang in ("sh", "bash")]
    assert blocks, "the recipe has no block under 'The same on this machine'"
    return blocks[0].text


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_the_recipe_runs_end_to_end_on_this_machine(tiny_model: Path, tmp_path: Path) -> None:
    script = local_block()
    assert INIT in script
    script = script.replace(INIT, f"cp -r {tiny_model} model/")  # the test's tiny model
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SRL_")}
    env.update(
        PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}",
        PYTHONUNBUFFERED="1",
        SRL_BROKER_PORT=str(port),
        SRL_BOOTSTRAP_SERVERS=f"127.0.0.1:{port}",
    )
    proc = subprocess.Popen(
        ["bash", "-e", "-c", script],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=360)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"the recipe still ran after 360 s:\n{output[-4000:]}")
    finally:
        _cleanup(proc.pid, tmp_path, env)
    assert proc.returncode == 0, output[-4000:]

    assert "kafka-topics" in output, f"srl topics plan printed no commands:\n{output[-2000:]}"
    versions = sorted((tmp_path / "runs/store/weights/gsm8k").glob("v*/manifest.json"))
    assert len(versions) >= 2, f"published versions: {versions}\n{output[-3000:]}"
    before = orjson.loads((tmp_path / "runs/gsm8k/eval-before.json").read_bytes())
    after = orjson.loads((tmp_path / "runs/gsm8k/eval-after.json").read_bytes())
    assert before["version"] == 0 and before["model"] == "model/"
    assert after["run"] == "gsm8k" and after["version"] == int(versions[-1].parent.name[1:])
    for rep in (before, after):
        assert rep["prompts"] == 6 and rep["reward"] == "consumers.rewards:math_answer"
        assert rep["greedy"]["completions"] == 6 and rep["greedy"]["reward_failures"] == 0
        assert 0.0 <= rep["greedy"]["pass@1"] <= 1.0
    assert set(after["sampled"]["pass@k"]) == {"1", "4"}
    assert after["sampled"]["completions"] == 24


def _cleanup(pid: int, where: Path, env: dict[str, str]) -> None:
    """Whatever the block left running (its process group), then the broker it started."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    if (where / ".srl" / "broker").is_dir():
        subprocess.run(
            [str(BIN / "srl"), "broker", "stop", "--data-dir", ".srl/broker"],
            cwd=where,
            env=env,
            capture_output=True,
            timeout=60,
        )
    shutil.rmtree(where / "model", ignore_errors=True)
