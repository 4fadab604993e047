"""Frozen INT4 / FP8 linear layers that dequantize with plain torch ops on every forward.

No custom kernels: the same code runs on CPU, on CUDA, under ``FakeTensorMode`` (the memory
planner's shadow runs) and under ``torch.compile``. Parameter names equal the checkpoint's
tensor names (``weight_packed``/``weight_scale``/``weight_shape`` for INT4,
``weight``/``weight_scale_inv`` for FP8), so ``state_dict()`` round-trips to the file
layout. The quantized data are frozen ``nn.Parameter``s rather than buffers so that ZeRO-3
shards them like any other weight. ``weight_scale`` is bf16 as built here and takes the dtype
of the tensor loaded into it (fp16: the exact scales of a GGUF Q4_0 weight); the dequantizers
compute in float32 from either.

Routed experts: transformers 5 holds them fused ([E, 2I, H]); :class:`QuantExperts` keeps one
:class:`QuantLinear` per expert and projection instead (named like the checkpoint,
``experts.N.gate_proj``) and dequantizes only the experts a batch routes to, one at a time.

On the CPU an INT4 weight is dequantized for its matmul into a per-thread workspace
(:func:`int4_workspace`: int32 codes, float32 values and the result in the compute dtype, sized by
the largest matrix seen) instead of fresh tensors: the allocating path builds six multi-MiB
temporaries per expert per forward, which glibc's allocator keeps once freed (the resident set of
a training rank grew by about 0.8 GiB over one policy update of a 1 GB MoE) and which cost a page
fault per 4 KiB each time (the in-place path is about 4x faster). The workspace is only ever read
by the matmul that follows; autograd never saves it (the backward dequantizes again).

``quant.kernel: fused`` (:mod:`orbitctl.kernels.int4_kernel`): an INT4 layer given a kernel pack
(:meth:`QuantLinear.use_fused_kernel`) runs its forward through PyTorch's weight-only INT4 kernel, in
every path (rollout, train, reference), and only the backward dequantizes.

Whole sequences on a CPU with native bf16 (:func:`dense_gemm_applies`): there the kernel multiplies in float32
(about 170 GFLOP/s on two AVX512-BF16 cores) where a bf16 GEMM runs at 330-430. A layer whose weights are exact in
bf16 (scales of at most :data:`~orbitctl.codec.formats.SCALE_BITS` significant bits, what ``orbitctl quantize``
writes) then dequantizes its weight once into the workspace and runs one bf16 GEMM: the same exact products of
the bf16-rounded activations and weights, accumulated in float32 and rounded once to bf16, as the kernel computes
them, in another order. A decode step (a few rows) keeps the kernel: there the dequantization costs more than
the GEMM saves.

On such a CPU (AVX512-BF16, uncapped, the library built) a layer exact in bf16 holds orbitctl's own pack
(:mod:`orbitctl.kernels.bf16_cpu`): its decode runs orbitctl's INT4 kernel (bf16 dot products, at the bf16 GEMM's
rate), and its dense weight for the whole-sequence GEMM and the backward comes from that pack's one-pass
dequantizer straight into the bf16 workspace (the same values as the float32 route, 26x faster).

Where the kernel granted this process AMX's tile data (:func:`orbitctl.kernels.bf16_cpu.amx_granted`), oneDNN runs
that GEMM on AMX tiles (``tdpbf16ps``: the same exact products, float32 accumulation, one rounding), and an input
without a positions axis takes it from :data:`DENSE_ROWS_AMX` rows. What no longer holds there: a blocked AMX GEMM
picks its blocking, and for few rows its kernel, by the number of rows, so a row's result may differ by a bf16 step
with the rows beside it (a prompt prefilled for its group against the same prompt in a batch). The decode steps'
kernel keeps every row independent (:func:`~orbitctl.kernels.int4_kernel.rows_are_independent` probes that kernel,
and ``quant.kernel: auto`` fuses on it); a forward and its recompute have the same rows and agree bit for bit. The
infer path's prefill and the train path's forward of the same tokens then agree to a bf16 step per layer, not bit
for bit, as every other bf16 matmul there does (dequantizing would not restore it: its GEMM is the same oneDNN
call); ``verify-alignment`` measures that as the kernel floor beside every comparison.
"""

