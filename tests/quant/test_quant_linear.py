"""QuantLinear: plain-torch dequantization on CPU, under FakeTensorMode and under torch.compile."""

from __future__ import annotations

import pytest
import torch

from orbitctl.model.quant_linear import QuantLinear
from orbitctl.codec.formats import pack_int4, quantize_fp8_blocks, quantize_int4


def _layer(fmt: str, out_f: int = 96, in_f: int = 256) -> tuple[QuantLinear, torch.Tensor]:
    w = torch.randn(out_f, in_f, generator=torch.Generator().manual_seed(1)) * 0.05
    layer = QuantLinear(in_f, out_f, fmt, group_size=32)
    if fmt == "int4":
        codes, scale = quantize_int4(w, 32)
        layer.weight_packed.data, layer.weight_scale.data = pack_int4(codes), scale
    else:
        q, scale = quantize_fp8_blocks(w)
        layer.weight.data, layer.weight_scale_inv.data = q, scale
    return layer, w


@pytest.mark.parametrize("fmt", ["int4", "fp8"])
def test_forward_matches_the_dense_weight(fmt):
    layer, w = _layer(fmt)
    x = torch.randn(3, 5, 256, dtype=torch.bfloat16)
    dense = layer.dequantized_weight(torch.float32)
    assert float((dense - w).norm() / w.norm()) < (0.12 if fmt == "int4" else 0.04)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, dense.to(torch.bfloat16)))
    assert all(not p.requires_grad for p in layer.parameters())


@pytest.mark.parametrize("fmt", ["int4", "fp8"])
def test_runs_under_fake_tensor_mode(fmt):
    from torch._subclasses.fake_tensor import FakeTensorMode

    layer, _ = _layer(fmt)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        x = torch.empty(4, 7, 256, dtype=torch.bfloat16)
        fake_layer = QuantLinear(256, 96, fmt, group_size=32)
        y = fake_layer(x)
        assert y.shape == (4, 7, 96) and y.dtype == torch.bfloat16
        assert mode.is_our_fake(y) if hasattr(mode, "is_our_fake") else type(y).__name__ == "FakeTensor"


@pytest.mark.parametrize("fmt", ["int4", "fp8"])
def test_compiles_without_graph_breaks(fmt):
    layer, _ = _layer(fmt)
    x = torch.randn(2, 256, dtype=torch.bfloat16)
    eager = layer(x)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x), eager)


@pytest.mark.parametrize("fmt", ["int4", "fp8"])
def test_backward_dequantizes_again_instead_of_keeping_the_dense_weight(fmt):
    """The input's gradient equals the dense layer's, and autograd keeps only the input, not W (an [out, in]
    dense copy per layer, which for a MoE layer's experts would be the whole layer in bf16)."""
    layer, _ = _layer(fmt, out_f=512, in_f=1024)
    x = torch.randn(4, 1024, dtype=torch.float32, requires_grad=True)
    saved: list[int] = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = layer(x)
    y.square().sum().backward()
    ref_x = x.detach().clone().requires_grad_(True)
    torch.nn.functional.linear(ref_x, layer.dequantized_weight(torch.float32)).square().sum().backward()
    assert torch.equal(x.grad, ref_x.grad)
    weight_bytes = 512 * 1024 * 4
    assert sum(saved) < weight_bytes / 8, saved  # y for the square; nothing weight-sized
