"""Trainable adapters on a frozen base: LoRA through PEFT, and the bottleneck adapter.

Adapters are in ``adapter.dtype`` (bf16, fp32, or auto as resolved by
:func:`orbitctl.kernels.cpu_dtype.resolve_dtype`) and are never merged into the quantized weights: the
same unmerged adapter serves the infer path and the train path.

Bottleneck adapter file format (``adapter/``):
  ``bottleneck_config.json``  {"format": "orbitctl-bottleneck", "version": 1, "dim": D,
                               "hidden_size": H, "num_layers": L, "placement": "after-mlp"}
  ``bottleneck.safetensors``  per layer i: ``layers.{i}.down.weight`` [D, H],
                               ``layers.{i}.down.bias`` [D], ``layers.{i}.up.weight`` [H, D],
                               ``layers.{i}.up.bias`` [H]; the layer computes
                               ``y = mlp(x); y + up(relu(down(y)))``.
LoRA is saved in PEFT's own format (``adapter_config.json`` + ``adapter_model.safetensors``),
loadable with ``peft.PeftModel.from_pretrained`` on the quantized base.
"""

from __future__ import annotations

import json
import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from orbitctl.errors import InputFileError, UserError
from orbitctl.kernels.cpu_dtype import torch_dtype
from orbitctl.plan.adapters import layer_index

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")
MLP = ("gate_proj", "up_proj", "down_proj", "fc1", "fc2", "w1", "w2", "w3")
BOTTLENECK_FORMAT = "orbitctl-bottleneck"
_ROUTED_EXPERT = re.compile(r"(^|\.)experts\.\d+\.")


@dataclass(frozen=True)
class AdapterReport:
    """What was adapted: shown to the user, so a preset that silently skips layers is visible."""

    kind: str
    modules: list[str]
    trainable_params: int
    dim: int
    dtypes: str = ""
    """The compute and adapter dtypes in use, e.g. 'compute and adapter fp32 (auto: ...)'."""

    def summary(self) -> str:
        suffixes: dict[str, int] = {}
        for name in self.modules:
            suffixes[name.rsplit(".", 1)[-1]] = suffixes.get(name.rsplit(".", 1)[-1], 0) + 1
        parts = ", ".join(f"{s} x{n}" for s, n in sorted(suffixes.items()))
        dtypes = f"; {self.dtypes}" if self.dtypes else ""
        return (f"{self.kind} dim {self.dim} on {len(self.modules)} modules ({parts}); "
                f"{self.trainable_params:,} trainable parameters{dtypes}")


def _is_linear(module) -> bool:
    import torch

    if isinstance(module, torch.nn.Linear):
        return True
    # bitsandbytes Linear4bit subclasses nn.Linear; orbitctl's QuantLinear exposes in/out features
    return hasattr(module, "in_features") and hasattr(module, "out_features") and type(module).__name__.endswith("Linear")


def first_adapted_layer(model, last_layers: int | None) -> int:
    """Index of the lowest decoder layer ``adapter.last_layers`` adapts in ``model`` (0: every layer)."""
    from orbitctl.plan.adapters import first_adapted_layer as first_of

    return first_of(int(model.config.num_hidden_layers), last_layers)


