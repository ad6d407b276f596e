"""Disk full in the object store during a publish, with the real trainer (issue 18): the
trainer goes on, the store holds no half-written version, nothing is announced that is not
whole, the publish is retried once there is space, and every trajectory is trained.

The store lives on a small tmpfs mounted in a mount namespace of its own (``unshare -m``, so
nothing outlives the test); ``tests/diskfull.py`` runs inside it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from srl.config import CommonConfig
from srl.kafka import create_topics


def mount_namespace_unavailable() -> str | None:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return "a tmpfs in a mount namespace needs root and unshare"
    out = subprocess.run(["unshare", "-m", "true"], capture_output=True)
    return None if out.returncode == 0 else f"unshare -m refused: {out.stderr.decode()[:200]}"


@pytest.mark.slow
def test_a_full_store_disk_fails_publishes_not_the_trainer(
    cli_env: dict[str, str], tiny_model: Path, tmp_path: Path, bootstrap: str, prefix: str
) -> None:
    if why := mount_namespace_unavailable():
        pytest.skip(why)
    create_topics(CommonConfig(bootstrap_servers=bootstrap, topic_prefix=prefix))
    mnt, out = tmp_path / "mnt", tmp_path / "result.json"
    mnt.mkdir()
    argv = ["unshare", "-m", sys.executable, "-m", "tests.diskfull", "--dir", str(mnt)]
    argv += ["--model", str(tiny_model), "--out", str(out)]
    root = Path(__file__).resolve().parents[2]
    run = subprocess.run(argv, env=cli_env, cwd=root, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    r = orjson.loads(out.read_bytes())
    log = out.with_suffix(".log").read_text()
    assert r["rc"] == 0 and "Traceback" not in log, log[-3000:]
    assert r["refused"] >= 3, "the full disk refused publishes and checkpoints"
    assert "trained 14 steps" in r["last"] and "'trained': 28" in r["last"], r["last"]
    # nothing half-written stays; versions are contiguous (a refused one is retried)
    whole = r["whole_versions"]
    assert r["version_dirs"] == len(whole) and whole == list(range(1, len(whole) + 1))
    assert len(whole) >= 3, "publishing resumed once there was space"
    assert r["announced"] and r["announced_verified"] == r["announced"]
    assert set(r["announced"]) <= set(whole)
