"""A model whose output layer is its embedding (``tie_word_embeddings``) through quantize and load, every format.

The checkpoint stores one matrix, ``embed_tokens``; the frozen base keeps it unquantized and its output layer is
a plain linear layer over that very tensor, never a 4-bit layer wrapping it (bitsandbytes asserts at the first
forward when it is) and never a second copy.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn


@pytest.fixture(scope="module")
def tied_source(tmp_path_factory):
    from orbitctl.model.tiny import build_tiny_model

    return build_tiny_model("llama", tmp_path_factory.mktemp("tied") / "hf", tie_word_embeddings=True)


def _tensor_names(directory) -> set[str]:
    from safetensors import safe_open

    names: set[str] = set()
    for file in directory.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            names.update(f.keys())
    return names


def _logits_and_head_input(model, ids):
    """The model's logits, and the final hidden states the output layer received (caught by a hook)."""
    seen = {}
    handle = model.get_output_embeddings().register_forward_hook(lambda m, args, out: seen.update(x=args[0]))
    try:
        logits = model(ids).logits
    finally:
        handle.remove()
    return logits, seen["x"]


@pytest.mark.parametrize("fmt", ["nf4", "int4", "fp8", "none"])
def test_tied_checkpoint_quantizes_and_loads_with_one_embedding(tied_source, tmp_path, fmt):
    from orbitctl.model.frozen_base import load_frozen_base
    from orbitctl.quant.convert import quantize_checkpoint

    assert "lm_head.weight" not in _tensor_names(tied_source)  # transformers writes a tied model without it
    out = tmp_path / fmt
    quantize_checkpoint(tied_source, out, fmt=fmt, group_size=32 if fmt == "int4" else 64)
    assert not any(n.startswith("lm_head.") for n in _tensor_names(out))
    config = json.loads((out / "config.json").read_text())
    if fmt == "nf4":  # an explicit skip list replaces transformers' default one, which would have skipped it
        assert "lm_head" in config["quantization_config"]["llm_int8_skip_modules"]
    model = load_frozen_base(out, compute_dtype=torch.float32)
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    assert type(head) is nn.Linear and head.weight is embedding.weight
    ids = torch.tensor([[1, 5, 9, 200, 31, 7]])
    logits, hidden = _logits_and_head_input(model, ids)  # nf4 failed here before
    assert torch.equal(logits, nn.functional.linear(hidden, embedding.weight))
    sharing = [n for n, p in model.named_parameters(remove_duplicate=False) if p is embedding.weight]
    assert sorted(sharing) == ["lm_head.weight", "model.embed_tokens.weight"]  # one tensor, two names


def test_nf4_checkpoint_written_without_the_tied_head_in_its_skip_list_still_loads(tied_source, tmp_path):
    """A tied nf4 checkpoint from before quantize wrote lm_head into llm_int8_skip_modules (or from another tool)."""
    from orbitctl.model.frozen_base import load_frozen_base
    from orbitctl.quant.convert import quantize_checkpoint

    out = tmp_path / "nf4"
    quantize_checkpoint(tied_source, out, fmt="nf4")
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"]["llm_int8_skip_modules"] = []
    (out / "config.json").write_text(json.dumps(config))
    model = load_frozen_base(out, compute_dtype=torch.float32)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    logits, hidden = _logits_and_head_input(model, torch.tensor([[3, 4, 5]]))
    assert torch.equal(logits, nn.functional.linear(hidden, model.get_input_embeddings().weight))


def test_tied_checkpoint_that_stores_the_head_keeps_it_bf16_and_loads_one_matrix(tied_source, tmp_path):
    """Some tied checkpoints also store lm_head.weight, equal to the embedding: never quantized, even with
    quant.skip empty, and the loaded output layer is the embedding itself, not a second copy."""
    from safetensors.torch import load_file, save_file

    from orbitctl.model.frozen_base import load_frozen_base
    from orbitctl.quant.convert import TIED_REASON, quantize_checkpoint

    source = tmp_path / "with-head"
    source.mkdir()
    tensors = load_file(str(tied_source / "model.safetensors"))
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, str(source / "model.safetensors"), metadata={"format": "pt"})
    (source / "config.json").write_text((tied_source / "config.json").read_text())
    for fmt in ("int4", "nf4"):
        out = tmp_path / fmt
        result = quantize_checkpoint(source, out, fmt=fmt, group_size=32 if fmt == "int4" else 64, skip=[])
        (head_row,) = [r for r in result.report["kept"] if r["name"] == "lm_head.weight"]
        assert head_row["reason"] == TIED_REASON and head_row["dtype"] == "BF16"
        model = load_frozen_base(out, compute_dtype=torch.float32)
        assert type(model.lm_head) is nn.Linear and model.lm_head.weight is model.model.embed_tokens.weight