def resolve_targets(model, targets, last_layers: int | None = None) -> list[str]:
    """Full module names for a preset or a list of suffixes, in the last ``last_layers`` decoder layers (all when
    None); lm_head is never adapted."""
    first = first_adapted_layer(model, last_layers)
    names = [n for n, m in model.named_modules() if n and _is_linear(m) and not n.endswith("lm_head")
             and (layer_index(n) or 0) >= first]
    if isinstance(targets, str):
        if targets == "all-linear":
            chosen = names
        elif targets == "attention":
            chosen = [n for n in names if n.rsplit(".", 1)[-1] in ATTENTION]
        elif targets in ("attention+mlp", "attention+shared"):
            chosen = [n for n in names if n.rsplit(".", 1)[-1] in ATTENTION + MLP]
            if targets == "attention+shared":
                # dense MLPs and shared experts, never the routed experts (their LoRA would
                # materialise every expert's weights on each forward)
                chosen = [n for n in chosen if not _ROUTED_EXPERT.search(n)]
        else:
            raise UserError(f"adapter.targets: unknown preset '{targets}'",
                            fix="use all-linear, attention, attention+mlp, attention+shared or a list of module names")
    else:
        wanted = list(targets)
        if any(t == "lm_head" or t.endswith(".lm_head") for t in wanted):
            raise UserError("adapter.targets: lm_head: the output layer is never adapted (it stays frozen with the "
                            "base; on a tied model it is the embedding)", fix="remove lm_head from adapter.targets")
        chosen = [n for n in names if any(n == t or n.endswith("." + t) for t in wanted)]
        missing = [t for t in wanted if not any(n == t or n.endswith("." + t) for n in names)]
        if missing:
            raise UserError(f"adapter.targets: no linear module named {', '.join(missing)} in this model",
                            fix=f"choose from suffixes such as {', '.join(sorted({n.rsplit('.', 1)[-1] for n in names}))}")
    if not chosen:
        raise UserError(f"adapter.targets: '{targets}' matches no linear module of this model",
                        fix="name the modules explicitly, e.g. [q_proj, v_proj]")
    return chosen


def adapter_dim(rank, hidden_size: int) -> int:
    return max(1, hidden_size // 10) if rank == "auto" else int(rank)


@contextmanager
def _targets_as_resolved():
    """PEFT as told: no rewriting of targets that orbitctl resolved against this very model.

    For model types whose MoE layout changed in transformers 5 (DeepSeek-V3, Kimi-K2, Qwen3-MoE ...),
    PEFT turns every target ending in gate_proj/up_proj/down_proj into the fused experts' parameters,
    which drops the dense layers' MLPs and the shared experts the targets name (they are separate
    linear modules) and adapts nothing in their place. The targets here are full module names of the
    live model, so there is nothing to convert.
    """
    from peft.utils import transformers_weight_conversion as conversion

    original = conversion.convert_peft_config_for_transformers
    conversion.convert_peft_config_for_transformers = lambda *args, **kwargs: None
    try:
        yield
    finally:
        conversion.convert_peft_config_for_transformers = original


def attach_lora(model, section, hidden_size: int, *, seed: int):
    """Wrap the base in a PeftModel with LoRA weights in ``section.dtype`` on the resolved targets."""
    import torch
    from peft import LoraConfig, get_peft_model

    modules = resolve_targets(model, section.targets, section.last_layers)
    rank = adapter_dim(section.rank, hidden_size)
    config = LoraConfig(
        r=rank, lora_alpha=section.alpha if section.alpha is not None else 2 * rank,
        lora_dropout=section.dropout, target_modules=modules, bias="none", task_type="CAUSAL_LM")
    from orbitctl.model.quant_linear import QuantLinear

    # INT4/FP8 layers are our own modules: PEFT wraps them through its custom-module hook
    config._register_custom_module({QuantLinear: _quant_lora_layer()})
    torch.manual_seed(seed)  # LoRA A init draws from the global generator
    with _targets_as_resolved():
        peft_model = get_peft_model(model, config, autocast_adapter_dtype=False)
    adapted = {n.removeprefix("base_model.model.") for n, m in peft_model.named_modules() if hasattr(m, "lora_A")}
    if set(modules) - adapted:
        missing = sorted(set(modules) - adapted)
        raise UserError(f"adapter.targets: PEFT attached no LoRA to {len(missing)} of the resolved modules "
                        f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''})",
                        fix="name the modules explicitly, or report the model type")
    dtype = torch_dtype(section.dtype, next(model.parameters()).device)
    for name, param in peft_model.named_parameters():
        if "lora_" in name:
            param.data = param.data.to(dtype)
    if section.experts != "none":  # after PEFT, which would freeze them
        from orbitctl.model.expert_lora import attach_expert_lora, expert_layers

        expert_rank = rank if section.experts_rank == "auto" else int(section.experts_rank)
        alpha = section.alpha if section.alpha is not None else 2 * rank
        first = first_adapted_layer(model, section.last_layers)
        attach_expert_lora(peft_model, section.experts, expert_rank, alpha, dtype, seed=seed, first_layer=first)
        modules = modules + [f"{name}[{section.experts} rank {expert_rank}]" for name, _ in expert_layers(peft_model)
                             if (layer_index(name) or 0) >= first]
    return peft_model, AdapterReport("lora", modules, _count_trainable(peft_model), rank)


