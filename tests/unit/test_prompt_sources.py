"""Prompt sources with field mapping (JSONL, parquet, Arrow, dataset directories), their bad
inputs, and ``--chat-template``: rendered at dispatch and in ``srl serve`` by one function, to
the same token ids (no Kafka).

``data/datasets/`` holds directories written by ``datasets.save_to_disk`` (datasets 5.2.0):
``gsm8k`` (a DatasetDict of train and test) and ``verl-chat`` (chat messages in ``prompt`` and
the answer in ``reward_model.ground_truth``, verl's layout).
"""

from __future__ import annotations

import builtins
import json
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from app.configs import ServeConfig
from app.serve.core import ServeEngine
from app.serve.protocol import Sampling
from app.serve.publish import Publisher
from app.serve.text import codec_for
from app.sources import load_source
from producers.config import DispatchConfig
from producers.dispatcher import plan_window
from producers.engines.hf import HFEngine
from producers.promptfit import PromptFit
from producers.rendering import render_prompts
from producers.sources import Fields, SourcePrompt, read_prompts
from schemas.records import PromptTask, decode_as, encode, unpack_tokens
from srl.chat import ChatTemplate
from srl.config import load_config
from srl.errors import ConfigError
from srl.tinymodel import load_tokenizer
from srl.topics import Layout
from tests.chat import with_chat_template

DATA = Path(__file__).parent / "data" / "datasets"
GSM8K = {
    "question": ["What is 2+3?", "What is 7*6?", "Half of 9?"],
    "answer": ["2+3 = 5\n#### 5", "7*6 = 42\n#### 42", "9/2\n#### 4.5"],
    "idx": [10, 11, 12],
}
CHATS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}],
]


def dcfg(**kw: Any) -> DispatchConfig:
    return load_config(DispatchConfig, cli={"prompts": "unused.jsonl", **kw}, env={})


@pytest.fixture(scope="module")
def chat_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return with_chat_template(tiny_model, tmp_path_factory.mktemp("chat") / "model")


def write_parquet(path: Path, columns: dict[str, list[Any]]) -> Path:
    pq.write_table(pa.table(columns), path)
    return path


def test_jsonl_with_field_mapping_and_generated_ids(tmp_path: Path) -> None:
    f = tmp_path / "gsm8k.jsonl"
    f.write_text(
        "\n".join(
            orjson.dumps({"question": q, "solution": a, "level": 1}).decode()
            for q, a in zip(GSM8K["question"], GSM8K["answer"], strict=True)
        )
        + "\n"
    )
    got = read_prompts(f, Fields(prompt="question", answer="solution", metadata=("level",)))
    assert [p.prompt_id for p in got] == ["gsm8k.jsonl:1", "gsm8k.jsonl:2", "gsm8k.jsonl:3"]
    assert got[1] == SourcePrompt(
        "gsm8k.jsonl:2", "What is 7*6?", {"level": 1, "answer": "7*6 = 42\n#### 42"}
    )
    # the default JSONL shape reads as before; an "answer" column is the reference by default
    f.write_text('{"prompt_id": "a", "prompt": "2+2=", "answer": 4, "metadata": {"k": 1}}\n')
    assert read_prompts(f) == [SourcePrompt("a", "2+2=", {"k": 1, "answer": 4})]


def test_parquet_with_field_mapping_nested_answer_and_integer_ids(tmp_path: Path) -> None:
    f = write_parquet(
        tmp_path / "train.parquet",
        {
            "question": GSM8K["question"],
            "idx": GSM8K["idx"],
            "reward_model": [{"ground_truth": a, "style": "rule"} for a in GSM8K["answer"]],
        },
    )
    fields = Fields(prompt="question", id="idx", answer="reward_model.ground_truth")
    got = read_prompts(f, fields)
    assert [(p.prompt_id, p.text, p.metadata) for p in got] == [
        (str(i), q, {"answer": a})
        for i, q, a in zip(GSM8K["idx"], GSM8K["question"], GSM8K["answer"], strict=True)
    ]
    # no id column: {file name}:{row index}; the GSM8K answer column is the reference
    write_parquet(f, {k: GSM8K[k] for k in ("question", "answer")})
    got = read_prompts(f, Fields(prompt="question"))
    assert [p.prompt_id for p in got] == ["train.parquet:0", "train.parquet:1", "train.parquet:2"]
    assert got[2].metadata == {"answer": "9/2\n#### 4.5"}


