"""Continuous batching against fixed batches: the same rows, the same completion lengths, decoded both ways.

    .venv/bin/python benchmarks/continuous_batching.py                          # the representative setting
    .venv/bin/python benchmarks/continuous_batching.py --set quant.format=int4 --rows 64 --slots 16 --reps 3 --json

The policy is the setting's (its base with LoRA attached, eval mode); the rows are ``--rows`` prompts of the
setting (its first prompts, ``rl.group_size`` copies each). Completion lengths come from a seeded distribution
(``--lengths``: ``uniform`` over 1..max_new_tokens, or ``geometric`` with mean max_new_tokens / 4, capped), and both
sides decode them teacher-forced (the tokens drawn once, uniformly, and fed through the same KV-cache decode a
sampled rollout runs, so the work is a rollout's and the lengths are known): ``chunks`` is ``Policy.sample`` over
fixed batches of ``--slots`` rows, each decoding until its longest row ends (what ``rollout.continuous_batching:
false`` runs); ``stream`` is ``Policy.sample_stream`` with ``--slots`` slots, a finished row's slot refilled at the
next step. Reported: kept completion tokens per second, median and range over ``--reps`` alternating runs after a
warm-up of each, and the model forwards each side ran.
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


def lengths_of(kind: str, rows: int, most: int, seed: int) -> list[int]:
    """Seeded completion lengths in 1..``most``: uniform, or geometric with mean ``most / 4`` (capped at ``most``)."""
    import random

    draw = random.Random(seed)
    if kind == "uniform":
        return [draw.randint(1, most) for _ in range(rows)]
    p = 4.0 / most
    out = []
    for _ in range(rows):
        n = 1
        while n < most and draw.random() > p:
            n += 1
        out.append(n)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    settings.add_policy_arguments(parser)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--lengths", choices=["uniform", "geometric"], default="uniform")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    import torch

    profile, split, policy = settings.eval_policy(args)
    group = profile.rl.group_size
    items = [it for it in split.train for _ in range(group)][:args.rows]
    ids, mask = policy.encode_prompts([it.prompt for it in items])
    new = profile.rollout.max_new_tokens
    lengths = lengths_of(args.lengths, len(items), new, profile.run.seed)
    vocab = int(policy.model.config.vocab_size)
    generator = torch.Generator().manual_seed(profile.run.seed)
    completion = torch.randint(3, vocab, (len(items), new), generator=generator)
    keep = (torch.arange(new)[None, :] < torch.tensor(lengths)[:, None]).long()
    forwards = []
    handle = policy.model.register_forward_pre_hook(lambda *a, **k: forwards.append(1), with_kwargs=True)
    kw = dict(max_new_tokens=0, temperature=1.0, top_p=1.0, generator=None)

    def chunks():
        for start in range(0, len(items), args.slots):
            rows = slice(start, start + args.slots)
            policy.sample(ids[rows], mask[rows], forced=(completion[rows], keep[rows]), **kw)

    def stream():
        policy.sample_stream(ids, mask, slots=args.slots, forced=(completion, keep), **kw)

    sides = {"chunks": chunks, "stream": stream}
    rates: dict[str, list[float]] = {name: [] for name in sides}
    calls: dict[str, int] = {}
    for rep in range(args.reps + 1):
        for name, fn in sides.items():
            forwards.clear()
            start = time.perf_counter()
            fn()
            seconds = time.perf_counter() - start
            calls[name] = len(forwards)
            if rep:  # the first run of each warms up
                rates[name].append(sum(lengths) / seconds)
    handle.remove()
    report = {"setting": args.setting, "sets": args.sets, "rows": len(items), "slots": args.slots,
              "lengths": args.lengths, "mean_length": statistics.mean(lengths), "max_new_tokens": new,
              "threads": args.threads, "reps": args.reps,
              "sides": {name: {"tokens_per_s": statistics.median(r), "min": min(r), "max": max(r),
                               "forwards": calls[name]} for name, r in rates.items()}}
    report["stream_over_chunks"] = report["sides"]["stream"]["tokens_per_s"] / report["sides"]["chunks"]["tokens_per_s"]
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"setting {args.setting} {' '.join(args.sets)}: {len(items)} rows, {args.slots} slots, {args.lengths} lengths "
          f"(mean {report['mean_length']:.1f} of at most {new} tokens), {args.threads} threads; kept completion "
          f"tokens/s, median (min-max) of {args.reps}")
    for name, side in report["sides"].items():
        print(f"{name}: {side['tokens_per_s']:.4g} ({side['min']:.4g}-{side['max']:.4g}), {side['forwards']} forwards")
    print(f"stream / chunks: {report['stream_over_chunks']:.2f}x")


if __name__ == "__main__":
    main()
