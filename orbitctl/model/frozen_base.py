"""Load the frozen quantized base written by `orbitctl quantize`, in any of its formats.

    from orbitctl.model.frozen_base import load_frozen_base, model_memory_bytes
    model = load_frozen_base("artifacts/tiny-llama-int4")   # a transformers PreTrainedModel
    model_memory_bytes(model)["total"]

- nf4 / fp4: transformers' own bitsandbytes loader (``Linear4bit``), straight from config.json.
- int4 / fp8: the model is built without weights, every quantized ``nn.Linear`` becomes a
  :class:`~orbitctl.model.quant_linear.QuantLinear` and every fused experts module a
  :class:`~orbitctl.model.quant_linear.QuantExperts`; tensors are then read one by one
  into the parameters of the same names. Dequantization is plain torch, per forward.
- none: a plain transformers model in the compute dtype.

A model with tied embeddings (``tie_word_embeddings``) keeps one matrix, the unquantized
``embed_tokens``, and its output layer is a plain ``nn.Linear`` over that same tensor in every
format: never a 4-bit layer wrapping the embedding, never a second copy.

Every parameter of the base has ``requires_grad=False``.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import torch
from torch import nn

from orbitctl.errors import InputFileError, UserError
from orbitctl.kernels.decode_attention import use_decode_attention
from orbitctl.model.mla import use_absorbed_mla
from orbitctl.rundir import read_json


def checkpoint_format(path: str | Path) -> str:
    """nf4, fp4, int4, fp8 or none, from the checkpoint's config.json."""
    from orbitctl.codec.qconfig import spec_from_quantization_config

    config_file = Path(path) / "config.json"
    qc = read_json(config_file, what="config.json",
                   fix="run orbitctl quantize first, or check model.quantized_path").get("quantization_config")
    try:
        return spec_from_quantization_config(qc).fmt
    except ValueError as exc:
        raise UserError(f"{config_file}: {exc}", fix="load checkpoints written by orbitctl quantize") from exc


def attention_kernel(flash_attention: bool) -> str:
    """transformers' ``attn_implementation`` for ``memory.flash_attention``: PyTorch SDPA (a fused kernel
    that keeps no score matrix), or the eager softmax(QK^T)V whose ``[heads, seq, seq]`` scores autograd keeps."""
    return "sdpa" if flash_attention else "eager"


def load_frozen_base(quantized_dir: str | Path, *, device: str | torch.device = "cpu",
                     compute_dtype: torch.dtype = torch.bfloat16, experts=None, attention: str = "sdpa"):
    """The frozen base model of ``quantized_dir`` on ``device``, every parameter with requires_grad=False.

    ``compute_dtype`` is the dtype the model computes in, whatever the checkpoint's config.json
    says: the unquantized weights are loaded in it and the NF4/FP4 layers dequantize to it.
    ``experts`` (an :class:`~orbitctl.model.expert_parallel.ExpertGroup`) loads only this rank's
    share of every MoE layer's routed experts, reading only their tensors (int4 and fp8 checkpoints).
    ``attention`` is the attention kernel (:func:`attention_kernel`), the same on the infer and train paths.
    MLA attention layers decode on their cached latent (:func:`~orbitctl.model.mla.use_absorbed_mla`).
    """
    from transformers import AutoModelForCausalLM

    path = Path(quantized_dir)
    fmt = checkpoint_format(path)
    if experts is not None and experts.size > 1 and fmt not in ("int4", "fp8"):
        raise UserError(f"{path}: expert parallelism loads int4 or fp8 experts, this checkpoint is {fmt}",
                        fix="set quant.format: int4 (or fp8), or memory.expert_parallel: 1")
    if fmt in ("int4", "fp8"):
        model = _load_with_quant_linear(path, torch.device(device), compute_dtype, experts, attention)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, config=_config_keeping_tied_head(path), dtype=compute_dtype,
                                                     device_map=str(device), attn_implementation=attention)
        _cast_unquantized(model, compute_dtype)
    _check_tied_head(model, path)
    for p in model.parameters():
        p.requires_grad_(False)
    for module in model.modules():
        # bitsandbytes repacks NF4/FP4 weights for its AVX512-BF16 CPU kernel at the first no-grad
        # eval forward; that kernel has no autograd (a later backward stops at the quantized layers)
        # and rounds differently from the training kernel. One kernel for every caller keeps the
        # infer path, the train path and verification on the same numbers.
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
            # dequantize to the dtype asked for, not the one config.json was written with
            module.compute_dtype, module.compute_type_is_set = compute_dtype, True
    if attention == "sdpa":  # a one-position decode query on the CPU skips the fused kernel's per-call cost
        model.config._attn_implementation = use_decode_attention()
    use_absorbed_mla(model)  # MLA decodes on its cached latent (orbitctl.model.mla); other attention is unchanged
    model.eval()
    return model