def test_chat_messages_column_needs_the_chat_template(tmp_path: Path) -> None:
    f = write_parquet(tmp_path / "chat.parquet", {"prompt": CHATS, "answer": ["hello", "4"]})
    got = read_prompts(f, Fields(chat=True))
    assert got[1].messages == tuple(CHATS[1]) and got[1].text == ""
    with pytest.raises(ConfigError, match=r"chat.parquet: row 0: column 'prompt' holds chat"):
        read_prompts(f)


def test_datasets_save_to_disk_directories() -> None:
    """Written by datasets 5.2.0; read with pyarrow alone (no datasets installed)."""
    got = read_prompts(DATA / "gsm8k" / "train", Fields(prompt="question", id="idx"))
    assert [p.prompt_id for p in got] == ["10", "11", "12"]
    assert got[0].metadata == {"answer": "2+3 = 5\n#### 5"}
    chat = read_prompts(DATA / "verl-chat", Fields(answer="reward_model.ground_truth", chat=True))
    assert [p.prompt_id for p in chat] == ["verl-chat:0", "verl-chat:1"]
    assert [p.messages for p in chat] == [tuple(c) for c in CHATS]
    assert [p.metadata["answer"] for p in chat] == ["hello", "4"]
    with pytest.raises(ConfigError, match=r"a DatasetDict \(splits: train, test\): give one split"):
        read_prompts(DATA / "gsm8k")


def test_a_sharded_dataset_directory_numbers_rows_across_shards(tmp_path: Path) -> None:
    """state.json lists the shards in order (datasets' layout, Arrow stream format)."""
    d = tmp_path / "ds"
    d.mkdir()
    names = []
    for i, rows in enumerate([["a", "b"], ["c"]]):
        names.append(f"data-{i:05d}-of-00002.arrow")
        table = pa.table({"prompt": rows})
        with pa.ipc.new_stream(str(d / names[-1]), table.schema) as w:
            w.write_table(table)
    (d / "state.json").write_text(json.dumps({"_data_files": [{"filename": n} for n in names]}))
    got = read_prompts(d)
    assert [(p.prompt_id, p.text) for p in got] == [("ds:0", "a"), ("ds:1", "b"), ("ds:2", "c")]
    (d / names[1]).unlink()
    with pytest.raises(ConfigError, match="lists data-00001-of-00002.arrow, which is not in"):
        read_prompts(d)


def test_a_directory_of_parquet_files_and_an_arrow_file(tmp_path: Path) -> None:
    for name, rows in [("b.parquet", ["y"]), ("a.parquet", ["x"])]:
        write_parquet(tmp_path / name, {"prompt": rows})
    assert [p.prompt_id for p in read_prompts(tmp_path)] == ["a.parquet:0", "b.parquet:0"]
    table = pa.table({"prompt": ["z"]})
    with pa.ipc.new_file(str(tmp_path / "f.arrow"), table.schema) as w:  # the file format
        w.write_table(table)
    assert read_prompts(tmp_path / "f.arrow") == [SourcePrompt("f.arrow:0", "z", {})]


@pytest.mark.parametrize(
    ("columns", "fields", "why"),
    [
        ({"q": ["x"]}, Fields(), r"t.parquet: no column 'prompt' \(--prompt-field; columns: q\)"),
        ({"prompt": ["x"]}, Fields(answer="sol"), r"no column 'sol' \(--answer-field"),
        ({"prompt": ["x"]}, Fields(id="id"), r"no column 'id' \(--id-field"),
        ({"prompt": [3]}, Fields(), r"t.parquet: row 0: prompt must be a string .* not int"),
        (
            {"prompt": ["x", "y"], "answer": ["1", None]},
            Fields(),
            r"row 1: the answer must be a string or a number \(column 'answer'\), not NoneType",
        ),
        ({"prompt": ["x", "y"], "prompt_id": ["a", "a"]}, Fields(), "row 1: duplicate prompt_id"),
        ({"prompt": ["x"], "prompt_id": [""]}, Fields(), "row 0: prompt_id must be a non-empty"),
        ({"prompt": [[{"role": "user"}]]}, Fields(chat=True), "message 0: content must be"),
        ({"prompt": ["x"], "blob": [b"\x00"]}, Fields(metadata=("blob",)), "metadata is not JSON"),
        ({"prompt": ["x"], "metadata": ["{}"]}, Fields(), "metadata must be a JSON object"),
        ({"prompt": pa.array([], pa.string())}, Fields(), "no prompts"),
    ],
)
def test_bad_rows_are_one_line_naming_file_row_and_column(
    tmp_path: Path, columns: dict[str, Any], fields: Fields, why: str
) -> None:
    f = write_parquet(tmp_path / "t.parquet", columns)
    with pytest.raises(ConfigError, match=why) as e:
        read_prompts(f, fields)
    assert "\n" not in str(e.value)