def load_lora(model, directory: str | Path, dtype: str = "bf16"):
    """A saved LoRA adapter on a frozen base of any format, as the trainer had it.

    ``PeftModel.from_pretrained`` alone does not know orbitctl's INT4/FP8 layers and builds the
    adapter in float32; this registers the layers and keeps the adapter in its trained dtype.
    """
    from peft import LoraConfig, PeftModel

    from orbitctl.model.quant_linear import QuantLinear

    config = LoraConfig.from_pretrained(str(directory))
    experts = _expert_sidecar(directory)
    if experts is not None:  # orbitctl builds the experts' adapters itself, not PEFT
        config.target_modules = [t for t in config.target_modules if not _ROUTED_EXPERT.search(t)]
        config.rank_pattern, config.alpha_pattern = {}, {}
    config._register_custom_module({QuantLinear: _quant_lora_layer()})
    with _targets_as_resolved():
        peft_model = PeftModel.from_pretrained(model, str(directory), config=config, autocast_adapter_dtype=False)
    target = torch_dtype(dtype, next(model.parameters()).device)
    for name, param in peft_model.named_parameters():
        if "lora_" in name:
            param.data = param.data.to(target)
    if experts is not None:
        from safetensors.torch import load_file

        from orbitctl.model.expert_lora import attach_expert_lora, load_expert_lora_tensors

        attach_expert_lora(peft_model, experts["layout"], experts["rank"], experts["alpha"], target, seed=0,
                           first_layer=experts["first_layer"])
        file = Path(directory) / "adapter_model.safetensors"
        load_expert_lora_tensors(peft_model, load_file(str(file)), str(file))
    return peft_model


def _quant_lora_layer():
    """PEFT's LoRA ``Linear`` over a frozen :class:`QuantLinear`: y = base(x) + B(A(dropout(x)))·scale."""
    from peft.tuners.lora.layer import Linear

    class QuantLinearLora(Linear):
        def _get_in_out_features(self, module):
            return module.in_features, module.out_features

        def _get_base_layer_device_and_dtype(self, base_layer):
            # follow the stored weights' device but never their dtype: PEFT would cast the adapter
            # to float8 next to an FP8 weight (lossy on load); the adapter dtype is the profile's
            stored = next(base_layer.parameters(), None)
            return (stored.device if stored is not None else None), None

        def merge(self, *args, **kwargs):
            raise ValueError("the base is quantized: its adapters stay unmerged (the adapter-first method)")

    return QuantLinearLora


def _count_trainable(model) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def _bottleneck_cls():
    import torch

    class BottleneckMLP(torch.nn.Module):
        """The layer's MLP followed by ``y + up(relu(down(y)))``; up starts at zero, so the
        adapted model starts equal to the base."""

        def __init__(self, mlp, hidden: int, dim: int, dtype) -> None:
            super().__init__()
            self.mlp = mlp
            # initialised on the CPU (the same numbers for one seed wherever it runs), then moved
            # next to the MLP's weights
            device = next(mlp.parameters()).device
            self.down = torch.nn.Linear(hidden, dim, dtype=dtype).to(device)
            self.up = torch.nn.Linear(dim, hidden, dtype=dtype).to(device)
            torch.nn.init.zeros_(self.up.weight)
            torch.nn.init.zeros_(self.up.bias)
            self.adapter_enabled = True

        def forward(self, x):
            y = self.mlp(x)
            if not self.adapter_enabled:
                return y
            return y + self.up(torch.relu(self.down(y.to(self.down.weight.dtype)))).to(y.dtype)

    return BottleneckMLP