def int4_kernel(name: str, fmt: str, device_type: str) -> str:
    """``quant.kernel`` resolved where the model runs: ``fused`` or ``dequantize``. auto is fused for INT4 where this
    torch has the device's kernel (the CPU's, or CUDA's tinygemm) and its rows do not depend on the rows beside them
    (the once-per-process probe of :func:`~orbitctl.kernels.int4_kernel.rows_are_independent`); fused asked for is
    fused wherever the kernel exists."""
    from orbitctl.kernels import int4_kernel as kernels

    if fmt != "int4" or name == "dequantize" or device_type not in ("cpu", "cuda"):
        return "dequantize"
    present = kernels.cpu_kernel_present if device_type == "cpu" else kernels.cuda_kernel_present
    if name == "fused":
        if not present():
            raise UserError(f"quant.kernel: fused needs torch's {device_type.upper()} INT4 kernel, which torch "
                            f"{torch.__version__} lacks", fix="set quant.kernel: auto or dequantize")
        return "fused"
    available = kernels.cpu_kernel_available if device_type == "cpu" else kernels.cuda_kernel_available
    return "fused" if available() else "dequantize"


def use_fused_int4(model: nn.Module, *, buffers_only: bool = False) -> int:
    """Repack every INT4 layer of ``model`` the kernel takes for the fused kernel (``quant.kernel``); returns
    the bytes the packs hold. ``buffers_only``: only the layers held as buffers (an expert-parallel rank's
    experts), under ZeRO-3, which partitions the parameters after loading: a pack built from a whole
    parameter would keep on every rank what ZeRO-3 shards. A layer of a shape the kernel does not take
    keeps dequantizing. On a GPU the routed experts of a MoE layer are stacked for the grouped kernel instead
    (:func:`use_grouped_experts`, which holds no second copy) where Triton is present, else they dequantize."""
    from orbitctl.model.expert_lora import expert_layers
    from orbitctl.model.quant_linear import ExpertMLP

    grouped = use_grouped_experts(model, buffers_only=buffers_only)
    done, total = set(grouped), 0  # linears never packed alone
    for _, layer in expert_layers(model):
        for e in layer.held:
            expert = layer.expert(e)
            gate, up = expert.gate_proj, expert.up_proj
            if id(gate) in grouped:
                continue
            if next(itertools.chain(expert.parameters(), expert.buffers())).device.type != "cpu":
                done.update(id(m) for m in expert.children())  # a GPU's expert runs grouped or dequantizes:
                continue                                        # a pack each would hold it twice
            if isinstance(expert, ExpertMLP) and _packable(gate, buffers_only) and _packable(up, buffers_only):
                total += expert.use_fused_gate_up()  # a CPU expert's gate and up in one pack: one kernel call
                done.update((id(gate), id(up)))
    for module in model.modules():
        if id(module) not in done and _packable(module, buffers_only):
            total += module.use_fused_kernel()
    return total


def _packable(layer, buffers_only: bool) -> bool:
    """Whether ``use_fused_int4`` packs this layer: an INT4 ``QuantLinear`` of a shape its device's kernel takes, held
    as a buffer where ``buffers_only``."""
    from orbitctl.kernels.int4_kernel import unsupported_shape
    from orbitctl.model.quant_linear import QuantLinear

    if not isinstance(layer, QuantLinear) or layer.fmt != "int4":
        return False
    if buffers_only and "weight_packed" not in layer._buffers:
        return False
    device = layer.weight_packed.device.type
    return unsupported_shape(layer.out_features, layer.in_features, layer.group_size, device) is None


