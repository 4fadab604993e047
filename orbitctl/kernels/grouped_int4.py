"""Routed experts as grouped INT4 matmuls on a GPU: every expert of a MoE layer in one kernel launch per projection.

    stack = ExpertStack.of(quant_experts)                  # once, after loading: the experts' INT4 words stacked
    y = stack.forward(hidden, top_k_index, top_k_weights)  # the layer's routed part, no host synchronisation

The per-expert loop (:func:`~orbitctl.model.expert_lora.experts_by_row`) issues each hit expert's
dequantize and matmuls on its own: on a 384-expert layer that is over a thousand launches per forward,
and each dequantize writes a bf16 copy of the expert before its matmul reads it (9x the bytes of the
4-bit codes). Here the (token, slot) pairs are sorted by expert and cut into blocks of ``BLOCK_M`` rows,
each block padded within its expert (:func:`align_blocks`: torch ops of static shapes, no ``.tolist()``), and
one Triton kernel per projection computes every block: it reads its expert's 4-bit codes and group scales,
dequantizes a tile in registers and multiplies it with the block's rows, accumulating in float32. The
codes are read once, nothing dense is written, and the launch count of a layer does not grow with the
experts hit; with static shapes the whole layer can be replayed from a CUDA graph.

The gate and up projections run as one launch over their stacked rows. The stacked tensors *are* the
experts' weights: after :meth:`ExpertStack.of` each expert's ``weight_packed`` and ``weight_scale`` are
views into them, so the state dict, saving and the per-expert path read the same memory and nothing is
held twice.

What the kernel computes: ``W = (code - 8) x scale`` in float32, rounded to the activations' dtype,
and ``x W^T`` accumulated in float32 by ``tl.dot``: the reference (:func:`grouped_reference`) is the
dequantized weight in the activations' dtype through a float32-accumulating matmul. Under
``TRITON_INTERPRET=1`` the same kernel runs on CPU tensors (the tests' check of its indexing and
numerics on this machine); the compiled kernel needs a CUDA device.
"""

from __future__ import annotations

import functools

import torch

BLOCK_M = 16
"""Rows of one block: tl.dot's smallest M. A decode step's experts see a few rows each, so the padding is small."""


