"""Tabular prompt files read with pyarrow: parquet, Arrow IPC, and local dataset directories.

Owns which files a ``--prompts PATH`` that is not JSONL names and how their rows are read
(``producers.sources`` maps the rows' columns to prompts):

* ``*.parquet``: a parquet file;
* ``*.arrow``: an Arrow IPC file, stream format (what ``datasets`` writes) or file format;
* a directory: a Hugging Face ``datasets`` directory written by ``save_to_disk`` (its
  ``state.json`` lists the Arrow shards, read in order: what ``datasets.load_from_disk``
  reads, without needing ``datasets``), else the ``*.parquet`` files directly in it (or, with
  none, its ``*.arrow`` files), by name. A ``DatasetDict`` directory (``dataset_dict.json``) is
  refused with its splits named: give one split's directory. Nothing is ever downloaded.

pyarrow is imported when a table is first read (the ``data`` extra: ``pip install
'srl[data]'``); without it, and for a file that does not read, one line naming the file.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from srl.errors import ConfigError

BATCH_ROWS = 1024


@dataclass(frozen=True)
class RowFile:
    """One file of rows: its name in errors and generated ids, its columns, and ``read``,
    which yields ``(row number from 0, where, row)`` with only the given columns."""

    name: str
    columns: frozenset[str]
    read: Callable[[Sequence[str]], Iterator[tuple[int, str, dict[str, Any]]]]


def _pyarrow(path: Path) -> Any:
    try:
        import pyarrow
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError:
        raise ConfigError(
            f"{path}: reading parquet or Arrow prompts needs pyarrow: pip install 'srl[data]'"
        ) from None
    return pyarrow


def table_files(path: Path) -> list[RowFile]:
    """The files of ``path`` (a parquet or Arrow file, or a directory), each ready to read."""
    if path.is_dir() and (path / "state.json").is_file():  # one table in shards
        return [_one_table(path, [_open(f) for f in dataset_files(path)])]
    if path.is_dir():
        return [_open(f) for f in dataset_files(path)]
    if not path.is_file():
        raise ConfigError(f"prompts {path}: no such file or directory")
    return [_open(path)]


def dataset_files(d: Path) -> list[Path]:
    """The data files of a directory, in order (module docstring)."""
    if (d / "dataset_dict.json").is_file():
        try:
            splits = list(json.loads((d / "dataset_dict.json").read_text())["splits"])
        except (OSError, ValueError, KeyError, TypeError):
            splits = sorted(p.name for p in d.iterdir() if p.is_dir())
        first = d / (splits[0] if splits else "SPLIT")
        raise ConfigError(
            f"{d}: a DatasetDict (splits: {', '.join(map(str, splits)) or 'none'}): give one "
            f"split's directory, e.g. --prompts {first}"
        )
    state = d / "state.json"
    if state.is_file():
        try:
            names = [f["filename"] for f in json.loads(state.read_text())["_data_files"]]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"{state}: not a datasets state.json ({e!r})") from None
        files = [d / str(n) for n in names]
        missing = [f for f in files if not f.is_file()]
        if missing:
            raise ConfigError(f"{state}: lists {missing[0].name}, which is not in {d}")
    else:
        files = sorted(d.glob("*.parquet")) or sorted(d.glob("*.arrow"))
    if not files:
        raise ConfigError(
            f"prompts {d}: no state.json (datasets save_to_disk), *.parquet or *.arrow files"
        )
    return files


def _open(f: Path) -> RowFile:
    pa = _pyarrow(f)
    try:
        if f.suffix == ".parquet":
            schema = pa.parquet.ParquetFile(str(f)).schema_arrow
        else:
            schema = _ipc_reader(pa, f).schema
    except (OSError, pa.ArrowException) as e:
        raise ConfigError(f"{f}: not a readable {_kind(f)} file ({_why(e)})") from None

    def read(cols: Sequence[str]) -> Iterator[tuple[int, str, dict[str, Any]]]:
        n = 0
        try:
            for batch in _batches(pa, f, list(cols)):
                for row in batch.to_pylist():
                    yield n, f"{f}: row {n}", row
                    n += 1
        except (OSError, pa.ArrowException) as e:
            raise ConfigError(f"{f}: unreadable after row {n} ({_why(e)})") from None

    return RowFile(str(f), frozenset(schema.names), read)


def _one_table(d: Path, shards: list[RowFile]) -> RowFile:
    """The shards of a ``save_to_disk`` directory as one table: rows numbered across them, as
    ``datasets`` indexes them (so the generated ids are ``{directory name}:{row}``)."""

    def read(cols: Sequence[str]) -> Iterator[tuple[int, str, dict[str, Any]]]:
        n = 0
        for shard in shards:
            for _, _, row in shard.read([c for c in cols if c in shard.columns]):
                yield n, f"{d}: row {n}", row
                n += 1

    return RowFile(str(d), frozenset().union(*(s.columns for s in shards)), read)


def _batches(pa: Any, f: Path, cols: list[str]) -> Iterator[Any]:
    if f.suffix == ".parquet":
        pf = pa.parquet.ParquetFile(str(f))
        yield from pf.iter_batches(batch_size=BATCH_ROWS, columns=cols)
    else:
        for batch in _ipc_batches(pa, f):
            yield batch.select(cols)


def _ipc_reader(pa: Any, f: Path) -> Any:
    """An Arrow IPC reader of ``f``: the stream format (``datasets``), else the file format."""
    try:
        return pa.ipc.open_stream(pa.memory_map(str(f)))
    except pa.ArrowInvalid:
        return pa.ipc.open_file(pa.memory_map(str(f)))


def _ipc_batches(pa: Any, f: Path) -> Iterator[Any]:
    reader = _ipc_reader(pa, f)
    if hasattr(reader, "num_record_batches"):  # the file format
        for i in range(reader.num_record_batches):
            yield reader.get_batch(i)
    else:
        yield from reader


def _kind(f: Path) -> str:
    return "parquet" if f.suffix == ".parquet" else "Arrow IPC"


def _why(e: BaseException) -> str:
    return (str(e).splitlines() or [type(e).__name__])[0]