def grouped_supported(module, *, buffers_only: bool = False) -> bool:
    """Whether the grouped kernel can run the routed experts of ``module`` (a MoE layer: ``held`` and ``expert``): INT4
    experts on a CUDA device (or on the CPU under Triton's interpreter, ``TRITON_INTERPRET=1``), Triton present, and under ZeRO-3
    (``buffers_only``) experts held as buffers (expert parallelism), which ZeRO does not partition."""
    from orbitctl.kernels.grouped_int4 import runs_on
    from orbitctl.model.quant_linear import QuantLinear

    if not len(module.held):
        return False
    gate = module.expert(module.held[0]).gate_proj
    if not isinstance(gate, QuantLinear) or gate.fmt != "int4":
        return False
    if buffers_only and "weight_packed" not in gate._buffers:
        return False
    return runs_on(gate.weight_packed.device.type)


def use_grouped_experts(model: nn.Module, *, buffers_only: bool = False) -> set[int]:
    """On a CUDA device with Triton, stack every MoE layer's routed INT4 experts for the grouped kernel
    (:class:`~orbitctl.kernels.grouped_int4.ExpertStack`, attached as the layer's ``stack``); returns the ids of
    the experts' linears so stacked. A layer whose expert adapters are per expert, or whose experts ZeRO-3
    partitions (``buffers_only`` and held as parameters), keeps its per-expert loop."""
    from orbitctl.model.expert_lora import expert_layers
    from orbitctl.kernels.grouped_int4 import ExpertStack

    stacked: set[int] = set()
    for _, module in expert_layers(model):
        if not grouped_supported(module, buffers_only=buffers_only):
            continue
        module.stack = ExpertStack.of(module)
        for e in module.held:
            stacked.update(id(m) for m in module.expert(e).children())
    return stacked


def apply_int4_kernel(model: nn.Module, profile, device) -> int:
    """``profile``'s ``quant.kernel`` on ``model`` loaded onto ``device``: the INT4 layers repacked for the fused
    kernel where it resolves to fused (under ZeRO-3 only the expert-parallel experts); the packs' bytes."""
    from orbitctl.kernels.cpu_dtype import device_type

    if int4_kernel(profile.quant.kernel, profile.quant.format, device_type(device)) != "fused":
        return 0
    return use_fused_int4(model, buffers_only=profile.memory.zero_stage == 3)


def _config_keeping_tied_head(path: Path):
    """The checkpoint's config, with ``lm_head`` among bitsandbytes' skipped modules when the embeddings are tied.

    An explicit ``llm_int8_skip_modules`` replaces transformers' own default (which skips tied and output
    layers), so a tied checkpoint whose list leaves ``lm_head`` out would get a 4-bit output layer wrapping
    the bf16 embedding, and bitsandbytes fails at the first forward. orbitctl quantize writes ``lm_head``
    into the list; checkpoints written before it did are read the same way."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    qc = getattr(config, "quantization_config", None)
    if isinstance(qc, dict) and qc.get("quant_method") == "bitsandbytes" and _ties_embeddings(config):
        skip = list(qc.get("llm_int8_skip_modules") or [])
        if "lm_head" not in skip:
            config.quantization_config = {**qc, "llm_int8_skip_modules": [*skip, "lm_head"]}
    return config


def _ties_embeddings(config) -> bool:
    return bool(getattr(config.get_text_config(), "tie_word_embeddings", False))


def _check_tied_head(model: nn.Module, path: Path) -> None:
    """A tied model's output layer is a plain linear layer over the embedding tensor itself."""
    if not _ties_embeddings(model.config):
        return
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    if type(head) is not nn.Linear or head.weight is not embedding.weight:
        raise InputFileError(f"{path}: tie_word_embeddings is set but the output layer ({type(head).__name__}) is not "
                             "a plain linear layer over the embedding", fix="quantize the checkpoint again with orbitctl quantize")


def _cast_unquantized(model: nn.Module, compute_dtype: torch.dtype) -> None:
    """Half-precision weights that are not packed NF4/FP4 data into ``compute_dtype``: transformers
    keeps a pre-quantized checkpoint's unquantized weights (embeddings, norms, lm_head) in their
    stored bf16 whatever ``dtype=`` asks for. Weights kept in fp32 on purpose stay so."""
    for param in model.parameters():
        if type(param).__name__ != "Params4bit" and param.dtype in (torch.bfloat16, torch.float16) \
                and param.dtype != compute_dtype:
            param.data = param.data.to(compute_dtype)


