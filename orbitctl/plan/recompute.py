"""``memory.keep_frozen_outputs``: a checkpointed layer's recompute without the frozen base's matmuls (the rule the
plan counts and train builds: here, below both).

    kwargs = checkpoint_kwargs(keep_frozen_outputs=True)   # for torch.utils.checkpoint.checkpoint
    model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)

Per-layer gradient checkpointing keeps each layer's input and runs the layer's forward again in the backward. With
a frozen base most of that forward is the base's matmuls (x W^T for every quantized or plain frozen weight), whose
outputs the backward's recomputed graph needs but whose weights take no gradient. Kept, the recompute runs only what
is cheap to run again: norms, RoPE, attention, activations, the adapters' thin matmuls. It costs their outputs,
``tokens x (sum of the frozen linear layers' output features) x 2`` bytes per checkpointed layer (the plan counts
it under activations), and saves one of the three passes of the base's matmuls an update runs (forward, recompute,
backward).

Which ops are kept (PyTorch's selective activation checkpointing, decided per dispatched op): a matmul whose weight
operand takes no gradient (a dequantized INT4/FP8 or NF4 weight, a plain frozen weight; the adapters' weights take
gradients and are recomputed), and the fused INT4 kernels. Everything else is recomputed. The kept outputs are the
tensors the first forward computed, so the gradients are bit for bit those of full recompute.
"""

from __future__ import annotations

import functools

MATMULS = ("mm", "addmm", "bmm")
"""Matmul ops whose last operand is the weight (``addmm``'s first operand is the bias)."""
KERNEL_OPS = ("_weight_int4pack_mm_for_cpu", "_weight_int4pack_mm", "int4_bf16_mm")
"""The dispatched ops' names of the fused INT4 kernels (PyTorch's CPU kernel, tinygemm, orbitctl's AVX512-BF16
kernel, :mod:`orbitctl.kernels.bf16_cpu`), as an op counter (:func:`orbitctl.rl.steptime.dispatched_ops`) names them:
their outputs are the frozen weights' and are kept."""


def keeps(op, args) -> bool:
    """Whether a dispatched op's output is kept rather than recomputed: a frozen weight's matmul or a fused kernel."""
    name = op.overloadpacket.__name__
    if name in KERNEL_OPS:
        return True
    if name not in MATMULS:
        return False
    weight = args[-1] if name == "addmm" else args[1]
    return not weight.requires_grad


def _policy(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if keeps(op, args) else CheckpointPolicy.PREFER_RECOMPUTE


def checkpoint_kwargs(*, keep_frozen_outputs: bool) -> dict:
    """Keyword arguments for ``torch.utils.checkpoint.checkpoint``: non-reentrant, and with ``keep_frozen_outputs``
    the selective policy above."""
    if not keep_frozen_outputs:
        return {"use_reentrant": False}
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return {"use_reentrant": False, "context_fn": functools.partial(create_selective_checkpoint_contexts, _policy)}
