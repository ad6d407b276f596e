"""Prompt sources for the dispatcher: JSONL, parquet and Arrow files, local dataset
directories, or a simulated workload (the demo task's prompts come from the app layer:
``app.sources.load_source``).

Owns the one shape every source yields (:class:`PromptLike`: ``prompt_id``, ``text``,
``metadata``), so the dispatcher takes any iterable of such objects as an argument, and how a
file's rows become prompts (the field mapping, :class:`Fields`):

* ``read_prompts(path, fields)``: a JSONL file (one JSON object per line), a parquet or Arrow
  file or a dataset directory (``producers.tables``). Each row gives
  - the prompt: column ``fields.prompt`` (default ``prompt``), a string, or chat messages (a
    list of ``{role, content}``), which need ``--chat-template`` (``producers.rendering``);
  - the id: column ``fields.id``, else ``prompt_id`` where the file has that column, else
    ``{file name}:{row}`` (the line number in JSONL, the row index from 0 in a table): stable
    for the same file. A string or an integer; ids must be unique;
  - the metadata (the reward function's third argument, through the seq-0 chunk): the row's
    ``metadata`` object if it has one, each of ``fields.metadata`` under its own name, and the
    reference answer, column ``fields.answer`` (else ``answer`` where the file has it), as
    ``metadata["answer"]``, which the built-in rewards read (``consumers.rewards``).
  ``a.b`` names field ``b`` of a struct (object) column ``a`` (verl's
  ``reward_model.ground_truth``). A bad row stops the dispatcher with one line naming the
  file, the row and the column.
* ``read_jsonl(path, fields)``: the JSONL reader alone (``{"prompt_id", "prompt", "metadata"}``
  by default).
* ``sim_prompts(n, lengths, seed)``: prompts whose ``metadata.sim_length`` is drawn from a
  length histogram: the oracle length the sim engine generates and the oracle predictor reads.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import orjson

from producers.tables import RowFile, table_files
from ranker.api import BaselinePredictor, LengthPredictor, OraclePredictor, RankerPredictor
from srl.chat import check_messages
from srl.errors import ConfigError
from srl.stores import store_from_config
from srl.workload import LengthHistogram

if TYPE_CHECKING:
    from producers.config import DispatchConfig


class PromptLike(Protocol):
    @property
    def prompt_id(self) -> str: ...

    @property
    def text(self) -> str: ...

    @property
    def metadata(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class SourcePrompt:
    prompt_id: str
    text: str
    metadata: dict[str, Any] = field(default_factory=dict)
    # a row of chat messages (text is empty until the chat template renders them)
    messages: tuple[dict[str, str], ...] | None = None
    # the rendered prompt's token ids (``producers.rendering``): the task carries them
    prompt_tokens: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Fields:
    """Which columns of a row are the prompt, its id, its answer and its extra metadata."""

    prompt: str = "prompt"
    id: str | None = None  # None: prompt_id where the file has it, else {file}:{row}
    answer: str | None = None  # None: answer where the file has it, else none
    metadata: tuple[str, ...] = ()
    chat: bool = False  # chat messages allowed (--chat-template renders them)

    @classmethod
    def of(cls, cfg: DispatchConfig) -> Fields:
        return cls(
            cfg.prompt_field, cfg.id_field, cfg.answer_field, cfg.metadata_fields, cfg.chat_template
        )

    def named(self) -> list[tuple[str, str]]:
        """``(option, column)`` of every column given explicitly: each must exist."""
        out = [("--prompt-field", self.prompt)]
        out += [("--id-field", self.id)] if self.id else []
        out += [("--answer-field", self.answer)] if self.answer else []
        return out + [("--metadata-fields", m) for m in self.metadata]


def read_prompts(path: str | Path, fields: Fields | None = None) -> list[SourcePrompt]:
    """The prompts of a JSONL, parquet or Arrow file or a dataset directory (module
    docstring); ConfigError naming the file, row and column of the first bad row."""
    p, fields = Path(path), fields or Fields()
    table = p.is_dir() or p.suffix in (".parquet", ".arrow")
    parts = table_files(p) if table else [_jsonl_file(p)]
    return _collect(str(path), (sp for part in parts for sp in _map_rows(part, fields)))


def read_jsonl(path: str | Path, fields: Fields | None = None) -> list[SourcePrompt]:
    return _collect(str(path), _map_rows(_jsonl_file(Path(path)), fields or Fields()))


def _jsonl_file(path: Path) -> RowFile:
    try:
        lines = path.read_bytes().splitlines()
    except OSError as e:
        raise ConfigError(f"prompts file {path}: {e.strerror or e}") from None
    rows: list[tuple[int, str, dict[str, Any]]] = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            d = orjson.loads(line)
        except orjson.JSONDecodeError as e:
            raise ConfigError(f"{where}: not JSON ({e.msg})") from None
        if not isinstance(d, dict):
            raise ConfigError(f"{where}: expected a JSON object")
        rows.append((n, where, d))
    columns = frozenset(k for _, _, d in rows for k in d)
    return RowFile(str(path), columns, lambda _cols: iter(rows))


def _collect(path: str, rows: Iterable[tuple[str, SourcePrompt]]) -> list[SourcePrompt]:
    out: list[SourcePrompt] = []
    seen: set[str] = set()
    for where, sp in rows:
        if sp.prompt_id in seen:
            raise ConfigError(f"{where}: duplicate prompt_id {sp.prompt_id!r}")
        seen.add(sp.prompt_id)
        out.append(sp)
    if not out:
        raise ConfigError(f"prompts file {path}: no prompts")
    return out


def _map_rows(part: RowFile, fields: Fields) -> Iterator[tuple[str, SourcePrompt]]:
    for option, column in fields.named():
        if column.split(".", 1)[0] not in part.columns and column not in part.columns:
            have = ", ".join(sorted(part.columns)[:20]) or "none"
            raise ConfigError(f"{part.name}: no column {column!r} ({option}; columns: {have})")
    id_col = fields.id or ("prompt_id" if "prompt_id" in part.columns else None)
    answer_col = fields.answer or ("answer" if "answer" in part.columns else None)
    wanted = [fields.prompt, id_col, answer_col, "metadata", *fields.metadata]
    tops = {c if c in part.columns else c.split(".", 1)[0] for c in wanted if c}
    name = Path(part.name).name
    for n, where, row in part.read(sorted(tops & part.columns)):
        yield where, _prompt_of(row, where, fields, id_col, answer_col, f"{name}:{n}")


def _prompt_of(
    row: dict[str, Any],
    where: str,
    fields: Fields,
    id_col: str | None,
    answer_col: str | None,
    default_id: str,
) -> SourcePrompt:
    value = _lookup(row, fields.prompt, where)
    messages = None
    if isinstance(value, list | tuple):
        try:
            messages = tuple(check_messages(value))
        except ValueError as e:
            raise ConfigError(f"{where}: column {fields.prompt!r}: {e}") from None
        if not fields.chat:
            raise ConfigError(
                f"{where}: column {fields.prompt!r} holds chat messages: give --chat-template "
                "(with --tokenizer DIR) to render them"
            )
    elif not isinstance(value, str):
        raise ConfigError(
            f"{where}: prompt must be a string or a list of chat messages (column "
            f"{fields.prompt!r}), not {type(value).__name__}"
        )
    pid = default_id if id_col is None else _lookup(row, id_col, where)
    if isinstance(pid, int) and not isinstance(pid, bool):
        pid = str(pid)
    if not isinstance(pid, str) or not pid:
        raise ConfigError(
            f"{where}: prompt_id must be a non-empty string or an integer (column {id_col!r})"
        )
    meta = _metadata_of(row, where, fields, answer_col)
    return SourcePrompt(pid, "" if messages else str(value), meta, messages)


def _metadata_of(
    row: dict[str, Any], where: str, fields: Fields, answer_col: str | None
) -> dict[str, Any]:
    meta = row.get("metadata")
    if meta is None:
        meta = {}
    if not isinstance(meta, dict):
        raise ConfigError(f"{where}: metadata must be a JSON object")
    meta = dict(meta)
    for column in fields.metadata:
        meta[column.rsplit(".", 1)[-1]] = _lookup(row, column, where)
    if answer_col is not None:
        answer = _lookup(row, answer_col, where)
        if isinstance(answer, bool) or not isinstance(answer, str | int | float):
            raise ConfigError(
                f"{where}: the answer must be a string or a number (column {answer_col!r}), "
                f"not {type(answer).__name__}"
            )
        meta["answer"] = answer
    try:
        orjson.dumps(meta)
    except TypeError as e:
        raise ConfigError(f"{where}: metadata is not JSON ({e})") from None
    return meta


def _lookup(row: dict[str, Any], column: str, where: str) -> Any:
    """``row[column]``; ``a.b`` is field ``b`` of object ``a`` (unless ``a.b`` is a column)."""
    if column in row:
        return row[column]
    value: Any = row
    for part in column.split("."):
        if not isinstance(value, dict) or part not in value:
            raise ConfigError(f"{where}: no {column!r}")
        value = value[part]
    return value


def sim_prompts(n: int, lengths: LengthHistogram, seed: int = 0) -> list[SourcePrompt]:
    """``n`` simulated prompts, each with its oracle output length in ``metadata.sim_length``."""
    drawn = lengths.sample(n, np.random.default_rng(seed))
    return [
        SourcePrompt(
            f"sim-{seed}-{i:07d}",
            f"simulated prompt {i} (seed {seed})",
            {"sim_length": int(length)},
        )
        for i, length in enumerate(drawn)
    ]


def make_predictor(cfg: DispatchConfig, prompts: list[PromptLike]) -> LengthPredictor:
    default = cfg.baseline_length or cfg.max_new_tokens
    if cfg.predictor == "baseline":
        return BaselinePredictor(default)
    if cfg.predictor == "ranker":
        return RankerPredictor(store_from_config(cfg), cfg.run, BaselinePredictor(default))
    known = {
        p.text: int(p.metadata["sim_length"])
        for p in prompts
        if isinstance(p.metadata.get("sim_length"), int)
    }
    if not known:
        raise ConfigError("--predictor oracle: no prompt carries metadata.sim_length")
    return OraclePredictor(known, default)
