"""The fused INT4 kernel (quant.kernel): what it computes, that every path computes the same, what the plan counts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from orbitctl.codec.formats import dequantize_int4, pack_int4, quantize_int4
from orbitctl.kernels.int4_kernel import Int4Pack, ran_kernel, unsupported_shape
from orbitctl.model.quant_linear import ExpertMLP, QuantLinear
from orbitctl.rl.steptime import count_ops, dispatched_ops

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"),
                                reason="this torch has no CPU INT4 kernel")
BF16_HALF_ULP = 2.0 ** -8
"""bf16 keeps 8 significant bits (ulp 2^-7 of the binade's base): rounding moves a value by at most 2^-8 of it."""


def _weight(out_f: int, in_f: int, seed: int = 0, scale_dtype=torch.bfloat16):
    w = torch.randn(out_f, in_f, generator=torch.Generator().manual_seed(seed)) * 0.05
    codes, scale = quantize_int4(w, 32)
    if scale_dtype == torch.float16:  # scales with more bits than bf16 keeps, as a GGUF Q4_0 weight's
        return pack_int4(codes), (scale.float() * 1.01).to(torch.float16)
    return pack_int4(codes), scale


def _bound(x: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
    """|fused - (bf16(x) W^T in float64)| allowed per element: the result's rounding to bf16, and float32
    accumulation over K terms (K eps_32 sum |x||w|)."""
    xb = x.to(torch.bfloat16).double()
    exact = xb @ dense.double().t()
    magnitude = xb.abs() @ dense.double().abs().t()
    return exact, BF16_HALF_ULP * exact.abs() * (1 + 2 ** -7) + x.shape[-1] * 2.0 ** -24 * magnitude


@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float16])
def test_fused_matmul_is_the_bf16_rounded_product_of_bf16_activations(scale_dtype):
    packed, scale = _weight(96, 256, scale_dtype=scale_dtype)
    pack = Int4Pack.of(packed, scale)
    assert len(pack.scales_and_zeros) == (1 if scale_dtype == torch.bfloat16 else 2)  # fp16 scales: hi + lo
    dense = dequantize_int4(packed, scale, 256, torch.float32)  # exact: 4-bit codes times the stored scales
    x = torch.randn(7, 256, generator=torch.Generator().manual_seed(1))
    y = pack.matmul(x)
    assert y.dtype == torch.float32 and y.shape == (7, 96)
    exact, bound = _bound(x, dense)
    assert bool(((y.double() - exact).abs() <= bound).all())
    # and it is not the float32 reference: the activations were rounded to bf16
    assert not torch.equal(y, x @ dense.t())


def test_auto_fuses_only_where_each_row_is_the_same_whatever_the_rows_beside_it():
    """What lets the one-token decode (infer path) and the full-sequence forward (train path) agree at the floor:
    where the probe finds it, rows of other shapes hold it too; where not, auto dequantizes."""
    from orbitctl.model.frozen_base import int4_kernel
    from orbitctl.kernels.int4_kernel import rows_are_independent

    if not rows_are_independent():
        assert int4_kernel("auto", "int4", "cpu") == "dequantize"
        return
    assert int4_kernel("auto", "int4", "cpu") == "fused"
    pack = Int4Pack.of(*_weight(64, 128))
    x = torch.randn(300, 128, generator=torch.Generator().manual_seed(2))
    whole = pack.matmul(x)
    for start, rows in ((0, 1), (5, 3), (17, 16), (40, 64), (100, 200)):
        assert torch.equal(pack.matmul(x[start:start + rows]), whole[start:start + rows])


