"""The GPU paths, checked in one command on a machine with one CUDA GPU (under 10 minutes on an H200).

    python benchmarks/device_check.py                 # on the GPU machine
    python benchmarks/device_check.py --smoke         # the same steps on this CPU at toy widths (code path only)

1. The CUDA train path on the tiny MoE (profiles/tiny-moe-cpu.yaml on one GPU: INT4 experts
   dequantized on the device, LoRA, DeepSpeed, the per-phase memory meter): steps, seconds per step,
   held-out accuracy before and after, and each phase's measured peak against the plan.
2. A real-width slice: a dense layer and MoE layer(s) at Kimi-K2 width (hidden 7168, routed experts
   of width 2048, INT4 group 32, random weights written by orbitctl.model.synthetic), trained for two
   steps on a long micro-batch; each phase's measured peak (torch.cuda.max_memory_allocated, and the
   device's used memory from NVML) against what `orbitctl plan` predicts for the same profile.

Prints one table at the end; never part of the test suite or CI.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from phase_memory import memory_rows, print_rows, profile_file, slice_sets, train, write_slice


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="run every step on the CPU at toy widths")
    parser.add_argument("--gpu", default="h200", help="the profile's hardware.gpu for this machine (catalog name)")
    parser.add_argument("--steps", type=int, default=20, help="tiny-MoE train steps")
    parser.add_argument("--experts", type=int, default=384, help="routed experts per MoE layer of the slice")
    parser.add_argument("--moe-layers", type=int, default=1, help="MoE layers of the slice (plus one dense layer)")
    parser.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence of the slice's micro-batch")
    parser.add_argument("--work", default="/tmp/orbitctl-device-check", help="scratch directory")
    args = parser.parse_args()

    import torch

    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here; run with --smoke to check the code path on the CPU")
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    gpu = "cpu" if args.smoke else args.gpu
    rows: list[tuple[str, str, str]] = []
    if not args.smoke:
        props = torch.cuda.get_device_properties(0)
        rows.append(("device", f"{props.name}, {props.total_memory / 2**30:.1f} GiB, torch {torch.__version__}", ""))

    # 1. the CUDA train path on the tiny MoE
    path = profile_file(work, {"name": "device-tiny-moe", "hardware.gpu": gpu, "hardware.gpus_per_node": 1,
                               "memory.expert_parallel": 1, "run.dir": str(work / "tiny-moe"),
                               "run.eval_every": max(1, args.steps), "run.save_every": 10**6})
    result, seconds = train(path, 3 if args.smoke else args.steps)
    rows.append(("tiny MoE train", f"{result['steps']} steps in {seconds:.0f} s; held-out {result['eval_before']} -> "
                                   f"{result['eval_after']}", "ok" if result["steps"] else "FAIL"))
    rows += memory_rows("tiny MoE", result["last_metrics"])

    # 2. the real-width slice
    width = dict(hidden=256, expert_width=128, experts=8, top_k=2) if args.smoke else \
        dict(hidden=7168, expert_width=2048, experts=args.experts, top_k=8)
    import time

    start = time.perf_counter()
    slice_dir, total, routed = write_slice(work / "slice", moe_layers=args.moe_layers, **width)
    rows.append(("slice written", f"{total / 1e9:.2f} GB ({routed / total:.0%} routed experts) in "
                                  f"{time.perf_counter() - start:.0f} s", ""))
    seq = 64 if args.smoke else args.seq_len
    path = profile_file(work, slice_sets(slice_dir, work / "slice-run", gpu, 1, seq, 16 if args.smoke else 64))
    result, seconds = train(path, 2)
    rows.append(("slice train", f"{result['steps']} steps in {seconds:.0f} s", "ok" if result["steps"] else "FAIL"))
    rows += memory_rows("slice", result["last_metrics"])
    print_rows(rows)


if __name__ == "__main__":
    main()