def load_frozen_base_for_profile(profile, *, device: str | torch.device = "cpu"):
    """The frozen base a profile names: model.quantized_path (or model.path when quant.format is none)."""
    fmt = profile.quant.format
    path = profile.model.quantized_path or (profile.model.path if fmt == "none" else None)
    if not path:
        raise UserError("model.quantized_path is not set", fix="set it in the profile and run orbitctl quantize PROFILE")
    found = checkpoint_format(path)
    if found != fmt:
        raise UserError(f"{path}: holds a {found} checkpoint but quant.format is {fmt}",
                        fix="run orbitctl quantize PROFILE again, or set quant.format to match")
    from orbitctl.kernels.cpu_dtype import torch_dtype

    model = load_frozen_base(path, device=device, compute_dtype=torch_dtype(profile.quant.compute_dtype, device),
                             attention=attention_kernel(profile.memory.flash_attention))
    apply_int4_kernel(model, profile, device)
    return model


def model_memory_bytes(model: nn.Module) -> dict[str, int]:
    """True in-memory bytes: parameters and buffers as stored (packed), plus bitsandbytes quant states."""
    seen: set[int] = set()

    def size(t: torch.Tensor | None) -> int:
        if t is None or t.device.type == "meta" or t.data_ptr() in seen:
            return 0
        seen.add(t.data_ptr())
        return t.numel() * t.element_size()

    params = sum(size(p) for p in model.parameters())
    buffers = sum(size(b) for b in model.buffers())
    quant_state = 0
    for p in model.parameters():
        state = getattr(p, "quant_state", None)
        while state is not None:
            quant_state += size(getattr(state, "absmax", None)) + size(getattr(state, "code", None))
            state = getattr(state, "state2", None)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"params": params, "buffers": buffers, "quant_state": quant_state,
            "total": params + buffers + quant_state, "trainable_params": trainable}


def _load_with_quant_linear(path: Path, device: torch.device, compute_dtype: torch.dtype, experts=None,
                            attention: str = "sdpa"):
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    from orbitctl.codec.source import open_checkpoint

    ckpt = open_checkpoint(path)
    config = AutoConfig.from_pretrained(path)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=compute_dtype, attn_implementation=attention)
    tied = _ties_embeddings(config)
    # a tied checkpoint may still store lm_head (a copy of the embedding): the output layer uses embed_tokens
    shapes = {name: e.shape for name, e in ckpt.entries.items() if not (tied and name.startswith("lm_head."))}
    elsewhere = _swap_modules(model, shapes, experts)
    _load_tensors(model, ckpt, device, elsewhere, only=shapes)
    if tied:
        model.tie_weights()
    missing = [n for n, p in [*model.named_parameters(), *model.named_buffers()] if p.device.type == "meta"]
    if missing:
        raise InputFileError(f"{path}: checkpoint has no tensor for {len(missing)} parameter(s), e.g. {missing[0]}",
                             fix="the checkpoint is incomplete; run orbitctl quantize --verify on it")
    return _move_rest(model, device)


def _move_rest(model: nn.Module, device: torch.device) -> nn.Module:
    """``model`` with the tensors it made itself (rotary tables, anything no checkpoint tensor replaced) moved to
    ``device``; the loaded ones are there already and stay the same objects (tied weights stay tied)."""
    def elsewhere(t: torch.Tensor) -> bool:
        return t.device.type != device.type or (device.index is not None and t.device.index != device.index)

    for module in model.modules():
        for key, param in module._parameters.items():
            if param is not None and elsewhere(param):
                module._parameters[key] = nn.Parameter(param.to(device), requires_grad=param.requires_grad)
        for key, buffer in module._buffers.items():
            if buffer is not None and elsewhere(buffer):
                module._buffers[key] = buffer.to(device)
    return model


