"""Experiment trackers beside metrics.jsonl: each step's numbers sent to TensorBoard, W&B or MLflow, offline.

    loggers = open_loggers(profile, RunDir("runs/tiny-cpu"), resumed_at=0)   # what run.loggers names
    for logger in loggers:
        logger.log(step, step_scalars(record))
    for logger in loggers:
        logger.close(failed=False)

:class:`~orbitctl.rl.runlog.MetricsLog` is the one caller: a record train appends to metrics.jsonl goes to every
logger at the same moment, as its numeric fields (a boolean as 0 or 1) under their own names, at the record's
step. Rank 0 alone logs. Each tracker writes inside the run directory and needs no network:

- ``tensorboard``: event files in ``tensorboard/`` (PyTorch's SummaryWriter, which needs the tensorboard package);
  a resumed run purges the events after its checkpoint's step, as metrics.jsonl is cut back there.
- ``wandb``: an offline run in ``wandb/`` (``wandb sync`` uploads it later); ``WANDB_MODE=online`` in the
  environment logs live instead, to ``WANDB_PROJECT`` (default ``orbitctl``).
- ``mlflow``: a local SQLite store, ``mlflow/mlflow.db`` (``mlflow ui --backend-store-uri sqlite:///...``), one
  experiment per profile name; ``MLFLOW_TRACKING_URI`` in the environment names another store.

W&B and MLflow start a new run each time train starts (a resumed run's first step is the one after the checkpoint).
Which packages each tracker needs is :data:`orbitctl.profile.support.LOGGER_MODULES`; train refuses a missing one
before it starts (exit 2).
"""

from __future__ import annotations

import os
import time
from typing import Protocol

from orbitctl.rundir import RunDir


class StepLogger(Protocol):
    def log(self, step: int, values: dict[str, float]) -> None: ...

    def close(self, failed: bool) -> None: ...


def step_scalars(record: dict) -> dict[str, float]:
    """The numbers of one metrics.jsonl record, every field but ``step`` (booleans as 0/1; None, text, lists and
    mappings left out): what each logger is sent."""
    return {key: float(value) for key, value in record.items()
            if key != "step" and isinstance(value, (int, float))}


def open_loggers(profile, run: RunDir, resumed_at: int) -> list[StepLogger]:
    """One logger per ``profile.run.loggers`` entry, in its order; ``resumed_at``: the step the run resumes from
    (0 for a fresh start)."""
    makers = {"tensorboard": TensorBoardLogger, "wandb": WandbLogger, "mlflow": MlflowLogger}
    return [makers[name](profile, run, resumed_at) for name in profile.run.loggers]


def _profile_text(profile) -> str:
    from orbitctl.profile import dump_profile

    return dump_profile(profile)


class TensorBoardLogger:
    """Scalars in TensorBoard event files under the run directory's ``tensorboard/``."""

    def __init__(self, profile, run: RunDir, resumed_at: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # events at or after purge_step, written before the checkpoint the run resumes from was cut, are dropped
        self.writer = SummaryWriter(str(run.root / RunDir.TENSORBOARD), purge_step=resumed_at + 1 if resumed_at else None)
        if not resumed_at:
            self.writer.add_text("profile", "\n".join("    " + line for line in _profile_text(profile).splitlines()))

    def log(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()  # a step is on disk when metrics.jsonl has it

    def close(self, failed: bool) -> None:
        self.writer.close()


class WandbLogger:
    """An offline W&B run under the run directory's ``wandb/``."""

    def __init__(self, profile, run: RunDir, resumed_at: int) -> None:
        import wandb

        self.run = wandb.init(
            mode=os.environ.get("WANDB_MODE") or "offline", dir=str(run.root),
            project=os.environ.get("WANDB_PROJECT") or "orbitctl", name=profile.name,
            config={**profile.model_dump(mode="json"), "resumed_from_step": resumed_at},
            # console off: W&B would wrap stdout and stderr, which carry train's JSON and live view
            settings=wandb.Settings(console="off", silent=True))

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)


MLFLOW_PARAMS_PER_CALL = 100
"""MLflow's limit on parameters in one log_batch call."""


class MlflowLogger:
    """An MLflow run in a local SQLite store under the run directory's ``mlflow/``, one experiment per profile."""

    def __init__(self, profile, run: RunDir, resumed_at: int) -> None:
        import logging

        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        root = (run.root / RunDir.MLFLOW).resolve()
        root.mkdir(parents=True, exist_ok=True)
        for name in ("mlflow", "alembic"):  # the store's creation logs its schema migrations at INFO
            logging.getLogger(name).setLevel(logging.WARNING)
        self.client = MlflowClient(tracking_uri=os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{root / 'mlflow.db'}")
        experiment = self.client.get_experiment_by_name(profile.name)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(
            profile.name, artifact_location=(root / "artifacts").as_uri())
        self.run_id = self.client.create_run(experiment_id, run_name=profile.name, tags={
            "orbitctl.run_dir": str(run.root), "orbitctl.resumed_from_step": str(resumed_at)}).info.run_id
        params = [Param(key, str(value)) for key, value in _flat(profile.model_dump(mode="json")).items()]
        for start in range(0, len(params), MLFLOW_PARAMS_PER_CALL):
            self.client.log_batch(self.run_id, params=params[start:start + MLFLOW_PARAMS_PER_CALL])

    def log(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(key, value, now, step) for key, value in values.items()])

    def close(self, failed: bool) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


def _flat(document: dict, prefix: str = "") -> dict:
    """``{"rl": {"lr": 1e-5}}`` -> ``{"rl.lr": 1e-5}``: the profile's keys as its YAML paths."""
    out = {}
    for key, value in document.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out
