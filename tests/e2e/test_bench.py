"""``srl bench``: the real CLI at small sizes; checks the JSON shape and its arithmetic, not
speed."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from tests.e2e.test_cli import run


def test_bench_dataplane_json_on_both_brokers() -> None:
    """A fresh broker of each engine, one after the other, in one run: figures by broker."""
    out = run(
        "srl",
        "bench",
        "dataplane",
        "--trajectories",
        "40",
        "--mean-tokens",
        "64",
        "--batch",
        "8",
        "--paced-seconds",
        "1",
        "--warmup-seconds",
        "0.2",
        "--broker",
        "embedded",
        "--broker",
        "kafka",
        "--json",
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    res = orjson.loads(out.stdout)
    assert list(res) == ["embedded", "kafka"]
    for r in res.values():
        check_dataplane(r)


def test_bench_dataplane_on_a_given_broker(cli_env: dict[str, str]) -> None:
    """--bootstrap (here SRL_BOOTSTRAP_SERVERS): that broker only, keyed "external"."""
    args = ("--trajectories", "20", "--mean-tokens", "32", "--batch", "4", "--json")
    args += ("--paced-seconds", "0.5", "--warmup-seconds", "0", "--repeats", "2")
    out = run("srl", "bench", "dataplane", *args, env=cli_env, timeout=240)
    assert out.returncode == 0, out.stderr
    res = orjson.loads(out.stdout)
    assert list(res) == ["external"]
    check_dataplane(res["external"], trajectories=20)


def check_dataplane(r: dict, trajectories: int = 40) -> None:  # type: ignore[type-arg]
    for key in (
        "tokens_per_s",
        "trajectories_per_s",
        "raw_tokens_per_s",
        "ready_latency_ms_p50",
        "ready_latency_ms_p99",
    ):
        assert r[key] > 0, key
    assert r["ready_latency_ms_p50"] <= r["ready_latency_ms_p99"] <= r["ready_latency_ms_p999"]
    assert abs(r["overhead"] - (r["raw_tokens_per_s"] / r["tokens_per_s"] - 1)) < 1e-3
    raw = r["phases"]["raw"][0]
    codec = max(r["phases"]["codec"], key=lambda c: c["tokens_per_s"])  # the best counts
    pacedall = r["phases"]["paced"]
    paced = pacedall[0]
    assert len(pacedall) == r["settings"]["repeats"]
    # raw and codec move the same trajectories, chunks, tokens and bytes
    for key in ("trajectories", "chunks", "tokens", "bytes"):
        assert raw[key] == codec[key], key
    # the paced phase at least as many, long enough for its warm-up and measured seconds
    assert paced["trajectories"] >= codec["trajectories"]
    assert paced["latency_samples"] <= paced["trajectories"]
    for q in ("p50", "p99", "p999"):
        s = r["ready_latency_spread_ms"][q]
        assert s["min"] <= r[f"ready_latency_ms_{q}"] == s["median"] <= s["max"], q
    assert codec["trajectories"] == trajectories and codec["tokens"] > trajectories
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
    t = s["trainer"]  # the step waits for the snapshot; the upload is what it no longer waits
    assert 0 < t["step_wait_s"] == t["snapshot_s"] and t["upload_s"] > 0
    assert abs(t["step_wait_sync_s"] - t["snapshot_s"] - t["upload_s"]) < 2e-3
    parts = t["snapshot_s"] + t["upload_s"] + t["follower_fetch_verify_s"] + t["follower_load_s"]
    assert abs(t["e2e_s"] - parts) < 5e-3 and t["e2e_gb_per_s"] > 0


@pytest.mark.slow
def test_bench_trainer_json_at_the_test_models_size() -> None:
    args = ["--spec", "test", "--steps", "1", "--rows", "8", "--budget", "512", "--json"]
    out = run("srl", "bench", "trainer", *args, timeout=600)
    assert out.returncode == 0, out.stderr
    runs = orjson.loads(out.stdout)["runs"]
    assert [(x["backend"], x["ranks"]) for x in runs] == [("torch", 1), ("torch", 2), ("fsdp", 2)]
    for x in runs:
        assert x["tokens_per_s"] > 0 and len(x["peak_rss_mib"]) == x["ranks"], x
        assert x["plan_mib"] > 0 and all(p > 0 for p in x["peak_rss_mib"]), x
    # the plan shards the state: less a rank on two FSDP ranks than replicated on two
    assert runs[2]["plan_mib"] < runs[1]["plan_mib"]
    bad = run("srl", "bench", "trainer", "--backends", "megatron")
    assert bad.returncode != 0 and "--backends megatron" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_bench_intake_json() -> None:
    args = ["--trajectories", "16", "--tokens", "64", "--chunk-tokens", "16", "--reward-ms", "1"]
    out = run("srl", "bench", "intake", *args, "--json", timeout=120)
    assert out.returncode == 0, out.stderr
    r = orjson.loads(out.stdout)
    assert r["settings"]["records"] == 16 * 4
    i = r["intake"]
    assert i["records_per_s"] > 0 and abs(i["tokens_per_s"] / i["records_per_s"] - 16) < 1e-6
    assert set(r["rewards"]) == {"workers_0", "workers_2"}
    assert all(
        m["loop_ms_per_trajectory"] > 0 and m["rewards_per_s"] > 0 for m in r["rewards"].values()
    )


def test_bench_weights_rejects_unknown_size() -> None:
    out = run("srl", "bench", "weights", "--sizes", "7B")
    assert out.returncode != 0 and "unknown 7B" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.slow
def test_bench_pipeline_json_on_another_histogram(cli_env: dict[str, str], tmp_path: Path) -> None:
    hist = tmp_path / "short.csv"
    hist.write_text("# lo,hi,probability\n20,60,0.6\n60,200,0.3\n200,400,0.1\n")
    out = run(
        "srl",
        "bench",
        "pipeline",
        "--lengths",
        str(hist),
        "--scale",
        "1",
        "--groups",
        "3",
        "--group-size",
        "2",
        "--iterations",
        "3",
        "--devices",
        "3",
        "--compression",
        "20",
        "--model-bytes",
        "4e9",
        "--sync-rates",
        "publish=4,fetch=8,verify=8,load=8",
        "--bootstrap",
        cli_env["SRL_BOOTSTRAP_SERVERS"],
        "--json",
        env=cli_env,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    res = orjson.loads(out.stdout)
    assert list(res) == ["external"]  # the test's broker
    r = res["external"]
    assert r["simulated"] is True and r["time_compression"] == 20
    assert set(r["modes"]) == {"colocated", "sync", "stream", "async", "async+skew"}
    fields = (
        "samples_per_s",
        "trained_tokens_per_s",
        "generated_tokens",
        "trained_tokens",
        "dropped_token_fraction",
        "mean_generated_tokens",
        "mean_trained_tokens",
        "tokens_ratio_vs_colocated",
        "tokens_ratio_vs_sync",
        "fraction_of_bound",
        "gen_idle",
        "train_idle",
        "staleness_mean",
        "staleness_max",
    )
    means = set()
    for name, m in r["modes"].items():
        for key in fields:
            assert m[key] is not None, (name, key)
        assert m["samples_per_s"] > 0 and 0 <= m["gen_idle"] <= 1 and 0 <= m["train_idle"] <= 1
        for base in ("colocated", "sync"):
            b = r["modes"][base]["trained_tokens_per_s"]
            assert abs(m[f"tokens_ratio_vs_{base}"] - m["trained_tokens_per_s"] / b) < 0.01
        # the bound is what no schedule of the generated workload could beat: never above it
        assert 0 < m["fraction_of_bound"] <= 1.0, (name, m["fraction_of_bound"], m["bound_steps_s"])
        assert abs(m["fraction_of_bound"] - m["bound_s"] / m["run_s"]) < 0.01
        # every mode trains each step's own prompts: nothing dropped, the same mix
        assert m["dropped_stale"] == 0 and m["dropped_token_fraction"] == 0, name
        assert m["trained_tokens"] == m["generated_tokens"] and m["trained"] >= 3 * 3 * 2
        means.add(m["mean_trained_tokens"])
        split = m["split"]
        if name == "colocated":  # every device for each phase in turn
            assert split["instances"] == split["trainer_devices"] == 3
        else:  # the same resources for every disaggregated mode
            assert split["instances"] + split["trainer_devices"] == 3
        assert m["steps"] == 3
        assert m["staleness_max"] <= (0 if name in ("colocated", "sync", "stream") else 1)
        check_timeline(name, m)
    assert len(means) == 1, f"every mode trains the same prompts: {means}"
    sync = r["weights_sync"]
    assert sync["model_bytes"] == 4_000_000_000 and sync["rates_gb_per_s"]["publish"] == 4
    assert sync["seconds_per_version"] == {"publish": 1.0, "fetch": 0.5, "verify": 0.5, "load": 0.5}


def check_timeline(name: str, m: dict) -> None:  # type: ignore[type-arg]
    """The hand-off timeline: every step's segments are >= 0 and add up to its span."""
    charged = m["sync_charged_s"]
    assert charged["load"] == 0.5
    assert charged["publish"] == (0.0 if name == "colocated" else 1.0)
    t = m["timeline"]
    assert t["k"] == (0 if name in ("colocated", "sync", "stream") else 1)
    assert t["steps"], name
    for row in t["steps"]:
        parts = [row[n] for n in ("publish", "release", "admit", "first_chunk", "generate")]
        parts += [row["ready"], row["consume"]]
        assert min(parts) >= 0 and abs(sum(parts) - row["span_s"]) < 1e-3, (name, row)
    chain = t["step_chain"]
    segments = ("publish", "release", "admit", "first_chunk", "generate", "ready", "consume")
    assert abs(sum(chain[n]["share"] for n in segments) - 1) < 0.01
    assert chain["span"]["p50_sim_s"] > 0 and t["weights_chain"]["rows"] > 0


