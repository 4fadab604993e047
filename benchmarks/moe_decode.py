"""Decode speed of a generated INT4 MoE over one RL step's sequences: the fused INT4 kernel against
dequantize-then-matmul, a fixed batch against the batch ``rollout.batch_size: auto`` sizes by memory, and
another checkout of the code (the code before a change), each run in a fresh process.

    .venv/bin/python benchmarks/moe_decode.py                                  # this checkout's sides
    .venv/bin/python benchmarks/moe_decode.py --baseline /tmp/orbitctl-before  # and that checkout's code
    .venv/bin/python benchmarks/moe_decode.py --experts 64 --top-k 8 --reps 5 --json

The model is written once by :func:`orbitctl.model.synthetic.write_int4_moe` (a DeepSeek-V3-type MoE:
MLA attention, a dense first layer, ``--experts`` routed INT4 experts of which each token uses
``--top-k``, one shared expert; seeded random weights), and loaded by ``load_frozen_base`` in the
compute dtype ``auto`` gives on this CPU. Each side decodes the step's ``--sequences`` sequences of ``--prompt``
random prompt tokens for ``--new`` tokens with transformers' dynamic KV cache (greedy, no EOS: every
completion is full length), so many at a time: ``--batch`` (16, what the profiles decode at without
``rollout.batch_size``: micro-batch x group), or the number ``auto`` gives for a profile of this model on one CPU
rank (the plan's: the most the rollout phase fits, at most the step's sequences). The baseline checkout has no
``auto``; it runs at ``--batch`` and, for comparison, at the same batch ``auto`` gives. One warm-up decode precedes
the measured ones in each process. Reported: completion tokens per second over the step, median and range over
``--reps`` rounds, the sides alternating within a round, and whether each side's greedy tokens equal the
dequantizing side's (the fused kernel rounds activations to bf16, so a few tokens may differ on a random model
whose logits are nearly tied), and for this checkout's sides the tokens/s ``orbitctl plan``'s time model
predicts for the same sampling at this machine's rates, measured as ``plan --measure-time`` measures them (a
profile of the model on one CPU rank with that kernel; one adapted linear, since the benchmark decodes the bare
base).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def decode(args) -> None:
    """The child: load the model with ``args.kernel``, decode ``args.sequences`` prompts ``args.batch`` at a time, and
    print one JSON line of the measured decode."""
    import torch

    from orbitctl.kernels.cpu_dtype import torch_dtype
    from orbitctl.model.frozen_base import load_frozen_base

    torch.set_num_threads(args.threads)
    model = load_frozen_base(args.model, compute_dtype=torch_dtype("auto", "cpu"))
    packs = 0
    if args.kernel == "fused":
        from orbitctl.model.frozen_base import use_fused_int4

        packs = use_fused_int4(model)
    vocab = model.config.vocab_size
    prompts = torch.randint(0, vocab, (args.sequences, args.prompt), generator=torch.Generator().manual_seed(0))

    greedy_decode(model, prompts[:args.batch], args.new)  # warm-up: oneDNN kernels, the allocator
    seconds, tokens = 0.0, []
    for start in range(0, args.sequences, args.batch):
        took, got = greedy_decode(model, prompts[start:start + args.batch], args.new)
        seconds += took
        tokens += got
    print(json.dumps({"tokens_per_s": args.sequences * args.new / seconds, "seconds": seconds, "tokens": tokens,
                      "pack_bytes": packs, "dtype": str(next(model.parameters()).dtype)}))


def greedy_decode(model, prompt, new: int):
    """``new`` greedy tokens for every row of ``prompt`` through transformers' dynamic KV cache (no EOS: every
    completion full length); returns (seconds, tokens)."""
    import torch
    from transformers import DynamicCache

    cache = DynamicCache()
    sync = torch.cuda.synchronize if prompt.device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    with torch.inference_mode():
        logits = model(input_ids=prompt, past_key_values=cache, use_cache=True).logits[:, -1]
        tokens = []
        for _ in range(new):
            nxt = logits.argmax(-1, keepdim=True)
            tokens.append(nxt)
            logits = model(input_ids=nxt, past_key_values=cache, use_cache=True).logits[:, -1]
    sync()
    return time.perf_counter() - start, torch.cat(tokens, 1).tolist()


def static_greedy_decode(model, prompt, new: int):
    """:func:`greedy_decode` on the static step (:class:`~orbitctl.model.graph_decode.StaticDecode`): the prefill through
    a dynamic cache, then every decode step on the static cache, replayed from a CUDA graph on a GPU (eager on the
    CPU); returns (seconds, tokens)."""
    import torch
    from transformers import DynamicCache

    from orbitctl.model.graph_decode import StaticDecode

    cuda = prompt.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    mask = torch.ones_like(prompt)
    alive = torch.ones(prompt.shape[0], dtype=torch.bool, device=prompt.device)
    sync()
    start = time.perf_counter()
    with torch.inference_mode():
        cache = DynamicCache()
        logits = model(input_ids=prompt, past_key_values=cache, use_cache=True).logits[:, -1]
        step = StaticDecode(model, "past_key_values", cache, mask, mask.sum(-1, keepdim=True), new, capture=cuda)
        tokens = []
        for _ in range(new):
            nxt = logits.argmax(-1)
            tokens.append(nxt[:, None])
            logits = step(nxt, alive)
    sync()
    return time.perf_counter() - start, torch.cat(tokens, 1).tolist()


def measured_peaks(threads: int, shape: tuple[int, int, int], group_size: int = 32):
    """This machine's rates as ``orbitctl plan --measure-time`` measures them (a GEMM of ``shape`` in the CPU's compute
    dtype, a memory copy, one eager op from a model's modules, one attention item, the fused INT4 kernel on ``shape``'s
    weight in groups of ``group_size`` at a few row counts) on ``threads`` threads."""
    import torch

    from orbitctl.kernels.cpu_dtype import torch_dtype
    from orbitctl.plan.measure_time import peaks_of_rates
    from orbitctl.rl.steptime import kernel_rates, machine_rates, overhead_rates

    torch.set_num_threads(threads)
    dtype = torch_dtype("auto", "cpu")
    flops, bandwidth = machine_rates(torch, dtype, shape)
    op_s, block_s = overhead_rates(torch, dtype)
    return peaks_of_rates({"flops_per_s": flops, "bytes_per_s": bandwidth, "op_s": op_s, "attention_block_s": block_s,
                           "kernel_flops_per_s": kernel_rates(torch, shape, group_size)})


def predicted_decode(profile_path: Path, *, batch: int, prompt: int, new: int, kernel: str,
                     overrides: tuple[str, ...] = (), peaks=None) -> tuple[float, str]:
    """The completion tokens/s (per GPU or CPU rank) and the decode's bound that the time model predicts for
    ``profile_path`` sampling ``batch`` sequences of ``prompt`` + ``new`` tokens in one round with ``quant.kernel:
    kernel``: the rollout's prefill and decode, as the benchmark times them. ``peaks``: the measured rates (efficiency
    1, as ``plan --measure-time`` predicts), else the catalog's."""
    from orbitctl.plan import plan_profile
    from orbitctl.plan.measure_time import predict_at
    from orbitctl.profile import load_profile

    profile = load_profile(str(profile_path), [f"rollout.batch_size={batch}", f"rollout.max_new_tokens={new}",
                                               f"memory.seq_len={prompt + new}", f"rl.prompts_per_step={batch // 2}",
                                               "rl.group_size=2", f"quant.kernel={kernel}", *overrides])
    timing = predict_at(profile, peaks) if peaks is not None else plan_profile(profile, with_advice=False).timing
    rollout = timing.phases["rollout"]
    if not rollout.seconds:
        return 0.0, "-"
    return rollout.tokens / rollout.seconds / profile.world_size, rollout.parts["decode"].bound


