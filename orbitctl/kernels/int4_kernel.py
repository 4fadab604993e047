"""The fused INT4 weight-only matmul (``quant.kernel``): y = x W^T without a dense copy of W.

    pack = Int4Pack.of(layer.weight_packed, layer.weight_scale)   # once, at load
    y = pack.matmul(x)                                            # x [..., in] -> [..., out] in x's dtype

Dequantize-then-matmul (:meth:`QuantLinear.matmul_weight`) writes every weight as a dense matrix
before its matmul: at decode, a few rows of activations against the whole matrix, the dequantization
costs far more than the matmul (a 4096 x 768 INT4 weight: ~17 ms dequantized in float32 against
~0.5 ms fused for one row on an AVX2 EPYC). PyTorch's weight-only INT4 kernel for the CPU
(``aten._weight_int4pack_mm_for_cpu``) reads the 4-bit codes directly; its codes live in the
kernel's own tiled layout, repacked once from the checkpoint's (``aten._convert_weight_to_int4pack_for_cpu``).

What the kernel computes, and so what every path of a fused layer computes: the activations
rounded to bf16, W = (code - 8) x scale + 0 exactly (the checkpoint's symmetric codes, zero
point 0), accumulated in float32, the result rounded to bf16 and cast back to the activations'
dtype. The kernel takes bf16 scales: a layer whose stored scales are not bf16 (a GGUF Q4_0 weight's
fp16 scales) is split into two bf16 terms, scale = hi + lo exactly, and runs the kernel twice. Each
output row depends only on its own input row (bit for bit, whatever the number of rows), so the
infer path's one-token decode and the train path's full-sequence forward compute the same function.
That holds for the kernel. On a CPU with native bf16, whole sequences of weights exact in bf16 take a
bf16 GEMM over the dequantized weight instead (:func:`orbitctl.model.quant_linear.dense_gemm_applies`):
the same products summed in another order, and where the GEMM runs on AMX tiles its rows may also round
by the number of rows beside them (see :mod:`orbitctl.model.quant_linear`).

Only the forward is fused: the gradient of the input uses the dequantized weight (the reference
path), the weight being frozen. The float32 and float16 variants of the CPU kernel are scalar
loops (slower than dequantizing); only bf16 activations are fast, which is why the kernel takes
them whatever the compute dtype.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from orbitctl.plan.recompute import KERNEL_OPS

KERNEL_GROUPS = (32, 64, 128, 256)
"""Group sizes the CPU kernel takes."""


def ran_kernel(ops) -> bool:
    """Whether counted ``ops`` (op name -> count) include a fused INT4 kernel."""
    return any(name in ops for name in KERNEL_OPS)


def cuda_kernel_present() -> bool:
    """Whether this torch has the CUDA weight-only INT4 kernel (tinygemm) and its repacking op."""
    ops = torch.ops.aten
    return hasattr(ops, "_weight_int4pack_mm") and hasattr(ops, "_convert_weight_to_int4pack")


def inner_k_tiles(in_features: int) -> int:
    """The CUDA kernel's inner K tiles for ``in_features`` (it reads K in tiles of 16 x this): 8, 4 or 2."""
    return next((tiles for tiles in (8, 4, 2) if in_features % (16 * tiles) == 0), 0)


def cpu_kernel_present() -> bool:
    """Whether this torch has the CPU weight-only INT4 kernel and its repacking op."""
    ops = torch.ops.aten
    return hasattr(ops, "_weight_int4pack_mm_for_cpu") and hasattr(ops, "_convert_weight_to_int4pack_for_cpu")


def cpu_kernel_available() -> bool:
    """Whether the kernel is present and on this CPU computes every output row bit for bit alike whatever the rows
    beside it (:func:`rows_are_independent`): what ``quant.kernel: auto`` fuses on."""
    return cpu_kernel_present() and rows_are_independent("cpu")


def cuda_kernel_available() -> bool:
    """The same for the CUDA kernel on this process's GPU."""
    return cuda_kernel_present() and torch.cuda.is_available() and rows_are_independent("cuda")


@functools.lru_cache(maxsize=2)
def rows_are_independent(device_type: str = "cpu") -> bool:
    """Probe once per process and device type: the kernel's rows of a many-row product equal the rows computed alone
    and in small batches. The infer and train paths agree at the floor only if this holds (a kernel that switched to
    a blocked algorithm for many rows would round differently); where it does not, ``quant.kernel: auto`` dequantizes.

    It probes the kernel (:meth:`Int4Pack.matmul`), what the decode steps run. The bf16 GEMM that whole sequences
    take on a CPU with native bf16 is not probed: on AMX tiles oneDNN's blocking may round a row by the rows beside
    it, and dequantizing would not change that (the reference path runs the same GEMM). There the prefill and the
    train path's forward of the same tokens agree to a bf16 step per layer, not bit for bit, and verify-alignment's
    floor (measured beside every comparison) shows it."""
    from orbitctl.codec.formats import round_scales

    generator = torch.Generator().manual_seed(0)
    words = torch.randint(-2**31, 2**31 - 1, (256, 64), generator=generator, dtype=torch.int32)
    scale = torch.rand(256, 16, generator=generator) * 0.02 + 0.001
    x = torch.randn(600, 512, generator=generator).to(torch.bfloat16).to(device_type)
    # scales of any bf16 value, and exact ones (orbitctl's checkpoints; the AVX512-BF16 kernel takes those)
    for scales in (scale.to(torch.bfloat16), round_scales(scale)):
        pack = Int4Pack.of(words.to(device_type), scales.to(device_type))
        whole = pack.matmul(x)
        if not all(torch.equal(pack.matmul(x[start:start + rows]), whole[start:start + rows])
                   for start, rows in ((0, 1), (1, 3), (7, 16), (40, 64), (100, 500))):
            return False
    return True


