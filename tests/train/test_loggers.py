"""``run.loggers``: the numbers train writes to metrics.jsonl, sent to TensorBoard, W&B and MLflow, each offline
inside the run directory; a logger whose package is missing refused before anything starts; the live line's ETA.

One two-step run of the small demo profile writes all three; each tracker's own files are read back with its own
reader (TensorBoard's EventAccumulator, W&B's record log, MLflow's client) and compared with metrics.jsonl."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]


def _expected(records: list[dict]) -> dict[str, dict[int, float]]:
    """``{field: {step: value}}``: every numeric field of every record (booleans as 0/1)."""
    out: dict[str, dict[int, float]] = {}
    for record in records:
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)):
                out.setdefault(key, {})[record["step"]] = float(value)
    return out


def _same(a: float, b: float, rel: float = 0.0) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=rel, abs=0.0)


@pytest.fixture(scope="module")
def logged_run(module_profile_yaml):
    """Two optimizer steps of the small demo profile with every logger on, in this process; the run directory,
    its metrics.jsonl records and the events train emitted."""
    import os

    from orbitctl.profile import load_profile
    from orbitctl.rl.api import train

    for name in ("WANDB_MODE", "WANDB_PROJECT", "MLFLOW_TRACKING_URI"):  # the trackers' defaults: offline, in the run
        os.environ.pop(name, None)
    profile = load_profile(module_profile_yaml("logged", **{"rl.steps": 2,
                                                            "run.loggers": ["tensorboard", "wandb", "mlflow"]}))
    events: list[tuple[str, dict]] = []
    result = train(profile, on_event=lambda kind, payload: events.append((kind, payload)))
    run_dir = Path(result.run_dir)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    return run_dir, records, events


def test_tensorboard_event_file_holds_the_metrics(logged_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, records, _ = logged_run
    files = list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert len(files) == 1
    events = EventAccumulator(str(files[0]), size_guidance={"scalars": 0})
    events.Reload()
    expected = _expected(records)
    assert set(events.Tags()["scalars"]) == set(expected)
    for key, by_step in expected.items():
        logged = {s.step: s.value for s in events.Scalars(key)}
        assert logged.keys() == by_step.keys(), key
        for step, value in by_step.items():  # event files hold float32
            assert _same(logged[step], float(np.float32(value))), (key, step)


def _wandb_history(run_file: Path) -> list[dict]:
    """The history rows of a W&B run file: a LevelDB-style log of Record protobufs after a 7-byte header, in
    32 KiB blocks, each record a 7-byte header (CRC, length, type: full, first, middle, last) and its bytes."""
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, pending, rows = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            break
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
    return rows


def test_wandb_offline_run_holds_the_metrics(logged_run):
    run_dir, records, _ = logged_run
    runs = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1
    rows = _wandb_history(runs[0])
    assert [row["_step"] for row in rows] == [1, 2]
    expected = _expected(records)
    for row in rows:
        step = row["_step"]
        logged = {k: v for k, v in row.items() if not k.startswith("_")}
        assert logged.keys() == {k for k, by_step in expected.items() if step in by_step}
        for key, value in logged.items():
            assert _same(float(value), expected[key][step]), (key, step)


def test_mlflow_local_store_holds_the_metrics(logged_run):
    from mlflow.tracking import MlflowClient

    run_dir, records, _ = logged_run
    client = MlflowClient(tracking_uri=f"sqlite:///{(run_dir / 'mlflow' / 'mlflow.db').resolve()}")
    import yaml

    name = yaml.safe_load((run_dir / "profile.yaml").read_text())["name"]  # one experiment per profile name
    experiment = client.get_experiment_by_name(name)
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED" and run.data.params["rl.steps"] == "2"
    expected = _expected(records)
    assert set(run.data.metrics) == set(expected)
    for key, by_step in expected.items():
        logged = {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
        assert logged.keys() == by_step.keys(), key
        for step, value in by_step.items():
            assert _same(logged[step], value), (key, step)


def test_the_live_line_shows_the_eta_from_measured_steps_beside_the_plan(logged_run):
    from orbitctl.cli.train import LiveView

    _, records, events = logged_run
    setup = next(payload for kind, payload in events if kind == "setup")
    steps = [payload for kind, payload in events if kind == "step"]
    assert setup["plan_step_s"] > 0
    assert steps[0]["eta_s"] is None  # the first step pays the warm-up and is not counted
    assert steps[1]["step_s_mean"] > 0 and steps[1]["eta_s"] == 0.0  # the last step: nothing left
    assert "eta_s" not in records[1]  # the live view's, not a metric of the run
    view = LiveView(10, 1)
    view.event("setup", {**setup, "warnings": []})
    line = view._line({**records[0], "eta_s": 16.0, "step_s_mean": 2.0})
    assert "step 1/10  ETA 16.0 s (2.0 s/step, plan " in line


def test_step_clock_means_the_steps_after_the_first(monkeypatch):
    from orbitctl.rl import runlog

    clock = runlog.StepClock(total_steps=10)
    for now, step, want in ((100.0, 1, (None, None)), (103.0, 2, (3.0, 24.0)), (104.0, 3, (2.0, 14.0))):
        monkeypatch.setattr(runlog.time, "perf_counter", lambda now=now: now)
        tick = clock.tick(step)
        assert (tick["step_s_mean"], tick["eta_s"]) == want


def test_a_resumed_tensorboard_log_drops_the_steps_after_the_checkpoint(tmp_path):
    """metrics.jsonl is cut back to the checkpoint on resume; the event files drop the same steps."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from orbitctl.profile import load_profile
    from orbitctl.rl.loggers import TensorBoardLogger
    from orbitctl.rundir import RunDir

    profile = load_profile(ROOT / "profiles" / "tiny-cpu.yaml")
    run = RunDir(tmp_path)
    first = TensorBoardLogger(profile, run, resumed_at=0)
    for step in (1, 2, 3):
        first.log(step, {"reward_mean": float(step)})
    first.close(failed=True)
    resumed = TensorBoardLogger(profile, run, resumed_at=1)  # the checkpoint was step 1
    for step in (2, 3):
        resumed.log(step, {"reward_mean": 10.0 * step})
    resumed.close(failed=False)
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(s.step, s.value) for s in events.Scalars("reward_mean")] == [(1, 1.0), (2, 20.0), (3, 30.0)]


