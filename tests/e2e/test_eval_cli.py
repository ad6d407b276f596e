"""``srl eval`` as a real subprocess on the tiny model and a small JSONL dataset: the JSON
report (stdout and --out), progress on stderr, and bad input as one line and exit 2."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import orjson

from tests.conftest import bin_path


def srl_eval(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SRL_")}
    return subprocess.run(
        [bin_path("srl"), "eval", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=240,
    )


def test_srl_eval_reports_pass_at_k_as_json(tiny_model: Path, tmp_path: Path) -> None:
    data = tmp_path / "gsm.jsonl"
    rows = [
        {
            "prompt_id": f"q{i}",
            "prompt": f"What is {i} + 4?",
            "metadata": {"answer": f"#### {i + 4}"},
        }
        for i in range(3)
    ]
    data.write_bytes(b"\n".join(orjson.dumps(r) for r in rows) + b"\n")
    args = ["--model", str(tiny_model), "--prompts", str(data)]
    args += ["--reward", "consumers.rewards:math_answer", "--reward-workers", "1"]
    args += ["--samples", "4", "--k", "1,4", "--temperature", "0.8", "--max-new-tokens", "6"]
    out = srl_eval(*args, "--json", "--per-prompt", "--out", "rep/eval.json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    rep = orjson.loads(out.stdout)
    assert rep == orjson.loads((tmp_path / "rep" / "eval.json").read_bytes())
    assert (rep["model"], rep["version"], rep["run"], rep["engine"]) == (
        str(tiny_model),
        0,
        None,
        "hf",
    )
    assert rep["prompts"] == 3 and rep["reward"] == "consumers.rewards:math_answer"
    g, s = rep["greedy"], rep["sampled"]
    assert g["completions"] == 3 and 0 <= g["pass@1"] <= 1 and g["reward_failures"] == 0
    assert set(s["pass@k"]) == {"1", "4"} and s["completions"] == 12 and s["temperature"] == 0.8
    assert s["pass@k"]["1"] <= s["pass@k"]["4"]
    assert sum(rep["finish"].values()) == 15 and rep["generated_tokens"] > 0
    assert [p["prompt_id"] for p in rep["per_prompt"]] == ["q0", "q1", "q2"]
    assert all(len(p["sampled"]["rewards"]) == 4 for p in rep["per_prompt"])
    assert "srl eval: scoring 30/30" in out.stderr  # the progress lines (stderr is no terminal)


def test_srl_eval_bad_input_is_one_line_and_exit_2(tiny_model: Path, tmp_path: Path) -> None:
    out = srl_eval("--model", str(tiny_model), "--prompts", "missing.jsonl", cwd=tmp_path)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip().splitlines() == [
        "srl: error: prompts file missing.jsonl: No such file or directory"
    ]
    (tmp_path / "p.jsonl").write_text('{"prompt_id": "a", "prompt": "x"}\n')
    for args, said in [
        (["--prompts", "p.jsonl"], "needs --model DIR or --run NAME"),
        (["--model", str(tiny_model)], "needs --prompts PATH"),
        (
            ["--model", str(tiny_model), "--prompts", "p.jsonl", "--samples", "2", "--k", "4"],
            "1..2",
        ),
        (
            ["--model", str(tiny_model), "--prompts", "p.jsonl", "--reward", "nope:f"],
            "cannot import",
        ),
    ]:
        out = srl_eval(*args, cwd=tmp_path)
        assert out.returncode == 2, (args, out.stderr)
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and said in lines[0], (args, out.stderr)
