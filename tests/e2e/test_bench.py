"""``srl bench``: the real CLI at small sizes; checks the JSON shape and its arithmetic, not speed."""

from __future__ import annotations

import orjson

from tests.e2e.test_cli import run


def test_bench_dataplane_json(cli_env: dict[str, str]) -> None:
    out = run("srl", "bench", "dataplane", "--trajectories", "40", "--mean-tokens", "64",
              "--batch", "8", "--json", env=cli_env, timeout=240)  # fmt: skip
    assert out.returncode == 0, out.stderr
    r = orjson.loads(out.stdout)
    for key in ("tokens_per_s", "trajectories_per_s", "raw_tokens_per_s",
                "ready_latency_ms_p50", "ready_latency_ms_p99"):  # fmt: skip
        assert r[key] > 0, key
    assert r["ready_latency_ms_p50"] <= r["ready_latency_ms_p99"]
    assert abs(r["overhead"] - (r["raw_tokens_per_s"] / r["tokens_per_s"] - 1)) < 1e-3
    raw, codec, paced = r["phases"]["raw"][0], r["phases"]["codec"][0], r["phases"]["paced"]
    # the three phases move the same trajectories, chunks, tokens and bytes
    for key in ("trajectories", "chunks", "tokens", "bytes"):
        assert raw[key] == codec[key] == paced[key], key
    assert codec["trajectories"] == 40 and codec["tokens"] > 40
    assert r["tokens_per_s"] == codec["tokens_per_s"]
    assert (
        abs(codec["tokens_per_s"] - codec["tokens"] / codec["wall_s"])
        <= 0.01 * codec["tokens_per_s"] + 1
    )
    assert paced["target_tokens_per_s"] == int(codec["tokens_per_s"] * 0.5)


def test_bench_weights_json() -> None:
    out = run("srl", "bench", "weights", "--sizes", "1M", "--swaps", "3", "--json", timeout=300)
    assert out.returncode == 0, out.stderr
    r = orjson.loads(out.stdout)
    (s,) = r["sizes"]
    assert s["params"] > 500_000 and s["bytes"] >= 2 * s["params"]  # bf16
    for key in ("publish_s", "fetch_verify_s", "load_s", "plain_copy_s"):
        assert s[key] > 0, key
    total = s["publish_s"] + s["fetch_verify_s"] + s["load_s"]
    assert abs(s["publish_load_s"] - total) < 2e-3
    assert abs(s["ratio"] - s["publish_load_s"] / s["plain_copy_s"]) <= 0.01 * s["ratio"] + 0.01
    assert r["swaps"] == 3 and 0 < r["swap_pause_ms"] <= r["swap_pause_ms_max"]


def test_bench_weights_rejects_unknown_size() -> None:
    out = run("srl", "bench", "weights", "--sizes", "7B")
    assert out.returncode != 0 and "unknown 7B" in out.stderr and "Traceback" not in out.stderr
