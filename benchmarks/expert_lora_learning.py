"""Does adapting the routed experts learn more than attention alone? The tiny MoE, same steps and seeds.

    python benchmarks/expert_lora_learning.py                  # 150 steps each (profiles/tiny-moe-cpu.yaml)
    python benchmarks/expert_lora_learning.py --steps 60 --runs attention per-expert

Each run is `orbitctl train profiles/tiny-moe-cpu.yaml` with one change: ``attention`` adapts the
attention projections only; ``attention+shared`` is the profile as shipped (attention, the dense
layer and the shared expert); ``shared`` / ``shared-outer`` / ``per-expert`` add the routed experts'
own adapters (``adapter.experts``) to attention. Every run uses the profile's 2 CPU ranks with
expert parallelism 2 and the same seed, so all start from the same base, prompts and draws.
Printed: held-out greedy accuracy before and after, trainable parameters, wall time.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from phase_memory import ROOT, profile_file
RUNS = {
    "attention": {"adapter.targets": "attention"},
    "attention+shared": {},
    "shared": {"adapter.targets": "attention", "adapter.experts": "shared"},
    "shared-outer": {"adapter.targets": "attention", "adapter.experts": "shared-outer"},
    "per-expert": {"adapter.targets": "attention", "adapter.experts": "per-expert"},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--runs", nargs="+", default=["attention", "attention+shared", "shared", "per-expert"],
                        choices=sorted(RUNS))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.runs:
            sets = {**RUNS[name], "rl.steps": args.steps, "run.dir": str(Path(tmp) / name / "run")}
            (Path(tmp) / name).mkdir()
            start = time.perf_counter()
            done = subprocess.run([sys.executable, "-m", "orbitctl.cli.app", "train",
                                   str(profile_file(Path(tmp) / name, sets)), "--json", "--fresh"],
                                  capture_output=True, text=True, cwd=ROOT)
            if done.returncode:
                print(f"{name}: exit {done.returncode}\n{done.stderr[-2000:]}", file=sys.stderr)
                continue
            result = json.loads(done.stdout)
            print(f"{name:<18} held-out {result['eval_before']:.1%} -> {result['eval_after']:.1%}  "
                  f"{time.perf_counter() - start:6.0f} s  {result['adapter']}", flush=True)


if __name__ == "__main__":
    main()
