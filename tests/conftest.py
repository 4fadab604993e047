"""Fixtures every test directory shares."""

import os
from pathlib import Path

import pytest
import yaml

DEMO = Path(__file__).resolve().parents[1] / "profiles" / "tiny-cpu.yaml"


@pytest.fixture(scope="session", autouse=True)
def model_cache(tmp_path_factory):
    """The demo base is built and quantized once per session into this directory (subprocesses inherit it)."""
    cache = os.environ.get("ORBITCTL_TEST_CACHE") or str(tmp_path_factory.mktemp("orbitctl-cache"))
    os.environ["ORBITCTL_CACHE"] = cache
    return cache


@pytest.fixture(scope="session")
def write_demo_profile():
    """``write_demo_profile(path, {dotted.key: value})``: the demo profile with those values, written to path."""

    def write(path: Path, overrides: dict) -> Path:
        data = yaml.safe_load(DEMO.read_text())
        for key, value in overrides.items():
            node = data
            *parents, last = key.split(".")
            for part in parents:
                node = node.setdefault(part, {})
            node[last] = value
        path.write_text(yaml.safe_dump(data))
        return path

    return write


def _one_error_line(err: str, *needles: str) -> None:
    """``err`` is exactly one ``Error: ...`` line, no traceback, holding every needle."""
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: ") and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


@pytest.fixture
def one_error_line():
    """``one_error_line(stderr, *needles)``: a bad-input error printed as one line naming the needles."""
    return _one_error_line


@pytest.fixture
def gpu_profile_inputs(tmp_path):
    """``--set`` arguments that give a shipped GPU profile the files `train --dry-run` checks for: a stand-in
    quantized base (a directory with a config.json) and a one-record GSM8K data file."""
    base = tmp_path / "quantized-base"
    base.mkdir()
    (base / "config.json").write_text("{}")
    data = tmp_path / "train.jsonl"
    data.write_text('{"question": "What is 2 + 3?", "answer": "2 + 3 = 5\\n#### 5"}\n')
    return ["--set", f"model.quantized_path={base}", "--set", f"data.train={data}"]
