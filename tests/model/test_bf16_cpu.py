"""The AVX512-BF16 INT4 kernel (orbitctl.kernels.bf16_cpu): what it computes, its layout, where it runs and where not."""

from __future__ import annotations

import pytest
import torch

from orbitctl.codec.formats import dequantize_int4, pack_int4, quantize_int4, unpack_int4
from orbitctl.kernels import bf16_cpu
from orbitctl.kernels.int4_kernel import Int4Pack

BF16_HALF_ULP = 2.0 ** -8
needs_kernel = pytest.mark.skipif(not bf16_cpu.available(), reason="the CPU has no AVX512-BF16 (or it is capped)")


def _weight(out_f: int, in_f: int, group: int = 64, seed: int = 0):
    w = torch.randn(out_f, in_f, generator=torch.Generator().manual_seed(seed)) * 0.05
    codes, scale = quantize_int4(w, group)
    return codes, pack_int4(codes), scale


def test_the_layout_holds_every_code_once_low_nibble_k_high_nibble_k_plus_16():
    codes, packed, scale = _weight(8, 128)
    ours, scales = bf16_cpu.pack(packed, scale)
    assert ours.dtype == torch.uint8 and ours.shape == (8, 64) and scales.dtype == torch.float32
    chunks = ours.reshape(8, 4, 16).to(torch.int32)
    back = torch.stack([chunks & 0xF, chunks >> 4], dim=2).reshape(8, 128) - 8
    assert torch.equal(back, codes.to(torch.int32))
    assert torch.equal(scales, scale.float())


def test_shapes_the_layout_cannot_take_are_named():
    assert bf16_cpu.unsupported_shape(96, 256, 64) is None
    assert "output features" in bf16_cpu.unsupported_shape(98, 256, 64)
    assert "groups of 48" in bf16_cpu.unsupported_shape(96, 240, 48)