@functools.lru_cache(maxsize=1)
def triton_present() -> bool:
    """Whether Triton imports (it ships with CUDA builds of torch; the CPU build has none)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except ImportError:
        return False
    return True


def align_blocks(experts: torch.Tensor, num_experts: int, block_m: int = BLOCK_M) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots sorted by expert and padded to whole blocks, in tensors of static shape (graph-capturable).

    ``experts`` [S]: each slot's expert, 0..E-1. Returns ``(rows, block_expert)``: ``rows`` [P] the slot of each
    padded row (``S`` marks padding), each expert's slots contiguous and starting on a multiple of ``block_m``;
    ``block_expert`` [P / block_m] the expert of each block (``-1``: a block past the last expert's). ``P`` is
    ``S + E (block_m - 1)`` rounded up to ``block_m``, the most any routing can need."""
    slots = experts.shape[0]
    device = experts.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, experts.long(), torch.ones_like(experts, dtype=torch.int64))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    order = torch.argsort(experts, stable=True)
    sorted_experts = experts[order].long()
    first_of = torch.cumsum(counts, 0) - counts  # each expert's first slot in sorted order
    position = starts[sorted_experts] + torch.arange(slots, device=device) - first_of[sorted_experts]
    total = -(-(slots + num_experts * (block_m - 1)) // block_m) * block_m
    rows = torch.full((total,), slots, dtype=torch.int64, device=device)
    rows.scatter_(0, position, order)
    block_start = torch.arange(0, total, block_m, device=device)
    block_expert = torch.searchsorted(ends, block_start, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1)
    return rows, block_expert.to(torch.int32)


@functools.lru_cache(maxsize=1)
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def grouped_int4_kernel(a_ptr, w_ptr, s_ptr, c_ptr, rows_ptr, block_expert_ptr, slots, n, k,
                            stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_cm,
                            ROW_DIV: tl.constexpr, GROUP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                            BK: tl.constexpr, K_INTERPRETED: tl.constexpr = 0):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        expert = tl.load(block_expert_ptr + pid_m)
        if expert >= 0:
            offs_m = pid_m * BM + tl.arange(0, BM)
            slot = tl.load(rows_ptr + offs_m)
            live = slot < slots
            a_row = tl.where(live, slot // ROW_DIV, 0)
            offs_n = pid_n * BN + tl.arange(0, BN)
            n_ok = offs_n < n
            w_base = w_ptr + expert.to(tl.int64) * stride_we
            s_base = s_ptr + expert.to(tl.int64) * stride_se
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            # The K loop's bound: the runtime ``k`` when compiled (K_INTERPRETED == 0, a constexpr, so the conditional
            # is resolved while the kernel is traced and the GPU kernel is exactly that of ``range(0, k, BK)``: one
            # scf.for over a runtime bound, pipelined as before). Under TRITON_INTERPRET=1 the launch passes ``k``
            # again, as a Python int: the interpreter runs this loop as Python's ``range``, which converts a tensor
            # bound with ``tensor.__index__``; Triton 3.6's is ``int(handle.data)``, and every interpreted scalar is a
            # one-element 1-d NumPy array, which NumPy >= 2.4 refuses ("only 0-dimensional arrays can be converted to
            # Python scalars"; later Triton squeezes it first). The int must reach ``range`` inline: the interpreter
            # turns every assigned value into such a tensor. A ``while`` loop would dodge it too, but compiles to
            # another, unpipelined loop. The data-dependent skip above (``if expert >= 0``) needs no other form: it
            # goes through ``tensor.__bool__``, which takes a one-element array on every NumPy.
            for k0 in range(0, K_INTERPRETED if K_INTERPRETED > 0 else k, BK):
                offs_k = k0 + tl.arange(0, BK)
                k_ok = offs_k < k
                a = tl.load(a_ptr + a_row[:, None] * stride_am + offs_k[None, :],
                            mask=live[:, None] & k_ok[None, :], other=0.0)
                words = tl.load(w_base + offs_n[None, :] * stride_wn + (offs_k // 8)[:, None],
                                mask=k_ok[:, None] & n_ok[None, :], other=0)
                codes = ((words >> ((offs_k % 8) * 4)[:, None]) & 0xF) - 8
                scale = tl.load(s_base + offs_n[None, :] * stride_sn + (offs_k // GROUP)[:, None],
                                mask=k_ok[:, None] & n_ok[None, :], other=0.0)
                b = (codes.to(tl.float32) * scale.to(tl.float32)).to(a.dtype)
                acc += tl.dot(a, b)
            tl.store(c_ptr + slot[:, None] * stride_cm + offs_n[None, :], acc.to(c_ptr.dtype.element_ty),
                     mask=live[:, None] & n_ok[None, :])

    return grouped_int4_kernel


def grouped_int4_mm(a: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, rows: torch.Tensor,
                    block_expert: torch.Tensor, slots: int, row_div: int, *, block_m: int = BLOCK_M) -> torch.Tensor:
    """For every slot ``s < slots``: ``out[s] = a[s // row_div] @ W[e(s)]^T``, ``W[e] = dequantized words[e], scales[e]``.

    ``a`` [rows_a, K] (bf16 or fp16), ``words`` [E, N, K/8] int32, ``scales`` [E, N, K/group]; ``rows`` and
    ``block_expert`` from :func:`align_blocks`. Returns ``[slots, N]`` in ``a``'s dtype.

    Numerics: ``W = (code - 8) x scale`` in float32 rounded to ``a``'s dtype, ``a W^T`` accumulated in float32 by
    ``tl.dot``, one rounding to ``a``'s dtype. Slots independent: a slot's result reads only its row and its
    expert's weight, whatever the other slots and blocks. Equals :func:`grouped_reference` up to the order of the
    float32 sums."""
    import triton

    k = a.shape[-1]
    n = words.shape[1]
    group = k // scales.shape[-1]
    out = torch.empty(slots, n, dtype=a.dtype, device=a.device)
    block_n = 64 if n >= 64 else 32
    block_k = max(32, min(64, group))
    grid = (block_expert.shape[0], triton.cdiv(n, block_n))
    kernel = _kernel()
    interpreted = not isinstance(kernel, triton.runtime.JITFunction)  # TRITON_INTERPRET=1: an InterpretedFunction
    kernel[grid](a, words, scales, out, rows, block_expert, slots, n, k,
                 a.stride(0), words.stride(0), words.stride(1), scales.stride(0), scales.stride(1), out.stride(0),
                 ROW_DIV=row_div, GROUP=group, BM=block_m, BN=block_n, BK=block_k,
                 K_INTERPRETED=k if interpreted else 0)
    return out


def grouped_int4_grad(grad_out: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, experts: torch.Tensor,
                      rows_a: int, row_div: int) -> torch.Tensor:
    """The input's gradient of :func:`grouped_int4_mm`: ``grad[r] = sum over slots s with s // row_div = r of
    grad_out[s] @ W[e(s)]``, through each hit expert's dequantized weight (the weights are frozen). Reads which
    experts were hit on the host: eager only, as a backward is."""
    from orbitctl.codec.formats import dequantize_int4

    k = words.shape[-1] * 8
    grad = grad_out.new_zeros(rows_a, k, dtype=torch.float32)
    for e in torch.unique(experts).tolist():
        if e >= words.shape[0]:  # a skipped slot (ExpertStack.forward's ``skip``): no expert ran it
            continue
        slots = torch.nonzero(experts == e).squeeze(-1)
        w = dequantize_int4(words[e], scales[e], k, grad_out.dtype)
        grad.index_add_(0, torch.div(slots, row_div, rounding_mode="floor"), (grad_out[slots] @ w).float())
    return grad.to(grad_out.dtype)


# The kernel and its gradient as dispatcher ops: one implementation for CUDA tensors and for the interpreter's CPU
# tensors, and a fake one (shapes only) for FakeTensorMode, under which the CUDA rehearsal runs the layer's
# forward and backward on a CPU (orbitctl.dist.rehearsal) and torch.compile would trace it
_OPS = torch.library.Library("orbitctl", "FRAGMENT")
_OPS.define("grouped_int4_mm(Tensor a, Tensor words, Tensor scales, Tensor rows, Tensor block_expert, int slots, "
            "int row_div) -> Tensor")
_OPS.define("grouped_int4_grad(Tensor grad_out, Tensor words, Tensor scales, Tensor experts, int rows_a, "
            "int row_div) -> Tensor")
for _device in ("CPU", "CUDA"):
    _OPS.impl("grouped_int4_mm", grouped_int4_mm, _device)
    _OPS.impl("grouped_int4_grad", grouped_int4_grad, _device)
torch.library.register_fake(
    "orbitctl::grouped_int4_mm", lambda a, words, scales, rows, block_expert, slots, row_div:
    a.new_empty(slots, words.shape[1]), lib=_OPS)
torch.library.register_fake(
    "orbitctl::grouped_int4_grad", lambda grad_out, words, scales, experts, rows_a, row_div:
    grad_out.new_empty(rows_a, words.shape[-1] * 8), lib=_OPS)


class _GroupedProjection(torch.autograd.Function):
    """:func:`grouped_int4_mm` whose backward gives the input's gradient (:func:`grouped_int4_grad`; the weights are
    frozen, the kernel is forward-only)."""

    @staticmethod
    def forward(ctx, a, words, scales, rows, block_expert, experts, row_div):
        ctx.save_for_backward(words, scales, experts)
        ctx.row_div, ctx.rows_a = row_div, a.shape[0]
        return torch.ops.orbitctl.grouped_int4_mm(a, words, scales, rows, block_expert, experts.shape[0], row_div)

    @staticmethod
    def backward(ctx, grad_out):
        words, scales, experts = ctx.saved_tensors
        grad = torch.ops.orbitctl.grouped_int4_grad(grad_out.contiguous(), words, scales, experts, ctx.rows_a,
                                                    ctx.row_div)
        return grad, None, None, None, None, None, None


def grouped_reference(a: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, experts: torch.Tensor,
                      row_div: int) -> torch.Tensor:
    """What :func:`grouped_int4_mm` computes, with plain torch ops: each slot's row times its expert's dequantized
    weight (in ``a``'s dtype), accumulated in float32."""
    from orbitctl.codec.formats import dequantize_int4

    k = a.shape[-1]
    out = []
    for slot, e in enumerate(experts.tolist()):
        w = dequantize_int4(words[e], scales[e], k, a.dtype).to(torch.float32)
        out.append(a[slot // row_div].to(torch.float32) @ w.t())
    return torch.stack(out).to(a.dtype)


def runs_on(device_type: str) -> bool:
    """Whether the kernel can run on tensors of ``device_type``: a CUDA device (or the CPU under Triton's interpreter,
    ``TRITON_INTERPRET=1``) with Triton present, imported only where it could run."""
    import os

    interpreted = device_type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
    return (device_type == "cuda" or interpreted) and triton_present()


def takes_lora(lora) -> bool:
    """Whether the grouped path computes this layer's expert adapters: none, or one shared adapter for every expert
    (per-expert factors keep the per-expert loop)."""
    return lora is None or lora.layout == "shared"


class ExpertStack:
    """A layer's routed INT4 experts stacked for :func:`grouped_int4_mm`: gate and up as one ``[E, 2I, H/8]``
    projection, down as ``[E, H, I/8]``; each expert's own parameters become views into these."""

    def __init__(self, gate_up: tuple[torch.Tensor, torch.Tensor], down: tuple[torch.Tensor, torch.Tensor],
                 width: int, dtype: torch.dtype = torch.bfloat16) -> None:
        self.gate_up, self.down, self.width, self.dtype = gate_up, down, width, dtype

    @classmethod
    def of(cls, module, dtype: torch.dtype = torch.bfloat16) -> "ExpertStack":
        """Stack ``module``'s experts (a :class:`~orbitctl.model.quant_linear.QuantExperts` or expert-parallel layer
        whose held experts are INT4 :class:`~orbitctl.model.quant_linear.QuantLinear` s) in place. ``dtype``: the
        activations' dtype in the kernel where the model computes in float32 (bf16; the tests' interpreter runs
        fp16, which Triton's interpreter represents exactly)."""
        experts = [module.expert(e) for e in module.held]
        width = experts[0].gate_proj.out_features

        def stack(names: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor]:
            parts = []
            for attr in ("weight_packed", "weight_scale"):
                whole = torch.stack([torch.cat([getattr(getattr(x, name), attr).data for name in names])
                                     for x in experts])
                row = 0
                for name in names:
                    rows = getattr(experts[0], name).out_features
                    for i, x in enumerate(experts):
                        _rebind(getattr(x, name), attr, whole[i, row:row + rows])
                    row += rows
                parts.append(whole)
            return parts[0], parts[1]

        return cls(stack(("gate_proj", "up_proj")), stack(("down_proj",)), width, dtype)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.gate_up, *self.down))

    def forward(self, hidden: torch.Tensor, local_experts: torch.Tensor, row_div: int, act_fn,
                lora=None, *, skip: bool = False) -> torch.Tensor:
        """Each slot's expert on its row: ``hidden`` [R, H], ``local_experts`` [S] (0-based among the held experts),
        slot ``s`` reading ``hidden[s // row_div]``. Returns ``[S, H]`` in ``hidden``'s dtype (computed in bf16 where
        ``hidden`` is float32: :attr:`dtype`). ``lora``: a ``shared`` expert adapter (:meth:`ExpertLoRA.bound`), one factor pair per
        projection for every expert, so its terms are plain matmuls beside the grouped ones. With ``skip`` a slot of
        expert ``E`` (one past the held experts) is computed by no block: its result rows are left unset."""
        x = hidden if hidden.dtype in (torch.bfloat16, torch.float16) else hidden.to(self.dtype)
        held = self.gate_up[0].shape[0]
        rows, block_expert = align_blocks(local_experts, held + 1 if skip else held)
        if skip:
            block_expert = torch.where(block_expert == held, -1, block_expert).to(torch.int32)
        gate_up = _GroupedProjection.apply(x, *self.gate_up, rows, block_expert, local_experts, row_div)
        if lora is not None:
            xa = hidden.to(lora.dtype)
            delta = torch.cat([lora.delta("gate_proj", -1, xa), lora.delta("up_proj", -1, xa)], -1)
            slot_token = torch.div(torch.arange(local_experts.shape[0], device=x.device), row_div, rounding_mode="floor")
            gate_up = gate_up + delta[slot_token].to(gate_up.dtype)
        h = act_fn(gate_up[:, :self.width]) * gate_up[:, self.width:]
        out = _GroupedProjection.apply(h, *self.down, rows, block_expert, local_experts, 1)
        if lora is not None:
            out = out + lora.delta("down_proj", -1, h.to(lora.dtype)).to(out.dtype)
        return out.to(hidden.dtype)


def _rebind(layer, attr: str, view: torch.Tensor) -> None:
    """Point ``layer.attr`` (a parameter or a buffer) at ``view``, freeing the tensor it held."""
    held = getattr(layer, attr)
    if isinstance(held, torch.nn.Parameter):
        held.data = view
    else:
        layer._buffers[attr] = view
