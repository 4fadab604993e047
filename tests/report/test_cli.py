"""`orbitctl report` stays thin, prints one JSON document with --json, and refuses bad input with exit 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from orbitctl.cli.app import app, main

REPO = Path(__file__).resolve().parents[2]


def test_arguments_reach_the_library(monkeypatch):
    import orbitctl.report as report

    seen = {}

    def fake(run_dirs, out, *, on_progress):
        seen.update(run_dirs=run_dirs, out=out, on_progress=on_progress)
        raise SystemExit(0)

    monkeypatch.setattr(report, "write_report", fake)
    result = CliRunner().invoke(app, ["report", "runs/a", "runs/b", "--out", "reports/ab", "--json"])
    assert result.exit_code == 0, result.output
    assert seen == {"run_dirs": ["runs/a", "runs/b"], "out": "reports/ab", "on_progress": None}


def test_json_is_one_document_and_no_torch_is_imported(make_run):
    run = make_run("json-run")
    script = ("import sys\nfrom orbitctl.cli.app import main\ncode = main(['report', sys.argv[1], '--json'])\n"
              "print(code, 'torch' in sys.modules, file=sys.stderr)")
    proc = subprocess.run([sys.executable, "-c", script, str(run)], capture_output=True, text=True, cwd=REPO,
                          timeout=120)
    assert proc.stderr.strip().splitlines()[-1] == "0 False", proc.stderr
    document = json.loads(proc.stdout)
    assert document["out"] == str(run / "report") and document["runs"][0]["name"] == "json-run"
    assert document["files"][-2:] == ["summary.json", "summary.md"]
    assert "drawing" not in proc.stderr  # --json turns progress off


def test_table_and_progress_without_json(make_run, capsys):
    run = make_run("plain")
    assert main(["report", str(run)]) == 0
    out, err = capsys.readouterr()
    assert "plain (30 steps, finished)" in out and "entropy unstable" in out and str(run / "report") in out
    assert "drawing reward.png" in err and "gradient-norm spike" in err


def _bad(tmp_path, make_run, case: str) -> tuple[list[str], tuple[str, ...]]:
    if case == "missing dir":
        return [str(tmp_path / "nope")], (str(tmp_path / "nope"), "no such run directory")
    if case == "no metrics":
        (tmp_path / "empty").mkdir()
        return [str(tmp_path / "empty")], ("metrics.jsonl",)
    if case == "torn metrics":
        run = make_run("torn")
        (run / "metrics.jsonl").write_text('{"step": 1}\nnot json\n{"step": 3}\n')
        return [str(run)], (f"{run / 'metrics.jsonl'}:2", "not JSON")
    if case == "no profile":
        run = make_run("noprof")
        (run / "profile.yaml").unlink()
        return [str(run)], ("profile.yaml",)
    if case == "bad profile":
        run = make_run("badprof", **{"alignment.entropy_window": 1})
        return [str(run)], ("profile.yaml", "alignment.entropy_window")
    if case == "two runs, no --out":
        return [str(make_run("a")), str(make_run("b"))], ("--out", "2 runs")
    if case == "--out is a run":
        a, b = make_run("a"), make_run("b")
        return [str(a), str(b), "--out", str(a)], ("--out", str(a))
    if case == "--out is a parent of a run":
        a = make_run("a")
        return [str(a), "--out", str(tmp_path)], ("--out", str(tmp_path))
    if case == "--out holds other files":
        (tmp_path / "docs").mkdir()
        (tmp_path / "docs" / "notes.txt").write_text("keep me")
        return [str(make_run("a")), "--out", str(tmp_path / "docs")], ("--out", "not a report")
    if case == "same run twice":
        a = make_run("a")
        return [str(a), str(a), "--out", str(tmp_path / "r")], ("given twice",)
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["missing dir", "no metrics", "torn metrics", "no profile", "bad profile",
                                  "two runs, no --out", "--out is a run", "--out is a parent of a run",
                                  "--out holds other files", "same run twice"])
def test_bad_input_is_one_line_and_exit_2(tmp_path, make_run, capsys, one_error_line, case):
    args, needles = _bad(tmp_path, make_run, case)
    code = main(["report", *args])
    err = capsys.readouterr().err
    assert code == 2, err
    one_error_line(err, *needles)
    if case == "--out holds other files":
        assert (tmp_path / "docs" / "notes.txt").read_text() == "keep me"
    if case in ("--out is a run", "--out is a parent of a run"):
        assert (tmp_path / "a" / "metrics.jsonl").is_file()
