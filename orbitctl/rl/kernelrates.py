"""The kernels the time model counts, measured at a profile's own shapes: what `orbitctl plan --calibrate` runs.

    python -m orbitctl.rl.kernelrates SHAPES.json     # prints one JSON line: {"device": ..., "rates": {...}, ...}

SHAPES.json (written by orbitctl.plan.calibrate from the profile, or by benchmarks/device_check.py for Kimi-K2)::

    {"device": "cpu" | "cuda", "compute_dtype": "bf16", "gemm": [M, K, N], "rank": R, "group_size": G,
     "fused": true,                                   # the CPU's fused INT4 kernel runs the profile's layers
     "profile": "PROFILE.yaml",                       # a CPU's: the host's tokenizer and draw rates
     "experts": {"held": E, "hidden": H, "width": I, "top_k": k, "decode_rows": B, "update_rows": T},
     "attention": {"batch": B, "kv_heads": h, "head_dim": D, "context": C}}

On a CPU it measures what ``plan --measure-time`` does (orbitctl.rl.steptime): the GEMM, the adapters' thin GEMM,
the fused INT4 kernel by rows, a memory copy, one eager op, one attention work item and the host's rates
(``encode_token_s``, ``decode_token_s``, ``keyed_draw_s``). On a CUDA GPU, each the
median of CUDA-event-timed calls after a warm-up:

- ``gemm_flops_per_s``: the bf16 [M, K] x [K, N] GEMM;
- ``hbm_bytes_per_s``: a 1 GiB device copy (read + write);
- ``experts_decode_bytes_per_s`` / ``experts_update_flops_per_s``: a routed-expert layer of E held INT4 experts
  (orbitctl.kernels.grouped_int4.ExpertStack: the grouped Triton kernel) at the decode's and the update's rows, each
  token routed to k experts uniformly; bytes are those of the experts the rows hit;
- ``attention_bytes_per_s``: one decode query per sequence over a bf16 KV cache of C positions
  (``scaled_dot_product_attention``); bytes are the cache read;
- ``all_to_all_bytes_per_s``: only with several processes (not measured here: one process, one GPU).

Whatever cannot run (no Triton, an unsupported shape) is left out with its reason in ``skipped``.
"""

from __future__ import annotations

import json
import statistics
import sys
import time


def median_s(fn, cuda: bool, reps: int = 10, warmup: int = 2, cap_s: float = 6.0) -> float:
    """Median seconds of ``fn()`` over ``reps`` calls after ``warmup`` (CUDA events on a GPU), fewer calls (at least
    three) once ``cap_s`` seconds are spent."""
    import torch

    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    times: list[float] = []
    spent = time.perf_counter()
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            began = time.perf_counter()
            fn()
            times.append(time.perf_counter() - began)
        if len(times) >= 3 and time.perf_counter() - spent > cap_s:
            break
    return statistics.median(times)


def cpu_rates(torch, shapes: dict) -> dict:
    """The CPU's rates, as plan --measure-time's child measures them (one thread where the parent set one)."""
    from orbitctl.rl.steptime import kernel_rates, machine_rates, overhead_rates

    from orbitctl.kernels.cpu_dtype import torch_dtype

    dtype = torch_dtype(shapes["compute_dtype"])
    gemm = tuple(shapes["gemm"])
    flops, bandwidth = machine_rates(torch, dtype, gemm)
    rank = shapes.get("rank", 0)
    rates = {"flops_per_s": flops, "bytes_per_s": bandwidth,
             "adapter_flops_per_s": machine_rates(torch, dtype, (gemm[0], gemm[1], rank))[0] if rank else flops}
    rates["op_s"], rates["attention_block_s"] = overhead_rates(torch, dtype)
    kernel = kernel_rates(torch, gemm, shapes["group_size"]) if shapes.get("fused") else []
    if kernel:
        rates["kernel_flops_per_s"] = [list(p) for p in kernel]
    if shapes.get("profile"):
        from orbitctl.profile import load_profile
        from orbitctl.rl.steptime import host_rates

        rates.update(host_rates(torch, load_profile(shapes["profile"])))
    return rates


