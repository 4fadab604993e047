"""One training step timed, and this machine's matmul and memory rates: what `orbitctl plan --measure-time` measures.

    python -m orbitctl.rl.steptime PROFILE.yaml RUN_DIR M K N     # prints one JSON line

Measures the matmul throughput of an [M, K] x [K, N] GEMM (the model's own update shape) in the
profile's compute dtype and the memory bandwidth of a 256 MiB copy, each the best of five runs,
then runs one step of ``train`` in RUN_DIR and reads the step's ``time_rollout_s`` and
``time_update_s`` from metrics.jsonl. The planner runs this as a child process: it sits below
the trainer and never imports it.
"""

from __future__ import annotations

import json
import sys
import time

def _best_of(fn, repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def machine_rates(torch, dtype, shape: tuple[int, int, int]) -> tuple[float, float]:
    """(FLOP/s of an [m, k] x [k, n] matmul in ``dtype``, memory bytes/s of a 256 MiB copy), each the best of
    five runs; ``shape`` is the model's own (m, k, n), so the rate is this machine's at this width."""
    m, k, n = shape
    a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
    torch.matmul(a, b)
    flops = 2 * m * k * n / _best_of(lambda: torch.matmul(a, b))
    src = torch.empty(64 * 2 ** 20, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    dst.copy_(src)
    bandwidth = 2 * src.numel() * 4 / _best_of(lambda: dst.copy_(src))  # read + write
    return flops, bandwidth


def main(argv: list[str] | None = None) -> int:
    import torch

    from orbitctl.model.cpu_dtype import torch_dtype
    from orbitctl.profile import load_profile
    from orbitctl.rl.api import train
    from orbitctl.rundir import RunDir

    path, run_dir, *shape = argv if argv is not None else sys.argv[1:]
    profile = load_profile(path, [f"run.dir={run_dir}", "rl.steps=1", "run.eval_every=1000000",
                                  "run.save_every=1000000"])
    dtype = torch_dtype(profile.quant.compute_dtype)
    flops, bandwidth = machine_rates(torch, dtype, tuple(int(x) for x in shape))
    train(profile, fresh=True, steps=1)
    records = [json.loads(line) for line in RunDir(run_dir).metrics.read_text().splitlines() if line.strip()]
    # one record per optimizer step: the rollout is timed on the first, every update on its own
    print(json.dumps({"flops_per_s": flops, "bytes_per_s": bandwidth, "dtype": str(dtype).removeprefix("torch."),
                      "rollout_s": float(records[0]["time_rollout_s"]),
                      "policy_update_s": sum(float(r["time_update_s"]) for r in records)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