def attach_bottleneck(model, section, hidden_size: int, *, seed: int):
    """Insert a bottleneck adapter after every decoder layer's MLP (the last ``adapter.last_layers`` when set)."""
    import torch

    layers = decoder_layers(model)
    first = first_adapted_layer(model, section.last_layers)
    dim = adapter_dim(section.rank, hidden_size)
    dtype = torch_dtype(section.dtype, next(model.parameters()).device)
    cls = _bottleneck_cls()
    torch.manual_seed(seed)
    names = []
    for i, layer in enumerate(layers):
        if i < first:
            continue
        layer.mlp = cls(layer.mlp, hidden_size, dim, dtype)
        names.append(f"model.layers.{i}.mlp")
    return model, AdapterReport("bottleneck", names, _count_trainable(model), dim)


def decoder_layers(model):
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise UserError("adapter.kind: bottleneck needs a decoder with model.layers[*].mlp",
                        fix="use adapter.kind: lora for this architecture")
    return list(layers)


def bottleneck_modules(model):
    return [m for m in model.modules() if type(m).__name__ == "BottleneckMLP"]


@contextmanager
def adapters_disabled(model):
    """The reference policy: the same weights with every adapter switched off (no copy)."""
    if hasattr(model, "disable_adapter"):
        from orbitctl.model.expert_lora import set_expert_lora_enabled

        switched = set_expert_lora_enabled(model, False)
        try:
            with model.disable_adapter():
                yield
        finally:
            for lora in switched:
                lora.enabled = True
        return
    modules = bottleneck_modules(model)
    for m in modules:
        m.adapter_enabled = False
    try:
        yield
    finally:
        for m in modules:
            m.adapter_enabled = True


def save_bottleneck(model, directory: str | Path, hidden_size: int) -> None:
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    modules = bottleneck_modules(model)
    tensors = {}
    for i, m in enumerate(modules):
        for part in ("down", "up"):
            lin = getattr(m, part)
            tensors[f"layers.{i}.{part}.weight"] = lin.weight.detach().contiguous().cpu()
            tensors[f"layers.{i}.{part}.bias"] = lin.bias.detach().contiguous().cpu()
    meta = {"format": BOTTLENECK_FORMAT, "version": 1, "dim": modules[0].down.out_features,
            "hidden_size": hidden_size, "num_layers": len(modules), "placement": "after-mlp"}
    save_file(tensors, str(directory / "bottleneck.safetensors"), metadata={"format": BOTTLENECK_FORMAT})
    (directory / "bottleneck_config.json").write_text(json.dumps(meta, indent=2) + "\n")


def load_bottleneck(model, directory: str | Path) -> None:
    """Copy saved bottleneck weights into a model that already has the adapters attached."""
    import torch
    from safetensors.torch import load_file

    directory = Path(directory)
    config_path = directory / "bottleneck_config.json"
    if not config_path.exists():
        raise InputFileError(f"{config_path}: not found", fix="point at a directory written by orbitctl train")
    tensors = load_file(str(directory / "bottleneck.safetensors"))
    with torch.no_grad():
        for i, m in enumerate(bottleneck_modules(model)):
            for part in ("down", "up"):
                lin = getattr(m, part)
                lin.weight.copy_(tensors[f"layers.{i}.{part}.weight"])
                lin.bias.copy_(tensors[f"layers.{i}.{part}.bias"])