def test_bench_pipeline_bad_histogram_is_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("1,2\n")
    out = run("srl", "bench", "pipeline", "--lengths", str(bad), "--json", timeout=60)
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert (
        out.stderr.strip().splitlines()[-1].startswith("srl: error:")
        and "lo,hi,probability" in out.stderr
    )


def test_bench_idle_json() -> None:
    out = run(
        "srl",
        "bench",
        "idle",
        "--records",
        "30",
        "--bursts",
        "3",
        "--seconds",
        "2",
        "--broker",
        "embedded",
        "--broker",
        "kafka",
        "--json",
        timeout=240,
    )
    assert out.returncode == 0, out.stderr
    r = orjson.loads(out.stdout)
    for engine in ("embedded", "kafka"):
        fetching, quiet = r[engine]["rows"]
        assert (fetching["mode"], quiet["mode"]) == ("fetching", "quiet")
        for row in r[engine]["rows"]:
            assert row["records_read"] == 30 and row["each_once_in_order"], (engine, row)
            assert 0 <= row["delay_ms_p50"] <= row["delay_ms_p99"]
        ratio = quiet["broker_cores"] / max(fetching["broker_cores"], 1e-3)
        assert abs(r[engine]["broker_cpu_ratio"] - ratio) < 2e-3
