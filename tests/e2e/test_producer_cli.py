"""``srl-producer dispatch`` and ``generate`` as real subprocesses: SIGKILL, SIGTERM, bad input."""

from __future__ import annotations

import re
import signal
import subprocess
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from srl.config import CommonConfig, load_config
from srl.data import STREAMRL_LENGTHS
from srl.kafka import committed_offsets
from srl.topics import Layout, pool_group
from tests.conftest import bin_path
from tests.integration.test_generation import Trajectories, check_exactly_once


def run(*args: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [bin_path(args[0]), *args[1:]], capture_output=True, text=True, env=env, timeout=timeout
    )


@contextmanager
def worker(
    env: dict[str, str], model: Path, wid: str, log: Path, *extra: str
) -> Iterator[subprocess.Popen[str]]:
    """A ``srl-producer generate`` process; killed on exit if the test did not stop it."""
    args = [
        bin_path("srl-producer"),
        "-v",
        "generate",
        "--model",
        str(model),
        "--worker-id",
        wid,
        "--threads",
        "1",
        "--max-batch",
        "2",
        "--chunk-tokens",
        "8",
        "--buckets",
        "le1024",
        *extra,
    ]
    with open(log, "w") as out:
        proc = subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)


def balanced_prompts(path: Path, n: int) -> list[str]:
    """n prompt ids, half on each of the 2 prompt partitions (librdkafka hashes keys with CRC32)."""
    ids, per = [], {0: 0, 1: 0}
    i = 0
    while len(ids) < n:
        pid = f"q{i}"
        part = zlib.crc32(pid.encode()) % 2
        if per[part] < n // 2:
            ids.append(pid)
            per[part] += 1
        i += 1
    path.write_text(
        "".join(
            orjson.dumps({"prompt_id": p, "prompt": f"question {p}?"}).decode() + "\n" for p in ids
        )
    )
    return ids


def cfg_from_env(env: dict[str, str]) -> CommonConfig:
    return load_config(CommonConfig, env={k: v for k, v in env.items() if k.startswith("SRL_")})


