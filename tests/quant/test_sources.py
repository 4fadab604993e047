"""Quantized inputs: FP8 block checkpoints are dequantized on the fly, INT4 ones are taken as is."""

from __future__ import annotations

import json

import torch

from orbitctl.quant.convert import quantize_checkpoint
from orbitctl.codec.formats import dequantize_fp8_blocks



def test_fp8_source_is_dequantized_block_by_block_then_quantized(quantized, qt, tmp_path):
    import bitsandbytes.functional as bnbf

    fp8 = quantized("deepseek_v3", "fp8")
    result = quantize_checkpoint(fp8, tmp_path / "nf4", fmt="nf4", max_shard_bytes=60_000)
    assert not result.report["passthrough"]
    src, out = qt.read_all(fp8), qt.read_all(tmp_path / "nf4")
    name = "model.layers.0.self_attn.q_b_proj.weight"  # 192 x 64: two row blocks of 128
    dense = dequantize_fp8_blocks(src[name], src[name + "_scale_inv"], torch.bfloat16)
    packed, state = bnbf.quantize_4bit(dense, blocksize=64, compress_statistics=True, quant_type="nf4",
                                       quant_storage=torch.bfloat16)
    assert torch.equal(out[name].view(torch.uint8), packed.view(torch.uint8))  # packed bits may spell NaN in bf16
    assert torch.equal(out[name + ".absmax"], state.absmax)
    assert not any(k.endswith("_scale_inv") for k in out)
    # routed experts (kept in bf16 by nf4) come out as the dequantized FP8 values
    expert = "model.layers.1.mlp.experts.2.down_proj.weight"
    assert out[expert].dtype == torch.bfloat16
    assert torch.equal(out[expert], dequantize_fp8_blocks(src[expert], src[expert + "_scale_inv"], torch.bfloat16))
    assert torch.equal(out["model.embed_tokens.weight"], src["model.embed_tokens.weight"])


def test_fp8_source_to_fp8_is_copied_not_requantized(quantized, qt, tmp_path):
    fp8 = quantized("qwen3_moe", "fp8")
    result = quantize_checkpoint(fp8, tmp_path / "again", fmt="fp8", max_shard_bytes=60_000)
    assert result.report["passthrough"] and result.report["tensors"] == []
    src, out = qt.read_all(fp8), qt.read_all(tmp_path / "again")
    assert src.keys() == out.keys()
    assert all(torch.equal(src[k].view(torch.uint8), out[k].view(torch.uint8)) for k in src)


def test_int4_checkpoint_is_accepted_as_is(quantized, qt, tmp_path):
    from orbitctl.model.frozen_base import load_frozen_base

    shipped = quantized("deepseek_v3", "int4", modules="experts")  # the Kimi-K2-Thinking layout: experts only
    result = quantize_checkpoint(shipped, tmp_path / "taken", fmt="int4", group_size=64, max_shard_bytes=60_000)
    assert result.report["passthrough"]
    src, out = qt.read_all(shipped), qt.read_all(tmp_path / "taken")
    assert src.keys() == out.keys()
    assert all(torch.equal(src[k], out[k]) for k in src)
    config_in = json.loads((shipped / "config.json").read_text())
    config_out = json.loads((tmp_path / "taken" / "config.json").read_text())
    assert config_out["quantization_config"] == config_in["quantization_config"]
    assert config_out["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] == 32
    load_frozen_base(tmp_path / "taken")
