"""Where one orbitctl RL step's time goes: torch.profiler over one rollout and one policy update.

    .venv/bin/python benchmarks/step_profile.py                          # the representative setting
    .venv/bin/python benchmarks/step_profile.py --setting demo --rows 12
    .venv/bin/python benchmarks/step_profile.py --trace /tmp/step.json   # also a Chrome trace (chrome://tracing)

The step is the trainer's own (``orbitctl.rl.rollout.collect`` then ``orbitctl.rl.update.run_update`` on the
DeepSpeed engine), after one unprofiled warm-up step. Printed per phase: wall seconds, the operators
with the most self CPU time, and the share of the phase spent in the frozen base's dequantization
(bitsandbytes' kernels for NF4, orbitctl's for INT4/FP8), its matmuls, and everything else.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import settings  # noqa: E402  (benchmarks/settings.py)

DEQUANT = ("bitsandbytes::dequantize", "dequantize_int4", "dequantize_fp8")
MATMUL = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "bitsandbytes::gemm_4bit")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setting", choices=["demo", "representative"], default="representative")
    parser.add_argument("--rows", type=int, default=15, help="operators listed per phase")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "orbitctl-bench")
    parser.add_argument("--trace", type=Path, help="write a Chrome trace of the profiled step here")
    args = parser.parse_args()

    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from orbitctl.builder import load_policy, prepare_frozen_base
    from orbitctl.data.prompts import PromptStream, load_prompts
    from orbitctl.rl.engine import build_engine, close_process_group, ensure_process_group
    from orbitctl.rl.losses import group_advantages
    from orbitctl.rl.rewards import make_reward
    from orbitctl.rl.rollout import collect
    from orbitctl.rl.update import run_update

    torch.set_num_threads(args.threads)
    s = settings.setting(args.setting, args.work)
    profile_ = s.load()
    rl, rollout = profile_.rl, profile_.rollout
    ensure_process_group()
    split = load_prompts(profile_.data, profile_.run.seed)
    reward_fn = make_reward(profile_.data.reward, split.task)
    policy = load_policy(profile_, prepare_frozen_base(profile_, split.warm_task))
    engine, _ = build_engine(policy, profile_, profile_.memory.gradient_accumulation_steps, rl.steps)
    generator = torch.Generator().manual_seed(profile_.run.seed)
    stream = PromptStream(split.train, profile_.run.seed, 0, 1)
    phases: dict[str, float] = {}

    def step(profiled: bool) -> None:
        positions, items = zip(*stream.next_step(rl.prompts_per_step))
        start = time.perf_counter()
        with record_function("rollout"):
            batch = collect(policy, list(items), reward_fn, group_size=rl.group_size,
                            batch_size=profile_.rollout_batch_size, max_new_tokens=rollout.max_new_tokens,
                            temperature=rollout.temperature, top_p=rollout.top_p, generator=generator,
                            keep_dist=False, keys=(profile_.run.seed, positions))
        middle = time.perf_counter()
        with record_function("update"):
            run_update(engine, policy, batch, group_advantages(batch.rewards, rl.group_size, rl.std_normalize),
                       profile_, lambda *a: None)
        if profiled:
            phases["rollout"], phases["update"] = middle - start, time.perf_counter() - middle
            phases["tokens"] = float(batch.completion_mask.sum())

    step(False)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step(True)
    close_process_group()
    if args.trace:
        prof.export_chrome_trace(str(args.trace))
    print(f"setting {args.setting}: {rl.prompts_per_step * rl.group_size} completions, "
          f"{int(phases['tokens'])} completion tokens; wall (under the profiler) rollout {phases['rollout']:.2f} s, "
          f"update {phases['update']:.2f} s")
    for phase in ("rollout", "update"):
        events = [e for e in prof.profiler.function_events if _inside(e, phase)]
        by_key: dict[str, list[float]] = {}
        for e in events:
            slot = by_key.setdefault(e.name, [0.0, 0])
            slot[0] += e.self_cpu_time_total
            slot[1] += 1
        total = sum(v[0] for v in by_key.values()) or 1.0
        shares = _shares_from(by_key)
        print(f"\n{phase}: self CPU {total / 1e6:.2f} s; dequantize {shares['dequant']:.0%}, matmul "
              f"{shares['matmul']:.0%}, everything else {shares['other']:.0%}")
        print(f"  {'operator':<48} {'self s':>8} {'share':>6} {'calls':>7}")
        for name, (cpu, calls) in sorted(by_key.items(), key=lambda kv: -kv[1][0])[:args.rows]:
            print(f"  {name[:48]:<48} {cpu / 1e6:8.3f} {cpu / total:6.1%} {calls:7d}")


def _inside(event, phase: str) -> bool:
    """Whether the profiler event ran under the ``record_function(phase)`` range (a CPU op's ancestors)."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name == phase:
            return True
        parent = parent.cpu_parent
    return False


def _shares_from(by_key: dict[str, list[float]]) -> dict:
    total = sum(v[0] for v in by_key.values()) or 1.0
    dequant = sum(v[0] for k, v in by_key.items() if k.startswith(DEQUANT))
    matmul = sum(v[0] for k, v in by_key.items() if k in MATMUL)
    return {"dequant": dequant / total, "matmul": matmul / total, "other": 1 - (dequant + matmul) / total}


if __name__ == "__main__":
    main()