def test_unreadable_missing_files_and_no_pyarrow(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "bad.parquet").write_bytes(b"not parquet at all")
    (tmp_path / "bad.arrow").write_bytes(b"not arrow")
    with pytest.raises(ConfigError, match="bad.parquet: not a readable parquet file"):
        read_prompts(tmp_path / "bad.parquet")
    with pytest.raises(ConfigError, match="bad.arrow: not a readable Arrow IPC file"):
        read_prompts(tmp_path / "bad.arrow")
    with pytest.raises(ConfigError, match="no such file or directory"):
        read_prompts(tmp_path / "gone.parquet")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"no state.json \(datasets save_to_disk\), \*.parquet"):
        read_prompts(tmp_path / "empty")
    real_import = builtins.__import__

    def no_pyarrow(name: str, *args: Any, **kw: Any) -> Any:
        if name.startswith("pyarrow"):
            raise ImportError(name)
        return real_import(name, *args, **kw)

    monkeypatch.setattr(builtins, "__import__", no_pyarrow)
    with pytest.raises(ConfigError, match=r"needs pyarrow: pip install 'srl\[data\]'"):
        read_prompts(tmp_path / "bad.parquet")


def test_dispatch_options_map_the_fields_and_check_the_template_options(tmp_path: Path) -> None:
    f = write_parquet(tmp_path / "g.parquet", {k: GSM8K[k] for k in ("question", "answer")})
    got = load_source(dcfg(prompts=str(f), prompt_field="question", metadata_fields=("answer",)))
    assert got[0].metadata == {"answer": "2+3 = 5\n#### 5"} and got[0].text == "What is 2+3?"
    with pytest.raises(ConfigError, match="--chat-template needs --tokenizer DIR"):
        dcfg(chat_template=True)
    with pytest.raises(ConfigError, match="--system-prompt needs --chat-template"):
        dcfg(system_prompt="be brief")


def test_rendered_prompts_carry_the_templates_ids(chat_model: Path, tiny_model: Path) -> None:
    cfg = dcfg(chat_template=True, tokenizer=str(chat_model), system_prompt="be kind")
    rows = [SourcePrompt("t", "2+2?"), SourcePrompt("c", "", {"answer": "4"}, tuple(CHATS[1]))]
    text, chat = render_prompts(cfg, rows)
    assert text.text == "<|bos|><system>be kind</system>\n<user>2+2?</user>\n<assistant>"
    # a conversation with its own system message keeps it
    assert chat.text == "<|bos|><system>be brief</system>\n<user>2+2?</user>\n<assistant>"
    assert chat.metadata == {"answer": "4"}
    tok = load_tokenizer(chat_model)
    for p in (text, chat):
        assert list(p.prompt_tokens) == tok(p.text, add_special_tokens=False)["input_ids"]
    # the task carries the ids; without the template, prompts stay as they are
    (task,) = plan_window([chat], np.array([5]), Layout(), cfg)
    assert unpack_tokens(task.prompt_tokens).tolist() == list(chat.prompt_tokens)
    assert render_prompts(dcfg(), rows) == rows
    bare = dcfg(chat_template=True, tokenizer=str(tiny_model))
    with pytest.raises(ConfigError, match=r"--tokenizer .* has no chat template") as e:
        render_prompts(bare, rows)
    assert "\n" not in str(e.value)