def test_the_layer_runs_the_kernel_forward_and_the_reference_backward():
    packed, scale = _weight(96, 256)
    layer = QuantLinear(256, 96, "int4", group_size=32)
    layer.weight_packed.data, layer.weight_scale.data = packed, scale
    x = torch.randn(2, 5, 256, generator=torch.Generator().manual_seed(3))
    reference = layer(x)  # no pack yet: dequantize-then-matmul
    assert layer.use_fused_kernel() == layer.kernel_pack.nbytes() == 96 * 256 // 2 + (256 // 32) * 96 * 2 * 2
    with torch.no_grad():
        fused = layer(x)
    assert torch.equal(fused, layer.kernel_pack.matmul(x))
    assert not torch.equal(fused, reference)
    x.requires_grad_(True)
    out = layer(x)
    assert torch.equal(out, fused)  # the autograd path computes the same forward
    grad = torch.randn_like(out)
    out.backward(grad)
    assert torch.equal(x.grad, grad @ layer.dequantized_weight(torch.float32))
    assert "kernel_pack" not in "".join(layer.state_dict())  # neither saved nor seen by ZeRO


def test_shapes_the_kernel_does_not_take_keep_dequantizing(int4_moe):
    from orbitctl.model.frozen_base import load_frozen_base, use_fused_int4

    assert unsupported_shape(100, 64, 32) and unsupported_shape(96, 48, 32) and unsupported_shape(96, 64, 16)
    assert unsupported_shape(96, 64, 32) is None
    model = load_frozen_base(int4_moe, compute_dtype=torch.float32)
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    odd = layers[0]
    odd.out_features = 100  # as if its rows were not a multiple of 16
    held = use_fused_int4(model)
    experts = [m for m in model.modules() if isinstance(m, ExpertMLP)]
    in_gate_up = {id(p) for e in experts if e.gate_up_pack is not None for p in (e.gate_proj, e.up_proj)}
    assert odd.kernel_pack is None and id(odd) not in in_gate_up
    assert all(m.kernel_pack is not None or id(m) in in_gate_up for m in layers[1:])
    assert not any(m.kernel_pack is not None for m in layers if id(m) in in_gate_up)
    # its expert's up projection still packs alone; every other expert packs gate and up together
    assert len(in_gate_up) == 2 * (len(experts) - 1)
    assert held == sum(m.kernel_pack.nbytes() for m in layers[1:] if m.kernel_pack is not None) \
        + sum(e.gate_up_pack.nbytes() for e in experts if e.gate_up_pack is not None)


def test_the_plan_counts_the_packs_a_rank_builds(int4_moe):
    """plan's int4_kernel_pack for one CPU rank holding every expert = the bytes use_fused_int4 built; none with
    quant.kernel: dequantize; half of them per rank with expert parallelism 2; none under ZeRO-3 without it."""
    from orbitctl.model.frozen_base import load_frozen_base, use_fused_int4
    from orbitctl.plan import plan_profile
    from orbitctl.profile import load_profile

    def planned(*sets: str) -> int:  # the tiny MoE profile over the fixture's architecture
        profile = load_profile(ROOT / "profiles" / "tiny-moe-cpu.yaml",
                               ["model.arch=null", f"model.config={int4_moe / 'config.json'}", *sets])
        return plan_profile(profile, with_advice=False).phases["rollout"]["int4_kernel_pack"]

    built = use_fused_int4(load_frozen_base(int4_moe, compute_dtype=torch.float32))
    one_rank = planned("memory.expert_parallel=1", "hardware.gpus_per_node=1")
    assert built > 0 and one_rank == built
    assert planned("memory.expert_parallel=1", "hardware.gpus_per_node=1", "quant.kernel=dequantize") == 0
    assert planned() == built // 2
    assert planned("memory.expert_parallel=1", "memory.zero_stage=3") == 0


