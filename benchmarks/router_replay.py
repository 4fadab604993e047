"""Router replay (R3) on the tiny MoE: how much of the train/infer mismatch is routing, and what replay removes.

    .venv/bin/python benchmarks/router_replay.py                   # fp8 KV on the infer path, 3 seeds
    .venv/bin/python benchmarks/router_replay.py --kv-dtype bf16   # the same paths: agreement 1, nothing to remove
    .venv/bin/python benchmarks/router_replay.py --prompts 600 --seeds 5 --json

The infer path of ``profiles/tiny-moe-cpu.yaml`` (one process) samples ``--prompts`` completions of the
task's prompts (temperature 1) through a KV cache in ``--kv-dtype``; the train path (the full-sequence
forward the update runs) then recomputes them twice: routing each token itself, and replaying the
experts the infer path recorded. Per seed it reports the routing agreement (share of recorded token x
MoE layer slots with the same top-k set on both paths), and the mean JS divergence and sampled-token
|d logp| between the paths, over all completion tokens and over the tokens a flip reaches (those after
a token whose experts differed, in the same completion). Printed: median and range over the seeds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _js(a_logits, b_logits):
    import torch

    from orbitctl.distances import js_divergence

    return js_divergence(torch.log_softmax(a_logits.double(), -1), torch.log_softmax(b_logits.double(), -1))


def _dlogp(a_logits, b_logits, ids):
    import torch

    pick = ids[..., None]
    a = torch.log_softmax(a_logits.double(), -1).gather(-1, pick).squeeze(-1)
    b = torch.log_softmax(b_logits.double(), -1).gather(-1, pick).squeeze(-1)
    return (a - b).abs()


def measure(policy, items, seed: int) -> dict:
    import torch

    from orbitctl.model.router_replay import same_set

    ids, mask = policy.encode_prompts([item.prompt for item in items])
    s = policy.sample(ids, mask, max_new_tokens=8, temperature=1.0, top_p=1.0,
                      generator=torch.Generator().manual_seed(seed), keep_logits=True)
    batch, prompt = s.completion_ids.shape[0], s.prompt_ids.shape[1]
    out = {}
    for replay in (False, True):
        with torch.no_grad():
            logits = policy.completion_logits(s.prompt_ids, s.prompt_mask, s.completion_ids, s.completion_mask,
                                              routes=s.routes, replay=replay).float()
        if not replay:
            agreement = policy.routing_agreement(s.routes, prompt, s.completion_mask)
            flipped = torch.zeros(s.completion_ids.shape, dtype=torch.bool)
            for layer, own in enumerate(policy.routing.own):
                recorded = s.routes[:, :, layer].long()
                mine = own.reshape(batch, -1, recorded.shape[-1])[:, prompt:].cpu()
                flipped |= (recorded >= 0).all(-1) & ~same_set(mine, recorded)
            reached = torch.zeros_like(flipped)
            reached[:, 1:] = flipped.long().cumsum(1)[:, :-1] > 0
        out[replay] = logits
    keep = s.completion_mask.bool()
    reached &= keep
    row = {"seed": seed, "tokens": int(keep.sum()), "reached": int(reached.sum()),
           "agreement": agreement.overall, "agreement_per_layer": agreement.per_layer()}
    for replay, name in ((False, "without"), (True, "with")):
        js = _js(out[replay], s.logits)
        dlogp = _dlogp(out[replay], s.logits, s.completion_ids)
        row[f"js_{name}"] = float(js[keep].mean())
        row[f"dlogp_{name}"] = float(dlogp[keep].mean())
        row[f"js_reached_{name}"] = float(js[reached].mean()) if reached.any() else None
        row[f"dlogp_reached_{name}"] = float(dlogp[reached].mean()) if reached.any() else None
    return row


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=600)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--kv-dtype", default="fp8", choices=("fp8", "bf16"))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    import tempfile

    from orbitctl.builder import load_policy, prepare_frozen_base
    from orbitctl.data.prompts import load_prompts
    from orbitctl.profile import load_profile

    with tempfile.TemporaryDirectory() as run:
        profile = load_profile(ROOT / "profiles" / "tiny-moe-cpu.yaml",
                               ["memory.expert_parallel=1", "hardware.gpus_per_node=1",
                                f"rollout.kv_dtype={args.kv_dtype}", f"run.dir={run}"])
        split = load_prompts(profile.data, profile.run.seed)
        policy = load_policy(profile, prepare_frozen_base(profile, split.warm_task))
        items = (split.train + split.eval)[:args.prompts]
        rows = [measure(policy, items, seed) for seed in range(args.seeds)]
    if args.json:
        json.dump({"kv_dtype": args.kv_dtype, "prompts": len(items), "rows": rows}, sys.stdout, indent=1)
        print()
        return

    def spread(key: str, fmt: str = ".3g") -> str:
        values = [r[key] for r in rows if r[key] is not None]
        if not values:
            return "n/a"
        return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"

    print(f"tiny MoE, infer path KV cache {args.kv_dtype}, {len(items)} prompts x {args.seeds} seeds; "
          f"median (range) over the seeds")
    print(f"  completion tokens {spread('tokens', 'd')}, reached by a routing flip {spread('reached', 'd')}")
    print(f"  routing agreement {spread('agreement', '.4f')}")
    print(f"  {'':32} {'without replay':>26} {'with replay':>26}")
    for label, key in (("JS, all tokens", "js"), ("|d logp|, all tokens", "dlogp"),
                       ("JS, tokens a flip reaches", "js_reached"), ("|d logp|, tokens a flip reaches", "dlogp_reached")):
        print(f"  {label:32} {spread(key + '_without'):>26} {spread(key + '_with'):>26}")


if __name__ == "__main__":
    main()
