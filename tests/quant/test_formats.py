"""Each format against the reference implementation of its layout."""

from __future__ import annotations

import json

import pytest
import torch

from orbitctl.codec.formats import (
    FormatSpec, dequantize_fp8_blocks, dequantize_int4, pack_int4, quantize_fp8_blocks, quantize_int4, unpack_int4,
)



@pytest.mark.parametrize("fmt,storage,dq,block", [("nf4", "bf16", True, 64), ("nf4", "uint8", False, 64),
                                                  ("fp4", "uint8", True, 128), ("fp4", "bf16", False, 64)])
def test_bnb_packed_data_and_absmax_are_bit_identical_to_quantize_4bit(tiny_models, quantized, qt, fmt, storage, dq, block):
    import bitsandbytes.functional as bnbf

    out = quantized("deepseek_v3", fmt, storage_dtype=storage, double_quant=dq, group_size=block)
    stored, source = qt.read_all(out), qt.read_all(tiny_models["deepseek_v3"])
    names = [n for n in stored if n + ".quant_map" in stored]
    assert len(names) == 16  # 5 MLA projections x 2 layers, dense MLP 3, shared expert 3
    storage_dtype = torch.bfloat16 if storage == "bf16" else torch.uint8
    for name in names:
        packed, state = bnbf.quantize_4bit(source[name], blocksize=block, compress_statistics=dq,
                                           quant_type=fmt, quant_storage=storage_dtype)
        assert stored[name].dtype == storage_dtype
        assert torch.equal(stored[name].view(torch.uint8), packed.view(torch.uint8)), name
        assert torch.equal(stored[name + ".absmax"], state.absmax), name
        expected = state.as_dict(packed=True)
        assert set(k for k in stored if k.startswith(name + ".")) == {f"{name}.{k}" for k in expected}
        for key, value in expected.items():
            assert torch.equal(stored[f"{name}.{key}"], value), f"{name}.{key}"


def test_bnb_config_matches_what_transformers_writes(quantized):
    config = json.loads((quantized("llama", "nf4") / "config.json").read_text())
    qc = config["quantization_config"]
    assert qc["quant_method"] == "bitsandbytes" and qc["load_in_4bit"] is True
    assert qc["bnb_4bit_quant_type"] == "nf4" and qc["bnb_4bit_use_double_quant"] is True
    assert qc["bnb_4bit_quant_storage"] == "bfloat16" and qc["llm_int8_skip_modules"] == ["lm_head"]


def test_int4_layout_decodes_with_the_compressed_tensors_decompressor(tiny_models, quantized, qt):
    out = quantized("qwen3_moe", "int4", group_size=64)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "pack-quantized" and qc["quant_method"] == "compressed-tensors"
    weights = qc["config_groups"]["group_0"]["weights"]
    assert (weights["num_bits"], weights["symmetric"], weights["strategy"], weights["group_size"]) == (4, True, "group", 64)
    stored, source = qt.read_all(out), qt.read_all(tiny_models["qwen3_moe"])
    prefixes = [n[: -len(".weight_packed")] for n in stored if n.endswith(".weight_packed")]
    assert any(".experts.3.down_proj" in p for p in prefixes) and len(prefixes) == 2 * (4 + 4 * 3)
    for prefix in prefixes:
        assert stored[prefix + ".weight_packed"].dtype == torch.int32
        assert stored[prefix + ".weight_scale"].dtype == torch.bfloat16
        assert stored[prefix + ".weight_shape"].tolist() == list(source[prefix + ".weight"].shape)
        theirs = qt.decode_ct_int4(stored, prefix, qc)
        ours = dequantize_int4(stored[prefix + ".weight_packed"], stored[prefix + ".weight_scale"],
                               source[prefix + ".weight"].shape[1], theirs.dtype)
        assert theirs.dtype == torch.bfloat16 and torch.equal(theirs, ours), prefix
        err = (theirs.float() - source[prefix + ".weight"].float()).norm() / source[prefix + ".weight"].float().norm()
        assert 0.0 < err < 0.15


def test_int4_packing_puts_the_first_column_in_the_lowest_nibble():
    codes = torch.tensor([[-8, -7, 0, 1, 2, 3, 6, 7]], dtype=torch.int8)
    word = pack_int4(codes)
    nibbles = [0, 1, 8, 9, 10, 11, 14, 15]  # code + 8, lowest first
    expected = sum(v << (4 * i) for i, v in enumerate(nibbles))
    assert word.dtype == torch.int32 and word.item() == expected - 2**32  # top nibble 15 sets the sign bit
    assert torch.equal(unpack_int4(word, 8), codes.to(torch.int32))


def test_int4_quantization_on_known_values():
    w = torch.tensor([[7.5, -7.5, 1.0, -1.04, 3.2, 0.0, 0.49, 0.51] * 4], dtype=torch.float32)
    codes, scale = quantize_int4(w, 32)
    assert scale.item() == 1.0  # absmax 7.5 / 7.5
    assert codes[0, :8].tolist() == [7, -8, 1, -1, 3, 0, 0, 1]  # +7.5 clamps to 7, -7.5 rounds to -8