def wait_running(*logs: Path, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not all("generator" in p.read_text() for p in logs):
        assert time.monotonic() < deadline, [p.read_text()[-2000:] for p in logs]
        time.sleep(0.2)


def until(
    t: Trajectories,
    what: Any,
    procs: dict[str, subprocess.Popen[str]],
    logs: dict[str, Path],
    timeout_s: float,
) -> None:
    """``t.wait`` that fails at once, with the log, if a worker process exits."""

    def check(t: Trajectories) -> bool:
        for name, p in procs.items():
            assert p.poll() is None, (
                f"{name} exited {p.returncode}: {logs[name].read_text()[-3000:]}"
            )
        return bool(what(t))

    t.wait(check, timeout_s=timeout_s)


def incomplete_of(t: Trajectories, wid: str) -> list[str]:
    """Trajectories of worker ``wid`` with at least two chunks published and no last chunk yet."""
    out = []
    for tid in t.chunks:
        cs = t.ordered(tid)
        if (
            cs[0].worker_id == wid
            and len(cs) >= 2
            and not cs[-1].is_last
            and sum(c.n_tokens for c in cs) < 250
        ):
            out.append(tid)
    return out


MEMBERSHIP = {
    # the pool assigns its partitions itself (pool epochs, producers.pool): any broker
    "pool-epochs": ({}, ()),
    # the pool's broker consumer group, classic protocol, and KIP-848 (group.protocol=consumer,
    # Apache Kafka 4.x): the broker evicts the dead member after its session timeout
    "classic-group": ({"SRL_POOL_LIVENESS": "false"}, ()),
    "kip848-group": ({"SRL_POOL_LIVENESS": "false"}, ("-X", "group.protocol=consumer")),
}


@pytest.mark.slow
@pytest.mark.parametrize(
    "membership",
    [
        "pool-epochs",
        # a broker group evicts a dead member on Apache Kafka only
        pytest.param("classic-group", marks=pytest.mark.kafka),
        pytest.param("kip848-group", marks=pytest.mark.kafka),
    ],
)
def test_sigkill_of_a_worker_mid_trajectory_is_resumed_by_another(
    cli_env: dict[str, str], tiny_model: Path, tmp_path: Path, membership: str
) -> None:
    """SIGKILL one of two workers; a supervisor-style restart joins; the dead one's work is resumed.

    The embedded noida-db 0.2.3 never evicts a dead group member (docs/reliability.md), so
    by default the pool assigns its partitions itself (pool epochs, ``producers.pool``): once
    the dead worker has been silent for the session timeout, the survivor and the newcomer
    share its partitions, whatever the broker. On Apache Kafka the pool's own consumer group
    does the same, classic or KIP-848 (``-X group.protocol=consumer``).
    """
    env, protocol = MEMBERSHIP[membership]
    cli_env = {**cli_env, **env}
    ids = balanced_prompts(tmp_path / "p.jsonl", 6)
    cfg = cfg_from_env(cli_env)
    assert run("srl", "topics", "create", env=cli_env).returncode == 0
    t = Trajectories(cfg)
    fast = ("-X", "max.poll.interval.ms=15000", *protocol)
    logs = {w: tmp_path / f"{w}.log" for w in ("wa", "wb", "wc")}
    with (
        worker(cli_env, tiny_model, "wa", logs["wa"], *fast) as wa,
        worker(cli_env, tiny_model, "wb", logs["wb"], *fast) as wb,
    ):
        wait_running(logs["wa"], logs["wb"])
        time.sleep(3)  # both members of the group
        out = run(
            "srl-producer",
            "dispatch",
            "--unpaced",
            "--partitioning",
            "key",
            "--prompts",
            str(tmp_path / "p.jsonl"),
            "--group-size",
            "4",
            "--max-new-tokens",
            "400",
            env=cli_env,
        )
        assert out.returncode == 0, out.stderr
        # the victim: whichever worker is mid-way through two trajectories first (a broker's
        # assignor may give one member every prompt partition)
        procs = {"wa": wa, "wb": wb}
        until(t, lambda t: any(len(incomplete_of(t, w)) >= 2 for w in procs), procs, logs, 60)
        dead = max(procs, key=lambda w: len(incomplete_of(t, w)))
        live = next(w for w in procs if w != dead)
        procs[dead].send_signal(signal.SIGKILL)
        assert procs[dead].wait(timeout=10) == -signal.SIGKILL
        # unfinished as far as the test had read at the kill: a lower bound of dead's progress
        seen_mid = set(incomplete_of(t, dead))
        with worker(cli_env, tiny_model, "wc", logs["wc"], *fast) as wc:
            rest = {live: procs[live], "wc": wc}
            until(t, lambda t: len(t.complete()) == 24, rest, logs, 150)
            for w in rest.values():
                w.send_signal(signal.SIGTERM)
            for name, w in rest.items():
                assert w.wait(timeout=60) == 0, logs[name].read_text()[-3000:]
    done = check_exactly_once(t, {(p, s) for p in ids for s in range(4)})
    assert t.duplicates == 0
    # What the killed worker left unfinished is read from the topic once everything is in, not
    # from what the test had read at the kill: its last chunks (a trajectory's last one among
    # them) may have been acknowledged by the broker and still on their way to the test then.
    # Others continued the numbering right after the killed one's last chunk (check_exactly_once:
    # seq 0..last once each). wc joining later moves partitions to it: a trajectory the survivor
    # resumed may be handed off to wc mid-way, so one or both of them write the rest
    started = {cs[0].trajectory_id: cs for cs in done.values() if cs[0].worker_id == dead}
    assert seen_mid <= set(started), "a trajectory the killed worker had started was not completed"
    resumed = []
    for cs in started.values():
        workers_in_order = [c.worker_id for c in cs]
        switch = next((i for i, w in enumerate(workers_in_order) if w != dead), len(cs))
        assert set(workers_in_order[switch:]) <= {live, "wc"}, workers_in_order
        if switch < len(cs):
            resumed.append(cs)
    assert resumed, "the killed worker's unfinished trajectories were not resumed"
    summaries = logs[live].read_text() + logs["wc"].read_text()
    assert re.search(r"resumed [1-9]", summaries), summaries[-3000:]


@pytest.mark.slow
def test_sigkill_then_a_replacement_under_a_new_group_resumes_the_dead_workers_trajectories(
    cli_env: dict[str, str], tiny_model: Path, tmp_path: Path
) -> None:
    """SIGKILL the pool's worker mid-trajectory; a replacement takes over the group's positions.

    Runs on every broker (the embedded one never evicts the dead member, so its group stays
    wedged; docs/broker.md): the replacement joins a new group with --take-over-from the old
    one, gets the uncommitted tasks redelivered, skips what is complete and resumes the dead
    worker's partial trajectories from their published prefix.
    """
    ids = balanced_prompts(tmp_path / "p.jsonl", 4)
    short = [f"s{i}" for i in range(4)]  # finished and committed before the kill
    (tmp_path / "s.jsonl").write_text(
        "".join(
            orjson.dumps({"prompt_id": p, "prompt": f"short {p}?"}).decode() + "\n" for p in short
        )
    )
    cfg = cfg_from_env(cli_env)
    assert run("srl", "topics", "create", env=cli_env).returncode == 0
    (tmp_path / "d.toml").write_text("[dispatch]\nbaseline_length = 400\n")  # all in le1024
    for file, n in (("s.jsonl", "4"), ("p.jsonl", "400")):
        out = run(
            "srl-producer",
            "dispatch",
            "--unpaced",
            "--partitioning",
            "key",
            "--config",
            str(tmp_path / "d.toml"),
            "--prompts",
            str(tmp_path / file),
            "--group-size",
            "4",
            "--max-new-tokens",
            n,
            env=cli_env,
        )
        assert out.returncode == 0, out.stderr
    t = Trajectories(cfg)
    logs = {w: tmp_path / f"{w}.log" for w in ("wa", "wc")}
    old_group = pool_group(cfg.topic_prefix, "regular")
    layout = Layout.from_config(cfg)
    parts = [(layout.prompts("le1024"), p) for p in range(cfg.prompt_partitions)]

    n_parts = cfg.prompt_partitions
    per_part = {
        p: sum(zlib.crc32(s.encode()) % n_parts == p for s in short) for p in range(n_parts)
    }

    def short_ones_committed(t: Trajectories) -> bool:
        if sum(cs[0].prompt_id in short for cs in t.complete().values()) < 16:
            return False
        done = committed_offsets(cfg, old_group, parts)
        return all((done[tp] or 0) >= per_part[tp[1]] for tp in parts)

    with worker(cli_env, tiny_model, "wa", logs["wa"]) as wa:
        until(
            t,
            lambda t: short_ones_committed(t) and len(incomplete_of(t, "wa")) >= 2,
            {"wa": wa},
            logs,
            240,
        )
        wa.send_signal(signal.SIGKILL)
        assert wa.wait(timeout=10) == -signal.SIGKILL
    # unfinished as far as the test had read when wa died: a lower bound of wa's progress only
    seen_mid = set(incomplete_of(t, "wa"))
    with worker(
        cli_env,
        tiny_model,
        "wc",
        logs["wc"],
        "--group-id",
        f"{old_group}.r1",
        "--take-over-from",
        old_group,
        "--idle-exit",
        "3",
    ) as wc:
        assert wc.wait(timeout=400) == 0, logs["wc"].read_text()[-3000:]
    t.wait(lambda t: len(t.complete()) == 32, timeout_s=30)
    done = check_exactly_once(t, {(p, s) for p in ids + short for s in range(4)})
    assert t.duplicates == 0
    assert all({c.worker_id for c in done[(p, s)]} == {"wa"} for p in short for s in range(4))
    # What wa left unfinished is read from the topic once everything is in, not from what the
    # test had read at the kill: wa's last chunks (a trajectory's last one among them) may have
    # been acknowledged by the broker and still on their way to the test's reader then.
    for cs in done.values():  # wa's chunks, then wc's, continuing the numbering (exactly once)
        wids = [c.worker_id for c in cs]
        switch = wids.index("wc") if "wc" in wids else len(wids)
        assert set(wids[:switch]) <= {"wa"} and set(wids[switch:]) <= {"wc"}, wids
    started = {cs[0].trajectory_id for cs in done.values() if cs[0].worker_id == "wa"}
    assert seen_mid <= started, "a trajectory wa had started was not completed"
    resumed = [cs for cs in done.values() if cs[0].worker_id == "wa" and cs[-1].worker_id == "wc"]
    assert resumed, "the killed worker's unfinished trajectories were not resumed"
    log_c = logs["wc"].read_text()
    assert re.search(r"took over [1-9]", log_c) and re.search(r"resumed [1-9]", log_c), log_c[
        -3000:
    ]


@pytest.mark.slow
def test_sigterm_hands_off_in_flight_work_and_exits_cleanly(
    cli_env: dict[str, str], tiny_model: Path, tmp_path: Path
) -> None:
    ids = balanced_prompts(tmp_path / "p.jsonl", 4)
    cfg = cfg_from_env(cli_env)
    assert run("srl", "topics", "create", env=cli_env).returncode == 0
    out = run(
        "srl-producer",
        "dispatch",
        "--unpaced",
        "--partitioning",
        "key",
        "--prompts",
        str(tmp_path / "p.jsonl"),
        "--group-size",
        "4",
        "--max-new-tokens",
        "400",
        env=cli_env,
    )
    assert out.returncode == 0, out.stderr
    t = Trajectories(cfg)
    with worker(cli_env, tiny_model, "w1", tmp_path / "w1.log", "--drain-timeout", "0") as w1:
        until(
            t,
            lambda t: len(incomplete_of(t, "w1")) >= 1,
            {"w1": w1},
            {"w1": tmp_path / "w1.log"},
            60,
        )
        w1.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        assert w1.wait(timeout=30) == 0, (tmp_path / "w1.log").read_text()[-3000:]
        assert time.monotonic() - t0 < 20
    log1 = (tmp_path / "w1.log").read_text()
    assert "handed off" in log1 and "handed off 0," not in log1, log1[-2000:]
    with worker(cli_env, tiny_model, "w2", tmp_path / "w2.log", "--idle-exit", "3") as w2:
        assert w2.wait(timeout=120) == 0, (tmp_path / "w2.log").read_text()[-3000:]
    t.wait(lambda t: len(t.complete()) == 16, timeout_s=30)
    done = check_exactly_once(t, {(p, s) for p in ids for s in range(4)})
    assert t.duplicates == 0
    assert any({c.worker_id for c in cs} == {"w1", "w2"} for cs in done.values()), (
        "nothing was resumed"
    )


def test_bad_input_is_one_line_and_a_nonzero_exit(cli_env: dict[str, str], tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt_id": "a", "prompt": "x"}\nnot json\n')
    out = run("srl-producer", "dispatch", "--prompts", str(bad), env=cli_env)
    assert out.returncode == 2 and out.stderr.strip().count("\n") == 0, out.stderr
    assert f"{bad}:2: not JSON" in out.stderr
    table = tmp_path / "t.parquet"
    pq.write_table(pa.table({"question": ["x"], "answer": [[1]]}), table)
    for args, why in [
        ((), f"{table}: no column 'prompt' (--prompt-field; columns: answer, question)"),
        (("--prompt-field", "question"), f"{table}: row 0: the answer must be a string or a"),
        (("--prompt-field", "question", "--chat-template"), "--chat-template needs --tokenizer"),
    ]:
        out = run("srl-producer", "dispatch", "--prompts", str(table), *args, env=cli_env)
        assert out.returncode == 2 and out.stderr.strip().count("\n") == 0, out.stderr
        assert why in out.stderr, out.stderr
    out = run("srl-producer", "dispatch", env=cli_env)
    assert out.returncode == 2 and "exactly one prompt source" in out.stderr
    out = run("srl-producer", "generate", env=cli_env)
    assert out.returncode == 2 and "engine hf needs --model DIR" in out.stderr
    out = run("srl-producer", "generate", "--engine", "sim", "--buckets", "le7", env=cli_env)
    assert out.returncode == 2 and "unknown bucket 'le7'" in out.stderr, out.stderr
    out = run("srl-producer", "generate", "--engine", "sim", "--max-batch", "0", env=cli_env)
    assert out.returncode == 2 and "max_batch" in out.stderr


def test_sim_generate_says_it_is_simulated(cli_env: dict[str, str], tmp_path: Path) -> None:
    hist = str(STREAMRL_LENGTHS)
    env = cli_env
    out = run(
        "srl-producer",
        "dispatch",
        "--task",
        "sim",
        "--lengths",
        hist,
        "--scale",
        "0.005",
        "--num-prompts",
        "3",
        "--group-size",
        "2",
        "--predictor",
        "oracle",
        env=env,
    )
    assert out.returncode == 0 and "SIMULATED" in out.stderr, out.stderr
    out = run(
        "srl-producer",
        "generate",
        "--engine",
        "sim",
        "--time-scale",
        "0",
        "--idle-exit",
        "2",
        "--json",
        env=env,
    )
    assert out.returncode == 0, out.stderr
    assert "SIMULATED" in out.stderr
    summary = orjson.loads(out.stdout)
    assert summary["simulated"] and summary["trajectories"] == 6 and summary["tasks"] == 3
