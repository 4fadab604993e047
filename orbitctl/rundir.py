"""Files that are never half-written, JSON read with an error that names the file, and the run directory.

    from orbitctl.rundir import RunDir, atomic_write_json, read_json
    run = RunDir("runs/tiny-cpu")
    run.metrics, run.summary, run.adapter, run.checkpoint(40)    # every path of the layout
    atomic_write_json(run.summary, {"status": "finished"})      # a temp name, fsync, rename
    read_json("quant_report.json", what="quantization report")   # InputFileError naming the file

The layout (``train`` writes it, ``verify-alignment --run`` and ``doctor`` read it)::

    profile.yaml          the profile the run was started with (overrides applied)
    deepspeed_config.json the DeepSpeed config the engine was built with (ZeRO stage, offload, prefetch)
    metrics.jsonl         one JSON object per optimizer step (docs/train.md)
    summary.json          written last: status, steps, accuracy before/after
    adapter/              the final adapter, PEFT format
    checkpoints/step-N/   complete checkpoints (a COMPLETE marker written last); .tmp-step-N while written
    report/               plots and tables made from the run
    tensorboard/ wandb/ mlflow/   what run.loggers write: event files, offline W&B runs, a local MLflow store

Everything that must not be seen half-written goes through :func:`atomic_file` or
:func:`atomic_dir`: a temporary name next to the target, renamed into place when complete, so an
interrupted writer leaves either the old file or none, never one that looks complete.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple

from orbitctl.errors import InputFileError


def cache_root() -> Path:
    """Where orbitctl caches what it builds (quantized bases, the demo model, compiled kernels): ``$ORBITCTL_CACHE``,
    else ``~/.cache/orbitctl``."""
    return Path(os.environ.get("ORBITCTL_CACHE") or Path.home() / ".cache" / "orbitctl")

PARTIAL_SUFFIX = ".partial"
"""What a file is called while it is written: ``name.partial`` next to ``name``."""


@contextlib.contextmanager
def atomic_file(path: str | Path, *, fsync: bool = True) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; when the block ends without error, fsync it and rename it
    onto ``path``. On error the temporary file is removed and ``path`` is untouched."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + PARTIAL_SUFFIX)
    try:
        yield tmp
        if fsync:
            with tmp.open("rb") as handle:
                os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | Path, text: str, *, fsync: bool = True) -> Path:
    """Write ``text`` to ``path`` through :func:`atomic_file`."""
    with atomic_file(path, fsync=fsync) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)


def atomic_write_json(path: str | Path, document: Any, *, fsync: bool = True) -> Path:
    """``document`` as indented JSON with a final newline, through :func:`atomic_file`."""
    return atomic_write_text(path, json.dumps(document, indent=2) + "\n", fsync=fsync)


def atomic_dir(final: str | Path, fill: Callable[[Path], Any], *, replace: bool = False) -> Any:
    """Fill a temporary directory next to ``final`` with ``fill(tmp)`` and rename it into place; returns
    what ``fill`` returned. A ``final`` that already exists is kept (another process finished the same
    work first) unless ``replace``, which swaps the new directory in. A failed fill leaves nothing."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        result = fill(tmp)
        if final.exists() and not replace:
            shutil.rmtree(tmp)
            return result
        promote_dir(tmp, final)
        return result
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def promote_dir(tmp: str | Path, final: str | Path) -> None:
    """Rename the completed directory ``tmp`` onto ``final``, replacing an older ``final`` (for directories
    several processes fill together, such as a checkpoint every rank writes into)."""
    final = Path(final)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)


def fsync_tree(path: str | Path) -> None:
    """fsync every file below ``path`` (before a rename that declares the directory complete)."""
    for file in Path(path).rglob("*"):
        if file.is_file():
            with file.open("rb") as handle:
                os.fsync(handle.fileno())


def read_json(path: str | Path, *, what: str = "JSON file", key: str | None = None, fix: str | None = None,
              expect: type | None = dict) -> Any:
    """The JSON document in ``path``. A missing, unreadable or malformed file (or, with ``expect``, a top
    level of another type) is an InputFileError naming the profile ``key`` that pointed at it (if any),
    the file, what it should have been, and ``fix``."""
    path = Path(path)
    where = f"{key}: {path}" if key else str(path)
    if not path.is_file():
        raise InputFileError(f"{where}: {what} not found", fix=fix or "check the path")
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise InputFileError(f"{where}: cannot read the {what} ({getattr(exc, 'strerror', None) or exc})",
                             fix=fix or "check the file and its permissions") from None
    except json.JSONDecodeError as exc:
        raise InputFileError(f"{where}: not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})",
                             fix=fix or f"rewrite or replace the {what}") from None
    if expect is not None and not isinstance(document, expect):
        raise InputFileError(f"{where}: the {what} must hold a JSON {'object' if expect is dict else expect.__name__} "
                             f"at the top level, got {type(document).__name__}", fix=fix)
    return document