def test_a_conversation_the_template_refuses_names_the_prompt(
    tiny_model: Path, tmp_path: Path
) -> None:
    strict = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}"
    model = with_chat_template(
        tiny_model, tmp_path / "strict", strict + "{{ messages[0]['content'] }}"
    )
    cfg = dcfg(chat_template=True, tokenizer=str(model), system_prompt="sys")
    with pytest.raises(ConfigError, match=r"prompt 'p': the chat template refused it: user first"):
        render_prompts(cfg, [SourcePrompt("p", "hi")])


def test_the_prompt_length_check_counts_the_rendered_prompt(chat_model: Path) -> None:
    cfg = dcfg(chat_template=True, tokenizer=str(chat_model), context_tokens=64, max_new_tokens=16)
    fit = PromptFit(cfg)
    (short,) = render_prompts(cfg, [SourcePrompt("s", "x" * 20)])
    assert fit.reason(SourcePrompt("s", "x" * 20)) is None  # 20 tokens as raw text
    (long,) = render_prompts(cfg.model_copy(update={"system_prompt": "y" * 30}), [short])
    assert fit.reason(short) is None  # 20 + the template's 18
    assert fit.reason(long) == (
        f"prompt too long: {len(long.prompt_tokens)} tokens + max_new_tokens 16 > the "
        "generators' context of 64"
    )


def test_generation_and_serving_render_a_chat_to_the_same_token_ids(
    chat_model: Path, tmp_path: Path
) -> None:
    """The dispatcher's task (through the wire format, as a generator reads it) and srl
    serve's chat request give token-identical prompts, with and without a system prompt."""
    f = write_parquet(tmp_path / "c.parquet", {"prompt": CHATS + [[CHATS[1][1]]]})
    engine = HFEngine(str(chat_model), max_batch=1, seed=0)
    for system in (None, "You are terse."):
        cfg = dcfg(prompts=str(f), chat_template=True, tokenizer=str(chat_model))
        cfg = cfg.model_copy(update={"system_prompt": system})
        prompts = load_source(cfg)
        tasks = plan_window(prompts, np.array([5] * len(prompts)), Layout(), cfg)
        by_id = {t.prompt_id: decode_as(encode(t), PromptTask) for t in tasks}
        served = ServeEngine(
            engine, codec_for(engine, True, system), Publisher(None, Layout(), 4, "w")
        )
        for p, messages in zip(prompts, CHATS + [[CHATS[1][1]]], strict=True):
            generated = unpack_tokens(by_id[p.prompt_id].prompt_tokens).tolist()
            serve_ids = served.prepare(messages, True, Sampling(8))
            assert generated == serve_ids and generated, (system, messages)
    # a plain-text row is one user message: the same ids as that chat request
    (text,) = render_prompts(cfg, [SourcePrompt("t", "2+2?")])
    assert list(text.prompt_tokens) == served.prepare(
        [{"role": "user", "content": "2+2?"}], True, Sampling(8)
    )


def test_serve_chat_template_options(tiny_model: Path, chat_model: Path) -> None:
    plain = HFEngine(str(tiny_model), max_batch=1, seed=0)
    with pytest.raises(ConfigError, match="--chat-template: the model's tokenizer has no chat"):
        codec_for(plain, True)
    msgs = [{"role": "user", "content": "hi"}]
    assert codec_for(plain).chat_prompt(msgs) == "user: hi\nassistant:"  # as before
    templated = HFEngine(str(chat_model), max_batch=1, seed=0)
    # without --chat-template: the tokenizer's template, no system prompt
    assert codec_for(templated).chat_prompt(msgs) == "<|bos|><user>hi</user>\n<assistant>"
    codec = codec_for(templated, True, "sys")
    assert codec.chat_prompt(msgs) == ChatTemplate(templated.tokenizer, "sys").render(msgs)

    class Sim:
        vocab = 100

        def tokenize(self, text: str) -> list[int]:
            return [1]

    with pytest.raises(ConfigError, match="the sim engine has no tokenizer"):
        codec_for(Sim(), True)
    with pytest.raises(ConfigError, match="--system-prompt needs --chat-template"):
        load_config(ServeConfig, cli={"engine": "sim", "system_prompt": "sys"}, env={})
    cfg = load_config(ServeConfig, cli={"engine": "sim", "chat_template": True}, env={})
    assert cfg.chat_template and cfg.system_prompt is None
