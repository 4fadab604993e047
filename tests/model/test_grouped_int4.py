"""The grouped INT4 expert kernel (orbitctl.kernels.grouped_int4): its block alignment, its numerics and its layer,
the kernel run by Triton's CPU interpreter in a child process (tests/model/grouped_child.py); what the plan counts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from orbitctl.kernels.grouped_int4 import align_blocks, triton_present

ROOT = Path(__file__).resolve().parents[2]
FP16_ULP = 2.0 ** -10
"""fp16 keeps 11 significant bits: one ulp is 2^-10 of the binade's base."""
BF16_ULP = 2.0 ** -7
"""bf16 keeps 8 significant bits: one ulp is 2^-7 of the binade's base."""
needs_triton = pytest.mark.skipif(not triton_present(), reason="Triton is not installed (pip install -e '.[test]')")


def _child(*args: str) -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "model" / "grouped_child.py"), *args],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("slots, experts", [(10, 6), (17, 4), (0, 3), (64, 32)])
def test_blocks_hold_each_slot_once_with_one_expert_per_block(slots, experts):
    routed = torch.randint(0, experts, (slots,), generator=torch.Generator().manual_seed(slots))
    rows, block_expert = align_blocks(routed, experts, block_m=4)
    assert rows.shape[0] == -(-(slots + experts * 3) // 4) * 4  # the static size, whatever the routing
    real = rows[rows < slots]
    assert sorted(real.tolist()) == list(range(slots))
    for b, e in enumerate(block_expert.tolist()):
        block = rows[4 * b: 4 * b + 4]
        block = block[block < slots]
        if e < 0:
            assert block.numel() == 0
        else:
            assert (routed[block] == e).all()
    # each expert's slots in one run of blocks, in the slots' order (stable)
    for e in range(experts):
        mine = [int(r) for b, x in enumerate(block_expert.tolist()) if x == e for r in rows[4 * b: 4 * b + 4] if r < slots]
        assert mine == torch.nonzero(routed == e).squeeze(-1).tolist()


@needs_triton
def test_the_kernel_is_the_dequantized_product_accumulated_in_float32():
    """Against grouped_reference (each slot's row times its expert's weight dequantized in fp16, float32 sums): the
    kernel's float32 accumulation in another order, then the fp16 rounding of the result, bound the difference."""
    got = _child("kernel")
    for name, figures in got.items():
        assert figures["max_diff"] <= 2 * FP16_ULP * figures["ref_max"], (name, figures)
    assert got["skewed"]["shape"] == [17, 40]


@needs_triton
def test_the_kernel_at_kimi_k2_shapes_in_bf16_matches_the_dequantized_reference():
    """Kimi-K2's hidden size (K = 7168) in bf16 with INT4 groups of 32 and of 128, a skewed routing (one expert 18 of
    24 slots, five experts none; N cut to 96: a full and a masked tile) against grouped_reference in bf16.

    Triton's interpreter keeps bf16 as raw uint16 and its tl.dot multiplies those as integers (every version to
    date: the child's 16x16 probe says whether this one does). Where it does, the kernel runs on the same bf16 values
    held in float32 and the comparison goes through float32: against the bf16 reference within 2^-7 (bf16's ulp) of
    its largest output (its result rounded to bf16, half an ulp, and its weights rounded to bf16, half an ulp each with
    independent signs, which averages far below that over 7168 terms; the kernel's float32 run rounds neither),
    and against the float32 reference within 2^-14 of its largest output (float32 sums of 7168 terms in another order:
    about 2^-24 sqrt(K) of the outputs' scale; any slip of the indexing is of the output's own size). Where the
    interpreter's bf16 dot is exact the kernel runs in bf16, its weights and result rounded by the interpreter's
    truncating casts: two ulps."""
    got = _child("kimi")
    assert got["fp16_dot_error"] == 0.0, got  # the fp16 checks above rest on the interpreter's fp16 dot
    if got["bf16_dot_error"] != 0.0:
        warnings.warn(f"Triton {got['triton']}'s interpreter multiplies bf16 as raw 16-bit integers (a 16x16 "
                      f"tl.dot off by {got['bf16_dot_error']:.3g}): the bf16 case ran on its values in float32, "
                      "compared through float32")
    for group in (32, 128):
        figures = got[f"group{group}"]
        assert figures["shape"] == [24, 96], figures
        assert figures["blocks"] == 4, figures  # expert 5's 18 slots: two blocks; expert 2's 4 and 7's 2: one each
        assert figures["experts_with_slots"] == [2, 5, 7], figures  # the experts without a slot have no block
        if figures["mode"] == "fp32":
            assert figures["max_diff"] <= BF16_ULP * figures["ref_max"], (group, figures)
            assert figures["fp32_max_diff"] <= 2.0 ** -14 * figures["fp32_ref_max"], (group, figures)
        else:
            assert figures["max_diff"] <= 2 * BF16_ULP * figures["ref_max"], (group, figures)


@needs_triton
def test_a_stacked_moe_layer_computes_the_loop_with_ops_that_do_not_grow_with_the_experts_hit(int4_moe):
    """The tiny INT4 MoE's layer with its experts stacked (views of one tensor each, the weights unchanged) against
    its per-expert loop on the same fp16 activations; the ops of a forward that hits two experts and of one that
    hits all eight are the same number, which the plan counts."""
    from orbitctl.arch.parse import arch_from_config
    from orbitctl.plan.ops import OPS_GROUPED_EXPERTS, op_counts
    from orbitctl.profile import load_profile

    got = _child("layer", str(int4_moe))
    assert got["stacked"] and got["weights_are_views"] and got["weights_kept"]
    assert got["linears_stacked"] == 3 * 8 * 2  # 3 projections x 8 experts x 2 MoE layers
    assert got["forward_diff"] <= 2 * FP16_ULP * got["forward_max"], got
    assert got["grad_diff"] <= 4 * FP16_ULP * got["grad_max"], got
    assert got["ops"]["two experts"] == got["ops"]["every expert"], got
    # the static exchange skips the slots of experts another rank holds; the rest are what the whole layer gives
    assert got["skipped_slots"] > 0 and got["skip_diff"] == 0.0, got
    arch = arch_from_config(json.loads((int4_moe / "config.json").read_text()))
    gpu = load_profile(ROOT / "profiles" / "tiny-moe-cpu.yaml", ["model.arch=null", f"model.config={int4_moe / 'config.json'}",
                                                                   "hardware.gpu=h100", "quant.kernel=fused"])
    cpu = load_profile(ROOT / "profiles" / "tiny-moe-cpu.yaml", ["model.arch=null", f"model.config={int4_moe / 'config.json'}",
                                                                   "quant.kernel=fused"])
    counted = got["ops"]["every expert"]
    # the layer's ops beyond the router: the plan's grouped term replaces the loop's dispatch and its experts
    assert abs(OPS_GROUPED_EXPERTS - counted) <= 0.15 * counted, (OPS_GROUPED_EXPERTS, counted)
    per_layer = (op_counts(gpu, arch).forward(8) - op_counts(gpu, arch).dense) / arch.moe_layers
    assert per_layer == 0  # on the GPU no op grows with the experts hit
    grown = op_counts(cpu, arch).forward(8) - op_counts(cpu, arch).forward(2)
    assert grown > 0  # the CPU keeps its loop: each hit expert adds its ops