def test_fp8_block_dequant_is_exact_on_known_blocks():
    q = torch.zeros(200, 300, dtype=torch.float8_e4m3fn)
    q[0, 0], q[127, 127], q[128, 0], q[199, 299], q[5, 200] = 1.5, -448.0, 2.0, 0.25, -3.0
    scale = torch.tensor([[0.5, 2.0, 4.0], [0.125, 8.0, 1024.0]], dtype=torch.float32)
    w = dequantize_fp8_blocks(q, scale, torch.float32)
    assert w.shape == (200, 300)
    assert (w[0, 0].item(), w[127, 127].item(), w[128, 0].item(), w[199, 299].item(), w[5, 200].item()) == \
           (0.75, -224.0, 0.25, 256.0, -6.0)
    assert int((w != 0).sum()) == 5


def test_fp8_quantization_round_trips_representable_blocks_exactly():
    # every value is an e4m3 number times a power of two and each block reaches 448 x scale
    base = torch.tensor([448.0, -448.0, 1.0, 0.5, -2.25, 0.0], dtype=torch.float32)
    w = base.repeat(256 * 256 // 6 + 1)[: 256 * 256].reshape(256, 256)
    w[:128, 128:] *= 2.0**-6
    w[128:, :128] *= 2.0**3
    q, scale = quantize_fp8_blocks(w)
    assert scale.shape == (2, 2) and q.dtype == torch.float8_e4m3fn
    assert torch.equal(dequantize_fp8_blocks(q, scale, torch.float32), w)


def test_fp8_checkpoint_layout(quantized, qt):
    out = quantized("deepseek_v3", "fp8")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                  "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head"]}
    stored = qt.read_all(out)
    assert stored["model.layers.1.mlp.experts.0.up_proj.weight"].dtype == torch.float8_e4m3fn
    assert stored["model.layers.1.mlp.experts.0.up_proj.weight_scale_inv"].shape == (1, 1)
    assert stored["model.layers.0.self_attn.q_b_proj.weight_scale_inv"].shape == (2, 1)
    assert stored["lm_head.weight"].dtype == torch.bfloat16


def test_describe_names_every_knob():
    assert FormatSpec("nf4", 64, True, "bf16").describe() == {"format": "nf4", "block_size": 64, "double_quant": True,
                                                              "storage_dtype": "bf16"}


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("quant_type,dtype", [("nf4", torch.bfloat16), ("fp4", torch.float16), ("nf4", torch.float32)])
def test_chunked_4bit_quantizer_is_bit_identical_on_many_chunks(threads, quant_type, dtype):
    import bitsandbytes.functional as bnbf

    from orbitctl.codec.bnb4 import quantize_4bit

    w = (torch.randn(1100, 768, generator=torch.Generator().manual_seed(3)) * 0.03).to(dtype)  # 845k values: many chunks
    w[7, :128] = 0  # an all-zero block
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ours, state = quantize_4bit(w, blocksize=64, quant_type=quant_type, double_quant=True, quant_storage=torch.uint8)
    finally:
        torch.set_num_threads(before)
    ref, ref_state = bnbf.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type=quant_type)
    assert torch.equal(ours, ref)
    a, b = state.as_dict(packed=True), ref_state.as_dict(packed=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_4bit_lookup_table_is_exact_at_and_beside_every_midpoint(quant_type):
    # the bucket table must agree with counting midpoints exactly where rounding could move a value
    # into the neighbouring cell: on each midpoint and one float32 step either side of it
    import bitsandbytes.functional as bnbf

    from orbitctl.codec.bnb4 import _codebook, quantize_4bit

    midpoints = torch.tensor(_codebook(quant_type)[0], dtype=torch.float32)
    values = torch.cat([midpoints, torch.nextafter(midpoints, torch.tensor(2.0)),
                        torch.nextafter(midpoints, torch.tensor(-2.0)), torch.tensor([0.0, -0.0, 1.0, -1.0])])
    values = torch.cat([values, torch.linspace(-1, 1, 64 * 40 - values.numel() - 40)])
    blocks = values[torch.randperm(values.numel(), generator=torch.Generator().manual_seed(0))]
    blocks = torch.cat([blocks, torch.zeros(40)]).view(-1, 64)
    blocks[:, 0] = 1.0  # absmax 1: the scaled values are the values themselves
    w = blocks.reshape(80, 32).contiguous()
    ours, _ = quantize_4bit(w, blocksize=64, quant_type=quant_type, double_quant=False, quant_storage=torch.uint8)
    ref, _ = bnbf.quantize_4bit(w, blocksize=64, compress_statistics=False, quant_type=quant_type)
    assert torch.equal(ours, ref)
