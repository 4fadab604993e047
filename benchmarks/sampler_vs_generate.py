"""orbitctl's sampler (``Policy.sample``) against transformers' ``generate`` on the same model and batch.

    .venv/bin/python benchmarks/sampler_vs_generate.py                       # the representative setting
    .venv/bin/python benchmarks/sampler_vs_generate.py --setting demo --reps 5 --json
    .venv/bin/python benchmarks/sampler_vs_generate.py --set quant.format=int4 --set quant.kernel=dequantize
    .venv/bin/python benchmarks/sampler_vs_generate.py --set quant.format=int4 --baseline /tmp/orbitctl-before

The model is the setting's NF4 base with its LoRA attached (fresh: B = 0, computed like a trained one),
in eval mode, without gradients; the batch is the setting's rollout batch (its first prompts, G copies
each, left-padded). Both decode with transformers' dynamic KV cache in the model's dtype, positions
counted from each row's first real token, and stop a row at EOS. At temperature 0 both are greedy and
must produce the same tokens (the script says which rows differ, if any); at temperature 1 both sample
the full distribution (orbitctl with its keyed draws, generate with torch's generator), so their tokens
differ but the work is the same. Reported: completion tokens per second, median and range over
``--reps`` alternating runs after one warm-up run of each.

``--baseline DIR`` measures this checkout (with ``--set``) beside another checkout of orbitctl (its own copy of
this script, the setting as it is there, or with ``--baseline-set``), side by side in one run: each repetition is
one fresh process per checkout, the two alternating, each a warm-up and one measured run of both samplers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import settings  # noqa: E402  (benchmarks/settings.py)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    settings.add_policy_arguments(parser)
    parser.add_argument("--baseline", type=Path, help="another checkout of orbitctl to measure beside this one")
    parser.add_argument("--baseline-set", action="append", default=[], dest="baseline_sets", metavar="KEY=VALUE",
                        help="a profile override for the baseline's side (repeatable; default: none, its setting as is)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.baseline is not None:
        side_by_side(args)
        return

    import torch

    from orbitctl.model.draws import KeyedDraws

    profile, split, policy = settings.eval_policy(args)
    prompts = [it.prompt for it in split.train[:profile.rl.prompts_per_step]
               for _ in range(profile.rl.group_size)]
    ids, mask = policy.encode_prompts(prompts)
    new = profile.rollout.max_new_tokens
    rows = ids.shape[0]
    draws = KeyedDraws(profile.run.seed, tuple(range(rows)))

    def ours(temperature: float):
        out = policy.sample(ids, mask, max_new_tokens=new, temperature=temperature, top_p=1.0,
                            generator=torch.Generator().manual_seed(0), draws=draws if temperature else None)
        return out.completion_ids, out.completion_mask

    def theirs(temperature: float):
        sampling = {"temperature": temperature, "top_p": 1.0, "top_k": 0} if temperature > 0 else {}
        with torch.no_grad():
            out = policy.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                                        do_sample=temperature > 0, eos_token_id=policy.eos_id,
                                        pad_token_id=policy.pad_id, use_cache=True, **sampling)
        completion = out[:, ids.shape[1]:]
        # generate pads a finished row with pad after its EOS; the mask keeps up to and including the EOS
        seen_eos = (completion == policy.eos_id).long().cumsum(-1)
        keep = (seen_eos == 0) | ((seen_eos == 1) & (completion == policy.eos_id))
        return completion, keep.long()

    def timed(fn, temperature):
        start = time.perf_counter()
        completion, keep = fn(temperature)
        return time.perf_counter() - start, completion, keep

    report: dict = {"setting": args.setting, "sets": args.sets, "rows": rows, "prompt_tokens": int(ids.shape[1]),
                    "max_new_tokens": new, "threads": args.threads, "temperatures": {}}
    for temperature in (0.0, 1.0):
        times: dict[str, list[float]] = {"orbitctl": [], "generate": []}
        tokens: dict[str, list[int]] = {"orbitctl": [], "generate": []}
        outputs = {}
        for rep in range(args.reps + 1):
            torch.manual_seed(rep)  # generate draws from torch's global generator
            for name, fn in (("orbitctl", ours), ("generate", theirs)):
                seconds, completion, keep = timed(fn, temperature)
                if rep:  # the first run of each warms up
                    times[name].append(seconds)
                    tokens[name].append(int(keep.sum()))
                outputs[name] = (completion, keep)
        entry = {name: {"tokens_per_s": statistics.median(t / s_ for t, s_ in zip(tokens[name], times[name])),
                        "min": min(t / s_ for t, s_ in zip(tokens[name], times[name])),
                        "max": max(t / s_ for t, s_ in zip(tokens[name], times[name])),
                        "tokens": tokens[name][-1], "seconds_median": statistics.median(times[name])}
                 for name in times}
        if temperature == 0.0:
            (a, ka), (b, kb) = outputs["orbitctl"], outputs["generate"]
            # each row's kept tokens, padding dropped: equal lists are equal completions
            kept = [[row[m.bool()].tolist() for row, m in zip(ids_, mask_)] for ids_, mask_ in ((a, ka), (b, kb))]
            same = [x == y for x, y in zip(*kept)]
            entry["greedy_rows_equal"] = sum(same)
            entry["greedy_rows_differing"] = [r for r, ok in enumerate(same) if not ok]
        report["temperatures"][str(temperature)] = entry
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"setting {args.setting} {' '.join(args.sets)}: {rows} rows, prompt {report['prompt_tokens']} tokens (left-padded), "
          f"up to {new} new tokens, {args.threads} threads; completion tokens/s, median (min-max) of {args.reps}")
    for temperature, entry in report["temperatures"].items():
        o, g = entry["orbitctl"], entry["generate"]
        line = (f"temperature {temperature}: orbitctl {o['tokens_per_s']:.4g} ({o['min']:.4g}-{o['max']:.4g}), "
                f"generate {g['tokens_per_s']:.4g} ({g['min']:.4g}-{g['max']:.4g}); "
                f"orbitctl/generate {o['tokens_per_s'] / g['tokens_per_s']:.2f}x")
        if "greedy_rows_equal" in entry:
            line += f"; greedy tokens equal in {entry['greedy_rows_equal']}/{rows} rows"
        print(line)


def side_by_side(args) -> None:
    """``--baseline``: alternate fresh processes of this checkout's script and the baseline's, one repetition each."""
    import os
    import subprocess

    sides = [("this checkout " + " ".join(args.sets), HERE.parent, [f"--set={s}" for s in args.sets]),
             (f"{args.baseline} " + " ".join(args.baseline_sets), args.baseline.resolve(),
              [f"--set={s}" for s in args.baseline_sets])]
    runs: dict[str, list[dict]] = {label: [] for label, _, _ in sides}
    for rep in range(args.reps):
        for label, tree, extra in sides:
            command = [sys.executable, str(tree / "benchmarks" / "sampler_vs_generate.py"), "--setting", args.setting,
                       "--reps", "1", "--threads", str(args.threads), "--work", str(args.work), "--json", *extra]
            done = subprocess.run(command, capture_output=True, text=True, cwd=tree,
                                  env={**os.environ, "PYTHONPATH": str(tree)})
            if done.returncode != 0:
                sys.exit(f"{label}: {(done.stderr.strip().splitlines() or ['no output'])[-1]}")
            out = done.stdout
            runs[label].append(json.loads(out[out.index("{"):]))
            print(f"rep {rep + 1}/{args.reps} {label}: done", file=sys.stderr)
    rows = []
    for label, _, _ in sides:
        for temperature in ("0.0", "1.0"):
            for sampler in ("orbitctl", "generate"):
                rates = [r["temperatures"][temperature][sampler]["tokens_per_s"] for r in runs[label]]
                rows.append({"side": label, "temperature": float(temperature), "sampler": sampler,
                             "median_tokens_per_s": statistics.median(rates), "min": min(rates), "max": max(rates),
                             "greedy_rows_equal": runs[label][-1]["temperatures"][temperature].get("greedy_rows_equal")})
    base = {(r["temperature"], r["sampler"]): r["median_tokens_per_s"] for r in rows if r["side"] == sides[1][0]}
    for row in rows:
        row["vs_baseline"] = row["median_tokens_per_s"] / base[(row["temperature"], row["sampler"])]
    if args.json:
        print(json.dumps({"setting": args.setting, "reps": args.reps, "threads": args.threads, "rows": rows}, indent=2))
        return
    print(f"setting {args.setting}, {args.reps} alternating fresh processes per side, {args.threads} threads; "
          "completion tokens/s, median (min-max)")
    for row in rows:
        equal = "" if row["greedy_rows_equal"] is None else f"; greedy = generate in {row['greedy_rows_equal']} rows"
        print(f"{row['side']}: temperature {row['temperature']:g}, {row['sampler']}: {row['median_tokens_per_s']:.4g} "
              f"({row['min']:.4g}-{row['max']:.4g}), {row['vs_baseline']:.2f}x the baseline's{equal}")


if __name__ == "__main__":
    main()
