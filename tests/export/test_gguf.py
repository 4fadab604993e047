"""The GGUF base: Q4_0 carries orbitctl's INT4 integers exactly, and the file is what llama.cpp's loader reads."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from orbitctl.export import q4_0  # noqa: E402
from orbitctl.export.archs import ARCHS, Namer  # noqa: E402
from orbitctl.export.base import QuantizedBase  # noqa: E402


def _read(path: Path):
    return gguf.GGUFReader(str(path))


def _field(reader, key):
    return reader.fields[key].contents()


def _dequantized(tensor) -> torch.Tensor:
    values = gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
    return torch.from_numpy(np.ascontiguousarray(values)).to(torch.float32)


@pytest.fixture(scope="module")
def base(int4_profile):
    from orbitctl.builder import prepare_frozen_base
    from orbitctl.data.prompts import load_prompts
    from orbitctl.profile import load_profile

    profile = load_profile(str(int4_profile))
    return QuantizedBase(prepare_frozen_base(profile, load_prompts(profile.data, profile.run.seed).warm_task).quantized_dir)


def test_every_q4_0_tensor_equals_orbitctls_decoded_int4(gguf_export, base):
    reader = _read(Path(gguf_export.output) / "model.gguf")
    by_name = {r.name: r for r in gguf_export.tensors}
    namer = Namer(ARCHS["llama"], base.config)
    exact = 0
    for tensor in reader.tensors:
        if tensor.tensor_type != gguf.GGMLQuantizationType.Q4_0:
            continue
        record = by_name[tensor.name]
        weight = base.read(record.source)
        rows = namer.row_order(record.source, weight.shape[0])
        expected = weight.decoded() if rows is None else weight.decoded()[rows]
        got = _dequantized(tensor).reshape(expected.shape)
        assert torch.equal(got, expected), tensor.name
        exact += record.status == "exact"
    quantized = [n for n in base.entries if n.endswith(".weight_packed")]
    assert exact == len(quantized) == 14  # 7 linear layers x 2 decoder layers, lm_head kept bf16
    assert gguf_export.counts["converted"] == 0 and gguf_export.counts["exact"] == len(gguf_export.tensors)


def test_every_other_tensor_is_exact_too(gguf_export, base):
    reader = _read(Path(gguf_export.output) / "model.gguf")
    by_name = {r.name: r for r in gguf_export.tensors}
    for tensor in reader.tensors:
        if tensor.tensor_type == gguf.GGMLQuantizationType.Q4_0:
            continue
        weight = base.read(by_name[tensor.name].source)
        assert tensor.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)
        if len(weight.shape) == 1:
            assert tensor.tensor_type == gguf.GGMLQuantizationType.F32, tensor.name  # norms in F32
        assert torch.equal(_dequantized(tensor).reshape(weight.shape), weight.decoded()), tensor.name


def test_the_file_reads_back_as_llama_with_its_tokenizer(gguf_export, base):
    reader = _read(Path(gguf_export.output) / "model.gguf")
    assert _field(reader, "general.architecture") == "llama"
    assert _field(reader, "general.type") == "model"
    assert _field(reader, "llama.block_count") == 2 and _field(reader, "llama.embedding_length") == 64
    assert _field(reader, "llama.attention.head_count_kv") == 2
    names = {t.name for t in reader.tensors}
    assert len(reader.tensors) == len(base.names()) == 21
    arch = gguf.MODEL_ARCH.LLAMA
    allowed = {gguf.TENSOR_NAMES[t].format(bid=b) + ".weight" for t in gguf.MODEL_TENSORS[arch] for b in range(2)}
    assert names <= allowed, sorted(names - allowed)
    assert {"token_embd.weight", "output.weight", "output_norm.weight", "blk.1.attn_q.weight", "blk.0.ffn_down.weight"} <= names
    tokens = _field(reader, "tokenizer.ggml.tokens")
    from orbitctl.model.charset import VOCAB

    assert _field(reader, "tokenizer.ggml.model") == "llama" and len(tokens) == 100
    assert tokens[VOCAB["7"]] == "7" and tokens[VOCAB[" "]] == "\u2581" and tokens[VOCAB["\n"]] == "\n"
    types = _field(reader, "tokenizer.ggml.token_type")
    assert types[VOCAB["<s>"]] == gguf.TokenType.CONTROL and types[VOCAB["<unk>"]] == gguf.TokenType.UNKNOWN
    assert types[VOCAB["7"]] == gguf.TokenType.NORMAL
    assert len(_field(reader, "tokenizer.ggml.scores")) == 100
    assert _field(reader, "tokenizer.ggml.bos_token_id") == 1 and _field(reader, "tokenizer.ggml.eos_token_id") == 2
    assert _field(reader, "tokenizer.ggml.add_bos_token") is True
    assert _field(reader, "tokenizer.ggml.add_space_prefix") is False


def test_the_q4_0_nibble_order_is_gguf_pys():
    """Element j of a block sits in the low nibble of byte j (j < 16) or the high nibble of byte j - 16."""
    codes = torch.arange(-8, 8, dtype=torch.int8).repeat(4).reshape(2, 32)
    codes[1] = codes[1].flip(0)
    scale = torch.tensor([[0.5], [0.25]], dtype=torch.bfloat16)
    data, check = q4_0.pack(codes, scale)
    assert data.shape == (2, 18) and check.exact
    assert data[0, 2] == (0 | (0 << 4)) and data[0, 3] == (1 | (1 << 4))  # q = code + 8: elements 0 and 16 are both -8
    got = q4_0.unpack(data, (2, 32))
    assert torch.equal(got, codes.float() * scale.float())


def test_a_scale_fp16_cannot_hold_is_reported_as_converted(base, tmp_path):
    """A copy of the base with one bf16 scale planted below fp16's normal range, where fp16 drops mantissa bits."""
    from safetensors.torch import load_file, save_file

    from orbitctl.export.gguf_base import write_base_gguf
    from orbitctl.export.vocab import read_vocab

    copy = tmp_path / "base"
    shutil.copytree(base.path, copy)
    tensors = load_file(str(copy / "model.safetensors"))
    key = "model.layers.1.mlp.up_proj.weight_scale"
    planted = torch.tensor((1 + 2 ** -7) * 2 ** -20, dtype=torch.bfloat16)
    assert planted.float() != planted.half().float()  # not an fp16 number
    tensors[key][3, 1] = planted
    save_file(tensors, str(copy / "model.safetensors"), metadata={"format": "pt"})
    planted_base = QuantizedBase(copy)
    records = write_base_gguf(planted_base, ARCHS["llama"], read_vocab(copy, "llama", 100), tmp_path / "m.gguf", name="x")
    converted = [r for r in records if r.status == "converted"]
    assert [r.source for r in converted] == ["model.layers.1.mlp.up_proj.weight"]
    assert converted[0].name == "blk.1.ffn_up.weight" and converted[0].written_as == "Q4_0"
    assert "1 of 256 bf16 scales rounded to fp16" in converted[0].why
    tensor = next(t for t in _read(tmp_path / "m.gguf").tensors if t.name == "blk.1.ffn_up.weight")
    weight = planted_base.read("model.layers.1.mlp.up_proj.weight")
    got = _dequantized(tensor).reshape(weight.shape)
    expected = weight.codes.float() * weight.scale.half().float().repeat_interleave(32, dim=1)
    assert torch.equal(got, expected)  # the same integers, with the fp16-rounded scale
    assert not torch.equal(got, weight.decoded())


def test_a_group_of_64_is_two_q4_0_blocks_with_one_scale():
    codes = torch.randint(-8, 8, (4, 128), dtype=torch.int8, generator=torch.Generator().manual_seed(0))
    scale = (torch.rand(4, 2, generator=torch.Generator().manual_seed(1)) * 0.1 + 0.01).to(torch.bfloat16)
    data, check = q4_0.pack(codes, scale)
    assert check.exact
    assert torch.equal(q4_0.unpack(data, (4, 128)), codes.float() * scale.float().repeat_interleave(64, dim=1))
