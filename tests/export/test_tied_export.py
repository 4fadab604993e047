"""Export of a tied-embedding base (a tiny llama with ``tie_word_embeddings``, named by ``model.path``, INT4 g32).

The base GGUF has ``token_embd`` and no ``output.weight``, as llama.cpp's converter writes a tied model, and
llama.cpp then computes its logits with ``token_embd``: with the LoRA GGUF it follows orbitctl's train path
within a few times the floor measured beside it (the same check as test_llama_cpp.py). The merged checkpoint
keeps ``tie_word_embeddings`` and stores no ``lm_head``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import yaml

gguf = pytest.importorskip("gguf")
# llama.cpp runs in a child (orbitctl.isolated); the parent never imports llama_cpp, find_spec only looks for it
requires_llama_cpp = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                                        reason="llama-cpp-python is not installed (`make setup` builds it)")
DEMO = Path(__file__).resolve().parents[2] / "profiles" / "tiny-cpu.yaml"


@pytest.fixture(scope="module")
def tied_profile(tmp_path_factory, model_cache) -> Path:
    from orbitctl.model.tiny import build_tiny_char_model

    root = tmp_path_factory.mktemp("tied-export")
    source = build_tiny_char_model(root / "hf", tie_word_embeddings=True)
    data = yaml.safe_load(DEMO.read_text())
    data["name"], data["model"] = "tied", {"path": str(source)}
    data["quant"].update({"format": "int4", "group_size": 32})
    (root / "tied.yaml").write_text(yaml.safe_dump(data))
    return root / "tied.yaml"


@pytest.fixture(scope="module")
def tied_policy(tied_profile):
    """The tied policy with seeded random, non-zero LoRA weights (as tests/export/conftest.py makes them)."""
    from orbitctl.builder import load_policy, prepare_frozen_base
    from orbitctl.data.prompts import load_prompts
    from orbitctl.model.adapters import randomize_adapters
    from orbitctl.profile import load_profile

    profile = load_profile(str(tied_profile))
    policy = load_policy(profile, prepare_frozen_base(profile, load_prompts(profile.data, profile.run.seed).warm_task),
                         device="cpu")
    randomize_adapters(policy.model, seed=7, std=0.15)
    return policy


@pytest.fixture(scope="module")
def tied_adapter(tied_policy, tmp_path_factory) -> Path:
    from orbitctl.model.adapters import save_adapter

    out = tmp_path_factory.mktemp("tied-run") / "adapter"
    save_adapter(tied_policy.model, out, "lora", tied_policy.hidden_size)
    return out


@requires_llama_cpp
def test_the_base_gguf_has_no_output_weight_and_llama_cpp_uses_the_embedding(tied_profile, tied_policy, tied_adapter,
                                                                            tmp_path):
    from orbitctl.export.api import export
    from orbitctl.export.compare import held_out_sequences
    from orbitctl.export.llamacpp import llama_cpp_agreement
    from orbitctl.profile import load_profile

    result = export(str(tied_profile), str(tmp_path / "gguf"), "gguf", adapter=str(tied_adapter))
    out = Path(result.output)
    names = {t.name for t in gguf.GGUFReader(str(out / "model.gguf")).tensors}
    assert "token_embd.weight" in names and "output.weight" not in names
    assert not any(r.source.startswith("lm_head") for r in result.tensors)
    seqs = held_out_sequences(load_profile(str(tied_profile)), tied_policy, 8)
    agreement = llama_cpp_agreement(tied_policy, seqs, out / "model.gguf", out / "adapter.gguf")
    floor, with_adapter, without = agreement["floor"], agreement["with_adapter"], agreement["without_adapter"]
    assert 0 < floor["logsoftmax_l1_mean"], floor
    assert with_adapter["logsoftmax_l1_mean"] <= 4 * floor["logsoftmax_l1_mean"], (with_adapter, floor)
    assert with_adapter["js_max"] <= 4 * floor["js_max"] + 1e-12, (with_adapter, floor)
    assert without["logsoftmax_l1_mean"] > 20 * with_adapter["logsoftmax_l1_mean"], (with_adapter, without)


def test_the_merged_checkpoint_stays_tied(tied_profile, tied_adapter, tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from orbitctl.export.api import export

    result = export(str(tied_profile), str(tmp_path / "merged"), "hf-merged", adapter=str(tied_adapter))
    out = Path(result.output)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        stored = set(f.keys())
    assert "model.embed_tokens.weight" in stored and not any(n.startswith("lm_head") for n in stored)
    model = AutoModelForCausalLM.from_pretrained(str(out))
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    ulp = torch.finfo(torch.bfloat16).eps * result.merge_cost["logit_absmax"]
    assert result.merge_cost["max_abs_logit_diff"] <= 16 * ulp, result.merge_cost  # the bound test_lora_and_merged uses


def test_an_lm_head_copy_in_a_tied_base_is_left_out(tmp_path):
    """A tied checkpoint that also stores lm_head (equal to the embedding): the export reads one matrix."""
    from safetensors.torch import load_file, save_file

    from orbitctl.export.base import QuantizedBase
    from orbitctl.model.tiny import build_tiny_char_model
    from orbitctl.quant.convert import quantize_checkpoint

    source = build_tiny_char_model(tmp_path / "hf", tie_word_embeddings=True)
    tensors = load_file(str(source / "model.safetensors"))
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, str(source / "model.safetensors"), metadata={"format": "pt"})
    quantize_checkpoint(source, tmp_path / "int4", fmt="int4", group_size=32)
    base = QuantizedBase(tmp_path / "int4")
    assert "lm_head.weight" in base.entries and base.tied  # stored (bf16) ...
    assert "lm_head.weight" not in base.names() and "model.embed_tokens.weight" in base.names()  # ... not exported
