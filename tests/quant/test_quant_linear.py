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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(96, 256), (256, 96 * 8), (5, 64)])
def test_workspace_dequantization_is_bit_identical(dtype, shape):
    from orbitctl.codec.formats import dequantize_int4, dequantize_int4_into
    from orbitctl.model.quant_linear import int4_workspace

    w = torch.randn(*shape, generator=torch.Generator().manual_seed(3))
    codes, scale = quantize_int4(w, 32)
    packed = pack_int4(codes)
    ref = dequantize_int4(packed, scale, shape[1], dtype)
    got = dequantize_int4_into(packed, scale, *int4_workspace(shape, dtype))
    assert got.dtype == dtype and got.shape == ref.shape
    assert torch.equal(got.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                       ref.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))


def test_layers_share_one_workspace_sized_by_the_largest_matrix():
    """(4 int32 + 4 float32 + 2 bf16) bytes per element of the largest matrix, reused by every later matmul and
    by both layer shapes; results equal the fresh-tensor path's."""
    import threading

    from orbitctl.model.quant_linear import workspace_bytes

    result = {}

    def run():  # a fresh thread: a workspace of its own, no other test's sizes
        a, _ = _layer("int4", out_f=512, in_f=256)
        b, _ = _layer("int4", out_f=128, in_f=512)
        x = torch.randn(3, 256, dtype=torch.bfloat16)
        ya = a(x)
        size = workspace_bytes()
        yb = b(torch.randn(3, 512, dtype=torch.bfloat16))
        for _ in range(3):
            a(x)
        result.update(size=size, after=workspace_bytes(), ya=ya, yb=yb,
                      ref_a=torch.nn.functional.linear(x, a.dequantized_weight(torch.bfloat16)))

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert result["size"] == 512 * 256 * (4 + 4 + 2) == result["after"]
    assert torch.equal(result["ya"], result["ref_a"])


def test_nothing_saved_for_backward_is_the_workspace():
    """Gradients through two layers that share the workspace equal the dense reference; autograd saves nothing
    weight-sized and nothing that lives in the workspace (a later layer overwrites it)."""
    from orbitctl.model.quant_linear import _WORKSPACE

    a, _ = _layer("int4", out_f=512, in_f=1024)
    b, _ = _layer("int4", out_f=1024, in_f=512)
    x = torch.randn(4, 1024, dtype=torch.float32, requires_grad=True)
    saved: list[torch.Tensor] = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = b(torch.relu(a(x)))
    y.square().sum().backward()
    ref_x = x.detach().clone().requires_grad_(True)
    wa, wb = a.dequantized_weight(torch.float32), b.dequantized_weight(torch.float32)
    torch.nn.functional.linear(torch.relu(torch.nn.functional.linear(ref_x, wa)), wb).square().sum().backward()
    assert torch.equal(x.grad, ref_x.grad)
    ws = {buf.untyped_storage().data_ptr() for buf in _WORKSPACE.buffers.values()}
    assert ws and not any(t.untyped_storage().data_ptr() in ws for t in saved)
    assert max(t.numel() * t.element_size() for t in saved) < 512 * 1024 * 4 / 8


def test_fake_and_meta_tensors_never_touch_the_workspace():
    import threading

    from torch._subclasses.fake_tensor import FakeTensorMode

    from orbitctl.model.quant_linear import workspace_bytes

    sizes = []

    def run():
        with FakeTensorMode(allow_non_fake_inputs=True):
            QuantLinear(256, 96, "int4", group_size=32)(torch.empty(2, 256, dtype=torch.bfloat16))
        QuantLinear(256, 96, "int4", group_size=32, device="meta")(torch.empty(2, 256, dtype=torch.bfloat16, device="meta"))
        sizes.append(workspace_bytes())

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert sizes == [0]


def test_the_plan_counts_the_workspace_the_layers_allocate():
    """orbitctl plan's dequant_workspace for the CPU profile equals the bytes the workspace holds after one matmul
    of every routed-expert shape of that architecture."""
    import threading
    from pathlib import Path

    from orbitctl.arch import builtin_arch
    from orbitctl.model.quant_linear import workspace_bytes
    from orbitctl.plan import plan_profile
    from orbitctl.profile import load_profile

    profile = load_profile(Path(__file__).resolve().parents[2] / "profiles" / "tiny-moe-cpu.yaml")
    shapes = {w.shape for layer in builtin_arch(profile.model.arch).layers for w in layer.weights if w.kind == "expert"}
    held = []

    def run():
        for out_f, in_f in sorted(shapes):
            layer, _ = _layer("int4", out_f=out_f, in_f=in_f)
            layer(torch.randn(2, in_f, dtype=torch.bfloat16))
        held.append(workspace_bytes())

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert held == [plan_profile(profile, with_advice=False).phases["policy_update"]["dequant_workspace"]]
