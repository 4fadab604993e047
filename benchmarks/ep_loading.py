"""Sharded loading under expert parallelism: each rank's resident-memory rise while it loads a large INT4 MoE.

    python benchmarks/ep_loading.py                      # a >= 2 GB checkpoint (written once, reused)
    python benchmarks/ep_loading.py --gb 0.3 --out /tmp/moe

Writes a DeepSeek-V3-type INT4 checkpoint (routed experts >= 90% of it; orbitctl.model.synthetic),
then loads it in fresh processes: one rank holding everything, and two ranks with expert
parallelism 2, each reading only its experts' byte ranges. Prints each rank's peak RSS rise over
its size before the load, as a share of the checkpoint's bytes.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path


def main() -> None:
    from orbitctl.model.synthetic import checkpoint_bytes, load_rss, write_int4_moe

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=2.1, help="checkpoint size to write, in GB (1e9 bytes)")
    parser.add_argument("--out", default="/tmp/orbitctl-ep-loading", help="where the checkpoint is written")
    args = parser.parse_args()
    # hidden 2048, expert width 1024: one expert is 3 x 2048 x 1024 INT4 weights, ~3.4 MB with its scales
    experts, per_expert = 96, 3 * 2048 * 1024 * (0.5 + 2 / 32)
    layers = max(1, round(args.gb * 1e9 * 0.97 / (experts * per_expert)))
    out = Path(args.out) / f"h2048-e{experts}-l{layers}"
    if not (out / "config.json").exists():
        start = time.perf_counter()
        write_int4_moe(out, hidden=2048, experts=experts, expert_width=1024, moe_layers=layers, vocab=4096)
        print(f"wrote {out} in {time.perf_counter() - start:.0f} s")
    total, routed = checkpoint_bytes(out)
    print(f"checkpoint {total / 1e9:.2f} GB, routed experts {routed / total:.1%} of it")
    for world in (1, 2):
        start = time.perf_counter()
        ranks = load_rss(out, world)
        seconds = time.perf_counter() - start
        for rank, r in enumerate(ranks):
            print(f"{'EP ' + str(world) if world > 1 else 'one rank'}, rank {rank}: peak RSS rise "
                  f"{r['rss_rise'] / 1e9:.2f} GB = {r['rss_rise'] / total:.2f} x checkpoint; model holds "
                  f"{r['model_bytes'] / 1e9:.2f} GB ({seconds:.0f} s for all ranks)")


if __name__ == "__main__":
    main()