from __future__ import annotations

import threading

import torch
from torch import nn

from orbitctl.codec.formats import dequantize_fp8_blocks, dequantize_int4, dequantize_int4_into, scales_exact_in_bf16
from orbitctl.kernels import cpu_dtype
from orbitctl.kernels.eager import real_eager
from orbitctl.kernels.grouped_int4 import takes_lora
from orbitctl.kernels.int4_kernel import Int4Pack
from orbitctl.model.expert_lora import experts_by_row

_WORKSPACE = threading.local()


def int4_workspace(shape: tuple[int, int], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """This thread's (int32 codes, float32 values, result in ``dtype`` or None for float32) views of ``shape``.

    One flat buffer of each kind per thread, grown to the largest matrix asked for and shared by every
    layer: (4 + 4 + bytes of ``dtype`` unless float32) bytes per element of the largest INT4 matrix."""
    values = workspace_buffer(shape, torch.float32)
    return workspace_buffer(shape, torch.int32), values, None if dtype == torch.float32 else workspace_buffer(shape, dtype)


def workspace_buffer(shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """This thread's one flat buffer of ``dtype``, grown to ``shape`` if smaller, as a view of ``shape``."""
    numel = shape[0] * shape[1]
    buffers = getattr(_WORKSPACE, "buffers", None)
    if buffers is None:
        buffers = _WORKSPACE.buffers = {}
    buf = buffers.get(dtype)
    if buf is None or buf.numel() < numel:
        buffers.pop(dtype, None)  # the smaller one goes before the larger one is made
        with torch.inference_mode(False):  # an inference tensor could not be written outside inference mode
            buf = buffers[dtype] = torch.empty(numel, dtype=dtype)
    return buf[:numel].view(shape)


def workspace_bytes() -> int:
    """Bytes this thread's INT4 dequantization workspace holds now."""
    return sum(b.numel() * b.element_size() for b in (getattr(_WORKSPACE, "buffers", None) or {}).values())


def _plain_cpu(t: torch.Tensor) -> bool:
    """A real CPU tensor in eager mode (:func:`real_eager`): not fake or meta (the planner's shadow runs), not traced;
    under another dispatch mode (selective checkpointing's, an op counter) the workspace serves as without one."""
    return t.device.type == "cpu" and real_eager(t)


def _kernel_input(x: torch.Tensor) -> bool:
    """Whether ``x`` can go through the fused kernel: a :func:`real_eager` CPU or CUDA tensor (the pack is the
    device's: the CPU kernel's or tinygemm's)."""
    return x.device.type in ("cpu", "cuda") and real_eager(x)


DENSE_ROWS = 256
"""Rows from which a fused INT4 layer with weights exact in bf16 runs one bf16 GEMM instead of the kernel on an
input without a positions axis (a routed expert's rows; :func:`dense_gemm_applies`) on an AVX512-BF16 CPU. Measured
on two AVX512-BF16 cores, a 4096 x 768 weight: the dequantization costs about as much as the kernel's extra time over
a bf16 GEMM at 128 rows, 1.44x the kernel's speed at 256, 2.18x at 3,584."""
DENSE_ROWS_AMX = 64
"""The same where the GEMM runs on AMX tiles (:func:`orbitctl.kernels.bf16_cpu.amx_granted`). Not measured here (no
AMX machine at hand); the reasoning: the one-pass dequantization of a 4096 x 768 weight (0.08 ms) costs what about 8
rows cost in orbitctl's AVX512-BF16 kernel (335-361 GFLOP/s on two cores), and an AMX GEMM at any rate above the
kernel's wins that back over some tens of rows; 64 leaves room for a GEMM at twice the kernel's rate."""


def dense_rows() -> int:
    """:data:`DENSE_ROWS_AMX` where many-row bf16 GEMMs run on AMX tiles in this process, else :data:`DENSE_ROWS`."""
    from orbitctl.kernels import bf16_cpu

    return DENSE_ROWS_AMX if bf16_cpu.amx_granted() else DENSE_ROWS


def dense_gemm_applies(x: torch.Tensor, in_features: int) -> bool:
    """Whether ``x`` goes through the dequantized bf16 GEMM rather than the fused kernel, on a CPU whose bf16 matmuls
    are native (not under the AVX2 cap; a GPU keeps its kernel): a forward over whole sequences (``[batch, positions,
    features]`` with more than one position: a prefill, the train path and its recompute), never a decode step (one
    position); an input without a positions axis from :func:`dense_rows` rows (fewer where the GEMM runs on AMX).

    Decided by the forward's kind rather than its row count, so that a prompt prefilled once for its group and the
    same prompt prefilled in a batch of 32 (transformers' ``generate``) take the same path, and so do a forward and
    its recompute."""
    if x.device.type != "cpu" or not cpu_dtype.host_bf16().native:
        return False
    return x.shape[-2] > 1 if x.dim() >= 3 else x.numel() >= dense_rows() * in_features


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


class QuantLinear(nn.Module):
    """y = x W^T + b with W stored as symmetric group INT4 (``fmt='int4'``) or 128x128-block FP8 (``fmt='fp8'``)."""

    def __init__(self, in_features: int, out_features: int, fmt: str, *, group_size: int = 32, bias: bool = False,
                 device=None, as_buffers: bool = False) -> None:
        super().__init__()
        if fmt not in ("int4", "fp8"):
            raise ValueError(f"QuantLinear stores int4 or fp8, not {fmt}")
        self.in_features, self.out_features, self.fmt, self.group_size = in_features, out_features, fmt, group_size

        def hold(name: str, tensor: torch.Tensor) -> None:
            # buffers: weights only this rank holds (an expert-parallel expert), which ZeRO must not touch
            self.register_buffer(name, tensor) if as_buffers else setattr(self, name, _frozen(tensor))

        if fmt == "int4":
            hold("weight_packed", torch.empty(out_features, in_features // 8, dtype=torch.int32, device=device))
            hold("weight_scale", torch.empty(out_features, in_features // group_size, dtype=torch.bfloat16, device=device))
            self.register_buffer("weight_shape", torch.tensor([out_features, in_features], dtype=torch.int64, device=device))
        else:
            blocks = (-(-out_features // 128), -(-in_features // 128))
            hold("weight", torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn, device=device))
            hold("weight_scale_inv", torch.empty(blocks, dtype=torch.float32, device=device))
        if bias:
            hold("bias", torch.zeros(out_features, dtype=torch.bfloat16, device=device))
        else:
            self.bias = None
        self.kernel_pack: Int4Pack | None = None
        """The weight in the fused kernel's layout (``quant.kernel: fused``): a plain attribute, so neither the
        state dict, nor ZeRO, nor ``.to()`` sees it; None: dequantize-then-matmul."""
        self.exact_in_bf16 = False
        """Whether every weight of this (fused) layer is exactly a bf16 number, so many rows may take the bf16 GEMM."""

    def use_fused_kernel(self) -> int:
        """Repack this INT4 layer's loaded weight for the fused kernel; returns the bytes the pack holds."""
        if self.fmt != "int4":
            raise ValueError("the fused kernel takes INT4 weights")
        self.kernel_pack = Int4Pack.of(self.weight_packed, self.weight_scale)
        self.exact_in_bf16 = scales_exact_in_bf16(self.weight_scale)
        return self.kernel_pack.nbytes()

    def fused_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T as the fused kernel computes it (bf16-rounded, in x's dtype): through the kernel, or for many rows
        of weights exact in bf16 one bf16 GEMM over the dequantized weight (see the module's docstring)."""
        if self.exact_in_bf16 and dense_gemm_applies(x, self.in_features):
            return nn.functional.linear(x.to(torch.bfloat16), self.matmul_weight(torch.bfloat16)).to(x.dtype)
        return self.kernel_pack.matmul(x)

    def dequantized_weight(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """The dense [out, in] weight this layer stands for (a fresh tensor)."""
        if self.fmt == "int4":
            return dequantize_int4(self.weight_packed, self.weight_scale, self.in_features, dtype)
        return dequantize_fp8_blocks(self.weight, self.weight_scale_inv, dtype)

    def matmul_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The dense weight for the matmul about to run: on the CPU (INT4) a view of this thread's workspace,
        valid until the next layer dequantizes (never keep it), elsewhere a fresh tensor."""
        if self.fmt != "int4" or not _plain_cpu(self.weight_packed):
            return self.dequantized_weight(dtype)
        pack = self.kernel_pack
        if pack is not None and pack.kind == "bf16" and dtype == torch.bfloat16:  # one pass, the same values
            from orbitctl.kernels import bf16_cpu

            out = workspace_buffer((self.out_features, self.in_features), dtype)
            return bf16_cpu.dequantize_into(pack.packed, pack.scales_and_zeros[0], pack.group_size, out)
        with torch.no_grad():
            codes, values, out = int4_workspace((self.out_features, self.in_features), dtype)
            return dequantize_int4_into(self.weight_packed, self.weight_scale, codes, values, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias.to(x.dtype) if self.bias is not None else None
        fused = self.kernel_pack is not None and _kernel_input(x)
        if not (torch.is_grad_enabled() and x.requires_grad):
            if fused:
                y = self.fused_matmul(x)
                return y + bias if bias is not None else y
            return nn.functional.linear(x, self.matmul_weight(x.dtype), bias)
        return (_FusedLinear if fused else _DequantLinear).apply(x, self, bias)

    def extra_repr(self) -> str:
        group = f", group_size={self.group_size}" if self.fmt == "int4" else ", block=128x128"
        return f"in_features={self.in_features}, out_features={self.out_features}, fmt={self.fmt}{group}"


class _DequantLinear(torch.autograd.Function):
    """y = x W^T + b whose backward dequantizes W again instead of keeping it: autograd would otherwise hold
    every layer's dense weight until the backward reaches it (a whole MoE layer's experts at once: 34 GB in
    bf16 for one Kimi-K2 layer), where the packed weight it came from is already in memory. The weight is
    frozen, so only the input's gradient is computed."""

    @staticmethod
    def forward(ctx, x, layer, bias):
        ctx.layer = layer
        return nn.functional.linear(x, layer.matmul_weight(x.dtype), bias)

    @staticmethod
    def backward(ctx, grad_out):
        w = ctx.layer.matmul_weight(grad_out.dtype)
        return grad_out @ w, None, None


class _FusedLinear(_DequantLinear):
    """y = x W^T + b through the fused INT4 kernel; the backward is :class:`_DequantLinear`'s."""

    @staticmethod
    def forward(ctx, x, layer, bias):
        ctx.layer = layer
        y = layer.fused_matmul(x)
        return y + bias if bias is not None else y


class ExpertMLP(nn.Module):
    """One routed expert: down(act(gate(x)) * up(x)), each projection quantized or plain."""

    def __init__(self, gate_proj: nn.Module, up_proj: nn.Module, down_proj: nn.Module) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj
        self.gate_up_pack: Int4Pack | None = None
        """Gate and up in one fused-kernel pack (``quant.kernel: fused`` on the CPU): one kernel call for both, each
        output column computed as by its own pack (bit for bit), half the calls and casts of an expert's input."""

    def use_fused_gate_up(self) -> int:
        """Pack the INT4 gate and up projections together for the fused kernel; returns the pack's bytes."""
        gate, up = self.gate_proj, self.up_proj
        gate.kernel_pack = up.kernel_pack = None
        self.gate_up_pack = Int4Pack.of(torch.cat([gate.weight_packed, up.weight_packed]),
                                        torch.cat([gate.weight_scale, up.weight_scale]))
        gate.exact_in_bf16 = scales_exact_in_bf16(gate.weight_scale)
        up.exact_in_bf16 = scales_exact_in_bf16(up.weight_scale)
        return self.gate_up_pack.nbytes()

    def fused_gate_up(self, x: torch.Tensor) -> torch.Tensor:
        """``[gate(x), up(x)]`` through the shared pack, or for many rows of weights exact in bf16 each projection's
        bf16 GEMM (:meth:`QuantLinear.fused_matmul`), one after the other (they share the workspace)."""
        gate, up = self.gate_proj, self.up_proj
        if gate.exact_in_bf16 and up.exact_in_bf16 and dense_gemm_applies(x, gate.in_features):
            return torch.cat([gate.fused_matmul(x), up.fused_matmul(x)], dim=-1)
        return self.gate_up_pack.matmul(x)

    def gate_up(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(gate(x), up(x))``: through the shared pack where there is one, else each projection."""
        if self.gate_up_pack is None or not _kernel_input(x):
            return self.gate_proj(x), self.up_proj(x)
        if torch.is_grad_enabled() and x.requires_grad:
            both = _FusedGateUp.apply(x, self)
        else:
            both = self.fused_gate_up(x)
        width = self.gate_proj.out_features
        return both[..., :width], both[..., width:]


class _FusedGateUp(torch.autograd.Function):
    """gate and up through their shared pack; the backward dequantizes each (the reference path), one at a time
    (they share the dequantization workspace)."""

    @staticmethod
    def forward(ctx, x, expert):
        ctx.expert = expert
        return expert.fused_gate_up(x)

    @staticmethod
    def backward(ctx, grad_out):
        gate, up = ctx.expert.gate_proj, ctx.expert.up_proj
        width = gate.out_features
        grad = grad_out[..., :width] @ gate.matmul_weight(grad_out.dtype)
        return grad + grad_out[..., width:] @ up.matmul_weight(grad_out.dtype), None


class QuantExperts(nn.Module):
    """Drop-in for transformers 5's fused ``*Experts`` module: same forward signature and result."""

    def __init__(self, experts: list[ExpertMLP], act_fn) -> None:
        super().__init__()
        self.num_experts = len(experts)
        # registered under the checkpoint's names: experts.N.gate_proj ...
        for i, expert in enumerate(experts):
            self.add_module(str(i), expert)
        self.act_fn = act_fn
        self.held = range(self.num_experts)
        self.expert_lora = None
        """The experts' adapters (:class:`~orbitctl.model.expert_lora.ExpertLoRA`), when adapter.experts asks."""
        self.stack = None
        """The experts stacked for the grouped GPU kernel (:class:`~orbitctl.kernels.grouped_int4.ExpertStack`), or None:
        the per-expert loop."""

    def expert(self, index: int) -> ExpertMLP:
        return getattr(self, str(index))

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """Every (token, slot) routed to its expert in one pass: the slots sorted by expert, each expert run on its
        contiguous rows (:func:`experts_by_row`), the weighted results added back to their tokens at once."""
        k = top_k_index.shape[-1]
        lora = self.expert_lora.bound() if self.expert_lora is not None else None
        if self.stack is not None and takes_lora(lora):  # every slot in its own row, in the slots' order
            out = self.stack.forward(hidden_states, top_k_index.reshape(-1), k, self.act_fn, lora)
            weighted = out.view(*top_k_index.shape, -1) * top_k_weights[..., None].to(out.dtype)
            return weighted.sum(-2).to(hidden_states.dtype)
        out, order = experts_by_row(self, top_k_index.reshape(-1),
                                    lambda order: hidden_states[torch.div(order, k, rounding_mode="floor")],
                                    lora, restore_order=False)
        token_of = torch.div(order, k, rounding_mode="floor")
        weights = top_k_weights.reshape(-1)[order, None]
        final = torch.zeros_like(hidden_states)
        return final.index_add_(0, token_of, (out * weights).to(final.dtype))