def read_json_or_none(path: str | Path) -> Any | None:
    """The JSON document in ``path``, or None when it is missing or torn (state files a rerun rebuilds)."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None


class JsonLine(NamedTuple):
    number: int
    """1-based line number in the file."""
    text: str
    record: Any | None
    """The parsed line; None when it is not JSON (a torn last line, or a bad one the caller judges)."""
    error: str | None = None
    """Why it is not JSON, e.g. 'Expecting value'."""
    column: int | None = None


def jsonl_records(path: str | Path) -> Iterator[JsonLine]:
    """Every non-empty line of a JSONL file, parsed or with the reason it could not be."""
    with Path(path).open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                yield JsonLine(number, line.rstrip("\n"), json.loads(line))
            except json.JSONDecodeError as exc:
                yield JsonLine(number, line.rstrip("\n"), None, exc.msg, exc.colno)


class RunDir:
    """The paths of one training run's directory (see the module docstring for the layout)."""

    PROFILE = "profile.yaml"
    METRICS = "metrics.jsonl"
    SUMMARY = "summary.json"
    DEEPSPEED_CONFIG = "deepspeed_config.json"
    ADAPTER = "adapter"
    CHECKPOINTS = "checkpoints"
    REPORT = "report"
    TENSORBOARD = "tensorboard"
    WANDB = "wandb"
    MLFLOW = "mlflow"
    LOGGER_DIRS = (TENSORBOARD, WANDB, MLFLOW)
    """What ``run.loggers`` write (docs/train.md, "Experiment trackers")."""
    COMPLETE = "COMPLETE"
    """The marker a checkpoint gets last; a checkpoint without it is partial."""
    TRAINER_STATE = "trainer.json"
    """The trainer's own state inside a checkpoint (step, data cursor, dtypes, threads)."""
    OWNED = (CHECKPOINTS, ADAPTER, METRICS, SUMMARY, PROFILE, DEEPSPEED_CONFIG, *LOGGER_DIRS)
    """What ``--fresh`` removes."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    def __repr__(self) -> str:
        return f"RunDir({str(self.root)!r})"

    profile = property(lambda self: self.root / self.PROFILE)
    metrics = property(lambda self: self.root / self.METRICS)
    summary = property(lambda self: self.root / self.SUMMARY)
    deepspeed_config = property(lambda self: self.root / self.DEEPSPEED_CONFIG)
    adapter = property(lambda self: self.root / self.ADAPTER)
    checkpoints = property(lambda self: self.root / self.CHECKPOINTS)
    report = property(lambda self: self.root / self.REPORT)

    def checkpoint(self, step: int) -> Path:
        return self.checkpoints / f"step-{step}"

    def partial_checkpoint(self, step: int) -> Path:
        return self.checkpoints / f".tmp-step-{step}"

    def complete_checkpoints(self) -> list[tuple[int, Path]]:
        """``(step, path)`` of every complete checkpoint, oldest first."""
        found = []
        if self.checkpoints.exists():
            for path in self.checkpoints.iterdir():
                if path.name.startswith("step-") and (path / self.COMPLETE).exists():
                    try:
                        found.append((int(path.name[5:]), path))
                    except ValueError:
                        continue
        return sorted(found)

    def latest_checkpoint(self) -> tuple[int, Path] | None:
        found = self.complete_checkpoints()
        return found[-1] if found else None

    def remove_partial(self) -> None:
        """Remove checkpoints an interrupted save left behind (``.tmp-step-N``, or no COMPLETE marker)."""
        if self.checkpoints.exists():
            for path in self.checkpoints.iterdir():
                if path.name.startswith(".tmp-") or (path.name.startswith("step-") and not (path / self.COMPLETE).exists()):
                    shutil.rmtree(path, ignore_errors=True)

    def clear(self) -> None:
        """Remove what a run wrote (``--fresh``); files that are not the run's stay."""
        for name in self.OWNED:
            target = self.root / name
            shutil.rmtree(target, ignore_errors=True) if target.is_dir() else target.unlink(missing_ok=True)

    def trained_adapter(self) -> Path | None:
        """The run's final adapter, else the newest complete checkpoint's, else None."""
        if self.adapter.is_dir():
            return self.adapter
        latest = self.latest_checkpoint()
        return latest[1] / self.ADAPTER if latest else None


RUN_DIR_FIX = "the run dir is runs/<profile name>, or the profile's run.dir"


def read_metrics(run_dir) -> list[dict]:
    """The run's per-step records, in step order; a torn last line is dropped."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise InputFileError(f"{run_dir}: no such run directory — fix: {RUN_DIR_FIX}")
    path = RunDir(run_dir).metrics
    if not path.is_file():
        raise InputFileError(f"{path}: no {path.name} in the run directory — fix: {RUN_DIR_FIX}, "
                             f"after at least one training step")
    rows = list(jsonl_records(path))
    records = []
    for k, (number, _, record, error, _) in enumerate(rows):
        if record is None:
            if k == len(rows) - 1:
                break  # a write cut short by a kill: the step is not complete
            raise InputFileError(f"{path}:{number}: not JSON ({error}) — fix: remove the damaged line "
                                 f"(train rewrites the file from its last checkpoint on resume)") from None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise InputFileError(f"{path}:{number}: not a step record (step) — fix: pass a run directory written "
                                 f"by orbitctl train")
        records.append(record)
    return sorted(records, key=lambda r: r["step"])


def metric_series(records: list[dict], name: str) -> list[tuple[int, float]]:
    """``(step, value)`` of every record whose ``name`` is a finite number (nulls and NaN left out)."""
    return [(r["step"], float(r[name])) for r in records
            if isinstance(r.get(name), (int, float)) and not isinstance(r.get(name), bool) and math.isfinite(r[name])]
