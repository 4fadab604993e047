"""What serving the demo policy in another format would cost: verify-alignment for every --infer-quant.

    .venv/bin/python benchmarks/alignment_whatif.py                     # the tiny demo, its run's adapter
    .venv/bin/python benchmarks/alignment_whatif.py --profile P.yaml --prompts 64

Prints one row per infer-path format (the trainer keeps the profile's format) with the gate
metrics, the first layer where the hidden states part, and the wall time; not a test.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default=str(ROOT / "profiles" / "tiny-cpu.yaml"))
    parser.add_argument("--prompts", type=int, default=100)
    args = parser.parse_args()

    from orbitctl.align.selfcheck import INFER_FORMATS
    from orbitctl.align.api import verify_alignment
    from orbitctl.profile import load_profile

    profile = load_profile(args.profile, [f"alignment.num_prompts={args.prompts}"])
    header = (f"{'infer path':<22}{'tokens':>7}{'JS mean':>10}{'JS p99':>10}{'L1 mean':>9}{'top1':>7}"
              f"{'top5':>7}{'k3 mean':>10}{'|dp| mean':>10}{'jump':>10}{'verdict':>8}{'s':>6}")
    print(f"trainer: {profile.quant.format} ({args.profile}), sampling temperature {profile.rollout.temperature}")
    print(header)
    for fmt in (None, *INFER_FORMATS):
        start = time.perf_counter()
        report = verify_alignment(profile, infer_quant=fmt, per_layer=True)
        s, jump = report.summary, report.source.get("first_jump")
        label = "same weights" if fmt is None else f"{fmt} copy"
        print(f"{label:<22}{report.tokens:>7}{s['js']['mean']:>10.2e}{s['js']['p99']:>10.2e}"
              f"{s['logsoftmax_l1']['mean']:>9.4f}{s['top1_agree']['mean']:>7.3f}{s['topk_overlap']['mean']:>7.3f}"
              f"{s['k3']['mean']:>10.2e}{s['sampled_dp_abs']['mean']:>10.2e}{(jump or {}).get('name', '-'):>10}"
              f"{report.verdict:>8}{time.perf_counter() - start:>6.1f}")
    print(f"adapter: {report.source['adapter']}")


if __name__ == "__main__":
    main()