@needs_kernel
@pytest.mark.parametrize("group", [32, 64, 128])
def test_it_is_the_bf16_rounded_float32_sum_of_exact_products(group):
    _, packed, scale = _weight(96, 512, group)
    ours, scales = bf16_cpu.pack(packed, scale)
    dense = dequantize_int4(packed, scale, 512, torch.float64)  # exact, and exactly a bf16 number each
    assert torch.equal(dense.to(torch.bfloat16).double(), dense)
    x = torch.randn(37, 512, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    y = bf16_cpu.matmul(x, ours, scales, group)
    exact = x.double() @ dense.t()
    # one rounding to bf16, and float32 accumulation over K terms (K eps_32 sum |x||w|)
    bound = BF16_HALF_ULP * exact.abs() * (1 + 2 ** -7) + 512 * 2.0 ** -24 * (x.double().abs() @ dense.abs().t())
    assert y.dtype == torch.bfloat16 and y.shape == (37, 96)
    assert bool(((y.double() - exact).abs() <= bound).all())
    # PyTorch's kernel sums the same products in another order: at most one bf16 step apart
    aten = torch.ops.aten._weight_int4pack_mm_for_cpu(
        x, torch.ops.aten._convert_weight_to_int4pack_for_cpu(unpack_int4(packed, 512).add_(8).contiguous(), 2),
        group, torch.stack([scale.t(), torch.zeros_like(scale.t())], -1).contiguous())
    assert bool(((y.float() - aten.float()).abs() <= 2 * BF16_HALF_ULP * aten.float().abs() + 2.0 ** -126).all())


@needs_kernel
def test_each_row_is_the_same_bit_for_bit_whatever_the_rows_beside_it():
    """What lets a one-token decode step and a batch compute the same numbers: tiles of 4 rows and the 1-row tail."""
    _, packed, scale = _weight(64, 256)
    ours, scales = bf16_cpu.pack(packed, scale)
    x = torch.randn(43, 256, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    whole = bf16_cpu.matmul(x, ours, scales, 64)
    for start, rows in ((0, 1), (1, 3), (4, 4), (5, 7), (11, 32)):
        assert torch.equal(bf16_cpu.matmul(x[start:start + rows], ours, scales, 64), whole[start:start + rows])
    # a strided (non-contiguous) input is read as its values
    wide = torch.zeros(43, 512, dtype=torch.bfloat16)
    wide[:, ::2] = x
    assert torch.equal(bf16_cpu.matmul(wide[:, ::2], ours, scales, 64), whole)


@needs_kernel
def test_a_pack_of_exact_scales_takes_it_and_other_scales_keep_pytorchs_kernel():
    _, packed, scale = _weight(96, 256)
    pack = Int4Pack.of(packed, scale)
    assert pack.kind == "bf16"
    x = torch.randn(2, 3, 256, generator=torch.Generator().manual_seed(3))
    assert pack.matmul(x).shape == (2, 3, 96) and pack.matmul(x).dtype == torch.float32
    inexact = Int4Pack.of(packed, (scale.float() * 1.01).to(torch.bfloat16))  # 8 significant bits
    assert inexact.kind == "aten"


def test_a_cpu_without_native_bf16_or_under_the_cap_is_told_why(monkeypatch):
    from orbitctl.kernels import cpu_dtype, cpu_state

    monkeypatch.setattr(bf16_cpu, "host_isa", bf16_cpu.host_isa.__wrapped__)  # asked afresh under each stub
    # the OS enabled the AVX-512 state (what the OS answers is tests/model/test_cpu_isa.py's)
    monkeypatch.setattr(cpu_state, "ask_kernel", lambda request_amx: cpu_state.KernelAnswers(0x2E7))
    flags = frozenset({"avx2", "fma"})
    monkeypatch.setattr(cpu_dtype, "read_host_cpu", lambda path="/proc/cpuinfo": cpu_dtype.CpuInfo("an AVX2 CPU", flags))
    assert "avx512_bf16" in bf16_cpu.cpu_unsupported()
    full = frozenset(bf16_cpu.CPU_FLAGS)
    monkeypatch.setattr(cpu_dtype, "read_host_cpu", lambda path="/proc/cpuinfo": cpu_dtype.CpuInfo("a CPU", full))
    monkeypatch.setattr(cpu_dtype, "host_bf16", lambda: cpu_dtype.Bf16Verdict(False, "capped by ATEN_CPU_CAPABILITY"))
    assert bf16_cpu.cpu_unsupported() == "capped by ATEN_CPU_CAPABILITY"


def test_a_failed_build_raises_with_the_compilers_words_and_leaves_no_library(tmp_path, monkeypatch):
    monkeypatch.setenv("ORBITCTL_CACHE", str(tmp_path))
    with pytest.raises(RuntimeError, match="failed"):
        bf16_cpu.build(compiler="false")  # a "compiler" that exits 1
    assert not any((tmp_path / "kernels").iterdir())


def test_a_build_lands_whole_under_a_name_of_its_source_and_is_reused(tmp_path, monkeypatch):
    import shutil

    compiler = shutil.which("g++")
    if compiler is None:
        pytest.skip("no g++ here")
    monkeypatch.setenv("ORBITCTL_CACHE", str(tmp_path))
    path = bf16_cpu.build(compiler)
    assert path.parent == tmp_path / "kernels" and path.name.startswith("bf16_cpu-") and path.stat().st_size > 0
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary left beside it
    stamp = path.stat().st_mtime_ns
    assert bf16_cpu.build(compiler) == path and path.stat().st_mtime_ns == stamp


def _attention_inputs(batch=5, heads=8, kv_heads=2, length=37, dim=64, room=11, seed=4):
    """bf16 q [B, H, 1, D] and K/V as the cache with room holds them: strided views of longer buffers."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, 1, dim, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(batch, kv_heads, length + room, dim, generator=g).to(torch.bfloat16)[:, :, :length]
            for _ in range(2))
    return q, k, v


@needs_kernel
def test_the_decode_attention_kernel_is_the_torch_paths_function_reading_the_cache_in_place(monkeypatch):
    from orbitctl.kernels import decode_attention as python_path

    q, k, v = _attention_inputs()
    assert not k.is_contiguous()
    mask = torch.ones(5, 1, 1, 37, dtype=torch.bool)
    mask[0, ..., :9] = False  # left padding
    mask[2, ..., 30] = False  # a finished row's fed pad
    mask[4] = False  # nothing to attend
    scale = 64 ** -0.5
    ours = bf16_cpu.decode_attention(q, k, v, mask, scale)
    assert ours.shape == (5, 8, 1, 64) and ours.dtype == torch.bfloat16
    assert bool((ours[4] == 0).all())
    additive = torch.zeros(mask.shape).masked_fill(~mask, float("-inf")).to(torch.bfloat16)
    assert torch.equal(bf16_cpu.decode_attention(q, k, v, additive, scale), ours)
    monkeypatch.setattr(bf16_cpu, "available", lambda: False)
    torch_path = python_path.decode_attention(q, k, v, mask, scale)
    # the same float32 sums and roundings; the exponentials' last bits may differ (two vectorised exps)
    assert bool(((ours.float() - torch_path.float()).abs() <= 2 * BF16_HALF_ULP * torch_path.float().abs() + 2 ** -20).all())
    groups = 4
    k64, v64 = (t.double().repeat_interleave(groups, dim=1) for t in (k, v))
    scores = (q.double() @ k64.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
    exact = torch.nan_to_num(scores.softmax(-1)) @ v64
    assert bool(((ours.double() - exact).abs() <= 2.0 ** -6 * (1 + exact.abs())).all())


@needs_kernel
def test_the_decode_attention_kernel_leaves_what_it_does_not_take_to_the_torch_path():
    q, k, v = _attention_inputs(dim=16)
    assert bf16_cpu.decode_attention(q, k, v, None, 0.25) is None  # head size not a multiple of 32
    q, k, v = _attention_inputs()
    assert bf16_cpu.decode_attention(q.float(), k.float(), v.float(), None, 0.25) is None  # float32
    per_head = torch.ones(5, 8, 1, 37, dtype=torch.bool)
    assert bf16_cpu.decode_attention(q, k, v, per_head, 0.25) is None  # a mask per head
    assert bf16_cpu.decode_attention(q, k, v, None, 0.25).shape == (5, 8, 1, 64)
