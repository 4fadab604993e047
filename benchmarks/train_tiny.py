"""orbitctl train vs TRL GRPOTrainer on the CPU demo: same model, task, group, lengths, LoRA.

    .venv/bin/pip install -e '.[bench]'
    .venv/bin/python benchmarks/train_tiny.py            # prints a table; not a test
    .venv/bin/python benchmarks/train_tiny.py --steps 40

Both train LoRA r=8 on every linear layer of the demo's NF4 base, 32 prompts x 8 completions
per optimizer step, completions of at most 2 tokens at temperature 1, lr 1e-3, one rank.
Throughput is measured after warm-up steps; orbitctl's time split comes from metrics.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def run_orbitctl(steps: int, warmup: int, run_dir: Path) -> dict:
    from orbitctl.profile import load_profile
    from orbitctl.rl.api import train

    profile = load_profile(ROOT / "profiles" / "tiny-cpu.yaml",
                           [f"run.dir={run_dir}", "run.eval_every=100000", "run.save_every=100000"])
    train(profile, fresh=True, steps=steps + warmup)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][warmup:]
    total = sum(r["time_rollout_s"] + r["time_reward_s"] + r["time_update_s"] for r in records)
    samples = sum(256 for _ in records)
    tokens = sum(r["tokens"] for r in records)
    return {"samples_per_s": samples / total, "tokens_per_s": tokens / total,
            "rollout_s": sum(r["time_rollout_s"] for r in records) / len(records),
            "reward_s": sum(r["time_reward_s"] for r in records) / len(records),
            "update_s": sum(r["time_update_s"] for r in records) / len(records),
            "step_s": total / len(records), "peak_rss_gib": records[-1]["peak_memory_bytes"] / 2**30}


def run_trl(steps: int, warmup: int, out_dir: Path) -> dict:
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from orbitctl.model.frozen_base import load_frozen_base
    from orbitctl.builder import prepare_frozen_base
    from orbitctl.profile import load_profile
    from orbitctl.data.prompts import load_prompts

    profile = load_profile(ROOT / "profiles" / "tiny-cpu.yaml")
    split = load_prompts(profile.data, 0)
    base = prepare_frozen_base(profile, split.warm_task)
    model = load_frozen_base(str(base.quantized_dir))
    tokenizer = AutoTokenizer.from_pretrained(str(base.quantized_dir))
    tokenizer.padding_side = "left"
    data = Dataset.from_list([{"prompt": it.prompt, "answer": it.answer} for it in split.train])

    def reward(completions, answer, **_):
        return [split.task.score(c, type(split.train[0])(prompt="", answer=a)) for c, a in zip(completions, answer)]

    stamps: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            stamps.append(time.perf_counter())

    config = GRPOConfig(
        output_dir=str(out_dir), max_steps=steps + warmup, per_device_train_batch_size=256, num_generations=8,
        max_completion_length=2, temperature=1.0, top_p=1.0, learning_rate=1e-3, beta=0.0, use_cpu=True,
        bf16=True, gradient_checkpointing=True, logging_steps=1000, save_strategy="no", report_to="none",
        scale_rewards="group", loss_type="dapo", warmup_steps=10, max_grad_norm=1.0, shuffle_dataset=True, seed=0)
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=data,
                          processing_class=tokenizer, peft_config=lora, callbacks=[Clock()])
    start = time.perf_counter()
    trainer.train()
    stamps = [start] + stamps
    measured = stamps[-1] - stamps[warmup]
    return {"samples_per_s": 256 * steps / measured, "tokens_per_s": None, "step_s": measured / steps,
            "peak_rss_gib": __import__("resource").getrusage(__import__("resource").RUSAGE_SELF).ru_maxrss / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--which", choices=["both", "orbitctl", "trl"], default="both")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(min(2, os.cpu_count() or 1))
    if args.child or args.which != "both":
        with tempfile.TemporaryDirectory() as tmp:
            fn = run_orbitctl if args.which == "orbitctl" else run_trl
            print("RESULT " + json.dumps(fn(args.steps, args.warmup, Path(tmp) / "run")))
        return
    import subprocess

    results = {}
    for which in ("orbitctl", "trl"):  # separate processes: no shared state, fair peak RSS
        out = subprocess.run([sys.executable, __file__, "--which", which, "--steps", str(args.steps),
                              "--warmup", str(args.warmup), "--child"], capture_output=True, text=True)
        line = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
        results[which] = json.loads(line[-1][7:]) if line else {"error": out.stderr.strip().splitlines()[-1:]}
    print(f"{'':10} {'samples/s':>10} {'tokens/s':>10} {'s/step':>8} {'peak RSS GiB':>13}")
    for name, r in results.items():
        if "error" in r:
            print(f"{name:10} failed: {r['error']}")
            continue
        tok = "-" if r.get("tokens_per_s") is None else f"{r['tokens_per_s']:.0f}"
        print(f"{name:10} {r['samples_per_s']:10.0f} {tok:>10} {r['step_s']:8.3f} {r['peak_rss_gib']:13.2f}")
    o = results.get("orbitctl", {})
    if "rollout_s" in o:
        print(f"orbitctl per step: rollout {o['rollout_s']:.3f} s, reward {o['reward_s']:.4f} s, update {o['update_s']:.3f} s")


if __name__ == "__main__":
    main()