def test_kernel_fused_with_a_format_it_does_not_run_exits_2(tmp_path, one_error_line):
    done = subprocess.run([sys.executable, "-m", "orbitctl.cli.app", "plan", str(ROOT / "profiles" / "tiny-cpu.yaml"),
                           "--set", "quant.kernel=fused"], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 2
    one_error_line(done.stderr, "quant.kernel", "nf4")


def test_kernel_fused_runs_on_an_nvidia_profile_and_is_refused_on_another_gpu(tmp_path, one_error_line,
                                                                               gpu_profile_inputs):
    """CUDA's tinygemm and the grouped expert kernel make fused an NVIDIA kernel too; an AMD GPU has neither."""
    kimi = str(ROOT / "profiles" / "kimi-k2_grpo_int4_8xh200.yaml")
    done = subprocess.run([sys.executable, "-m", "orbitctl.cli.app", "train", kimi, "--set", "quant.kernel=fused",
                           "--dry-run", "--json", *gpu_profile_inputs], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert '"int4_kernel": "fused"' in done.stdout
    done = subprocess.run([sys.executable, "-m", "orbitctl.cli.app", "train", kimi, "--set", "quant.kernel=fused",
                           "--set", "hardware.gpu=mi300x", "--dry-run"], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 2
    one_error_line(done.stderr, "quant.kernel", "fused")


@pytest.mark.parametrize("kernel", ["fused", "dequantize"])
def test_the_time_models_ops_per_decode_step_are_the_ops_a_tiny_moe_step_issues(int4_moe, kernel):
    """plan's op count of one decode forward (orbitctl.plan.ops, the experts the step hit) against a dispatch count
    of that forward on the tiny INT4 MoE, each kernel: within 15%."""
    from transformers import DynamicCache

    from orbitctl.arch.parse import arch_from_config
    from orbitctl.model.frozen_base import load_frozen_base, use_fused_int4
    from orbitctl.model.quant_linear import QuantExperts
    from orbitctl.plan.ops import op_counts
    from orbitctl.profile import load_profile

    model = load_frozen_base(int4_moe, compute_dtype=torch.float32)
    if kernel == "fused":
        use_fused_int4(model)
    hits = []
    for module in model.modules():
        if isinstance(module, QuantExperts):
            module.register_forward_hook(lambda m, args, out: hits.append(int(torch.unique(args[1]).numel())))
    ids = torch.randint(0, model.config.vocab_size, (16, 9), generator=torch.Generator().manual_seed(0))
    cache = DynamicCache()
    with torch.no_grad():
        model(input_ids=ids[:, :8], past_key_values=cache, use_cache=True)  # the prefill
        hits.clear()
        counted = count_ops(torch, lambda: model(input_ids=ids[:, 8:], past_key_values=cache,
                                                 use_cache=True))  # one decode step of 16 sequences
    profile = load_profile(ROOT / "profiles" / "tiny-moe-cpu.yaml",
                           ["model.arch=null", f"model.config={int4_moe / 'config.json'}", f"quant.kernel={kernel}"])
    import json

    arch = arch_from_config(json.loads((int4_moe / "config.json").read_text()))
    counts = op_counts(profile, arch)
    modelled = counts.forward(sum(hits)) + counts.decode_extra  # a decode step: MLA on the cached latent
    print(f"{kernel}: {counted} ops counted, {modelled:.0f} modelled, experts hit {hits}")
    assert abs(modelled - counted) <= 0.15 * counted, (modelled, counted, hits)


def test_the_sorted_expert_dispatch_is_the_per_token_sum_and_takes_an_empty_batch():
    """QuantExperts' one-pass dispatch (rows sorted by expert, one index_add) against each token's own weighted sum
    of its k experts, each expert run on that token alone: the matmuls' and the sum's float32 rounding bound the
    difference (n eps of the magnitudes, n the inner dimensions 16 + 32 and the 3 terms)."""
    from torch import nn

    from orbitctl.model.quant_linear import ExpertMLP, QuantExperts

    torch.manual_seed(0)
    experts = QuantExperts([ExpertMLP(nn.Linear(16, 32, bias=False), nn.Linear(16, 32, bias=False),
                                      nn.Linear(32, 16, bias=False)) for _ in range(6)], nn.functional.silu)
    hidden, index, weights = torch.randn(9, 16), torch.randint(0, 6, (9, 3)), torch.rand(9, 3)
    with torch.no_grad():
        out = experts(hidden, index, weights)
        terms = torch.stack([torch.stack([experts.expert(int(index[t, j])).down_proj(
            nn.functional.silu(experts.expert(int(index[t, j])).gate_proj(hidden[t]))
            * experts.expert(int(index[t, j])).up_proj(hidden[t])) * weights[t, j] for j in range(3)])
            for t in range(9)])
        bound = (16 + 32 + 3) * torch.finfo(torch.float32).eps * terms.abs().sum(1)
        assert bool(((out - terms.sum(1)).abs() <= bound).all())
        assert not torch.equal(out, torch.zeros_like(out))
        empty = experts(hidden[:0], index[:0], weights[:0])
    assert empty.shape == (0, 16)


def test_the_dry_run_says_which_kernel_train_builds_and_the_packs_planned():
    from orbitctl.launch.dryrun import dry_run
    from orbitctl.profile import load_profile

    cpu = dry_run(load_profile(ROOT / "profiles" / "tiny-moe-cpu.yaml")).memory
    assert cpu["int4_kernel"] == "fused" and cpu["int4_kernel_pack_bytes"] > 0
    off = dry_run(load_profile(ROOT / "profiles" / "tiny-moe-cpu.yaml", ["quant.kernel=dequantize"])).memory
    assert off["int4_kernel"] == "dequantize" and off["int4_kernel_pack_bytes"] == 0
    gpu = dry_run(load_profile(ROOT / "profiles" / "kimi-k2_grpo_int4_8xh200.yaml")).memory
    # INT4 experts only: on a GPU they run grouped from their own storage, so no pack is held
    assert gpu["int4_kernel"] == "fused" and gpu["int4_kernel_pack_bytes"] == 0
    off = dry_run(load_profile(ROOT / "profiles" / "kimi-k2_grpo_int4_8xh200.yaml", ["quant.kernel=dequantize"])).memory
    assert off["int4_kernel"] == "dequantize" and off["int4_kernel_pack_bytes"] == 0


def test_quantized_scales_keep_five_significant_bits_so_every_weight_is_a_bf16_number():
    from orbitctl.codec.formats import SCALE_BITS, round_scales, scales_exact_in_bf16

    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(5)) * 0.05
    codes, scale = quantize_int4(w, 32)
    assert scales_exact_in_bf16(scale)
    dense = dequantize_int4(pack_int4(codes), scale, 256, torch.float32)
    assert torch.equal(dense, dense.to(torch.bfloat16).float())  # code x scale is exact in bf16
    unrounded = w.reshape(64, 8, 32).abs().amax(-1) / 7.5
    _, exponent = torch.frexp(unrounded)  # unrounded = m 2^e, m in [0.5, 1): 5 bits of m are steps of 2^(e-5)
    half_step = torch.ldexp(torch.ones_like(unrounded), exponent - SCALE_BITS - 1)
    assert bool(((scale.float() - unrounded).abs() <= half_step).all())  # rounded to the nearest
    assert torch.equal(round_scales(scale.float()), scale)
    # scales with a bf16's full 8 bits (another tool's checkpoint) or fp16's are not exact: their layers keep the kernel
    assert not scales_exact_in_bf16(unrounded.to(torch.bfloat16))
    assert not scales_exact_in_bf16(_weight(96, 256, scale_dtype=torch.float16)[1])


def _dense_layer(out_f: int, in_f: int, scale_dtype=torch.bfloat16) -> QuantLinear:
    packed, scale = _weight(out_f, in_f, scale_dtype=scale_dtype)
    layer = QuantLinear(in_f, out_f, "int4", group_size=32)
    layer.weight_packed.data, layer.weight_scale.data = packed, scale
    layer.use_fused_kernel()
    return layer


def _native_bf16(monkeypatch, native: bool) -> None:
    from orbitctl.kernels import cpu_dtype

    monkeypatch.setattr(cpu_dtype, "host_bf16", lambda: cpu_dtype.Bf16Verdict(native, "as the test says"))


def _ops(fn):
    return dispatched_ops(torch, fn)


@pytest.mark.parametrize("grad", [False, True])
def test_many_rows_on_native_bf16_take_one_bf16_gemm_computing_what_the_kernel_computes(monkeypatch, grad):
    from orbitctl.model import quant_linear

    _native_bf16(monkeypatch, True)
    layer = _dense_layer(96, 256)
    assert layer.exact_in_bf16
    rows = quant_linear.DENSE_ROWS
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(6)).requires_grad_(grad)
    with torch.set_grad_enabled(grad):
        ops = _ops(lambda: layer(x))
        y = layer(x)
    assert ops.get("mm", 0) == 1 and not ran_kernel(ops)
    dense = layer.dequantized_weight(torch.float32)
    exact, bound = _bound(x.detach(), dense)
    assert bool(((y.detach().double() - exact).abs() <= bound).all())  # the kernel's contract, the same bound
    kernel = layer.kernel_pack.matmul(x.detach())
    # the two sum the same exact products in float32 in another order: at most one bf16 step apart
    assert bool(((y.detach() - kernel).abs() <= 2 * BF16_HALF_ULP * kernel.abs() + 2.0 ** -126).all())
    if grad:
        g = torch.randn_like(y)
        y.backward(g)
        assert torch.equal(x.grad, g @ dense)  # the backward is the reference's, as before
    # one row fewer, or a CPU whose bf16 is emulated, or scales not exact in bf16: the kernel
    with torch.no_grad():
        assert ran_kernel(_ops(lambda: layer(x.detach()[:rows - 1])))
        assert ran_kernel(_ops(lambda: _dense_layer(96, 256, torch.float16)(x.detach())))
        _native_bf16(monkeypatch, False)
        assert ran_kernel(_ops(lambda: layer(x.detach())))


def test_an_experts_shared_gate_up_pack_takes_the_dense_gemm_for_many_rows(monkeypatch):
    from orbitctl.model import quant_linear

    _native_bf16(monkeypatch, True)
    expert = ExpertMLP(_dense_layer(64, 128), _dense_layer(64, 128), _dense_layer(128, 64))
    expert.use_fused_gate_up()
    x = torch.randn(quant_linear.DENSE_ROWS, 128, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ops = _ops(lambda: expert.gate_up(x))
        gate, up = expert.gate_up(x)
        shared = expert.gate_up_pack.matmul(x)
    assert ops.get("mm", 0) == 2 and not ran_kernel(ops)
    both = torch.cat([gate, up], -1)
    assert bool(((both - shared).abs() <= 2 * BF16_HALF_ULP * shared.abs() + 2.0 ** -126).all())


def test_whole_sequences_take_the_dense_gemm_whatever_their_rows_and_decode_steps_keep_the_kernel(monkeypatch):
    """By the forward's kind: a group's prompt prefilled once and the same prompt in a batch of 32 take one path."""
    from orbitctl.kernels import bf16_cpu
    from orbitctl.kernels.cpu_dtype import host_bf16

    # where the dense path runs for real on AVX512-BF16, a row's result is the same in any batch (on AMX tiles
    # oneDNN's blocking may round a row by the rows beside it: quant_linear's docstring)
    native = host_bf16().native and not bf16_cpu.amx_granted()
    _native_bf16(monkeypatch, True)
    layer = _dense_layer(96, 256)
    g = torch.Generator().manual_seed(8)
    prompt, steps = torch.randn(2, 3, 256, generator=g), torch.randn(40, 1, 256, generator=g)
    with torch.no_grad():
        assert not ran_kernel(_ops(lambda: layer(prompt)))  # 6 rows, 3 positions each
        assert ran_kernel(_ops(lambda: layer(steps)))  # 40 rows of one position
        alone, batched = layer(prompt[:1]), layer(torch.cat([prompt] * 16))
    if native:
        assert torch.equal(alone[0], batched[0])