def tinygemm_row(hidden: int) -> tuple[str, str, str]:
    """CUDA's weight-only INT4 kernel on a random [4 hidden, hidden] INT4 weight: whether its rows are independent of
    the rows beside them (what quant.kernel: auto fuses on), and its largest difference from the dequantized weight's
    bf16 product over 64 rows."""
    import torch

    from orbitctl.codec.formats import dequantize_int4
    from orbitctl.kernels.int4_kernel import Int4Pack, rows_are_independent

    g = torch.Generator().manual_seed(0)
    words = torch.randint(-2**31, 2**31 - 1, (4 * hidden, hidden // 8), generator=g, dtype=torch.int32).cuda()
    scale = (torch.rand(4 * hidden, hidden // 32, generator=g) * 0.02 + 0.001).to(torch.bfloat16).cuda()
    x = torch.randn(64, hidden, generator=g).to(torch.bfloat16).cuda()
    fused = Int4Pack.of(words, scale).matmul(x).float()
    reference = (x.float() @ dequantize_int4(words, scale, hidden, torch.float32).t())
    rel = float((fused - reference).abs().max() / reference.abs().max())
    independent = rows_are_independent("cuda")
    return ("tinygemm", f"rows independent: {independent}; largest difference {rel:.2e} of the largest output",
            "ok" if independent and rel < 2 ** -6 else "FAIL")


def fused_layer_rows(hidden: int, device: str, *, decode_rows: int = 32, sequence_rows: int = 4096
                     ) -> list[tuple[str, str, str]]:
    """A fused INT4 layer ([4 hidden, hidden], scales as ``orbitctl quantize`` writes them) through its own forward,
    as the model runs it: which ops a decode step ([rows, 1, hidden]) and a whole-sequence forward ([1, rows, hidden])
    issue (the device's INT4 kernel, or a GEMM over the dequantized weight), and each one's GFLOP/s against a
    bf16 GEMM on the dense weight, best of 3. On a GPU this is tinygemm at the decode's rows and at an update's."""
    import time

    import torch

    from orbitctl.codec.formats import pack_int4, quantize_int4
    from orbitctl.model.quant_linear import QuantLinear
    from orbitctl.kernels.int4_kernel import KERNEL_OPS
    from orbitctl.rl.steptime import dispatched_ops

    g = torch.Generator().manual_seed(0)
    codes, scale = quantize_int4(torch.randn(4 * hidden, hidden, generator=g) * 0.02, 32)
    layer = QuantLinear(hidden, 4 * hidden, "int4", group_size=32).to(device)
    with torch.no_grad():
        layer.weight_packed.copy_(pack_int4(codes).to(device))
        layer.weight_scale.copy_(scale.to(device))
    layer.use_fused_kernel()
    dense = layer.dequantized_weight(torch.bfloat16)

    def best(fn) -> float:
        fn()
        times = []
        for _ in range(3):
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        return min(times)

    rows = []
    for label, shape in (("decode step", (decode_rows, 1, hidden)), ("whole sequence", (1, sequence_rows, hidden))):
        x = torch.randn(*shape, generator=g).to(device, torch.bfloat16)
        with torch.no_grad():
            ops = dispatched_ops(torch, lambda: layer(x))
            kernel = sorted(n for n in ops if n in KERNEL_OPS or n in ("mm", "addmm", "bmm"))
            flops = 2 * x.numel() * 4 * hidden
            ours, gemm = flops / best(lambda: layer(x)) / 1e9, flops / best(lambda: x @ dense.t()) / 1e9
        rows.append((f"fused INT4 layer, {label} ({x.numel() // hidden} rows)",
                     f"{', '.join(kernel)}: {ours:.1f} GFLOP/s against {gemm:.1f} for the bf16 GEMM ({ours / gemm:.2f}x)",
                     "ok" if kernel else "FAIL"))
    return rows


def decode_rows(model_dir: Path, profile_path: Path, device: str, *, batch: int, new: int,
                prompt_len: int = 16) -> list[tuple[str, str, str]]:
    """A GPU's decode step: ``model_dir`` (an INT4 MoE) on ``device`` decoded greedy with its
    experts grouped (on a GPU; the CPU's fused kernel with --smoke) and dequantized one by one, against the decode
    tokens/s the time model predicts for ``profile_path`` at this batch and length. (check, figure, verdict) rows."""
    import torch

    from orbitctl.kernels.cpu_dtype import torch_dtype
    from orbitctl.model.frozen_base import load_frozen_base, use_fused_int4
    dtype = torch.bfloat16 if device == "cuda" else torch_dtype("auto", "cpu")
    model = load_frozen_base(model_dir, device=device, compute_dtype=dtype)
    packs = use_fused_int4(model)
    layers = [m for m in model.modules() if getattr(m, "stack", None) is not None]
    rows = [("INT4 kernels", f"{len(layers)} MoE layer(s) grouped, {packs / 2**20:.1f} MiB of dense kernel packs",
             "ok" if layers or device != "cuda" else "FAIL")]
    if layers:  # one layer's experts: the grouped kernel against the per-expert dequantizing loop
        moe = layers[0]
        g = torch.Generator().manual_seed(0)
        hidden = torch.randn(64, model.config.hidden_size, generator=g).to(device, dtype)
        index = torch.randint(0, moe.num_experts, (64, model.config.num_experts_per_tok), generator=g).to(device)
        weights = torch.rand(index.shape, generator=g).to(device, dtype)
        with torch.inference_mode():
            grouped = moe(hidden, index, weights).float()
            stack, moe.stack = moe.stack, None
            loop = moe(hidden, index, weights).float()
            moe.stack = stack
        rel = float((grouped - loop).abs().max() / loop.abs().max())
        rows.append(("grouped vs dequantize", f"largest difference {rel:.2e} of the layer's largest output",
                     "ok" if rel < 2 ** -6 else "FAIL"))
    if device == "cuda":  # the dense INT4 kernel (tinygemm): the slice's dense part is bf16, so check it on its own
        rows.append(tinygemm_row(model.config.hidden_size))
    rows += fused_layer_rows(model.config.hidden_size, device, sequence_rows=4096 if device == "cuda" else 512)
    prompt = torch.randint(0, model.config.vocab_size, (batch, prompt_len), generator=torch.Generator().manual_seed(0))
    prompt = prompt.to(device)
    measured, tokens = {}, {}
    fast = "grouped" if layers else "fused"
    graphed = "CUDA graphs" if device == "cuda" else "static step"
    for label in (graphed, fast, "dequantize"):
        if label == "dequantize":
            for m in layers:
                m.stack = None
            for m in model.modules():
                if hasattr(m, "kernel_pack"):
                    m.kernel_pack = None
        run = static_greedy_decode if label == graphed else greedy_decode
        run(model, prompt, 4)  # warm-up: kernels compiled, a graph captured, the allocator
        seconds, tokens[label] = run(model, prompt, new)
        measured[label] = batch * new / seconds
    same = sum(a == b for x, y in zip(tokens[graphed], tokens[fast]) for a, b in zip(x, y))
    rows.append((f"{graphed} greedy tokens", f"{same}/{batch * new} equal to the eager decode's",
                 "ok" if same >= 0.9 * batch * new else "FAIL"))
    eager, eager_bound = predicted_decode(profile_path, batch=batch, prompt=prompt_len, new=new, kernel="fused",
                                          overrides=("rollout.decode_graphs=false",))
    rows.append(("decode tokens/s, eager", f"{fast} {measured[fast]:.0f}, dequantize {measured['dequantize']:.0f} "
                                           f"({measured[fast] / measured['dequantize']:.2f}x); the plan predicts "
                                           f"{eager:.0f} ({eager_bound}-bound)",
                 f"measured/predicted {measured[fast] / eager:.2f}" if eager else "no prediction"))
    if device == "cuda":  # the plan's graphed decode applies on a GPU only
        replayed, bound = predicted_decode(profile_path, batch=batch, prompt=prompt_len, new=new, kernel="fused")
        rows.append(("decode tokens/s, CUDA graphs", f"{measured[graphed]:.0f} ({measured[graphed] / measured[fast]:.2f}x "
                                                     f"eager); the plan predicts {replayed:.0f} ({bound}-bound)",
                     f"measured/predicted {measured[graphed] / replayed:.2f}" if replayed else "no prediction"))
    else:
        rows.append(("decode tokens/s, static step", f"{measured[graphed]:.0f} eager on the CPU (the code path of the "
                                                     "CUDA graph; no replay here)", "ok"))
    return rows


def child(tree: Path, model: Path, kernel: str, batch: int, args) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--model", str(model), "--kernel", kernel,
           "--batch", str(batch), "--sequences", str(args.sequences), "--prompt", str(args.prompt), "--new",
           str(args.new), "--threads", str(args.threads)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=str(tree))
    if done.returncode:
        raise SystemExit(f"{kernel} in {tree} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def auto_batch(profile_path: Path, *, sequences: int, prompt: int, new: int) -> int:
    """The sequences ``rollout.batch_size: auto`` decodes at once for a step of ``sequences`` (``sequences / 2`` prompts
    x 2 completions) of ``prompt`` + ``new`` tokens on ``profile_path``'s hardware: the plan's number."""
    from orbitctl.plan import resolve_rollout_batch
    from orbitctl.profile import load_profile

    profile = load_profile(str(profile_path), ["rollout.batch_size=auto", f"rollout.max_new_tokens={new}",
                                               f"memory.seq_len={prompt + new}", f"rl.prompts_per_step={sequences // 2}",
                                               "rl.group_size=2", "quant.kernel=fused"])
    return resolve_rollout_batch(profile).rollout_batch_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--expert-width", type=int, default=256)
    parser.add_argument("--moe-layers", type=int, default=3)
    parser.add_argument("--sequences", type=int, default=64, help="the step's sequences, all decoded to full length")
    parser.add_argument("--batch", type=int, default=16,
                        help="sequences decoded at once by the fixed-batch sides (the profiles' micro-batch x group)")
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--baseline", type=Path, help="another checkout of orbitctl to measure beside this one")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "orbitctl-bench")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--kernel", default="dequantize", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return decode(args)

    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(HERE))
    from orbitctl.model.synthetic import write_int4_moe
    from phase_memory import profile_file, slice_sets

    name = f"moe-e{args.experts}-k{args.top_k}-h{args.hidden}-w{args.expert_width}-l{args.moe_layers}"
    model = args.work / name
    if not (model / "config.json").exists():
        write_int4_moe(model, hidden=args.hidden, experts=args.experts, expert_width=args.expert_width,
                       moe_layers=args.moe_layers, top_k=args.top_k)
    sets = slice_sets(model, args.work / "run", "cpu", 1, args.prompt + args.new, args.new)
    path = profile_file(args.work, {**sets, "name": "moe-decode", "adapter.targets": ["o_proj"],
                                    "adapter.last_layers": 1})  # one adapted linear: the benchmark decodes the base
    auto = auto_batch(path, sequences=args.sequences, prompt=args.prompt, new=args.new)
    sides = [("this checkout, dequantize", ROOT, "dequantize", args.batch),
             ("this checkout, fused", ROOT, "fused", args.batch),
             ("this checkout, fused, batch auto", ROOT, "fused", auto)]
    if args.baseline is not None:
        sides[:0] = [(f"{args.baseline} (dequantize)", args.baseline.resolve(), "dequantize", args.batch),
                     (f"{args.baseline} (dequantize), batch {auto}", args.baseline.resolve(), "dequantize", auto)]
    runs: dict[str, list[dict]] = {label: [] for label, *_ in sides}
    for rep in range(args.reps):
        for label, tree, kernel, batch in sides:
            runs[label].append(child(tree, model, kernel, batch, args))
            print(f"round {rep + 1}: {label}: {runs[label][-1]['tokens_per_s']:.1f} tokens/s", file=sys.stderr)
    reference = runs["this checkout, dequantize"][0]["tokens"]
    rows = []
    for label, _, _, batch in sides:
        rates = [r["tokens_per_s"] for r in runs[label]]
        tokens = runs[label][0]["tokens"]
        same = sum(a == b for ra, rb in zip(tokens, reference) for a, b in zip(ra, rb))
        rows.append({"side": label, "batch": batch, "median_tokens_per_s": statistics.median(rates), "min": min(rates),
                     "max": max(rates), "greedy_tokens_equal": f"{same}/{sum(len(r) for r in reference)}",
                     "dtype": runs[label][0]["dtype"], "pack_bytes": runs[label][0]["pack_bytes"]})
    base = rows[0]["median_tokens_per_s"]
    peaks = measured_peaks(args.threads, (args.batch, args.hidden, args.expert_width * args.top_k))
    for row, (_, tree, kernel, batch) in zip(rows, sides):
        row["speedup"] = row["median_tokens_per_s"] / base
        row["predicted_tokens_per_s"], row["bound"] = predicted_decode(
            path, batch=batch, prompt=args.prompt, new=args.new, kernel=kernel, peaks=peaks) \
            if tree == ROOT else (None, "")
    rates = {"gemm_flops_per_s": peaks.flops, "copy_bytes_per_s": peaks.hbm, "op_s": peaks.op_s}
    setting = {"experts": args.experts, "top_k": args.top_k, "hidden": args.hidden, "expert_width": args.expert_width,
               "moe_layers": args.moe_layers, "sequences": args.sequences, "batch": args.batch, "batch_auto": auto,
               "prompt": args.prompt, "new": args.new, "reps": args.reps, "threads": args.threads}
    if args.json:
        print(json.dumps({"setting": setting, "rows": rows, "measured_rates": rates}, indent=1))
        return
    print(f"INT4 MoE decode of one step's {args.sequences} sequences: {setting}")
    print(f"the plan at this machine's rates (as plan --measure-time): GEMM {peaks.flops / 1e9:.1f} GFLOP/s, "
          f"copy {peaks.hbm / 1e9:.1f} GB/s, {peaks.op_s * 1e6:.1f} us per eager op")
    print(f"{'side':<52} {'batch':>5} {'tokens/s median (range)':>26} {'x':>6} {'greedy = dequantize':>20} "
          f"{'plan predicts':>22}")
    for row in rows:
        spread = f"{row['median_tokens_per_s']:.1f} ({row['min']:.1f}-{row['max']:.1f})"
        plan = f"{row['predicted_tokens_per_s']:.1f} ({row['bound']})" if row["predicted_tokens_per_s"] else "-"
        print(f"{row['side']:<52} {row['batch']:>5} {spread:>26} {row['speedup']:>6.2f} {row['greedy_tokens_equal']:>20} "
              f"{plan:>22}")


if __name__ == "__main__":
    main()
