"""The real trainer on an object store whose filesystem fills up mid-run (issue 18).

Run inside its own mount namespace (``unshare -m``, root), so the small tmpfs it mounts goes
away with it: ``python -m tests.diskfull --dir D --model M --out F`` with ``SRL_BOOTSTRAP_SERVERS``
and ``SRL_TOPIC_PREFIX`` set. In order: a tmpfs at ``D``, the store on it; a few groups; the
trainer (``srl-consumer train``) until it has published v1; then a ballast file fills the disk,
more groups arrive and publishes and checkpoints fail; the ballast goes, the last groups
arrive, the trainer trains them and exits after its 14th step. Then the store and the weights
topic are checked and a JSON summary written to ``F`` (the tmpfs is gone once this process
ends). Used by ``tests/e2e/test_disk_full.py``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson

from srl.config import CommonConfig
from srl.errors import WeightsError
from srl.stores import open_store
from srl.topics import Layout
from srl.weights import fetch_tensors, load_manifest, read_announcements
from tests.chunks import produce
from tests.integration.test_trainer import make_groups

REFUSED = "failed, training goes on"


def wait(what: Any, timeout_s: float, why: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not what():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {why}")
        time.sleep(0.1)


def fill(path: Path) -> None:
    """Write ``path`` until the filesystem is full."""
    with open(path, "wb", buffering=0) as f:
        try:
            while True:
                f.write(bytes(64 * 1024))
        except OSError:
            pass


def trainer(model: str, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    args = [str(Path(sys.executable).parent / "srl-consumer"), "-v", "train", "--model", model]
    args += ["--groups-per-step", "1", "--batching", "groups", "--max-staleness", "100"]
    args += ["--micro-batch-tokens", "64", "--lr", "1e-3", "--device", "cpu"]
    # 14 groups, one a step: done at step 14 (the idle exit only ends a trainer that stops short)
    args += ["--keep-checkpoints", "1", "--max-steps", "14", "--idle-exit-s", "8"]
    args += ["--keep-versions", "0"]  # the audit verifies every version announced
    args += ["--reward", "consumers.rewards:first_line_match"]
    with log.open("ab") as out:
        return subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT)


def audit(cfg: CommonConfig, store_url: str) -> dict[str, Any]:
    """Every version in the store whole and verified; every announcement pointing at one."""
    store = open_store(store_url)
    keys = store.list("weights/default/")
    dirs = sorted({k.split("/")[2] for k in keys})
    whole = [d for d in dirs if f"weights/default/{d}/manifest.json" in keys]
    anns = [a for a in read_announcements(cfg, Layout.from_config(cfg)) if a.run == "default"]
    verified = []
    for a in anns:
        try:
            fetch_tensors(store, load_manifest(store, a))
            verified.append(a.version)
        except WeightsError as e:
            print(f"announced v{a.version} does not verify: {e}", file=sys.stderr)
    return {
        "version_dirs": len(dirs),
        "whole_versions": [int(d[1:]) for d in whole],
        "announced": [a.version for a in anns],
        "announced_verified": verified,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--size", default="32m")
    args = ap.parse_args()
    root = Path(args.dir)
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={args.size}", "tmpfs", str(root)], check=True
    )
    store_url = f"file://{root / 'store'}"
    env = {**os.environ, "SRL_STORE": store_url, "PYTHONUNBUFFERED": "1"}
    cfg = CommonConfig(
        bootstrap_servers=env["SRL_BOOTSTRAP_SERVERS"], topic_prefix=env["SRL_TOPIC_PREFIX"]
    )
    log = Path(args.out).with_suffix(".log")
    by_prompt: dict[str, list[Any]] = {}
    for c in make_groups(14, n=2, seed=1):
        by_prompt.setdefault(c.prompt_id, []).append(c)
    groups = iter(by_prompt.values())
    produce(cfg, [c for _ in range(4) for c in next(groups)])
    proc = trainer(args.model, env, log)
    manifest = root / "store/weights/default/v00000001/manifest.json"
    wait(manifest.exists, 120, "v1")
    fill(root / "ballast")  # the disk is full from here on
    produce(cfg, [c for _ in range(6) for c in next(groups)])
    wait(lambda: log.read_text().count(REFUSED) >= 3, 120, "refused writes")
    (root / "ballast").unlink()
    produce(cfg, [c for _ in range(4) for c in next(groups)])
    rc = proc.wait(300)
    text = log.read_text()
    result = {"rc": rc, "refused": text.count(REFUSED), "last": text.strip().splitlines()[-1]}
    result |= audit(cfg, store_url)
    Path(args.out).write_bytes(orjson.dumps(result))


if __name__ == "__main__":
    main()
