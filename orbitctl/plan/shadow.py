"""Adapters that work under FakeTensorMode, for the --measure calibration.

PEFT moves its new weights with ``module.to()``, which fake mode forbids, and MemTracker
hooks every parameter's gradient, which a frozen parameter cannot take. So the measured copy
gets small LoRA / bottleneck modules built in place, and its frozen weights become buffers
(they are counted as such).
"""

from __future__ import annotations


def _lora_class():
    import torch
    from torch import nn

    class ShadowLoRA(nn.Module):
        """y = base(x) + B(A(dropout(x))) * alpha / r with A, B in the adapter dtype."""

        def __init__(self, base, rank: int, alpha: float, dropout: float, dtype) -> None:
            super().__init__()
            self.base = base
            self.A = nn.Parameter(torch.empty(rank, base.in_features, dtype=dtype))
            self.B = nn.Parameter(torch.zeros(base.out_features, rank, dtype=dtype))
            self.scale = alpha / rank
            self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

        def forward(self, x):
            y = self.base(x)
            z = self.dropout(x).to(self.A.dtype)
            return y + ((z @ self.A.t()) @ self.B.t()).to(y.dtype) * self.scale

    return ShadowLoRA


def _bottleneck_class():
    import torch
    from torch import nn

    class ShadowBottleneck(nn.Module):
        """mlp(x) followed by y + up(relu(down(y)))."""

        def __init__(self, mlp, hidden: int, dim: int, dtype) -> None:
            super().__init__()
            self.mlp = mlp
            self.down = nn.Linear(hidden, dim, dtype=dtype)
            self.up = nn.Linear(dim, hidden, dtype=dtype)

        def forward(self, x):
            y = self.mlp(x)
            return y + self.up(torch.relu(self.down(y.to(self.down.weight.dtype)))).to(y.dtype)

    return ShadowBottleneck


def attach_shadow_adapters(model, arch, adapters, section) -> int:
    """Wrap the adapted linear modules; returns how many adapted weights could not be wrapped."""
    import torch
    from torch import nn

    dtype = torch.bfloat16 if section.dtype == "bf16" else torch.float32
    for param in model.parameters():
        param.requires_grad_(False)
    layers = model.model.layers
    if adapters.kind == "bottleneck":
        cls = _bottleneck_class()
        for layer in layers:
            layer.mlp = cls(layer.mlp, arch.hidden_size, adapters.rank, dtype)
        return 0
    cls = _lora_class()
    alpha = section.alpha if section.alpha is not None else 2 * adapters.rank
    skipped = 0
    for index, name in sorted(adapters.adapted):
        parent_path, _, leaf = f"{index}.{name}".rpartition(".")
        parent = layers
        for part in parent_path.split("."):
            parent = getattr(parent, part, None) if not part.isdigit() else parent[int(part)]
            if parent is None:
                break
        target = getattr(parent, leaf, None) if parent is not None else None
        if isinstance(target, nn.Linear):
            setattr(parent, leaf, cls(target, adapters.rank, alpha, section.dropout, dtype))
        else:
            skipped += 1
    return skipped


def freeze_to_buffers(model) -> None:
    """Turn every frozen parameter into a buffer so MemTracker's gradient hooks skip it."""
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if not param.requires_grad:
                delattr(module, name)
                module.register_buffer(name, param.data)


FLASH_STYLE = "orbitctl_causal"  # a name containing "flash" would make transformers look for a kernel


def register_flash_style_attention() -> str:
    """A causal attention that behaves like a flash kernel: no s x s mask, fp32 log-sum-exp kept.

    Under fake tensors transformers cannot see that the batch has no padding and would build a
    4-D mask; a GPU flash kernel never does. MLA's shorter value heads are padded to the
    query/key size, as transformers does for flash attention.
    """
    import torch.nn.functional as F
    from transformers import AttentionInterface

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        v_dim = value.shape[-1]
        if v_dim != query.shape[-1]:
            value = F.pad(value, [0, query.shape[-1] - v_dim])
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling,
                                             enable_gqa=key.shape[1] != query.shape[1])
        return out[..., :v_dim].transpose(1, 2).contiguous(), None

    AttentionInterface.register(FLASH_STYLE, attention)
    return FLASH_STYLE
