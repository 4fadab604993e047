"""The grouped INT4 expert kernel's checks, run in a child process under Triton's CPU interpreter.

    TRITON_INTERPRET=1 python tests/model/grouped_child.py {kernel | kimi | layer MODEL_DIR}

prints one JSON line of measured figures; tests/model/test_grouped_int4.py asserts on them. The
interpreter must be on before Triton is first imported, so the checks cannot run in pytest's process.
"""

from __future__ import annotations

import json
import sys

import torch


def kernel() -> dict:
    """grouped_int4_mm against grouped_reference on uneven routings (an expert with no slot, one with 17, shapes off
    the block sizes): the largest difference and the reference's scale."""
    from orbitctl.kernels.grouped_int4 import align_blocks, grouped_int4_mm, grouped_reference

    g = torch.Generator().manual_seed(0)
    result = {}
    for name, (experts, n, k, group, tokens, top_k) in {
            "decode": (6, 48, 128, 32, 5, 2), "skewed": (4, 40, 96, 32, 17, 1), "group64": (3, 64, 128, 64, 8, 3)}.items():
        words = torch.randint(-2**31, 2**31 - 1, (experts, n, k // 8), generator=g, dtype=torch.int32)
        scales = (torch.rand(experts, n, k // group, generator=g) * 0.02 + 0.001).to(torch.float16)
        a = torch.randn(tokens, k, generator=g).to(torch.float16)
        routed = torch.randint(1, experts, (tokens * top_k,), generator=g)  # expert 0 gets nothing
        if name == "skewed":
            routed[:] = 2
        rows, block_expert = align_blocks(routed, experts)
        out = grouped_int4_mm(a, words, scales, rows, block_expert, routed.shape[0], top_k)
        ref = grouped_reference(a, words, scales, routed, top_k)
        result[name] = {"max_diff": float((out.float() - ref.float()).abs().max()),
                        "ref_max": float(ref.float().abs().max()), "shape": list(out.shape)}
    return result


def dot_probe(dtype: torch.dtype) -> float:
    """The largest error of one interpreted ``tl.dot`` of 16x16 operands in ``dtype`` against the float32 product of the
    same values (quarters in [-2, 2): every product and every sum exact in float32, so an exact ``tl.dot`` gives 0).
    Triton's interpreter keeps bf16 as the raw uint16 bits and its dot multiplies those as integers."""
    import triton
    import triton.language as tl

    @triton.jit
    def probe(a_ptr, b_ptr, c_ptr, N: tl.constexpr):
        r = tl.arange(0, N)
        tile = r[:, None] * N + r[None, :]
        tl.store(c_ptr + tile, tl.dot(tl.load(a_ptr + tile), tl.load(b_ptr + tile)))

    g = torch.Generator().manual_seed(2)
    a, b = (torch.randint(-8, 8, (16, 16), generator=g).float() / 4 for _ in range(2))
    c = torch.empty(16, 16)
    probe[(1,)](a.to(dtype), b.to(dtype), c, N=16)
    return float((c - a @ b).abs().max())


def kimi() -> dict:
    """grouped_int4_mm at Kimi-K2's gate/up shape (K = 7168 hidden, INT4 groups of 32 and of 128, bf16 activations and
    scales; N cut from 2048 to 96, one full and one masked tile of 64, to keep the interpreter fast) on a skewed routing
    of 6 tokens x top-4: expert 5 gets 18 of the 24 slots, experts 2 and 7 the rest, expert 0 (and 1, 3, 4, 6) none.

    Where the interpreter's bf16 ``tl.dot`` is exact the kernel runs in bf16; where it is not (``dot_probe``), the
    kernel runs on the same bf16 values held in float32 (activations and scales), which the interpreter multiplies
    right. Either way against grouped_reference in bf16 (weights dequantized to bf16, float32 sums, bf16 result), and
    the float32 run also against the float32 reference (the same sums, nothing rounded to bf16)."""
    import triton

    from orbitctl.kernels.grouped_int4 import align_blocks, grouped_int4_mm, grouped_reference

    bf16_dot_error = dot_probe(torch.bfloat16)
    result = {"triton": triton.__version__, "bf16_dot_error": bf16_dot_error,
              "fp16_dot_error": dot_probe(torch.float16)}
    mode = "bf16" if bf16_dot_error == 0.0 else "fp32"
    g = torch.Generator().manual_seed(3)
    experts, n, k, tokens, top_k = 8, 96, 7168, 6, 4
    routed = torch.tensor([5] * 18 + [2] * 4 + [7] * 2)[torch.randperm(tokens * top_k, generator=g)]
    a = torch.randn(tokens, k, generator=g).to(torch.bfloat16)
    for group in (32, 128):
        words = torch.randint(-2**31, 2**31 - 1, (experts, n, k // 8), generator=g, dtype=torch.int32)
        scales = (torch.rand(experts, n, k // group, generator=g) * 0.02 + 0.001).to(torch.bfloat16)
        rows, block_expert = align_blocks(routed, experts)
        ref = grouped_reference(a, words, scales, routed, top_k).float()
        if mode == "bf16":
            out = grouped_int4_mm(a, words, scales, rows, block_expert, routed.shape[0], top_k).float()
            ref32 = None
        else:
            out = grouped_int4_mm(a.float(), words, scales.float(), rows, block_expert, routed.shape[0], top_k)
            ref32 = grouped_reference(a.float(), words, scales.float(), routed, top_k)
        result[f"group{group}"] = {
            "mode": mode, "max_diff": float((out - ref).abs().max()), "ref_max": float(ref.abs().max()),
            "fp32_max_diff": None if ref32 is None else float((out - ref32).abs().max()),
            "fp32_ref_max": None if ref32 is None else float(ref32.abs().max()),
            "shape": list(out.shape), "blocks": int((block_expert >= 0).sum()),
            "experts_with_slots": sorted(set(block_expert[block_expert >= 0].tolist()))}
    return result


def layer(model_dir: str) -> dict:
    """A tiny INT4 MoE's QuantExperts with its experts stacked against the same layer's per-expert loop, both on fp16
    activations: forward and input gradient, the ops each issues for two routings, and the parameters as views."""
    from orbitctl.model.frozen_base import load_frozen_base, use_grouped_experts
    from orbitctl.kernels.grouped_int4 import ExpertStack
    from orbitctl.model.quant_linear import QuantExperts
    from torch.utils._python_dispatch import TorchDispatchMode

    model = load_frozen_base(model_dir, compute_dtype=torch.float32)
    moe = next(m for m in model.modules() if isinstance(m, QuantExperts))
    first_weight = moe.expert(0).gate_proj.weight_packed.clone()
    hidden = moe.expert(0).gate_proj.in_features
    g = torch.Generator().manual_seed(1)
    x = torch.randn(12, hidden, generator=g).to(torch.float16)
    index = torch.randint(0, moe.num_experts, (12, 2), generator=g)
    weights = torch.rand(12, 2, generator=g).to(torch.float16)

    def run(x_in):
        x_in = x_in.detach().requires_grad_(True)
        out = moe(x_in, index, weights)
        out.float().square().sum().backward()
        return out.detach().float(), x_in.grad.float()

    # the loop's reference: each expert dequantized in fp16, fp32 accumulation as the kernel's
    loop_out, loop_grad = run(x)
    count = use_grouped_experts(model)
    stacked = moe.stack is not None
    moe.stack = ExpertStack.of(moe, torch.float16) if stacked else None
    grouped_out, grouped_grad = run(x)

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    from orbitctl.kernels.grouped_int4 import align_blocks

    with torch.no_grad():  # the ops one launch issues here: the dispatcher op (its output allocated inside it)
        rows, blocks = align_blocks(index.reshape(-1), moe.num_experts)
        Count.ops = 0
        with Count():
            torch.ops.orbitctl.grouped_int4_mm(x, *moe.stack.gate_up, rows, blocks, index.numel(), 2)
        launch = Count.ops
    ops = {}
    with torch.no_grad():
        for name, routing in {"two experts": torch.zeros_like(index) + torch.tensor([0, 1]),
                              "every expert": index}.items():
            Count.ops = 0
            with Count():
                moe(x, routing, weights)
            ops[name] = Count.ops - 2 * (launch - 2)  # each launch as one op and its output's, as on a GPU
    with torch.no_grad():  # the static exchange's form: slots of expert E (none held) computed by no block
        flat = index.reshape(-1)
        skipped = flat >= moe.num_experts // 2
        every = moe.stack.forward(x, flat, 2, moe.act_fn)
        some = moe.stack.forward(x, torch.where(skipped, moe.num_experts, flat), 2, moe.act_fn, skip=True)
        skip_diff = float((some[~skipped].float() - every[~skipped].float()).abs().max())
    return {"stacked": stacked, "linears_stacked": len(count), "skip_diff": skip_diff,
            "skipped_slots": int(skipped.sum()),
            "forward_diff": float((grouped_out - loop_out).abs().max()), "forward_max": float(loop_out.abs().max()),
            "grad_diff": float((grouped_grad - loop_grad).abs().max()), "grad_max": float(loop_grad.abs().max()),
            "ops": ops, "weights_are_views": bool(moe.expert(0).gate_proj.weight_packed.data_ptr()
                                                   == moe.stack.gate_up[0].data_ptr()),
            "weights_kept": bool(torch.equal(moe.expert(0).gate_proj.weight_packed, first_weight))}


if __name__ == "__main__":
    check = sys.argv[1]
    print(json.dumps({"kernel": kernel, "kimi": kimi}[check]() if check != "layer" else layer(sys.argv[2])))
