"""The kernel floor on this machine, and how far planted differences stand above it.

    .venv/bin/python benchmarks/alignment_floor.py
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 .venv/bin/python benchmarks/alignment_floor.py

Runs verify-alignment on the tiny demo profile (fresh adapters unless the run has one) as the
same model on both paths (the floor itself), a separate copy in the same format, an fp4 copy,
and copies with one layer's norm perturbed, and prints for each the comparison, the floor
measured beside it, their ratio, and the first layer named. The CPU and torch's kernel
capability head the output, so figures from two machines can be told apart. Not a test.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default=str(ROOT / "profiles" / "tiny-cpu.yaml"))
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="profile override")
    args = parser.parse_args()

    import torch

    from orbitctl.align.selfcheck import Perturbation
    from orbitctl.align.api import verify_alignment
    from orbitctl.profile import load_profile

    profile = load_profile(args.profile, [f"alignment.num_prompts={args.prompts}", *args.set])
    print(f"CPU: {cpu_name()}; torch {torch.__version__}, kernel capability {torch.backends.cpu.get_cpu_capability()}")
    cases = [("same model", {}), (f"{profile.quant.format} copy", {"infer_quant": profile.quant.format}),
             ("fp4 copy", {"infer_quant": "fp4"}), ("layer 0 perturbed", {"perturb": Perturbation(0, 1.0)}),
             ("layer 1 perturbed", {"perturb": Perturbation(1, 1.0)})]
    print(f"{'infer path':<19}{'dtype':>9}{'JS mean':>10}{'floor':>10}{'x floor':>9}{'JS max':>10}{'floor':>10}"
          f"{'|dlogp|max':>11}{'floor':>10}{'1ulp JS':>10}{'jump':>10}{'s':>6}")
    for label, kwargs in cases:
        start = time.perf_counter()
        report = verify_alignment(profile, per_layer=True, **kwargs)
        s, f = report.summary, report.floor
        times = report.floor_times()["js"]
        jump = report.source.get("first_jump")
        print(f"{label:<19}{f.compute_dtype:>9}{s['js']['mean']:>10.2e}{f.summary['js']['mean']:>10.2e}"
              f"{times:>9.3g}{s['js']['max']:>10.2e}{f.summary['js']['max']:>10.2e}"
              f"{s['sampled_dlogp_abs']['max']:>11.2e}{f.summary['sampled_dlogp_abs']['max']:>10.2e}"
              f"{f.bound()['js']:>10.2e}{(jump or {}).get('name', '-'):>10}{time.perf_counter() - start:>6.1f}")
        ratios = {m: report.floor.times(s, m) for m in ("js", "logsoftmax_l1", "k3", "sampled_dp_abs",
                                                         "sampled_dlogp_abs", "kl_train_infer")}
        print(f"{'':<19}mean / floor mean: " + ", ".join(f"{m} {v:.3g}" for m, v in ratios.items()))
        if f.layers is not None:
            print(f"{'':<19}per-layer error {[f'{e.rel_error:.2e}' for e in report.layers]}; "
                  f"floor {[f'{x:.2e}' for x in f.layers]}")


if __name__ == "__main__":
    main()