def _gemm_rate(torch, shape) -> float:
    m, k, n = shape
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    return 2.0 * m * k * n / median_s(lambda: a @ b, True)


def _copy_rate(torch) -> float:
    """A 1 GiB device copy: bytes read + written per second."""
    src = torch.empty(2 ** 29, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    return 2.0 * src.numel() * 2 / median_s(lambda: dst.copy_(src), True)


def gpu_rates(torch, shapes: dict, skipped: dict) -> dict:
    """A CUDA GPU's rates at the profile's shapes (module docstring)."""
    import torch.nn.functional as F

    dev, bf16 = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)
    rates = {}
    rates["gemm_flops_per_s"] = _gemm_rate(torch, shapes["gemm"])
    rates["hbm_bytes_per_s"] = _copy_rate(torch)
    ex = shapes.get("experts")
    if ex:
        from orbitctl.kernels.grouped_int4 import ExpertStack, triton_present

        if not triton_present():
            skipped["experts"] = "triton does not import"
        else:
            from orbitctl.codec.formats import round_scales

            E, H, I, G = ex["held"], ex["hidden"], ex["width"], shapes["group_size"]
            top = min(ex["top_k"], E)  # each row picks distinct experts among the held ones

            def int4(rows: int, cols: int):
                words = torch.randint(-2**31, 2**31 - 1, (E, rows, cols // 8), dtype=torch.int32, device=dev,
                                      generator=gen)
                scales = round_scales(torch.rand(E, rows, cols // G, device=dev, generator=gen) * 0.01 + 0.001)
                return words, scales

            stack = ExpertStack(int4(2 * I, H), int4(H, I), I, dtype=bf16)
            per_expert = stack.nbytes() / E
            with torch.no_grad():
                for label, tokens in (("decode", ex["decode_rows"]), ("update", ex["update_rows"])):
                    hidden = torch.randn(tokens, H, device=dev, generator=gen).to(bf16)
                    experts = torch.rand(tokens, E, device=dev, generator=gen).argsort(-1)[:, :top].reshape(-1)
                    hit = int(torch.unique(experts).numel())
                    s = median_s(lambda: stack.forward(hidden, experts, top, F.silu), True)
                    if label == "decode":
                        rates["experts_decode_bytes_per_s"] = hit * per_expert / s
                    else:
                        rates["experts_update_flops_per_s"] = 2.0 * tokens * top * 3 * H * I / s
    att = shapes.get("attention")
    if att:
        B, h, D, C = att["batch"], att["kv_heads"], att["head_dim"], att["context"]
        q = torch.randn(B, h, 1, D, device=dev, dtype=bf16)
        kv = torch.randn(2, B, h, C, D, device=dev, dtype=bf16)
        s = median_s(lambda: F.scaled_dot_product_attention(q, kv[0], kv[1]), True)
        rates["attention_bytes_per_s"] = kv.numel() * 2 / s
    skipped["all_to_all"] = "one process: the all-to-all needs the profile's world size"
    return rates


def main(argv: list[str] | None = None) -> int:
    import torch

    (path,) = argv if argv is not None else sys.argv[1:]
    with open(path, encoding="utf-8") as fh:
        shapes = json.load(fh)
    skipped: dict[str, str] = {}
    if shapes["device"] == "cuda":
        if not torch.cuda.is_available():
            print(json.dumps({"error": "no CUDA device visible to torch"}))
            return 1
        device = torch.cuda.get_device_name(0)
        rates = gpu_rates(torch, shapes, skipped)
    else:
        from orbitctl.kernels.cpu_dtype import read_host_cpu

        info = read_host_cpu()
        device = f"{info.model if info else 'unknown CPU'}, {torch.get_num_threads()} thread(s)"
        rates = cpu_rates(torch, shapes)
    print(json.dumps({"device": device, "rates": rates, "skipped": skipped, "torch": torch.__version__}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
