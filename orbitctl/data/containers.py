"""Records from a data file, whatever holds them: JSON Lines (plain or gzip), JSON, Parquet, Arrow.

* ``.jsonl``, ``.jsonl.gz``: one JSON object per line (empty lines skipped).
* ``.json``, ``.json.gz``: a JSON list of objects, or an object whose ``"data"`` is that list;
  a ``.json`` file that is JSON Lines (what ``Dataset.to_json`` writes) reads as JSON Lines
  (so a lone object without a ``"data"`` list is one record).
* ``.parquet``: what ``Dataset.to_parquet`` writes.
* ``.arrow``: an Arrow IPC stream, as ``Dataset.save_to_disk`` writes ``data-00000-of-00001.arrow``
  (an IPC file, Feather v2, reads too).
* a directory: a ``save_to_disk`` directory (its ``state.json`` lists the Arrow files in order;
  without one, every ``*.arrow``, else every ``*.parquet``, in name order).

Every record comes with where it is, ``file:line`` for JSON Lines, ``file:N`` (the N-th record or
row, from 1) otherwise, so a bad one is named. Reading fails on the first malformed record.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Iterator

from orbitctl.errors import InputFileError

SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".json.gz", ".parquet", ".arrow")
"""The file endings read (a ``save_to_disk`` directory too)."""


@dataclass(frozen=True)
class Record:
    """One record of a data file and where it is, for messages."""

    where: str
    fields: dict


def read_records(path: str | Path) -> list[Record]:
    """Every record of the file or ``save_to_disk`` directory at ``path``, in order."""
    path = Path(path)
    if not path.exists():
        raise InputFileError(f"{path}: file not found",
                             fix="set data.train/data.eval to an existing data file or builtin:NAME")
    if path.is_dir():
        return [record for part in _directory_parts(path) for record in read_records(part)]
    name = path.name.lower()
    if name.endswith((".jsonl", ".jsonl.gz")):
        with _open_text(path) as handle:
            return list(_json_lines(handle, path))
    if name.endswith((".json", ".json.gz")):
        return _json_document(path)
    if name.endswith(".parquet"):
        return _rows(path, _parquet_table(path))
    if name.endswith(".arrow"):
        return _rows(path, _arrow_table(path))
    raise InputFileError(f"{path}: unknown data file type",
                         fix=f"use a file ending in {', '.join(SUFFIXES)} or a save_to_disk directory")


def _open_text(path: Path) -> IO[str]:
    if path.name.lower().endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return path.open(encoding="utf-8")


def _object(value, where: str) -> Record:
    if not isinstance(value, dict):
        raise InputFileError(f"{where}: expected a JSON object, got {type(value).__name__}")
    return Record(where, value)


def _json_lines(handle: IO[str], path: Path) -> Iterator[Record]:
    try:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as exc:
                raise InputFileError(f"{path}:{number}: not valid JSON ({exc.msg} at column {exc.colno})",
                                     fix="each line must be one JSON object") from None
            yield _object(value, f"{path}:{number}")
    except (OSError, EOFError, UnicodeDecodeError) as exc:  # a truncated or corrupt gzip, bytes that are not UTF-8
        raise InputFileError(f"{path}: cannot be read ({exc})", fix="rewrite the file as UTF-8 JSON Lines") from None


def _json_document(path: Path) -> list[Record]:
    try:
        with _open_text(path) as handle:
            text = handle.read()
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        raise InputFileError(f"{path}: cannot be read ({exc})", fix="rewrite the file as UTF-8 JSON") from None
    try:
        document = json.loads(text)
    except json.JSONDecodeError:
        # Dataset.to_json writes JSON Lines under a .json name
        from io import StringIO

        return list(_json_lines(StringIO(text), path))
    if isinstance(document, dict):
        # {"data": [...]}, or the one line of a one-record JSON Lines file
        document = document["data"] if isinstance(document.get("data"), list) else [document]
    if not isinstance(document, list):
        raise InputFileError(f"{path}: expected a JSON list of records or {{\"data\": [...]}}, "
                             f"got {type(document).__name__}", fix="write one JSON object per record")
    return [_object(value, f"{path}:{number}") for number, value in enumerate(document, start=1)]


def _parquet_table(path: Path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path)
    except (pa.ArrowException, OSError) as exc:
        raise InputFileError(f"{path}: not a readable Parquet file ({exc})",
                             fix="write it again with Dataset.to_parquet or pyarrow.parquet.write_table") from None


def _arrow_table(path: Path):
    import pyarrow as pa

    try:
        with pa.memory_map(str(path)) as source:
            return pa.ipc.open_stream(source).read_all()
    except pa.ArrowInvalid:
        pass
    try:
        with pa.memory_map(str(path)) as source:
            return pa.ipc.open_file(source).read_all()
    except (pa.ArrowException, OSError) as exc:
        raise InputFileError(f"{path}: not an Arrow IPC stream or file ({exc})",
                             fix="write it again with Dataset.save_to_disk or pyarrow.ipc") from None


def _rows(path: Path, table) -> list[Record]:
    return [Record(f"{path}:{number}", row) for number, row in enumerate(table.to_pylist(), start=1)]


def _directory_parts(path: Path) -> list[Path]:
    if (path / "dataset_dict.json").exists():
        raise InputFileError(f"{path}: a dataset with several splits",
                             fix=f"point at one split's directory, e.g. {path / 'train'}")
    state = path / "state.json"
    if state.exists():
        try:
            files = [path / entry["filename"] for entry in json.loads(state.read_text())["_data_files"]]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise InputFileError(f"{state}: not a save_to_disk state file ({exc})",
                                 fix="write the directory again with Dataset.save_to_disk") from None
    else:
        files = sorted(path.glob("*.arrow")) or sorted(path.glob("*.parquet"))
    if not files:
        raise InputFileError(f"{path}: a directory with no .arrow or .parquet files",
                             fix="point at a data file or a Dataset.save_to_disk directory")
    return files
