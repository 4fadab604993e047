"""orbitctl's AVX512-BF16 CPU kernels against PyTorch's, side by side in one process, on the shapes of the
representative setting (a 107 M llama: hidden 768, MLP 4096, 12 heads of 64).

    .venv/bin/python benchmarks/int4_kernels.py                # median (min-max) of 30 timings each
    .venv/bin/python benchmarks/int4_kernels.py --reps 100 --threads 1 --json

Rows: the INT4 matmul at 1-256 rows of activations (orbitctl's ``bf16_cpu.matmul``, PyTorch's
``_weight_int4pack_mm_for_cpu``, and a bf16 GEMM over the dense weight, which needs the dense copy), the
dequantization into a dense bf16 weight (one pass against the float32 route's five), and the one-position decode
attention over a cache's strided views (orbitctl's kernel against the torch path of ``decode_attention``).
Figures are GFLOP/s or milliseconds; every timing is the median and range of ``--reps`` runs after 3 warm-ups.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _timed(fn, reps: int) -> tuple[float, float, float]:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), min(times), max(times)


def _fmt(spread, scale: float, unit: str) -> str:
    median, low, high = spread
    # a rate: the fastest run gives the highest figure
    return (f"{scale / median:.1f} ({scale / high:.1f}-{scale / low:.1f}) {unit}" if unit == "GFLOP/s"
            else f"{median * 1e3:.3f} ({low * 1e3:.3f}-{high * 1e3:.3f}) ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    import torch

    from orbitctl.codec.formats import dequantize_int4, dequantize_int4_into, pack_int4, quantize_int4
    from orbitctl.kernels import bf16_cpu
    from orbitctl.kernels import decode_attention as attention_path
    from orbitctl.kernels.int4_kernel import Int4Pack
    from orbitctl.model.quant_linear import int4_workspace

    torch.set_num_threads(args.threads)
    why = bf16_cpu.cpu_unsupported()
    if why is not None or not bf16_cpu.available():
        sys.exit(f"orbitctl's bf16 kernels do not run here: {why or 'the library did not build (see the log)'}")
    g = torch.Generator().manual_seed(0)
    rows_out: list[dict] = []

    def row(what: str, ours, theirs, extra=None, flops: float = 0.0) -> None:
        unit = "GFLOP/s" if flops else "ms"
        scale = flops / 1e9
        entry = {"what": what, "orbitctl": ours, "pytorch": theirs, "bf16_gemm": extra,
                 "unit": unit, "speedup": theirs[0] / ours[0]}
        rows_out.append(entry)
        if not args.json:
            cells = [f"orbitctl {_fmt(ours, scale, unit)}", f"PyTorch {_fmt(theirs, scale, unit)}"]
            if extra is not None:
                cells.append(f"bf16 GEMM on the dense weight {_fmt(extra, scale, unit)}")
            print(f"{what}: " + ", ".join(cells) + f"; orbitctl/PyTorch {theirs[0] / ours[0]:.2f}x", flush=True)

    for out_f, in_f in ((4096, 768), (768, 4096), (768, 768)):
        codes, scale = quantize_int4(torch.randn(out_f, in_f, generator=g) * 0.02, 64)
        words = pack_int4(codes)
        ours = Int4Pack.of(words, scale)
        assert ours.kind == "bf16"
        packed, scales = bf16_cpu.pack(words, scale)
        aten = torch.ops.aten._weight_int4pack_mm_for_cpu
        aten_pack = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).add(8).contiguous(), 2)
        table = torch.stack([scale.t(), torch.zeros_like(scale.t())], -1).contiguous()
        dense = dequantize_int4(words, scale, in_f, torch.bfloat16)
        for rows in (1, 8, 32, 64, 256):
            x = torch.randn(rows, in_f, generator=g).to(torch.bfloat16)
            row(f"INT4 matmul {out_f}x{in_f}, {rows} rows",
                _timed(lambda: bf16_cpu.matmul(x, packed, scales, 64), args.reps),
                _timed(lambda: aten(x, aten_pack, 64, table), args.reps),
                _timed(lambda: x @ dense.t(), args.reps), flops=2.0 * rows * out_f * in_f)
        out = torch.empty(out_f, in_f, dtype=torch.bfloat16)
        codes_ws, values_ws, out_ws = int4_workspace((out_f, in_f), torch.bfloat16)
        row(f"dequantize {out_f}x{in_f} to bf16",
            _timed(lambda: bf16_cpu.dequantize_into(packed, scales, 64, out), args.reps),
            _timed(lambda: dequantize_int4_into(words, scale, codes_ws, values_ws, out_ws), args.reps))

    q = torch.randn(32, 12, 1, 64, generator=g).to(torch.bfloat16)
    for length in (64, 128, 512):
        k, v = (torch.randn(32, 12, length + 32, 64, generator=g).to(torch.bfloat16)[:, :, :length] for _ in range(2))
        mask = torch.ones(32, 1, 1, length, dtype=torch.bool)
        mask[:8, ..., : length // 4] = False  # left padding

        def torch_path():
            real = bf16_cpu.available
            bf16_cpu.available = lambda: False
            try:
                return attention_path.decode_attention(q, k, v, mask, 0.125)
            finally:
                bf16_cpu.available = real

        row(f"decode attention, 32 rows x 12 heads x {length} positions",
            _timed(lambda: bf16_cpu.decode_attention(q, k, v, mask, 0.125), args.reps), _timed(torch_path, args.reps))
    if args.json:
        print(json.dumps({"threads": args.threads, "reps": args.reps, "rows": rows_out}, indent=2))


if __name__ == "__main__":
    main()