@pytest.mark.parametrize("logger, module", [("wandb", "wandb"), ("mlflow", "sqlalchemy"), ("tensorboard", "tensorboard")])
def test_a_logger_without_its_package_is_refused_before_the_run(logger, module, monkeypatch, capsys, one_error_line):
    from orbitctl.cli.app import main
    from orbitctl.profile import support

    real = support._installed
    monkeypatch.setattr(support, "_installed", lambda name: name != module and real(name))
    tiny = str(ROOT / "profiles" / "tiny-cpu.yaml")
    for extra in (["--dry-run"], []):  # refused before any work: the dry run and the run itself
        assert main(["train", tiny, "--set", f"run.loggers=[{logger}]", *extra]) == 2
        one_error_line(capsys.readouterr().err, "run.loggers", logger, f"package {module} is not installed",
                       "orbitctl[loggers]")


def test_loggers_are_listed_once_and_known():
    from orbitctl.errors import ProfileError
    from orbitctl.profile import load_profile

    tiny = ROOT / "profiles" / "tiny-cpu.yaml"
    assert load_profile(tiny).run.loggers == []
    with pytest.raises(ProfileError, match=r"run\.loggers: wandb listed more than once"):
        load_profile(tiny, ["run.loggers=[wandb, wandb]"])
    with pytest.raises(ProfileError, match=r"run\.loggers\.0: must be 'tensorboard', 'wandb' or 'mlflow'"):
        load_profile(tiny, ["run.loggers=[comet]"])