def unsupported_shape(out_features: int, in_features: int, group_size: int, device_type: str = "cpu") -> str | None:
    """Why the kernel of ``device_type`` cannot take an [out, in] weight in groups of ``group_size`` (None: it can)."""
    if device_type == "cuda" and not inner_k_tiles(in_features):
        return f"{in_features} input features (the CUDA kernel reads them in tiles of 32)"
    if group_size not in KERNEL_GROUPS:
        return f"group size {group_size} (the kernel takes {', '.join(map(str, KERNEL_GROUPS))})"
    if out_features % 16:
        return f"{out_features} output features (the kernel packs rows in blocks of 16)"
    if in_features % group_size or in_features % 2:
        return f"{in_features} input features in groups of {group_size}"
    return None


def _scale_terms(scale: torch.Tensor) -> list[torch.Tensor]:
    """bf16 terms whose float32 sum is exactly ``scale`` (one term for bf16 scales, two for fp16)."""
    exact = scale.to(torch.float32)
    hi = exact.to(torch.bfloat16)
    lo = (exact - hi.to(torch.float32)).to(torch.bfloat16)
    if not torch.equal(hi.to(torch.float32) + lo.to(torch.float32), exact):
        raise ValueError("INT4 scales that two bf16 terms do not represent exactly (float32 scales)")
    return [hi] if not lo.any() else [hi, lo]


@dataclass
class Int4Pack:
    """One INT4 weight in the fused kernel's layout. ``kind`` says which kernel: ``"aten"`` (PyTorch's, on the
    CPU or tinygemm on CUDA: codes [out, in/2] uint8 and, per scale term, the kernel's [in/group, out, 2] bf16
    (scale, zero point 0) table) or ``"bf16"`` (:mod:`orbitctl.kernels.bf16_cpu`, on a CPU with AVX512-BF16 for
    weights exact in bf16: its codes [out, in/2] uint8 and one float32 [out, in/group] scale table)."""

    packed: torch.Tensor
    scales_and_zeros: list[torch.Tensor]
    group_size: int
    in_features: int
    out_features: int
    kind: str = "aten"

    @classmethod
    def of(cls, weight_packed: torch.Tensor, weight_scale: torch.Tensor) -> "Int4Pack":
        """Repack a checkpoint INT4 weight (int32 words [out, in/8], scales [out, in/group])."""
        from orbitctl.codec.formats import scales_exact_in_bf16, unpack_int4
        from orbitctl.kernels import bf16_cpu

        out_features, words = weight_packed.shape
        in_features = words * 8
        group_size = in_features // weight_scale.shape[-1]
        device = weight_packed.device
        why = unsupported_shape(out_features, in_features, group_size, device.type)
        if why is not None:
            raise ValueError(f"the fused INT4 kernel cannot take this weight: {why}")
        if (device.type == "cpu" and bf16_cpu.available() and scales_exact_in_bf16(weight_scale)
                and bf16_cpu.unsupported_shape(out_features, in_features, group_size) is None):
            packed, scales = bf16_cpu.pack(weight_packed, weight_scale)
            return cls(packed, [scales], group_size, in_features, out_features, kind="bf16")
        with torch.no_grad():
            codes = unpack_int4(weight_packed, in_features).add_(8)  # unsigned 0..15, as the kernel reads them
            if device.type == "cuda":  # tinygemm: two codes a byte, the even one in the high nibble
                pairs = ((codes[:, ::2] << 4) | codes[:, 1::2]).to(torch.uint8)
                packed = torch.ops.aten._convert_weight_to_int4pack(pairs.contiguous(), inner_k_tiles(in_features))
                del pairs
            else:
                packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.contiguous(), 2)
            del codes
            tables = []
            for term in _scale_terms(weight_scale):
                table = torch.zeros(in_features // group_size, out_features, 2, dtype=torch.bfloat16, device=device)
                table[..., 0] = term.t()
                tables.append(table.contiguous())
        return cls(packed, tables, group_size, in_features, out_features)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, *self.scales_and_zeros))

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T for x [..., in]: the result in x's dtype (bf16-rounded, see the module's docstring).

        Numerics: x rounded to bf16, W = (code - 8) x scale exactly (fp16 scales as two bf16 terms, their results
        summed in float32), accumulated in float32, rounded to bf16, cast to x's dtype. Rows independent (each output
        row depends only on its input row, bit for bit, whatever the rows beside it) where
        :func:`rows_are_independent` says so. The reference: the dequantized weight in bf16 times the bf16 x
        through a float32-accumulating matmul, the same products summed in another order."""
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16)
        if self.kind == "bf16":
            from orbitctl.kernels import bf16_cpu

            out = bf16_cpu.matmul(rows, self.packed, self.scales_and_zeros[0], self.group_size)
            return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        kernel = torch.ops.aten._weight_int4pack_mm if x.device.type == "cuda" else torch.ops.aten._weight_int4pack_mm_for_cpu
        out = kernel(rows, self.packed, self.group_size, self.scales_and_zeros[0])
        if len(self.scales_and_zeros) > 1:
            out = out.to(torch.float32) + kernel(rows, self.packed, self.group_size, self.scales_and_zeros[1])
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
