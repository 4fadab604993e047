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


def compare(policy, prompts: list[str], lengths: list[int], slots: int, reps: int, seed: int) -> dict:
    """Decode ``prompts`` teacher-forced to ``lengths`` (seeded tokens) both ways, ``reps`` alternating runs after a
    warm-up of each: ``{"chunks"|"stream": {tokens_per_s, min, max, forwards, logprobs}}``, tokens/s of kept tokens,
    the model forwards of one run and the last run's log-probs of the kept tokens."""
    import torch

    ids, mask = policy.encode_prompts(prompts)
    new = max(lengths)
    generator = torch.Generator().manual_seed(seed)
    completion = torch.randint(3, int(policy.model.config.vocab_size), (len(prompts), new), generator=generator)
    keep = (torch.arange(new)[None, :] < torch.tensor(lengths)[:, None]).long()
    forwards = []
    handle = policy.model.register_forward_pre_hook(lambda *a, **k: forwards.append(1), with_kwargs=True)
    kw = dict(max_new_tokens=0, temperature=1.0, top_p=1.0, generator=None)

    def chunks():  # eager, like the stream (static=False: no CUDA graph on a GPU)
        from orbitctl.rl.rollout import _pad_right

        return _pad_right([policy.sample(ids[r], mask[r], forced=(completion[r], keep[r]), static=False, **kw).logprobs
                           for r in (slice(s, s + slots) for s in range(0, len(prompts), slots))], 0.0)

    def stream():
        return policy.sample_stream(ids, mask, slots=slots, forced=(completion, keep), **kw).logprobs

    rates: dict[str, list[float]] = {"chunks": [], "stream": []}
    out: dict[str, dict] = {}
    try:
        for rep in range(reps + 1):
            for name, fn in (("chunks", chunks), ("stream", stream)):
                forwards.clear()
                start = time.perf_counter()
                logprobs = fn()
                seconds = time.perf_counter() - start
                if rep:  # the first run of each warms up
                    rates[name].append(sum(lengths) / seconds)
                out[name] = {"forwards": len(forwards), "logprobs": logprobs[keep.bool()].tolist()}
    finally:
        handle.remove()
    for name, r in rates.items():
        out[name].update(tokens_per_s=statistics.median(r), min=min(r), max=max(r))
    return out


def device_rows(profile_path: Path, smoke: bool) -> list[tuple[str, str, str]]:
    """Rows for a GPU run: the profile's policy (on its device) streams 4 prompts x its group through a
    quarter of the rows' slots against fixed batches, uniform lengths up to max_new_tokens; ok where the kept
    log-probs agree within a few roundings of the compute dtype (the same function, positions left-padded)."""
    import torch

    from orbitctl.builder import load_policy, prepare_frozen_base
    from orbitctl.data.prompts import load_prompts
    from orbitctl.profile import load_profile

    profile = load_profile(profile_path)
    split = load_prompts(profile.data, profile.run.seed)
    policy = load_policy(profile, prepare_frozen_base(profile, split.warm_task))
    prompts = [it.prompt for it in split.train[:4] for _ in range(profile.rl.group_size)]
    lengths = lengths_of("uniform", len(prompts), min(profile.rollout.max_new_tokens, 8 if smoke else 64),
                         profile.run.seed)
    sides = compare(policy, prompts, lengths, max(1, len(prompts) // 4), 1 if smoke else 3, profile.run.seed)
    chunks, stream = torch.tensor(sides["chunks"]["logprobs"]), torch.tensor(sides["stream"]["logprobs"])
    dtype = policy.model.get_input_embeddings().weight.dtype
    bound = 64 * torch.finfo(dtype).eps * (1 + float(chunks.abs().max()))
    diff = float((stream - chunks).abs().max())
    return [("continuous batching", f"{len(prompts)} rows in {max(1, len(prompts) // 4)} slots: stream "
             f"{sides['stream']['tokens_per_s']:.0f} tok/s ({sides['stream']['forwards']} forwards) against fixed "
             f"batches {sides['chunks']['tokens_per_s']:.0f} ({sides['chunks']['forwards']}); log-prob difference "
             f"{diff:.2e} (bound {bound:.2e})", "ok" if diff <= bound else "FAIL")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    settings.add_policy_arguments(parser)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--lengths", choices=["uniform", "geometric"], default="uniform")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    profile, split, policy = settings.eval_policy(args)
    group = profile.rl.group_size
    items = [it for it in split.train for _ in range(group)][:args.rows]
    lengths = lengths_of(args.lengths, len(items), profile.rollout.max_new_tokens, profile.run.seed)
    sides = compare(policy, [it.prompt for it in items], lengths, args.slots, args.reps, profile.run.seed)
    new = profile.rollout.max_new_tokens
    report = {"setting": args.setting, "sets": args.sets, "rows": len(items), "slots": args.slots,
              "lengths": args.lengths, "mean_length": statistics.mean(lengths), "max_new_tokens": new,
              "threads": args.threads, "reps": args.reps,
              "sides": sides}
    report["stream_over_chunks"] = report["sides"]["stream"]["tokens_per_s"] / report["sides"]["chunks"]["tokens_per_s"]
    for side in sides.values():
        del side["logprobs"]
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
