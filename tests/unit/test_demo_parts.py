"""The demo's and the smoke run's pure parts: topic prefix, the roles' environment, figures."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from app.demo import demo_prefix, role_env
from app.demoplan import VLLM_KV_CACHE_GIB, DemoConfig, DemoError, Plan, require_engine
from app.smoke import smoke_result, synthetic_chunks
from producers.config import GenerateConfig
from srl.topics import Layout


@pytest.mark.parametrize(
    ("embedded", "prefix", "fresh"),
    [
        (True, "srl", False),  # the embedded broker is the demo's own
        (True, "mine", False),
        (False, "srl", True),  # a shared broker: a prefix of its own
        (False, "mine", False),  # unless one was given
    ],
)
def test_demo_prefix(embedded: bool, prefix: str, fresh: bool) -> None:
    cfg = DemoConfig(topic_prefix=prefix, embedded=embedded)
    got = demo_prefix(cfg)
    if fresh:
        assert got.startswith("srl-demo-") and len(got) == len("srl-demo-") + 6
        assert demo_prefix(cfg) != got
    else:
        assert got == prefix


def test_role_env_drops_srl_settings_but_verbosity() -> None:
    env = role_env({"PATH": "/bin", "SRL_RUN": "x", "SRL_VERBOSE": "1", "OMP_NUM_THREADS": "8"})
    assert env == {
        "PATH": "/bin",
        "SRL_VERBOSE": "1",
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "GLOO_SOCKET_IFNAME": "lo",
    }


def test_two_trainer_ranks_run_under_torchrun_and_the_dtype_reaches_the_trainer(
    tmp_path: Path,
) -> None:
    cfg = DemoConfig(trainer_ranks=2, dtype="bfloat16")
    plan = Plan(cfg, tmp_path, tmp_path / "model", "127.0.0.1:9092", "p", "r", "file:///s")
    assert plan.role_tables()["train"]["dtype"] == "bfloat16"
    argv = plan.trainer_argv(["--config", "srl.toml"])
    assert Path(argv[0]).name == "torchrun" and "--nproc-per-node" in argv
    assert argv[argv.index("--nproc-per-node") + 1] == "2"
    assert argv[-5:] == ["-m", "app.cli.consumer", "train", "--config", "srl.toml"]
    one = Plan(DemoConfig(), *[tmp_path, tmp_path / "model", "127.0.0.1:9092", "p", "r", "x"])
    assert Path(one.trainer_argv([])[0]).name == "srl-consumer"


def test_the_vllm_demo_sizes_each_generators_kv_cache_or_says_how_to_run_it(
    tmp_path: Path,
) -> None:
    plan = Plan(
        DemoConfig(engine="vllm"), tmp_path, tmp_path / "m", "127.0.0.1:9092", "p", "r", "x"
    )
    gen = plan.role_tables()["generate"]
    assert gen | {"engine": "vllm", "dtype": "float32", "kv_cache_gib": VLLM_KV_CACHE_GIB} == gen
    GenerateConfig.model_validate(gen)  # keys every generator reads
    hf = Plan(DemoConfig(), tmp_path, tmp_path / "m", "127.0.0.1:9092", "p", "r", "x")
    assert hf.role_tables()["generate"]["engine"] == "hf"
    assert "kv_cache_gib" not in hf.role_tables()["generate"]
    require_engine(DemoConfig())  # hf: anywhere
    if importlib.util.find_spec("vllm") is None:  # .venv: one line saying how to run it
        with pytest.raises(DemoError, match=r"run it from \.venv-vllm: .*srl demo --engine vllm"):
            require_engine(DemoConfig(engine="vllm"))
    else:
        require_engine(DemoConfig(engine="vllm"))


def test_smoke_result() -> None:
    chunks = synthetic_chunks(5, Layout("x"))
    tokens = sum(c.n_tokens for c in chunks)
    got = smoke_result(chunks, 5, 4, 1, 0.12345, 2.0)
    assert got == {
        "trajectories": 5,
        "chunks": len(chunks),
        "tokens": tokens,
        "assembled": 4,
        "duplicates": 1,
        "lost": 1,
        "produce_s": 0.123,
        "wall_s": 2.0,
        "tokens_per_s": round(tokens / 2.0),
    }
