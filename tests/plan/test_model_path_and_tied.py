"""`model.path` alone names the architecture (its config.json), and a tied model counts its embedding once.

The counts are checked against the model transformers builds from the same config.json: ``parameters()``
yields a tied output layer's weight once, as the embedding.
"""

from __future__ import annotations

import json

import pytest

from orbitctl.cli.app import main


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Two tiny llamas, tied and untied, as checkpoint directories."""
    from orbitctl.model.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("plan-path")
    return {tied: build_tiny_model("llama", root / f"tied-{tied}", tie_word_embeddings=tied) for tied in (True, False)}


def _profile(tmp_path, model: str) -> str:
    path = tmp_path / "p.yaml"
    path.write_text(f"name: t\nmodel:\n{model}hardware: {{gpu: cpu, gpus_per_node: 1, host_ram_gib: 24}}\n"
                    "quant: {format: nf4}\nmemory: {seq_len: 32, micro_batch_size: 1}\n")
    return str(path)


def _transformers_count(directory) -> int:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(directory)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("tied", [True, False])
def test_model_path_alone_plans_from_its_config_json(checkpoints, tmp_path, capsys, tied):
    directory = checkpoints[tied]
    assert main(["plan", _profile(tmp_path, f"  path: {directory}\n"), "--json"]) in (0, 1)
    by_path = json.loads(capsys.readouterr().out)
    assert by_path["params_total"] == _transformers_count(directory)
    # the same numbers as naming the file itself
    assert main(["plan", _profile(tmp_path, f"  config: {directory / 'config.json'}\n"), "--json"]) in (0, 1)
    by_config = json.loads(capsys.readouterr().out)
    assert by_config["params_total"] == by_path["params_total"]
    assert by_config["per_gpu_bytes"] == by_path["per_gpu_bytes"]


def test_tied_model_counts_the_embedding_once(checkpoints):
    from orbitctl.arch import arch_from_config, load_config_file

    tied, untied = (arch_from_config(load_config_file(checkpoints[t] / "config.json")) for t in (True, False))
    assert tied.lm_head is None and tied.tie_word_embeddings
    assert untied.params_total - tied.params_total == tied.embedding.numel


def test_model_path_without_config_json_is_exit_2_naming_model_path(tmp_path, capsys, one_error_line):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["plan", _profile(tmp_path, f"  path: {empty}\n")]) == 2
    one_error_line(capsys.readouterr().err, "model.path", str(empty), "config.json")


def test_model_path_alone_is_a_valid_profile(tmp_path):
    from orbitctl.profile import load_profile

    profile = load_profile(_profile(tmp_path, "  path: /models/any\n"))  # the file is read when used, not here
    assert profile.model.path == "/models/any" and profile.model.config is None and profile.model.arch is None
