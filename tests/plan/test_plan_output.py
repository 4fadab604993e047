"""`orbitctl plan`'s text output: the answer in its first lines, and no cell cut at 80 or 120 columns."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def _render(repo, name: str, columns: int) -> str:
    env = {**os.environ, "COLUMNS": str(columns), "NO_COLOR": "1"}
    code = "from orbitctl.cli.app import main; raise SystemExit(main(['plan', %r]))" % str(
        repo / "profiles" / f"{name}.yaml")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode in (0, 1), done.stderr
    return done.stdout


@pytest.mark.parametrize("columns", [80, 120])
@pytest.mark.parametrize("name", ["kimi-k2_grpo_int4_8xh200", "llama-3.1-8b_grpo_qlora-nf4_1x24g"])
def test_plan_reads_at_80_and_120_columns_without_a_cut_cell(repo, name, columns):
    out = _render(repo, name, columns)
    assert "…" not in out, [line for line in out.splitlines() if "…" in line]
    if "kimi" in name:  # the layouts table keeps its EP column and tells its four rows apart
        rows = [line.split() for line in out.splitlines() if line.strip().startswith(("8*", "1 ", "8 "))]
        assert len({tuple(r) for r in rows}) >= 4 and any(r[0] == "8*" for r in rows)


@pytest.mark.parametrize("name", ["kimi-k2_grpo_int4_8xh200", "llama-3.1-8b_grpo_qlora-nf4_1x24g", "tiny-cpu"])
def test_the_answer_comes_in_the_first_ten_lines(repo, name):
    head = _render(repo, name, 120).splitlines()[:10]
    text = "\n".join(head)
    assert "FITS" in text or "DOES NOT FIT" in text
    assert "per GPU in" in text  # the peak and its phase
    assert "step " in text and "prediction" in text  # the step time and what it rests on
    assert "GPU-hours" in text
    full = _render(repo, name, 120)
    if "advice:" in full:
        assert any(line.startswith("advice:") and "--set" in line for line in head)