def _quant_linear_for(prefix: str, in_f: int, out_f: int, shapes: dict[str, tuple], *,
                      as_buffers: bool = False) -> nn.Module:
    from orbitctl.model.quant_linear import QuantLinear

    bias = f"{prefix}.bias" in shapes
    if f"{prefix}.weight_packed" in shapes:
        groups = shapes[f"{prefix}.weight_scale"][-1]
        return QuantLinear(in_f, out_f, "int4", group_size=in_f // groups, bias=bias, device="meta", as_buffers=as_buffers)
    if f"{prefix}.weight_scale_inv" in shapes:
        return QuantLinear(in_f, out_f, "fp8", bias=bias, device="meta", as_buffers=as_buffers)
    return nn.Linear(in_f, out_f, bias=bias, device="meta")


def _swap_modules(model: nn.Module, shapes: dict[str, tuple], experts=None) -> dict[str, range]:
    """Replace quantized linears and fused experts with modules shaped like the checkpoint. With an
    expert group, fused experts become this rank's share; returns {experts module name: owned range}."""
    from orbitctl.model.expert_parallel import ExpertParallelExperts
    from orbitctl.model.quant_linear import ExpertMLP, QuantExperts

    swaps: list[tuple[str, nn.Module]] = []
    owned: dict[str, range] = {}
    parallel = experts is not None and experts.size > 1
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and (f"{name}.weight_packed" in shapes or f"{name}.weight_scale_inv" in shapes):
            swaps.append((name, _quant_linear_for(name, module.in_features, module.out_features, shapes)))
        elif _is_fused_experts(module) and f"{name}.gate_up_proj" not in shapes:
            n_exp, hidden, inter = module.down_proj.shape[0], module.down_proj.shape[1], module.down_proj.shape[2]
            indices = experts.owned(n_exp) if parallel else range(n_exp)

            def expert(e: int) -> ExpertMLP:
                return ExpertMLP(*(_quant_linear_for(f"{name}.{e}.{proj}", i, o, shapes, as_buffers=parallel)
                                   for proj, i, o in (("gate_proj", hidden, inter), ("up_proj", hidden, inter),
                                                      ("down_proj", inter, hidden))))

            if parallel:
                owned[name] = indices
                swaps.append((name, ExpertParallelExperts({e: expert(e) for e in indices}, n_exp, module.act_fn, experts)))
            else:
                swaps.append((name, QuantExperts([expert(e) for e in indices], module.act_fn)))
    for name, new in swaps:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
    return owned


def _held_elsewhere(tensor_name: str, owned: dict[str, range]) -> bool:
    """True for a routed expert's tensor that another rank of the expert-parallel group holds."""
    for prefix, indices in owned.items():
        if tensor_name.startswith(prefix + "."):
            index = tensor_name[len(prefix) + 1:].split(".", 1)[0]
            return index.isdigit() and int(index) not in indices
    return False


def _is_fused_experts(module: nn.Module) -> bool:
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter) and gate_up.dim() == 3


def _load_tensors(model: nn.Module, ckpt: Any, device: torch.device, owned: dict[str, range] | None = None,
                  only: dict | None = None) -> None:
    """Read every tensor into its place, each from its own byte range; experts another rank owns, and tensors
    not in ``only`` (when given), are not read."""
    from orbitctl.codec.safetensors_io import read_tensor

    handles: dict[Path, Any] = {}
    try:
        for name, entry in ckpt.entries.items():
            if (owned and _held_elsewhere(name, owned)) or (only is not None and name not in only):
                continue
            module_name, _, attr = name.rpartition(".")
            try:
                module = model.get_submodule(module_name)
            except AttributeError:
                raise InputFileError(f"{entry.file}: tensor '{name}' has no place in a {type(model).__name__}",
                                     fix="the checkpoint does not match its config.json") from None
            handle = handles.get(entry.file) or handles.setdefault(entry.file, entry.file.open("rb"))
            tensor = read_tensor(entry, handle)
            current = getattr(module, attr, None)
            # int4 scales keep their stored dtype: a GGUF Q4_0 weight's fp16 scales are exact only in fp16
            if current is not None and current.is_floating_point() and tensor.is_floating_point() and \
                    tensor.dtype not in (torch.float8_e4m3fn,) and current.dtype != tensor.dtype and attr != "weight_scale":
                tensor = tensor.to(current.dtype)
            tensor = tensor.to(device)
            if attr in module._buffers:
                module._buffers[attr] = tensor
            else:
                setattr(module, attr, nn.Parameter(tensor, requires_grad=False))
    finally:
        for h in handles.values():
            h.close()
