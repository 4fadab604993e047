"""orbitctl train against TRL's GRPOTrainer, timed the same way on the same setting.

    .venv/bin/pip install -e '.[bench]'
    .venv/bin/python benchmarks/train_vs_trl.py                              # the demo setting
    .venv/bin/python benchmarks/train_vs_trl.py --setting representative     # 107 M llama, 64-token completions
    .venv/bin/python benchmarks/train_vs_trl.py --setting representative --reps 3 --steps 3 --json
    .venv/bin/python benchmarks/train_vs_trl.py --setting smollm2           # SmolLM2-135M-Instruct, chat template
    .venv/bin/python benchmarks/train_vs_trl.py --setting representative --orbitctl-set quant.format=int4

With ``--orbitctl-set`` a third side runs orbitctl with those profile overrides (e.g. its own standard 4-bit
format, INT4 through the fused kernel, against TRL's bitsandbytes NF4), beside orbitctl on the setting's format.

Settings: ``benchmarks/settings.py``. Both trainers load the same NF4 checkpoint, train the same LoRA
(all linear layers; of the last N with ``adapter.last_layers``, PEFT's ``layers_to_transform``) on the
same prompts, group size, completion length, sampling, learning rate and precision (orbitctl's resolved
compute dtype: bf16 where the CPU has native bf16, else fp32; TRL's ``bf16`` flag follows it), with
the same number of torch threads, each repetition in a fresh process, the two trainers alternating.

Timing, the same on both sides: the wall-clock between the ends of consecutive optimizer steps
(orbitctl's ``step`` event, TRL's ``on_step_end``), after ``--warmup`` steps; the step after the
measured ones is run but not counted (orbitctl evaluates at its last step). So a step is everything
its trainer does from one optimizer step to the next. Inside it, the rollout (sampling the completions,
decoded to text) and the update are timed by each trainer's own boundaries: orbitctl's phase timers,
and for TRL its ``_generate_single_turn`` (rollout) and the step minus ``_generate_and_score_completions``
(update). Reported per trainer: the median and range over repetitions of samples/s (completions per
second of step), rollout tokens/s (completion tokens per second of rollout), update tokens/s (completion
tokens per second of update) and the process's peak RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import settings  # noqa: E402  (benchmarks/settings.py)


def _samples(profile) -> int:
    """Completions per optimizer step."""
    return profile.rl.prompts_per_step * profile.rl.group_size


def _peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _summary(stamps: list[float], warmup: int, steps: int, samples: int, rollout_s: list[float],
             update_s: list[float], tokens: list[int]) -> dict:
    """Per-step figures over steps ``warmup+1 .. warmup+steps`` (1-based); ``stamps[i]`` ends step i (0: start)."""
    span = stamps[warmup + steps] - stamps[warmup]
    window = slice(warmup, warmup + steps)
    tok, roll, upd = sum(tokens[window]), sum(rollout_s[window]), sum(update_s[window])
    return {"step_s": span / steps, "samples_per_s": samples * steps / span, "rollout_tokens_per_s": tok / roll,
            "update_tokens_per_s": tok / upd, "rollout_s": roll / steps, "update_s": upd / steps,
            "completion_tokens_per_step": tok / steps, "peak_rss_gib": _peak_rss_gib()}


def run_orbitctl(s: settings.Setting, warmup: int, steps: int, work: Path, sets: tuple[str, ...] = ()) -> dict:
    from orbitctl.kernels.cpu_dtype import compute_dtype_name
    from orbitctl.rl.api import train

    total = warmup + steps + 1
    profile = s.load((f"run.dir={work / 'run'}", "run.eval_every=100000", "run.save_every=100000",
                      f"rl.steps={total}", *sets))
    stamps: list[float] = []
    records: list[dict] = []

    def on_event(kind: str, payload: dict) -> None:
        if kind == "step":
            stamps.append(time.perf_counter())
            records.append(payload)
        elif kind == "eval" and not stamps:  # the step-0 evaluation ends setup: step 1 starts here
            stamps.append(time.perf_counter())

    train(profile, fresh=True, on_event=on_event)
    return {**_summary(stamps, warmup, steps, _samples(profile),
                       [r["time_rollout_s"] for r in records], [r["time_update_s"] for r in records],
                       [int(r["tokens"]) for r in records]),
            "compute_dtype": compute_dtype_name(profile)}


def run_trl(s: settings.Setting, warmup: int, steps: int, work: Path) -> dict:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from orbitctl.builder import prepare_frozen_base
    from orbitctl.data.prompts import load_prompts
    from orbitctl.kernels.cpu_dtype import compute_dtype_name
    from orbitctl.model.frozen_base import load_frozen_base
    from orbitctl.rl.rewards import make_reward

    profile = s.load()
    split = load_prompts(profile.data, 0)
    base = prepare_frozen_base(profile, split.warm_task)
    bf16 = compute_dtype_name(profile) == "bf16"
    model = load_frozen_base(str(base.quantized_dir), compute_dtype=torch.bfloat16 if bf16 else torch.float32)
    tok_dir = base.quantized_dir if (base.quantized_dir / "tokenizer.json").exists() else base.source_dir
    tokenizer = AutoTokenizer.from_pretrained(str(tok_dir))
    tokenizer.padding_side = "left"
    items = {it.prompt: it for it in split.train}
    chat = profile.data.chat_template
    system = [{"role": "system", "content": profile.data.system_prompt}] if chat and profile.data.system_prompt else []
    # under a chat template TRL takes conversational prompts and renders them with the tokenizer's template itself
    data = Dataset.from_list([{"prompt": [*system, {"role": "user", "content": it.prompt}] if chat else it.prompt}
                              for it in split.train])
    score = make_reward(profile.data.reward, split.task)  # orbitctl's own reward function, called the same way

    def reward(prompts, completions, **_):
        if chat:  # conversational: the prompt's last turn is the question, the completion one assistant turn
            prompts = [p[-1]["content"] for p in prompts]
            completions = [c[0]["content"] for c in completions]
        return score(completions, [items[p] for p in prompts])

    stamps: list[float] = []
    rollout_s: list[float] = []
    scored_s: list[float] = []
    tokens: list[int] = []

    class Timed(GRPOTrainer):
        def _generate_single_turn(self, *args, **kwargs):
            start = time.perf_counter()
            out = super()._generate_single_turn(*args, **kwargs)
            rollout_s.append(time.perf_counter() - start)
            tokens.append(sum(len(c) for c in out[0]))
            return out

        def _generate_and_score_completions(self, *args, **kwargs):
            start = time.perf_counter()
            out = super()._generate_and_score_completions(*args, **kwargs)
            scored_s.append(time.perf_counter() - start)
            return out

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            stamps.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            stamps.append(time.perf_counter())

    n = _samples(profile)
    rl, rollout, adapter = profile.rl, profile.rollout, profile.adapter
    config = GRPOConfig(
        output_dir=str(work / "trl"), max_steps=warmup + steps + 1, per_device_train_batch_size=n,
        num_generations=rl.group_size, max_completion_length=rollout.max_new_tokens, temperature=rollout.temperature,
        top_p=rollout.top_p, learning_rate=rl.lr, beta=0.0, use_cpu=True, bf16=bf16,
        gradient_checkpointing=profile.memory.gradient_checkpointing, logging_steps=10**6, save_strategy="no",
        report_to="none", scale_rewards="group" if rl.std_normalize else "none", loss_type="dapo",
        warmup_steps=rl.warmup_steps, lr_scheduler_type="constant_with_warmup", max_grad_norm=rl.grad_clip,
        shuffle_dataset=True, seed=0, dataloader_num_workers=0)
    layers = model.config.num_hidden_layers
    last = list(range(layers - adapter.last_layers, layers)) if adapter.last_layers else None
    # PEFT takes layers_to_transform only with named modules: the llama linears "all-linear" picks
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"] if last else "all-linear"
    lora = LoraConfig(r=adapter.rank, lora_alpha=adapter.alpha, lora_dropout=0.0, target_modules=targets,
                      layers_to_transform=last, task_type="CAUSAL_LM")
    trainer = Timed(model=model, reward_funcs=reward, args=config, train_dataset=data, processing_class=tokenizer,
                    peft_config=lora, callbacks=[Clock()])
    trainer.train()
    update_s = [stamps[i + 1] - stamps[i] - scored_s[i] for i in range(len(scored_s))]
    return {**_summary(stamps, warmup, steps, n, rollout_s, update_s, tokens),
            "compute_dtype": "bf16" if bf16 else "fp32"}


def _child(which: str, s: settings.Setting, warmup: int, steps: int, threads: int, sets: tuple[str, ...]) -> dict:
    import torch

    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as tmp:
        if which == "trl":
            return run_trl(s, warmup, steps, Path(tmp))
        return run_orbitctl(s, warmup, steps, Path(tmp), sets if which == "orbitctl+" else ())


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


KEYS = ("samples_per_s", "rollout_tokens_per_s", "update_tokens_per_s", "step_s", "rollout_s", "update_s",
        "peak_rss_gib")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setting", choices=settings.SETTINGS, default="demo")
    parser.add_argument("--steps", type=int, default=None, help="measured steps per repetition (demo 20, else 3)")
    parser.add_argument("--warmup", type=int, default=None, help="steps before the measured ones (demo 5, else 1)")
    parser.add_argument("--reps", type=int, default=3, help="repetitions of each trainer, alternating")
    parser.add_argument("--which", choices=["both", "orbitctl", "orbitctl+", "trl"], default="both")
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "orbitctl-bench",
                        help="where the representative model and prompts are built once")
    parser.add_argument("--orbitctl-set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="a third side: orbitctl with this profile override (repeatable), e.g. quant.format=int4")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    steps = args.steps or (20 if args.setting == "demo" else 3)
    warmup = args.warmup if args.warmup is not None else (5 if args.setting == "demo" else 1)
    s = settings.setting(args.setting, args.work)
    profile = s.load()
    if args.child:
        print("RESULT " + json.dumps(_child(args.which, s, warmup, steps, args.threads, tuple(args.sets))), flush=True)
        return
    names = ["orbitctl", "trl"] if args.which == "both" else [args.which]
    if args.sets and args.which in ("both", "orbitctl"):
        names.insert(1, "orbitctl+")
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for rep in range(args.reps):
        for name in names:  # alternating, each in its own process: no shared state, a fair peak RSS
            cmd = [sys.executable, __file__, "--child", "--which", name, "--setting", args.setting, "--steps",
                   str(steps), "--warmup", str(warmup), "--threads", str(args.threads), "--work", str(args.work),
                   *(f"--orbitctl-set={item}" for item in args.sets)]
            out = subprocess.run(cmd, capture_output=True, text=True)
            line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
            if not line:
                sys.exit(f"{name} failed (rep {rep + 1}):\n" + "\n".join(out.stderr.strip().splitlines()[-15:]))
            runs[name].append(json.loads(line[-1][len("RESULT "):]))
            print(f"rep {rep + 1} {name}: " + ", ".join(f"{k} {runs[name][-1][k]:.3g}" for k in KEYS),
                  file=sys.stderr, flush=True)
    table = {name: {k: _spread([r[k] for r in rs]) for k in KEYS} | {"compute_dtype": rs[0]["compute_dtype"]}
             for name, rs in runs.items()}
    report = {"setting": args.setting, "steps": steps, "warmup": warmup, "reps": args.reps, "threads": args.threads,
              "samples_per_step": _samples(profile), "max_new_tokens": profile.rollout.max_new_tokens,
              "cpu_capability": os.environ.get("ATEN_CPU_CAPABILITY", "default"), "orbitctl+_sets": args.sets,
              "results": table, "runs": runs}
    if "trl" in table:
        for name in ("orbitctl", "orbitctl+"):
            if name in table:
                report[f"{name}_over_trl_samples_per_s"] = (table[name]["samples_per_s"]["median"]
                                                            / table["trl"]["samples_per_s"]["median"])
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"setting {args.setting}: {report['samples_per_step']} completions of <= {report['max_new_tokens']} tokens per step, "
          f"{args.reps} reps x {steps} steps after {warmup} warm-up, {args.threads} threads; median (min-max)")
    if args.sets:
        print(f"orbitctl+ is orbitctl with {' '.join(args.sets)}; orbitctl and trl run the setting's own format")
    print(f"{'':9} {'samples/s':>22} {'rollout tok/s':>22} {'update tok/s':>22} {'s/step':>20} {'peak RSS GiB':>18}")
    for name, t in table.items():
        cells = [f"{t[k]['median']:.4g} ({t[k]['min']:.4g}-{t[k]['max']:.4g})" for k in
                 ("samples_per_s", "rollout_tokens_per_s", "update_tokens_per_s", "step_s", "peak_rss_gib")]
        print(f"{name:9} " + " ".join(f"{c:>22}" for c in cells) + f"  [{t['compute_dtype']}]")
    for name in ("orbitctl", "orbitctl+"):
        if f"{name}_over_trl_samples_per_s" in report:
            print(f"{name} / TRL samples/s: {report[f'{name}_over_trl_samples_per_s']:.2f}x")


if __name__ == "__main__":
    main()
