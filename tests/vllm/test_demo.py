"""``srl demo --engine vllm`` end to end, every role a real process of this environment
(.venv-vllm): the dispatcher, both generator pools on srl's vLLM engine, the trainer. The
same audit as the hf engine's demo (tests/e2e/test_demo.py): nothing lost, nothing twice,
every released prompt trained, and every published version evaluated.

Short on purpose (2 steps of 4 groups of 4, 16 held-out prompts): each generator starts its
own vLLM engine (~10 s on 2 idle cores, more under load)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import orjson
import pytest

from tests.conftest import bin_path
from tests.e2e.test_demo import _pids, _stop

pytestmark = [pytest.mark.embedded, pytest.mark.timeout(600)]

STEPS = 2


def test_the_demo_on_vllm_loses_nothing_and_evaluates_every_version(
    tmp_path: Path, cli_env: dict[str, str], vllm_model: Path
) -> None:
    (tmp_path / "demo.toml").write_text(
        "[demo]\neval_prompts = 16\neval_every = 1\ngroup_size = 4\ngroups_per_step = 4\n"
    )
    argv = [
        bin_path("srl"),
        "-v",
        "demo",
        "--engine",
        "vllm",
        "--out",
        str(tmp_path / "demo"),
        "--model",
        str(vllm_model),
        "--config",
        str(tmp_path / "demo.toml"),
        "--steps",
        str(STEPS),
        "--json",
    ]
    log, out = tmp_path / "demo.log", tmp_path / "demo.json"
    with log.open("w") as f, out.open("wb") as o:
        proc = subprocess.Popen(argv, env=cli_env, stdout=o, stderr=f, cwd=tmp_path)
    try:
        rc = proc.wait(480)
    finally:
        leaked = _stop(proc, log)
    assert rc == 0, log.read_text()[-3000:]
    assert not leaked, f"roles still running after the demo ended: {leaked}"
    printed = orjson.loads(out.read_bytes())
    report = orjson.loads((tmp_path / "demo" / "report.json").read_bytes())
    assert printed["engine"] == report["engine"] == "vllm"
    assert printed["lost"] == report["lost"] == 0
    assert report["duplicates_seen"] == 0 and report["decided_twice"] == 0
    assert report["steps"] == STEPS and report["policy_versions"] == STEPS
    assert report["trajectories_trained"] == STEPS * 4 * 4  # every released prompt's group
    assert report["dropped_stale"] == 0 and report["failed"] == 0
    assert [p["version"] for p in report["eval_curve"]] == list(range(STEPS + 1))
    for pool in ("gen-regular", "gen-longtail"):  # both pools ran srl's vLLM engine
        text = (tmp_path / "demo" / "logs" / f"{pool}.log").read_text()
        assert "engine vllm" in text and "vLLM" in text, text[-2000:]
    assert len(_pids(log)) == 4  # four roles started, all gone when it ended
