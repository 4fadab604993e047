"""Which bf16 numbers this CPU's kernels give, and how fast: run it once plain and once capped.

    .venv/bin/python benchmarks/cpu_kernels.py
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 .venv/bin/python benchmarks/cpu_kernels.py

Prints torch's kernel capability, a digest of bf16 ``F.linear`` outputs over a few shapes (two
runs whose digests differ computed different bf16 numbers), whether one row at a time gives the
same bits as all rows at once (what KV-cache decoding against a full forward depends on), and
the median time of a 256x64x256 matmul in bf16 and fp32. Not a test.
"""

from __future__ import annotations

import hashlib
import statistics
import time

SHAPES = [(256, 64, 256), (16, 64, 100), (33, 172, 64), (128, 4096, 128)]


def main() -> None:
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    digest = hashlib.sha1()
    print(f"torch {torch.__version__}, kernel capability {torch.backends.cpu.get_cpu_capability()}, "
          f"{torch.get_num_threads()} threads")
    for m, k, n in SHAPES:
        x, w = torch.randn(m, k).bfloat16(), torch.randn(n, k).bfloat16()
        full = F.linear(x, w)
        rows = torch.cat([F.linear(x[i:i + 1], w) for i in range(m)])
        digest.update(full.float().numpy().tobytes())
        print(f"  bf16 linear {m}x{k} by {k}x{n}: one row at a time == all rows: {torch.equal(full, rows)}")
    print(f"bf16 output digest: {digest.hexdigest()[:16]}")
    for dtype in (torch.bfloat16, torch.float32):
        a, b = torch.randn(256, 64).to(dtype), torch.randn(64, 256).to(dtype)
        times = []
        for _ in range(30):
            start = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - start)
        print(f"256x64x256 matmul in {str(dtype).removeprefix('torch.')}: {statistics.median(times) * 1e6:.0f} us")


if __name__ == "__main__":
    main()