def randomize_adapters(model, *, seed: int, std: float) -> None:
    """Seeded normal values in every trainable (adapter) weight, LoRA's zero B included: an adapter of the
    size a short training run reaches, for checks that carry one through export, serve or verification
    without training it."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad:
                param.copy_((torch.randn(param.shape, generator=gen) * std).to(param.dtype))


@contextmanager
def adapter_gathered(model):
    """Collective under ZeRO-3 (every rank enters it): the adapter parameters ZeRO-3 partitioned are whole on
    every rank inside the block, so that rank 0 can save them (:func:`save_adapter`); outside ZeRO-3 a no-op.
    A partitioned parameter outside a gather holds no elements, and a save would write empty tensors."""
    partitioned = [p for p in model.parameters() if p.requires_grad and hasattr(p, "ds_id")]
    if not partitioned:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None):
        yield


def save_adapter(model, directory: str | Path, kind: str, hidden_size: int) -> None:
    """The adapter in its saved format (PEFT for LoRA); under ZeRO-3 inside :func:`adapter_gathered`."""
    if kind == "lora":
        model.save_pretrained(str(directory), safe_serialization=True)
        _save_expert_adapters(model, Path(directory))
    else:
        save_bottleneck(model, directory, hidden_size)


def load_adapter_weights(model, directory: str | Path, kind: str) -> None:
    """Load saved adapter weights into the live model (resume)."""
    if kind == "lora":
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        file = Path(directory) / "adapter_model.safetensors"
        state = load_file(str(file))
        set_peft_model_state_dict(model, state)
        from orbitctl.model.expert_lora import load_expert_lora_tensors

        load_expert_lora_tensors(model, state, str(file))
    else:
        load_bottleneck(model, directory)


EXPERT_SIDECAR = "expert_adapter.json"
"""Beside a LoRA adapter whose routed experts have their own: ``{"format": "orbitctl-expert-lora", "version": 1,
"layout", "rank", "alpha", "first_layer"}`` (the lowest decoder layer adapted: ``adapter.last_layers``). The factors themselves are in ``adapter_model.safetensors`` under PEFT's
per-expert names, and ``adapter_config.json`` lists the expert projections (with ``rank_pattern`` and
``alpha_pattern`` for their rank), so a PEFT-format loader (vLLM's MoE LoRA) sees an ordinary per-expert LoRA."""


def _save_expert_adapters(model, directory: Path) -> None:
    from safetensors.torch import load_file, save_file

    from orbitctl.model.expert_lora import expert_layers, expert_lora_tensors

    tensors = expert_lora_tensors(model)
    if not tensors:
        return
    adapted = [(name, m.expert_lora) for name, m in expert_layers(model) if m.expert_lora is not None]
    lora = adapted[0][1]
    file = directory / "adapter_model.safetensors"
    save_file({**load_file(str(file)), **tensors}, str(file), metadata={"format": "pt"})
    config_file = directory / "adapter_config.json"
    config = json.loads(config_file.read_text())
    projections = sorted({key.split(".lora_")[0].removeprefix("base_model.model.") for key in tensors})
    config["target_modules"] = sorted(set(config.get("target_modules") or []) | set(projections))
    pattern = r"experts\.\d+\.(gate|up|down)_proj$"
    config["rank_pattern"] = {**(config.get("rank_pattern") or {}), pattern: lora.rank}
    config["alpha_pattern"] = {**(config.get("alpha_pattern") or {}), pattern: lora.alpha}
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (directory / EXPERT_SIDECAR).write_text(json.dumps(
        {"format": "orbitctl-expert-lora", "version": 1, "layout": lora.layout, "rank": lora.rank,
         "alpha": lora.alpha, "first_layer": layer_index(adapted[0][0]) or 0}, indent=2) + "\n")


def _expert_sidecar(directory: str | Path) -> dict | None:
    path = Path(directory) / EXPERT_SIDECAR
    if not path.exists():
        return None
    try:
        meta = json.loads(path.read_text())
        return {"layout": str(meta["layout"]), "rank": int(meta["rank"]), "alpha": float(meta["alpha"]),
                "first_layer": int(meta.get("first_layer", 0))}
    except (ValueError, KeyError, TypeError) as exc:
        raise InputFileError(f"{path}: not an orbitctl expert-adapter description ({exc})",
                             fix="save the adapter again with orbitctl train") from exc
