"""One training step timed, and this machine's matmul and memory rates: what `orbitctl plan --measure-time` measures.

    python -m orbitctl.rl.steptime PROFILE.yaml RUN_DIR M K N [R [STEPS]]    # prints one JSON line

Measures the matmul throughput of an [M, K] x [K, N] GEMM (the model's own update shape) and of
the adapters' thin [M, K] x [K, R] one in the profile's compute dtype, of the fused INT4 kernel on an [N, K]
weight at a few row counts up to M (where the profile's layers run it), the memory bandwidth of a
256 MiB copy, the cost of one eager op issued from transformers' modules and of one attention work item
(one sequence and head of a tiny causal attention) and the rollout's host work per token (:func:`host_rates`: the
tokenizer both ways, the keyed draws), each the best of several runs; then runs
STEPS steps (default 1) of ``train`` in RUN_DIR and reads each step's ``time_rollout_s`` and
``time_update_s`` from metrics.jsonl: the fastest of the steps after the first (which pays the
warm-up), as each microbenchmark is the best of its runs, so that both time this core
undisturbed. The planner runs this as a child process: it sits below the trainer and never
imports it.
"""

from __future__ import annotations

import json
import sys
import time
from collections import Counter


def _best_of(fn, repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def machine_rates(torch, dtype, shape: tuple[int, int, int]) -> tuple[float, float]:
    """(FLOP/s of an [m, k] x [k, n] matmul in ``dtype``, memory bytes/s of a 256 MiB copy), each the best of
    five runs; ``shape`` is the model's own (m, k, n), so the rate is this machine's at this width."""
    m, k, n = shape
    a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
    torch.matmul(a, b)
    flops = 2 * m * k * n / _best_of(lambda: torch.matmul(a, b))
    src = torch.empty(64 * 2 ** 20, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    dst.copy_(src)
    bandwidth = 2 * src.numel() * 4 / _best_of(lambda: dst.copy_(src))  # read + write
    return flops, bandwidth


KERNEL_ROWS = (1, 4, 16, 64, 256, 1024)
"""Row counts the fused INT4 kernel is timed at (and the update's own): the plan interpolates between them."""


def kernel_rates(torch, shape: tuple[int, int, int], group_size: int) -> list[tuple[int, float]]:
    """``(rows, FLOP/s)`` of a fused INT4 layer's forward (:meth:`~orbitctl.model.quant_linear.QuantLinear.fused_matmul`:
    the kernel, or from :data:`~orbitctl.model.quant_linear.DENSE_ROWS` rows on a CPU with native bf16 the
    dequantized bf16 GEMM) on a random [n, k] INT4 weight in groups of ``group_size``, its scales as
    ``orbitctl quantize`` writes them, at :data:`KERNEL_ROWS` up to the update's ``m`` rows and at ``m``; each the
    best of three runs."""
    from orbitctl.codec.formats import round_scales
    from orbitctl.kernels.int4_kernel import unsupported_shape
    from orbitctl.model.quant_linear import QuantLinear

    m, k, n = shape
    if unsupported_shape(n, k, group_size) is not None:
        return []  # the model's layers of this shape dequantize too
    generator = torch.Generator().manual_seed(0)
    layer = QuantLinear(k, n, "int4", group_size=group_size)
    with torch.no_grad():
        layer.weight_packed.copy_(torch.randint(-2**31, 2**31 - 1, (n, k // 8), generator=generator, dtype=torch.int32))
        layer.weight_scale.copy_(round_scales(torch.rand(n, k // group_size, generator=generator) * 0.02 + 0.001))
    layer.use_fused_kernel()
    rates = []
    with torch.no_grad():
        for rows in sorted({r for r in KERNEL_ROWS if r < m} | {m}):
            x = torch.randn(rows, k, generator=generator)
            layer.fused_matmul(x)
            rates.append((rows, 2 * rows * k * n / _best_of(lambda: layer.fused_matmul(x), repeats=3)))
    return rates


OP_BLOCKS = 8
"""Blocks of the op microbenchmark: each an RMSNorm, two projections and a SwiGLU MLP at hidden 64."""


def _op_stack(torch, dtype):
    """``OP_BLOCKS`` residual blocks built from transformers' own RMSNorm and MLP modules (the module classes a
    decoder layer calls), hidden 64, MLP 128: the per-op cost of eager code as a model issues it (module calls,
    their Python, a GEMM among elementwise ops), not of one op in a tight loop."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

    config = LlamaConfig(hidden_size=64, intermediate_size=128, hidden_act="silu")

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.mlp = LlamaRMSNorm(64), LlamaMLP(config)
            self.q, self.o = torch.nn.Linear(64, 64, bias=False), torch.nn.Linear(64, 64, bias=False)

        def forward(self, x):
            x = x + self.o(self.q(self.norm(x)))
            return x + self.mlp(self.norm(x))

    return torch.nn.Sequential(*[Block() for _ in range(OP_BLOCKS)]).to(dtype)


def dispatched_ops(torch, fn) -> Counter:
    """How many times ``fn()`` dispatches each operator (ATen ops below autograd, by name: ``mm``,
    ``_weight_int4pack_mm_for_cpu``, ...). A dispatch mode: the ops still run, the fused kernels included."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: Counter = Counter()

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return seen


def count_ops(torch, fn) -> int:
    """Operators ``fn()`` dispatches (ATen ops below autograd, as the plan counts them)."""
    return sum(dispatched_ops(torch, fn).values())


def overhead_rates(torch, dtype) -> tuple[float, float]:
    """(seconds of one eager op issued from a model's modules: :func:`_op_stack` on 16 rows, its time over its
    op count; seconds of one attention work item: a causal attention of 16 sequences x 4 heads x 16 tokens, per
    sequence-head)."""
    stack, x = _op_stack(torch, dtype), torch.randn(16, 64, dtype=dtype)
    with torch.no_grad():
        stack(x)
        ops = count_ops(torch, lambda: stack(x))
        op_s = _best_of(lambda: stack(x), repeats=50) / ops  # many short tries: one undisturbed
    q = torch.randn(16, 4, 16, 16, dtype=dtype)
    attend = torch.nn.functional.scaled_dot_product_attention
    attend(q, q, q, is_causal=True)
    block_s = _best_of(lambda: [attend(q, q, q, is_causal=True) for _ in range(5)], repeats=50) / 5 / 64
    return op_s, block_s


def host_rates(torch, profile) -> dict[str, float]:
    """The rollout's host work outside ATen ops, per unit, with the profile's own tokenizer and the step's own prompts,
    each the best of five runs: ``encode_token_s`` (a prompt token through :meth:`Policy.encode_prompts
    <orbitctl.model.policy.Policy.encode_prompts>`, its chat template included), ``decode_token_s`` (a completion
    token back to text through ``Policy.decode``: completions of ``rollout.max_new_tokens`` of the prompts' own
    tokens, one call a row) and ``keyed_draw_s`` (one row's keyed uniform at one token, orbitctl.model.draws). An
    environment's data (``env:NAME``) has no prompt list: its encoding is left to the default rate."""
    from orbitctl.builder import load_policy, prepare_frozen_base
    from orbitctl.data.prompts import load_prompts
    from orbitctl.model.draws import KeyedDraws
    from orbitctl.rl.envs import env_name

    rows = profile.rl.prompts_per_step * profile.rl.group_size
    draws = KeyedDraws(profile.run.seed, tuple(range(rows)))
    rates = {"keyed_draw_s": _best_of(lambda: draws.uniforms(1)) / rows}
    if env_name(profile.data.train) is not None:
        return rates
    split = load_prompts(profile.data, profile.run.seed)
    prompts = [item.prompt for item in split.train[:profile.rl.prompts_per_step]]
    policy = load_policy(profile, prepare_frozen_base(profile, split.warm_task), device="cpu")
    ids, mask = policy.encode_prompts(prompts)
    rates["encode_token_s"] = _best_of(lambda: policy.encode_prompts(prompts)) / int(mask.sum())
    tokens = ids[mask.bool()]
    new = profile.rollout.max_new_tokens
    completions = tokens[torch.arange(rows * new) % tokens.numel()].view(rows, new)
    every = torch.ones_like(completions)
    rates["decode_token_s"] = _best_of(lambda: policy.decode(completions, every)) / (rows * new)
    return rates


def main(argv: list[str] | None = None) -> int:
    import torch

    from orbitctl.kernels.cpu_dtype import torch_dtype
    from orbitctl.profile import load_profile
    from orbitctl.rl.api import train
    from orbitctl.rundir import RunDir

    path, run_dir, *rest = argv if argv is not None else sys.argv[1:]
    shape = tuple(int(x) for x in rest[:3])
    rank = int(rest[3]) if len(rest) > 3 else 0
    steps = int(rest[4]) if len(rest) > 4 else 1
    keep = [f"run.dir={run_dir}", "run.eval_every=1000000", "run.save_every=1000000"]
    rl = load_profile(path, keep).rl
    per = rl.ppo_epochs * rl.minibatches  # optimizer steps per rollout batch
    profile = load_profile(path, [*keep, f"rl.steps={steps * per}"])
    dtype = torch_dtype(profile.quant.compute_dtype)
    flops, bandwidth = machine_rates(torch, dtype, shape)
    thin = machine_rates(torch, dtype, (shape[0], shape[1], rank))[0] if rank else 0.0
    op_s, block_s = overhead_rates(torch, dtype)
    from orbitctl.model.frozen_base import int4_kernel

    fused = int4_kernel(profile.quant.kernel, profile.quant.format, "cpu") == "fused"
    kernel = kernel_rates(torch, shape, profile.quant.group_size) if fused else []
    host = host_rates(torch, profile)
    train(profile, fresh=True, steps=steps * per)
    records = [json.loads(line) for line in RunDir(run_dir).metrics.read_text().splitlines() if line.strip()]
    # one record per optimizer step: a rollout's time is on its first, every update on its own
    rollouts = [float(records[i]["time_rollout_s"]) for i in range(0, len(records), per)]
    updates = [sum(float(r["time_update_s"]) for r in records[i:i + per]) for i in range(0, len(records), per)]
    steady = slice(1, None) if len(rollouts) > 1 else slice(None)
    print(json.dumps({"flops_per_s": flops, "bytes_per_s": bandwidth, "adapter_flops_per_s": thin,
                      "op_s": op_s, "attention_block_s": block_s, "kernel_flops_per_s": kernel, **host,
                      "dtype": str(dtype).removeprefix("torch."),
                      "threads": torch.get_num_threads(), "steps": len(rollouts),
                      "rollout_s": min(rollouts[steady]), "policy_update_s": min(updates[steady]),
                      "first_rollout_s": rollouts[0], "first_policy_update_s": updates[0]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
